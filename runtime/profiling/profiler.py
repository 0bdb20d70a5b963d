"""Profiling as an interpreter subclass: the same dispatch, every instruction timed.

`ProfilingInterpreter` wraps the parts of a plain `Interpreter` and records into a `Recorder`
(runtime/profiling/recorder.py) the wall time of each compute op, the host time of each send or
receive, when each group of posts went out and what it carried, and when each wait started,
was released and ended; of each forward, the part of its time outside the stage's module (the
profile's `dispatch`: the host time of an instruction that does not grow with the stage's
layers), from hooks on the stage modules.

On CUDA (`EventTimes`) a compute op's time is the GPU time between two CUDA events recorded on
the current stream, where the op is queued, before and after it (a fused op's after the join
of its two streams), and the gradient sum's likewise: nothing synchronizes the device around
an op, so transfers in flight on NCCL's streams are not counted as compute, and the two halves
of a fused op stay concurrent. The events are read after the step, at its one synchronize;
the sum's start and end are placed on the host's clock from the step's last event, recorded
just before that synchronize. A forward's `dispatch` is then host time alone: the op's host
time less the host time of its module call.

A MoE stage's F, B and I run as phases (pipecc/ir/ops.py `Phase`), each timed as a compute op
is (the host's wall time, or CUDA events); the phases of one op add up to its duration,
recorded under its own kind (F, B or I) when its last phase ends, so the phases of a fused
F&B's two halves, interleaved in the program, count to the F and to the B they are part
of. Each expert-parallel all-to-all is recorded with the time it was posted, the time the
compute thread began to wait for it and the time it completed (runtime/profiling/
moe_costs.py): a blocking one is waited for from its post, an asynchronous one at the `Wait`
that lists it (on CUDA, as events on the current stream, which waits for the all-to-all's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from pipecc.ir.keys import carried
from pipecc.ir.ops import Collective, Fused, Kind, Phase, Send

from ..engine.context import StepContext
from ..engine.interpreter import Interpreter
from ..engine.steps import (
    AllToAllStep,
    Bound,
    ComputeStep,
    FusedStep,
    PhaseStep,
    PostStep,
    SequentialStep,
    WaitStep,
)
from .recorder import Recorder


class ProfilingInterpreter(Interpreter):
    """An `Interpreter` over `base`'s parts that records every instruction in `recorder`."""

    def __init__(
        self, base: Interpreter, recorder: Recorder, events: EventTimes | None = None
    ) -> None:
        super().__init__(base.parts)
        self.recorder = recorder
        device = base.transfers.device
        # CUDA events time the ops (module docstring); None: host wall time, on the CPU
        self.events = events if events is not None else EventTimes.of(device)
        # (start, end) of the last call of a stage's module: a forward's time inside it
        self.inside: list[float] = []
        # a MoE op's phases so far: (kind, chunk, mb) -> seconds (their sum is the op's)
        self.phased: dict[tuple[str, int, int], float] = {}
        # each asynchronous all-to-all posted and not yet waited for: index -> (stage, posted
        # at: a host time, or on CUDA an event)
        self.a2a_posted: dict[int, tuple[int, Any]] = {}

    def run(self, bound: Bound, ctx: StepContext) -> None:
        """The step, with hooks on the stage modules that time a forward's module call."""
        handles = []
        for chunk in self.stage.chunks.values():
            handles.append(chunk.module.register_forward_pre_hook(self._entered))
            handles.append(chunk.module.register_forward_hook(self._left))
        try:
            start = time.perf_counter()
            super().run(bound, ctx)
            if self.events is not None:
                self.events.read()  # the step's one synchronize
            self.recorder.span(start, time.perf_counter())
        finally:
            for handle in handles:
                handle.remove()
            if self.events is not None:
                self.events.pending.clear()

    def _entered(self, *_: object) -> None:
        self.inside[:] = [time.perf_counter()]

    def _left(self, *_: object) -> None:
        if len(self.inside) == 1:
            self.inside.append(time.perf_counter())

    def compute(self, ctx: StepContext, step: ComputeStep | FusedStep | SequentialStep) -> None:
        if isinstance(step, SequentialStep):  # each part timed as the op it is
            super().compute(ctx, step)
            return
        self.inside.clear()
        marked = self.events.mark() if self.events is not None else None
        start = time.perf_counter()
        super().compute(ctx, step)
        seconds = time.perf_counter() - start
        instr = step.instr
        if isinstance(instr, Fused):
            kind, stage = ("FB" if instr.backward.kind is Kind.B else "FI"), instr.forward.stage
        else:
            assert isinstance(step, ComputeStep)
            kind, stage = step.kind.value, step.stage
            if step.kind is Kind.F and len(self.inside) == 2:  # the module ran once, in it
                self.recorder.outside(seconds - (self.inside[1] - self.inside[0]))
        if self.events is None:
            self.recorder.compute(kind, stage, seconds)
        else:
            self.events.timed(marked, lambda _, took: self.recorder.compute(kind, stage, took))

    def post(self, ctx: StepContext, step: PostStep) -> None:
        start = time.perf_counter()
        self.transfers.post(ctx, step)
        if step.commit:
            group = list(self.transfers.posts.queue)
            self.transfers.commit()
            now = time.perf_counter()  # the group is posted (or handed to the poster thread)
            for posted, tensors in group:
                nbytes = sum(t.nbytes for t in tensors)
                self.recorder.posted(posted.send, carried(posted.comm), now, nbytes)
        self.recorder.post(time.perf_counter() - start)

    def wait(self, ctx: StepContext, step: WaitStep) -> None:
        a2as = [self.a2a_posted.pop(i) for i in step.ops if i in self.a2a_posted]
        marked = self.events.mark() if self.events is not None and a2as else None
        start = time.perf_counter()
        waited, released = self.transfers.wait(ctx, step, self.rank)
        ops = tuple((type(op) is Send, carried(op)) for op in waited)
        self.recorder.wait(ops, (start, max(start, released), time.perf_counter()))
        for stage, posted in a2as:
            if self.events is None:
                self.recorder.a2a(stage, False, (posted, start, max(start, released)))
            else:
                self._async_events(stage, posted, marked)

    def phase(self, ctx: StepContext, step: PhaseStep) -> None:
        """One phase of a MoE stage's op, timed; the op's duration once its last phase ends
        (module docstring)."""
        if self.events is None:
            start = time.perf_counter()
            super().phase(ctx, step)
            self._phase_timed(step.phase, time.perf_counter() - start)
            return
        marked = self.events.mark()
        super().phase(ctx, step)
        phase = step.phase
        self.events.timed(marked, lambda _, took: self._phase_timed(phase, took))

    def _phase_timed(self, phase: Phase, seconds: float) -> None:
        op = phase.op
        kind, key = op.kind.value, (op.kind.value, op.chunk, op.mb)
        self.recorder.phase(kind, op.stage, phase.part.value, phase.layer, seconds)
        total = self.phased.pop(key, 0.0) + seconds
        if phase.is_last:
            self.recorder.compute(kind, op.stage, total)
        else:
            self.phased[key] = total

    def all_to_all(self, ctx: StepContext, step: AllToAllStep) -> None:
        """An expert-parallel all-to-all: a blocking one timed from its post to its
        completion; an asynchronous one's post noted for the `Wait` that completes it."""
        instr = step.instr
        assert isinstance(instr, Collective)
        chunk = step.key[0]  # the stage the program names, else the one its chunk holds
        stage = instr.stages[0] if instr.stages else self.stage.chunks[chunk].slot.stage
        posted = time.perf_counter() if self.events is None else self.events.mark()
        super().all_to_all(ctx, step)
        if instr.asynchronous:
            self.a2a_posted[step.index] = (stage, posted)
        elif self.events is None:
            self.recorder.a2a(stage, True, (posted, posted, time.perf_counter()))
        else:
            self.events.timed(
                posted, lambda at, took: self.recorder.a2a(stage, True, (at, at, at + took))
            )

    def _async_events(self, stage: int, posted: Any, waited: Any) -> None:
        """On CUDA: an asynchronous all-to-all's post and wait, read after the step (the
        two events' reports come in this order)."""
        got: list[float] = []

        def report(at: float, took: float) -> None:
            got.extend((at, at + took))
            if len(got) == 4:  # (posted, done), (waited from, done)
                self.recorder.a2a(stage, False, (got[0], got[2], got[3]))

        assert self.events is not None
        self.events.timed(posted, report)
        self.events.timed(waited, report)

    def collective(self, instr: Collective) -> None:
        """The gradient sum, recorded as the profile's `sync` (its time per step)."""
        if self.events is not None:
            marked = self.events.mark()
            super().collective(instr)
            self.events.timed(marked, lambda at, took: self.recorder.sync(at, at + took))
            return
        start = time.perf_counter()
        super().collective(instr)
        self.recorder.sync(start, time.perf_counter())


Report = Callable[[float, float], None]  # (its start on the host's clock, its seconds)


class EventTimes:
    """Ops timed with CUDA events on the current stream, read after the step (module
    docstring). `make()` gives a timing event (with `record(stream)` and `elapsed_time`),
    `stream()` the current stream, `synchronize()` waits for the device; a test passes
    stand-ins."""

    def __init__(
        self,
        make: Callable[[], Any],
        stream: Callable[[], Any],
        synchronize: Callable[[], None],
    ) -> None:
        self.make = make
        self.stream = stream
        self.synchronize = synchronize
        self.pending: list[tuple[Any, Any, Report]] = []  # (start, end, report) in op order

    @classmethod
    def of(cls, device: torch.device) -> EventTimes | None:
        """The device's event timer; None off CUDA."""
        if device.type != "cuda":
            return None
        event: Any = torch.cuda.Event  # torch leaves its constructor untyped
        return cls(
            lambda: event(enable_timing=True),
            lambda: torch.cuda.current_stream(device),
            lambda: torch.cuda.synchronize(device),
        )

    def mark(self) -> Any:
        """An event recorded now on the current stream."""
        event = self.make()
        event.record(self.stream())
        return event

    def timed(self, start: Any, report: Report) -> None:
        """An op that began at `start` ends now; `report` gets its times after the step."""
        self.pending.append((start, self.mark(), report))

    def read(self) -> None:
        """After the step: one synchronize, then each op's start on the host's clock (the last
        event is the synchronize's return) and its GPU seconds, reported in op order."""
        last = self.mark()
        self.synchronize()
        now = time.perf_counter()

        for start, end, report in self.pending:
            at = now - float(start.elapsed_time(last)) / 1e3
            report(at, float(start.elapsed_time(end)) / 1e3)
        self.pending.clear()
