"""Which waits a schedule's comm placement causes, and which its compute order does.

Every gap before a compute op, on its rank, is split in two (issue 6, DESIGN §6):

- **dependency-bound**: the part before the op's inputs could exist at all, given the compute
  order and the costs: each input's producer ended when it did in this replay, and its
  message then needs its latency. These are the schedule's own bubbles.
- **placement-bound**: the rest. The data could have been there, but was not: a receive
  posted after the data was ready, a send posted late, a send or receive queued behind an
  unmatched op on an nccl stream, a rendezvous send waiting for a receive not yet posted, a
  rank blocked completing a send it did not need yet. These waits vanish when the comm ops
  are posted at their best legal positions (`pipecc compile --align`).

"Stall-free alignment" means zero placement-bound wait. A gap whose every input was already
there is wholly placement-bound. The host time of the posts and waits inside a gap (the cost
model's `post` and `wait`) is neither: it is the gap's `host` part, and the other two split
the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipecc.ir.keys import MessageKeys
from pipecc.ir.ops import (
    Collective,
    Compute,
    Fused,
    Instr,
    Send,
    Wait,
    computations,
    is_compute,
)
from pipecc.ir.printer import describe
from pipecc.ir.program import Program
from pipecc.semantics import CauseKind, Replay
from pipecc.semantics.costs import CostModel
from pipecc.semantics.wiring import inputs

_EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class Gap:
    """Rank `rank` sat idle from `since` until compute op `index` started at `until`."""

    rank: int
    index: int
    since: float
    until: float
    dependency: float  # the part before the op's inputs could exist
    placement: float  # the rest of the idle time
    cause: str  # for a placement-bound part: what held the rank
    host: float = 0.0  # the host time of the posts and waits inside the gap

    @property
    def length(self) -> float:
        return self.until - self.since

    def to_json(self) -> dict[str, object]:
        return {
            "index": self.index,
            "since": clean(self.since),
            "length": clean(self.length),
            "dependency_bound": clean(self.dependency),
            "placement_bound": clean(self.placement),
            "host": clean(self.host),
            "cause": self.cause,
        }


def clean(value: float) -> float:
    """A time rounded to 9 decimals: sums of durations such as 0.1 print as 29.4, not
    29.399999999999995 (the replay itself keeps full precision). Every time in the
    simulator's JSON goes through it, gaps and the rest of the timeline alike."""
    return round(value, 9) + 0.0


def classify(program: Program, run: Replay, costs: CostModel) -> list[list[Gap]]:
    """The idle gaps before every compute op of every rank, each split into its
    dependency-bound and placement-bound parts (module docstring)."""
    ready = _data_ready(program, run, costs)
    w = run.wiring
    starts, ends = run.start, run.end
    post, wait = costs.overhead()  # every post and every Wait takes exactly this much
    gaps: list[list[Gap]] = []
    for rank in range(program.num_ranks):
        found: list[Gap] = []
        previous_end, previous = 0.0, w.offsets[rank] - 1
        waits, next_wait = w.waits[rank], 0
        last_wait = len(waits)
        for g in w.computes[rank]:
            # the instructions since the previous compute op: posts and waits
            first_wait = next_wait
            while next_wait < last_wait and waits[next_wait] < g:
                next_wait += 1
            count = next_wait - first_wait
            host = post * (g - previous - 1 - count) + wait * count
            start = starts[g] or 0.0
            if start > previous_end + host + _EPSILON:
                at = (rank, g - w.offsets[rank])
                found.append(_gap(program, run, at, (previous_end, start, host), ready.get(g, 0.0)))
            previous_end, previous = ends[g] or start, g
        gaps.append(found)
    return gaps


def _gap(
    program: Program,
    run: Replay,
    at: tuple[int, int],
    span: tuple[float, float, float],
    data_ready: float,
) -> Gap:
    """The gap before compute op `at` = (rank, index): from `since` to `until`, `host` of it
    spent posting and waiting."""
    (rank, index), (since, until, host) = at, span
    idle = until - since - host
    dependency = min(max(data_ready - since, 0.0), idle)
    placement = idle - dependency
    if placement <= _EPSILON:
        return Gap(rank, index, since, until, idle, 0.0, "", host)
    cause = _placement_cause(program, run, rank, index, max(since, data_ready))
    return Gap(rank, index, since, until, dependency, placement, cause, host)


def _data_ready(program: Program, run: Replay, costs: CostModel) -> dict[int, float]:
    """For each compute op (by global instruction id): when its last input could have been
    there — its producers' end in this replay plus, for a message, the host time of its post
    and its latency."""
    flow = run.wiring.keys
    post, _ = costs.overhead()
    computes = [
        [(index, computations(instr)) for index, instr in enumerate(instrs) if is_compute(instr)]
        for instrs in program.ranks
    ]
    made_at = _made_at(computes, flow, run)
    stride, inputs_of, offsets = flow.mb_stride, flow.inputs, run.wiring.offsets
    ready: dict[int, float] = {}
    for rank, ops in enumerate(computes):
        base, instrs = offsets[rank], program.ranks[rank]
        for index, _ in ops:
            latest = 0.0
            for op in inputs(instrs[index]):  # a MoE op's input: at its first phase
                needed = inputs_of[op.kind][op.pipe][op.stage]
                if needed is None:
                    continue
                at = made_at.get(op.mb * stride + needed.base)
                if at is None:
                    continue
                if needed.src != needed.dst:  # from another rank: posted, then in flight
                    at += post + costs.latency(op.stage)
                latest = max(latest, at)
            if latest:
                ready[base + index] = latest
    return ready


def _made_at(
    computes: list[list[tuple[int, tuple[Compute, ...]]]], flow: MessageKeys, run: Replay
) -> dict[int, float]:
    """When each message's producer ended in this replay (by message key)."""
    stride, outputs_of, ends, offsets = flow.mb_stride, flow.outputs, run.end, run.wiring.offsets
    made_at: dict[int, float] = {}
    for rank, ops in enumerate(computes):
        base = offsets[rank]
        for index, parts in ops:
            for op in parts:
                out = outputs_of[op.kind][op.pipe][op.stage]
                if out is not None:
                    made_at[op.mb * stride + out.base] = ends[base + index] or 0.0
    return made_at


def _placement_cause(
    program: Program, run: Replay, rank: int, index: int, could_start: float
) -> str:
    """What held the rank after its data could have been there: the op whose completion
    released it, and why that op completed late."""
    instrs = program.ranks[rank]
    released = _releasing_op(run, instrs, rank, index)
    if released is None:
        return f"waited for its own instructions past {could_start:g}"
    op = instrs[released]
    done = run.done_time(rank, released) or 0.0
    head = f"[{released}] {describe(op)} completed at {done:g}"
    return f"{head}: {_why_late(program, run, rank, released)}"


def _releasing_op(run: Replay, instrs: tuple[Instr, ...], rank: int, index: int) -> int | None:
    """The comm op whose completion let the rank reach compute op `index`: the cause of the
    op itself, or of the last Wait before it that blocked."""
    cause = run.cause(rank, index)
    if cause.kind is CauseKind.RECV:
        return cause.index
    i = index - 1
    while i >= 0 and type(instrs[i]) is not Compute and type(instrs[i]) is not Fused:
        if type(instrs[i]) is Wait:
            wait_cause = run.cause(rank, i)
            if wait_cause.kind is CauseKind.WAIT:
                return wait_cause.index
        i -= 1
    return None


def _why_late(program: Program, run: Replay, rank: int, index: int) -> str:
    op = program.ranks[rank][index]
    if type(op) is Collective:
        return _collective_late(run, rank, index)
    completion = run.completion_cause(rank, index)
    if completion.kind is CauseKind.TRANSFER:
        peer, at = completion.rank, completion.index
        partner = program.ranks[peer][at]
        ready = run.ready_time(peer, at) or 0.0
        ready_cause = run.ready_cause(peer, at)
        if ready_cause.kind is CauseKind.STREAM:
            ahead = program.ranks[ready_cause.rank][ready_cause.index]
            return (
                f"rank {peer}'s [{at}] {describe(partner)} was queued on its nccl stream "
                f"behind [{ready_cause.index}] {describe(ahead)} until {ready:g}"
            )
        if type(op) is Send:
            return f"a send held until rank {peer} posted its receive at {ready:g}"
        return f"rank {peer} posted the matching send only at {ready:g}"
    ready_cause = run.ready_cause(rank, index)
    if ready_cause.kind is CauseKind.STREAM:
        ahead = program.ranks[ready_cause.rank][ready_cause.index]
        return f"queued on this rank's nccl stream behind [{ready_cause.index}] {describe(ahead)}"
    posted = run.post_time(rank, index) or 0.0
    if type(op) is Send:
        done = run.done_time(rank, index) or 0.0
        return (
            f"the rank waited for its own send to finish its transfer ({posted:g} to "
            f"{done:g}) before it needed to; completed later, it would not block"
        )
    return f"the receive was posted only at {posted:g}"


def _collective_late(run: Replay, rank: int, index: int) -> str:
    """Why a collective completed when it did: its last member to be ready, or its own
    duration after that."""
    w = run.wiring
    members = w.members[w.offsets[rank] + index]
    posts = [(run.posted(m) or 0.0, m) for m in members]
    if not posts:
        return "it met no other member"
    at, last = max(posts)
    peer, where = w.locate(last)
    if peer == rank:
        return f"every other member was ready before it was posted at {at:g}"
    return f"its last member, rank {peer} ([{where}]), was ready at {at:g}"
