"""Give every op its microbatch and every W its I: per-rank streams → compute-only Program.

Requires: `Streams` from the front end (chunks may be open for a plain `W`, microbatches
open where the schedule left them to the compiler).
Ensures: every Compute names (chunk, pipe, stage, mb); each (pipe, stage, mb) with mb < M has
exactly one F and either one B or one I and one W, on the rank that holds the stage; every
backward comes after its own F on its rank and every W after its I; ops generated for padded
microbatches (mb ≥ M) are dropped; hand-placed sends, recvs and waits name concrete messages.

Numbering (DESIGN §2): each chunk has a forward counter and a backward counter (shared by B,
I and the backward half of a fused op) that start at the first microbatch of the chunk's pipe;
an op takes the next value of its counter unless it names its microbatch. A plain `W` takes
the rank's oldest pending I, `W1` the oldest pending I of chunk 1 (FIFO). `fill` blocks are
resolved first (`passes.fill_idle`: the order they decide is then checked like a written one).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pipecc.diagnostics import ScheduleError, Span
from pipecc.ir.keys import Message, MessageKeys
from pipecc.ir.ops import Compute, Fused, Instr, Kind, Msg, Recv, Send, Wait, computations
from pipecc.ir.program import Program
from pipecc.ir.streams import CommSpec, FusedSpec, OpSpec, StreamItem, Streams, WaitSpec
from pipecc.passes.fill_idle import fill_idle

_new = tuple.__new__
_F, _I, _W = Kind.F, Kind.I, Kind.W


def assign_microbatches(streams: Streams) -> Program:
    """Resolve fill blocks, microbatches and W targets; check that the program is complete."""
    streams = fill_idle(streams)
    placement = streams.placement
    ranks = tuple(
        _RankAssigner(streams, rank).run(stream) for rank, stream in enumerate(streams.ranks)
    )
    return Program(
        schedule=streams.schedule,
        source=streams.source,
        num_ranks=streams.num_ranks,
        num_microbatches=streams.num_microbatches,
        params=streams.params,
        comm="none",
        placement=placement,
        ranks=ranks,
        recompute=streams.recompute,
    )


@dataclass
class _RankAssigner:
    """Walks one rank's stream once, keeping its counters and queues."""

    streams: Streams
    rank: int
    out: list[Instr] = field(default_factory=list)
    fwd: list[int] = field(default_factory=list)
    bwd: list[int] = field(default_factory=list)
    limits: list[range] = field(default_factory=list)
    pending_all: deque[tuple[int, int, Span | None]] = field(default_factory=deque)
    pending_chunk: list[deque[tuple[int, int, Span | None]]] = field(default_factory=list)
    waited: set[tuple[int, int]] = field(default_factory=set)
    forwards: set[int] = field(default_factory=set)
    done: dict[Kind, list[bytearray]] = field(default_factory=dict)  # kind -> chunk -> mb
    unsent: dict[Msg, deque[tuple[Message, int]]] = field(default_factory=dict)
    posted: list[int] = field(default_factory=list)
    manual_recvs: list[tuple[int, CommSpec]] = field(default_factory=list)
    groups: dict[int, int] = field(default_factory=dict)
    flow: MessageKeys = field(init=False)
    slots: list[tuple[int, int]] = field(default_factory=list)  # chunk -> (pipe, stage)
    manual: bool = False  # the stream has hand-placed comm ops
    count: int = 0  # microbatches M: ops on higher ones (padding) are dropped

    def __post_init__(self) -> None:
        placement = self.streams.placement
        self.flow = MessageKeys(placement)
        generated = self.streams.generated_microbatches
        for slot in placement.chunks(self.rank):
            mbs = placement.microbatches(slot.pipe, generated)
            self.fwd.append(mbs.start)
            self.bwd.append(mbs.start)
            self.limits.append(mbs)
            self.pending_chunk.append(deque())
            self.slots.append((slot.pipe, slot.stage))
        count = self.count = self.streams.num_microbatches
        self.done = {kind: [bytearray(count) for _ in self.slots] for kind in Kind}
        self.unsent = {Msg.ACT: deque(), Msg.GRAD: deque()}

    def run(self, stream: tuple[StreamItem, ...]) -> tuple[Instr, ...]:
        self.manual = any(type(item) is CommSpec or type(item) is WaitSpec for item in stream)
        place, fused, append = self._place, self._fused, self.out.append  # every op: here
        for item in stream:
            if type(item) is OpSpec:
                op = place(item)
                if op is not None:
                    append(op)
                    if self.manual:
                        self._note_produced(op)
            elif type(item) is FusedSpec:
                fused(item)
            elif type(item) is CommSpec:
                self._comm(item)
            elif type(item) is WaitSpec:
                self._wait(item)
            else:
                raise AssertionError(f"unknown stream item {item!r}")
        self._finish()
        return tuple(self.out)

    # ---- computations ----------------------------------------------------------------------

    def _fused(self, item: FusedSpec) -> None:
        # the backward is placed (and checked) first: the two halves run together, so a
        # backward cannot use the forward it is fused with
        backward = self._place(item.backward)
        forward = self._place(item.forward)
        if forward is not None and backward is not None:
            self.out.append(_new(Fused, (forward, backward, item.span)))
        elif forward is not None:
            self.out.append(forward)
        elif backward is not None:
            self.out.append(backward)
        if self.manual:
            for op in (forward, backward):
                if op is not None:
                    self._note_produced(op)

    def _place(self, spec: OpSpec) -> Compute | None:
        """The Compute for `spec`, marked done on this rank, or None when it falls on a
        padded microbatch. A repeated op, or a backward before its forward, is an error."""
        kind, chunk, mb, span = spec
        if kind is _W:
            op = self._resolve_weight(spec)
            if op is not None:  # _resolve_weight takes each I once: a W cannot repeat
                self.done[_W][op.chunk][op.mb] = 1
            return op
        if chunk is None or not 0 <= chunk < len(self.slots):
            chunk = self._chunk(spec)
        if mb is None:
            counters = self.fwd if kind is _F else self.bwd
            mb = counters[chunk]
            counters[chunk] = mb + 1
        if mb not in self.limits[chunk]:
            self._mb_error(spec, chunk, mb)
        if kind is _I:
            self._queue_weight(chunk, mb, span)  # queued even when padded: its W drops too
        if mb >= self.count:
            return None
        pipe, stage = self.slots[chunk]
        op = _new(Compute, (kind, chunk, pipe, stage, mb, span))
        marks, key = self.done[kind][chunk], mb * len(self.slots) + chunk
        if marks[mb] or (kind is not _F and key not in self.forwards):
            self._order_error(op, marks)
        marks[mb] = 1
        if kind is _F:
            self.forwards.add(key)
        return op

    def _chunk(self, spec: OpSpec) -> int:
        placement = self.streams.placement
        if spec.chunk is None:
            if placement.num_chunks(self.rank) == 1:
                return 0
            raise ScheduleError(
                f"'{spec.kind.value}' needs a chunk number: rank {self.rank} holds "
                f"{placement.num_chunks(self.rank)} chunks (write {spec.kind.value}0, "
                f"{spec.kind.value}1, ...)",
                spec.span,
            )
        if not placement.has_chunk(self.rank, spec.chunk):
            raise ScheduleError(
                f"{spec.kind.value}{spec.chunk}: rank {self.rank} has no chunk {spec.chunk} "
                f"(placement {placement.name} gives it {placement.num_chunks(self.rank)})",
                spec.span,
            )
        return spec.chunk

    def _mb_error(self, spec: OpSpec, chunk: int, mb: int) -> None:
        limit = self.limits[chunk]
        slot = self.streams.placement.slot(self.rank, chunk)
        what = f"{spec.kind.value}{chunk}"
        if spec.mb is None:
            raise ScheduleError(
                f"{what} on rank {self.rank} would take microbatch {mb}, but pipe {slot.pipe} "
                f"has only microbatches {limit.start}..{limit.stop - 1}: too many "
                f"{'forwards' if spec.kind is Kind.F else 'backwards'} for chunk {chunk}",
                spec.span,
            )
        raise ScheduleError(
            f"{what}[{mb}] on rank {self.rank}: microbatch {mb} is not in pipe {slot.pipe}'s "
            f"range {limit.start}..{limit.stop - 1}",
            spec.span,
        )

    def _queue_weight(self, chunk: int, mb: int, span: Span | None) -> None:
        entry = (chunk, mb, span)
        self.pending_all.append(entry)
        self.pending_chunk[chunk].append(entry)

    def _resolve_weight(self, spec: OpSpec) -> Compute | None:
        entry = self._pop_weight(spec)
        chunk, mb, _ = entry
        self.waited.add((chunk, mb))
        if mb >= self.count:
            return None  # the W of an I generated for a padded microbatch
        pipe, stage = self.slots[chunk]
        return _new(Compute, (_W, chunk, pipe, stage, mb, spec.span))

    def _pop_weight(self, spec: OpSpec) -> tuple[int, int, Span | None]:
        if spec.chunk is None:
            queue = self.pending_all
        else:
            queue = self.pending_chunk[self._chunk(spec)]
        if spec.mb is not None:
            for entry in queue:
                if entry[1] == spec.mb and (entry[0], entry[1]) not in self.waited:
                    return entry
            raise ScheduleError(
                f"W{spec.chunk}[{spec.mb}] on rank {self.rank}: no pending I{spec.chunk} on "
                f"microbatch {spec.mb} before it",
                spec.span,
            )
        while queue and (queue[0][0], queue[0][1]) in self.waited:
            queue.popleft()
        if not queue:
            which = "" if spec.chunk is None else f" of chunk {spec.chunk}"
            raise ScheduleError(
                f"W on rank {self.rank} has no pending I{which} to complete (a W computes the "
                "weight gradient of an earlier I)",
                spec.span,
            )
        return queue.popleft()

    def _order_error(self, op: Compute, marks: bytearray) -> None:
        if marks[op.mb]:
            first = next(o for instr in self.out for o in computations(instr) if o == op)
            raise ScheduleError(
                f"{op.label()} appears twice on rank {self.rank} (stage {op.stage} of pipe "
                f"{op.pipe} has one {op.kind.value} per microbatch)",
                op.span,
                notes=((first.span, "first here"),) if first.span else (),
            )
        raise ScheduleError(
            f"{op.label()} on rank {self.rank} comes before its forward {Kind.F.value}"
            f"{op.chunk}.{op.mb} (a backward needs the activations of its forward)",
            op.span,
        )

    def _check_complete(self) -> None:
        """Each (chunk, mb) of this rank needs one F and one B, or one I and one W."""
        done, placement = self.done, self.streams.placement
        for chunk, (pipe, stage) in enumerate(self.slots):
            where = f"rank {self.rank} chunk {chunk} (stage {stage} of pipe {pipe})"
            for mb in placement.microbatches(pipe, self.streams.num_microbatches):
                if not done[Kind.F][chunk][mb]:
                    raise ScheduleError(f"{where} has no forward for microbatch {mb}")
                full, split = done[Kind.B][chunk][mb], done[Kind.I][chunk][mb]
                if full and split:
                    raise ScheduleError(f"{where} has both a B and an I for microbatch {mb}")
                if not full and not split:
                    raise ScheduleError(f"{where} has no backward (B or I) for microbatch {mb}")

    def _finish(self) -> None:
        self._check_complete()
        for chunk, mb, span in self.pending_all:
            if mb < self.streams.num_microbatches and (chunk, mb) not in self.waited:
                raise ScheduleError(
                    f"I{chunk}.{mb} on rank {self.rank} has no W: its weight gradient is never "
                    "computed",
                    span,
                )
        self._resolve_manual_recvs()

    # ---- hand-placed communication ---------------------------------------------------------

    def _note_produced(self, op: Compute) -> None:
        flow = self.flow.output_flow(op.kind, op.pipe, op.stage, op.mb)
        if flow is not None and flow.src != flow.dst:
            message = self.flow.message(flow.key)
            self.unsent[message.what].append((message, flow.dst))

    def _comm(self, item: CommSpec) -> None:
        group = self._group(item.group)
        if item.send:
            queue = self.unsent[item.what]
            if not queue:
                raise ScheduleError(
                    f"send {item.what.value} on rank {self.rank}: no {_noun(item.what)} produced "
                    "on this rank is waiting to be sent (a send follows the op that produces its "
                    "tensor)",
                    item.span,
                )
            message, peer = queue.pop()  # the most recent one not yet sent by hand
            self.posted.append(len(self.out))
            self.out.append(
                Send(item.what, peer, message.pipe, message.stage, message.mb, group, item.span)
            )
        else:
            self.posted.append(len(self.out))
            self.manual_recvs.append((len(self.out), item))
            self.out.append(Recv(item.what, -1, 0, 0, 0, group, item.span))  # resolved at end

    def _group(self, group: int | None) -> int | None:
        if group is None:
            return None
        return self.groups.setdefault(group, len(self.groups))

    def _wait(self, item: WaitSpec) -> None:
        if not self.posted:
            raise ScheduleError(
                f"wait on rank {self.rank}: no hand-placed send or recv is waiting to complete",
                item.span,
            )
        self.out.append(Wait(tuple(self.posted), item.span))
        self.posted = []

    def _resolve_manual_recvs(self) -> None:
        """A hand-placed `recv act|grad` receives the input of the next op after it that
        consumes such a tensor from another rank and has no hand-placed recv yet."""
        if not self.manual_recvs:
            return
        consumers: dict[Msg, deque[tuple[int, Message, int]]] = {
            Msg.ACT: deque(),
            Msg.GRAD: deque(),
        }
        for index, instr in enumerate(self.out):
            for op in computations(instr):
                flow = self.flow.input_flow(op.kind, op.pipe, op.stage, op.mb)
                if flow is not None and flow.src != flow.dst:
                    message = self.flow.message(flow.key)
                    consumers[message.what].append((index, message, flow.src))
        for index, item in self.manual_recvs:
            queue = consumers[item.what]
            while queue and queue[0][0] < index:
                queue.popleft()
            if not queue:
                raise ScheduleError(
                    f"recv {item.what.value} on rank {self.rank}: no later op on this rank "
                    f"consumes a {_noun(item.what)} from another rank",
                    item.span,
                )
            _, message, peer = queue.popleft()
            placeholder = self.out[index]
            assert type(placeholder) is Recv
            self.out[index] = Recv(
                item.what,
                peer,
                message.pipe,
                message.stage,
                message.mb,
                placeholder.group,
                item.span,
            )


def _noun(what: Msg) -> str:
    return "activation" if what is Msg.ACT else "gradient"


# ---- completeness --------------------------------------------------------------------------
