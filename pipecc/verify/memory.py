"""--max-activations: the peak live activations of every rank (the rule of
`pipecc.analysis.memory`), and the ranks above the limit."""

from __future__ import annotations

from typing import NamedTuple

from pipecc.analysis.memory import peak_activations
from pipecc.diagnostics import ActivationLimitError
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
