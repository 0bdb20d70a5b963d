"""Timed replay of a compiled program with a cost model (DESIGN §6).

The simulator is the replay engine of `pipecc.semantics` (the same code the verifier runs)
with durations from a `CostModel`; this module turns the replay into the numbers users ask
for: makespan, the step time (makespan plus the duplicated-stage gradient sync, `sync`),
bubble ratio, per-rank busy, host and idle time, the idle time inside each rank's working
interval, stalls (every wait on a recv or a rendezvous send) and peak memory.

    timeline = simulate(program, parse_cost_flag("F=1,B=2"))
    timeline.makespan, timeline.bubble_ratio, timeline.ranks[0].stalls
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, cast

from pipecc.analysis.gaps import Gap, classify, clean
from pipecc.analysis.memory import BytePeak, peak_activations, peak_bytes, stage_bytes
from pipecc.diagnostics import ProgramError
from pipecc.ir.ops import (
    Collective,
    CollectiveKind,
    Compute,
    Fused,
    Instr,
    Phase,
    Recv,
    Send,
    Sequential,
    StageOp,
    Wait,
)
from pipecc.ir.printer import describe
from pipecc.ir.program import Program
from pipecc.perf import paused_gc
from pipecc.semantics import CommModel, Replay, replay
from pipecc.semantics.costs import CostModel, CostTiming


class DeadlockedError(ProgramError):
    """The program cannot run to completion under the chosen comm model."""


@dataclass(frozen=True, slots=True)
class Blocked:
    """A time a rank sat blocked, longer than the threshold: rank `rank` at instruction
    `index`, from `since` for `length`, until `released_by` (an op of this rank) completed.
    DESIGN §6 lists them as a rank's `stalls`."""

    rank: int
    index: int
    since: float
    length: float
    released_by: int | None
    message: str

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "since": clean(self.since),
            "length": clean(self.length),
            "released_by": self.released_by,
            "message": self.message,
        }


@dataclass(frozen=True, slots=True)
class RankStats:
    """What one rank did: times, memory, stalls."""

    rank: int
    busy: float
    idle: float
    internal_idle: float
    host: float  # time spent posting and in waits after their release (`post`, `wait`)
    first_start: float
    last_end: float
    peak_activations: int
    peak_index: int
    peak_time: float
    in_bytes: BytePeak | None  # the whole predicted peak, where the costs give sizes
    stalls: tuple[Blocked, ...]
    gaps: tuple[Gap, ...] = ()
    a2a_exposed: float = 0.0  # time blocked on expert-parallel all-to-alls (`exposed_a2a`)

    @property
    def peak_bytes(self) -> float | None:
        """The whole predicted peak in bytes (parameters, gradients, optimizer,
        activations, buffers, unsharded), or None without sizes in the costs."""
        return None if self.in_bytes is None else self.in_bytes.peak

    @property
    def dependency_bound(self) -> float:
        """Idle time before compute ops that the compute order and costs make unavoidable."""
        return sum(gap.dependency for gap in self.gaps)

    @property
    def placement_bound(self) -> float:
        """Idle time that better-placed comm ops would remove (pipecc.analysis.gaps)."""
        return sum(gap.placement for gap in self.gaps)

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "busy": clean(self.busy),
            "idle": clean(self.idle),
            "internal_idle": clean(self.internal_idle),
            "host": clean(self.host),
            "first_start": clean(self.first_start),
            "last_end": clean(self.last_end),
            "peak_activations": self.peak_activations,
            "peak_at": {"index": self.peak_index, "time": clean(self.peak_time)},
            "peak_bytes": self.peak_bytes,
            "peak_bytes_at": None if self.in_bytes is None else self.in_bytes.at,
            "peak_breakdown": None if self.in_bytes is None else self.in_bytes.breakdown.to_json(),
            "stalls": [s.to_json() for s in self.stalls],
            "dependency_bound": clean(self.dependency_bound),
            "placement_bound": clean(self.placement_bound),
            "gaps": [gap.to_json() for gap in self.gaps],
            "a2a_exposed": clean(self.a2a_exposed),
        }


class TimedOp(NamedTuple):
    """An instruction of the simulated step, with when it ran."""

    rank: int
    at: int  # its index in the rank's list
    instr: Instr
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Timeline:
    """The simulated step: the replay itself, and the figures derived from it.

    `step` is the makespan plus, for a program whose parameters held on several ranks are
    summed after it (one that holds no collective), the cost model's `sync`: that sum
    follows the program in every training step (DESIGN §7). A program that places its sums
    (passes/sum_shared.py) pays their `collective` duration inside the makespan.
    """

    costs: CostModel
    replay: Replay
    makespan: float
    bubble_ratio: float
    ranks: tuple[RankStats, ...]
    sync: float = 0.0

    @property
    def program(self) -> Program:
        return self.replay.program

    @property
    def model(self) -> CommModel:
        return self.replay.model

    @property
    def step(self) -> float:
        return self.makespan + self.sync

    @property
    def longest_rank(self) -> RankStats:
        """The rank whose span (last end − first start of its computations) is longest; the
        lowest-numbered of those, on a tie."""
        return max(self.ranks, key=lambda stats: stats.last_end - stats.first_start)

    @property
    def span_bubble_ratio(self) -> float:
        """The zero-bubble papers' bubble rate: 1 − busy / (last end − first start) of the
        longest rank (`longest_rank`), which leaves out the fill and drain before and after
        it that `bubble_ratio` counts (docs/simulate.md)."""
        stats = self.longest_rank
        span = stats.last_end - stats.first_start
        return 1.0 - stats.busy / span if span > 0 else 0.0

    def ops(self) -> list[TimedOp]:
        """Every instruction with its start and end, rank by rank."""
        found = []
        for rank, instrs in enumerate(self.program.ranks):
            for index, instr in enumerate(instrs):
                start = self.replay.start_time(rank, index)
                end = self.replay.end_time(rank, index)
                found.append(TimedOp(rank, index, instr, start or 0.0, end or 0.0))
        return found

    def to_json(self) -> dict[str, Any]:
        """The contract of DESIGN §6."""
        return {
            "schedule": self.program.schedule,
            "ranks_count": self.program.num_ranks,
            "microbatches": self.program.num_microbatches,
            "comm_model": self.model.value,
            "costs": self.costs.describe(),
            "makespan": clean(self.makespan),
            "sync": clean(self.sync),
            "step": clean(self.step),
            "bubble_ratio": clean(self.bubble_ratio),
            "span_bubble_ratio": clean(self.span_bubble_ratio),
            "ranks": [stats.to_json() for stats in self.ranks],
            "ops": [
                {
                    "rank": rank,
                    "index": index,
                    "op": op_name(instr),
                    "start": clean(start),
                    "end": clean(end),
                }
                for rank, index, instr, start, end in self.ops()
            ],
        }


def op_name(instr: Instr) -> str:
    """The short name of an instruction in timelines: `F0.3`, `F0.4&B1.1`, `send`, ..."""
    match instr:
        case Compute() | Fused() | Sequential() | StageOp() | Phase():
            return instr.label()
        case Send():
            return "send"
        case Recv():
            return "recv"
        case Wait():
            return "wait"
        case Collective():
            return instr.label()
        case _:
            raise AssertionError(f"unknown instruction {instr!r}")


def simulate(
    program: Program,
    costs: CostModel,
    *,
    model: CommModel = CommModel.NCCL,
    stall_threshold: float = 0.0,
) -> Timeline:
    """Replay `program` with `costs` under `model`.

    Raises DeadlockedError when the program cannot finish (`pipecc verify` explains why).
    """
    with paused_gc():
        return _simulate(program, costs, model, stall_threshold)


def _simulate(
    program: Program, costs: CostModel, model: CommModel, stall_threshold: float
) -> Timeline:
    run = replay(program, model=model, timing=CostTiming(costs, program.moe))
    if not run.finished:
        raise DeadlockedError(
            f"{program.schedule} (P={program.num_ranks}, M={program.num_microbatches}) does "
            f"not run to completion under the {model.value} comm model; run "
            f"'pipecc verify' for the deadlock and its cycle"
        )
    makespan = run.makespan()
    gaps = classify(program, run, costs)
    ranks = tuple(
        replace(
            _rank_stats(rank, program, run, costs, makespan, stall_threshold),
            gaps=tuple(gaps[rank]),
            a2a_exposed=exposed_a2a(run, rank, costs.overhead()[0]),
        )
        for rank in range(program.num_ranks)
    )
    busy = sum(stats.busy for stats in ranks)
    bubble = 1.0 - busy / (program.num_ranks * makespan) if makespan > 0 else 0.0
    sync = costs.sync if sums_gradients(program, costs.shared) else 0.0
    return Timeline(costs, run, makespan, bubble, ranks, sync)


def sums_gradients(program: Program, shared: tuple[tuple[int, ...], ...] = ()) -> bool:
    """Whether the runtime sums gradients across ranks after the program, outside it (DESIGN
    §7): the program holds no collective (a program that places its sums pays their
    `collective` duration inside the replay instead), and some stage is held twice (two
    pipes over the same stages, as DualPipe), or a group of stages that holds one parameter
    (`shared`, e.g. tied embeddings) lies on more than one rank."""
    if any(type(i) is Collective for instrs in program.ranks for i in instrs):
        return False
    if program.placement.num_pipes > 1:
        return True
    slots = program.placement.slots
    return any(len({slot.rank for slot in slots if slot.stage in group}) > 1 for group in shared)


def _rank_stats(
    rank: int,
    program: Program,
    run: Replay,
    costs: CostModel,
    makespan: float,
    threshold: float,
) -> RankStats:
    instrs = program.ranks[rank]
    busy, first, last = 0.0, None, 0.0
    starts, ends = run.start, run.end
    for g in run.wiring.computes[rank]:  # the global ids of the rank's compute ops
        start, end = starts[g], ends[g]
        assert start is not None and end is not None
        busy += end - start
        first = start if first is None else first
        last = end
    base = run.wiring.offsets[rank]
    stage_ops = [base + i for i, instr in enumerate(instrs) if type(instr) is StageOp]
    busy += sum((ends[g] or 0.0) - (starts[g] or 0.0) for g in stage_ops)  # 0 unless costed
    post, wait = costs.overhead()  # every post and every Wait takes exactly this much
    waits = len(run.wiring.waits[rank])
    posts = len(instrs) - len(run.wiring.computes[rank]) - waits - len(stage_ops)
    host = post * posts + wait * waits
    first = first if first is not None else 0.0
    peak, at = peak_activations(instrs)
    peak_index = max(at, 0)
    in_bytes = (
        peak_bytes(program, rank, lambda stage: stage_bytes(costs, stage))
        if costs.has_bytes()
        else None
    )
    peak_time = run.start_time(rank, peak_index) or 0.0 if instrs else 0.0
    return RankStats(
        rank=rank,
        busy=busy,
        idle=makespan - busy,
        internal_idle=(last - first) - busy,
        host=host,
        first_start=first,
        last_end=last,
        peak_activations=peak,
        peak_index=peak_index,
        peak_time=peak_time,
        in_bytes=in_bytes,
        stalls=tuple(_stalls(rank, run, threshold, post=post)),
    )


class Span(NamedTuple):
    """One instruction of a rank's replay other than a post: where the rank was free to
    start it (`ready`: the previous instruction's end, plus `post` per post since), when it
    started (was released) and ended."""

    at: int  # its index in the rank's list
    instr: Instr
    ready: float
    start: float
    end: float


def _spans(run: Replay, rank: int, post: float) -> Iterator[Span]:
    """The rank's instructions in order as `Span`s; a post never blocks: it ends `post`
    after the previous instruction."""
    starts, ends, base = run.start, run.end, run.wiring.offsets[rank]
    previous_end = 0.0
    for index, instr in enumerate(run.program.ranks[rank]):
        kind = type(instr)
        if kind is Send or kind is Recv:
            previous_end += post
            continue
        start = starts[base + index] or 0.0
        end = ends[base + index] or start
        yield Span(index, instr, previous_end, start, end)
        previous_end = end


def _stalls(rank: int, run: Replay, threshold: float, *, post: float) -> list[Blocked]:
    """Every time the rank sat blocked (at a Wait, or at a compute op waiting for a recv):
    from the end of the previous instruction to the start (the release) of this one."""
    found = []
    instrs = run.program.ranks[rank]
    for span in _spans(run, rank, post):
        length = span.start - span.ready
        if length <= threshold or length <= 0:
            continue
        cause = run.cause(rank, span.at)
        released = cause.index if cause.rank == rank and cause.index >= 0 else None
        message = "previous op" if released is None else _released_by(instrs[released])
        found.append(Blocked(rank, span.at, span.ready, length, released, message))
    return found


def is_a2a(instr: Instr) -> bool:
    return type(instr) is Collective and instr.kind is CollectiveKind.ALL_TO_ALL


def exposed_a2a(run: Replay, rank: int, post: float) -> float:
    """The time `rank` sat blocked on expert-parallel all-to-alls: in a blocking one after
    posting it, and at a Wait that lists only all-to-alls (one the rank's compute did not
    hide). 0 for a program without them."""
    instrs = run.program.ranks[rank]
    total = 0.0
    for span in _spans(run, rank, post):
        instr = span.instr
        if is_a2a(instr) and not cast(Collective, instr).asynchronous:
            total += max(span.end - span.start - post, 0.0)
        elif type(instr) is Wait and all(
            0 <= i < len(instrs) and is_a2a(instrs[i]) for i in instr.ops
        ):
            total += max(span.start - span.ready, 0.0)
    return total


def _released_by(instr: Instr) -> str:
    """What released a stall (DESIGN §6's `message`): a comm op in its long form without pipe
    or group, anything else by its `op` name."""
    if type(instr) is Send or type(instr) is Recv:
        return describe(instr, pipes=False, groups=False)
    return op_name(instr)
