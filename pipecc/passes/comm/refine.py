"""The default policy's refinements of a lowering's global order (`insert_comms`, step 2):
which of two close messages in opposite directions goes first on their pair, and how early
a receive is posted.

The order of `comm.order` sorts messages by the moment each comes to exist in a replay with
a nominal latency. Two refinements make it hold up when the real latency is longer (up to
a compute op or more), where every pair's stream carries one transfer after the other:

- **Reply first.** Rank a makes message m for rank b, and its compute op right after the
  one that makes m consumes a message m' from b that comes to exist later. Posted in the order they
  are made, m's transfer runs ahead of m' on the pair's stream, and rank a's next op waits
  for both. Unless rank b needs m as urgently (its op right after making m' consumes m: a
  cross exchange, kept in the order made), m goes right after m' in the global order.
- **Receives a little ahead.** A receive is posted at least `recv_lead` compute ops before
  the op that consumes it, so a sender that runs ahead of the nominal replay finds it
  posted; a receive that shares its moment and peer with another post of its rank stays in
  that group.

Both keep one global order that every rank posts in, with every send after the op that
makes its tensor and every receive before the op that consumes it, which is what makes the
lowering deadlock-free under every comm model (`insert_comms`): a message moved after m'
still comes before its consumer on b (at least two ops after m' is made), and each rank's
posts are kept in the global order by posting a post no earlier than the one before it.
"""

from __future__ import annotations

from operator import itemgetter
from typing import cast

from pipecc.passes.comm.order import (
    GAP,
    IS_SEND,
    KEY,
    MADE,
    ORDER,
    PAYLOAD,
    SLOTS,
    Event,
    RankOps,
)
from pipecc.passes.comm.placement import CommPlacement, MessageOrder


def refine(
    events: list[list[Event]], ranks: list[RankOps], size: int, placement: CommPlacement
) -> None:
    """Apply the placement's refinements to every rank's events (from `message_events`, of a
    program without hand-placed comm ops; keys below `size`), in place."""
    consumer = _consumers(ranks, size)
    if placement.order is MessageOrder.REPLY_FIRST:
        _reply_first(events, ranks, consumer)
    if placement.recv_lead:
        for rank_events in events:
            _lead_receives(rank_events, consumer, placement.recv_lead)
    for rank_events in events:
        _keep_order(rank_events, consumer)


def _consumers(ranks: list[RankOps], size: int) -> list[int]:
    """The index, among its rank's compute ops, of the op consuming each message (-1: none)."""
    consumer = [-1] * size
    for ops in ranks:
        for c, inputs in enumerate(ops.inputs):
            for key in inputs:
                consumer[key] = c
    return consumer


def _reply_first(events: list[list[Event]], ranks: list[RankOps], consumer: list[int]) -> None:
    """Move each message that its sender's next op's reply should precede (module
    docstring) right after that reply in the global order."""
    sends = _Sends(events, len(consumer))
    src_of, dst_of, made_by, orders = sends.src, sends.dst, sends.made_by, sends.order
    candidates = []  # (order, key, its replies), in one pass, before any sorting
    for key in sends.sent:
        order, src, dst, next_op = orders[key], src_of[key], dst_of[key], made_by[key] + 1
        inputs = ranks[src].inputs
        if next_op < len(inputs):
            replies = [
                reply
                for reply in inputs[next_op]
                if src_of[reply] == dst
                and orders[reply] > order
                and consumer[key] > made_by[reply] + 1  # else a cross exchange: kept
            ]
            if replies:
                candidates.append((order, key, replies))
    after: dict[int, tuple[int, int]] = {}  # moved message -> (anchor's order, depth)
    for _, key, replies in sorted(candidates, reverse=True):  # a reply before what it passes
        best = max(after.get(reply, (orders[reply], 0)) for reply in replies)
        after[key] = (best[0], best[1] + 1)
    if after:
        _move(events, sends, _new_orders(after, orders))


class _Sends:
    """Per message key: its sender and receiver, the index of the compute op that makes it
    and its order; and every message's key."""

    def __init__(self, events: list[list[Event]], size: int) -> None:
        self.src, self.dst, self.made_by = [-1] * size, [-1] * size, [-1] * size
        self.order = [0] * size
        self.sent: list[int] = []
        src, dst, made_by, orders, sent = self.src, self.dst, self.made_by, self.order, self.sent
        for rank, rank_events in enumerate(events):
            for gap, order, payload, key, is_send, _ in rank_events:
                if is_send:
                    src[key], dst[key] = rank, cast("int", payload[1])
                    made_by[key], orders[key] = gap - 1, order
                    sent.append(key)


def _new_orders(after: dict[int, tuple[int, int]], orders: list[int]) -> dict[int, int]:
    """The order of each moved message: right after its anchor's, in the room `SLOTS` left
    there (deeper moves after shallower ones, then in their own order). Where more moved
    messages share an anchor than there is room, every order is renumbered instead."""
    moved = sorted((anchor, depth, orders[key], key) for key, (anchor, depth) in after.items())
    new: dict[int, int] = {}
    previous, slot = -1, 0
    for anchor, _, _, key in moved:
        slot = slot + 1 if anchor == previous else 1
        if slot >= SLOTS:
            return _renumbered(moved, orders)
        new[key], previous = anchor + slot, anchor
    return new


def _renumbered(moved: list[tuple[int, int, int, int]], orders: list[int]) -> dict[int, int]:
    """`_new_orders` without the room limit: every message a new order (rare: a program
    where one message is the reply for more than SLOTS - 1 others)."""
    keys = {key for *_, key in moved}
    ranked = sorted(
        [(orders[key], 0, 0, key) for key in range(len(orders)) if orders[key] and key not in keys]
        + moved
    )
    return {key: index * SLOTS for index, (*_, key) in enumerate(ranked)}


def _move(events: list[list[Event]], sends: _Sends, new: dict[int, int]) -> None:
    """Give the sends and receives of the messages in `new` their new orders."""
    ranks = {sends.src[key] for key in new} | {sends.dst[key] for key in new}
    for rank in sorted(ranks):
        rank_events = events[rank]
        for i, event in enumerate(rank_events):
            order = new.get(event[KEY])
            if order is not None:
                rank_events[i] = (event[GAP], order, *event[PAYLOAD:])


def _lead_receives(rank_events: list[Event], consumer: list[int], lead: int) -> None:
    """Post each receive at least `lead` compute ops before its consumer, unless it shares
    its moment and peer with another post of the rank (their group is kept: such posts are
    neighbours in the rank's events, in one gap, adjacent in the order)."""
    last = len(rank_events) - 1
    for i, event in enumerate(rank_events):
        if event[IS_SEND]:
            continue
        gap = consumer[event[KEY]] - lead
        if gap >= event[GAP]:
            continue
        if (i > 0 and _one_moment(rank_events[i - 1], event)) or (
            i < last and _one_moment(rank_events[i + 1], event)
        ):
            continue
        rank_events[i] = (max(gap, 0), *event[ORDER:])


def _one_moment(a: Event, b: Event) -> bool:
    return a[MADE] == b[MADE] and a[PAYLOAD][1] == b[PAYLOAD][1]


def _keep_order(rank_events: list[Event], consumer: list[int]) -> None:
    """Sort the rank's posts by the global order, each posted no earlier than the one before
    it (a send may move later, never earlier than its op; a receive stays before its
    consumer: see the module docstring)."""
    rank_events.sort(key=itemgetter(ORDER))
    gap = 0
    for i, event in enumerate(rank_events):
        if event[GAP] < gap:
            rank_events[i] = (gap, *event[ORDER:])
            assert event[IS_SEND] or gap <= consumer[event[KEY]], "a receive after its consumer"
        else:
            gap = event[GAP]
