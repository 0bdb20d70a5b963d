"""Coverage: every (pipe, stage, mb) has one F and either one B or one I and one W.

Microbatches are global (DESIGN §2): pipe p of a placement with k pipes carries
microbatches p·M/k .. (p+1)·M/k − 1. Counts live in one flat list indexed like message keys,
so a correct program is confirmed with whole-list operations.
"""

from __future__ import annotations

from pipecc.diagnostics import CoverageError
from pipecc.ir.ops import Compute, Fused, Instr, Kind, computations
from pipecc.verify.context import Context

_OK_B, _OK_IW, _NONE = (1, 1, 0, 0), (1, 0, 1, 1), (0, 0, 0, 0)
_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W


def check_coverage(ctx: Context) -> None:
    """Report every (pipe, stage, mb) whose ops are missing, duplicated or out of range."""
    counts, outside = _count(ctx)
    tuples = list(zip(counts[0::4], counts[1::4], counts[2::4], counts[3::4], strict=True))
    valid = _valid_positions(ctx)
    if valid is None:
        bad = [i for i, t in enumerate(tuples) if t != _OK_B and t != _OK_IW]
    else:
        bad = [
            i
            for i, t in enumerate(tuples)
            if ((t != _OK_B and t != _OK_IW) if valid[i] else t != _NONE)
        ]
    if bad:
        first = _first_ops(ctx)
        for i in bad:
            _report(ctx, _decode(ctx, i), _problem(tuples[i]), first)
    for rank, index, op in outside:
        program = ctx.program
        text = (
            f"{ctx.describe(rank, index)} names pipe {op.pipe} stage {op.stage} mb "
            f"{op.mb}, which this program (P={program.num_ranks}, "
            f"M={program.num_microbatches}, placement '{program.placement.name}') does "
            "not have"
        )
        ctx.report(CoverageError(text, ctx.span(rank, index), rank=rank, index=index))


def _parts(instr: Instr) -> tuple[Compute, ...]:
    return computations(instr)


def _count(ctx: Context) -> tuple[list[int], list[tuple[int, int, Compute]]]:
    """Counts of (F, B, I, W) per (pipe, stage, mb) position, and the ops outside the grid."""
    keys, w = ctx.keys, ctx.wiring
    pipes, stages, slot = keys.pipes, keys.stages, keys.slot
    microbatches = ctx.program.num_microbatches
    counts = [0] * (microbatches * pipes * keys.stride * 4)
    outside: list[tuple[int, int, Compute]] = []
    for rank, instrs in enumerate(ctx.program.ranks):
        base = w.offsets[rank]
        for g in w.computes[rank]:
            for op in _parts(instrs[g - base]):
                kind, _, pipe, stage, mb, _ = op
                if not (0 <= pipe < pipes and 0 <= stage < stages[pipe] and 0 <= mb < microbatches):
                    outside.append((rank, g - base, op))
                    continue
                k = 0 if kind is _F else 1 if kind is _B else 2 if kind is _I else 3
                counts[(slot(pipe, stage, mb) << 2) | k] += 1
    return counts, outside


def _valid_positions(ctx: Context) -> list[bool] | None:
    """Which positions name a real (pipe, stage, mb), or None when all of them do."""
    keys, placement = ctx.keys, ctx.program.placement
    microbatches = ctx.program.num_microbatches
    if keys.pipes == 1 and keys.stages[0] == keys.stride:
        return None
    valid = [False] * (microbatches * keys.pipes * keys.stride)
    for pipe in range(keys.pipes):
        for mb in placement.microbatches(pipe, microbatches):
            start = keys.slot(pipe, 0, mb)
            valid[start : start + keys.stages[pipe]] = [True] * keys.stages[pipe]
    return valid


def _decode(ctx: Context, position: int) -> tuple[int, int, int]:
    return ctx.keys.place(position)


def _first_ops(ctx: Context) -> dict[tuple[int, int, int], tuple[int, int]]:
    first: dict[tuple[int, int, int], tuple[int, int]] = {}
    for rank, instrs in enumerate(ctx.program.ranks):
        for index, instr in enumerate(instrs):
            if type(instr) is not Compute and type(instr) is not Fused:
                continue
            for op in _parts(instr):
                first.setdefault((op.pipe, op.stage, op.mb), (rank, index))
    return first


def _problem(got: tuple[int, ...]) -> str:
    """What is wrong with counts (F, B, I, W) of one (pipe, stage, mb)."""
    f, b, i, w = got
    if b == 0 and i == 0 and w == 0 and f == 0:
        return "no ops at all (no F, no backward)"
    parts = []
    if f != 1:
        parts.append("no F" if f == 0 else f"{f} F")
    if b and (i or w):
        parts.append(f"both B and I/W ({b} B, {i} I, {w} W)")
    elif b > 1:
        parts.append(f"{b} B")
    elif b == 0 and (i, w) != (1, 1):
        parts.append(
            "no backward (B, or I and W)" if i == w == 0 else f"{i} I and {w} W (expected one each)"
        )
    return ", ".join(parts)


def _report(
    ctx: Context,
    key: tuple[int, int, int],
    problem: str,
    first: dict[tuple[int, int, int], tuple[int, int]],
) -> None:
    pipe, stage, mb = key
    pipe_text = f"pipe {pipe} " if ctx.program.placement.num_pipes > 1 else ""
    valid = mb in ctx.program.placement.microbatches(pipe, ctx.program.num_microbatches)
    text = (
        f"{pipe_text}stage {stage} mb {mb} has {problem}"
        if valid
        else f"{pipe_text}stage {stage} mb {mb}: microbatch {mb} does not flow through pipe "
        f"{pipe}, yet it has ops there"
    )
    where = first.get(key)
    if where is None:
        ctx.report(CoverageError(text))
        return
    rank, index = where
    ctx.report(CoverageError(text, ctx.span(rank, index), rank=rank, index=index))
