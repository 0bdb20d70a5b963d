"""Resolve `fill` blocks: place the ops a rank runs where it would otherwise idle.

Requires: `Streams` from the front end, possibly with `FillSpec`/`FillEndSpec` bounds (no
hand-placed comm op inside them: the front end refuses that).
Ensures: streams without fill bounds, for `assign_microbatches`. A stream with no fill block
is returned as it is. Otherwise every rank's ops are written with their chunk and microbatch
(the numbering `assign_microbatches` would give them: the same counters), in the order the
fill decides, and every W a fill adds is a plain `W` (the rank's oldest pending I), so that
`assign_microbatches` checks the result like any written order.

The rule (docs/dsl.md 4.7), decided once, deterministically, in the unit-cost timing: F, I
and W take 1, B takes 2, a fused op the sum of its parts, messages take no time, and every
op starts as soon as its rank is free and its inputs exist. Inside `fill KINDS [cap N]`,
where the rank's next written op cannot start yet (its input does not exist), the rank runs,
in this order of preference:
1. the first later op of the block of a kind in KINDS (F, B or I) whose inputs exist (a
   forward only if the rank's activations after it, counting the written forwards it
   overtakes, stay within N);
2. with W in KINDS, the W of its oldest pending I.
With W in KINDS and a cap N, a written forward that would take the rank's activations (stage
units: F +1, B and W −1, I 0) above N first runs the oldest pending Ws. With W in KINDS, the
end of the block runs every W still pending. When the order cannot be numbered, or cannot
run, nothing is moved and each block's pending Ws run at its end: `assign_microbatches` and
the lowering then report the fault as they do for any order.

The timing is its own dataflow list schedule, not the replay engine's: it decides the order
that the replay then runs (tests/passes/test_fill_idle.py checks with `pipecc simulate` at
F=I=W=1 that a filled W delays no written op, and that V-Half and V-Min reach the spans of
the reference generators). A rank decides what fills a slot only once every other rank has
caught up with its clock, so that no input that could exist by then is still to be made.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace

from pipecc.diagnostics import Span
from pipecc.ir.keys import MessageKeys
from pipecc.ir.ops import Kind
from pipecc.ir.streams import (
    CommSpec,
    FillEndSpec,
    FillSpec,
    FusedSpec,
    OpSpec,
    StreamItem,
    Streams,
    WaitSpec,
)

UNIT = {Kind.F: 1, Kind.B: 2, Kind.I: 1, Kind.W: 1}
_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W


class _Unresolvable(Exception):
    """The order cannot be numbered or run: leave it to the passes that report faults."""


@dataclass(slots=True)
class _Op:
    """One written computation (or fused pair), numbered."""

    item: StreamItem  # what is emitted: the op with its chunk and microbatch
    parts: tuple[tuple[Kind, int, int], ...]  # (kind, chunk, mb) of each half
    inputs: tuple[int, ...]  # message keys it consumes (from any rank, its own included)
    outputs: tuple[int, ...]
    duration: int
    grows: bool  # it allocates activations (an F, alone or fused)
    delta: int  # its net change of the rank's activations
    dropped: bool  # on a padded microbatch: emitted, but it does not run


Entry = _Op | OpSpec | FillSpec | FillEndSpec | CommSpec | WaitSpec  # OpSpec: a written W


def fill_idle(streams: Streams) -> Streams:
    """`streams` with every fill block resolved (module docstring)."""
    if not any(type(item) is FillSpec for rank in streams.ranks for item in rank):
        return streams
    try:
        entries = [_number(streams, rank) for rank in range(streams.num_ranks)]
        ranks = _Sim(streams, entries).run()
    except _Unresolvable:
        ranks = [_unmoved(stream) for stream in streams.ranks]
    return replace(streams, ranks=tuple(tuple(rank) for rank in ranks))


# ---- numbering ---------------------------------------------------------------------------


def _number(streams: Streams, rank: int) -> list[Entry]:
    """The rank's stream with every F, B and I given its chunk and microbatch by the counters
    of `assign_microbatches` (DESIGN §2); raises `_Unresolvable` where that pass would fail."""
    numbering = _Numbering(streams, rank)
    entries: list[Entry] = []
    for item in streams.ranks[rank]:
        if isinstance(item, FusedSpec):  # the backward first, as assign_microbatches numbers it
            entries.append(numbering.op((item.backward, item.forward), item.span))
        elif isinstance(item, OpSpec) and item.kind is not _W:
            entries.append(numbering.op((item,), item.span))
        else:
            entries.append(item)
    return entries


class _Numbering:
    """The forward and backward counters of one rank's chunks (DESIGN §2)."""

    def __init__(self, streams: Streams, rank: int) -> None:
        placement = streams.placement
        self.count = streams.num_microbatches
        self.keys = MessageKeys(placement)
        self.slots = [(slot.pipe, slot.stage) for slot in placement.chunks(rank)]
        generated = streams.generated_microbatches
        self.limits = [placement.microbatches(pipe, generated) for pipe, _ in self.slots]
        self.fwd = [mbs.start for mbs in self.limits]
        self.bwd = list(self.fwd)

    def place(self, spec: OpSpec) -> tuple[int, int]:
        chunk = spec.chunk
        if chunk is None and len(self.slots) == 1:
            chunk = 0
        if chunk is None or not 0 <= chunk < len(self.slots):
            raise _Unresolvable
        mb = spec.mb
        if mb is None:
            counters = self.fwd if spec.kind is _F else self.bwd
            mb = counters[chunk]
            counters[chunk] = mb + 1
        if mb not in self.limits[chunk]:
            raise _Unresolvable
        return chunk, mb

    def op(self, specs: tuple[OpSpec, ...], span: Span | None) -> _Op:
        parts = tuple((spec.kind, *self.place(spec)) for spec in specs)
        inputs, outputs = [], []
        for kind, chunk, mb in parts:
            pipe, stage = self.slots[chunk]
            if (flow := self.keys.input_flow(kind, pipe, stage, mb)) is not None:
                inputs.append(flow.key)
            if (flow := self.keys.output_flow(kind, pipe, stage, mb)) is not None:
                outputs.append(flow.key)
        items = [
            OpSpec(kind, chunk, mb, spec.span)
            for (kind, chunk, mb), spec in zip(parts, specs, strict=True)
        ]
        item: StreamItem = items[0] if len(items) == 1 else FusedSpec(items[1], items[0], span)
        return _Op(
            item,
            parts,
            tuple(inputs),
            tuple(outputs),
            sum(UNIT[kind] for kind, _, _ in parts),
            any(kind is _F for kind, _, _ in parts),
            sum(_delta(kind) for kind, _, _ in parts),
            any(mb >= self.count for _, _, mb in parts),
        )


def _delta(kind: Kind) -> int:
    return {_F: 1, _B: -1, _I: 0, _W: -1}[kind]


def _unmoved(stream: tuple[StreamItem, ...]) -> list[StreamItem]:
    """The stream as written, each fill block's pending Ws run at its end (no timing)."""
    out: list[StreamItem] = []
    pending = _Pending()
    fill: FillSpec | None = None
    for item in stream:
        if isinstance(item, FillSpec):
            fill = item
        elif isinstance(item, FillEndSpec):
            if fill is not None and _W in fill.kinds:
                out.extend(OpSpec(_W, None, None, fill.span) for _ in range(len(pending)))
                pending.clear()
            fill = None
        else:
            out.append(item)
            pending.note(item)
    return out


@dataclass(slots=True)
class _Pending:
    """A rank's pending Is, as `assign_microbatches` resolves Ws against them: a plain `W`
    takes the oldest, `W1` the oldest of chunk 1, `W1[mb]` that one."""

    queue: list[tuple[int, int]] = field(default_factory=list)  # (chunk, mb), oldest first

    def __len__(self) -> int:
        return len(self.queue)

    def clear(self) -> None:
        self.queue.clear()

    def note(self, item: StreamItem) -> None:
        """Track a written item without numbering (`_unmoved`): only the counts matter."""
        if isinstance(item, FusedSpec):
            item = item.backward
        if isinstance(item, OpSpec) and item.kind is _I:
            self.queue.append((-1, -1))
        elif isinstance(item, OpSpec) and item.kind is _W and self.queue:
            self.queue.pop(0)

    def add(self, chunk: int, mb: int) -> None:
        self.queue.append((chunk, mb))

    def take(self, spec: OpSpec | None) -> tuple[int, int]:
        """The I the W `spec` completes (None: a fill's plain W)."""
        queue = self.queue
        for n, (chunk, mb) in enumerate(queue):
            if (
                spec is None
                or spec.chunk is None
                or (chunk == spec.chunk and spec.mb in (None, mb))
            ):
                return queue.pop(n)
        raise _Unresolvable


@dataclass(slots=True)
class _Rank:
    """One rank's state in the list schedule."""

    entries: list[Entry]
    ends: dict[int, int]  # index of a FillSpec -> index of its FillEndSpec
    out: list[StreamItem] = field(default_factory=list)
    cursor: int = 0
    clock: int = 0
    mem: int = 0
    pending: _Pending = field(default_factory=_Pending)
    fill: FillSpec | None = None
    end: int = 0  # index of the open block's FillEndSpec
    pulled: set[int] = field(default_factory=set)
    forwards: set[tuple[int, int]] = field(default_factory=set)  # (chunk, mb) run here
    wake: int | None = None  # the time it is scheduled at, None when it waits


class _Sim:
    """The unit-cost list schedule of every rank (module docstring)."""

    def __init__(self, streams: Streams, entries: list[list[Entry]]) -> None:
        self.streams = streams
        self.ranks = [_Rank(list(e), _block_ends(e)) for e in entries]
        self.done: dict[int, int] = {}  # message key -> when it exists
        self.heap: list[tuple[int, int]] = []
        self.watchers: dict[int, list[int]] = {}  # key -> ranks waiting for it
        self.idle: set[int] = set()  # ranks in a fill block waiting for any change

    def run(self) -> list[list[StreamItem]]:
        for rank in range(len(self.ranks)):
            self._schedule(rank, 0)
        while self.heap:
            time, rank = heapq.heappop(self.heap)
            state = self.ranks[rank]
            if state.wake != time:
                continue  # a stale entry
            state.wake, state.clock = None, max(state.clock, time)
            self._advance(rank)
        if any(state.cursor < len(state.entries) for state in self.ranks):
            raise _Unresolvable  # a rank waits forever: the order cannot run
        return [state.out for state in self.ranks]

    def _schedule(self, rank: int, time: int) -> None:
        state = self.ranks[rank]
        if state.wake is None or time < state.wake:
            state.wake = time
            heapq.heappush(self.heap, (time, rank))

    def _advance(self, rank: int) -> None:
        """Run `rank` until it has to wait."""
        state = self.ranks[rank]
        while state.cursor < len(state.entries):
            entry = state.entries[state.cursor]
            if state.cursor in state.pulled:
                state.cursor += 1
            elif isinstance(entry, _Op):
                if not self._written(rank, entry):
                    return
            else:
                self._marker(state, entry)

    def _marker(
        self, state: _Rank, entry: FillSpec | FillEndSpec | OpSpec | CommSpec | WaitSpec
    ) -> None:
        """A fill bound, a written W or a hand-placed comm op (outside fill blocks)."""
        if isinstance(entry, FillSpec):
            state.fill, state.end = entry, state.ends[state.cursor]
        elif isinstance(entry, FillEndSpec):
            if state.fill is not None and _W in state.fill.kinds:
                while len(state.pending):
                    self._weight(state, None, state.fill.span)
            state.fill = None
        elif isinstance(entry, OpSpec):
            self._weight(state, entry, entry.span)
        elif isinstance(entry, CommSpec | WaitSpec):
            state.out.append(entry)
        state.cursor += 1

    def _written(self, rank: int, op: _Op) -> bool:
        """Run the rank's next written op, or what the fill puts before it; False when the
        rank has to wait."""
        state = self.ranks[rank]
        fill = state.fill
        if op.dropped:
            self._run(rank, op)
            state.cursor += 1
            return True
        if fill is not None and self._over_cap(state, op):
            self._weight(state, None, fill.span)
            return True
        if self._ready(op, state.clock):
            self._run(rank, op)
            state.cursor += 1
            return True
        if fill is not None:
            return self._idle(rank, op, fill)
        return self._wait(rank, op)

    def _over_cap(self, state: _Rank, op: _Op) -> bool:
        fill = state.fill
        assert fill is not None
        return (
            fill.cap is not None
            and _W in fill.kinds
            and op.grows
            and state.mem + 1 > fill.cap
            and len(state.pending) > 0
        )

    def _idle(self, rank: int, op: _Op, fill: FillSpec) -> bool:
        """The rank would idle before `op` inside a fill block."""
        state = self.ranks[rank]
        if self.heap and self.heap[0][0] < state.clock:
            self._schedule(rank, state.clock)  # another rank may still make `op` ready
            return False
        if self._pull(rank, fill):
            return True
        if _W in fill.kinds and len(state.pending):
            self._weight(state, None, fill.span)
            return True
        wake = self._arrival(op)
        if wake is None:  # nothing on the way to `op` yet: wake for a later op of the block
            wake = self._next_arrival(state, fill)
        if wake is not None:
            self._schedule(rank, max(wake, state.clock))
        self.idle.add(rank)
        return False

    def _pull(self, rank: int, fill: FillSpec) -> bool:
        """Run the first later op of the block of a kind the fill names that can start."""
        state = self.ranks[rank]
        forwards = 0
        for index in range(state.cursor, state.end):
            entry = state.entries[index]
            if not isinstance(entry, _Op) or index in state.pulled:
                continue
            if index > state.cursor and self._pullable(state, entry, fill, forwards):
                self._run(rank, entry)
                state.pulled.add(index)
                return True
            forwards += entry.grows
        return False

    def _next_arrival(self, state: _Rank, fill: FillSpec) -> int | None:
        """The earliest time a later op of the block that the fill may pull has its inputs
        (None: none has them on the way)."""
        found: int | None = None
        for index in range(state.cursor + 1, state.end):
            entry = state.entries[index]
            if not isinstance(entry, _Op) or index in state.pulled or entry.dropped:
                continue
            if len(entry.parts) == 1 and entry.parts[0][0] in fill.kinds:
                arrival = self._arrival(entry)
                if arrival is not None and arrival > state.clock:
                    found = arrival if found is None else min(found, arrival)
        return found

    def _pullable(self, state: _Rank, op: _Op, fill: FillSpec, forwards: int) -> bool:
        if len(op.parts) != 1 or op.dropped:
            return False
        kind, chunk, mb = op.parts[0]
        if kind not in fill.kinds or not self._ready(op, state.clock):
            return False
        if kind is not _F:
            return (chunk, mb) in state.forwards
        return fill.cap is None or state.mem + 1 + forwards <= fill.cap

    def _wait(self, rank: int, op: _Op) -> bool:
        """Outside a fill block: wait until the op's inputs exist."""
        state = self.ranks[rank]
        times = [self.done.get(key) for key in op.inputs]
        missing = [key for key, time in zip(op.inputs, times, strict=True) if time is None]
        if missing:
            self.watchers.setdefault(missing[0], []).append(rank)
        else:
            state.clock = max(time for time in times if time is not None)
        return not missing

    def _arrival(self, op: _Op) -> int | None:
        """When the last input of `op` exists, None while one is still to be made."""
        times = [self.done.get(key) for key in op.inputs]
        known = [time for time in times if time is not None]
        return max(known, default=0) if len(known) == len(times) else None

    def _ready(self, op: _Op, time: int) -> bool:
        done = self.done
        return all((at := done.get(key)) is not None and at <= time for key in op.inputs)

    def _run(self, rank: int, op: _Op) -> None:
        state = self.ranks[rank]
        state.out.append(op.item)
        for kind, chunk, mb in op.parts:
            if kind is _I:
                state.pending.add(chunk, mb)
            elif kind is _F:
                state.forwards.add((chunk, mb))
        if op.dropped:
            return
        end = state.clock = state.clock + op.duration
        state.mem += op.delta
        for key in op.outputs:
            self.done[key] = end
            for waiter in self.watchers.pop(key, ()):
                self._schedule(waiter, max(end, self.ranks[waiter].clock))
        for waiter in self.idle:
            self._schedule(waiter, max(end, self.ranks[waiter].clock))
        self.idle.clear()

    def _weight(self, state: _Rank, spec: OpSpec | None, span: Span | None) -> None:
        """A W: written (`spec`) or placed by the fill (None, a plain W)."""
        _, mb = state.pending.take(spec)
        state.out.append(spec if spec is not None else OpSpec(_W, None, None, span))
        if mb < self.streams.num_microbatches:
            state.clock += UNIT[_W]
            state.mem -= 1


def _block_ends(entries: list[Entry]) -> dict[int, int]:
    """The index of each fill block's end, by the index of its start."""
    ends, start = {}, -1
    for index, entry in enumerate(entries):
        if isinstance(entry, FillSpec):
            start = index
        elif isinstance(entry, FillEndSpec):
            ends[start] = index
    return ends
