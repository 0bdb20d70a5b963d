"""Place the data-parallel gradient all_reduce of every stage: one async collective each.

With a replicate dimension in the mesh (`dp_replicate`, torchtitan's DDP replicas), every
pipeline computes the gradients of its own share of the batch, and each stage's gradients
are summed over the replicas before the optimizer step. The compiler places that sum as an
instruction, as Megatron-LM's overlapped gradient reduction issues it: right after the
stage's last gradient op on its rank (its last B or W, or its REDUCE_GRAD when FSDP reduces
it first; after the sends posted just after it, so the gradient the upstream rank waits for
does not queue behind the reduction), asynchronous, so it overlaps the rest of the
cooldown, and completed by one Wait before the step ends (before the gradient sums of
shared parameters, which read the same gradients).

In a pipeline's program the collective names its own pipeline rank and the mesh dimension
(`ranks=[r]`, `dims=["dp_replicate"]`): every pipeline runs the same list, and on the
whole mesh it is an all_reduce over the ranks that hold the same stage in every replica
(`passes/expand_mesh.py`).

With expert parallelism (`ep` among the reduced dims) an EP rank is a data-parallel replica
for the dense parameters only: a stage with MoE layers gets two reductions, its dense
parameters' over all the dims (`dp-grad dense s3`) and its experts' over the dims other
than `ep` (`dp-grad experts s3`, none when `ep` is the only one: each expert lives on one
EP rank); a stage without MoE layers is all dense and keeps its one `dp-grad s3`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipecc.ir.ops import (
    Collective,
    CollectiveKind,
    Instr,
    Kind,
    Recv,
    Send,
    StageAction,
    StageOp,
    Wait,
    computations,
)
from pipecc.ir.placement import Placement
from pipecc.ir.program import Program
from pipecc.passes.splice import positions, splice

WHAT = "dp-grad"  # the `what` of a data-parallel reduction: "dp-grad s3"
DIM = "dp_replicate"
EP = "ep"


def insert_dp_reduction(
    prog: Program,
    *,
    shards: int = 1,
    dims: tuple[str, ...] = (DIM,),
    moe: tuple[int, ...] | None = None,
) -> Program:
    """One async all_reduce per stage of each rank over the replicas, and its Wait.

    Requires: a program with its comm ops placed; `shards` is the mesh's dp_shard when the
    stages are FSDP-sharded (the reduction then carries 1/shards of the gradients), else 1.
    Ensures: the data-parallel reductions the program held (and Waits left empty) are
    replaced; each stage with a B or W on its rank gets one
    `Collective(all_reduce, (rank,), "dp-grad s<stage>", async, dims=("dp_replicate",))`
    just after its last B, W or REDUCE_GRAD and the sends, receives and stage actions that
    directly follow it, in stage order where several end together, and
    one Wait listing them all sits at the end of the rank's list, before any trailing
    blocking collectives; every other Wait keeps its ops. `dims`: the dimensions reduced
    over (`ep` among them: the module docstring's split, by `moe`, the MoE layers per stage).
    """
    ranks = tuple(
        _rank(prog.placement, rank, instrs, _Reduce(shards, dims, moe))
        for rank, instrs in enumerate(prog.ranks)
    )
    return replace(prog, ranks=ranks)


class _Reduce:
    """What one stage's reductions are: over which dims, with which `what`."""

    def __init__(self, shards: int, dims: tuple[str, ...], moe: tuple[int, ...] | None) -> None:
        self.shards = shards
        self.dims = dims
        self.moe = moe or ()

    def collectives(self, rank: int, stage: int) -> list[Collective]:
        experts = EP in self.dims and stage < len(self.moe) and self.moe[stage] > 0
        if not experts:
            return [self._op(rank, f"{WHAT} s{stage}", self.dims, stage)]
        found = [self._op(rank, f"{WHAT} dense s{stage}", self.dims, stage)]
        others = tuple(d for d in self.dims if d != EP)
        if others:
            found.append(self._op(rank, f"{WHAT} experts s{stage}", others, stage))
        return found

    def _op(self, rank: int, what: str, dims: tuple[str, ...], stage: int) -> Collective:
        kind = CollectiveKind.ALL_REDUCE
        return Collective(kind, (rank,), what, True, dims, (stage,), self.shards)


def is_dp_reduction(instr: Instr) -> bool:
    """A collective this pass placed."""
    return type(instr) is Collective and instr.what.startswith(f"{WHAT} ")


def _rank(
    placement: Placement, rank: int, instrs: Sequence[Instr], reduce: _Reduce
) -> tuple[Instr, ...]:
    bare = splice(instrs, drop=is_dp_reduction)
    ends = {chunk: _past_posts(bare, i) for chunk, i in _last_grad_ops(bare).items()}
    after: dict[int, list[Instr]] = {}
    made: list[Instr] = []
    for chunk, i in sorted(
        ends.items(), key=lambda item: (item[1], _stage(placement, rank, item[0]))
    ):
        ops = reduce.collectives(rank, _stage(placement, rank, chunk))
        after.setdefault(i, []).extend(ops)
        made.extend(ops)
    if not made:
        return bare
    placed = splice(bare, after=after)
    tail = _tail(placed)
    wait = Wait(positions(placed, made))
    return (*placed[:tail], wait, *placed[tail:])


def _stage(placement: Placement, rank: int, chunk: int) -> int:
    return placement.slot(rank, chunk).stage


def _last_grad_ops(instrs: Sequence[Instr]) -> dict[int, int]:
    """Each chunk's last B, W or REDUCE_GRAD (the last op writing its gradients)."""
    found: dict[int, int] = {}
    for i, instr in enumerate(instrs):
        if type(instr) is StageOp and instr.kind is StageAction.REDUCE_GRAD:
            found[instr.chunk] = i
        for op in computations(instr):
            if op.kind is Kind.B or op.kind is Kind.W:
                found[op.chunk] = i
    return found


def _past_posts(instrs: Sequence[Instr], i: int) -> int:
    """Instruction i, or the last of the sends, receives and stage actions just after it:
    posting them never blocks, and a send there carries the gradient the upstream rank waits
    for, which must not queue behind the reduction (nor behind FSDP's reduce_scatter that
    the reduction waits for)."""
    while i + 1 < len(instrs) and type(instrs[i + 1]) in (Send, Recv, StageOp):
        i += 1
    return i


def _tail(instrs: Sequence[Instr]) -> int:
    """The start of the run of blocking collectives that ends the list (gradient sums)."""
    i = len(instrs)
    while i > 0 and _is_blocking_collective(instrs[i - 1]):
        i -= 1
    return i


def _is_blocking_collective(instr: Instr) -> bool:
    return isinstance(instr, Collective) and not instr.asynchronous
