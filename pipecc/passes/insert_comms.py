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
   `batch_isend_irecv`). Before each compute op one Wait completes the receives it consumes,
   and the sends that are due: a send is completed before the first compute op of its rank
   that starts, in the replay of step 1, no earlier than the op that consumes the message on
   the receiving rank. By then the receiver has posted its receive, so a rendezvous send does
   not hold its rank up in the unit-time picture, and the buffer is not held for longer than
   the message is in use. Whatever is still open at the end is completed by a final Wait.
   Hand-placed sends without a hand-placed `wait` follow the same rule.

The policy "early-recv" (`EARLY_RECV`) is the default with every receive it places posted
before the first compute op, still in the global order, so a transfer can start the moment
its sender posts. It is for gloo: there every posted op progresses on its own (DESIGN §5's
`rendezvous` model), and a receive posted late delays a transfer that could already have
happened. Under NCCL's ordered streams the early receives sit in front of the sends behind
them and the program deadlocks: it passes `verify --comm rendezvous` and `eager` only, and
the runtime refuses to run it on NCCL (`pipecc.ir.program.RENDEZVOUS_ONLY`).
"""

from __future__ import annotations

import enum
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from pipecc.diagnostics import ScheduleError
from pipecc.ir.dataflow import Dataflow, Message
from pipecc.ir.ops import Compute, Fused, Instr, Kind, Msg, Recv, Send, Wait
from pipecc.ir.program import Program

UNIT_COST = {Kind.F: 1, Kind.B: 2, Kind.I: 1, Kind.W: 1}

_new = tuple.__new__


class RecvPosting(enum.Enum):
    """Where a receive is posted on its rank (both keep every pair in one global order)."""

    # before the first compute op that starts once the message exists (the default policy)
    WHEN_MADE = "when-made"
    # before the compute op during which the message comes to exist, so that a rendezvous
    # transfer can start the moment the data is there (the alignment pass)
    BEFORE_BUSY = "before-busy"
    # before the first compute op of the rank (the early-recv policy: rendezvous only)
    AT_START = "at-start"


class Grouping(enum.Enum):
    """Which posts between two compute ops are posted together (one nccl unit)."""

    PER_GAP = "per-gap"  # all of them (the default policy)
    BY_TIME = "by-time"  # those whose messages come to exist at the same moment
    NONE = "none"  # each alone


def _unit_duration(instr: Compute | Fused) -> float:
    if type(instr) is Compute:
        return UNIT_COST[instr.kind]
    return UNIT_COST[instr.forward.kind] + UNIT_COST[instr.backward.kind]  # type: ignore[union-attr]


def _no_latency(stage: int) -> float:
    return 0.0


@dataclass(frozen=True, slots=True)
class CommPlacement:
    """The knobs of the lowering: the durations and latencies of the replay that orders the
    program, where receives go, and what is grouped. `DEFAULT` is the default policy; the
    alignment pass (`align_comms`) uses the real costs. A compute op's `duration` may depend
    on its kind and stage only: it is asked once per (kind, pipe, stage), not per op."""

    policy: str
    duration: Callable[[Compute | Fused], float] = _unit_duration
    latency: Callable[[int], float] = _no_latency  # by receiving stage
    recv_posting: RecvPosting = RecvPosting.WHEN_MADE
    grouping: Grouping = Grouping.PER_GAP


DEFAULT = CommPlacement("default")
POLICY = DEFAULT.policy
EARLY_RECV = CommPlacement("early-recv", recv_posting=RecvPosting.AT_START)
POLICIES = {placement.policy: placement for placement in (DEFAULT, EARLY_RECV)}

# A message event is (gap, order, payload, key, is_send, time): it is posted before compute
# op `gap` of its rank; `payload` is the Send/Recv fields up to the group, (what, peer, pipe,
# stage, mb); `order` sorts every message into one global order (_message_order: by the time
# the message comes to exist, then rank, then position in the rank's list, the same on every
# rank); `time` is that moment, for grouping.
Event = tuple[int, int, tuple[object, ...], int, bool, int]


@dataclass
class _RankOps:
    """The compute ops of one rank, with what each consumes and produces."""

    computes: list[Compute | Fused] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # index in the input list
    inputs: list[tuple[int, ...]] = field(default_factory=list)  # message keys needed
    outputs: list[tuple[tuple[int, int, tuple[object, ...], tuple[object, ...], float], ...]] = (
        field(default_factory=list)
    )  # (key, dst, send payload, recv payload, latency)
    durations: list[float] = field(default_factory=list)
    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    # With hand-placed sends: the (message key, latency) that become available when compute k
    # ends (a hand-placed send publishes its tensor where it is posted, not where it is made).
    publish: list[list[tuple[int, float]]] | None = None


class _Keys:
    """The message keys of this pass: `Dataflow`'s (what, pipe, stage) base times M, plus the
    microbatch. A rank's ops go through the microbatches of a few stages in order, so their
    look-ups in the tables indexed by key (`_replay`, the emission) walk memory in order: with
    Dataflow's microbatch-major keys every look-up of a large program was a cache miss."""

    def __init__(self, flow: Dataflow, microbatches: int) -> None:
        self.flow, self.count = flow, microbatches
        self.size = microbatches * flow.mb_stride  # every key is below this

    def key(self, what: Msg, pipe: int, stage: int, mb: int) -> int:
        return self.flow.key(what, pipe, stage, 0) * self.count + mb

    def message(self, key: int) -> Message:
        base, mb = divmod(key, self.count)
        return self.flow.message(base)._replace(mb=mb)


def insert_comms(prog: Program, placement: CommPlacement = DEFAULT) -> Program:
    """Lower a compute-only program with the default policy, or another of `POLICIES`
    (module docstring)."""
    return lower(prog, placement)


def strip_comms(prog: Program) -> Program:
    """`prog` with every send, receive and wait removed, hand-placed ones included: the
    compute-only program a lowering starts from."""
    ranks = tuple(
        tuple(instr for instr in instrs if type(instr) is Compute or type(instr) is Fused)
        for instrs in prog.ranks
    )
    return replace(prog, ranks=ranks, comm="none")


def lower(prog: Program, placement: CommPlacement) -> Program:
    """Place the comm ops of `prog` as `placement` says (the module docstring describes the
    default; `align_comms` passes the real costs)."""
    flow = Dataflow(prog.placement)
    keys = _Keys(flow, prog.num_microbatches)
    table = _op_table(keys, placement)
    ranks = [_collect(instrs, keys, placement, table) for instrs in prog.ranks]
    consumed = _replay(ranks, prog, keys)
    if placement.duration is not _unit_duration or placement.latency is not _no_latency:
        _integer_times(ranks, consumed)
    span = 2 * max((len(instrs) for instrs in prog.ranks), default=1) + 2
    manual = [
        len(ops.computes) != len(instrs) for ops, instrs in zip(ranks, prog.ranks, strict=True)
    ]  # the ranks with hand-placed sends, recvs or waits
    manual_sends, manual_recvs = (
        _manual_messages(prog, ranks, keys, span) if any(manual) else ({}, set())
    )
    events = _message_events(ranks, manual_sends, manual_recvs, span, placement.recv_posting)
    for ops in ranks:  # what the events now hold: freed, so that emission reuses the memory
        ops.outputs.clear()
        ops.publish = None
    lowered = []
    for rank, instrs in enumerate(prog.ranks):
        hand_waited = _hand_waited(instrs) if manual[rank] else set()
        emitter = _Emitter(
            keys, ranks[rank].start, consumed, placement.grouping, hand_waited=hand_waited
        )
        lowered.append(_emit_rank(instrs, ranks[rank], events[rank], emitter))
        events[rank] = []
    if any(manual):  # hand-placed sends, recvs or waits
        _check_hand_placed_order(tuple(lowered))
    return Program(
        schedule=prog.schedule,
        source=prog.source,
        num_ranks=prog.num_ranks,
        num_microbatches=prog.num_microbatches,
        params=prog.params,
        comm=placement.policy,
        placement=prog.placement,
        ranks=tuple(lowered),
    )


def _check_hand_placed_order(ranks: tuple[tuple[Instr, ...], ...]) -> None:
    """Hand-placed sends or recvs can post a pair's messages in different orders on the two
    sides; matched in posting order, that would deliver the wrong tensor. Say so here."""
    sends: dict[tuple[int, int], list[Send]] = {}
    recvs: dict[tuple[int, int], list[Recv]] = {}
    for rank, instrs in enumerate(ranks):
        for instr in instrs:
            if type(instr) is Send:
                sends.setdefault((rank, instr.peer), []).append(instr)
            elif type(instr) is Recv:
                recvs.setdefault((instr.peer, rank), []).append(instr)
    for (src, dst), posted in sorted(sends.items()):
        for k, (send, recv) in enumerate(zip(posted, recvs.get((src, dst), []), strict=False)):
            if send.what is not recv.what or send[2:5] != recv[2:5]:
                raise ScheduleError(
                    f"rank {src}'s send #{k} to rank {dst} carries {_name(send)} but rank "
                    f"{dst}'s receive #{k} from rank {src} expects {_name(recv)}: messages "
                    "between two ranks match in posting order, so this would deliver the "
                    "wrong tensor (check the order of the hand-placed sends and recvs)",
                    send.span or recv.span,
                    notes=((recv.span, "the receive"),) if send.span and recv.span else (),
                )


def _name(op: Send | Recv) -> str:
    return f"{op.what.value} stage {op.stage} mb {op.mb}"


# What a computation of one (kind, pipe, stage) consumes and produces, for any microbatch:
# (base of the key of its input message, or -1; (base, src, dst, what, receiving stage,
# latency) of its output message, or None; its duration).
_OpInfo = tuple[int, tuple[int, int, int, Msg, int, float] | None, float]


def _op_table(keys: _Keys, placement: CommPlacement) -> dict[Kind, list[list[_OpInfo]]]:
    """`_OpInfo` by kind, pipe and stage: one look-up per compute op in `_collect`. The key
    bases are `_Keys`' (a message's key is its base plus its microbatch)."""
    flow, count = keys.flow, keys.count
    stages = max(flow.placement.num_stages(p) for p in range(flow.placement.num_pipes))
    latency_of = [placement.latency(stage) for stage in range(stages)]
    table: dict[Kind, list[list[_OpInfo]]] = {}
    for kind in Kind:
        by_pipe = table[kind] = []
        for pipe in range(flow.placement.num_pipes):
            row = []
            for stage in range(flow.placement.num_stages(pipe)):
                needed = flow.inputs[kind][pipe][stage]
                made = flow.outputs[kind][pipe][stage]
                output = None
                if made is not None:
                    base, src, dst, what, _, to = made
                    latency = latency_of[to] if src != dst else 0.0
                    output = (base * count, src, dst, what, to, latency)
                duration = placement.duration(Compute(kind, 0, pipe, stage, 0))
                row.append((-1 if needed is None else needed[0] * count, output, duration))
            by_pipe.append(row)
    return table


def _collect(
    instrs: Sequence[Instr],
    keys: _Keys,
    placement: CommPlacement,
    table: dict[Kind, list[list[_OpInfo]]],
) -> _RankOps:
    ops = _RankOps()
    fused_durations: dict[tuple[object, ...], float] = {}
    add_compute, add_position = ops.computes.append, ops.positions.append
    add_inputs, add_outputs, add_duration = (
        ops.inputs.append,
        ops.outputs.append,
        ops.durations.append,
    )
    for position, instr in enumerate(instrs):
        if type(instr) is Compute:
            kind, _, pipe, stage, mb, _ = instr
            needed, made, duration = table[kind][pipe][stage]
            add_inputs(() if needed < 0 else (needed + mb,))
            if made is None:
                add_outputs(())
            else:
                base, src, dst, what, to, latency = made
                add_outputs(
                    (
                        (
                            base + mb,
                            dst,
                            (what, dst, pipe, to, mb),
                            (what, src, pipe, to, mb),
                            latency,
                        ),
                    )
                )
        elif type(instr) is Fused:
            inputs = []
            outputs = []
            for kind, _, pipe, stage, mb, _ in instr[:2]:
                needed, made, _ = table[kind][pipe][stage]
                if needed >= 0:
                    inputs.append(needed + mb)
                if made is not None:
                    base, src, dst, what, to, latency = made
                    outputs.append(
                        (
                            base + mb,
                            dst,
                            (what, dst, pipe, to, mb),
                            (what, src, pipe, to, mb),
                            latency,
                        )
                    )
            add_inputs(tuple(inputs))
            add_outputs(tuple(outputs))
            signature = (instr[0][0], instr[0][3], instr[1][0], instr[1][3])
            if signature not in fused_durations:
                fused_durations[signature] = placement.duration(instr)
            duration = fused_durations[signature]
        else:
            continue
        add_compute(instr)
        add_position(position)
        add_duration(duration)
    if len(ops.computes) != len(instrs) and any(type(instr) is Send for instr in instrs):
        _anchor_manual_sends(ops, instrs, keys)
    return ops


def _anchor_manual_sends(ops: _RankOps, instrs: Sequence[Instr], keys: _Keys) -> None:
    """Publish each hand-sent message at the end of the compute op just before its send."""
    manual = {
        keys.key(i.what, i.pipe, i.stage, i.mb): position
        for position, i in enumerate(instrs)
        if type(i) is Send
    }
    latency = {out[0]: out[4] for outputs in ops.outputs for out in outputs}
    ops.publish = [
        [(out[0], out[4]) for out in outputs if out[0] not in manual] for outputs in ops.outputs
    ]
    k = -1
    for instr in instrs:
        if type(instr) is Compute or type(instr) is Fused:
            k += 1
        elif type(instr) is Send:
            key = keys.key(instr.what, instr.pipe, instr.stage, instr.mb)
            ops.publish[k].append((key, latency.get(key, 0.0)))


def _manual_messages(
    prog: Program, ranks: list[_RankOps], keys: _Keys, span: int
) -> tuple[dict[int, int], set[int]]:
    """The messages the schedule sends by hand, with the global order of their posts, and the
    messages it receives by hand.

    A hand-placed send is posted where the schedule wrote it, possibly well after its producer;
    the receiving side (placed by this pass) must see it in the same order among that pair's
    messages, so the message takes its order from the send's own position.
    """
    sends: dict[int, int] = {}
    recvs: set[int] = set()
    num_ranks = prog.num_ranks
    for rank, instrs in enumerate(prog.ranks):
        ends, computes = ranks[rank].end, -1
        for position, instr in enumerate(instrs):
            if type(instr) is Compute or type(instr) is Fused:
                computes += 1
            elif type(instr) is Send:
                key = keys.key(instr.what, instr.pipe, instr.stage, instr.mb)
                time = int(ends[computes]) if computes >= 0 else 0
                sends[key] = _message_order(time, rank, position, 0, num_ranks, span)
            elif type(instr) is Recv:
                recvs.add(keys.key(instr.what, instr.pipe, instr.stage, instr.mb))
    return sends, recvs


def _replay(ranks: list[_RankOps], prog: Program, keys: _Keys) -> list[float]:
    """Run every rank's computes as soon as their inputs exist (the placement's durations and
    latencies); return when each message is consumed (0 for a message nothing consumes).

    Both tables are lists indexed by message key: the keys are dense (`_Keys`), and a
    list index is cheaper than a hash look-up in this loop over every op."""
    available: list[float | None] = [None] * keys.size
    consumed: list[float] = [0] * keys.size
    cursor = [0] * len(ranks)
    clock = [0.0] * len(ranks)
    remaining = sum(len(r.computes) for r in ranks)
    # what each compute op makes available, as (key, _, _, _, latency) tuples: its outputs,
    # or with hand-placed sends the (key, latency) pairs _anchor_manual_sends computed
    publishes = [
        ops.outputs
        if ops.publish is None
        else [[(key, 0, 0, 0, lat) for key, lat in keys] for keys in ops.publish]
        for ops in ranks
    ]
    while remaining:
        progressed = 0
        for rank, ops in enumerate(ranks):
            k, now = cursor[rank], clock[rank]
            inputs, durations = ops.inputs, ops.durations
            start, end = ops.start, ops.end
            publish = publishes[rank]
            count = len(ops.computes)
            while k < count:
                ready = now
                for key in inputs[k]:
                    at = available[key]
                    if at is None:
                        break
                    if at > ready:
                        ready = at
                else:
                    for key in inputs[k]:
                        consumed[key] = ready
                    now = ready + durations[k]
                    start.append(ready)
                    end.append(now)
                    for output in publish[k]:
                        available[output[0]] = now + output[4]
                    k += 1
                    continue
                break
            progressed += k - cursor[rank]
            cursor[rank], clock[rank] = k, now
        if not progressed:
            raise _stuck(ranks, cursor, available, keys)
        remaining -= progressed
    return consumed


def _stuck(
    ranks: list[_RankOps], cursor: list[int], available: list[float | None], keys: _Keys
) -> ScheduleError:
    lines = []
    first_span = None
    for rank, ops in enumerate(ranks):
        k = cursor[rank]
        if k >= len(ops.computes):
            continue
        instr = ops.computes[k]
        missing = [keys.message(key).label() for key in ops.inputs[k] if available[key] is None]
        lines.append(f"rank {rank} at {instr.label()} waits for {', '.join(missing)}")
        first_span = first_span or instr.span
    return ScheduleError(
        "the compute order cannot run: every rank that has ops left waits for data that "
        "only comes after it\n  " + "\n  ".join(lines),
        first_span,
    )


# ---- global order ---------------------------------------------------------------------------


def _integer_times(ranks: list[_RankOps], consumed: list[float]) -> None:
    """Replace the replay's times by their rank among all distinct times, so that event orders
    are exact integers (unit costs give integers already: nothing to do)."""
    values = {t for ops in ranks for t in (*ops.start, *ops.end)}
    if all(float(t).is_integer() for t in values):
        return
    index = {t: i for i, t in enumerate(sorted(values))}
    for ops in ranks:
        ops.start = [index[t] for t in ops.start]
        ops.end = [index[t] for t in ops.end]
    consumed[:] = [index.get(t, 0) for t in consumed]


def _message_events(
    ranks: list[_RankOps],
    manual_sends: dict[int, int],
    manual_recvs: set[int],
    span: int,
    posting: RecvPosting,
) -> list[list[Event]]:
    """Every rank's message events (its sends and its recvs), in the order it posts them."""
    num_ranks = len(ranks)
    events: list[list[Event]] = [[] for _ in range(num_ranks)]
    # a receive goes before the first compute op that starts at or after the moment its
    # message exists (WHEN_MADE), or that is still running then (BEFORE_BUSY), or before the
    # first compute op of all (AT_START)
    find: Callable[[Sequence[float], float], int]
    if posting is RecvPosting.WHEN_MADE:
        find, times = bisect_left, [ops.start for ops in ranks]
    elif posting is RecvPosting.BEFORE_BUSY:
        find, times = bisect_right, [ops.end for ops in ranks]
    else:
        find, times = _first_gap, [ops.start for ops in ranks]
    unit = 2 * num_ranks * span  # an order divided by this is its time
    manual = bool(manual_sends or manual_recvs)
    for src, ops in enumerate(ranks):
        own, ends, positions = events[src], ops.end, ops.positions
        first = src * span  # _message_order, inlined: this loop sees every message
        for k, outputs in enumerate(ops.outputs):
            if not outputs:
                continue
            made = int(ends[k])  # an integer time: see _integer_times
            base = made * unit + first + 2 * positions[k]
            for sub, (key, dst, send, recv, _) in enumerate(outputs):
                if dst == src:
                    continue
                if manual:
                    _manual_events(
                        events,
                        (k, src, dst, key, base + sub, made, send, recv),
                        manual_sends,
                        manual_recvs,
                        (find, times[dst], unit),
                    )
                    continue
                order = base + sub
                own.append((k + 1, order, send, key, True, made))
                # found by the time as the replay left it: a float compares faster with floats
                gap = find(times[dst], ends[k])
                events[dst].append((gap, order, recv, key, False, made))
    for rank_events in events:
        rank_events.sort()
    return events


def _manual_events(
    events: list[list[Event]],
    message: tuple[int, int, int, int, int, int, tuple[object, ...], tuple[object, ...]],
    manual_sends: dict[int, int],
    manual_recvs: set[int],
    locate: tuple[Callable[..., int], list[float], int],
) -> None:
    """`_message_events` for one message of a program with hand-placed sends or recvs: a
    hand-sent message takes its order from its send; a hand-received one gets no Recv."""
    k, src, dst, key, order, made, send, recv = message
    find, times, unit = locate
    if key in manual_sends:
        order = manual_sends[key]
    else:
        events[src].append((k + 1, order, send, key, True, made))
    if key not in manual_recvs:
        events[dst].append((find(times, order // unit), order, recv, key, False, made))


def _first_gap(times: Sequence[float], time: float) -> int:
    """Where an AT_START receive goes: before compute op 0, whenever its message is made."""
    return 0


def _message_order(time: int, rank: int, position: int, sub: int, num_ranks: int, span: int) -> int:
    """Messages that come to exist at `time`, after input position `position` of `rank`
    (sub: which of the op's outputs): one integer, the same on every rank."""
    return ((2 * time * num_ranks + rank) * span + 2 * position) + sub


# ---- emission -------------------------------------------------------------------------------


@dataclass
class _Emitter:
    """Builds one rank's lowered list: posts, waits and computes in order."""

    keys: _Keys
    starts: list[float]  # start of each compute op of the rank in the ordering replay
    consumed: list[float]  # message key -> start of the op consuming it, likewise
    grouping: Grouping = Grouping.PER_GAP
    out: list[Instr] = field(default_factory=list)
    due: dict[int, list[int]] = field(default_factory=dict)  # compute k -> sends to wait
    recv_at: dict[int, int] = field(default_factory=dict)  # message key -> index of its Recv
    hand_waited: set[int] = field(default_factory=set)  # input positions a hand wait lists
    groups: dict[int, int] = field(default_factory=dict)
    next_group: int = 0
    moved: dict[int, int] = field(default_factory=dict)  # input index -> output index

    def post(self, batch: list[Event]) -> None:
        """Post the events of one gap between two compute ops, grouped as the placement says."""
        if self.grouping is Grouping.PER_GAP:
            self._post_group(batch)
        elif self.grouping is Grouping.NONE:
            for event in batch:
                self._post_group([event])
        else:
            start = 0
            for i in range(1, len(batch) + 1):
                if i == len(batch) or batch[i][5] != batch[start][5]:
                    self._post_group(batch[start:i])
                    start = i

    def _post_group(self, batch: list[Event]) -> None:
        group = None
        if len(batch) > 1:
            group = self.next_group
            self.next_group += 1
        tail = (group, None)
        out, recv_at, due = self.out, self.recv_at, self.due
        starts, consumed = self.starts, self.consumed
        for _, _, payload, key, send, _ in batch:
            if send:  # due: as `_due`, inlined (this loop places every message of a program)
                k = bisect_left(starts, consumed[key])
                waits = due.get(k)
                if waits is None:
                    due[k] = [len(out)]
                else:
                    waits.append(len(out))
                out.append(_new(Send, payload + tail))
            else:
                recv_at[key] = len(out)
                out.append(_new(Recv, payload + tail))

    def manual(self, position: int, instr: Instr) -> None:
        """Copy a hand-placed Send/Recv/Wait, renumbering its group and wait indices."""
        index = len(self.out)
        self.moved[position] = index
        if type(instr) is Wait:
            self.out.append(Wait(tuple(self.moved[i] for i in instr.ops), instr.span))
            return
        assert type(instr) is Send or type(instr) is Recv
        group = instr.group
        if group is not None:
            if group not in self.groups:
                self.groups[group] = self.next_group
                self.next_group += 1
            group = self.groups[group]
        self.out.append(instr._replace(group=group))
        if position in self.hand_waited:
            return  # the schedule completes it with its own wait
        key = self.keys.key(instr.what, instr.pipe, instr.stage, instr.mb)
        if type(instr) is Send:
            self._due(key, index)
        else:
            self.recv_at[key] = index

    def _due(self, key: int, index: int) -> None:
        """A send is completed before the first compute op of its rank that starts, in the
        unit-time replay, once its receiver has consumed it (the receiver has posted its recv
        by then): late enough not to hold the sender up, early enough to free the buffer."""
        k = bisect_left(self.starts, self.consumed[key])
        self.due.setdefault(k, []).append(index)

    def wait_before(self, k: int, inputs: tuple[int, ...]) -> None:
        """The Wait before compute op k: the recvs it consumes and the sends due there."""
        targets = self.due.pop(k, [])
        for key in inputs:
            index = self.recv_at.pop(key, None)
            if index is not None:
                targets.append(index)
        if targets:
            targets.sort()
            self.out.append(_new(Wait, (tuple(targets), None)))

    def wait_all(self) -> None:
        """One final Wait for what is still open: the sends due after the last compute op,
        and any recv no compute op consumed (hand-waited ops were never registered)."""
        posted = [i for waits in self.due.values() for i in waits]
        posted.extend(self.recv_at.values())
        if posted:
            posted.sort()
            self.out.append(_new(Wait, (tuple(posted), None)))


def _emit_rank(  # noqa: C901
    instrs: Sequence[Instr], ops: _RankOps, events: list[Event], emitter: _Emitter
) -> tuple[Instr, ...]:
    """Interleave one rank's computes with its posts and waits. The default grouping (every
    gap's posts together) and the Wait before each op are inlined here: this loop places
    every instruction of a program."""
    if emitter.grouping is not Grouping.PER_GAP or len(ops.computes) != len(instrs):  # hand-placed
        return _emit_rank_general(instrs, ops, events, emitter)
    out, recv_at, due = emitter.out, emitter.recv_at, emitter.due
    starts, consumed = emitter.starts, emitter.consumed
    append, pop_due, pop_recv = out.append, due.pop, recv_at.pop
    group = emitter.next_group
    inputs = ops.inputs
    cursor, count = 0, len(events)
    next_gap = events[0][0] if events else len(ops.computes)
    for k, instr in enumerate(ops.computes):
        if next_gap <= k:
            stop = cursor + 1
            while stop < count and events[stop][0] <= k:
                stop += 1
            if stop - cursor > 1:
                tail: tuple[int | None, None] = (group, None)
                group += 1
            else:
                tail = (None, None)
            for event in events[cursor:stop]:
                payload, key = event[2], event[3]
                if event[4]:  # a send: completed when due (`_Emitter._due`)
                    at = bisect_left(starts, consumed[key])
                    waits = due.get(at)
                    if waits is None:
                        due[at] = [len(out)]
                    else:
                        waits.append(len(out))
                    append(_new(Send, payload + tail))
                else:
                    recv_at[key] = len(out)
                    append(_new(Recv, payload + tail))
            cursor = stop
            next_gap = events[stop][0] if stop < count else len(ops.computes)
        targets = pop_due(k, None)  # the Wait before op k (`_Emitter.wait_before`)
        for key in inputs[k]:
            index = pop_recv(key, None)
            if index is not None:
                if targets is None:
                    targets = [index]
                else:
                    targets.append(index)
        if targets:
            if len(targets) > 1:
                targets.sort()
            append(_new(Wait, (tuple(targets), None)))
        append(instr)
    emitter.next_group = group
    if cursor < count:
        emitter.post(events[cursor:])
    emitter.wait_all()
    return tuple(out)


def _emit_rank_general(
    instrs: Sequence[Instr], ops: _RankOps, events: list[Event], emitter: _Emitter
) -> tuple[Instr, ...]:
    """`_emit_rank` for any grouping and for hand-placed comm ops, one method per step."""
    cursor = 0
    position = 0  # next input instruction to copy (hand-placed comm ops)
    count = len(events)
    for k, instr in enumerate(ops.computes):
        stop = cursor
        while stop < count and events[stop][0] <= k:
            stop += 1
        if stop > cursor:
            emitter.post(events[cursor:stop])
            cursor = stop
        if position < ops.positions[k]:
            position = _copy_manual(emitter, instrs, position, ops.positions[k])
        emitter.wait_before(k, ops.inputs[k])
        emitter.out.append(instr)
        position += 1
    if cursor < count:
        emitter.post(events[cursor:])
    _copy_manual(emitter, instrs, position, len(instrs))
    emitter.wait_all()
    return tuple(emitter.out)


def _hand_waited(instrs: Sequence[Instr]) -> set[int]:
    return {i for instr in instrs if type(instr) is Wait for i in instr.ops}


def _copy_manual(emitter: _Emitter, instrs: Sequence[Instr], start: int, stop: int) -> int:
    for position in range(start, stop):
        emitter.manual(position, instrs[position])
    return stop
