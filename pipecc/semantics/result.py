"""What a replay found: times, matching, the cause of every event, and the blocked state."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pipecc.ir.program import Program
from pipecc.semantics.model import CommModel
from pipecc.semantics.wiring import COMPUTE, SEND, Wiring


class CauseKind(enum.Enum):
    """What bound the time of an event (see `Replay.cause`)."""

    START = "start"  # the first instruction of a rank, at time 0
    PROGRAM = "program"  # the previous instruction of the rank ended then
    RECV = "recv"  # a compute waited for the data of this Recv
    WAIT = "wait"  # a Wait was released by the completion of this op
    POST = "post"  # a comm op's own post (or its group's) was the last thing it needed
    TRANSFER = "transfer"  # the matched partner became ready last
    STREAM = "stream"  # the unit ahead on an nccl stream completed last (this op of it)


class Cause(NamedTuple):
    """An event's binding predecessor: instruction `index` of `rank` (-1 for START)."""

    kind: CauseKind
    rank: int
    index: int  # type: ignore[assignment]  # shadows tuple.index by design: read by name


class Block(enum.Enum):
    """Why an instruction cannot run, or why a posted op cannot complete (a deadlock)."""

    WAITS_FOR = "waits for"  # a blocked compute/Wait needs this op to complete
    NOT_POSTED = "not posted"  # the op comes at or after the instruction its rank is stuck at
    NO_PARTNER = "no partner"  # nothing matches this op: it can never complete
    PARTNER = "partner"  # the matched partner is not posted, or (nccl) not active
    STREAM = "stream"  # (nccl) an earlier unit on one of this op's streams is incomplete
    MEMBERS = "members"  # a collective waits for this member's collective (not yet reached)


class Stuck(NamedTuple):
    """One edge of the blocked state: (rank, index) cannot proceed because of `on`."""

    rank: int
    index: int  # type: ignore[assignment]  # shadows tuple.index by design: read by name
    why: Block
    on: tuple[int, int] | None  # the (rank, index) it depends on; None for NO_PARTNER


@dataclass(frozen=True, slots=True)
class Replay:
    """The outcome of one replay (read-only; times are None for what never happened).

    For a Send/Recv, start..end is the host time of its post (start = end without a `post`
    overhead), `done` its completion; `unit_post` holds when each unit was posted (the end of
    its last op). For a Wait, start is its release and end = start + the `wait` overhead; for
    a compute op, end = start + duration. `unit_act` holds the activation time of each unit
    (nccl models only). Ties between causes resolve towards the cross-rank cause (RECV, WAIT,
    TRANSFER, STREAM), so a walk back along causes always reaches time 0.
    """

    wiring: Wiring
    model: CommModel
    start: Sequence[float | None]
    end: Sequence[float | None]
    done: Sequence[float | None]
    unit_act: Sequence[float | None]
    unit_post: Sequence[float | None]
    latency: Sequence[float]  # of each send, and of its partner recv
    cursors: tuple[int, ...]  # global id of each rank's next instruction
    stuck: tuple[Stuck, ...]  # the blocked state; empty when the replay finished

    @property
    def program(self) -> Program:
        return self.wiring.program

    @property
    def finished(self) -> bool:
        """Every instruction ran and every posted op completed: no deadlock."""
        return not self.stuck

    def blocked_at(self, rank: int) -> int | None:
        """The index of the instruction `rank` is stuck at, or None if it ran to the end."""
        g = self.cursors[rank]
        offsets = self.wiring.offsets
        return None if g == offsets[rank + 1] else g - offsets[rank]

    def start_time(self, rank: int, index: int) -> float | None:
        return self.start[self.wiring.offsets[rank] + index]

    def end_time(self, rank: int, index: int) -> float | None:
        return self.end[self.wiring.offsets[rank] + index]

    def done_time(self, rank: int, index: int) -> float | None:
        """When a Send/Recv completed (None if it never did, or for other instructions)."""
        return self.done[self.wiring.offsets[rank] + index]

    def partner(self, rank: int, index: int) -> tuple[int, int] | None:
        """The (rank, index) of the op matched with Send/Recv `index` of `rank`."""
        p = self.wiring.partner[self.wiring.offsets[rank] + index]
        return None if p < 0 else self.wiring.locate(p)

    def makespan(self) -> float:
        return max((t for t in self.end if t is not None), default=0.0)

    def cause(self, rank: int, index: int) -> Cause:
        """What bound the start of instruction `index` of `rank` (which must have started):
        RECV/WAIT name the op whose completion released it, PROGRAM the previous
        instruction, START time 0."""
        w = self.wiring
        g = w.offsets[rank] + index
        at = self.start[g]
        if at is None:
            raise ValueError(f"rank {rank} instruction {index} never started")
        kind = CauseKind.RECV if w.code[g] == COMPUTE else CauseKind.WAIT
        for d in w.deps[g]:
            if self.done[d] == at:
                return Cause(kind, rank, d - w.offsets[rank])
        if index == 0:
            return Cause(CauseKind.START, rank, -1)
        return Cause(CauseKind.PROGRAM, rank, index - 1)

    def completion_cause(self, rank: int, index: int) -> Cause:
        """What bound the completion of Send/Recv `index` of `rank` (which must have
        completed): TRANSFER names the partner, whose `ready_cause` goes on; otherwise this
        op's own `ready_cause` (its post, or the unit ahead of it on a stream)."""
        w = self.wiring
        g = w.offsets[rank] + index
        p = w.partner[g]
        if self.done[g] is None or p < 0:
            raise ValueError(f"rank {rank} instruction {index} is not a completed comm op")
        if self.model is CommModel.EAGER:
            if w.code[g] == SEND:
                return Cause(CauseKind.POST, rank, index)
            if _known(self.posted(p)) + self.latency[p] >= _known(self.posted(g)):
                return Cause(CauseKind.TRANSFER, *w.locate(p))
            return Cause(CauseKind.POST, rank, index)
        if _known(self._ready(p)) >= _known(self._ready(g)):
            return Cause(CauseKind.TRANSFER, *w.locate(p))
        return self.ready_cause(rank, index)

    def ready_cause(self, rank: int, index: int) -> Cause:
        """What bound the moment Send/Recv `index` of `rank` could transfer: its own post
        (POST), or under nccl the completion of the unit ahead of it on a stream (STREAM)."""
        w = self.wiring
        g = w.offsets[rank] + index
        if self.model.has_streams:
            u = w.unit[g]
            act = self.unit_act[u]
            for v in w.streams(self.model).preds(w, u):
                ops = range(w.unit_first[v], w.unit_last[v] + 1)
                last = max(ops, key=lambda o: self.done[o] or 0.0)
                if self.done[last] == act:
                    return Cause(CauseKind.STREAM, *w.locate(last))
        return Cause(CauseKind.POST, rank, index)

    def post_time(self, rank: int, index: int) -> float | None:
        """When Send/Recv `index` of `rank` was posted (its group's post, after the host
        time of every op of the group)."""
        return self.posted(self.wiring.offsets[rank] + index)

    def ready_time(self, rank: int, index: int) -> float | None:
        """When Send/Recv `index` of `rank` could transfer: its post, or (nccl) the
        activation of its unit."""
        return self._ready(self.wiring.offsets[rank] + index)

    def posted(self, g: int) -> float | None:
        """When Send/Recv `g` (a global id) was posted: the end of its unit's last post."""
        return self.unit_post[self.wiring.unit[g]]

    def _ready(self, g: int) -> float | None:
        if self.model.has_streams:
            return self.unit_act[self.wiring.unit[g]]
        return self.posted(g)


def _known(time: float | None) -> float:
    """A time the replay has set (the caller checked the op completed)."""
    assert time is not None
    return time
