"""An explicit-state executor of DESIGN §5, written independently of pipecc.semantics.

It keeps no precomputed matching and no max-plus times: each rank is a cursor, each ordered
rank pair a FIFO channel of posted-but-unmatched sends and receives (paired as they meet),
each rank's streams FIFO queues of posted units; it fires any enabled action until none is
left. The final state (cursors, posted and completed ops) is what the replay engine must
reproduce.

`run_timed` is a discrete-event version with a global clock and a priority queue, for the
timed semantics.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from pipecc.ir.ops import Collective, Compute, Fused, Instr, Kind, Msg, Recv, Send, Wait
from pipecc.ir.program import Program

Op = tuple[int, int]  # (rank, index)
MODELS = ("nccl", "nccl-single", "rendezvous", "eager")


@dataclass
class Outcome:
    cursors: list[int]
    posted: set[Op]
    completed: set[Op]
    matched: dict[Op, Op]
    times: dict[Op, float] = field(default_factory=dict)  # timed: start of every executed op
    done_at: dict[Op, float] = field(default_factory=dict)  # timed: completion of comm ops


def _is_comm(instr: Instr) -> bool:
    return type(instr) is Send or type(instr) is Recv


def _is_posted(instr: Instr) -> bool:
    """What a rank posts: a send, a receive, a collective (a unit of its own)."""
    return type(instr) is Send or type(instr) is Recv or type(instr) is Collective


def _blocking(instr: Instr) -> bool:
    return type(instr) is Collective and not instr.asynchronous


def _group_end(instrs: tuple[Instr, ...], i: int) -> int:
    """One past the last op of the unit starting at i (consecutive comm ops, same group)."""
    if type(instrs[i]) is Collective:
        return i + 1
    group = instrs[i].group  # type: ignore[union-attr]
    j = i + 1
    if group is None:
        return j
    while j < len(instrs) and _is_comm(instrs[j]) and instrs[j].group == group:  # type: ignore[union-attr]
        j += 1
    return j


def _input_name(op: Compute, program: Program, rank: int) -> tuple[Msg, int, int, int] | None:
    """The message op receives from another rank, if any."""
    placement = program.placement
    if not (0 <= op.pipe < placement.num_pipes and 0 <= op.stage < placement.num_stages(op.pipe)):
        return None
    if op.kind is Kind.F:
        if op.stage == 0 or placement.holder(op.pipe, op.stage - 1).rank == rank:
            return None
        return (Msg.ACT, op.pipe, op.stage, op.mb)
    if op.kind is Kind.W or placement.is_last_stage(op.pipe, op.stage):
        return None
    if placement.holder(op.pipe, op.stage + 1).rank == rank:
        return None
    return (Msg.GRAD, op.pipe, op.stage, op.mb)


def _consumed(program: Program, rank: int, index: int) -> list[int]:
    """Indices of the recvs compute `index` consumes: per input, the latest recv of that
    message before it, else the first after it."""
    instrs = program.ranks[rank]
    instr = instrs[index]
    parts = (instr,) if type(instr) is Compute else (instr.forward, instr.backward)  # type: ignore[union-attr]
    found = []
    for op in parts:
        name = _input_name(op, program, rank)
        if name is None:
            continue
        hits = [
            j
            for j, x in enumerate(instrs)
            if type(x) is Recv and (x.what, x.pipe, x.stage, x.mb) == name
        ]
        before = [j for j in hits if j < index]
        after = [j for j in hits if j > index]
        if before:
            found.append(before[-1])
        elif after:
            found.append(after[0])
    return found


class _Machine:
    def __init__(self, program: Program, model: str) -> None:
        self.p = program
        self.model = model
        self.n = program.num_ranks
        self.cursor = [0] * self.n
        self.posted: set[Op] = set()
        self.completed: set[Op] = set()
        self.matched: dict[Op, Op] = {}
        self.sendq: dict[tuple[int, int], deque[Op]] = {}
        self.recvq: dict[tuple[int, int], deque[Op]] = {}
        self.streams: dict[tuple[int, int], deque[tuple[Op, ...]]] = {}
        self.unit_of: dict[Op, tuple[Op, ...]] = {}
        # collectives: per set of ranks, each member's posted and unmatched ones; the met ones
        self.collq: dict[tuple[int, ...], dict[int, deque[Op]]] = {}
        self.meetings: list[tuple[Op, ...]] = []
        self.consumes = {
            (r, i): _consumed(program, r, i)
            for r, instrs in enumerate(program.ranks)
            for i, x in enumerate(instrs)
            if type(x) in (Compute, Fused)
        }

    def peer_ok(self, rank: int, instr: Instr) -> bool:
        return 0 <= instr.peer < self.n and instr.peer != rank  # type: ignore[union-attr]

    def members(self, rank: int, instr: Collective) -> tuple[int, ...] | None:
        """The collective's set of ranks, None when it is malformed (it meets nothing)."""
        ranks = tuple(sorted(set(instr.ranks)))
        if len(ranks) != len(instr.ranks) or rank not in ranks or ranks[-1] >= self.n:
            return None
        return ranks

    def stream_keys(self, unit: tuple[Op, ...]) -> list[tuple[int, int]]:
        rank = unit[0][0]
        if self.model == "nccl-single":
            return [(rank, -1)]
        first = self.p.ranks[rank][unit[0][1]]
        if type(first) is Collective:  # at the head of every stream toward its members
            ranks = self.members(rank, first) or ()
            return [(rank, peer) for peer in ranks if peer != rank]
        peers = []
        for r, i in unit:
            instr = self.p.ranks[r][i]
            if self.peer_ok(r, instr) and instr.peer not in peers:  # type: ignore[union-attr]
                peers.append(instr.peer)  # type: ignore[union-attr]
        return [(rank, peer) for peer in peers]

    def post_unit(self, rank: int) -> None:
        instrs = self.p.ranks[rank]
        start = self.cursor[rank]
        end = _group_end(instrs, start)
        unit = tuple((rank, i) for i in range(start, end))
        for op in unit:
            self.posted.add(op)
            self.unit_of[op] = unit
            instr = instrs[op[1]]
            if type(instr) is Collective:
                ranks = self.members(rank, instr)
                if ranks is not None:
                    self.collq.setdefault(ranks, {}).setdefault(rank, deque()).append(op)
                continue
            if type(instr) is Send and self.model == "eager":
                self.completed.add(op)  # buffered: complete when posted, partner or not
            if not self.peer_ok(rank, instr):
                continue
            if type(instr) is Send:
                self.sendq.setdefault((rank, instr.peer), deque()).append(op)
            else:
                self.recvq.setdefault((instr.peer, rank), deque()).append(op)  # type: ignore[union-attr]
        for key in self.stream_keys(unit):
            self.streams.setdefault(key, deque()).append(unit)
        self.cursor[rank] = start if _blocking(instrs[start]) else end  # blocking: stays there

    def match_all(self) -> bool:
        progress = self.meet()
        for pair, sends in self.sendq.items():
            recvs = self.recvq.get(pair)
            while sends and recvs:
                s, r = sends.popleft(), recvs.popleft()
                self.matched[s] = r
                self.matched[r] = s
                progress = True
        return progress

    def meet(self) -> bool:
        """The k-th collective over a set on each member meets the k-th of the others."""
        progress = False
        for ranks, queues in self.collq.items():
            while all(queues.get(r) for r in ranks):
                self.meetings.append(tuple(queues[r].popleft() for r in ranks))
                progress = True
        return progress

    def active(self, op: Op) -> bool:
        unit = self.unit_of[op]
        return all(self.streams[key][0] == unit for key in self.stream_keys(unit))

    def transfer(self) -> bool:
        """Complete every matched pair whose completion rule holds."""
        progress = False
        for s, r in list(self.matched.items()):
            if type(self.p.ranks[s[0]][s[1]]) is not Send or r in self.completed:
                continue
            if self.model in ("nccl", "nccl-single") and not (self.active(s) and self.active(r)):
                continue
            self.completed.add(s)
            self.completed.add(r)
            progress = True
        for met in self.meetings:
            if met[0] in self.completed:
                continue
            if self.model in ("nccl", "nccl-single") and not all(self.active(op) for op in met):
                continue
            self.completed.update(met)
            progress = True
        if self.model in ("nccl", "nccl-single"):
            progress |= self.retire()
        return progress

    def retire(self) -> bool:
        progress = False
        for queue in self.streams.values():
            while queue and all(op in self.completed for op in queue[0]):
                queue.popleft()
                progress = True
        return progress

    def step_rank(self, rank: int) -> bool:
        instrs = self.p.ranks[rank]
        i = self.cursor[rank]
        if i >= len(instrs):
            return False
        instr = instrs[i]
        if _is_posted(instr) and (rank, i) not in self.posted:
            self.post_unit(rank)
            return True
        if type(instr) is Wait:
            needed = [
                (rank, j) for j in instr.ops if 0 <= j < len(instrs) and _is_posted(instrs[j])
            ]
        elif type(instr) is Collective:  # blocking, posted: the rank waits for it
            needed = [(rank, i)]
        else:
            needed = [(rank, j) for j in self.consumes[(rank, i)]]
        if all(op in self.completed for op in needed):
            self.cursor[rank] = i + 1
            return True
        return False

    def run(self) -> Outcome:
        progress = True
        while progress:
            progress = False
            for rank in range(self.n):
                while self.step_rank(rank):
                    progress = True
            progress |= self.match_all()
            progress |= self.transfer()
        return Outcome(self.cursor, self.posted, self.completed, self.matched)


def run(program: Program, model: str) -> Outcome:
    """Fire enabled actions until none is left (untimed)."""
    return _Machine(program, model).run()


# ---- timed: a discrete-event simulation with a global clock -------------------------------


class _Timed(_Machine):
    """Events in global time order: a rank runs its next instruction when its clock says so;
    a transfer completes at its computed time; completions wake ranks and stream heads."""

    def __init__(
        self,
        program: Program,
        model: str,
        duration: dict[Op, float],
        latency: dict[Op, float],
        overhead: dict[int, tuple[float, float]],
    ) -> None:
        super().__init__(program, model)
        self.duration = duration
        self.latency = latency  # per send
        self.overhead = overhead  # per rank: (host time per post, per Wait after its release)
        self.paid: set[int] = set()  # ranks whose next unit's posts have taken their time
        self.heap: list[tuple[float, int, str, object]] = []
        self.seq = 0
        self.post_time: dict[Op, float] = {}
        self.act_time: dict[tuple[Op, ...], float] = {}
        self.head_since: dict[tuple[int, int], float] = {}
        self.done_at: dict[Op, float] = {}
        self.times: dict[Op, float] = {}
        self.waiting: dict[Op, int] = {}
        self.scheduled: set[Op] = set()

    def push(self, t: float, kind: str, x: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, x))

    def run_timed(self) -> Outcome:
        for rank in range(self.n):
            self.push(0.0, "rank", rank)
        while self.heap:
            t, _, kind, x = heapq.heappop(self.heap)
            if kind == "rank":
                self.rank_event(t, x)  # type: ignore[arg-type]
            else:
                self.complete_event(t, x)  # type: ignore[arg-type]
        return Outcome(
            self.cursor, self.posted, self.completed, self.matched, self.times, self.done_at
        )

    def rank_event(self, t: float, rank: int) -> None:
        instrs = self.p.ranks[rank]
        while self.cursor[rank] < len(instrs):
            i = self.cursor[rank]
            instr = instrs[i]
            if _is_posted(instr) and (rank, i) not in self.posted:
                if not self.post_timed(t, rank):
                    return  # back when its posts have taken their time
                continue
            if type(instr) is Wait:
                needed = [
                    (rank, j) for j in instr.ops if 0 <= j < len(instrs) and _is_posted(instrs[j])
                ]
            elif type(instr) is Collective:  # blocking, posted: the rank waits for it
                needed = [(rank, i)]
            else:
                needed = [(rank, j) for j in self.consumes[(rank, i)]]
            missing = [op for op in needed if op not in self.completed]
            if missing:
                self.waiting[missing[0]] = rank
                return
            if type(instr) is Collective:  # it started when posted; the rank goes on
                self.cursor[rank] = i + 1
                continue
            self.times[(rank, i)] = t
            self.cursor[rank] = i + 1
            if type(instr) in (Compute, Fused):
                self.push(t + self.duration[(rank, i)], "rank", rank)
                return
            wait = self.overhead[rank][1]
            if wait:  # the Wait is released at t and takes `wait` more
                self.push(t + wait, "rank", rank)
                return

    def post_timed(self, t: float, rank: int) -> bool:
        """Post the unit at the rank's cursor, whose ops each take `post` one after another;
        False if that takes time: the rank comes back when it is over, and posts then."""
        instrs = self.p.ranks[rank]
        start = self.cursor[rank]
        if rank not in self.paid:
            clock = t
            for j in range(start, _group_end(instrs, start)):
                self.times[(rank, j)] = clock
                clock = clock + self.overhead[rank][0]
            if clock > t:
                self.paid.add(rank)
                self.push(clock, "rank", rank)
                return False
        self.paid.discard(rank)
        self.post_unit(rank)
        end = _group_end(instrs, start)
        for j in range(start, end):
            self.post_time[(rank, j)] = t
        self.after_post(t, tuple((rank, j) for j in range(start, end)))
        return True

    def after_post(self, t: float, unit: tuple[Op, ...]) -> None:
        self.match_all()
        if self.model == "eager":
            for op in unit:
                instr = self.p.ranks[op[0]][op[1]]
                if type(instr) is Send:
                    self.done_at[op] = t
                    self.wake(op, t)
        if self.model in ("nccl", "nccl-single"):
            if self.active(unit[0]):
                self.act_time[unit] = t
        self.try_transfers()

    def ready_time(self, op: Op) -> float | None:
        if op not in self.posted:
            return None
        if self.model in ("nccl", "nccl-single"):
            return self.act_time.get(self.unit_of[op])
        return self.post_time[op]

    def try_transfers(self) -> None:
        for met in self.meetings:
            if met[0] in self.scheduled:
                continue
            ready = [self.ready_time(op) for op in met]
            if any(x is None for x in ready):
                continue
            at = max(x for x in ready if x is not None) + self.latency.get(met[0], 0.0)
            self.scheduled.add(met[0])
            for op in met:
                self.push(at, "complete", op)
        for s, r in list(self.matched.items()):
            if type(self.p.ranks[s[0]][s[1]]) is not Send or r in self.scheduled:
                continue
            lat = self.latency[s]
            if self.model == "eager":
                at = max(self.post_time[r], self.post_time[s] + lat)
            else:
                a, b = self.ready_time(s), self.ready_time(r)
                if a is None or b is None:
                    continue
                at = max(a, b) + lat
            self.scheduled.add(r)
            if self.model != "eager":
                self.push(at, "complete", s)
            self.push(at, "complete", r)

    def complete_event(self, t: float, op: Op) -> None:
        self.completed.add(op)
        self.done_at[op] = t
        self.wake(op, t)
        if self.model in ("nccl", "nccl-single"):
            unit = self.unit_of[op]
            if all(x in self.completed for x in unit):
                for key in self.stream_keys(unit):
                    queue = self.streams[key]
                    assert queue[0] == unit
                    queue.popleft()
                    if queue and queue[0] not in self.act_time and self.active(queue[0][0]):
                        self.act_time[queue[0]] = t
                self.try_transfers()

    def wake(self, op: Op, t: float) -> None:
        rank = self.waiting.pop(op, None)
        if rank is not None:
            self.push(t, "rank", rank)


def run_timed(
    program: Program,
    model: str,
    duration: dict[Op, float],
    latency: dict[Op, float],
    overhead: dict[int, tuple[float, float]] | None = None,
) -> Outcome:
    """Discrete-event replay with durations per compute op, latency per send and host
    overheads per rank (time per post, per Wait after its release; none by default)."""
    host = overhead or {rank: (0.0, 0.0) for rank in range(program.num_ranks)}
    return _Timed(program, model, duration, latency, host).run_timed()
