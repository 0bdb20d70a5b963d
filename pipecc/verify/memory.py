"""Peak live activations per rank, in the units of DESIGN §2.

One unit is one stage's activations for one microbatch: F allocates 1; B frees 1; I frees 0
(what W needs stays); W frees 1; a fused op allocates its forward before its backward frees.
With these units the peaks are P for 1F1B and ZB-H1 and 2P-1 for ZB-H2, on rank 0.
"""

from __future__ import annotations

from typing import NamedTuple, cast

from pipecc.diagnostics import ActivationLimitError
from pipecc.ir.ops import Compute, Fused, Kind
from pipecc.verify.context import Context

DELTA = {Kind.F: 1, Kind.B: -1, Kind.I: 0, Kind.W: -1}
_F, _I = Kind.F, Kind.I


class Peak(NamedTuple):
    """The largest number of live activation units on `rank`, first reached at `index`
    (-1 for a rank without computations)."""

    rank: int
    peak: int
    index: int  # type: ignore[assignment]  # shadows tuple.index by design: read by name


def peaks(ctx: Context) -> tuple[Peak, ...]:
    """The peak of every rank."""
    w = ctx.wiring
    found = []
    for rank, instrs in enumerate(ctx.program.ranks):
        base = w.offsets[rank]
        live, top, at = 0, 0, -1
        for g in w.computes[rank]:
            instr = instrs[g - base]
            if type(instr) is Fused:
                live += _delta(instr.forward.kind)
                if live > top:  # the forward allocates before the backward frees
                    top, at = live, g - base
                live += _delta(instr.backward.kind)
                continue
            live += _delta(cast(Compute, instr).kind)
            if live > top:
                top, at = live, g - base
        found.append(Peak(rank, top, at))
    return tuple(found)


def _delta(kind: Kind) -> int:
    # identity tests: hashing an enum member for a dict lookup is a Python-level call
    return 1 if kind is _F else 0 if kind is _I else -1


def check_memory(ctx: Context, found: tuple[Peak, ...], limit: int) -> None:
    """Report every rank whose peak exceeds `limit` units."""
    for rank, peak, index in found:
        if peak > limit:
            text = (
                f"rank {rank} holds {peak} activation units at its peak (@{index}, "
                f"{ctx.what(ctx.instr(rank, index))}), above --max-activations {limit}"
            )
            ctx.report(ActivationLimitError(text, ctx.span(rank, index), rank=rank, index=index))
