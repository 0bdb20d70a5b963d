"""A lower bound on the best order's objective (docs/search-bounds.md derives it).

The bound relaxes the problem to one machine at a time. Every op gets a *head* (the earliest
it can start) and a *tail* (the least time that must follow its end) from the longest paths
of a precedence graph, and each rank is then a single machine with release dates and
delivery times, whose preemptive optimum (Jackson's rule: run the released op with the
longest tail) is a lower bound on any order of that rank. The graph holds:

- data edges: F(s-1, m) → F(s, m), F(S-1, m) → I(S-1, m), I(s+1, m) → I(s, m),
  F(s, m) → I(s, m), I(s, m) → W(s, m), with the latency `comm` between ranks;
- FIFO edges per stage and kind, K(s, m-1) → K(s, m): microbatches have equal costs, so any
  order is, up to renaming microbatches, one in which each kind runs in microbatch order;
- memory edges: under the cap, F(s, m) can only run once enough earlier microbatches have
  run their W (or I) on stage s to free the memory it needs (on a V's upper stage, counting
  what the rank's lower stage holds too).

Beside it, a memory-time bound (Little's law): each microbatch holds its forward's memory
at least from its F to its I, the round trip through the stages above, and all of it fits
under the cap on its rank. The bound is the largest of these over the ranks.
"""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple

from pipecc.ir.ops import Kind
from pipecc.search.problem import Objective, Problem, SearchOp

_KINDS = (Kind.F, Kind.I, Kind.W)

_EPS = 1e-9


class LowerBound(NamedTuple):
    """The bound and its parts (each a valid bound on its own)."""

    value: float
    busy: float  # the busiest rank's work
    machine: float  # the single-machine bound with heads, tails and memory edges
    memory: float  # the memory-time bound (0 without a binding cap)


class _Graph(NamedTuple):
    """The precedence graph in a topological order; an op is `(kind * S + stage) * M + mb`."""

    order: tuple[int, ...]
    preds: tuple[tuple[tuple[int, float], ...], ...]  # (pred, its duration + the latency)
    succs: tuple[tuple[tuple[int, float], ...], ...]  # (succ, the latency + its duration)
    duration: tuple[float, ...]
    rank: tuple[int, ...]


def lower_bound(problem: Problem) -> float:
    """A lower bound on `problem`'s objective over every order that fits its cap.

    math.inf when no order fits the cap (a forward needs more memory than it can ever get)."""
    return bound_parts(problem).value


def bound_parts(problem: Problem) -> LowerBound:
    """The lower bound with its parts."""
    busy = max(_busy(problem, rank) for rank in range(problem.ranks))
    graph = _graph(problem)
    if graph is None:
        return LowerBound(math.inf, busy, math.inf, math.inf)
    if problem.objective is Objective.MAKESPAN:
        machine = _machine_makespan(problem, graph)
    else:
        machine = max(_machine_span(problem, graph, rank) for rank in range(problem.ranks))
    heads = _heads(graph)
    memory = max(_memory_time(problem, heads, rank) for rank in range(problem.ranks))
    return LowerBound(max(busy, machine, memory), busy, machine, memory)


def memory_precedences(problem: Problem) -> list[tuple[SearchOp, SearchOp]] | None:
    """The memory edges of the bound's graph as (earlier, later) op pairs: every order
    that fits the cap runs the first before the second. None when no order fits."""
    pairs: list[tuple[SearchOp, SearchOp]] = []
    for stage in range(problem.num_stages):
        for mb in range(problem.microbatches):
            preds = _memory_preds(problem, stage, mb)
            if preds is None:
                return None
            later = SearchOp(Kind.F, stage, mb)
            pairs.extend((_search_op(problem, pred), later) for pred, _ in preds)
    return pairs


def earliest_starts(problem: Problem) -> dict[SearchOp, float] | None:
    """Each op's head: no order that fits the cap starts it earlier. None when none fits."""
    graph = _graph(problem)
    if graph is None:
        return None
    heads = _heads(graph)
    return {_search_op(problem, op): heads[op] for op in range(len(heads))}


def _search_op(problem: Problem, op: int) -> SearchOp:
    rest, mb = divmod(op, problem.microbatches)
    kind, stage = divmod(rest, problem.num_stages)
    return SearchOp(_KINDS[kind], stage, mb)


def _busy(problem: Problem, rank: int) -> float:
    return sum(problem.duration(op) for op in problem.ops_of(rank))


def _op_id(problem: Problem, kind: int, stage: int, mb: int) -> int:
    return (kind * problem.num_stages + stage) * problem.microbatches + mb


def _latency(problem: Problem, a: int, b: int) -> float:
    return 0.0 if problem.rank_of(a) == problem.rank_of(b) else problem.comm


def _data_preds(problem: Problem, kind: int, stage: int, mb: int) -> list[tuple[int, float]]:
    """Data and FIFO predecessors of one op (kinds 0, 1, 2 = F, I, W)."""
    preds: list[tuple[int, float]] = []
    if mb > 0:
        preds.append((_op_id(problem, kind, stage, mb - 1), 0.0))
    if kind == 0 and not problem.is_first(stage):
        preds.append((_op_id(problem, 0, stage - 1, mb), _latency(problem, stage - 1, stage)))
    if kind == 1:
        preds.append((_op_id(problem, 0, stage, mb), 0.0))
        if not problem.is_last(stage):
            lat = _latency(problem, stage + 1, stage)
            preds.append((_op_id(problem, 1, stage + 1, mb), lat))
    if kind == 2:
        preds.append((_op_id(problem, 1, stage, mb), 0.0))
    return preds


def _memory_preds(problem: Problem, stage: int, mb: int) -> list[tuple[int, float]] | None:
    """The frees F(stage, mb) must wait for; None when it can never fit the cap.

    Each constraint (kind, freeing stage, held, free) says: just after F(stage, mb) the rank
    holds at least `held` minus `free` for each op of that kind already run on the freeing
    stage, and this must be ≤ cap; by FIFO, the op of microbatch n-1 comes first, where n is
    the count needed. All counts are ≤ mb, so a larger n means that no order fits."""
    preds: list[tuple[int, float]] = []
    for kind, freeing, held, free in _memory_constraints(problem, stage, mb):
        over = held - problem.cap
        if over <= _EPS:
            continue
        if free <= _EPS:
            return None
        needed = math.ceil(over / free - _EPS)
        if needed > mb:
            return None
        preds.append((_op_id(problem, kind, freeing, needed - 1), 0.0))
    return preds


def _memory_constraints(
    problem: Problem, stage: int, m: int
) -> list[tuple[int, int, float, float]]:
    """Lower bounds on the memory held just after F(stage, m), each linear in one count.

    Stage s alone holds (m+1)·a + n_I·b + n_W·d (a, b, d: its F, I, W deltas; n_W ≤ n_I ≤ m
    the I's and W's of its microbatches ≤ m run so far), and the rank's other stage ≥ 0.
    On a V's upper stage h, the lower stage l of the same rank has also run F for
    microbatches 0..m (they feed h), and its I's follow h's (n_I,l ≤ n_I,h): so together
    (m+1)(a_l + a_h) + n_I,l·b_l + n_W,l·d_l + n_I,h·b_h + n_W,h·d_h, bounded through one
    count at a time. Only where a > 0 ≥ b, d and each microbatch's running total is ≥ 0."""
    deltas = {
        s: (problem.mem_f[s], problem.mem_i[s], problem.mem_w[s]) for s in range(problem.num_stages)
    }
    a, b, d = deltas[stage]
    if not _memory_model_applies(a, b, d):
        return []
    found = [(2, stage, (m + 1) * a + m * b, -d), (1, stage, (m + 1) * a, -(b + d))]
    lower = problem.stages_of(problem.rank_of(stage))[0]
    if lower == stage or not _feeds(problem, lower, stage):
        return found
    if not _memory_model_applies(*deltas[lower]):
        return found
    al, bl, dl = deltas[lower]
    both = (m + 1) * (a + al)
    found += [
        (1, stage, both, -(bl + dl + b + d)),
        (2, lower, both + m * (bl + b + d), -dl),
        (1, lower, both + m * (b + d), -(bl + dl)),
        (2, stage, both + m * (bl + dl + b), -d),
    ]
    return found


def _feeds(problem: Problem, lower: int, upper: int) -> bool:
    """The forwards of `lower` feed those of `upper` (one pipe, lower before upper): not the
    two pipes of a bidirectional rank, whose stages hold unrelated microbatches."""
    return problem.ir_stage(lower)[0] == problem.ir_stage(upper)[0]


def _memory_model_applies(a: float, b: float, d: float) -> bool:
    return a > _EPS and b <= _EPS and d <= _EPS and a + b >= -_EPS and a + b + d >= -_EPS


def _graph(problem: Problem) -> _Graph | None:
    """The precedence graph, or None when the cap rules out every order."""
    preds = _all_preds(problem)
    if preds is None:
        return None
    duration = [0.0] * len(preds)
    rank = [0] * len(preds)
    for kind, table in enumerate((problem.f, problem.i, problem.w)):
        for stage in range(problem.num_stages):
            for mb in range(problem.microbatches):
                duration[_op_id(problem, kind, stage, mb)] = table[stage]
                rank[_op_id(problem, kind, stage, mb)] = problem.rank_of(stage)
    weighted = [[(pred, duration[pred] + lat) for pred, lat in incoming] for incoming in preds]
    succs: list[list[tuple[int, float]]] = [[] for _ in preds]
    for op, incoming in enumerate(preds):
        for pred, lat in incoming:
            succs[pred].append((op, lat + duration[op]))
    return _Graph(
        _topological(problem),
        tuple(map(tuple, weighted)),
        tuple(map(tuple, succs)),
        tuple(duration),
        tuple(rank),
    )


def _all_preds(problem: Problem) -> list[list[tuple[int, float]]] | None:
    """Every op's predecessors (data, FIFO, memory), or None when the cap rules out all."""
    preds: list[list[tuple[int, float]]] = [
        [] for _ in range(3 * problem.num_stages * problem.microbatches)
    ]
    for kind in range(3):
        for stage in range(problem.num_stages):
            for mb in range(problem.microbatches):
                op = _op_id(problem, kind, stage, mb)
                preds[op] = _data_preds(problem, kind, stage, mb)
                extra = _memory_preds(problem, stage, mb) if kind == 0 else []
                if extra is None:
                    return None
                preds[op].extend(extra)
    return preds


def _topological(problem: Problem) -> tuple[int, ...]:
    """Microbatch by microbatch: F up the stages, I down, then W (memory edges point from
    an earlier microbatch's W or I, so this order respects every edge)."""
    stages = range(problem.num_stages)
    order: list[int] = []
    for mb in range(problem.microbatches):
        order.extend(_op_id(problem, 0, s, mb) for s in stages)
        order.extend(_op_id(problem, 1, s, mb) for s in reversed(stages))
        order.extend(_op_id(problem, 2, s, mb) for s in stages)
    return tuple(order)


def _heads(graph: _Graph, source: int | None = None) -> list[float]:
    """Earliest starts: from time 0 for every op, or relative to `source`'s start (-inf for
    ops that do not follow it)."""
    heads = [0.0 if source is None else -math.inf] * len(graph.duration)
    if source is not None:
        heads[source] = 0.0
    preds = graph.preds
    for op in graph.order:
        best = heads[op]
        for pred, weight in preds[op]:
            if heads[pred] + weight > best:
                best = heads[pred] + weight
        heads[op] = best
    return heads


def _tails(graph: _Graph, rank: int | None = None) -> list[float]:
    """Least time after each op's end: to the end of the step, or to the end of `rank`'s
    last op (-inf for ops with no path back to `rank`)."""
    count = len(graph.duration)
    if rank is None:
        tails = [0.0] * count
    else:
        tails = [0.0 if graph.rank[op] == rank else -math.inf for op in range(count)]
    succs = graph.succs
    for op in reversed(graph.order):
        best = tails[op]
        for succ, weight in succs[op]:
            if tails[succ] + weight > best:
                best = tails[succ] + weight
        tails[op] = best
    return tails


def _jackson(jobs: list[tuple[float, float, float]]) -> float:
    """Optimum of one machine with preemption: max over jobs of end + tail.

    `jobs` are (release, duration, tail); at every release the machine runs the released
    job with the longest tail (Jackson's rule, optimal for the preemptive relaxation)."""
    jobs = sorted(jobs)
    ready: list[tuple[float, float]] = []  # (-tail, remaining)
    time, best, index = 0.0, 0.0, 0
    while index < len(jobs) or ready:
        if not ready:
            time = max(time, jobs[index][0])
        while index < len(jobs) and jobs[index][0] <= time + _EPS:
            release, duration, tail = jobs[index]
            heapq.heappush(ready, (-tail, duration))
            index += 1
        neg_tail, remaining = heapq.heappop(ready)
        next_release = jobs[index][0] if index < len(jobs) else math.inf
        run = min(remaining, next_release - time)
        time += run
        if remaining - run > _EPS:
            heapq.heappush(ready, (neg_tail, remaining - run))
        else:
            best = max(best, time - neg_tail)
    return best


def _machine_makespan(problem: Problem, graph: _Graph) -> float:
    heads, tails = _heads(graph), _tails(graph)
    best = 0.0
    for rank in range(problem.ranks):
        jobs = [
            (heads[op], graph.duration[op], tails[op])
            for op in range(len(graph.duration))
            if graph.rank[op] == rank
        ]
        best = max(best, _jackson(jobs))
    return best


def _machine_span(problem: Problem, graph: _Graph, rank: int) -> float:
    """The single-machine bound on `rank`'s span: times are measured from its first op,
    which is F of its lowest stage, microbatch 0 (every op of the rank follows it)."""
    first = _op_id(problem, 0, problem.stages_of(rank)[0], 0)
    heads, tails = _heads(graph, first), _tails(graph, rank)
    jobs = [
        (heads[op], graph.duration[op], tails[op])
        for op in range(len(graph.duration))
        if graph.rank[op] == rank
    ]
    return _jackson(jobs)


def _memory_time(problem: Problem, heads: list[float], rank: int) -> float:
    """Little's law on `rank`: Σ over its microbatches of memory × holding time ≤ cap × the
    window from its first op's start to its last W's start.

    A microbatch of stage s holds a from its F's start to its I's start (at least F's
    duration and the round trip through the stages above) and a + b from then to its W's
    start (at least I's duration)."""
    if problem.cap <= _EPS:
        return 0.0
    area = 0.0
    for stage in problem.stages_of(rank):
        a, b, d = problem.mem_f[stage], problem.mem_i[stage], problem.mem_w[stage]
        if not _memory_model_applies(a, b, d):
            return 0.0
        round_trip = _round_trip(problem, stage)
        area += problem.microbatches * (
            a * (problem.f[stage] + round_trip) + (a + b) * problem.i[stage]
        )
    start = min(heads[_op_id(problem, 0, s, 0)] for s in problem.stages_of(rank))
    if problem.objective is Objective.SPAN:
        start = 0.0
    last_w = min(problem.w[s] for s in problem.stages_of(rank))
    return start + area / problem.cap + last_w


def _round_trip(problem: Problem, stage: int) -> float:
    """Least time from the end of F(stage, m) to the start of I(stage, m)."""
    total = 0.0
    above = stage + 1
    while not problem.is_last(above - 1):
        link = _latency(problem, above - 1, above)
        total += 2 * link + problem.f[above] + problem.i[above]
        above += 1
    return total
