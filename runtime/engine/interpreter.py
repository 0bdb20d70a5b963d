"""The interpreter: walks this rank's instruction list and dispatches each instruction.

One loop walks the plan (runtime/plan/plan.py) in order and hands each instruction to the part
that executes it: a compute op to `StageOps` (F, B, I, W; runtime/engine/compute.py), a fused
op to `FusedOps` (runtime/engine/fused.py), a sequential one (torch's OVERLAP_F_B) part by
part, a send or receive and a wait to `Transfers` (runtime/engine/transfers.py), torch's
per-stage actions to runtime/engine/stage_actions.py, a collective (the gradient sum of shared
parameters) to `GradientSums` (runtime/comm/shared.py). It contains no schedule-specific
code: 1F1B, ZB-H1 and DualPipe differ only in their programs. An exception inside an
instruction (the user's module or loss, or a bug) becomes an `InstructionError`: a `RankError`
whose one-line message names the rank, the step, the instruction index and the instruction,
raised from the exception, which keeps its full traceback (`details()`; `pipecc run` prints it
under the line). A pipecc error raised there (a stage output that does not match the next
stage's input, a loss that is not a scalar) keeps its kind and gets the same prefix, and no
traceback: it is one message.

Subclasses change what happens around an instruction by overriding `compute`, `post`, `wait`
and `collective`: `ProfilingInterpreter` (runtime/profiling/profiler.py) times them.
"""

from __future__ import annotations

import traceback

from pipecc.diagnostics import PipeccError, RankError
from pipecc.ir.ops import Collective, Compute, Fused, Instr, Recv, Send, Sequential, StageOp, Wait
from pipecc.ir.printer import describe

from ..comm.shared import GradientSums
from ..plan.plan import Plan
from .compute import StageOps
from .context import StepContext
from .fused import FusedOps
from .stage_actions import run_stage_op
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


class Interpreter:
    """Runs a plan on one rank against a step's context."""

    def __init__(
        self,
        rank: int,
        stage: StageOps,
        fused: FusedOps,
        transfers: Transfers,
        sums: GradientSums | None = None,
    ) -> None:
        self.rank = rank
        self.stage = stage
        self.fused = fused
        self.transfers = transfers
        self.sums = sums

    def run(self, plan: Plan, ctx: StepContext) -> None:
        for index, instr, commit in plan:
            try:
                self.dispatch(ctx, index, instr, commit)
            except PipeccError as err:  # named where it happened, unless it says already
                if not err.message.startswith("rank "):
                    err.message = f"{self.where(ctx, index, instr)}: {err.message}"
                    err.args = (err.message,)
                raise
            except Exception as err:
                raise InstructionError(
                    self.where(ctx, index, instr) + f": {type(err).__name__}: {err}"
                ) from err

    def dispatch(self, ctx: StepContext, index: int, instr: Instr, commit: bool) -> None:
        match instr:
            case Compute() | Fused() | Sequential():
                self.compute(ctx, instr)
            case Send() | Recv():
                self.post(ctx, index, instr, commit)
            case Wait():
                self.wait(ctx, index, instr)
            case StageOp():  # torch's UNSHARD & co.: FSDP stages only (stage_ops.py)
                chunk = self.stage.chunks.get(instr.chunk)
                run_stage_op(chunk.module if chunk is not None else None, instr)
            case Collective():
                self.collective(instr)
            case _:
                raise AssertionError(f"unknown instruction {instr!r}")

    def compute(self, ctx: StepContext, instr: Compute | Fused | Sequential) -> None:
        if isinstance(instr, Sequential):  # torch's OVERLAP_F_B: its parts in the order written
            for part in instr.parts:
                self.compute(ctx, part)
        elif isinstance(instr, Fused):
            self.fused.run(ctx, instr)
        else:
            self.stage.run(ctx, instr)

    def post(self, ctx: StepContext, index: int, instr: Send | Recv, commit: bool) -> None:
        self.transfers.post(ctx, index, instr, commit)

    def wait(self, ctx: StepContext, index: int, instr: Wait) -> None:
        self.transfers.wait(ctx, self.where(ctx, index, instr), instr)

    def collective(self, instr: Collective) -> None:
        """The program's gradient sum over the holders of a parameter
        (runtime/comm/shared.py)."""
        assert self.sums is not None  # bound with the runtime's sums whenever a plan runs
        self.sums.run(instr)

    def where(self, ctx: StepContext, index: int, instr: Instr) -> str:
        """The rank, the step and the instruction, for errors."""
        return f"rank {self.rank}, step {ctx.step}: instruction {index} ({describe(instr)})"
