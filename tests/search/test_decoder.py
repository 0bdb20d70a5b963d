"""The decoder's timing equals the reference replay's, and its orders fit the cap."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from profiles import random_problem

from pipecc.search.decoder import NO_LIMIT, RankPolicy, Reserve, decode
from pipecc.search.engine import smallest_cap, structured_policies
from pipecc.search.polish import Polisher, Timer
from pipecc.search.problem import SPLIT, evaluate, fits


def _random_policy(rng: random.Random, ranks: int) -> tuple[RankPolicy, ...]:
    return tuple(
        RankPolicy(
            warmup=rng.randint(1, 2 * ranks),
            wlimit=rng.choice((0, 1, 3, NO_LIMIT)),
            gap_f=rng.random() < 0.5,
            late_first=rng.random() < 0.5,
            reserve=rng.choice(tuple(Reserve)),
        )
        for _ in range(ranks)
    )


@pytest.mark.parametrize("seed", range(6))
def test_decoded_times_equal_the_reference_replay(seed: int) -> None:
    rng = random.Random(seed)
    checked = 0
    for _ in range(40):
        problem = random_problem(rng)
        decoded = decode(problem, _random_policy(rng, problem.ranks))
        if decoded is None:
            continue
        reference = evaluate(problem, decoded.order)
        assert reference is not None
        mine = decoded.evaluation
        for ours, theirs in ((mine.start, reference.start), (mine.end, reference.end)):
            assert [len(r) for r in ours] == [len(r) for r in theirs]
            flat = [t for r in theirs for t in r]
            assert [t for r in ours for t in r] == pytest.approx(flat, abs=1e-6)
        assert mine.peak == pytest.approx(reference.peak)
        assert mine.makespan == pytest.approx(reference.makespan, abs=1e-6)
        assert mine.span == pytest.approx(reference.span, abs=1e-6)
        assert fits(problem, reference), (reference.peak, problem.cap)
        checked += 1
    assert checked >= 25


@pytest.mark.parametrize("seed", range(4))
def test_structured_policies_always_finish_at_the_smallest_cap(seed: int) -> None:
    rng = random.Random(100 + seed)
    for _ in range(15):
        problem = random_problem(rng)
        tight = replace(problem, cap=smallest_cap(problem))
        results = [decode(tight, policy) for policy in structured_policies(tight)]
        assert any(r is not None for r in results)
        for result in filter(None, results):
            assert fits(tight, result.evaluation)


def test_ops_of_one_kind_and_stage_run_in_microbatch_order() -> None:
    rng = random.Random(7)
    for _ in range(20):
        problem = random_problem(rng)
        decoded = decode(problem, _random_policy(rng, problem.ranks))
        if decoded is None:
            continue
        for ops in decoded.order:
            for kind in SPLIT:
                for stage in {op.stage for op in ops}:
                    mbs = [op.mb for op in ops if op.kind is kind and op.stage == stage]
                    assert mbs == sorted(mbs)


@pytest.mark.parametrize("seed", range(4))
def test_polish_timer_agrees_with_the_reference_replay(seed: int) -> None:
    rng = random.Random(200 + seed)
    stalls = 0
    for _ in range(30):
        problem = random_problem(rng)
        decoded = decode(problem, _random_policy(rng, problem.ranks))
        if decoded is None:
            continue
        ranks = [list(ops) for ops in decoded.order]
        for _ in range(3):  # random swaps: some orders stall, some run
            r = rng.randrange(problem.ranks)
            i, j = rng.randrange(len(ranks[r])), rng.randrange(len(ranks[r]))
            ranks[r][i], ranks[r][j] = ranks[r][j], ranks[r][i]
        order = tuple(tuple(ops) for ops in ranks)
        timer = Timer(problem)
        timed = timer.run([[timer.op_id(op) for op in ops] for ops in order])
        reference = evaluate(problem, order)
        if reference is None:
            assert timed is None
            stalls += 1
            continue
        assert timed is not None
        assert timed[0] == pytest.approx(reference.makespan)
        assert timed[1] == pytest.approx(reference.span)
        assert timed[2] == pytest.approx(sum(ends[-1] for ends in reference.end))
    assert stalls > 0


def test_polish_keeps_the_order_valid_and_never_worse() -> None:
    rng = random.Random(9)
    for _ in range(10):
        problem = random_problem(rng, max_mb=8)
        decoded = decode(problem, _random_policy(rng, problem.ranks))
        if decoded is None:
            continue
        before = decoded.evaluation.score(problem.objective)
        order, score, _ = Polisher(problem).polish(decoded.order, rng, 300, lambda s: False)
        after = evaluate(problem, order)
        assert after is not None and fits(problem, after)
        assert after.score(problem.objective) == pytest.approx(score[0])
        assert score[0] <= before + 1e-9


def test_a_cutoff_drops_exactly_the_orders_worse_than_it() -> None:
    rng = random.Random(11)
    dropped = kept = 0
    for _ in range(60):
        problem = random_problem(rng)
        policy = _random_policy(rng, problem.ranks)
        full = decode(problem, policy)
        if full is None:
            continue
        score = full.evaluation.score(problem.objective)
        cutoff = score * rng.choice((0.9, 1.0, 1.1))
        cut = decode(problem, policy, cutoff)
        if score > cutoff + 1e-9:
            assert cut is None
            dropped += 1
        else:
            assert cut is not None and cut.order == full.order
            kept += 1
    assert dropped and kept
