"""The default policy's refinements of a lowering's global order (`insert_comms`, step 2):
which of two close messages in opposite directions goes first on their pair, and how early
a receive is posted.

The order of `comm.order` sorts messages by the moment each comes to exist in a replay with
a nominal latency. Two refinements make it hold up when the real latency is longer (up to
a compute op or more), where every pair's stream carries one transfer after the other:

- **Reply first.** Rank a makes message m for rank b, and the compute op right after it on
  rank a consumes a message m' from b that comes to exist later. Posted in the order they
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

from typing import cast

from pipecc.passes.comm.order import GAP, IS_SEND, KEY, MADE, ORDER, PAYLOAD, Event, RankOps
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
    docstring) right after that reply in the global order, and renumber the orders."""
    sends = _Sends(events, len(consumer))
    after: dict[int, tuple[int, int]] = {}  # moved message -> (anchor order, depth)
    for order, key, dst in sorted(sends.sent, reverse=True):  # a reply before what it passes
        src, next_op = sends.src[key], sends.made_by[key] + 1
        inputs = ranks[src].inputs
        best: tuple[int, int] | None = None
        for reply in inputs[next_op] if next_op < len(inputs) else ():
            if sends.src[reply] != dst or sends.order[reply] < order:
                continue
            if consumer[key] <= sends.made_by[reply] + 1:
                continue  # rank b needs m right after making the reply: a cross exchange
            anchor = after.get(reply, (sends.order[reply], 0))
            if best is None or anchor > best:
                best = anchor
        if best is not None:
            after[key] = (best[0], best[1] + 1)
    if after:
        _renumber(events, after, max(sends.order) + 1)


class _Sends:
    """Per message key: its sender, the index of the compute op that makes it, its order;
    and every message as (order, key, receiver)."""

    def __init__(self, events: list[list[Event]], size: int) -> None:
        self.src, self.made_by, self.order = [-1] * size, [-1] * size, [0] * size
        self.sent: list[tuple[int, int, int]] = []
        for src, rank_events in enumerate(events):
            for event in rank_events:
                if event[IS_SEND]:
                    key = event[KEY]
                    self.src[key], self.made_by[key] = src, event[GAP] - 1
                    self.order[key] = event[ORDER]
                    self.sent.append((event[ORDER], key, cast("int", event[PAYLOAD][1])))


def _renumber(events: list[list[Event]], after: dict[int, tuple[int, int]], bound: int) -> None:
    """New orders: an unmoved message keeps its place, a moved one goes right after its
    anchor (deeper moves after shallower ones, then by its own order, below `bound`)."""
    stride = (max(depth for _, depth in after.values()) + 1) * bound
    for rank, rank_events in enumerate(events):
        renumbered = []
        for event in rank_events:
            moved = after.get(event[KEY])
            if moved is None:
                order = event[ORDER] * stride
            else:
                order = moved[0] * stride + moved[1] * bound + event[ORDER]
            renumbered.append((event[GAP], order, *event[PAYLOAD:]))
        events[rank] = renumbered


def _lead_receives(rank_events: list[Event], consumer: list[int], lead: int) -> None:
    """Post each receive at least `lead` compute ops before its consumer, unless it shares
    its moment and peer with another post of the rank (their group is kept)."""
    moments: dict[tuple[int, object], int] = {}
    for event in rank_events:
        moment = (event[MADE], event[PAYLOAD][1])
        moments[moment] = moments.get(moment, 0) + 1
    for i, event in enumerate(rank_events):
        if event[IS_SEND] or moments[(event[MADE], event[PAYLOAD][1])] > 1:
            continue
        gap = max(0, consumer[event[KEY]] - lead)
        if gap < event[GAP]:
            rank_events[i] = (gap, *event[ORDER:])


def _keep_order(rank_events: list[Event], consumer: list[int]) -> None:
    """Sort the rank's posts by the global order, each posted no earlier than the one before
    it (a send may move later, never earlier than its op; a receive stays before its
    consumer: see the module docstring)."""
    rank_events.sort(key=_order)
    gap = 0
    for i, event in enumerate(rank_events):
        if event[GAP] < gap:
            rank_events[i] = (gap, *event[ORDER:])
            assert event[IS_SEND] or gap <= consumer[event[KEY]], "a receive after its consumer"
        else:
            gap = event[GAP]


def _order(event: Event) -> int:
    return event[ORDER]
