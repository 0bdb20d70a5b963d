"""Local search on the order itself: move one op of one rank, keep the move if not worse.

The list scheduler only produces orders its rules can express; this polish reaches the
others. A step takes a random op of a random rank and moves it a few places earlier or later
on its rank; the move is dropped at once if it breaks microbatch order within its kind and
stage (the search's FIFO space) or pushes the rank's running memory over the cap; otherwise
the order is timed by `Timer` (the reference replay's rules, on integer op ids, about ten
times faster than `evaluate`; a test checks they agree) and kept if its score is not worse
(a tie moves along the plateau; the sum of the ranks' finishing times breaks ties).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from pipecc.ir.ops import Kind
from pipecc.search.problem import SPLIT, Order, Problem, SearchOp

Score = tuple[float, float]
WINDOW = 6  # how far one step moves an op
_KIND_INDEX = {Kind.F: 0, Kind.I: 1, Kind.W: 2}


class Timer:
    """Times orders of one problem: op id = (kind·S + stage)·M + mb."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        stages, m = problem.num_stages, problem.microbatches
        self.m, self.stages = m, stages
        count = 3 * stages * m
        self.duration = [0.0] * count
        self.delta = [0.0] * count
        self.preds: list[tuple[tuple[int, float], ...]] = [()] * count
        for stage in range(stages):
            for mb in range(m):
                for kind in SPLIT:
                    op = SearchOp(kind, stage, mb)
                    g = self.op_id(op)
                    self.duration[g] = problem.duration(op)
                    self.delta[g] = problem.mem_delta(op)
                    self.preds[g] = self._preds(op)

    def op_id(self, op: SearchOp) -> int:
        return (_KIND_INDEX[op.kind] * self.stages + op.stage) * self.m + op.mb

    def _preds(self, op: SearchOp) -> tuple[tuple[int, float], ...]:
        p = self.problem
        kind, stage, mb = op
        if kind is Kind.F:
            needs = [] if p.is_first(stage) else [SearchOp(Kind.F, stage - 1, mb)]
        elif kind is Kind.W:
            needs = [SearchOp(Kind.I, stage, mb)]
        else:
            needs = [SearchOp(Kind.F, stage, mb)]
            if not p.is_last(stage):
                needs.append(SearchOp(Kind.I, stage + 1, mb))
        return tuple(
            (self.op_id(n), 0.0 if p.rank_of(n.stage) == p.rank_of(stage) else p.comm)
            for n in needs
        )

    def run(self, ranks: list[list[int]]) -> tuple[float, float, float] | None:
        """(makespan, span, sum of the ranks' last ends), or None when the order stalls."""
        end = [-1.0] * len(self.duration)
        heads = [0] * len(ranks)
        free = [0.0] * len(ranks)
        first = [0.0] * len(ranks)
        waiting: dict[int, int] = {}  # op id -> the rank whose head waits for it
        todo = list(range(len(ranks)))
        duration, preds = self.duration, self.preds
        while todo:
            r = todo.pop()
            ops, h, t = ranks[r], heads[r], free[r]
            while h < len(ops):
                g = ops[h]
                ready = 0.0
                blocked = -1
                for pred, latency in preds[g]:
                    done = end[pred]
                    if done < 0:
                        blocked = pred
                        break
                    ready = max(ready, done + latency)
                if blocked >= 0:
                    waiting[blocked] = r
                    break
                start = t if t > ready else ready
                if h == 0:
                    first[r] = start
                t = end[g] = start + duration[g]
                h += 1
                woken = waiting.pop(g, None)
                if woken is not None:
                    todo.append(woken)
            heads[r], free[r] = h, t
        if any(h < len(ops) for h, ops in zip(heads, ranks, strict=True)):
            return None
        return (max(free), max(f - s for f, s in zip(free, first, strict=True)), sum(free))


class Polisher:
    """The local search on one problem's orders."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.timer = Timer(problem)
        self.ops = {
            self.timer.op_id(op): op for r in range(problem.ranks) for op in problem.ops_of(r)
        }
        self.family = {g: (op.kind, op.stage) for g, op in self.ops.items()}
        self.span = problem.objective.value == "span"

    def score(self, ranks: list[list[int]]) -> Score:
        timed = self.timer.run(ranks)
        if timed is None:
            return (math.inf, math.inf)
        return (timed[1] if self.span else timed[0], timed[2])

    def fits(self, ops: list[int]) -> bool:
        total, cap, delta = 0.0, self.problem.cap + 1e-9, self.timer.delta
        for g in ops:
            total += delta[g]
            if total > cap:
                return False
        return True

    def step(self, ranks: list[list[int]], rng: random.Random) -> tuple[int, list[int]] | None:
        """A random move: (rank, its new op list), or None if it leaves the space."""
        r = rng.randrange(len(ranks))
        ops = ranks[r]
        i = rng.randrange(len(ops))
        j = min(len(ops) - 1, max(0, i + rng.choice((-1, 1)) * rng.randint(1, WINDOW)))
        if i == j:
            return None
        g = ops[i]
        lo, hi = (j, i) if j < i else (i + 1, j + 1)
        if any(self.family[x] == self.family[g] for x in ops[lo:hi]):
            return None  # would pass an op of its own kind and stage
        moved = ops[:i] + ops[i + 1 :]
        moved.insert(j, g)
        return (r, moved) if self.fits(moved) else None

    def polish(
        self, order: Order, rng: random.Random, steps: int, stop: Callable[[Score], bool]
    ) -> tuple[Order, Score, int]:
        """Up to `steps` moves from `order`; returns the best order, its score, moves tried."""
        ranks = [[self.timer.op_id(op) for op in ops] for ops in order]
        current = best = self.score(ranks)
        best_ranks = [list(ops) for ops in ranks]
        tried = 0
        while tried < steps and not stop(best):
            tried += 1
            move = self.step(ranks, rng)
            if move is None:
                continue
            r, ops = move
            previous, ranks[r] = ranks[r], ops
            score = self.score(ranks)
            if score <= current:
                current = score
                if score < best:
                    best, best_ranks = score, [list(x) for x in ranks]
            else:
                ranks[r] = previous
        order = tuple(tuple(self.ops[g] for g in ops) for ops in best_ranks)
        return order, best, tried
