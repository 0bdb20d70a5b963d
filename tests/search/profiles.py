"""Random search problems for the validity tests: per-stage costs, latency, caps, both
placements and objectives."""

from __future__ import annotations

import random

from pipecc.search.problem import SHAPES, MemDeltas, Objective, Problem
from pipecc.semantics.costs import CostModel, StageCost


def random_costs(rng: random.Random, ranks: int) -> CostModel:
    """Per-share F, I, W in 0.2..2 (some W short), one latency of 0, 0.3 or 1."""
    stages = tuple(
        (
            s,
            StageCost(
                F=round(rng.uniform(0.5, 2), 2),
                I=round(rng.uniform(0.5, 2), 2),
                W=round(rng.uniform(0.2, 1.5), 2),
            ),
        )
        for s in range(ranks)
        if rng.random() < 0.8
    )
    base = StageCost(F=1.0, I=1.0, W=1.0, comm=rng.choice((0.0, 0.3, 1.0)))
    return CostModel(base=base, stages=stages)


def random_problem(rng: random.Random, *, max_ranks: int = 4, max_mb: int = 6) -> Problem:
    """A random problem whose cap admits at least one schedule."""
    ranks = rng.randint(1, max_ranks)
    return Problem.from_costs(
        random_costs(rng, ranks),
        ranks=ranks,
        microbatches=rng.randint(1, max_mb),
        placement=rng.choice(SHAPES),
        cap=rng.choice((1, 1.5, 2, ranks, 2 * ranks)),
        mem=rng.choice((MemDeltas(), MemDeltas(1.0, 0.25, -1.25))),
        objective=rng.choice(tuple(Objective)),
    )
