"""The sail-sg baseline of benchmarks/: the figures the issue quotes for it, and its orders
replay to the span it reports and fit the cap (the cross-check against upstream's code runs
from a checkout: `benchmarks/sailsg_upstream.py PATH`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from sailsg_baseline import grid_problem, grid_profiles, sailsg_schedule  # noqa: E402

from pipecc.search.problem import evaluate, fits  # noqa: E402


@pytest.mark.parametrize(("ranks", "mbs", "cap", "span"), [(4, 8, 2, 85), (8, 16, 8, 89)])
def test_the_issue_figures(ranks: int, mbs: int, cap: float, span: float) -> None:
    costly = grid_profiles(ranks)[3]
    assert costly.name == "costly messages"
    result = sailsg_schedule(grid_problem(costly, mbs, cap))
    assert result is not None and result.span == span


@pytest.mark.parametrize("ranks", [4, 8])
@pytest.mark.parametrize("mbs", [8, 16])
def test_orders_replay_to_the_reported_span_within_the_cap(ranks: int, mbs: int) -> None:
    for profile in grid_profiles(ranks):
        for cap in (ranks / 2, ranks, 2 * ranks):
            problem = grid_problem(profile, mbs, cap)
            result = sailsg_schedule(problem)
            assert result is not None
            evaluation = evaluate(problem, result.order)
            assert evaluation is not None and fits(problem, evaluation)
            assert evaluation.span == pytest.approx(result.span)


def test_only_the_loop_placement() -> None:
    problem = grid_problem(grid_profiles(4)[0], 8, 4, placement="vshape")
    with pytest.raises(ValueError, match="loop placement"):
        sailsg_schedule(problem)
