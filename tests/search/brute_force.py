"""The exact optimum of tiny search problems, by enumerating every order (a test oracle).

Each rank's candidate orders are all sequences of its ops in which every op kind of a stage
runs in microbatch order (FIFO; microbatches have equal costs, so this loses no optimum) and
each microbatch runs F before I before W (and, in a V, the two stages' F and I in data
order), and whose running memory total stays within the cap.
Every combination of one candidate per rank is replayed; the best is confirmed with the
reference replay `problem.evaluate`. A few hundred orders per rank: P = 2, M ≤ 4 (loop).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator
from dataclasses import replace
from typing import NamedTuple

from pipecc.ir.ops import Kind
from pipecc.search.problem import (
    SPLIT,
    Objective,
    Order,
    Problem,
    SearchOp,
    _inputs,
    evaluate,
    fits,
)
from pipecc.semantics.costs import StageCost, parse_cost_flag

_EPS = 1e-9


class Optimum(NamedTuple):
    """The best value over every order that fits, and one order that reaches it."""

    value: float
    order: Order | None  # None when no order fits the cap
    orders_tried: int


def rank_orders(problem: Problem, rank: int) -> list[tuple[SearchOp, ...]]:
    """Every FIFO, F-before-I-before-W order of `rank`'s ops within the cap."""
    stages = problem.stages_of(rank)
    counts = {(kind, stage): 0 for kind in SPLIT for stage in stages}
    return list(_extend(problem, stages, counts, [], 0.0))


def _extend(
    problem: Problem,
    stages: tuple[int, ...],
    counts: dict[tuple[Kind, int], int],
    prefix: list[SearchOp],
    memory: float,
) -> Iterator[tuple[SearchOp, ...]]:
    if len(prefix) == 3 * len(stages) * problem.microbatches:
        yield tuple(prefix)
        return
    for stage in stages:
        for kind in SPLIT:
            done = counts[(kind, stage)]
            if done == problem.microbatches or not _inputs_run(counts, stages, kind, stage):
                continue
            op = SearchOp(kind, stage, done)
            total = memory + problem.mem_delta(op)
            if total > problem.cap + _EPS:
                continue
            counts[(kind, stage)] += 1
            prefix.append(op)
            yield from _extend(problem, stages, counts, prefix, total)
            prefix.pop()
            counts[(kind, stage)] -= 1


def _inputs_run(
    counts: dict[tuple[Kind, int], int], stages: tuple[int, ...], kind: Kind, stage: int
) -> bool:
    """Whether the next `kind` op of `stage` has its inputs on this rank already in the
    order (its own F before its I before its W; in a V, the lower stage's F before the
    upper's, the upper stage's I before the lower's): otherwise the order deadlocks."""
    done = counts[(kind, stage)]
    if kind is Kind.W:
        return done < counts[(Kind.I, stage)]
    if kind is Kind.I and done >= counts[(Kind.F, stage)]:
        return False
    kin = [other for other in stages if (other < stage if kind is Kind.F else other > stage)]
    return all(done < counts[(kind, other)] for other in kin)


def optimum(problem: Problem) -> Optimum:
    """The best objective value of `problem` over every order (see the module docstring)."""
    candidates = [rank_orders(problem, rank) for rank in range(problem.ranks)]
    replay = _FastReplay(problem)
    best, best_order, tried = math.inf, None, 0
    for order in itertools.product(*candidates):
        tried += 1
        value = replay.score(order)
        if value < best - _EPS:
            best, best_order = value, order
    if best_order is None:
        return Optimum(math.inf, None, tried)
    evaluation = evaluate(problem, best_order)
    assert evaluation is not None and fits(problem, evaluation)
    confirmed = evaluation.score(problem.objective)
    assert abs(confirmed - best) <= 1e-6, (confirmed, best)
    return Optimum(confirmed, best_order, tried)


class _FastReplay:
    """The latency-model replay of `problem.evaluate`, specialised for many orders of one
    problem (tests check that both agree)."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.inputs: dict[SearchOp, tuple[tuple[SearchOp, float], ...]] = {}
        for rank in range(problem.ranks):
            for op in problem.ops_of(rank):
                self.inputs[op] = tuple(
                    (need, 0.0 if problem.rank_of(need.stage) == rank else problem.comm)
                    for need in _inputs(problem, op)
                )

    def score(self, order: Order) -> float:
        """The objective of `order` (inf when it deadlocks)."""
        done: dict[SearchOp, float] = {}
        heads = [0] * len(order)
        free = [0.0] * len(order)
        first = [0.0] * len(order)
        progress = True
        while progress:
            progress = False
            for rank, ops in enumerate(order):
                while heads[rank] < len(ops):
                    op = ops[heads[rank]]
                    ready = 0.0
                    for need, lat in self.inputs[op]:
                        if need not in done:
                            break
                        ready = max(ready, done[need] + lat)
                    else:
                        start = max(free[rank], ready)
                        if heads[rank] == 0:
                            first[rank] = start
                        free[rank] = done[op] = start + self.problem.duration(op)
                        heads[rank] += 1
                        progress = True
                        continue
                    break
        if any(heads[rank] < len(ops) for rank, ops in enumerate(order)):
            return math.inf
        if self.problem.objective is Objective.MAKESPAN:
            return max(free)
        return max(end - start for start, end in zip(first, free, strict=True))


class Case(NamedTuple):
    """One tiny problem the brute force settles in about a second at most."""

    cost: str
    last_share: float  # the last share's durations are this times the others'
    ranks: int
    microbatches: int
    placement: str
    cap: float
    objective: Objective

    def problem(self) -> Problem:
        """The problem this case describes."""
        costs = parse_cost_flag(self.cost)
        if self.last_share != 1:
            base = costs.base
            heavy = StageCost(
                F=_times(base.F, self.last_share),
                I=_times(base.I, self.last_share),
                W=_times(base.W, self.last_share),
            )
            costs = replace(costs, stages=((self.ranks - 1, heavy),))
        return Problem.from_costs(
            costs,
            ranks=self.ranks,
            microbatches=self.microbatches,
            placement=self.placement,
            cap=self.cap,
            objective=self.objective,
        )

    def __str__(self) -> str:
        return (
            f"{self.cost}x{self.last_share:g}-P{self.ranks}-M{self.microbatches}-{self.placement}"
            f"-cap{self.cap:g}-{self.objective.value}"
        )


def _times(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


PROFILES = (
    ("F=1,I=1,W=1,comm=1", 1.0),  # costly messages
    ("F=1,I=1.5,W=0.5,comm=0.5", 1.0),  # small W
    ("F=5.478,I=5.806,W=3.534,comm=0.2", 1.0),  # sail-sg's example costs
    ("F=1,I=1,W=1,comm=0.1", 2.0),  # a heavy last share (LM head)
)

_SMALL = (
    (2, 2, "loop", (1, 2)),
    (2, 3, "loop", (1, 2, 3)),
    (2, 4, "loop", (2,)),
    (3, 2, "loop", (1, 2, 3)),
    (2, 2, "vshape", (1,)),
)
_LARGER = ((2, 4, "loop", (3,)), (2, 2, "vshape", (1.5,)))  # ~2 s each

CASES = tuple(
    Case(cost, last_share, ranks, mbs, placement, cap, objective)
    for cost, last_share in PROFILES
    for objective in Objective
    for ranks, mbs, placement, caps in _SMALL
    for cap in caps
) + tuple(
    Case(*PROFILES[1], ranks, mbs, placement, cap, Objective.MAKESPAN)
    for ranks, mbs, placement, caps in _LARGER
    for cap in caps
)
"""The tiny cases the bound and the search are checked against."""


@functools.cache
def case_optimum(case: Case) -> Optimum:
    """The optimum of one case, computed once per test session."""
    return optimum(case.problem())
