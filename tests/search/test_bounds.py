"""The lower bound: never above the optimum (brute force) nor any bundled schedule's value."""

from __future__ import annotations

import math
import random

import pytest
from brute_force import CASES, Case, case_optimum, optimum

from pipecc.search.baseline import bundled_orders
from pipecc.search.bounds import bound_parts, lower_bound
from pipecc.search.problem import SHAPES, Objective, Problem, evaluate
from pipecc.semantics.costs import parse_cost_flag

_TOL = 1e-9


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bound_is_at_most_the_optimum(case: Case) -> None:
    best = case_optimum(case)
    assert lower_bound(case.problem()) <= best.value + _TOL


def test_bound_is_tight_where_the_chain_or_the_cap_decides() -> None:
    """The bound reaches the optimum on cases where one of its parts is exact (so a bound
    weakened to the busy time alone fails here)."""
    tight = [case for case in CASES if case.objective is Objective.MAKESPAN and case.cap <= 2]
    for case in tight:
        if case.placement == "loop" and case.last_share == 1:
            assert lower_bound(case.problem()) == pytest.approx(case_optimum(case).value)


COSTS = ("F=1,I=1,W=1,comm=1", "F=1,I=1.5,W=0.5,comm=0.5", "F=5.478,I=5.806,W=3.534,comm=0.2")


@pytest.mark.parametrize("objective", list(Objective), ids=lambda o: o.value)
@pytest.mark.parametrize("cost", COSTS)
@pytest.mark.parametrize(("ranks", "mbs"), [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_bound_is_at_most_every_bundled_schedule(
    ranks: int, mbs: int, cost: str, objective: Objective
) -> None:
    """At the schedule's own peak as the cap, and with no binding cap."""
    checked = 0
    for placement in SHAPES:
        loose = _problem(cost, ranks, mbs, placement, math.inf, objective)
        for entry in bundled_orders(loose):
            evaluation = evaluate(loose, entry.order)
            assert evaluation is not None
            value = evaluation.score(objective)
            assert lower_bound(loose) <= value + _TOL, entry.name
            tight = _problem(cost, ranks, mbs, placement, max(evaluation.peak), objective)
            assert lower_bound(tight) <= value + _TOL, entry.name
            checked += 1
    assert checked >= 2


def test_bound_parts_on_the_issue_examples() -> None:
    """P=4, M=8, F=I=W=1, comm=1 at a cap of P/2 activations: the optimum is 63 (an exact
    solver's), all of it from the memory edges; at P=8, M=16 and 1F1B's memory, 83."""
    tight = _problem("F=1,I=1,W=1,comm=1", 4, 8, "loop", 2, Objective.MAKESPAN)
    parts = bound_parts(tight)
    assert parts.busy == 24 and parts.machine == 63 and parts.value == 63
    one_f_one_b = _problem("F=1,I=1,W=1,comm=1", 8, 16, "loop", 8, Objective.MAKESPAN)
    assert lower_bound(one_f_one_b) == 83


def test_cap_below_one_forward_is_infeasible() -> None:
    problem = _problem("F=1,I=1,W=1,comm=0", 2, 2, "loop", 0.5, Objective.MAKESPAN)
    assert lower_bound(problem) == math.inf


def _problem(
    cost: str, ranks: int, mbs: int, placement: str, cap: float, objective: Objective
) -> Problem:
    return Problem.from_costs(
        parse_cost_flag(cost),
        ranks=ranks,
        microbatches=mbs,
        placement=placement,
        cap=cap,
        objective=objective,
    )


def _random_problem(seed: int) -> Problem:
    """Per-stage durations drawn independently, a random latency, cap and objective."""
    rng = random.Random(seed)
    placement = "loop" if seed % 4 else "vshape"
    stages = 2 if placement == "loop" else 4
    scale = 1.0 if placement == "loop" else 0.5

    def draw() -> tuple[float, ...]:
        return tuple(round(rng.uniform(0.5, 2.0), 2) for _ in range(stages))

    caps = (1, 1.5, 2, 3) if placement == "loop" else (1, 1.5)
    return Problem(
        ranks=2,
        microbatches=3 if placement == "loop" else 2,
        placement=placement,
        f=draw(),
        i=draw(),
        w=draw(),
        comm=round(rng.uniform(0.0, 1.0), 2),
        mem_f=(scale,) * stages,
        mem_i=(0.0,) * stages,
        mem_w=(-scale,) * stages,
        cap=rng.choice(caps),
        objective=rng.choice(list(Objective)),
    )


@pytest.mark.parametrize("seed", range(12))
def test_bound_is_at_most_the_optimum_with_random_stage_costs(seed: int) -> None:
    problem = _random_problem(seed)
    assert lower_bound(problem) <= optimum(problem).value + _TOL
