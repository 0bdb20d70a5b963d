"""The interpreter: walks this rank's bound plan and hands each step to the part that runs it.

One loop walks the plan bound to the step's shape signature (runtime/engine/bound.py: every
instruction resolved once into a step, runtime/engine/steps.py) in order and hands each step
to the part that executes it: a compute step to `StageOps` (F, B, I, W;
runtime/engine/compute.py), a fused one to `FusedOps` (runtime/engine/fused.py), a sequential
one (torch's OVERLAP_F_B) part by part, a send or receive and a wait to `Transfers`
(runtime/engine/transfers.py), torch's per-stage actions to runtime/engine/stage_actions.py,
a collective (the gradient sum of shared parameters) to `GradientSums`
(runtime/comm/shared.py), a MoE stage's phase and all-to-all to `MoEOps`
(runtime/engine/moe_ops.py). It contains no schedule-specific code: 1F1B, ZB-H1 and DualPipe
differ only in their programs. The step's signature is settled before the plan runs
(runtime/pipeline.py), so a plan runs from its first step to its last. An exception inside
an instruction (the user's module or loss, or a bug) becomes an `InstructionError`: a
`RankError` whose one-line message names the rank, the step, the instruction index and the
instruction, raised from the exception, which keeps its full traceback (`details()`;
`pipecc run` prints it under the line). A pipecc error raised there (a stage output that
does not match the next stage's input, a loss that is not a scalar) keeps its kind and gets
the same prefix, and no traceback: it is one message. The text is built only then.

While a torch profiler records (`torch.profiler.profile`, read once per step), every step
runs under `torch.profiler.record_function` with its instruction's label (`F0.3`, `I1.2`,
`send act s1.3→r1`, made once when the plan is bound, runtime/engine/steps.py), so the
trace shows the program; otherwise the loop is the plain one (no cost per instruction). The
host time spent in waits is added up per step (`waited`: `PipelineRuntime.last_step`).

How to hook in (torch.fx's `Interpreter` shape): every step calls one method of the
interpreter for its kind, and a subclass overrides those it cares about, calling `super()`:

    Interpreter.run(bound, ctx)        one step of the program: `walk` over the bound plan
      walk(steps, ctx)                 each step in order; errors named here
        compute(ctx, step)             F, B, I, W; F&B and F&I; torch's OVERLAP_F_B
        post(ctx, step)                a send or receive (its group posted at its end)
        wait(ctx, step)                a wait on posted ops
        stage_op(step)                 torch's UNSHARD, RESHARD, REDUCE_GRAD
        reduce(ctx, step)              a collective over mesh dimensions
        phase(ctx, step)               one phase of a MoE stage's F, B or I
        all_to_all(ctx, step)          an expert-parallel dispatch or combine (over ep)
        collective(instr)              the shared-parameter gradient sum

A subclass wraps a complete interpreter, built by the runtime, and shares its parts
(`Parts`: the stage ops, fused ops, transfers, sums and mesh), so nothing is set on it
afterwards and a part added later reaches every subclass:

    class Counting(Interpreter):
        def __init__(self, base: Interpreter) -> None:
            super().__init__(base.parts)
            self.computed = 0

        def compute(self, ctx, step):
            self.computed += 1
            super().compute(ctx, step)

    runtime.step(x, y, through=Counting)

`ProfilingInterpreter` (runtime/profiling/profiler.py) times every step this way, and
`ByteProfilingInterpreter` (runtime/profiling/memory.py) measures each op's bytes.
"""

from __future__ import annotations

import time
import traceback
from typing import NamedTuple

import torch

from pipecc.diagnostics import PipeccError, RankError
from pipecc.ir.ops import Collective

from ..comm.mesh import DataParallel
from ..comm.shared import GradientSums
from ..compat import profiler_enabled
from .compute import StageOps
from .context import StepContext
from .fused import FusedOps
from .moe_ops import MoEOps
from .stage_actions import run_stage_op
from .steps import (
    AllToAllStep,
    Bound,
    ComputeStep,
    FusedStep,
    PhaseStep,
    PostStep,
    ReduceStep,
    SequentialStep,
    StageStep,
    Step,
    WaitStep,
    where,
)
from .transfers import Transfers


class InstructionError(RankError):
    """An exception that is no pipecc error, raised by what an instruction ran (the user's
    module, loss or hook, or a bug); it is this error's `__cause__`, with its traceback."""

    def details(self) -> str:
        """The message, then the cause's full traceback (the frames of the user's code)."""
        cause = self.__cause__
        if cause is None:
            return self.message
        return self.message + "\n" + "".join(traceback.format_exception(cause)).rstrip()


class Parts(NamedTuple):
    """What an interpreter dispatches to: this rank's compute primitives (`stage`), fused
    ops, transfers, the shared-parameter gradient sums and the data-parallel reductions
    over mesh dimensions (None: the program has none)."""

    rank: int
    stage: StageOps
    fused: FusedOps
    transfers: Transfers
    sums: GradientSums | None = None
    mesh: DataParallel | None = None
    moe: MoEOps | None = None  # the MoE stages' phases and all-to-alls (none: no MoE stage)


class Interpreter:
    """Runs a bound plan on one rank against a step's context (module docstring: the map)."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.rank, self.stage, self.fused, self.transfers, self.sums, self.mesh = parts[:6]
        self.moe = parts.moe
        self.waited = 0.0  # host seconds in this step's waits

    def run(self, bound: Bound, ctx: StepContext) -> None:
        """One step: `bound` (the signature's training or forward-only plan) against `ctx`,
        whose mailbox was made for it."""
        self.transfers.begin()
        if self.moe is not None:
            self.moe.begin()
        self.waited = 0.0
        if profiler_enabled():
            self.walk_labelled(bound.steps, ctx)
        else:
            self.walk(bound.steps, ctx)

    def walk_labelled(self, steps: tuple[Step, ...], ctx: StepContext) -> None:
        """`walk`, each step under `record_function` with its label (a profiler records)."""
        for step in steps:
            with torch.profiler.record_function(step.label):
                self.walk((step,), ctx)

    def leftovers(self, ctx: StepContext) -> list[str]:
        """What a complete program would have consumed by the end of the step."""
        found = self.transfers.posts.leftovers() + ctx.leftovers()
        return found + (self.moe.leftovers() if self.moe is not None else [])

    def walk(self, steps: tuple[Step, ...], ctx: StepContext) -> None:
        for step in steps:
            try:
                step.go(self, ctx)
            except PipeccError as err:  # named where it happened, unless it says already
                if not err.message.startswith("rank "):
                    err.message = f"{self.where(ctx, step)}: {err.message}"
                    err.args = (err.message,)
                raise
            except Exception as err:
                raise InstructionError(
                    self.where(ctx, step) + f": {type(err).__name__}: {err}"
                ) from err

    def compute(self, ctx: StepContext, step: ComputeStep | FusedStep | SequentialStep) -> None:
        if type(step) is ComputeStep:
            step.run(ctx, step)
        elif type(step) is FusedStep:
            self.fused.run(ctx, step)
        else:  # torch's OVERLAP_F_B: its parts in the order written
            assert isinstance(step, SequentialStep)
            for part in step.parts:
                self.compute(ctx, part)

    def post(self, ctx: StepContext, step: PostStep) -> None:
        self.transfers.post(ctx, step)
        if step.commit:
            self.transfers.commit()

    def wait(self, ctx: StepContext, step: WaitStep) -> None:
        start = time.perf_counter()
        self.transfers.wait(ctx, step, self.rank)
        self.waited += time.perf_counter() - start

    def stage_op(self, step: StageStep) -> None:
        """torch's UNSHARD & co.: FSDP stages only (runtime/engine/stage_actions.py)."""
        run_stage_op(step.module, step.action)

    def collective(self, instr: Collective) -> None:
        """The program's gradient sum over the holders of a parameter
        (runtime/comm/shared.py)."""
        assert self.sums is not None  # bound with the runtime's sums whenever a plan runs
        self.sums.run(instr)

    def reduce(self, ctx: StepContext, step: ReduceStep) -> None:
        """A data-parallel reduction over mesh dimensions (runtime/comm/mesh.py): posted,
        and completed here when blocking, at the `wait` that lists it when async."""
        assert self.mesh is not None and isinstance(step.instr, Collective)
        works = self.mesh.post(step.index, step.instr)
        if step.instr.asynchronous:
            self.transfers.hold(step.index, works)
        else:
            for work in works:
                work.wait()

    def phase(self, ctx: StepContext, step: PhaseStep) -> None:
        """One phase of a MoE stage's F, B or I (runtime/engine/moe_ops.py)."""
        assert self.moe is not None  # bound only for a program with phases
        self.moe.phase(ctx, step)

    def all_to_all(self, ctx: StepContext, step: AllToAllStep) -> None:
        """An expert-parallel all-to-all: posted, and completed here when blocking, at the
        `wait` that lists it when async (as `reduce`)."""
        assert self.moe is not None and isinstance(step.instr, Collective)
        works = self.moe.post(ctx, step)
        if step.instr.asynchronous:
            self.transfers.hold(step.index, works)
        else:
            for work in works:
                work.wait()

    def where(self, ctx: StepContext, step: Step) -> str:
        """The rank, the step and the instruction, for errors."""
        return where(self.rank, ctx.step, step.index, step.instr)
