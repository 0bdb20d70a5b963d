"""The exact polish: CP-SAT, hinted with the search's order, for small problems when the
optional extra is installed; the search works the same without it."""

from __future__ import annotations

import pytest

from pipecc.search import engine, exact
from pipecc.search.problem import Problem, evaluate, fits
from pipecc.semantics.costs import parse_cost_flag


def _v_case(ranks: int = 3, microbatches: int = 4, cap: float = 2) -> Problem:
    # a V case whose optimum (26.5, CP-SAT's proof) the policies and the moves miss (27.5)
    return Problem.from_costs(parse_cost_flag("F=1,I=1,W=1,comm=1"), ranks=ranks,
                              microbatches=microbatches, placement="vshape",
                              cap=cap)  # fmt: skip


def test_without_ortools_the_search_never_calls_the_solver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: object, **kwargs: object) -> exact.ExactResult:
        raise AssertionError("the exact solver ran without OR-Tools")

    monkeypatch.setattr(exact, "available", lambda: False)
    monkeypatch.setattr(exact, "solve", refuse)
    problem = _v_case()
    assert engine.exact_budget(problem, 10.0) == 0.0
    result = engine.search(problem, time_limit=5, budget=300, moves=2000)
    assert result is not None
    evaluation = evaluate(problem, result.order)
    assert evaluation is not None and fits(problem, evaluation)


def test_the_budget_is_for_small_problems_and_scales_with_the_time_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(exact, "available", lambda: True)
    small, large = _v_case(), _v_case(ranks=8, microbatches=8, cap=4)
    limit = engine.default_time_limit(small.ranks, small.microbatches)
    assert engine.exact_budget(small, limit) == engine.EXACT_WORK
    assert engine.exact_budget(small, 10 * limit) == engine.EXACT_WORK
    assert engine.exact_budget(small, limit / 2) == pytest.approx(engine.EXACT_WORK / 2)
    assert engine.exact_budget(large, limit) == 0.0


@pytest.mark.skipif(not exact.available(), reason="OR-Tools is not installed")
def test_the_exact_polish_reaches_an_optimum_the_moves_miss() -> None:
    problem = _v_case()
    limit = engine.default_time_limit(problem.ranks, problem.microbatches)
    decodes, moves = engine.budgets(problem, limit)
    heuristic = engine.search(problem, time_limit=60 * limit, budget=decodes, moves=moves,
                              exact_work=0)  # fmt: skip
    first = engine.search(problem, time_limit=60 * limit, budget=decodes, moves=moves)
    second = engine.search(problem, time_limit=60 * limit, budget=decodes, moves=moves)
    assert heuristic is not None and first is not None and second is not None
    assert heuristic.score == pytest.approx(27.5)
    assert first.score == pytest.approx(26.5) and first.policy == ()
    assert first.order == second.order  # one worker and a deterministic limit
    evaluation = evaluate(problem, first.order)
    assert evaluation is not None and fits(problem, evaluation)
