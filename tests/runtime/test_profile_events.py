"""The profiler's CUDA branch (runtime/profiling/profiler.py `EventTimes`), on the CPU with
stand-in events: each op is timed by two events on the current stream, the device is
synchronized once, after the step, and the ops' times are the GPU time between their events
(not the host's), the gradient sum placed on the host's clock."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from pipecc.runtime.engine.context import StepContext
from pipecc.runtime.engine.interpreter import Parts
from pipecc.runtime.engine.steps import (
    Bound,
    CollectiveStep,
    ComputeStep,
    FusedStep,
)
from pipecc.runtime.profiling import profiler
from pipecc.runtime.profiling.profiler import EventTimes, ProfilingInterpreter
from pipecc.runtime.profiling.recorder import Recorder

from pipecc.ir.ops import Collective, CollectiveKind, Compute, Fused, Kind


class Gpu:
    """A stand-in device: its clock (ms) moves only when an op's work is queued; the host's
    clock is frozen at 100 s, so every host time is 0 and only events can see the work."""

    def __init__(self) -> None:
        self.ms = 0.0
        self.log: list[str] = []

    def event(self) -> Event:
        return Event(self)

    def synchronize(self) -> None:
        self.log.append("synchronize")


class Event:
    def __init__(self, gpu: Gpu) -> None:
        self.gpu = gpu
        self.at: float | None = None

    def record(self, stream: object) -> None:
        assert stream == "current"
        self.at = self.gpu.ms
        self.gpu.log.append(f"record {self.at:g}")

    def elapsed_time(self, end: Event) -> float:
        assert "synchronize" in self.gpu.log, "read only after the step's synchronize"
        assert self.at is not None and end.at is not None
        return end.at - self.at


def test_ops_are_timed_by_events_and_read_after_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiler.time, "perf_counter", lambda: 100.0)
    gpu = Gpu()

    def work(ms: float) -> Any:
        def run(*_: object) -> None:
            gpu.log.append(f"op {ms:g}")
            gpu.ms += ms

        return run

    unit: Any = SimpleNamespace()
    forward = ComputeStep(0, Compute(Kind.F, 0, 0, 0, 0), unit)
    forward.run = work(5)
    fused_instr = Fused(Compute(Kind.F, 1, 0, 1, 0), Compute(Kind.B, 0, 0, 0, 1))
    halves = (ComputeStep(1, fused_instr.forward, unit), ComputeStep(1, fused_instr.backward, unit))
    fused = FusedStep(1, fused_instr, halves, None)
    total = Collective(CollectiveKind.ALL_REDUCE, (0, 1), "grad-sum s0+s1")
    bound = Bound((forward, fused, CollectiveStep(2, total)), ())
    parts: Any = Parts(
        0,
        cast(Any, SimpleNamespace(chunks={})),
        cast(Any, SimpleNamespace(run=work(12))),
        cast(Any, SimpleNamespace(device=torch.device("cpu"), begin=lambda: None)),
        cast(Any, SimpleNamespace(run=work(3))),
    )
    base: Any = SimpleNamespace(parts=parts, transfers=parts.transfers)
    recorder = Recorder()
    events = EventTimes(gpu.event, lambda: "current", gpu.synchronize)
    timed = ProfilingInterpreter(base, recorder, events)
    timed.run(bound, StepContext(inputs=None, targets=None, scale=1.0, training=True))
    assert gpu.log == [
        "record 0", "op 5", "record 5", "record 5", "op 12", "record 17",
        "record 17", "op 3", "record 20", "record 20", "synchronize",
    ]  # fmt: skip
    assert recorder.computes == [("F", 0, 0.005), ("FB", 1, 0.012)]
    (sync,) = recorder.syncs
    assert sync[1:] == (pytest.approx(100 - 0.003), pytest.approx(100.0))
    assert recorder.spans == [(0, 100.0, 100.0)] and events.pending == []


def test_the_cpu_profile_keeps_host_times() -> None:
    assert EventTimes.of(torch.device("cpu")) is None
