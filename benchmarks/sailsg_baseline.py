"""sail-sg's zero-bubble auto-scheduler heuristic, reimplemented as a baseline for the search.

    .venv/bin/python benchmarks/sailsg_baseline.py -P 4 -M 8 --cost F=1,I=1,W=1,comm=1 --memory 2

(benchmarks/sailsg_upstream.py runs upstream's own code from a checkout against this one.)

The heuristic of `scheduler/zb.py` in sail-sg/zero-bubble-pipeline-parallelism, rewritten from
its published algorithm for pipecc's search problem (loop placement: stage s on rank s). It
builds one order per stage greedily, microbatch by microbatch, timing each op as it places
it (an op ends at max(its rank's end, its input's end + comm) + its duration):

- microbatch 0: one F on every stage, then warm-up forwards. Walking up from the last stage,
  a stage takes more forwards (within its memory) while they fit before the gradient of
  microbatch 0 comes back: before it arrives (`fill_to_first_backward`, switch 1), or as long
  as the stage is not yet past its arrival (otherwise). Each stage then keeps fewer warm-up
  forwards than the stage before it. Then the backward (the zero-bubble I) of microbatch 0
  down the stages.
- every later microbatch: each stage wants one more F. With `prefer_backward` (switch 2), a
  stage at least two forwards ahead of the next skips its F when the next stage's F and I
  would end before it could, or when the wait it would cause is within the largest idle any
  stage has collected. A stage takes an F only if the next one does. Before an F (and
  before an I), W's are forced while memory is short, W's are placed into the wait for the
  input if they fit in it whole, and one more W is placed when the stage would otherwise
  idle: always when that idle exceeds the largest idle collected elsewhere, else only with
  `fill_gaps_greedily` (switch 3). After microbatch M-1's I on stage 0 its W's come first.
- remaining W's end every stage's order.

All 8 combinations of the switches are tried; the best by span (the largest, over stages, of
the last W's end minus the first F's start) is kept. A combination that cannot fit the cap
(memory short with no W left to run) is dropped; the upstream code raises there instead.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipecc.ir.ops import Kind
from pipecc.search.problem import (  # noqa: E402
    Objective,
    Order,
    Problem,
    SearchOp,
    evaluate,
    fits,
)
from pipecc.semantics.costs import CostModel, StageCost, parse_cost_flag  # noqa: E402

_KINDS = (Kind.F, Kind.I, Kind.W)


class Switches(NamedTuple):
    """The heuristic's three switches (upstream: allow_bubble_before_first_b, prioritize_b,
    no_bubble_greedy)."""

    fill_to_first_backward: bool
    prefer_backward: bool
    fill_gaps_greedily: bool


class SailResult(NamedTuple):
    """The heuristic's best order, the span it reports for it, and the switches that won."""

    order: Order
    span: float
    switches: Switches


class MemoryShort(ValueError):
    """A stage needs memory and has no W left to free it."""


class _Greedy:
    """The state of one run of the heuristic: per stage, the ops placed so far."""

    def __init__(self, problem: Problem, switches: Switches) -> None:
        self.p = problem
        self.sw = switches
        stages = problem.num_stages
        self.count = [[0, 0, 0] for _ in range(stages)]  # F, I, W placed per stage
        self.end = [0.0] * stages  # when each stage is free
        self.memory = [0.0] * stages
        self.idle = [0.0] * stages  # waits collected after the stage's first F
        self.done: dict[SearchOp, float] = {}
        self.order: list[list[SearchOp]] = [[] for _ in range(stages)]

    def cost(self, kind: int, stage: int) -> float:
        return (self.p.f, self.p.i, self.p.w)[kind][stage]

    def mem(self, kind: int, stage: int) -> float:
        return (self.p.mem_f, self.p.mem_i, self.p.mem_w)[kind][stage]

    def finished(self, kind: int, stage: int, mb: int) -> float:
        """When an op ended; 0 for one not placed yet (as upstream's zero-filled table)."""
        return self.done.get(SearchOp(_KINDS[kind], stage, mb), 0.0)

    def put(self, stage: int, kind: int) -> None:
        mb = self.count[stage][kind]
        cost = self.cost(kind, stage)
        free_end = self.end[stage] + cost
        finish = free_end
        if kind == 0 and stage > 0:
            finish = max(finish, self.finished(0, stage - 1, mb) + self.p.comm + cost)
        if kind == 1 and stage < self.p.num_stages - 1:
            finish = max(finish, self.finished(1, stage + 1, mb) + self.p.comm + cost)
        if self.count[stage][0] > 0:
            self.idle[stage] += finish - free_end
        self.end[stage] = finish
        op = SearchOp(_KINDS[kind], stage, mb)
        self.done[op] = finish
        self.memory[stage] += self.mem(kind, stage)
        self.count[stage][kind] += 1
        self.order[stage].append(op)

    def pending_w(self, stage: int) -> bool:
        return self.count[stage][2] < self.count[stage][1]

    def free_memory_for(self, stage: int, kind: int) -> None:
        """Force W's until `kind`'s op fits the cap."""
        while self.memory[stage] + self.mem(kind, stage) > self.p.cap + 1e-9:
            if not self.pending_w(stage):
                raise MemoryShort(f"stage {stage} cannot fit its memory")
            self.put(stage, 2)

    def fill_wait(self, stage: int, arrival: float) -> None:
        """Place W's into the wait for an input arriving at `arrival`."""
        while self.pending_w(stage) and self.end[stage] + self.cost(2, stage) <= arrival:
            self.put(stage, 2)
        if self.pending_w(stage) and self.end[stage] < arrival:
            within = arrival - self.end[stage] <= max(self.idle) - self.idle[stage]
            if not within or self.sw.fill_gaps_greedily:
                self.put(stage, 2)

    def warm_up(self) -> None:
        """Microbatch 0: an F everywhere, the warm-up forwards, then I down the stages."""
        stages = self.p.num_stages
        for stage in range(stages):
            self.put(stage, 0)
        extra = self.warm_up_forwards()
        for stage in range(1, stages):
            while (
                extra[stage] > 0
                and extra[stage] >= extra[stage - 1]
                and self.count[stage][0] + extra[stage] < self.p.microbatches
            ):
                extra[stage] -= 1
        for stage in range(stages):
            for _ in range(extra[stage]):
                self.put(stage, 0)
        for stage in reversed(range(stages)):
            self.put(stage, 1)

    def warm_up_forwards(self) -> list[int]:
        """How many more forwards each stage can run before microbatch 0's gradient."""
        stages, comm = self.p.num_stages, self.p.comm
        extra = [0] * stages
        back = self.finished(0, stages - 1, 0) + self.cost(1, stages - 1)
        for stage in reversed(range(stages - 1)):
            memory, busy = self.memory[stage], self.end[stage]
            while (
                self.count[stage][0] + extra[stage] < self.p.microbatches
                and memory + self.mem(0, stage) <= self.p.cap + 1e-9
            ):
                if self.sw.fill_to_first_backward:
                    if busy + self.cost(0, stage) > back + comm:
                        break
                elif busy >= back + comm:
                    break
                memory += self.mem(0, stage)
                busy += self.cost(0, stage)
                extra[stage] += 1
            back = max(busy, back + comm) + self.cost(1, stage)
        return extra

    def wants_forward(self, stage: int) -> bool:
        """Whether `stage` takes an F for the current microbatch (before the min rule)."""
        counts = self.count
        if counts[stage][0] >= self.p.microbatches:
            return False
        nxt = stage + 1
        if not (self.sw.prefer_backward and nxt < self.p.num_stages):
            return True
        if counts[stage][0] < counts[nxt][0] + 2:
            return True
        after_next = self.end[nxt] + self.cost(0, nxt) + self.cost(1, nxt) + self.p.comm
        if self.end[stage] >= after_next:
            return False
        forced_w, memory, pending = 0.0, self.memory[stage] + self.mem(0, stage), 0
        while memory > self.p.cap + 1e-9 and counts[stage][2] + pending < counts[stage][1]:
            forced_w += self.cost(2, stage)
            memory += self.mem(2, stage)
            pending += 1
        if self.end[stage] + self.cost(0, stage) + forced_w <= after_next:
            return True
        return after_next - self.end[stage] > max(self.idle) - self.idle[stage]

    def steady(self, mb: int) -> None:
        """One more F per stage that wants it (if the next stage does), then mb's I."""
        stages = self.p.num_stages
        wants = [self.wants_forward(stage) for stage in range(stages)]
        for stage in reversed(range(stages - 1)):
            wants[stage] = wants[stage] and wants[stage + 1]
        for stage in range(stages):
            if not wants[stage]:
                continue
            self.free_memory_for(stage, 0)
            if stage > 0:
                arrival = self.finished(0, stage - 1, self.count[stage][0]) + self.p.comm
                self.fill_wait(stage, arrival)
            self.put(stage, 0)
        for stage in reversed(range(stages)):
            self.free_memory_for(stage, 1)
            if stage + 1 < stages:
                self.fill_wait(stage, self.finished(1, stage + 1, mb) + self.p.comm)
            if stage == 0 and self.count[0][0] == self.p.microbatches:
                while self.pending_w(0):
                    self.put(0, 2)
            self.put(stage, 1)

    def run(self) -> float:
        """Place every op; the span upstream reports."""
        self.warm_up()
        for mb in range(1, self.p.microbatches):
            self.steady(mb)
        for stage in range(self.p.num_stages):
            while self.count[stage][2] < self.p.microbatches:
                self.put(stage, 2)
        last = self.p.microbatches - 1
        return max(
            self.finished(2, stage, last) - self.finished(0, stage, 0) + self.cost(0, stage)
            for stage in range(self.p.num_stages)
        )


def greedy(problem: Problem, switches: Switches) -> tuple[Order, float]:
    """One run of the heuristic: the order and the span it computes (MemoryShort when the
    cap cannot be met this way)."""
    if problem.placement != "loop":
        raise ValueError("sail-sg's heuristic schedules one stage per rank (loop placement)")
    state = _Greedy(problem, switches)
    span = state.run()
    return tuple(map(tuple, state.order)), span


def sailsg_schedule(problem: Problem) -> SailResult | None:
    """The best of the 8 switch combinations by span; None when none fits the cap."""
    best: SailResult | None = None
    for flags in itertools.product((True, False), repeat=3):
        switches = Switches(*flags)
        try:
            order, span = greedy(problem, switches)
        except MemoryShort:
            continue
        if best is None or span < best.span:
            best = SailResult(order, span, switches)
    return best


class Profile(NamedTuple):
    """A cost profile of the search_quality grid: per-share F, I, W and the latency."""

    name: str
    f: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    comm: float


def grid_profiles(ranks: int, *, seed: int = 0) -> tuple[Profile, ...]:
    """The four profiles of the search_quality grid for P ranks."""
    import random  # only here: the grid's random profile

    rng = random.Random(seed * 1000 + ranks)

    def jitter(base: float) -> tuple[float, ...]:
        values = [round(base * rng.uniform(0.8, 1.2), 3) for _ in range(ranks)]
        values[-1] *= 2  # the LM head
        return tuple(values)

    def uniform(name: str, f: float, i: float, w: float, comm: float) -> Profile:
        return Profile(name, (f,) * ranks, (i,) * ranks, (w,) * ranks, comm)

    return (
        uniform("balanced", 5.478, 5.806, 3.534, 0.2),
        uniform("small W", 1.0, 1.5, 0.5, 0.5),
        Profile("random, last ×2", jitter(1.0), jitter(1.0), jitter(1.0), 0.1),
        uniform("costly messages", 1.0, 1.0, 1.0, 1.0),
    )


def grid_problem(
    profile: Profile,
    microbatches: int,
    cap: float,
    *,
    placement: str = "loop",
    objective: Objective = Objective.MAKESPAN,
) -> Problem:
    """The search problem of one grid cell (default memory: F +1, I 0, W -1 per share): the
    profile as per-share costs, cut for the placement by `Problem.from_costs`."""
    shares = tuple(
        (share, StageCost(F=f, I=i, W=w))
        for share, (f, i, w) in enumerate(zip(profile.f, profile.i, profile.w, strict=True))
    )
    costs = CostModel(base=StageCost(comm=profile.comm), stages=shares)
    return Problem.from_costs(
        costs,
        ranks=len(profile.f),
        microbatches=microbatches,
        placement=placement,
        cap=cap,
        objective=objective,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-P", type=int, default=4)
    parser.add_argument("-M", type=int, default=8)
    parser.add_argument("--cost", default="F=1,I=1,W=1,comm=1")
    parser.add_argument("--memory", type=float, default=math.inf, help="cap, activations per rank")
    args = parser.parse_args(argv)
    problem = Problem.from_costs(
        parse_cost_flag(args.cost),
        ranks=args.P,
        microbatches=args.M,
        placement="loop",
        cap=args.memory,
    )
    result = sailsg_schedule(problem)
    if result is None:
        print("no switch combination fits the cap")
        return 1
    evaluation = evaluate(problem, result.order)
    assert evaluation is not None and fits(problem, evaluation)
    print(
        f"span {result.span:g} (its own), makespan {evaluation.makespan:g},"
        f" span {evaluation.span:g}"
    )
    print(f"peak {max(evaluation.peak):g}, switches {result.switches}")
    for rank, ops in enumerate(result.order):
        print(f"rank {rank}: {' '.join(map(str, ops))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
