"""List scheduling: a policy (per-rank knobs) → an order, timed as `evaluate` times it.

The decoder replays the latency model of `pipecc.search.problem` event by event, in time
order. Whenever a rank is free it picks one of the ops whose inputs have arrived, by its
`RankPolicy`, and starts it at once (or idles until the next message). Ops of one kind and
stage run in microbatch order (FIFO, as every published schedule does), so a rank's choice is
only which (kind, stage) goes next. Because each op starts at max(rank free, inputs arrived),
the times it produces are exactly those `evaluate` computes for the order it returns (a test
checks this); the order is valid by construction and the memory cap holds at every step:

- an F is started only if the rank's memory, after it and after the later forwards that the
  microbatches already in flight on this rank still owe it (the V shape's second chunk),
  stays within the cap: so a started microbatch can always finish its forwards here;
- when nothing else may run, a pending W frees memory.

A policy that cannot finish (a rank waits forever) decodes to None.
"""

from __future__ import annotations

import enum
import heapq
import math
from typing import NamedTuple

from pipecc.ir.ops import Kind
from pipecc.search.problem import SPLIT, Evaluation, Objective, Order, Problem, SearchOp

EPS = 1e-9
NO_LIMIT = 1 << 30
F, I, W = SPLIT  # noqa: E741


class Reserve(enum.Enum):
    """How much memory a new microbatch's first forward on a V rank leaves free."""

    ALL = "all"  # for the later forward of every microbatch in flight: never stalls
    ONE = "one"  # for one later forward (the oldest microbatch's: W frees it again)
    NONE = "none"  # nothing: a tight cap can stall (the policy then decodes to None)


class RankPolicy(NamedTuple):
    """How one rank picks its next op.

    `warmup`: while fewer microbatches than this are in flight on the rank (its first
    stage's F done, its I not), a new microbatch's F goes before an I; `wlimit`: a W is
    forced once more than this many are pending (0: each I is followed by its W, as 1F1B's
    B); `gap_f`: a new microbatch's F may fill a gap where no I has
    arrived (else the rank waits for the I, or runs a W); `late_first`: on the V shape, the
    later stage's (chunk 1's) F goes before an I, and its I before the first stage's (else
    after the I's, first stage first); `reserve`: the room a new microbatch's F keeps for
    the later stage's forwards on this rank (the V shape).
    """

    warmup: int
    wlimit: int = NO_LIMIT
    gap_f: bool = True
    late_first: bool = True
    reserve: Reserve = Reserve.ALL
    gap_w: bool = True


Policy = tuple[RankPolicy, ...]


class Decoded(NamedTuple):
    """The order a policy produces and its evaluation."""

    order: Order
    evaluation: Evaluation


class _Rank:
    """A rank's state during decoding."""

    __slots__ = (
        "stages",
        "nf",
        "ni",
        "nw",
        "pending",
        "mem",
        "free",
        "ops",
        "starts",
        "ends",
        "peak",
    )

    def __init__(self, stages: tuple[int, ...]) -> None:
        self.stages = stages
        self.nf = [0] * len(stages)  # next microbatch of each of the rank's stages, per kind
        self.ni = [0] * len(stages)
        self.nw = [0] * len(stages)
        self.pending = 0  # W's whose I has run
        self.mem = 0.0
        self.peak = 0.0
        self.free = 0.0
        self.ops: list[SearchOp] = []
        self.starts: list[float] = []
        self.ends: list[float] = []


class _Decoder:
    """One decoding run (the state of all ranks and the finished ops' end times)."""

    def __init__(self, problem: Problem, policy: Policy, cutoff: float) -> None:
        self.p = problem
        self.policy = policy
        self.cutoff = cutoff + EPS
        self.span = problem.objective is Objective.SPAN
        self.over = False  # an op ended past the cutoff
        stages, m = problem.num_stages, problem.microbatches
        self.m = m
        self.first = [problem.is_first(s) for s in range(stages)]
        self.final = [problem.is_last(s) for s in range(stages)]
        self.rank_of = [problem.rank_of(s) for s in range(stages)]
        self.fend = [-1.0] * (stages * m)  # end time of F(s, mb) at s·M + mb; -1: not yet
        self.iend = [-1.0] * (stages * m)
        self.ranks = [_Rank(problem.stages_of(r)) for r in range(problem.ranks)]
        self.events: list[tuple[float, int]] = [(0.0, r) for r in range(problem.ranks)]
        self.cap = problem.cap + EPS
        self.mem_f, self.mem_i = list(problem.mem_f), list(problem.mem_i)
        cross = [  # the latency of the input of F(s) (from s-1) and of I(s) (from s+1)
            problem.comm if a != b else 0.0
            for a, b in zip(self.rank_of, self.rank_of[1:], strict=False)
        ]
        self.lat_f = [0.0, *cross]
        self.lat_i = [*cross, 0.0]
        self.reserve_one = [  # Reserve.ONE: room for one forward (and I) of the later stage
            problem.mem_f[stages[-1]] + max(0.0, problem.mem_i[stages[-1]])
            for stages in map(problem.stages_of, range(problem.ranks))
        ]

    def run(self) -> Decoded | None:
        events = self.events
        while events:
            time, r = heapq.heappop(events)
            rank = self.ranks[r]
            if time < rank.free - EPS:
                continue
            choice = self.choose(r, rank, max(time, rank.free))
            if choice is not None:
                self.start(r, rank, choice, max(time, rank.free))
                if self.over:
                    return None
        return self.result()

    def ready_f(self, r: int, rank: _Rank, c: int, now: float) -> bool:
        stage, mb = rank.stages[c], rank.nf[c]
        if mb >= self.m:
            return False
        if not self.first[stage]:
            end = self.fend[(stage - 1) * self.m + mb]
            if end < 0 or end + self.lat_f[stage] > now + EPS:
                return False
        need = rank.mem + self.mem_f[stage]
        if c == 0 and len(rank.stages) > 1:
            mode = self.policy[r].reserve
            if mode is Reserve.ONE:
                need += self.reserve_one[r]
            elif mode is Reserve.ALL:
                need += max(0.0, self.mem_f[rank.stages[-1]] * (rank.nf[0] + 1 - rank.nf[-1]))
        return need <= self.cap

    def ready_i(self, r: int, rank: _Rank, c: int, now: float) -> bool:
        stage, mb = rank.stages[c], rank.ni[c]
        if mb >= rank.nf[c]:
            return False
        if not self.final[stage]:
            end = self.iend[(stage + 1) * self.m + mb]
            if end < 0 or end + self.lat_i[stage] > now + EPS:
                return False
        return rank.mem + self.mem_i[stage] <= self.cap

    def choose(self, r: int, rank: _Rank, now: float) -> tuple[Kind, int] | None:
        """The policy's pick among the ops that may start now (None: idle)."""
        pol = self.policy[r]
        nw, ni = rank.nw, rank.ni
        two = len(ni) > 1
        w_chunk = 0 if nw[0] < ni[0] else 1 if two and nw[1] < ni[1] else -1
        if w_chunk >= 0 and rank.pending > pol.wlimit:
            return W, w_chunk
        new_f = self.ready_f(r, rank, 0, now)
        if new_f and rank.nf[0] - ni[0] < pol.warmup:
            return F, 0
        more_f = two and self.ready_f(r, rank, 1, now)
        if more_f and pol.late_first:
            return F, 1
        if two and pol.late_first and self.ready_i(r, rank, 1, now):
            return I, 1
        if self.ready_i(r, rank, 0, now):
            return I, 0
        if two and not pol.late_first and self.ready_i(r, rank, 1, now):
            return I, 1
        if more_f:
            return F, 1
        if new_f and pol.gap_f:
            return F, 0
        if w_chunk >= 0 and (pol.gap_w or self.w_due(rank)):
            return W, w_chunk
        return None

    def w_due(self, rank: _Rank) -> bool:
        """A pending W must run even in a policy that keeps W's out of gaps: memory holds
        the next forward back, or the rank has no F or I left."""
        room = self.p.cap - rank.mem
        if any(room < self.p.mem_f[s] - EPS for s in rank.stages):
            return True
        return all(n >= self.m for n in rank.ni)

    def start(self, r: int, rank: _Rank, choice: tuple[Kind, int], now: float) -> None:
        kind, c = choice
        stage = rank.stages[c]
        p, m = self.p, self.m
        if kind is Kind.F:
            mb, rank.nf[c] = rank.nf[c], rank.nf[c] + 1
            end = now + p.f[stage]
            rank.mem += p.mem_f[stage]
            self.fend[stage * m + mb] = end
            consumer = r if self.final[stage] else self.rank_of[stage + 1]
        elif kind is Kind.I:
            mb, rank.ni[c] = rank.ni[c], rank.ni[c] + 1
            rank.pending += 1
            end = now + p.i[stage]
            rank.mem += p.mem_i[stage]
            self.iend[stage * m + mb] = end
            consumer = r if self.first[stage] else self.rank_of[stage - 1]
        else:
            mb, rank.nw[c] = rank.nw[c], rank.nw[c] + 1
            rank.pending -= 1
            end = now + p.w[stage]
            rank.mem += p.mem_w[stage]
            consumer = r
        rank.peak = max(rank.peak, rank.mem)
        rank.free = end
        if end - (rank.starts[0] if self.span and rank.starts else 0.0) > self.cutoff:
            self.over = True
        rank.ops.append(SearchOp(kind, stage, mb))
        rank.starts.append(now)
        rank.ends.append(end)
        heapq.heappush(self.events, (end, r))
        if consumer != r:
            heapq.heappush(self.events, (end + p.comm, consumer))

    def result(self) -> Decoded | None:
        total = 3 * self.m
        if any(len(rank.ops) != total * len(rank.stages) for rank in self.ranks):
            return None
        ranks = self.ranks
        evaluation = Evaluation(
            makespan=max(rank.free for rank in ranks),
            span=max(rank.ends[-1] - rank.starts[0] for rank in ranks),
            peak=tuple(rank.peak for rank in ranks),
            start=tuple(tuple(rank.starts) for rank in ranks),
            end=tuple(tuple(rank.ends) for rank in ranks),
        )
        return Decoded(tuple(tuple(rank.ops) for rank in ranks), evaluation)


def decode(problem: Problem, policy: Policy, cutoff: float = math.inf) -> Decoded | None:
    """The order `policy` produces for `problem`, with its evaluation; None if it stalls,
    or as soon as its objective is sure to exceed `cutoff` (an op ends past it)."""
    if len(policy) != problem.ranks:
        raise ValueError(f"policy has {len(policy)} ranks, the problem {problem.ranks}")
    return _Decoder(problem, policy, cutoff).run()
