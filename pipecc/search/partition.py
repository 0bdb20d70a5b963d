"""The search over cuts: which contiguous layers each stage holds, which stages recompute,
and the op order, together, from a per-layer profile under a per-rank byte cap.

A cut with its recomputation choices becomes an ordinary search `Problem` (`cut_problem`):
a stage's durations are the sums of its layers' (a recomputed stage runs its F again
before its I), and the byte cap becomes the problem's memory rule exactly: rank r may hold
`cap - static(r)` bytes of activations (its layers' parameters, gradients and optimizer
state are held all step), so each of its stages' byte changes is divided by that headroom
and the problem's cap is 1. An F keeps its stage's `act_bytes` (a recomputed stage keeps
only its first layer's `input_bytes`, and its I brings the rest back until the W frees
all). Without a cap the problem counts units (F +1, W -1) under a cap that never binds.

The search (`search_cuts`), for each placement:

1. seeds: the uniform cut; for each of the smallest bottleneck bounds (the largest stage or
   rank load, M·(F + I + W) per microbatch), the cuts that fill stages from the left and
   from the right under it; under a cap, the same for the bytes (a stage's static bytes
   and its activations for one microbatch, or for P); cuts whose first and last stages
   take any counts and the middle ones equal counts (what Megatron's and torchtitan's
   settings give, every count);
   each with the recomputation that the cap needs (`recompute_plans`);
2. each seed is scored by a short order search (the plain policies of the order search's
   grid, the bundled schedules' orders); the best few are climbed: a boundary moves by one
   or two layers, each neighbour scored with the orders found so far (re-scored with a
   short order search after each round), while the step improves;
3. the best cuts get the full order search (`pipecc.search.engine.search`), the time limit
   shared between them; the shortest step wins.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from pipecc.search.baseline import compiled_orders
from pipecc.search.cut_problem import (
    Setting,
    StageBytes,
    can_recompute,
    cut_problem,
    memory_peaks,
    num_stages,
    rank_of,
    stage_bytes,
    stage_durations,
)
from pipecc.search.engine import SearchResult, default_time_limit, search, smallest_cap
from pipecc.search.layers import Cut, Profile, cut_of_counts, uniform_cut
from pipecc.search.problem import Order, Problem
from pipecc.search.replay import OrderReplay

__all__ = [  # the cut's problem is cut_problem.py's; its names stay importable from here
    "Found",
    "Setting",
    "StageBytes",
    "any_cut_bound",
    "can_recompute",
    "cut_problem",
    "memory_peaks",
    "num_stages",
    "rank_of",
    "search_cuts",
    "stage_bytes",
    "stage_durations",
]

_EPS = 1e-9
QUICK_DECODES = 16  # decodes of a seed's short order search
KEEP = 3  # seeds given a short order search by each ranking, cuts given the full one
CLIMBS = 6  # cuts climbed
SMALL = 1024  # orders × stages × microbatches up to which wide moves are timed with every order
CLIMB_ROUNDS = 3  # short order searches during a climb
CLIMB_STEPS = 40  # moves of a climb between two of them (a count, not a clock: the result
# depends on the input and the seed only, wherever the final searches' clock does not end them)


# ---- seeds ----------------------------------------------------------------------------------


def layer_loads(profile: Profile) -> list[float]:
    """One microbatch's work of each layer (F + I + W)."""
    return [layer.F + layer.I + layer.W for layer in profile.layers]


def _greedy(loads: Sequence[float], stages: int, bound: float) -> list[int] | None:
    """Layers per stage, each stage as full as `bound` allows from the left while leaving a
    layer for every later stage; None if the last stage ends above the bound."""
    counts, at, n = [], 0, len(loads)
    for stage in range(stages - 1):
        total, count = loads[at], 1
        while at + count < n - (stages - stage - 1) and total + loads[at + count] <= bound:
            total += loads[at + count]
            count += 1
        if total > bound + _EPS:
            return None
        counts.append(count)
        at += count
    if sum(loads[at:]) > bound + _EPS:
        return None
    return [*counts, n - at]


def bottleneck_cuts(loads: Sequence[float], stages: int, bounds: int = 4) -> list[Cut]:
    """For the `bounds` smallest feasible bounds on a stage's load, the cuts that fill the
    stages from the left and from the right under each (balanced-partition candidates)."""
    sums = sorted(
        {sum(loads[a:b]) for a in range(len(loads)) for b in range(a + 1, len(loads) + 1)}
    )
    low, high = 0, len(sums) - 1
    while low < high:  # the smallest feasible bound (greedy filling decides feasibility)
        mid = (low + high) // 2
        low, high = (low, mid) if _greedy(loads, stages, sums[mid]) else (mid + 1, high)
    cuts = []
    for bound in sums[low : low + bounds]:
        left = _greedy(loads, stages, bound)
        right = _greedy(loads[::-1], stages, bound)
        cuts += [cut_of_counts(c) for c in (left, right[::-1] if right else None) if c]
    return cuts


def edge_cuts(layers: int, stages: int) -> Iterator[Cut]:
    """Every cut whose first and last stages take any counts and whose middle stages take
    equal counts (differing by at most one, the earlier ones taking the extra layers):
    Megatron's first/last-stage layer counts and torchtitan's less-layers rules give these."""
    if stages < 3:
        yield from (cut_of_counts([a, layers - a]) for a in range(1, layers)) if stages == 2 else ()
        return
    middle_stages = stages - 2
    for first in range(1, layers - middle_stages):
        for last in range(1, layers - middle_stages - first + 1):
            middle = layers - first - last
            base, extra = divmod(middle, middle_stages)
            counts = [base + (1 if s < extra else 0) for s in range(middle_stages)]
            yield cut_of_counts([first, *counts, last])


def estimate(setting: Setting, cut: Cut) -> float:
    """A quick figure of a cut's step: M times its busiest rank's work per microbatch, plus
    one microbatch's way through every stage (fill and drain)."""
    durations = stage_durations(setting.profile, cut)
    per_rank = [0.0] * setting.ranks
    for stage, (f, i, w) in enumerate(durations):
        per_rank[rank_of(setting.ranks, setting.placement, stage)] += f + i + w
    through = sum(f + i for f, i, _ in durations)
    return (setting.microbatches - 1) * max(per_rank) + through


def seed_cuts(setting: Setting, edges: int = 8) -> list[Cut]:
    """The seeds of the search (module docstring, step 1), without recomputation."""
    loads = layer_loads(setting.profile)
    layers, stages = len(loads), setting.stages
    found = [uniform_cut(layers, stages), *bottleneck_cuts(loads, stages)]
    if setting.cap is not None:  # cuts that balance the bytes, for caps that bind
        for depth in (1, setting.ranks):
            weights = [
                layer.static_bytes + depth * layer.act_bytes for layer in setting.profile.layers
            ]
            found += bottleneck_cuts(weights, stages, bounds=2)
    ranked = sorted(edge_cuts(layers, stages), key=lambda cut: estimate(setting, cut))
    found += ranked[:edges]
    return list(dict.fromkeys(found))


# ---- recomputation --------------------------------------------------------------------------


def recompute_plans(setting: Setting, cut: Cut) -> list[Cut]:
    """The cut with the recomputation to try: none, if that fits; else the least the cap
    needs (stages switched largest saving first until one microbatch at a time fits: on the
    V shape a recomputed first chunk holds only its input while the second runs); and every
    recomputable stage of the ranks that cannot hold as many microbatches as 1F1B's depth
    there (P - r; 2(P - r) - 1 on the V shape). Empty when nothing fits."""
    plans = []
    minimal = _least_recomputation(setting, cut)
    if minimal is not None:
        plans.append(minimal)
    deep = _deep_recomputation(setting, minimal or cut)
    if deep is not None and deep != minimal:
        plans.append(deep)
    return plans


def _least_recomputation(setting: Setting, cut: Cut) -> Cut | None:
    while True:
        problem = cut_problem(setting, cut)
        if problem is None:
            return None
        if setting.cap is None or smallest_cap(problem) <= problem.cap + _EPS:
            return cut
        options = [
            (_saving(setting, cut, s), s)
            for s in range(cut.stages)
            if not cut.recompute[s] and can_recompute(setting.profile, cut, s)
        ]
        if not options:
            return None
        _, stage = max(options)
        flags = list(cut.recompute)
        flags[stage] = True
        cut = cut.with_recompute(tuple(flags))


def _saving(setting: Setting, cut: Cut, stage: int) -> float:
    layers = [setting.profile.layers[n] for n in cut.span(stage)]
    return sum(layer.act_bytes for layer in layers) - (layers[0].input_bytes or 0.0)


def _deep_recomputation(setting: Setting, cut: Cut) -> Cut | None:
    if setting.cap is None:
        return None
    problem = cut_problem(setting, cut)
    if problem is None:
        return None
    flags = list(cut.recompute)
    for rank in range(setting.ranks):
        depth = (
            setting.ranks - rank if setting.placement == "loop" else 2 * (setting.ranks - rank) - 1
        )
        per_mb = sum(problem.mem_f[s] for s in problem.stages_of(rank))
        if per_mb * min(depth, setting.microbatches) > problem.cap + _EPS:
            for stage in problem.stages_of(rank):
                flags[stage] = flags[stage] or can_recompute(setting.profile, cut, stage)
    deep = cut.with_recompute(tuple(flags))
    problem = cut_problem(setting, deep)
    if problem is None or smallest_cap(problem) > problem.cap + _EPS:
        return None
    return deep


# ---- the search -----------------------------------------------------------------------------


class Candidate(NamedTuple):
    """A cut (with its recomputation), the best order known for it and that order's step
    (with the sum of the ranks' finishing times, which breaks ties: a climb moves along a
    plateau of equal steps where the other ranks finish earlier)."""

    score: float
    cut: Cut
    order: Order
    finish: float = math.inf


class Known(NamedTuple):
    """An order known to the search, ready to be timed under any cut (`OrderReplay`)."""

    order: Order
    replay: OrderReplay


def _known(problem: Problem, orders: Sequence[Order]) -> list[Known]:
    return [Known(order, OrderReplay(problem, order)) for order in orders]


def _timed(
    setting: Setting, cut: Cut, known: Sequence[Known], cutoff: float = math.inf
) -> Candidate | None:
    """`cut` with the best of the `known` orders that fits it (None: none fits, or none
    ends by `cutoff`)."""
    problem = cut_problem(setting, cut)
    if problem is None:
        return None
    best = None
    for entry in known:
        if entry.replay.fits(problem):
            timed = entry.replay.score(problem, cutoff + _EPS)
            if timed is not None and (best is None or timed < (best.score, best.finish)):
                best = Candidate(timed[0], cut, entry.order, timed[1])
    return best


def _quick(setting: Setting, cut: Cut, pool: Sequence[Order], seed: int) -> Candidate | None:
    """A short order search on `cut`: the plain policies, then `pool`."""
    problem = cut_problem(setting, cut)
    if problem is None:
        return None
    found = search(problem, time_limit=60.0, budget=QUICK_DECODES, moves=0, exact_work=0,
                   seed=seed, candidates=pool)  # fmt: skip
    if found is None:
        return None
    finish = sum(ends[-1] for ends in found.evaluation.end if ends)
    return Candidate(found.score, cut, found.order, finish)


def neighbours(cut: Cut) -> Iterator[Cut]:
    """The cuts one boundary away: a boundary moved by one or two layers."""
    bounds = (*cut.starts, cut.layers)
    for k in range(1, cut.stages):
        for delta in (-2, -1, 1, 2):
            moved = bounds[k] + delta
            if bounds[k - 1] < moved < bounds[k + 1]:
                starts = cut.starts[:k] + (moved,) + cut.starts[k + 1 :]
                yield Cut(starts, cut.layers, cut.recompute)


def wider_neighbours(profile: Profile, cut: Cut) -> Iterator[Cut]:
    """The cuts two moves away: one stage's recomputation switched; two boundaries moved by
    one layer each, either way; a run of boundaries moved together by one layer (a layer
    handed on along the stages between)."""
    for stage in range(cut.stages):
        if cut.recompute[stage] or can_recompute(profile, cut, stage):
            flags = list(cut.recompute)
            flags[stage] = not flags[stage]
            yield cut.with_recompute(tuple(flags))
    bounds = (*cut.starts, cut.layers)
    for k in range(1, cut.stages):
        for j in range(k + 1, cut.stages):
            shifts = [(dk, dj, False) for dk in (-1, 1) for dj in (-1, 1)]
            if j > k + 1:
                shifts += [(-1, -1, True), (1, 1, True)]
            for dk, dj, run in shifts:
                moved = list(bounds)
                for n in range(k, j + 1) if run else (k, j):
                    moved[n] += dk if n == k else dj
                if all(a < b for a, b in zip(moved, moved[1:], strict=False)):
                    yield Cut(tuple(moved[:-1]), cut.layers, cut.recompute)


def _climb(setting: Setting, start: Candidate, known: list[Known], seed: int) -> Candidate:
    """Move boundaries while the step improves, each neighbour timed with the known orders;
    after each climb a short order search on the new cut adds its order (module docstring)."""
    best = start
    for _ in range(CLIMB_ROUNDS):
        for _ in range(CLIMB_STEPS):
            top = _best_neighbour(setting, best, neighbours(best.cut), known)
            if top is best:  # timed with the current order only: they are many
                wider = wider_neighbours(setting.profile, best.cut)
                own = [k for k in known if k.order is best.order] or known
                if len(known) * setting.stages * setting.microbatches <= SMALL:
                    own = known
                top = _best_neighbour(setting, best, wider, own)
            if top is best:
                break
            best = top
        again = _quick(setting, best.cut, (best.order,), seed)
        if again is None or not _better(again, best):
            break
        problem = cut_problem(setting, again.cut)
        assert problem is not None
        known.extend(_known(problem, [again.order]))
        best = again
    return best


def _best_neighbour(
    setting: Setting, best: Candidate, cuts: Iterator[Cut], known: Sequence[Known]
) -> Candidate:
    """The best of `cuts` timed with the known orders, if it beats `best` (else `best`)."""
    top = best
    for cut in cuts:
        timed = _timed(setting, cut, known, top.score)
        if timed is not None and _better(timed, top):
            top = timed
    return top


def _better(one: Candidate, other: Candidate) -> bool:
    """A shorter step, or the same step with the ranks finishing earlier in sum."""
    if one.score < other.score - _EPS:
        return True
    return one.score <= other.score + _EPS and one.finish < other.finish - _EPS


class Found(NamedTuple):
    """A searched cut: the cut and the order search's result on it."""

    cut: Cut
    result: SearchResult


def search_cuts(setting: Setting, *, time_limit: float | None = None, seed: int = 0) -> list[Found]:
    """The best cuts found with their searched orders, best first (empty when no cut fits
    the cap). `time_limit` is the final order searches' (default: the order search's
    default for P and M, per cut searched)."""
    plans = [plan for cut in seed_cuts(setting) for plan in recompute_plans(setting, cut)]
    if not plans:
        return []
    known = _bundled_known(setting, plans[0])
    limit = time_limit or KEEP * default_time_limit(setting.ranks, setting.microbatches)
    scored: dict[Cut, Candidate] = {}
    by_estimate = sorted(plans, key=lambda cut: estimate(setting, cut))
    for cut in dict.fromkeys([*_best_timed(setting, plans, known), *by_estimate[:KEEP]]):
        found = _quick(setting, cut, [k.order for k in known], seed)
        if found is not None:
            problem = cut_problem(setting, cut)
            assert problem is not None
            known.extend(_known(problem, [found.order]))
            scored[cut] = found
    for candidate in sorted(scored.values(), key=_rank)[:CLIMBS]:
        climbed = _climb(setting, candidate, known, seed)
        scored[climbed.cut] = min(scored.get(climbed.cut, climbed), climbed, key=_rank)
    return _final(setting, sorted(scored.values(), key=_rank)[:KEEP], limit, seed)


def _bundled_known(setting: Setting, cut: Cut) -> list[Known]:
    problem = cut_problem(setting, cut)
    assert problem is not None
    orders = compiled_orders(setting.ranks, setting.microbatches, setting.placement)
    return _known(problem, [order for _, order, _ in orders])


def _best_timed(setting: Setting, plans: Sequence[Cut], known: Sequence[Known]) -> list[Cut]:
    """The KEEP plans the known orders time best."""
    timed = [t for t in (_timed(setting, cut, known) for cut in plans) if t is not None]
    return [t.cut for t in sorted(timed, key=_rank)[:KEEP]]


def _final(
    setting: Setting, finalists: Sequence[Candidate], limit: float, seed: int
) -> list[Found]:
    """The full order search on each finalist, the time limit shared."""
    results = []
    for candidate in finalists:
        problem = cut_problem(setting, candidate.cut)
        assert problem is not None
        found = search(problem, time_limit=limit / len(finalists), seed=seed,
                       candidates=(candidate.order,), exact_work=0)  # fmt: skip
        if found is not None:
            results.append(Found(candidate.cut, found))
    return sorted(results, key=lambda r: (r.result.score, r.cut.starts, r.cut.recompute))


def _rank(candidate: Candidate) -> tuple[float, float, tuple[int, ...], tuple[bool, ...]]:
    return (candidate.score, candidate.finish, candidate.cut.starts, candidate.cut.recompute)


def any_cut_bound(setting: Setting) -> float:
    """A lower bound on the step over every cut and order: the model's work for M
    microbatches spread evenly over the ranks, and never less than one microbatch's way
    through every layer."""
    loads = layer_loads(setting.profile)
    through = sum(layer.F + layer.I for layer in setting.profile.layers)
    return max(setting.microbatches * sum(loads) / setting.ranks, through)
