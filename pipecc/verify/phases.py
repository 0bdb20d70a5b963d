"""MoE phases: an op split into phases is that op only with all its phases, in order.

A MoE stage's F, B or I runs as its phases (`ir.ops.phases`, `passes/expand_moe.py`): a
forward pre0, experts0, ..., post, a backward the reverse. The other checks count the op at
its last phase (coverage, a send after it), take its input at its first (dataflow) and
place every phase on the op's rank; this one reports an op whose phases on a rank are not
exactly that sequence (one missing, repeated, out of order, or of a layer the stage does
not have), as a coverage violation: the op is not covered as a whole. Between each two of
its phases the op's own all-to-all must be posted (its `what` naming the layer, the
direction and the op's microbatch in its pipeline) and, posted `async`, be listed by a wait
before the next phase, which consumes its tokens: otherwise the experts would run on tokens
that never arrived, in every member alike (which the collectives' matching cannot see).
"""

from __future__ import annotations

from typing import cast

from pipecc.diagnostics import CoverageError
from pipecc.ir.ops import (
    Collective,
    CollectiveKind,
    Compute,
    Instr,
    Phase,
    Wait,
    all_to_all_what,
    phases,
)
from pipecc.verify.context import Context


def check_phases(ctx: Context) -> None:
    """Report each op whose phases on a rank are not its whole sequence, in order."""
    moe = ctx.program.moe
    for rank, instrs in enumerate(ctx.program.ranks):
        found: dict[Compute, list[tuple[int, Phase]]] = {}
        for index, instr in enumerate(instrs):
            if type(instr) is Phase:
                found.setdefault(instr.op, []).append((index, instr))
        for op, seen in found.items():
            layers = _layers(moe, op, seen)
            expected = phases(op, layers)
            if tuple(p for _, p in seen) != expected:
                _report(ctx, rank, seen, expected, layers)
            else:
                _check_all_to_alls(ctx, rank, seen, layers)


def _local(ctx: Context, op: Compute) -> Compute:
    """`op` as its pipeline names it (the all-to-alls' `what`): on the whole mesh, the
    microbatch within its pipeline's share."""
    program = ctx.program
    if not program.is_whole_mesh or program.mesh is None:
        return op
    return op._replace(mb=op.mb % (program.num_microbatches // program.mesh.pipelines))


def _check_all_to_alls(ctx: Context, rank: int, seen: list[tuple[int, Phase]], layers: int) -> None:
    """Between phases j and j + 1 of one op: its j-th all-to-all, complete before j + 1."""
    instrs = ctx.program.ranks[rank]
    op = _local(ctx, seen[0][1].op)
    for j in range(len(seen) - 1):
        (start, before), (end, after) = seen[j], seen[j + 1]
        what = all_to_all_what(op, layers, j)
        at = next(
            (i for i in range(start + 1, end) if _is_a2a(instrs[i], what)),
            None,
        )
        waited = at is not None and (
            not cast(Collective, instrs[at]).asynchronous
            or any(type(x) is Wait and at in x.ops for x in instrs[at + 1 : end])
        )
        if not waited:
            how = "no such all-to-all" if at is None else f"@{at} is not waited before it"
            text = (
                f"rank {rank}: {after.label()} @{end} needs the all-to-all {what!r} after "
                f"{before.label()} @{start}, completed before it: {how}"
            )
            ctx.report(CoverageError(text, ctx.span(rank, end), rank=rank, index=end))
            return


def _is_a2a(instr: Instr, what: str) -> bool:
    return (
        type(instr) is Collective and instr.kind is CollectiveKind.ALL_TO_ALL and instr.what == what
    )


def _layers(moe: tuple[int, ...] | None, op: Compute, seen: list[tuple[int, Phase]]) -> int:
    """The stage's MoE layers: the program's `moe`, else as many as experts phases seen."""
    if moe is not None and 0 <= op.stage < len(moe):
        return moe[op.stage]
    return sum(1 for _, p in seen if p.part.value == "experts")


def _report(
    ctx: Context,
    rank: int,
    seen: list[tuple[int, Phase]],
    expected: tuple[Phase, ...],
    layers: int,
) -> None:
    index, first = seen[0]
    got = ", ".join(f"{p.label()} @{i}" for i, p in seen)
    want = ", ".join(p.label() for p in expected) or "none (it is not split)"
    text = (
        f"rank {rank}: {first.op.label()} (stage {first.op.stage} mb {first.op.mb}) runs the "
        f"phases {got}; a stage of {layers} MoE layer{'' if layers == 1 else 's'} runs "
        f"{want}, each once and in this "
        "order, so the op is not covered as a whole"
    )
    ctx.report(CoverageError(text, ctx.span(rank, index), rank=rank, index=index))
