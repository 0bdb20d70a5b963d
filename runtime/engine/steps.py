"""The steps of a bound plan: each instruction of a rank with everything it needs resolved.

A step is built once per shape signature (runtime/engine/bound.py) and run at every training
step with that signature. It holds what the instruction would otherwise look up or compute
each time: its chunk, its mailbox slots (integers: `StepContext.mail` is a list), the
boundary it rebuilds its input with and the one its output must match, the split-backward
method of its chunk, its group-commit flag, and for a receive the buffers it receives into
(allocated once per signature). `go` hands the step to the interpreter's method for its kind,
so an interpreter subclass (the profiler) sees every step as the plain one does.

Nothing on this path formats text: `where` builds an instruction's name only when an error
is reported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from pipecc.ir.keys import Message
from pipecc.ir.ops import (
    Collective,
    Compute,
    Fused,
    Instr,
    Phase,
    Recv,
    Send,
    Sequential,
    StageOp,
    Wait,
)
from pipecc.ir.printer import describe

from ..boundaries.trees import Boundary
from ..plan.binding import Chunk
from .context import StepContext
from .weight_contract import Capture

Tensors = tuple[torch.Tensor, ...]


class Runner(Protocol):
    """What runs the steps (`Interpreter` and its subclasses)."""

    def compute(self, ctx: StepContext, step: ComputeStep | FusedStep | SequentialStep) -> None:
        """A compute step."""

    def post(self, ctx: StepContext, step: PostStep) -> None:
        """A send or a receive."""

    def wait(self, ctx: StepContext, step: WaitStep) -> None:
        """A wait."""

    def stage_op(self, step: StageStep) -> None:
        """torch's UNSHARD, RESHARD, REDUCE_GRAD."""

    def reduce(self, ctx: StepContext, step: ReduceStep) -> None:
        """A collective over mesh dimensions (a data-parallel reduction)."""

    def collective(self, instr: Collective) -> None:
        """A collective (the shared-parameter gradient sum)."""

    def phase(self, ctx: StepContext, step: PhaseStep) -> None:
        """One phase of a MoE stage's F, B or I (runtime/engine/moe_ops.py)."""

    def all_to_all(self, ctx: StepContext, step: AllToAllStep) -> None:
        """An expert-parallel all-to-all over `ep` (runtime/engine/moe_ops.py)."""


class Step:
    """One instruction of the plan: its index in the rank's list, the instruction, and its
    label (`F0.3`, `send act s1.3→r1`: the IR's `label()`, made once here), the name a torch
    profiler's trace shows it under (runtime/engine/interpreter.py)."""

    __slots__ = ("index", "instr", "label")

    def __init__(self, index: int, instr: Instr) -> None:
        self.index = index
        self.instr = instr
        self.label = instr.label()

    def go(self, runner: Runner, ctx: StepContext) -> None:
        raise NotImplementedError


class ComputeStep(Step):
    """F, B, I or W of one (chunk, mb): `run` is the `StageOps` method of its kind."""

    __slots__ = (
        "kind", "chunk", "pipe", "stage", "mb", "unit", "key", "src", "dst", "run",
        "given", "carries", "rebuild", "expected", "out_carries", "checked", "capture",
    )  # fmt: skip

    def __init__(self, index: int, op: Compute, unit: Chunk) -> None:
        super().__init__(index, op)
        self.kind, self.chunk, self.pipe, self.stage, self.mb = op[:5]
        self.unit = unit
        self.key = (op.chunk, op.mb)  # what a forward saves for its backward, and I for W
        self.src = -1  # the mailbox slot it takes its input (F) or output gradient (B, I) from
        self.dst = -1  # the slot it leaves its output (F) or input gradient (B, I) in
        self.run: Callable[[StepContext, ComputeStep], None] = _unbound
        self.given: Boundary | None = None  # F: its input's boundary
        self.carries: tuple[bool, ...] | None = None  # F: which input tensors carry a gradient
        self.rebuild: Callable[[Tensors], object] = _as_is  # F: the input value from tensors
        self.expected: Boundary | None = None  # F (not last): the next stage's input
        self.out_carries: tuple[bool, ...] | None = None  # F: which outputs get a gradient
        self.checked = False  # F: its output was validated against `expected` in full
        self.capture: Capture | None = None  # F, I: the contract method's capture

    @property
    def op(self) -> Compute:
        assert isinstance(self.instr, Compute)
        return self.instr

    def go(self, runner: Runner, ctx: StepContext) -> None:
        runner.compute(ctx, self)


class FusedStep(Step):
    """F&B or F&I: its two halves, and the user's overlap hook when it applies."""

    __slots__ = ("forward", "backward", "hook")

    def __init__(
        self,
        index: int,
        instr: Fused,
        halves: tuple[ComputeStep, ComputeStep],
        hook: Callable[..., tuple[Any, Any]] | None,
    ) -> None:
        super().__init__(index, instr)
        self.forward, self.backward = halves
        self.hook = hook

    def go(self, runner: Runner, ctx: StepContext) -> None:
        runner.compute(ctx, self)


class SequentialStep(Step):
    """torch's OVERLAP_F_B: its parts, one after another."""

    __slots__ = ("parts",)

    def __init__(self, index: int, instr: Sequential, parts: tuple[ComputeStep, ...]) -> None:
        super().__init__(index, instr)
        self.parts = parts

    def go(self, runner: Runner, ctx: StepContext) -> None:
        runner.compute(ctx, self)


class PostStep(Step):
    """A send or a receive: its message's slot, whether its group is posted after it, and
    its point-to-point ops (a receive's over its buffers, made once; a send's reused, each
    given the step's tensor when it is posted)."""

    __slots__ = ("comm", "send", "slot", "commit", "ops", "buffers")

    def __init__(self, index: int, instr: Send | Recv, slot: int, commit: bool) -> None:
        super().__init__(index, instr)
        self.comm = instr
        self.send = type(instr) is Send
        self.slot = slot
        self.commit = commit
        self.ops: list[dist.P2POp] = []
        self.buffers: Tensors | None = None  # a receive's, None where no boundary says them

    @property
    def peer(self) -> int:
        return self.comm.peer

    def go(self, runner: Runner, ctx: StepContext) -> None:
        runner.post(ctx, self)


class WaitStep(Step):
    """A wait on the posted ops at `ops` (instruction indices)."""

    __slots__ = ("ops",)

    def __init__(self, index: int, instr: Wait) -> None:
        super().__init__(index, instr)
        self.ops = instr.ops

    def go(self, runner: Runner, ctx: StepContext) -> None:
        runner.wait(ctx, self)


class StageStep(Step):
    """torch's per-stage action on its chunk's module (None: this rank lacks it)."""

    __slots__ = ("action", "module")

    def __init__(self, index: int, instr: StageOp, module: torch.nn.Module | None) -> None:
        super().__init__(index, instr)
        self.action = instr
        self.module = module

    def go(self, runner: Runner, ctx: StepContext) -> None:
        runner.stage_op(self)


class CollectiveStep(Step):
    """A collective of the program."""

    __slots__ = ()

    def go(self, runner: Runner, ctx: StepContext) -> None:
        assert isinstance(self.instr, Collective)
        runner.collective(self.instr)


class ReduceStep(Step):
    """A collective over mesh dimensions (a data-parallel reduction, runtime/comm/mesh.py):
    posted here, completed here when blocking, at its `wait` when async."""

    __slots__ = ()

    def go(self, runner: Runner, ctx: StepContext) -> None:
        runner.reduce(ctx, self)


class PhaseStep(Step):
    """One phase of a MoE stage's F, B or I (`Phase`): `op` is its op bound as a compute
    step (mailbox slots, boundaries), which its first and last phases use."""

    __slots__ = ("op", "phase")

    def __init__(self, index: int, instr: Phase, op: ComputeStep) -> None:
        super().__init__(index, instr)
        self.phase = instr
        self.op = op

    def go(self, runner: Runner, ctx: StepContext) -> None:
        runner.phase(ctx, self)


class AllToAllStep(Step):
    """An expert-parallel all-to-all (`Collective(kind=ALL_TO_ALL)`): which direction of
    which MoE layer of which (chunk, microbatch), parsed once from its `what`."""

    __slots__ = ("direction", "key", "layer")

    def __init__(
        self, index: int, instr: Collective, direction: str, layer: int, key: tuple[int, int]
    ) -> None:
        super().__init__(index, instr)
        self.direction = direction  # dispatch, combine, combine-grad, dispatch-grad
        self.layer = layer
        self.key = key

    def go(self, runner: Runner, ctx: StepContext) -> None:
        runner.all_to_all(ctx, self)


class Bound(NamedTuple):
    """A plan bound to one signature: its steps, and the message of each mailbox slot."""

    steps: tuple[Step, ...]
    messages: tuple[Message, ...]


def where(rank: int, step: int, index: int, instr: Instr) -> str:
    """The rank, the step and the instruction, for errors (built only when one is raised)."""
    return f"rank {rank}, step {step}: instruction {index} ({describe(instr)})"


def _unbound(ctx: StepContext, step: ComputeStep) -> None:
    raise AssertionError(f"step {step.index} was never bound")


def _as_is(tensors: Tensors) -> object:
    return tensors
