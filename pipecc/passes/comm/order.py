"""The order of a lowering (`insert_comms`, steps 1 and 2): each compute op's messages, the
replay that orders the program, and every rank's message events in one global order."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from pipecc.diagnostics import LoweringViolation
from pipecc.ir.keys import StageMajorKeys
from pipecc.ir.ops import (
    Compute,
    Fused,
    Instr,
    Kind,
    Msg,
    Recv,
    Send,
    Sequential,
    computations,
    is_compute,
)
from pipecc.ir.printer import message
from pipecc.ir.program import Program
from pipecc.passes.comm.placement import CommPlacement, Grouping, MessageOrder, RecvPosting

# A message event, the post of a send or a receive: (gap, order, payload, key, is_send, made).
# It is posted before compute op `gap` of its rank; `order` sorts every message into one
# global order (`_message_order`: by the time the message comes to exist, then rank, then
# position in the rank's list, the same on every rank; `comm.refine` may move a message);
# `payload` is the Send/Recv fields up to the group (what, peer, pipe, stage, mb); `key` the
# message's; `made` the moment it comes to exist, for grouping. A plain tuple, unpacked by
# name where it is read (`GAP`, `ORDER`, ... index the fields the emission's scan and
# `comm.refine` read alone): there are two per message, and as a NamedTuple they cost 5% of
# a compile of 10⁶ instructions.
Event = tuple[int, int, tuple[object, ...], int, bool, int]
# Room left after each message's order for the messages `comm.refine` moves right after it
SLOTS: Final = 64
GAP: Final = 0
ORDER: Final = 1
PAYLOAD: Final = 2
KEY: Final = 3
IS_SEND: Final = 4
MADE: Final = 5


@dataclass
class RankOps:
    """The compute ops of one rank, with what each consumes and produces."""

    computes: list[Compute | Fused | Sequential] = field(default_factory=list)
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


# What a computation of one (kind, pipe, stage) consumes and produces, for any microbatch:
# (base of the key of its input message, or -1; (base, src, dst, what, receiving stage,
# latency) of its output message, or None; its duration).
_OpInfo = tuple[int, tuple[int, int, int, Msg, int, float] | None, float]


def op_table(keys: StageMajorKeys, placement: CommPlacement) -> dict[Kind, list[list[_OpInfo]]]:
    """`_OpInfo` by kind, pipe and stage: one look-up per compute op in `collect`. The key
    bases are `StageMajorKeys`' (a message's key is its base plus its microbatch)."""
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
                duration = _ordering(placement.duration(Compute(kind, 0, pipe, stage, 0)))
                row.append((-1 if needed is None else needed.base * count, output, duration))
            by_pipe.append(row)
    return table


# The ordering replay gives every op at least this duration. A cost model may give an op zero
# time; then an op and the message it makes would share one moment with the op that consumes
# it, and the message's place in the global order (by time) could fall after the receive
# that the consumer needs first. With a positive duration, time order is dependency order.
_MIN_DURATION = 1e-9


def _ordering(duration: float) -> float:
    return duration if duration > _MIN_DURATION else _MIN_DURATION


def collect(
    instrs: Sequence[Instr],
    keys: StageMajorKeys,
    placement: CommPlacement,
    table: dict[Kind, list[list[_OpInfo]]],
) -> RankOps:
    """One rank's compute ops with the message keys each consumes, what each produces and
    its duration (`table` from `op_table`)."""
    ops = RankOps()
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
        elif type(instr) is Fused or type(instr) is Sequential:
            inputs = []
            outputs = []
            for kind, _, pipe, stage, mb, _ in computations(instr):
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
            signature = (type(instr), *((op.kind, op.stage) for op in computations(instr)))
            if signature not in fused_durations:
                fused_durations[signature] = _ordering(placement.duration(instr))
            duration = fused_durations[signature]
        else:
            continue
        add_compute(instr)
        add_position(position)
        add_duration(duration)
    if len(ops.computes) != len(instrs) and any(type(instr) is Send for instr in instrs):
        _anchor_manual_sends(ops, instrs, keys)
    return ops


def _anchor_manual_sends(ops: RankOps, instrs: Sequence[Instr], keys: StageMajorKeys) -> None:
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
        if is_compute(instr):
            k += 1
        elif type(instr) is Send:
            key = keys.key(instr.what, instr.pipe, instr.stage, instr.mb)
            ops.publish[k].append((key, latency.get(key, 0.0)))


def manual_messages(
    prog: Program, ranks: list[RankOps], keys: StageMajorKeys, span: int
) -> tuple[dict[int, int], dict[int, int]]:
    """The messages the schedule sends by hand, with the global order of their posts, and the
    messages it receives by hand (their orders, -1 here, are filled in by `message_events`).

    A hand-placed send is posted where the schedule wrote it, possibly well after its producer;
    the receiving side (placed by this pass) must see it in the same order among that pair's
    messages, so the message takes its order from the send's own position.
    """
    sends: dict[int, int] = {}
    recvs: dict[int, int] = {}
    num_ranks = prog.num_ranks
    for rank, instrs in enumerate(prog.ranks):
        ends, computes = ranks[rank].end, -1
        for position, instr in enumerate(instrs):
            if is_compute(instr):
                computes += 1
            elif type(instr) is Send:
                key = keys.key(instr.what, instr.pipe, instr.stage, instr.mb)
                time = int(ends[computes]) if computes >= 0 else 0
                sends[key] = _message_order(time, rank, position, 0, num_ranks, span)
            elif type(instr) is Recv:
                recvs[keys.key(instr.what, instr.pipe, instr.stage, instr.mb)] = -1
    return sends, recvs


def order_replay(ranks: list[RankOps], prog: Program, keys: StageMajorKeys) -> list[float]:
    """Run every rank's computes as soon as their inputs exist (the placement's durations and
    latencies); return when each message is consumed (0 for a message nothing consumes).

    Both tables are lists indexed by message key: the keys are dense (`StageMajorKeys`), and a
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
    ranks: list[RankOps], cursor: list[int], available: list[float | None], keys: StageMajorKeys
) -> LoweringViolation:
    lines = []
    first_span = None
    for rank, ops in enumerate(ranks):
        k = cursor[rank]
        if k >= len(ops.computes):
            continue
        instr = ops.computes[k]
        missing = [message(keys.message(key)) for key in ops.inputs[k] if available[key] is None]
        lines.append(f"rank {rank} at {instr.label()} waits for {', '.join(missing)}")
        first_span = first_span or instr.span
    return LoweringViolation(
        "the compute order cannot run: every rank that has ops left waits for data that "
        "only comes after it\n  " + "\n  ".join(lines),
        first_span,
    )


# ---- global order ---------------------------------------------------------------------------


def integer_times(ranks: list[RankOps], consumed: list[float]) -> None:
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


def message_events(
    ranks: list[RankOps],
    manual_sends: dict[int, int],
    manual_recvs: dict[int, int],
    span: int,
    placement: CommPlacement,
) -> list[list[Event]]:
    """Every rank's message events (its sends and its recvs), in the order it posts them.

    With `Grouping.BY_PAIR` (and no hand-placed comm op) the messages of one moment are
    ordered pair by pair, so that those of one pair are adjacent on both of its ranks: one
    key for every rank, so the order stays one global order."""
    posting = placement.recv_posting
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
    # BY_PAIR without hand-placed ops: within one moment, the messages go pair by pair
    pair_unit = unit if placement.grouping is Grouping.BY_PAIR and not manual else 0
    moment = unit + pair_unit * (num_ranks * num_ranks - 1)  # the orders of one time
    # REPLY_FIRST: every order times SLOTS, leaving room after each for the messages
    # `comm.refine` moves there
    slots = SLOTS if placement.order is MessageOrder.REPLY_FIRST and not manual else 1
    for src, ops in enumerate(ranks):
        own, ends, positions = events[src], ops.end, ops.positions
        first = src * span  # _message_order, inlined: this loop sees every message
        pairs = [
            (min(src, dst) * num_ranks + max(src, dst)) * pair_unit for dst in range(num_ranks)
        ]
        for k, outputs in enumerate(ops.outputs):
            if not outputs:
                continue
            made = int(ends[k])  # an integer time: see integer_times
            base = made * moment + first + 2 * positions[k]
            for sub, (key, dst, send, recv, _) in enumerate(outputs):
                if dst == src:
                    continue
                order = (base + sub + pairs[dst]) * slots
                if manual:
                    _manual_events(
                        events,
                        (k, src, dst, key, order, made, send, recv),
                        manual_sends,
                        manual_recvs,
                        (find, times[dst], unit),
                    )
                    continue
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
    manual_recvs: dict[int, int],
    locate: tuple[Callable[..., int], list[float], int],
) -> None:
    """`message_events` for one message of a program with hand-placed sends or recvs: a
    hand-sent message takes its order from its send; a hand-received one gets no Recv, and
    its order is recorded, for the emission to post the hand-placed receive in turn."""
    k, src, dst, key, order, made, send, recv = message
    find, times, unit = locate
    if key in manual_sends:
        order = manual_sends[key]
    else:
        events[src].append((k + 1, order, send, key, True, made))
    if key in manual_recvs:
        manual_recvs[key] = order
    else:
        gap = find(times, order // unit)
        events[dst].append((gap, order, recv, key, False, made))


def _first_gap(times: Sequence[float], time: float) -> int:
    """Where an AT_START receive goes: before compute op 0, whenever its message is made."""
    return 0


def _message_order(time: int, rank: int, position: int, sub: int, num_ranks: int, span: int) -> int:
    """Messages that come to exist at `time`, after input position `position` of `rank`
    (sub: which of the op's outputs): one integer, the same on every rank."""
    return ((2 * time * num_ranks + rank) * span + 2 * position) + sub
