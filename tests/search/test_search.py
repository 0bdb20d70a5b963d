"""Every search result is valid: it verifies under every comm model, fits the cap, its .sched
compiles back to the same order, and the cost file beside it reproduces its makespan."""

from __future__ import annotations

import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
from profiles import random_costs

from pipecc.api import compile_source
from pipecc.search.baseline import bundled_orders
from pipecc.search.engine import search, smallest_cap
from pipecc.search.lower import compute_order
from pipecc.search.problem import MemDeltas, Problem, evaluate, fits
from pipecc.search.run import NoScheduleError, Request, run_search
from pipecc.search.sched import write_sched
from pipecc.semantics import CommModel
from pipecc.semantics.costs import load_cost_file, parse_cost_flag
from pipecc.simulate.timeline import simulate
from pipecc.verify import ALL_MODELS, Options, verify

F1 = "F=1,I=1,W=1,comm=1"


def _request(rng: random.Random) -> Request:
    ranks = rng.randint(2, 4)
    return Request(
        ranks=ranks,
        microbatches=rng.randint(1, 6),
        costs=random_costs(rng, ranks),
        cap=rng.choice((1.0, 1.5, 2.0, float(ranks), 2.0 * ranks)),
        mem=rng.choice((MemDeltas(), MemDeltas(1.0, 0.25, -1.25))),
        placement=rng.choice(("loop", "vshape", "auto")),
        objective=rng.choice(("makespan", "span")),
        comm=rng.choice(tuple(CommModel)),
        time_limit=0.05,
    )


@pytest.mark.parametrize("seed", range(8))
def test_results_on_random_profiles_are_valid(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    for case in range(3):
        req = _request(rng)
        try:
            outcome = run_search(req)
        except NoScheduleError as err:  # the message names the smallest cap with a schedule
            need = float(re.search(r"the smallest cap that has one is ([0-9.]+)", str(err))[1])
            assert need > req.cap
            req = req._replace(cap=need)
            outcome = run_search(req)
        problem, program = outcome.problem, outcome.lowered.program
        report = verify(program, Options(models=ALL_MODELS))
        assert report.ok, report.violations[:1]
        assert compute_order(program) == outcome.order
        evaluation = evaluate(problem, outcome.order)
        assert evaluation is not None and fits(problem, evaluation)
        assert max(outcome.peak) <= req.cap + 1e-9
        costs_file = tmp_path / f"{case}.costs.toml"
        costs_file.write_text(outcome.costs_text)
        costs = load_cost_file(costs_file)
        assert simulate(program, costs, model=req.comm).makespan == outcome.makespan
        assert simulate(program, costs, model=CommModel.EAGER).makespan == pytest.approx(
            evaluation.makespan, abs=1e-9
        )
        assert outcome.lower_bound <= evaluation.makespan + 1e-9  # a bound on the makespan
        if outcome.baseline is not None:
            assert outcome.makespan <= outcome.baseline.makespan + 1e-9
        text = write_sched(problem, outcome.order, "searched")
        again = compile_source(text, "searched.sched", ranks=problem.ranks,
                               microbatches=problem.microbatches)  # fmt: skip
        assert compute_order(again) == outcome.order
        assert verify(again, Options(models=ALL_MODELS)).ok


@pytest.mark.parametrize(
    ("ranks", "microbatches", "cap", "optimum"),
    [(4, 8, 2, 63), (8, 16, 8, 83)],  # optima of an exact solver on the same space (issue 12)
)
def test_finds_the_known_optima_with_costly_messages(
    ranks: int, microbatches: int, cap: float, optimum: float
) -> None:
    problem = Problem.from_costs(parse_cost_flag(F1), ranks=ranks, microbatches=microbatches,
                                 placement="loop", cap=cap)  # fmt: skip
    result = search(problem, time_limit=5)
    assert result is not None
    assert result.evaluation.makespan == pytest.approx(optimum)


def test_same_seed_same_order() -> None:
    rng = random.Random(3)
    problem = Problem.from_costs(random_costs(rng, 4), ranks=4, microbatches=8,
                                 placement="vshape", cap=3)  # fmt: skip
    first = search(problem, time_limit=30, budget=120, moves=500, seed=5)
    second = search(problem, time_limit=30, budget=120, moves=500, seed=5)
    assert first is not None and second is not None
    assert first.order == second.order and first.evaluations == second.evaluations


def test_below_the_smallest_cap_there_is_no_order() -> None:
    rng = random.Random(4)
    problem = Problem.from_costs(random_costs(rng, 3), ranks=3, microbatches=4,
                                 placement="vshape", cap=1)  # fmt: skip
    assert smallest_cap(problem) == pytest.approx(1.0)  # two half-share forwards
    assert search(replace(problem, cap=0.9), time_limit=1) is None


def test_a_periodic_order_is_written_with_phases_and_repeats() -> None:
    problem = Problem.from_costs(parse_cost_flag("F=1,I=1,W=1"), ranks=4, microbatches=12,
                                 placement="loop", cap=4)  # fmt: skip
    zb_h1 = next(b for b in bundled_orders(problem) if b.name == "zb_h1")
    text = write_sched(problem, zb_h1.order, "again")
    assert "phase warmup" in text and "phase steady" in text and "phase cooldown" in text
    assert "repeat 8 { I W F }" in text  # rank 0's steady state: (I W F) × (M - P)
    assert len(text.splitlines()) < 40
    again = compile_source(text, "again.sched", ranks=4, microbatches=12)
    assert compute_order(again) == zb_h1.order
