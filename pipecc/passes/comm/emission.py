"""Emission of a lowering (`insert_comms`, step 3): each rank's posts, groups and waits
around its compute ops, in the order `comm.order` gave its message events."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipecc.ir.keys import StageMajorKeys
from pipecc.ir.ops import Instr, Recv, Send, StageOp, Wait
from pipecc.passes.comm.order import GAP, MADE, PAYLOAD, Event, RankOps
from pipecc.passes.comm.placement import Grouping, SendWait

_new = tuple.__new__


@dataclass
class Emitter:
    """Builds one rank's lowered list: posts, waits and computes in order."""

    keys: StageMajorKeys
    starts: list[float]  # start of each compute op of the rank in the ordering replay
    consumed: list[float]  # message key -> start of the op consuming it, likewise
    grouping: Grouping = Grouping.PER_GAP
    send_wait: SendWait = SendWait.WHEN_CONSUMED
    out: list[Instr] = field(default_factory=list)
    due: dict[int, list[int]] = field(default_factory=dict)  # compute k -> sends to wait
    recv_at: dict[int, int] = field(default_factory=dict)  # message key -> index of its Recv
    hand_waited: set[int] = field(default_factory=set)  # input positions a hand wait lists
    hand_order: dict[int, int] = field(default_factory=dict)  # hand-placed message -> order
    groups: dict[int, int] = field(default_factory=dict)
    next_group: int = 0
    moved: dict[int, int] = field(default_factory=dict)  # input index -> output index
    # SendWait.WITH_REPLY: the sends to each peer not yet given to a receive, and the sends
    # each receive (by index) completes with it
    open_sends: dict[object, list[int]] = field(default_factory=dict)
    replies: dict[int, list[int]] = field(default_factory=dict)

    def post(self, batch: list[Event]) -> None:
        """Post the events of one gap between two compute ops, grouped as the placement says."""
        if self.grouping is Grouping.PER_GAP:
            self._post_group(batch)
        elif self.grouping is Grouping.NONE:
            for event in batch:
                self._post_group([event])
        else:
            by_pair = self.grouping is Grouping.BY_PAIR
            start = 0
            for i in range(1, len(batch) + 1):
                if (
                    i == len(batch)
                    or batch[i][MADE] != batch[start][MADE]
                    or (by_pair and batch[i][PAYLOAD][1] != batch[start][PAYLOAD][1])
                ):
                    self._post_group(batch[start:i])
                    start = i

    def _post_group(self, batch: list[Event]) -> None:
        group = None
        if len(batch) > 1:
            group = self.next_group
            self.next_group += 1
        tail = (group, None)
        out = self.out
        for _, _, payload, key, send, _ in batch:
            if send:
                self._due(key, len(out), payload[1])
                out.append(_new(Send, payload + tail))
            else:
                self._received(key, len(out), payload[1])
                out.append(_new(Recv, payload + tail))

    def manual(self, position: int, instr: Instr) -> None:
        """Copy a hand-placed Send/Recv/Wait, renumbering its group and wait indices."""
        index = len(self.out)
        self.moved[position] = index
        if type(instr) is StageOp:  # torch's UNSHARD & co. stay where they were written
            self.out.append(instr)
            return
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
            self._due(key, index, instr.peer)
        else:
            self._received(key, index, instr.peer)

    def _due(self, key: int, index: int, peer: object) -> None:
        """Where the send at `index` is completed (`SendWait`). WHEN_CONSUMED: before the
        first compute op of its rank that starts, in the ordering replay, once its receiver
        has consumed it (the receiver has posted its recv by then)."""
        if self.send_wait is SendWait.WITH_REPLY:
            self.open_sends.setdefault(peer, []).append(index)
            return
        k = bisect_left(self.starts, self.consumed[key])
        self.due.setdefault(k, []).append(index)

    def _received(self, key: int, index: int, peer: object) -> None:
        """A receive posted at `index`: completed before its consumer, with the open sends to
        the same peer (SendWait.WITH_REPLY)."""
        self.recv_at[key] = index
        sends = self.open_sends.pop(peer, None)
        if sends is not None:
            self.replies[index] = sends

    def wait_before(self, k: int, inputs: tuple[int, ...]) -> None:
        """The Wait before compute op k: the recvs it consumes and the sends due there."""
        targets = self.due.pop(k, [])
        for key in inputs:
            index = self.recv_at.pop(key, None)
            if index is not None:
                targets.append(index)
                targets.extend(self.replies.pop(index, ()))
        if targets:
            targets.sort()
            self.out.append(_new(Wait, (tuple(targets), None)))

    def wait_all(self) -> None:
        """One final Wait for what is still open: the sends due after the last compute op,
        and any recv no compute op consumed (hand-waited ops were never registered)."""
        posted = [i for waits in self.due.values() for i in waits]
        posted.extend(self.recv_at.values())
        posted.extend(i for sends in self.replies.values() for i in sends)
        posted.extend(i for sends in self.open_sends.values() for i in sends)
        if posted:
            posted.sort()
            self.out.append(_new(Wait, (tuple(posted), None)))


def emit_rank(  # noqa: C901
    instrs: Sequence[Instr], ops: RankOps, events: list[Event], emitter: Emitter
) -> tuple[Instr, ...]:
    """Interleave one rank's computes with its posts and waits. The groupings of a gap's
    posts (`Emitter.post`), where sends are completed (`Emitter._due`, `_received`) and the
    Wait before each op (`Emitter.wait_before`) are inlined here, because this loop places
    every instruction of a program; `_emit_rank_general` does the same through the methods
    (every post alone, and hand-placed comm ops)."""
    if emitter.grouping is Grouping.NONE or len(ops.computes) != len(instrs):  # hand-placed
        return _emit_rank_general(instrs, ops, events, emitter)
    by_time = emitter.grouping is Grouping.BY_TIME or emitter.grouping is Grouping.BY_PAIR
    by_pair = emitter.grouping is Grouping.BY_PAIR
    with_reply = emitter.send_wait is SendWait.WITH_REPLY
    out, recv_at, due = emitter.out, emitter.recv_at, emitter.due
    open_sends, replies = emitter.open_sends, emitter.replies
    starts, consumed = emitter.starts, emitter.consumed
    append, pop_due, pop_recv, pop_reply = out.append, due.pop, recv_at.pop, replies.pop
    group = emitter.next_group
    inputs = ops.inputs
    cursor, count = 0, len(events)
    next_gap = events[0][GAP] if events else len(ops.computes)
    for k, instr in enumerate(ops.computes):
        if next_gap <= k:
            stop = cursor + 1
            while stop < count and events[stop][GAP] <= k:
                stop += 1
            while cursor < stop:  # the gap's posts, one group at a time
                last = stop
                if by_time:  # those whose messages come to exist at one moment
                    made = events[cursor][MADE]
                    peer = events[cursor][PAYLOAD][1] if by_pair else None  # (and one peer)
                    last = cursor + 1
                    while last < stop and events[last][MADE] == made:
                        if by_pair and events[last][PAYLOAD][1] != peer:
                            break
                        last += 1
                if last - cursor > 1:
                    tail: tuple[int | None, None] = (group, None)
                    group += 1
                else:
                    tail = (None, None)
                for _, _, payload, key, send, _ in events[cursor:last]:
                    position = len(out)
                    if send:
                        if with_reply:  # completed with the next receive from its peer
                            waiting = open_sends.get(payload[1])
                            if waiting is None:
                                open_sends[payload[1]] = [position]
                            else:
                                waiting.append(position)
                        else:  # completed when its receiver has consumed it
                            at = bisect_left(starts, consumed[key])
                            waits = due.get(at)
                            if waits is None:
                                due[at] = [position]
                            else:
                                waits.append(position)
                        append(_new(Send, payload + tail))
                    else:
                        recv_at[key] = position
                        if with_reply:
                            waiting = open_sends.pop(payload[1], None)
                            if waiting is not None:
                                replies[position] = waiting
                        append(_new(Recv, payload + tail))
                cursor = last
            next_gap = events[stop][GAP] if stop < count else len(ops.computes)
        targets = pop_due(k, None)  # the Wait before op k (`Emitter.wait_before`)
        for key in inputs[k]:
            index = pop_recv(key, None)
            if index is not None:
                if targets is None:
                    targets = [index]
                else:
                    targets.append(index)
                sends = pop_reply(index, None)
                if sends is not None:
                    targets.extend(sends)
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
    instrs: Sequence[Instr], ops: RankOps, events: list[Event], emitter: Emitter
) -> tuple[Instr, ...]:
    """`emit_rank` for any grouping and for hand-placed comm ops, one method per step."""
    cursor = 0
    position = 0  # next input instruction to copy (hand-placed comm ops)
    count = len(events)
    for k, instr in enumerate(ops.computes):
        stop = cursor
        while stop < count and events[stop][GAP] <= k:
            stop += 1
        position = _post_gap(emitter, instrs, (position, ops.positions[k]), events[cursor:stop])
        cursor = stop
        emitter.wait_before(k, ops.inputs[k])
        emitter.out.append(instr)
        position += 1
    _post_gap(emitter, instrs, (position, len(instrs)), events[cursor:])
    emitter.wait_all()
    return tuple(emitter.out)


def _post_gap(
    emitter: Emitter, instrs: Sequence[Instr], hand: tuple[int, int], batch: list[Event]
) -> int:
    """Post one gap: its events and the hand-placed ops at input positions `hand` (start,
    stop), merged by the global order, so that each pair of ranks still posts its messages
    in one order on both sides (a hand-placed Wait stays after the ops written before it).
    Returns the next input position."""
    start, stop = hand
    done = 0
    for position in range(start, stop):
        hand_op = instrs[position]
        if type(hand_op) is Send or type(hand_op) is Recv:
            key = emitter.keys.key(hand_op.what, hand_op.pipe, hand_op.stage, hand_op.mb)
            order = emitter.hand_order.get(key, -1)
            first = done
            while done < len(batch) and batch[done][1] < order:
                done += 1
            if done > first:
                emitter.post(batch[first:done])
        emitter.manual(position, hand_op)
    if done < len(batch):
        emitter.post(batch[done:])
    return stop


def hand_waited(instrs: Sequence[Instr]) -> set[int]:
    """The input positions of the ops a hand-placed `wait` completes."""
    return {i for instr in instrs if type(instr) is Wait for i in instr.ops}
