"""Per-rank op streams: what the front end hands to the passes (DESIGN §1).

A stream lists, for one rank, the ops in the order the schedule wrote them, with chunk and
microbatch left open where the DSL leaves them to the compiler (`W` without a chunk, ops
without an explicit microbatch), any hand-placed comm ops, and the bounds of `fill` blocks.
`passes.fill_idle` resolves the fills; `passes.assign_microbatches` turns streams into a
compute-only `Program`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pipecc.diagnostics import Span
from pipecc.ir.ops import Kind, Msg
from pipecc.ir.placement import Placement


class OpSpec(NamedTuple):
    """One computation as the schedule wrote it.

    `chunk` is None only for a plain `W` (the rank's oldest pending I); `mb` is None when the
    compiler assigns the next microbatch of the op's counter.
    """

    kind: Kind
    chunk: int | None
    mb: int | None
    span: Span | None = None


class FusedSpec(NamedTuple):
    """`F0&B1`: a forward overlapped with a backward, one instruction."""

    forward: OpSpec
    backward: OpSpec
    span: Span | None = None


class CommSpec(NamedTuple):
    """A hand-placed `send`/`recv` of an activation or gradient; `group` ties posts together."""

    send: bool
    what: Msg
    group: int | None
    span: Span | None = None


class WaitSpec(NamedTuple):
    """A hand-placed `wait`: completes every hand-placed op posted before it and not waited."""

    span: Span | None = None


class FillSpec(NamedTuple):
    """The start of a `fill` block: until its `FillEndSpec`, the rank's idle slots in the
    unit-cost timing run a later op of `kinds` (F, B, I) that is ready, or its oldest pending W;
    with `cap`, a forward that would hold more activations first runs pending Ws
    (`passes.fill_idle` resolves it; docs/dsl.md 4.7)."""

    kinds: frozenset[Kind]
    cap: int | None
    span: Span | None = None


class FillEndSpec(NamedTuple):
    """The end of a `fill` block: every W it left pending runs here."""

    span: Span | None = None


StreamItem = OpSpec | FusedSpec | CommSpec | WaitSpec | FillSpec | FillEndSpec


@dataclass(frozen=True, slots=True)
class Streams:
    """The expanded schedule for one (P, M): placement, parameters and one stream per rank.

    `generated_microbatches` ≥ `num_microbatches`: the count the schedule was generated for
    (`pad microbatches to N`); ops on microbatches ≥ M are dropped when microbatches are
    assigned.
    """

    schedule: str
    source: str
    num_ranks: int
    num_microbatches: int
    generated_microbatches: int
    params: tuple[tuple[str, int], ...]
    placement: Placement
    ranks: tuple[tuple[StreamItem, ...], ...]
    recompute: tuple[int, ...] = ()  # stages recomputed in full (`recompute stage ...`)
