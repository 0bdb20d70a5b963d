"""MoE phases: an op split into phases is that op only with all its phases, in order.

A MoE stage's F, B or I runs as its phases (`ir.ops.phases`, `passes/expand_moe.py`): a
forward pre0, experts0, ..., post, a backward the reverse. The other checks count the op at
its last phase (coverage, a send after it), take its input at its first (dataflow) and
place every phase on the op's rank; this one reports an op whose phases on a rank are not
exactly that sequence (one missing, repeated, out of order, or of a layer the stage does
not have), as a coverage violation: the op is not covered as a whole.
"""

from __future__ import annotations

from pipecc.diagnostics import CoverageError
from pipecc.ir.ops import Compute, Phase, phases
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
