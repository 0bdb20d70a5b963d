"""Place sends, receives and waits: the default lowering policy (docs/compile.md).

Requires: a compute-only Program from `assign_microbatches` (hand-placed Send/Recv/Wait may
already be present; they are kept where the schedule put them).
Ensures: every message between two ranks has exactly one Send on the producing rank and one
Recv on the consuming rank; every posted op is completed by exactly one Wait; a Recv is
waited before the op that consumes it. For the ops this pass places, the program runs to
completion under every comm model of DESIGN §5, `nccl-single` included, and never turns a
runnable compute order into a deadlock or a mismatch.

The policy, "default":
1. Replay the compute order with unit durations (F=1, B=2, I=1, W=1; a fused op the sum)
   as soon as data allows. This is a topological order of the whole program; a compute order
   that cannot run at all is reported here with the op each rank is stuck on.
2. Give each message the time its producer ends and sort every event (compute starts and
   messages) into one global order. Each rank posts its sends and receives in that order:
   a send right after the op that produces it, a receive at the point of that rank's program
   where the message comes into existence. Every pair of ranks therefore sees its messages in
   the same order on both sides, and the global order is itself a run in which every op
   completes when it is reached — which is why no comm model can deadlock it.
3. The posts between two compute ops form one group (posted together, as
   `batch_isend_irecv`). Before each compute op one Wait completes the receives it consumes
   and every send posted since the previous compute op (as DualPipe does); whatever is still
   open at the end is completed by a final Wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipecc.diagnostics import ScheduleError
from pipecc.ir.dataflow import Dataflow
from pipecc.ir.ops import Compute, Fused, Instr, Kind, Recv, Send, Wait
from pipecc.ir.program import Program

POLICY = "default"
UNIT_COST = {Kind.F: 1, Kind.B: 2, Kind.I: 1, Kind.W: 1}

_new = tuple.__new__


@dataclass
class _RankOps:
    """The compute ops of one rank, with what each consumes and produces."""

    computes: list[Compute | Fused] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # index in the input list
    inputs: list[tuple[int, ...]] = field(default_factory=list)  # message keys needed
    outputs: list[tuple[tuple[int, int], ...]] = field(default_factory=list)  # (key, dst)
    durations: list[int] = field(default_factory=list)
    start: list[int] = field(default_factory=list)
    end: list[int] = field(default_factory=list)


def insert_comms(prog: Program) -> Program:
    """Lower a compute-only program with the default policy (module docstring)."""
    flow = Dataflow(prog.placement)
    ranks = [_collect(instrs, flow) for instrs in prog.ranks]
    manual_sends, manual_recvs = _manual_messages(prog, flow)
    _replay_unit_times(ranks, prog)
    events = _message_events(ranks, manual_sends, manual_recvs, prog.num_ranks)
    lowered = tuple(
        _emit_rank(rank, prog.ranks[rank], ranks[rank], events[rank], flow)
        for rank in range(prog.num_ranks)
    )
    return Program(
        schedule=prog.schedule,
        source=prog.source,
        num_ranks=prog.num_ranks,
        num_microbatches=prog.num_microbatches,
        params=prog.params,
        comm=POLICY,
        placement=prog.placement,
        ranks=lowered,
    )


def _collect(instrs: Sequence[Instr], flow: Dataflow) -> _RankOps:
    ops = _RankOps()
    for position, instr in enumerate(instrs):
        if type(instr) is Compute:
            parts: tuple[Compute, ...] = (instr,)
            duration = UNIT_COST[instr.kind]
        elif type(instr) is Fused:
            parts = (instr.forward, instr.backward)
            duration = UNIT_COST[instr.forward.kind] + UNIT_COST[instr.backward.kind]
        else:
            continue
        inputs = []
        outputs = []
        for op in parts:
            needed = flow.input_flow(op.kind, op.pipe, op.stage, op.mb)
            if needed is not None:
                inputs.append(needed.key)
            made = flow.output_flow(op.kind, op.pipe, op.stage, op.mb)
            if made is not None:
                outputs.append((made.key, made.dst))
        ops.computes.append(instr)
        ops.positions.append(position)
        ops.inputs.append(tuple(inputs))
        ops.outputs.append(tuple(outputs))
        ops.durations.append(duration)
    return ops


def _manual_messages(prog: Program, flow: Dataflow) -> tuple[set[int], set[int]]:
    """The message keys whose send (resp. recv) the schedule placed by hand."""
    sends: set[int] = set()
    recvs: set[int] = set()
    for instrs in prog.ranks:
        for instr in instrs:
            if type(instr) is Send:
                sends.add(flow.key(instr.what, instr.pipe, instr.stage, instr.mb))
            elif type(instr) is Recv:
                recvs.add(flow.key(instr.what, instr.pipe, instr.stage, instr.mb))
    return sends, recvs


def _replay_unit_times(ranks: list[_RankOps], prog: Program) -> None:
    """Run every rank's computes as soon as their inputs exist (unit durations)."""
    available: dict[int, int] = {}
    cursor = [0] * len(ranks)
    clock = [0] * len(ranks)
    remaining = sum(len(r.computes) for r in ranks)
    while remaining:
        progressed = 0
        for rank, ops in enumerate(ranks):
            k, now = cursor[rank], clock[rank]
            inputs, outputs, durations = ops.inputs, ops.outputs, ops.durations
            start, end = ops.start, ops.end
            count = len(ops.computes)
            while k < count:
                ready = now
                for key in inputs[k]:
                    at = available.get(key)
                    if at is None:
                        break
                    if at > ready:
                        ready = at
                else:
                    now = ready + durations[k]
                    start.append(ready)
                    end.append(now)
                    for key, _ in outputs[k]:
                        available[key] = now
                    k += 1
                    continue
                break
            progressed += k - cursor[rank]
            cursor[rank], clock[rank] = k, now
        if not progressed:
            raise _stuck(ranks, cursor, available, prog)
        remaining -= progressed


def _stuck(
    ranks: list[_RankOps], cursor: list[int], available: dict[int, int], prog: Program
) -> ScheduleError:
    flow = Dataflow(prog.placement)
    lines = []
    first_span = None
    for rank, ops in enumerate(ranks):
        k = cursor[rank]
        if k >= len(ops.computes):
            continue
        instr = ops.computes[k]
        missing = [flow.message(key).label() for key in ops.inputs[k] if key not in available]
        lines.append(f"rank {rank} at {instr.label()} waits for {', '.join(missing)}")
        first_span = first_span or instr.span
    return ScheduleError(
        "the compute order cannot run: every rank that has ops left waits for data that "
        "only comes after it\n  " + "\n  ".join(lines),
        first_span,
    )


# ---- global order ---------------------------------------------------------------------------

# An event key sorts compute starts and messages into one global order:
#   compute k of rank r: (start, 1, r, k)
#   message:             (end of producer, 0, producing rank, producer index, output index)
# A message sorts before any compute that starts when it appears, so it is posted first.


@dataclass
class _Event:
    key: tuple[int, int, int, int, int]
    message: int
    peer: int
    send: bool


def _message_events(
    ranks: list[_RankOps], manual_sends: set[int], manual_recvs: set[int], num_ranks: int
) -> list[list[_Event]]:
    events: list[list[_Event]] = [[] for _ in range(num_ranks)]
    for src, ops in enumerate(ranks):
        for k, outputs in enumerate(ops.outputs):
            for sub, (key, dst) in enumerate(outputs):
                if dst == src:
                    continue
                order = (ops.end[k], 0, src, k, sub)
                if key not in manual_sends:
                    events[src].append(_Event(order, key, dst, True))
                if key not in manual_recvs:
                    events[dst].append(_Event(order, key, src, False))
    for rank_events in events:
        rank_events.sort(key=lambda event: event.key)
    return events


# ---- emission -------------------------------------------------------------------------------


@dataclass
class _Emitter:
    """Builds one rank's lowered list: posts, waits and computes in order."""

    flow: Dataflow
    out: list[Instr] = field(default_factory=list)
    open_sends: list[int] = field(default_factory=list)
    recv_at: dict[int, int] = field(default_factory=dict)  # message key -> index of its Recv
    waited: set[int] = field(default_factory=set)
    groups: dict[int, int] = field(default_factory=dict)
    next_group: int = 0
    moved: dict[int, int] = field(default_factory=dict)  # input index -> output index

    def post(self, batch: list[_Event]) -> None:
        group = None
        if len(batch) > 1:
            group = self.next_group
            self.next_group += 1
        message = self.flow.message
        for event in batch:
            what, pipe, stage, mb = message(event.message)
            index = len(self.out)
            if event.send:
                self.out.append(_new(Send, (what, event.peer, pipe, stage, mb, group, None)))
                self.open_sends.append(index)
            else:
                self.out.append(_new(Recv, (what, event.peer, pipe, stage, mb, group, None)))
                self.recv_at[event.message] = index

    def manual(self, position: int, instr: Instr) -> None:
        """Copy a hand-placed Send/Recv/Wait, renumbering its group and wait indices."""
        index = len(self.out)
        self.moved[position] = index
        if type(instr) is Wait:
            targets = tuple(self.moved[i] for i in instr.ops)
            self.waited.update(targets)
            self.out.append(Wait(targets, instr.span))
            return
        assert type(instr) is Send or type(instr) is Recv
        group = instr.group
        if group is not None:
            if group not in self.groups:
                self.groups[group] = self.next_group
                self.next_group += 1
            group = self.groups[group]
        key = self.flow.key(instr.what, instr.pipe, instr.stage, instr.mb)
        self.out.append(instr._replace(group=group))
        if type(instr) is Send:
            self.open_sends.append(index)
        else:
            self.recv_at[key] = index

    def wait_before(self, inputs: tuple[int, ...]) -> None:
        targets = [i for i in self.open_sends if i not in self.waited]
        for key in inputs:
            index = self.recv_at.pop(key, None)
            if index is not None and index not in self.waited:
                targets.append(index)
        self.open_sends = []
        if targets:
            self.waited.update(targets)
            self.out.append(_new(Wait, (tuple(sorted(targets)), None)))

    def wait_all(self) -> None:
        posted = [
            i
            for i, instr in enumerate(self.out)
            if (type(instr) is Send or type(instr) is Recv) and i not in self.waited
        ]
        if posted:
            self.waited.update(posted)
            self.out.append(_new(Wait, (tuple(posted), None)))


def _emit_rank(
    rank: int, instrs: Sequence[Instr], ops: _RankOps, events: list[_Event], flow: Dataflow
) -> tuple[Instr, ...]:
    emitter = _Emitter(flow)
    cursor = 0
    position = 0  # next input instruction to copy (hand-placed comm ops)
    for k, instr in enumerate(ops.computes):
        key = (ops.start[k], 1, rank, k, 0)
        cursor = _post_until(emitter, events, cursor, key)
        position = _copy_manual(emitter, instrs, position, ops.positions[k])
        emitter.wait_before(ops.inputs[k])
        emitter.out.append(instr)
        position += 1
    _post_until(emitter, events, cursor, None)
    _copy_manual(emitter, instrs, position, len(instrs))
    emitter.wait_all()
    return tuple(emitter.out)


def _post_until(
    emitter: _Emitter, events: list[_Event], cursor: int, key: tuple[int, ...] | None
) -> int:
    stop = cursor
    while stop < len(events) and (key is None or events[stop].key < key):
        stop += 1
    if stop > cursor:
        emitter.post(events[cursor:stop])
    return stop


def _copy_manual(emitter: _Emitter, instrs: Sequence[Instr], start: int, stop: int) -> int:
    for position in range(start, stop):
        emitter.manual(position, instrs[position])
    return stop

