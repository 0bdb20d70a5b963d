"""`pipecc run --profile` of a MoE program, without processes: the profiler times every phase
and all-to-all (runtime/profiling/profiler.py) on a fake clock, a MoE op's phases add up to
its F, B or I (a fused op's interleaved halves each to its own kind), and the cost file gets
`a2a` and `moe_experts` per stage (runtime/profiling/moe_costs.py), which the simulator
reads back."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from pipecc.runtime.engine.context import StepContext
from pipecc.runtime.engine.interpreter import Parts
from pipecc.runtime.engine.steps import AllToAllStep, Bound, ComputeStep, PhaseStep, Step, WaitStep
from pipecc.runtime.profiling import profiler
from pipecc.runtime.profiling.moe_costs import moe_profile
from pipecc.runtime.profiling.profiler import EventTimes, ProfilingInterpreter
from pipecc.runtime.profiling.recorder import Recorder, measured_costs, render_cost_file

from pipecc.api import compile_schedule
from pipecc.cli import main
from pipecc.commands.run_report import moe_profile_lines
from pipecc.ir.ops import (
    Collective,
    CollectiveKind,
    Compute,
    Kind,
    Phase,
    Wait,
    all_to_all_what,
    phases,
)
from pipecc.passes.expand_moe import expand_moe
from pipecc.semantics.costs import parse_cost_text

LOOP = compile_schedule("1f1b", ranks=2, microbatches=2)


class Clock:
    """The host's clock (s), moved only by the stand-ins' work."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _interpreter(clock: Clock, took: dict[str, float], a2a: float) -> ProfilingInterpreter:
    """A profiling interpreter over stand-ins: each phase takes `took[part]` seconds, each
    all-to-all completes `a2a` s after it is posted (at its wait: no earlier than then)."""

    def phase(ctx: object, step: PhaseStep) -> None:
        clock.now += took[step.phase.part.value]

    def post(ctx: object, step: AllToAllStep) -> list[Any]:
        done = clock.now + a2a
        return [SimpleNamespace(wait=lambda: setattr(clock, "now", max(clock.now, done)))]

    held: dict[int, list[Any]] = {}

    def wait(ctx: object, step: WaitStep, rank: int) -> tuple[list[Any], float]:
        for index in step.ops:
            for work in held.pop(index):
                work.wait()
        return [], clock.now

    moe = SimpleNamespace(phase=phase, post=post, begin=lambda: None)
    transfers = SimpleNamespace(
        device=torch.device("cpu"), begin=lambda: None, hold=held.__setitem__, wait=wait
    )
    parts: Any = Parts(0, cast(Any, SimpleNamespace(chunks={})), cast(Any, None),
                       cast(Any, transfers), moe=cast(Any, moe))  # fmt: skip
    base: Any = SimpleNamespace(parts=parts, transfers=transfers)
    return ProfilingInterpreter(base, Recorder(), events=None)


def _a2a(index: int, op: Compute, j: int, asynchronous: bool) -> AllToAllStep:
    what = all_to_all_what(op, 1, j)
    instr = Collective(CollectiveKind.ALL_TO_ALL, (0,), what, asynchronous, ("ep",), (op.stage,))
    direction = what.split()[0]
    return AllToAllStep(index, instr, direction, 0, (op.chunk, op.mb))


def _steps(ops: list[tuple[Compute, Phase | None]], asynchronous: bool) -> list[Step]:
    """Each (op, phase) as a phase step, each (op, None) as the op's next all-to-all (with
    its Wait right after it when asynchronous)."""
    steps: list[Step] = []
    seen: dict[Compute, int] = {}
    for op, phase in ops:
        unit: Any = SimpleNamespace()
        if phase is not None:
            steps.append(PhaseStep(len(steps), phase, ComputeStep(len(steps), op, unit)))
            continue
        j = seen.get(op, 0)
        seen[op] = j + 1
        steps.append(_a2a(len(steps), op, j, asynchronous))
        if asynchronous:
            steps.append(WaitStep(len(steps), Wait((len(steps) - 1,))))
    return steps


TOOK = {"pre": 0.003, "experts": 0.002, "post": 0.001}
F = Compute(Kind.F, 0, 0, 1, 0)
B = Compute(Kind.B, 0, 0, 1, 1)


def test_a_plain_ops_phases_add_up_to_it_and_its_blocking_all_to_alls_are_timed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(profiler.time, "perf_counter", clock)
    pre, experts, post = phases(F, 1)
    order = [(F, pre), (F, None), (F, experts), (F, None), (F, post)]
    timed = _interpreter(clock, TOOK, a2a=0.004)
    timed.run(Bound(tuple(_steps(order, asynchronous=False)), ()), _ctx())
    record = timed.recorder
    assert [(p.kind, p.stage, p.part, p.layer) for p in record.phases] == [
        ("F", 1, "pre", 0), ("F", 1, "experts", 0), ("F", 1, "post", 1)
    ]  # fmt: skip
    assert record.computes == [("F", 1, pytest.approx(0.006))], "the sum, once the op ends"
    assert [(a.blocking, a.done - a.posted, a.done - a.waited) for a in record.a2as] == [
        (True, pytest.approx(0.004), pytest.approx(0.004))
    ] * 2


def test_a_fused_ops_interleaved_phases_count_to_their_own_kinds_and_its_async_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(profiler.time, "perf_counter", clock)
    f, b = phases(F, 1), phases(B, 1)  # DualPipe's interleave of the two halves
    order = [(B, b[0]), (B, None), (F, f[0]), (F, None), (B, b[1]), (B, None), (F, f[1]),
             (F, None), (B, b[2]), (F, f[2])]  # fmt: skip
    timed = _interpreter(clock, TOOK, a2a=0.0025)
    timed.run(Bound(tuple(_steps(order, asynchronous=True)), ()), _ctx())
    record = timed.recorder
    assert sorted(record.computes) == [
        ("B", 1, pytest.approx(0.006)), ("F", 1, pytest.approx(0.006))
    ], "no FB: each half's phases are its own op's"  # fmt: skip
    # each all-to-all is waited for right after its post: 2.5 ms of it exposed
    assert [(a.blocking, round(a.done - a.posted, 6)) for a in record.a2as] == [(False, 0.0025)] * 4
    assert timed.a2a_posted == {}, "every posted all-to-all was waited for"


def _ctx() -> StepContext:
    return StepContext(inputs=None, targets=None, scale=1.0, training=True)


def _recorders(async_only: bool = False) -> list[Recorder]:
    """Two steps of two ranks (stages 0 and 1, one MoE layer): F phases 3+2+1 ms, B phases
    4+4+2 ms (experts 6 of 16 ms), all-to-alls of 1.5 ms (2 ms on stage 1 in step 1)."""
    records = []
    for step in range(2):
        for stage in (0, 1):
            record = Recorder(step=step)
            for kind, times in (("F", (3, 2, 1)), ("B", (4, 4, 2))):
                for (part, layer), ms in zip(
                    (("pre", 0), ("experts", 0), ("post", 1)), times, strict=True
                ):
                    record.phase(kind, stage, part, layer, ms / 1e3)
                record.compute(kind, stage, sum(times) / 1e3)
            a2a = 2.0 if (step, stage) == (1, 1) else 1.5
            for start in (10.0, 20.0):
                waited = start + (0.0 if not async_only else 0.001)
                record.a2a(stage, not async_only, (start, waited, start + a2a / 1e3))
            records.append(record)
    return records


def test_the_cost_file_gets_a2a_and_moe_experts_per_stage_and_simulate_reads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    program = expand_moe(LOOP, (1, 1))
    records = _recorders()
    top, per_stage = measured_costs(records)
    assert per_stage[0] == {"F": 6.0, "B": 10.0, "moe_experts": 0.375, "a2a": 1.5}
    assert per_stage[1]["a2a"] == 1.75, "the median of the step means 1.5 and 2"
    assert top["moe_experts"] == 0.375 and top["a2a"] == pytest.approx(1.625)
    text = render_cost_file(records, "fake", measured_on=program)
    costs = parse_cost_text(text, "fake").for_program(program)
    assert (costs.stage(0).a2a, costs.stage(0).moe_experts) == (1.5, 0.375)
    assert costs.stage(1).a2a == 1.75 and "moe_layers" not in text, "the program says K"
    assert "[profile.stage.0]" in text and "F_experts = 2.0" in text
    unsaid = render_cost_file(records, "fake", measured_on=LOOP)  # a program without moe
    assert parse_cost_text(unsaid, "fake").stage(1).moe_layers == 1
    path = tmp_path / "moe.toml"
    path.write_text(text)
    args = ["simulate", "1f1b", "-P", "2", "-M", "2", "--mesh", "pp=2,ep=2", "--moe", "1"]
    assert main([*args, "--cost-file", str(path)]) == 0
    assert "a2a=1.625, moe_experts=0.375" in capsys.readouterr().out


def test_with_only_async_all_to_alls_a2a_is_the_rendezvous_fit_of_their_waits() -> None:
    # each waited for from 1 ms after its post and released at post + a2a: the fit is a2a
    _, per_stage = measured_costs(_recorders(async_only=True))
    assert per_stage[0]["a2a"] == pytest.approx(1.5, abs=1e-4)
    assert per_stage[1]["a2a"] == pytest.approx(1.75, abs=1e-4)


def test_the_report_prints_the_phases_per_stage() -> None:
    lines = moe_profile_lines(moe_profile(_recorders()))
    assert lines[1].split() == ["stage", "F_pre", "F_experts", "F_post", "B_pre", "B_experts",
                                "B_post", "a2a", "a2a_exposed", "moe_experts"]  # fmt: skip
    assert lines[2].split() == ["0", "3", "2", "1", "4", "4", "2", "1.5", "1.5", "0.375"]


class Event:
    """A stand-in CUDA event on `clock` (the device's time; the host's is frozen)."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.at = clock, 0.0

    def record(self, stream: object) -> None:
        self.at = self.clock.now

    def elapsed_time(self, end: Event) -> float:
        return (end.at - self.at) * 1e3  # ms, as torch's


@pytest.mark.parametrize("asynchronous", [False, True])
def test_on_cuda_phases_and_all_to_alls_are_timed_by_events(
    monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    device = Clock()
    monkeypatch.setattr(profiler.time, "perf_counter", lambda: 100.0)
    f, b = phases(F, 1), phases(B, 1)
    order = [(B, b[0]), (B, None), (F, f[0]), (F, None), (B, b[1]), (B, None), (F, f[1]),
             (F, None), (B, b[2]), (F, f[2])]  # fmt: skip
    timed = _interpreter(device, TOOK, a2a=0.0025)
    timed.events = EventTimes(lambda: Event(device), lambda: "current", lambda: None)
    timed.run(Bound(tuple(_steps(order, asynchronous)), ()), _ctx())
    record = timed.recorder
    assert sorted(record.computes) == [
        ("B", 1, pytest.approx(0.006)), ("F", 1, pytest.approx(0.006))
    ]  # fmt: skip
    assert [round(a.done - a.posted, 6) for a in record.a2as] == [0.0025] * 4
    assert all(a.blocking is not asynchronous for a in record.a2as)


def test_a_blocking_all_to_all_is_its_last_members_time_not_the_early_posters_wait() -> None:
    """Two EP peers of stage 0: in each all-to-all one posts 1 ms before the other and so
    waits 1 ms more; the transfer itself takes 0.5 ms. The replay holds a collective for its
    last member already, so `a2a` is 0.5 ms, not the mean wait 1 ms."""
    records = []
    for rank in range(2):
        record = Recorder(step=0)
        for index, start in enumerate((10.0, 20.0, 30.0)):
            early = (index + rank) % 2 == 0  # the peers take turns posting first
            posted = start if early else start + 0.001
            record.a2a(0, True, (posted, posted, start + 0.0015))
        records.append(record)
    _, per_stage = measured_costs(records)
    assert per_stage[0]["a2a"] == pytest.approx(0.5)
