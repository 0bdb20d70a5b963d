"""The search: policies for the list scheduler, hill climbing over them, then a polish.

An order is first found as the output of the list scheduler (`pipecc.search.decoder`) under
a policy, one `RankPolicy` per rank. The search

1. decodes the plain policies of a grid (warm-up depth as 1F1B's or ZB-V's, as deep as the
   cap allows, half, one; ZB-H1's W backlog) and a seeded sample of the rest of it (W right
   after its I, or in the gaps; forwards and W's in gaps or not; the V shape's chunk order
   and reserve), and keeps the best few;
2. climbs from them: each step changes one knob of one rank, or of all, or the warm-up depth
   of a run of ranks, decodes (stopping as soon as an op ends past the score to beat), and
   keeps the change if the order is not worse (ties are kept, so the climb drifts along
   plateaus; the sum of the ranks' finishing times breaks ties); after PATIENCE steps
   without improvement it restarts from another start, later from the best policy;
3. if the best order is above the lower bound, adds the given candidates (the bundled
   schedules' orders that fit), then polishes the best with single-op moves
   (`pipecc.search.polish`);
4. stops at the evaluation budget, at the lower bound, or at the clock;
5. with the optional exact solver installed (`pipecc[exact]`) and a small problem (P ≤ 4,
   M ≤ 8), if the order is still above the bound, hands it to CP-SAT as a hint for an exact
   polish on one worker of EXACT_WORK deterministic seconds at the default time limit (it
   ends early at a proven optimum; its clock is EXACT_CLOCK, not the time limit, so that the
   result does not depend on the machine), and keeps CP-SAT's order if it is better.

Every order is valid and fits the cap by construction. The default budget is what the time
limit allows at the reference machine's costs, so the same seed gives the same order
wherever the clock does not end the search first.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

from pipecc.search import exact
from pipecc.search.bounds import lower_bound
from pipecc.search.decoder import NO_LIMIT, Decoded, Policy, RankPolicy, Reserve, decode
from pipecc.search.polish import Polisher
from pipecc.search.problem import SHAPES, Evaluation, Order, Problem, evaluate, fits

POLICY_SHARE = 0.6  # of the time limit, for the policy search; the polish has the rest
# The time limit becomes a number of decodes and moves by these costs (measured on the
# 2-core reference machine), so that a seed gives the same order on any machine that keeps
# up; on a slower (or busier) one the clock ends the climb at CLIMB_CLOCK × the limit and
# the polish at the limit.
DECODE_SECONDS = (1.5e-4, 4e-6)  # per decode, per op (a climb cuts most off early)
MOVE_SECONDS = (2e-5, 0.6e-6)  # per move, per op
CLIMB_CLOCK = 0.75
KEEP = 4  # restart points kept from the structured grid
GRID_FIRST = 14  # the grid's plain policies, always decoded
GRID_SHARE = 0.1  # of the decode budget, at most, for the rest of the grid (shuffled)
PATIENCE = 150  # steps without improvement before a restart
EXACT_RANKS, EXACT_MICROBATCHES = 4, 8  # the largest problems the exact polish takes on
EXACT_WORK = 10.0  # CP-SAT's deterministic seconds for the exact polish
EXACT_CLOCK = 120.0  # its wall-clock safety limit (the work limit ends it first)


class SearchResult(NamedTuple):
    """The best order found, its evaluation, the policy that produced it and the effort."""

    problem: Problem
    order: Order
    evaluation: Evaluation
    policy: Policy  # () when the order is a given candidate's or was polished
    seconds: float
    evaluations: int  # decodes and polishing moves

    @property
    def score(self) -> float:
        return self.evaluation.score(self.problem.objective)


Score = tuple[float, float]
Bound = Callable[[Problem], float]


def default_time_limit(ranks: int, microbatches: int) -> float:
    """The default `--time-limit` in seconds: 0.7 s up to P·M = 256 (P=8, M=32), then
    growing with P·M (2.8 s at P=16, M=64; 11.2 s at P=32, M=128), at most 25 s."""
    return min(25.0, 0.7 * max(1.0, ranks * microbatches / 256))


def _score(problem: Problem, decoded: Decoded | None) -> Score:
    if decoded is None:
        return (math.inf, math.inf)
    ev = decoded.evaluation
    return (ev.score(problem.objective), sum(ends[-1] for ends in ev.end))


def max_depth(problem: Problem, rank: int) -> int:
    """How many microbatches the cap lets rank `rank` hold in flight (at least 1)."""
    per_mb = problem.mem_f[rank]  # the rank's first stage
    if per_mb <= 0:
        return problem.microbatches
    return max(1, min(problem.microbatches, int(problem.cap / per_mb + 1e-9)))


def _policy(
    warmups: list[int], wlimits: list[int], gap: bool, late_first: bool, reserve: Reserve
) -> Policy:
    """One policy for every rank: gap-filling forwards and W's both on or both off."""
    return tuple(
        RankPolicy(w, lim, gap, late_first, reserve, gap)
        for w, lim in zip(warmups, wlimits, strict=True)
    )


def structured_policies(problem: Problem, rng: random.Random | None = None) -> list[Policy]:
    """The starting grid: warm-up depth × W placement × gap forwards × (V shape) chunk order
    × reserve. The plain variant of each depth (W in the gaps, forwards in gaps, later
    chunk first, one reserved forward) comes first, the rest in an order shuffled by `rng`
    (so that a small budget samples all of the grid's corners)."""
    p = problem.ranks
    vee = len(problem.stages_of(0)) > 1
    depths = [max_depth(problem, r) for r in range(p)]
    shapes = [
        [min(d, (2 if vee else 1) * (p - r) - (1 if vee else 0)) for r, d in enumerate(depths)],
        depths,
        [min(d, max(1, (p - r + 1) // 2)) for r, d in enumerate(depths)],
        [1] * p,
    ]
    if vee:
        shapes.append([min(d, p - r) for r, d in enumerate(depths)])
        # from the cap's depth on rank 0 down to one on the last rank
        shapes.append([round(d - (d - 1) * r / max(1, p - 1)) for r, d in enumerate(depths)])
    plain = Reserve.ONE if vee else Reserve.ALL
    first = [_policy(ws, [NO_LIMIT] * p, True, True, plain) for ws in shapes]
    if vee:  # without reserve: tight caps need the room (the decoder drops a stall)
        first += [_policy(ws, [NO_LIMIT] * p, True, True, Reserve.NONE) for ws in shapes]
    zb_h1 = list(range(p))  # rank r keeps r W's for the drain's bubbles, as ZB-H1
    first.append(_policy(shapes[0], zb_h1, False, True, plain))
    rest = [
        _policy(ws, wl, gap, late_first, reserve)
        for ws in shapes
        for wl in ([NO_LIMIT] * p, [0] * p, zb_h1)
        for gap in (True, False)
        for late_first in ((True, False) if vee else (True,))
        for reserve in (tuple(Reserve) if vee else (Reserve.ALL,))
    ]
    rest = [policy for policy in rest if policy not in first]
    (rng or random.Random(0)).shuffle(rest)
    return first + rest


def _mutate(problem: Problem, policy: Policy, rng: random.Random) -> Policy:
    """One random step: a knob of one rank, or the warm-up depth of a run of ranks."""
    p = problem.ranks
    ranks = list(policy)
    r = rng.randrange(p)
    pol = ranks[r]
    move = rng.randrange(8 if len(problem.stages_of(0)) > 1 else 5)
    if move <= 1:
        step = rng.choice((-1, 1))
        lo, hi = sorted((r, rng.randrange(p))) if move == 1 else (r, r)
        for k in range(lo, hi + 1):
            depth = min(max_depth(problem, k), max(1, ranks[k].warmup + step))
            ranks[k] = ranks[k]._replace(warmup=depth)
    elif move == 2:
        choices = (0, 1, 2, r, max(1, p - r), NO_LIMIT)
        ranks[r] = pol._replace(wlimit=rng.choice([c for c in choices if c != pol.wlimit]))
    elif move == 3:
        ranks[r] = (
            pol._replace(gap_f=not pol.gap_f)
            if rng.random() < 0.5
            else pol._replace(gap_w=not pol.gap_w)
        )
    elif move == 4:
        wlimit = rng.choice((0, NO_LIMIT))
        ranks = [rank._replace(wlimit=wlimit) for rank in ranks]
    elif move == 5:
        ranks[r] = pol._replace(late_first=not pol.late_first)
    elif move == 6:
        ranks[r] = pol._replace(reserve=rng.choice([m for m in Reserve if m is not pol.reserve]))
    else:
        reserve = rng.choice(tuple(Reserve))
        ranks = [rank._replace(reserve=reserve) for rank in ranks]
    return tuple(ranks)


class _Search:
    """The state of one search: the best so far, the budget and the clock."""

    def __init__(self, problem: Problem, time_limit: float, budget: int, bound: float) -> None:
        self.problem = problem
        self.deadline = time.perf_counter() + time_limit
        self.budget = budget
        self.bound = bound if math.isfinite(bound) else 0.0
        self.evaluations = 0
        self.best: tuple[Score, Decoded] | None = None  # the best order, decoded or given
        self.best_policy: tuple[Score, Policy] | None = None

    def at_bound(self, score: Score) -> bool:
        return score[0] <= self.bound * (1 + 1e-9)

    def done(self) -> bool:
        if self.evaluations >= self.budget or time.perf_counter() >= self.deadline:
            return True
        return self.best is not None and self.at_bound(self.best[0])

    def offer(self, score: Score, decoded: Decoded) -> None:
        if self.best is None or score < self.best[0]:
            self.best = (score, decoded)

    def try_policy(self, policy: Policy, cutoff: float = math.inf) -> Score:
        decoded = decode(self.problem, policy, cutoff)
        self.evaluations += 1
        score = _score(self.problem, decoded)
        if decoded is not None:
            self.offer(score, decoded)
            if self.best_policy is None or score < self.best_policy[0]:
                self.best_policy = (score, policy)
        return score

    def climb(self, start: Policy, score: Score, rng: random.Random) -> None:
        current, current_score, stale = start, score, 0
        while stale < PATIENCE and not self.done():
            candidate = _mutate(self.problem, current, rng)
            candidate_score = self.try_policy(candidate, current_score[0])
            if candidate_score <= current_score:
                stale = 0 if candidate_score < current_score else stale + 1
                current, current_score = candidate, candidate_score
            else:
                stale += 1


def search(
    problem: Problem,
    *,
    time_limit: float,
    seed: int = 0,
    budget: int | None = None,
    moves: int | None = None,
    bound: Bound = lower_bound,
    candidates: Sequence[Order] | Callable[[], Sequence[Order]] = (),
    exact_work: float | None = None,
) -> SearchResult | None:
    """The best order found with `budget` decodes and `moves` polishing moves (by default
    what `time_limit` seconds allow at the reference costs; the clock stops the search at
    `time_limit` in any case); None when no order fits the memory
    cap (see `smallest_cap`). `candidates` (orders, such as the bundled schedules'; those
    that fit the cap count) start the polish if no decoded order beats them; given as a
    function, they are only made when the climb ends above the bound. `exact_work` is the
    exact polish's deterministic time (default: `exact_budget`; 0 turns it off)."""
    began = time.perf_counter()
    target = bound(problem)
    default_budget, default_moves = budgets(problem, time_limit)
    budget = default_budget if budget is None else budget
    moves = default_moves if moves is None else moves
    state = _Search(problem, CLIMB_CLOCK * time_limit, budget, target)
    rng = random.Random(seed)
    _climb_policies(state, rng)
    if not (state.best is not None and state.at_bound(state.best[0])):
        orders = candidates() if callable(candidates) else candidates
        given = _best_given(problem, orders)
        if given is not None:
            state.offer(*given)
    if state.best is None:
        return None
    score, decoded = state.best
    order = decoded.order
    policy = state.best_policy[1] if state.best_policy and state.best_policy[0] == score else ()
    deadline = began + time_limit
    polished, polished_score, tried = Polisher(problem).polish(
        order, rng, moves, lambda s: state.at_bound(s) or _past(deadline)
    )
    if polished_score < score:
        order, policy, score = polished, (), polished_score
    work = exact_budget(problem, time_limit) if exact_work is None else exact_work
    if work > 0 and not state.at_bound(score):
        solved = _exact_polish(problem, order, score, work, seed)
        order, policy = (order, policy) if solved is None else (solved, ())
    evaluation = evaluate(problem, order)
    assert evaluation is not None and fits(problem, evaluation)
    return SearchResult(
        problem,
        order,
        evaluation,
        policy,
        time.perf_counter() - began,
        state.evaluations + tried,
    )


def budgets(problem: Problem, time_limit: float) -> tuple[int, int]:
    """(decodes, polishing moves) that `time_limit` seconds allow at the reference costs."""
    ops = 3 * problem.num_stages * problem.microbatches
    decode_cost = DECODE_SECONDS[0] + DECODE_SECONDS[1] * ops
    move_cost = MOVE_SECONDS[0] + MOVE_SECONDS[1] * ops
    return (
        max(KEEP, int(POLICY_SHARE * time_limit / decode_cost)),
        int((1 - POLICY_SHARE) * time_limit / move_cost),
    )


def _exact_polish(
    problem: Problem, order: Order, score: Score, work: float, seed: int
) -> Order | None:
    """CP-SAT's order from `order` within `work` deterministic seconds, if it is faster."""
    solved = exact.solve(
        problem, time_limit=EXACT_CLOCK, hint=order, workers=1, work=work, seed=seed
    )
    if solved.order is not None and solved.value < score[0] - 1e-9:
        return solved.order
    return None


def exact_budget(problem: Problem, time_limit: float) -> float:
    """The exact polish's default deterministic time, for problems up to EXACT_RANKS ranks
    and EXACT_MICROBATCHES microbatches when OR-Tools is installed (else 0): EXACT_WORK at
    the default time limit or above, in proportion below it."""
    small = problem.ranks <= EXACT_RANKS and problem.microbatches <= EXACT_MICROBATCHES
    if not (small and exact.available()):
        return 0.0
    return EXACT_WORK * min(
        1.0, time_limit / default_time_limit(problem.ranks, problem.microbatches)
    )


def _past(deadline: float) -> bool:
    return time.perf_counter() >= deadline


def _climb_policies(state: _Search, rng: random.Random) -> None:
    """The structured grid, then hill climbing from its best few (module docstring)."""
    starts: list[tuple[Score, Policy]] = []
    grid = structured_policies(state.problem, rng)
    for policy in grid[: max(GRID_FIRST, int(GRID_SHARE * state.budget))]:
        if state.done() and state.best is not None:
            break
        starts.append((state.try_policy(policy), policy))
    starts = sorted((s for s in starts if math.isfinite(s[0][0])), key=lambda s: s[0])[:KEEP]
    round_ = 0
    while starts and not state.done():
        score, policy = starts[round_ % len(starts)]
        if round_ >= len(starts) and state.best_policy is not None:  # later: from the best
            score, policy = state.best_policy
        state.climb(policy, score, rng)
        round_ += 1


def _best_given(problem: Problem, orders: Sequence[Order]) -> tuple[Score, Decoded] | None:
    best = None
    for order in orders:
        evaluation = evaluate(problem, order)
        if evaluation is None or not fits(problem, evaluation):
            continue
        decoded = Decoded(order, evaluation)
        score = _score(problem, decoded)
        if best is None or score < best[0]:
            best = (score, decoded)
    return best


def smallest_cap(problem: Problem) -> float:
    """The smallest cap under which the decoder finds an order: one microbatch in flight at
    a time (every rank's forwards of one microbatch held at once, its W right after its I)."""
    one = problem.ranks * (RankPolicy(1, 0, False, True),)
    decoded = decode(replace(problem, cap=math.inf), one)
    assert decoded is not None  # one microbatch at a time always runs
    most = max(decoded.evaluation.peak)
    if problem.pipes == 1:
        return most
    # several pipes: the policy above keeps one microbatch of each pipe in flight; the
    # smallest cap is the least whole number of forwards under which it still runs
    step = max(problem.mem_f)
    cap = step
    while cap < most - 1e-9:
        if decode(replace(problem, cap=cap), one) is not None:
            return cap
        cap += step
    return most


def placements(choice: str) -> tuple[str, ...]:
    """`--placement`'s value → the placements to search."""
    if choice == "auto":
        return SHAPES
    if choice not in (*SHAPES, *LAYOUTS):
        raise ValueError(f"unknown placement {choice!r}: {SHAPES + LAYOUTS}")
    return (choice,)


LAYOUTS = ("bidirectional", "table")
"""The placements the search takes as an IR placement (`Problem.layout`): DualPipe's and
Chimera's two pipes, and a `.sched` file's table (`--placement-from`)."""
