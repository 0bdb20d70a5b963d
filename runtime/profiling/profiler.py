"""Profiling as an interpreter subclass: the same dispatch, every instruction timed.

`ProfilingInterpreter` wraps the parts of a plain `Interpreter` and records into a `Recorder`
(runtime/profiling/recorder.py) the wall time of each compute op (on CUDA between two device
synchronisations), the host time of each send or receive, when each group of posts went out and
what it carried, and when each wait started, was released and ended.
"""

from __future__ import annotations

import time

import torch

from pipecc.ir.keys import carried
from pipecc.ir.ops import Collective, Compute, Fused, Kind, Recv, Send, Sequential, Wait

from ..engine.context import StepContext
from ..engine.interpreter import Interpreter
from .recorder import Recorder


class ProfilingInterpreter(Interpreter):
    """An `Interpreter` over `base`'s parts that records every instruction in `recorder`."""

    def __init__(self, base: Interpreter, recorder: Recorder) -> None:
        super().__init__(base.rank, base.stage, base.fused, base.transfers, base.sums)
        self.recorder = recorder
        self.cuda = base.transfers.device if base.transfers.device.type == "cuda" else None

    def compute(self, ctx: StepContext, instr: Compute | Fused | Sequential) -> None:
        if isinstance(instr, Sequential):  # each part timed as the op it is
            super().compute(ctx, instr)
            return
        self._synchronize()
        start = time.perf_counter()
        super().compute(ctx, instr)
        self._synchronize()
        seconds = time.perf_counter() - start
        if isinstance(instr, Fused):
            kind = "FB" if instr.backward.kind is Kind.B else "FI"
            self.recorder.compute(kind, instr.forward.stage, seconds)
        else:
            self.recorder.compute(instr.kind.value, instr.stage, seconds)

    def post(self, ctx: StepContext, index: int, instr: Send | Recv, commit: bool) -> None:
        ctx.settle()  # the step's shape gather is not a post's host time
        start = time.perf_counter()
        self.transfers.post(ctx, index, instr, commit=False)
        if commit:
            group = list(ctx.queue)
            self.transfers.commit(ctx)
            now = time.perf_counter()  # the group is posted (its ops go out from the poster)
            for _, op, tensors in group:
                nbytes = sum(t.nbytes for t in tensors)
                self.recorder.posted(type(op) is Send, carried(op), now, nbytes)
        self.recorder.post(time.perf_counter() - start)

    def wait(self, ctx: StepContext, index: int, instr: Wait) -> None:
        start = time.perf_counter()
        waited, released = self.transfers.wait(ctx, self.where(ctx, index, instr), instr)
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
