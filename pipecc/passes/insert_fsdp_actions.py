"""Place FSDP's stage actions in a program: UNSHARD, RESHARD and REDUCE_GRAD per stage.

A stage whose parameters are sharded (FSDP2's `fully_shard` over the mesh's dp_shard
dimension) must be gathered (UNSHARD: an all_gather) before it computes and may be freed
(RESHARD) after; its gradients are reduce-scattered once per step (REDUCE_GRAD), after its
last weight-gradient computation, with gradient sync off for every earlier backward, as
torch's pipeline schedule runs them (docs/parallelism.md).

Placement, per rank, walking its computations in order:

- before a computation, every stage it computes on is unsharded (required), then the stages
  of the next `prefetch` computations are fetched ahead while the residency allows
  (lookahead), each with an UNSHARD placed before the Recv/Wait run that precedes the
  computation, so the gather overlaps the receive;
- residency (`max_active_stages`, as torch's knob): at most K stages of the rank unsharded
  at once; fetching another evicts (RESHARD) the one whose next use is farthest (Belady's
  rule, optimal for the number of gathers), and a prefetch never evicts a stage needed
  sooner than the one it fetches; None: no bound (each stage gathered once per step);
- after a computation: REDUCE_GRAD of each stage whose last B or W it is, then RESHARD of
  each stage it was the last use of.

The memory effect: at most K stages' full parameters live on the rank at once, against
every held stage's with no bound; a smaller K trades memory for gathers (`Plan.gathers`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipecc.diagnostics import InputError
from pipecc.ir.ops import (
    Instr,
    Kind,
    Recv,
    StageAction,
    StageOp,
    Wait,
    computations,
    is_compute,
)
from pipecc.ir.placement import Placement
from pipecc.ir.program import Program
from pipecc.passes.splice import splice

INFINITY = 1 << 62


@dataclass(frozen=True, slots=True)
class FsdpPolicy:
    """`--max-active-stages K` (None: no bound) and `--prefetch N` (computations ahead)."""

    max_active_stages: int | None = None
    prefetch: int = 1


DEFAULT_POLICY = FsdpPolicy()


def insert_fsdp_actions(prog: Program, *, policy: FsdpPolicy = DEFAULT_POLICY) -> Program:
    """UNSHARD, RESHARD and REDUCE_GRAD of every stage of every rank (module docstring).

    Requires: a program whose computations lie on the ranks and chunks of its placement;
    `policy.max_active_stages` ≥ the most stages one instruction computes on (InputError
    otherwise, naming it).
    Ensures: the stage actions the program held are replaced; on each rank each stage's
    UNSHARD and RESHARD alternate, starting with UNSHARD and ending with RESHARD, every
    computation lies inside a pair, at most K stages are unsharded at any point, and each
    stage with a B or W has exactly one REDUCE_GRAD, after its last; every Wait keeps its ops.
    """
    if policy.max_active_stages is not None and policy.max_active_stages < 1:
        raise InputError(f"--max-active-stages must be ≥ 1, got {policy.max_active_stages}")
    if policy.prefetch < 0:
        raise InputError(f"--prefetch must be ≥ 0, got {policy.prefetch}")
    ranks = tuple(
        _rank(prog.placement, rank, instrs, policy) for rank, instrs in enumerate(prog.ranks)
    )
    return replace(prog, ranks=ranks)


def _rank(
    placement: Placement, rank: int, instrs: Sequence[Instr], policy: FsdpPolicy
) -> tuple[Instr, ...]:
    bare = splice(instrs, drop=lambda x: type(x) is StageOp)
    uses = [(i, _chunks(x)) for i, x in enumerate(bare) if is_compute(x)]
    plan = _Plan(rank, [chunks for _, chunks in uses], policy)
    before: dict[int, list[Instr]] = {}
    after: dict[int, list[Instr]] = {}
    last_grad = _last_grads(bare)
    for k, (i, chunks) in enumerate(uses):
        evicted, fetched = plan.step(k, chunks, i)
        ops = [_op(placement, rank, c, StageAction.RESHARD) for c in evicted]
        ops += [_op(placement, rank, c, StageAction.UNSHARD) for c in fetched]
        if ops:
            before.setdefault(_head(bare, i), []).extend(ops)
        done = [c for c in chunks if last_grad.get(c) == i]
        ends = plan.release(k)
        after[i] = [_op(placement, rank, c, StageAction.REDUCE_GRAD) for c in done]
        after[i] += [_op(placement, rank, c, StageAction.RESHARD) for c in ends]
    return splice(bare, before=before, after=after)


def _chunks(instr: Instr) -> tuple[int, ...]:
    """The chunks an instruction computes on, each once, in order."""
    return tuple(dict.fromkeys(op.chunk for op in computations(instr)))


def _last_grads(instrs: Sequence[Instr]) -> dict[int, int]:
    """Each chunk's last instruction holding one of its B or W (its weight gradients)."""
    found: dict[int, int] = {}
    for i, instr in enumerate(instrs):
        for op in computations(instr):
            if op.kind is Kind.B or op.kind is Kind.W:
                found[op.chunk] = i
    return found


def _head(instrs: Sequence[Instr], i: int) -> int:
    """The start of the run of Recv and Wait instructions just before computation i."""
    while i > 0 and type(instrs[i - 1]) in (Recv, Wait):
        i -= 1
    return i


def _op(placement: Placement, rank: int, chunk: int, kind: StageAction) -> StageOp:
    slot = placement.slot(rank, chunk)
    return StageOp(kind, chunk, slot.pipe, slot.stage)


class _Plan:
    """The residency of one rank's chunks as its computations run (module docstring)."""

    def __init__(self, rank: int, uses: list[tuple[int, ...]], policy: FsdpPolicy) -> None:
        self.rank = rank
        self.uses = uses
        self.limit = policy.max_active_stages
        self.prefetch = policy.prefetch
        self.active: list[int] = []
        self.at: dict[int, list[int]] = {}  # chunk -> the computations using it, in order
        for k, chunks in enumerate(uses):
            for c in chunks:
                self.at.setdefault(c, []).append(k)

    def next_use(self, chunk: int, k: int) -> int:
        """The first computation at or after k that uses `chunk` (INFINITY if none)."""
        found = self.at.get(chunk, [])
        j = bisect_left(found, k)
        return found[j] if j < len(found) else INFINITY

    def step(self, k: int, chunks: tuple[int, ...], index: int) -> tuple[list[int], list[int]]:
        """Before computation k: the chunks to evict and to fetch (required, then ahead)."""
        if self.limit is not None and len(chunks) > self.limit:
            raise InputError(
                f"--max-active-stages {self.limit}: rank {self.rank} @{index} computes on "
                f"{len(chunks)} stages at once, so at least {len(chunks)} must be unsharded"
            )
        evicted: list[int] = []
        fetched: list[int] = []
        for c in chunks:
            self._fetch(c, k, chunks, (evicted, fetched), required=True)
        ahead = [c for later in self.uses[k + 1 : k + 1 + self.prefetch] for c in later]
        for c in dict.fromkeys(ahead):
            if not self._fetch(c, k, chunks, (evicted, fetched), required=False):
                break
        return evicted, fetched

    def _fetch(
        self,
        chunk: int,
        k: int,
        now: tuple[int, ...],
        out: tuple[list[int], list[int]],
        *,
        required: bool,
    ) -> bool:
        if chunk in self.active:
            return True
        if self.limit is not None and len(self.active) >= self.limit:
            victims = [a for a in self.active if a not in now]
            if not victims:  # only a prefetch gets here: the residency holds `now` alone
                return False
            victim = max(victims, key=lambda a: self.next_use(a, k))
            if not required and self.next_use(victim, k) <= self.next_use(chunk, k):
                return False
            self.active.remove(victim)
            out[0].append(victim)
        self.active.append(chunk)
        out[1].append(chunk)
        return True

    def release(self, k: int) -> list[int]:
        """After computation k: the active chunks no later computation uses (resharded)."""
        ends = [c for c in self.active if self.next_use(c, k + 1) == INFINITY]
        self.active = [c for c in self.active if c not in ends]
        return ends
