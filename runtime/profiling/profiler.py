"""Profiling as an interpreter subclass: the same dispatch, every instruction timed.

`ProfilingInterpreter` wraps the parts of a plain `Interpreter` and records into a `Recorder`
(runtime/profiling/recorder.py) the wall time of each compute op (on CUDA between two device
synchronisations), the host time of each send or receive, when each group of posts went out and
what it carried, and when each wait started, was released and ended; of each forward, the
part of its time outside the stage's module (the profile's `dispatch`: the host time of an
instruction that does not grow with the stage's layers), from hooks on the stage modules.
"""

from __future__ import annotations

import time

import torch

from pipecc.ir.keys import carried
from pipecc.ir.ops import Collective, Fused, Kind, Send

from ..engine.context import StepContext
from ..engine.interpreter import Interpreter
from ..engine.steps import (
    Bound,
    ComputeStep,
    FusedStep,
    PostStep,
    SequentialStep,
    WaitStep,
)
from .recorder import Recorder


class ProfilingInterpreter(Interpreter):
    """An `Interpreter` over `base`'s parts that records every instruction in `recorder`."""

    def __init__(self, base: Interpreter, recorder: Recorder) -> None:
        super().__init__(base.parts)
        self.recorder = recorder
        self.cuda = base.transfers.device if base.transfers.device.type == "cuda" else None
        # (start, end) of the last call of a stage's module: a forward's time inside it
        self.inside: list[float] = []

    def run(self, bound: Bound, ctx: StepContext) -> None:
        """The step, with hooks on the stage modules that time a forward's module call."""
        handles = []
        for chunk in self.stage.chunks.values():
            handles.append(chunk.module.register_forward_pre_hook(self._entered))
            handles.append(chunk.module.register_forward_hook(self._left))
        try:
            start = time.perf_counter()
            super().run(bound, ctx)
            self._synchronize()
            self.recorder.span(start, time.perf_counter())
        finally:
            for handle in handles:
                handle.remove()

    def _entered(self, *_: object) -> None:
        self._synchronize()
        self.inside[:] = [time.perf_counter()]

    def _left(self, *_: object) -> None:
        self._synchronize()
        if len(self.inside) == 1:
            self.inside.append(time.perf_counter())

    def compute(self, ctx: StepContext, step: ComputeStep | FusedStep | SequentialStep) -> None:
        if isinstance(step, SequentialStep):  # each part timed as the op it is
            super().compute(ctx, step)
            return
        self._synchronize()
        self.inside.clear()
        start = time.perf_counter()
        super().compute(ctx, step)
        self._synchronize()
        seconds = time.perf_counter() - start
        instr = step.instr
        if isinstance(instr, Fused):
            kind = "FB" if instr.backward.kind is Kind.B else "FI"
            self.recorder.compute(kind, instr.forward.stage, seconds)
        else:
            assert isinstance(step, ComputeStep)
            self.recorder.compute(step.kind.value, step.stage, seconds)
            if step.kind is Kind.F and len(self.inside) == 2:  # the module ran once, in it
                self.recorder.outside(seconds - (self.inside[1] - self.inside[0]))

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
        start = time.perf_counter()
        waited, released = self.transfers.wait(ctx, step, self.rank)
        ops = tuple((type(op) is Send, carried(op)) for op in waited)
        self.recorder.wait(ops, (start, max(start, released), time.perf_counter()))

    def collective(self, instr: Collective) -> None:
        """The gradient sum, recorded as the profile's `sync` (its time per step)."""
        self._synchronize()
        start = time.perf_counter()
        super().collective(instr)
        self._synchronize()
        self.recorder.sync(start, time.perf_counter())

    def _synchronize(self) -> None:
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
