"""The exact solver (optional OR-Tools extra): the brute-force optimum on tiny cases, the
issue's reference optima, and a clear error without OR-Tools."""

from __future__ import annotations

import sys

import pytest
from brute_force import CASES, Case, case_optimum

from pipecc.search import exact
from pipecc.search.bounds import lower_bound
from pipecc.search.problem import Problem, evaluate, fits
from pipecc.semantics.costs import parse_cost_flag

needs_ortools = pytest.mark.skipif(not exact.available(), reason="OR-Tools is not installed")


@needs_ortools
@pytest.mark.parametrize("case", CASES[::3], ids=str)
def test_exact_matches_the_brute_force(case: Case) -> None:
    result = exact.solve(case.problem())
    assert result.optimal
    assert result.value == pytest.approx(case_optimum(case).value, abs=1e-9)
    assert result.order is not None
    evaluation = evaluate(case.problem(), result.order)
    assert evaluation is not None and fits(case.problem(), evaluation)


@needs_ortools
@pytest.mark.parametrize(
    ("cost", "cap", "optimum"),
    [
        ("F=1,I=1,W=1,comm=1", 2, 63),
        ("F=1,I=1,W=1,comm=1", 4, 39),
        ("F=1,I=1.5,W=0.5,comm=0.5", 2, 57),
    ],
)
def test_exact_optima_at_p4_m8(cost: str, cap: float, optimum: float) -> None:
    """P=4, M=8: the issue's cap-P/2 reference (63, where sail-sg's heuristic gives 85)."""
    problem = Problem.from_costs(
        parse_cost_flag(cost), ranks=4, microbatches=8, placement="loop", cap=cap
    )
    result = exact.solve(problem)
    assert result.optimal and result.value == pytest.approx(optimum)
    assert lower_bound(problem) <= result.value + 1e-9


@needs_ortools
def test_exact_reports_an_infeasible_cap() -> None:
    problem = Problem.from_costs(
        parse_cost_flag("F=1,I=1,W=1"), ranks=2, microbatches=2, placement="loop", cap=0.5
    )
    result = exact.solve(problem)
    assert result.order is None and result.optimal


def test_without_ortools_the_solver_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n.startswith("ortools.")] + ["ortools"]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: cannot import
    assert not exact.available()
    problem = CASES[0].problem()
    with pytest.raises(exact.ExactSolverMissing, match=r"pip install 'pipecc\[exact\]'"):
        exact.solve(problem)


@needs_ortools
@pytest.mark.parametrize(
    ("cost", "cap"),
    [
        ("F=1,I=1,W=1,comm=1", 1),
        ("F=1,I=1,W=1,comm=1", 2),
        ("F=1,I=1.5,W=0.5,comm=0.5", 1.5),
        ("F=1,I=1,W=1,comm=0", 3),
    ],
)
def test_v_shape_bound_is_at_most_the_exact_optimum(cost: str, cap: float) -> None:
    """P=3, M=4 in the V shape, where the bound's cross-stage memory edges apply."""
    problem = Problem.from_costs(
        parse_cost_flag(cost), ranks=3, microbatches=4, placement="vshape", cap=cap
    )
    result = exact.solve(problem)
    assert result.optimal
    assert lower_bound(problem) <= result.value + 1e-9
