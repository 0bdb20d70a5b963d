"""--max-activations: the peak live activations of every rank (the rule of
`pipecc.analysis.memory`), and the ranks above the limit; --memory-budget: the same rule in
bytes, and the ranks whose predicted peak is above the budget."""

from __future__ import annotations

from typing import NamedTuple

from pipecc.analysis.memory import (
    BytePeak,
    format_bytes,
    peak_activations,
    peak_bytes,
    stage_bytes,
)
from pipecc.diagnostics import ActivationLimitError, MemoryBudgetError
from pipecc.semantics.costs import CostModel
from pipecc.verify.context import Context


class Peak(NamedTuple):
    """The largest number of live activation units on `rank`, first reached at `index`
    (-1 for a rank without computations)."""

    rank: int
    peak: int
    index: int  # type: ignore[assignment]  # shadows tuple.index by design: read by name


def peaks(ctx: Context) -> tuple[Peak, ...]:
    """The peak of every rank."""
    return tuple(
        Peak(rank, *peak_activations(instrs)) for rank, instrs in enumerate(ctx.program.ranks)
    )


def check_memory(ctx: Context, found: tuple[Peak, ...], limit: int) -> None:
    """Report every rank whose peak exceeds `limit` units."""
    for rank, peak, index in found:
        if peak > limit:
            text = (
                f"rank {rank} holds {peak} activation units at its peak (@{index}, "
                f"{ctx.what(ctx.instr(rank, index))}), above --max-activations {limit}"
            )
            ctx.report(ActivationLimitError(text, ctx.span(rank, index), rank=rank, index=index))


def byte_peaks(ctx: Context, costs: CostModel) -> tuple[BytePeak, ...]:
    """The predicted peak in bytes of every rank, with `costs` converted for the program."""
    program = ctx.program
    model = costs.for_program(program)
    return tuple(
        peak_bytes(program, rank, lambda stage: stage_bytes(model, stage))
        for rank in range(program.num_ranks)
    )


def check_budget(ctx: Context, found: tuple[BytePeak, ...], budget: float) -> None:
    """Report every rank whose predicted peak exceeds `budget` bytes, at the instruction
    where it first does, with what the peak is made of."""
    for rank, (peak, index, breakdown) in enumerate(found):
        if peak <= budget:
            continue
        parts = ", ".join(
            f"{name} {format_bytes(value)}" for name, value in breakdown.to_json().items() if value
        )
        where = f"@{index}, {ctx.what(ctx.instr(rank, index))}" if index >= 0 else "from the start"
        text = (
            f"rank {rank} needs {format_bytes(peak)} at its predicted peak ({where}: {parts}), "
            f"above --memory-budget {format_bytes(budget)}"
        )
        span = ctx.span(rank, index) if index >= 0 else None
        ctx.report(MemoryBudgetError(text, span, rank=rank, index=max(index, 0)))
