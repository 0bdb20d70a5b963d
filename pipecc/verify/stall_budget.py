"""`--stall-budget`: waits that the comm placement causes, against a budget (docs/align.md).

With a cost model, the program is replayed with durations under each comm model it passes;
every idle gap before a compute op is split into its dependency-bound part (the schedule's
own bubble) and its placement-bound part (`pipecc.analysis.gaps`). A placement-bound part longer
than the budget is a `stall` violation naming the rank, the instruction, what it waited for
and why; the totals of both parts per rank are reported beside it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipecc.analysis.gaps import Gap, classify
from pipecc.diagnostics import InputError, StallError
from pipecc.semantics import CommModel, replay
from pipecc.semantics.costs import CostModel, CostTiming
from pipecc.verify.context import Context

_BUDGET = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(%?)\s*")


@dataclass(frozen=True, slots=True)
class StallBudget:
    """The longest placement-bound wait allowed: in time units, or a percentage of the
    makespan."""

    value: float
    percent: bool = False

    @classmethod
    def parse(cls, text: str) -> StallBudget:
        """`0`, `0.05` or `2%`."""
        match = _BUDGET.fullmatch(text)
        if match is None:
            raise InputError(
                f"--stall-budget: expected a time (0.05) or a percentage of the "
                f"makespan (2%), got {text!r}"
            )
        return cls(float(match.group(1)), bool(match.group(2)))

    def allowed(self, makespan: float) -> float:
        return self.value * makespan / 100 if self.percent else self.value

    def __str__(self) -> str:
        return f"{self.value:g}%" if self.percent else f"{self.value:g}"


@dataclass(frozen=True, slots=True)
class WaitTotals:
    """Under one comm model: the makespan, and per rank the dependency-bound and
    placement-bound idle time."""

    model: CommModel
    makespan: float
    dependency: tuple[float, ...]
    placement: tuple[float, ...]


def check_stalls(
    ctx: Context, costs: CostModel, model: CommModel, budget: StallBudget
) -> WaitTotals | None:
    """Report every placement-bound wait over `budget` under `model`; None when the program
    does not run to completion there (the deadlock check reports that). `costs` are
    converted for the program as in every command (per share of the model, docs/simulate.md)."""
    costs = costs.for_program(ctx.program)
    run = replay(
        ctx.program, model=model, timing=CostTiming(costs, ctx.program.moe), wiring=ctx.wiring
    )
    if not run.finished:
        return None
    gaps = classify(ctx.program, run, costs)
    makespan = run.makespan()
    allowed = budget.allowed(makespan)
    for rank_gaps in gaps:
        for gap in rank_gaps:
            if gap.placement > allowed + 1e-9:
                ctx.report(_violation(ctx, gap, model, budget, allowed))
    return WaitTotals(
        model,
        round(makespan, 9),
        tuple(round(sum(g.dependency for g in rank), 9) for rank in gaps),
        tuple(round(sum(g.placement for g in rank), 9) for rank in gaps),
    )


def _violation(
    ctx: Context, gap: Gap, model: CommModel, budget: StallBudget, allowed: float
) -> StallError:
    limit = f"{budget}" + (f" = {allowed:g}" if budget.percent else "")
    text = (
        f"{ctx.describe(gap.rank, gap.index)} waits {gap.placement:g} longer than its "
        f"data needs ({gap.since:g} to {gap.until:g}, of which {gap.dependency:g} "
        f"dependency-bound) under {model.value}, over the stall budget {limit}: "
        f"{gap.cause}"
    )
    return StallError(text, ctx.span(gap.rank, gap.index), rank=gap.rank, index=gap.index)
