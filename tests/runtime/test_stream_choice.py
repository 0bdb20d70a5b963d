"""Which CUDA stream each half of a fused op runs on (runtime/engine/fused.py `TwoStreams`),
checked on the CPU with stand-in streams over the compiled programs of every bundled
schedule that has fused ops.

Autograd runs a backward's kernels on the stream its forward ran on. So the two halves of
an F&B (F&I) overlap only when the fused forward goes to the stream other than the one the
backward half's forward used, and the backward half must run with that stream current (its
entry and exit syncs are then no-ops between the halves). The check walks each rank's
instructions in order through the real `FusedOps.run`, records where every forward ran (a
plain F on the current stream), and asserts both rules at every fused op; and that the
tensors the halves read are alive when the streams join.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from pipecc.runtime.engine.context import Saved, StepContext
from pipecc.runtime.engine.fused import FusedOps, TwoStreams
from pipecc.runtime.engine.steps import ComputeStep, FusedStep

from pipecc.api import bundled_schedules, compile_schedule
from pipecc.diagnostics import PipeccError
from pipecc.ir.ops import Compute, Fused, Kind
from pipecc.ir.program import Program

UNIT: Any = SimpleNamespace()  # a step's chunk: the stand-in ops never look at it


class Stream:
    """A stand-in CUDA stream: its name, and the streams it was made to wait for."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    def wait_stream(self, other: Stream) -> None:
        self.log.append(f"{self.name} waits {other.name}")

    def __repr__(self) -> str:
        return self.name


class Device:
    """Stand-in streams of one device, and which is current (as `torch.cuda.stream` sets)."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.main = Stream("main", self.log)
        self.side = Stream("side", self.log)
        self.now = self.main

    @contextlib.contextmanager
    def use(self, stream: Stream) -> Iterator[None]:
        before, self.now = self.now, stream
        try:
            yield
        finally:
            self.now = before

    def streams(self) -> TwoStreams:
        return TwoStreams(self.side, lambda: self.now, self.use)


class AlwaysSide(TwoStreams):
    """The rule before the fix: every fused forward on the side stream, every backward half
    on the current one."""

    def pick(self, ctx: StepContext, forward: Any, backward: Any) -> tuple[bool, bool]:
        return True, False


class Walk:
    """Runs one rank's instructions: plain ops as the interpreter would (on the current
    stream), fused ones through `FusedOps.run`; records where each forward ran and every
    fused op whose halves break the rules."""

    def __init__(self, device: Device, streams: TwoStreams) -> None:
        self.device = device
        self.ran: dict[tuple[int, int], Stream] = {}  # (chunk, mb) -> its forward's stream
        self.wrong: list[str] = []
        ops = SimpleNamespace(chunks={}, recompute=frozenset(), forward=self.forward)
        self.fused = FusedOps(cast(Any, ops), torch.device("cpu"), streams)
        self.expected: Stream | None = None  # the stream the running backward half needs

    def forward(self, ctx: StepContext, op: ComputeStep) -> None:
        self.ran[op.key] = self.device.now

    def backward(self, ctx: StepContext, op: ComputeStep) -> None:
        if self.device.now is not self.expected:
            self.wrong.append(f"{op.instr.label()} ran on {self.device.now}, its forward on "
                              f"{self.expected}")  # fmt: skip

    def rank(self, instrs: tuple[Any, ...]) -> int:
        ctx = StepContext(inputs=None, targets=None, scale=1.0, training=True)
        fused = 0
        for index, instr in enumerate(instrs):
            if type(instr) is Compute and instr.kind is Kind.F:
                self.ran[(instr.chunk, instr.mb)] = self.device.main
            elif type(instr) is Fused:
                fused += 1
                self.one(ctx, index, instr)
        return fused

    def one(self, ctx: StepContext, index: int, instr: Fused) -> None:
        halves = (
            ComputeStep(index, instr.forward, UNIT),
            ComputeStep(index, instr.backward, UNIT),
        )
        halves[1].run = self.backward
        self.expected = self.ran.get(halves[1].key, self.device.main)
        self.fused.run(ctx, FusedStep(index, instr, halves, None))
        if self.ran[halves[0].key] is self.expected:
            self.wrong.append(f"{instr.label()}: both halves on {self.expected}")


def _programs() -> Iterator[tuple[str, int, int, Program]]:
    """Every bundled schedule's programs with fused ops, at P = 1, 2, 4, 8."""
    for name in bundled_schedules():
        for ranks, microbatches in ((1, 6), (2, 8), (4, 16), (8, 32)):
            try:
                program = compile_schedule(name, ranks=ranks, microbatches=microbatches)
            except PipeccError:
                continue  # the schedule does not take this P and M
            if any(type(i) is Fused for ops in program.ranks for i in ops):
                yield name, ranks, microbatches, program


def _walk(program: Program, rule: type[TwoStreams]) -> tuple[int, list[str]]:
    fused, wrong = 0, []
    for instrs in program.ranks:
        device = Device()
        walk = Walk(device, rule(device.side, lambda d=device: d.now, device.use))
        fused += walk.rank(tuple(instrs))
        wrong += walk.wrong
    return fused, wrong


PROGRAMS = list(_programs())


def test_every_bundled_schedule_with_fused_ops_is_walked() -> None:
    names = {name for name, *_ in PROGRAMS}
    assert {"dualpipe", "dualpipev"} <= names
    assert {(n, p) for n, p, *_ in PROGRAMS} >= {("dualpipev", 1), ("dualpipe", 4)}


@pytest.mark.parametrize(("name", "ranks", "microbatches", "program"), PROGRAMS,
                         ids=[f"{n}-P{p}-M{m}" for n, p, m, _ in PROGRAMS])  # fmt: skip
def test_the_halves_of_each_fused_op_run_on_different_streams(
    name: str, ranks: int, microbatches: int, program: Program
) -> None:
    fused, wrong = _walk(program, TwoStreams)
    assert fused > 0
    assert wrong == []


def test_the_old_rule_puts_most_halves_on_one_stream() -> None:
    """The check sees the defect: with every fused forward on the side stream, a backward
    half whose forward was itself fused runs behind the new forward (the review's counts)."""
    found = {}
    for name, ranks, microbatches in (("dualpipev", 1, 6), ("dualpipev", 8, 32)):
        program = compile_schedule(name, ranks=ranks, microbatches=microbatches)
        fused, wrong = _walk(program, AlwaysSide)
        found[(name, ranks)] = (sum("both halves" in w for w in wrong), fused)
    assert found == {("dualpipev", 1): (7, 9), ("dualpipev", 8): (227, 355)}


def test_the_streams_join_and_what_the_halves_read_lives_until_then() -> None:
    device = Device()
    streams = device.streams()
    alive: dict[str, bool] = {}
    refs: dict[str, weakref.ref[torch.Tensor]] = {}

    def join_checked(other: Stream) -> None:
        gc.collect()
        alive.update({name: ref() is not None for name, ref in refs.items()})
        device.log.append(f"main waits {other.name}")

    cast(Any, device.main).wait_stream = join_checked

    def forward(ctx: StepContext, op: ComputeStep) -> None:
        (taken,) = ctx.mail[op.src] or ()
        ctx.mail[op.src] = None
        del taken  # a no-grad input nothing saves: only the hold keeps it

    def backward(ctx: StepContext, op: ComputeStep) -> None:
        ctx.saved.pop(op.key)
        ctx.mail[op.src] = None

    ops = SimpleNamespace(chunks={}, recompute=frozenset(), forward=forward)
    fused = FusedOps(cast(Any, ops), torch.device("cpu"), streams)
    ctx = StepContext(inputs=None, targets=None, scale=1.0, training=True)
    tensors = {name: torch.ones(2) for name in ("input", "grad", "saved_input", "saved_output")}
    refs.update({name: weakref.ref(t) for name, t in tensors.items()})
    ctx.mail = [(tensors.pop("input"),), (tensors.pop("grad"),)]
    ctx.saved[(0, 0)] = Saved((tensors.pop("saved_input"),), (tensors.pop("saved_output"),))
    f, b = Compute(Kind.F, 1, 0, 1, 1), Compute(Kind.B, 0, 0, 0, 0)
    halves = (ComputeStep(0, f, UNIT), ComputeStep(0, b, UNIT))
    halves[0].src, halves[1].src = 0, 1
    halves[1].run = backward
    fused.run(ctx, FusedStep(0, Fused(f, b), halves, None))
    assert device.log == ["side waits main", "main waits side"]
    assert alive == dict.fromkeys(refs, True)
    gc.collect()
    assert [name for name, ref in refs.items() if ref() is not None] == []
