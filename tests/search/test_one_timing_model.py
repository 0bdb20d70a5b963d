"""One timing model: the search's replay (`problem.evaluate`) gives the makespan `pipecc
simulate` prints for the same order under the latency model (`--comm eager`), on random
orders, costs, latencies and both placements; and the decoder, which the search uses to
time candidates, reproduces `evaluate`."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from profiles import random_problem

from pipecc.cli import main
from pipecc.interop import json_program
from pipecc.passes.insert_comms import insert_comms
from pipecc.search.lower import costs_toml, to_program
from pipecc.search.problem import Order, Problem, SearchOp, _inputs, evaluate, fits
from pipecc.search.replay import OrderReplay


def random_order(problem: Problem, rng: random.Random) -> Order:
    """A random order that runs to the end: ops are drawn at random among those whose
    inputs are done (any rank), so every rank's sequence is a legal interleaving."""
    todo = {op for rank in range(problem.ranks) for op in problem.ops_of(rank)}
    done: set[SearchOp] = set()
    order: list[list[SearchOp]] = [[] for _ in range(problem.ranks)]
    while todo:
        ready = sorted((op for op in todo if all(n in done for n in _inputs(problem, op))), key=str)
        op = rng.choice(ready)
        todo.remove(op)
        done.add(op)
        order[problem.rank_of(op.stage)].append(op)
    return tuple(map(tuple, order))


@pytest.mark.parametrize("seed", range(40))
def test_search_replay_is_the_simulators_latency_model(
    seed: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(seed)
    problem = random_problem(rng, max_ranks=4, max_mb=5)
    order = random_order(problem, rng)
    evaluation = evaluate(problem, order)
    assert evaluation is not None
    program = insert_comms(to_program(problem, order))
    (tmp_path / "p.json").write_text(json_program.dumps(program))
    (tmp_path / "c.toml").write_text(costs_toml(problem))
    code = main(["simulate", str(tmp_path / "p.json"), "--cost-file", str(tmp_path / "c.toml"),
                 "--comm", "eager", "--json"])  # fmt: skip
    assert code == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["makespan"] == pytest.approx(evaluation.makespan, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_an_order_replayed_under_other_costs_is_timed_as_evaluate_times_it(seed: int) -> None:
    """`OrderReplay` (the layer search's scoring of cuts) equals `evaluate` on the same order
    under the costs of another random problem of the same placement and sizes."""
    rng = random.Random(seed)
    problem = random_problem(rng, max_ranks=4, max_mb=5)
    order = random_order(problem, rng)
    replay = OrderReplay(problem, order)
    for _ in range(3):
        other = random_problem(rng, max_ranks=4, max_mb=5)
        other = replace(other, ranks=problem.ranks, microbatches=problem.microbatches,
                        placement=problem.placement, f=_jitter(rng, problem.f),
                        i=_jitter(rng, problem.i), w=_jitter(rng, problem.w),
                        mem_f=problem.mem_f, mem_i=problem.mem_i, mem_w=problem.mem_w)  # fmt: skip
        evaluation = evaluate(other, order)
        assert evaluation is not None
        assert replay.makespan(other) == pytest.approx(evaluation.makespan, rel=1e-12)
        assert replay.fits(other) == fits(other, evaluation)


def _jitter(rng: random.Random, values: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(round(v * rng.uniform(0.2, 3), 3) for v in values)
