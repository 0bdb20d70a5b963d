"""The compute primitives of one rank: forward, backward (B), input backward (I), weight (W).

`StageOps` runs one compute instruction of one (chunk, microbatch) against the step's
`StepContext`: a forward takes its inputs (the step's inputs on stage 0, the mailbox
elsewhere, rebuilt into the stage's pytree), leaves the tensors of its outputs for the next
stage and what its backward needs; a backward takes the output gradients from the mailbox
(ones of the scaled loss on a last stage) and leaves the input gradients for the previous
stage. Stage inputs are detached leaves, so each (chunk, microbatch) has its own autograd
graph from its input to its output. Only tensors that carry a gradient (runtime/boundaries/trees.py)
get one: the boundary of the stage says which, on both sides alike.

Each forward runs under the RNG state derived for its (step, stage, microbatch)
(runtime/engine/rng.py) and, when configured, under `torch.autocast`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from pipecc.diagnostics import InputError, ProgramError, SetupError
from pipecc.ir.keys import Message, consumed, produced
from pipecc.ir.ops import Compute, Kind
from pipecc.ir.printer import describe, message

from ..boundaries.specs import autocast_context
from ..boundaries.trees import Boundary, call, flatten, unwrap
from ..config import LossFn
from ..plan.binding import Chunk
from .context import Saved, StepContext, Tensors
from .precision import Fp32Grads
from .rng import ForwardRng
from .split_backward import full_backward, input_backward
from .weight_contract import capturing


class StageOps:
    """The compute primitives over this rank's chunks."""

    def __init__(
        self,
        rank: int,
        chunks: dict[int, Chunk],
        loss_fn: LossFn,
        rng: ForwardRng,
        autocast: tuple[torch.device, torch.dtype | None],
    ) -> None:
        self.rank = rank
        self.chunks = chunks
        self.boundaries: dict[int, Boundary] = {}  # this step's, set by the runtime
        self.loss_fn = loss_fn
        self.rng = rng
        self.autocast_device, self.autocast_dtype = autocast
        self.precision: Fp32Grads | None = None
        self.split: frozenset[int] = frozenset()  # chunks with I ops: forwards captured for W

    def run(self, ctx: StepContext, op: Compute) -> None:
        """One compute instruction, by kind."""
        match op.kind:
            case Kind.F:
                self.forward(ctx, op)
            case Kind.B:
                self.backward(ctx, op)
            case Kind.I:
                self.backward_input(ctx, op)
            case Kind.W:
                self.weight(ctx, op)

    def forward(self, ctx: StepContext, op: Compute) -> None:
        chunk = self.chunks[op.chunk]
        value, inputs = self.stage_inputs(ctx, op)
        self.rng.seed(ctx.step, op.stage, op.mb)
        captured = ctx.training and op.chunk in self.split
        with self.autocast():
            with capturing(chunk.module) if captured else contextlib.nullcontext():
                output = call(chunk.module, value)
            outputs = self.loss(ctx, op.mb, output) if chunk.last else None
        if outputs is None:
            outputs = self.hand_on(ctx, op, output)
        if ctx.training:
            ctx.saved[(op.chunk, op.mb)] = Saved(inputs, outputs)

    def backward(self, ctx: StepContext, op: Compute) -> None:
        saved = ctx.saved.pop((op.chunk, op.mb))
        outputs, grads = self.output_grads(ctx, op, saved)
        self.hand_back(ctx, op, saved.inputs, full_backward(outputs, grads, saved.inputs))
        self.drain(op.chunk)

    def backward_input(self, ctx: StepContext, op: Compute) -> None:
        saved = ctx.saved.pop((op.chunk, op.mb))
        outputs, grads = self.output_grads(ctx, op, saved)
        params = self.chunks[op.chunk].params
        input_grads, weight = input_backward(outputs, grads, saved.inputs, params)
        ctx.weights[(op.chunk, op.mb)] = weight
        self.hand_back(ctx, op, saved.inputs, input_grads)
        self.drain(op.chunk)  # by contract, I leaves the gradients of non-Linear parameters

    def weight(self, ctx: StepContext, op: Compute) -> None:
        ctx.weights.pop((op.chunk, op.mb)).run()
        self.drain(op.chunk)

    def drain(self, chunk: int) -> None:
        """With fp32 accumulation: move the chunk's new weight gradients into it."""
        if self.precision is not None:
            self.precision.drain(self.chunks[chunk].module.parameters())

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return autocast_context(self.autocast_device, self.autocast_dtype)

    # ---- tensors in and out of a stage -----------------------------------------------------

    def stage_inputs(self, ctx: StepContext, op: Compute) -> tuple[object, Tensors]:
        """A forward's input value, and its tensors that send a gradient back (detached
        leaves of this stage's graph when training)."""
        chunk = self.chunks[op.chunk]
        if chunk.first:
            if ctx.inputs is None:
                raise InputError(f"rank {self.rank} holds stage 0 and needs the step's inputs")
            return ctx.inputs[op.mb], ()
        tensors = take(ctx, consumed(op.kind, op.pipe, op.stage, op.mb))
        boundary = self.boundaries.get(op.stage)
        carries = _carries(boundary, tensors)
        if ctx.training:
            tensors = tuple(
                t.detach().requires_grad_(True) if c else t
                for t, c in zip(tensors, carries, strict=True)
            )
        value = boundary.rebuild(tensors) if boundary is not None else tensors
        grads_back = tuple(t for t, c in zip(tensors, carries, strict=True) if c)
        return value, grads_back if ctx.training else ()

    def target(self, ctx: StepContext, mb: int) -> object:
        if ctx.targets is None:
            raise InputError(f"rank {self.rank} holds a last stage and needs the step's targets")
        return ctx.targets[mb]

    def loss(self, ctx: StepContext, mb: int, output: object) -> Tensors:
        """On a last stage: record the microbatch's loss; a backward starts from loss/M."""
        if not ctx.training:
            ctx.outputs[mb] = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, output)
            if ctx.targets is None:
                return ()
        loss = self.loss_fn(unwrap(output), unwrap(self.target(ctx, mb)))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = (
                f"a tensor of shape {list(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else f"{loss!r}"[:80]
            )
            raise InputError(f"the loss function must return a scalar tensor, got {got}")
        ctx.losses[mb] = loss.detach().clone()  # a loss's storage may be a whole batch's
        return (loss * ctx.scale,)

    def hand_on(self, ctx: StepContext, op: Compute, output: object) -> Tensors:
        """Leave a forward's output tensors for the next stage (a send, or a local forward);
        return those a gradient comes back for."""
        tensors, got = flatten(output, f"the output of {describe(op, places=True)}")
        expected = self.boundaries.get(op.stage + 1)
        if expected is not None:
            check_output(op, got, expected, training=ctx.training)
        ctx.mail[produced(op.kind, op.pipe, op.stage, op.mb)] = tuple(t.detach() for t in tensors)
        carries = _carries(expected or got, tuple(tensors))
        return tuple(t for t, c in zip(tensors, carries, strict=True) if c)

    def output_grads(self, ctx: StepContext, op: Compute, saved: Saved) -> tuple[Tensors, Tensors]:
        """The outputs a backward starts from, with their gradients."""
        if self.chunks[op.chunk].last:
            return saved.outputs, tuple(torch.ones_like(o) for o in saved.outputs)
        received = take(ctx, consumed(op.kind, op.pipe, op.stage, op.mb))
        live = [(o, g) for o, g in zip(saved.outputs, received, strict=True) if o.requires_grad]
        return tuple(o for o, _ in live), tuple(g for _, g in live)

    def hand_back(
        self, ctx: StepContext, op: Compute, inputs: Tensors, grads: Sequence[torch.Tensor | None]
    ) -> None:
        """Leave a backward's input gradients for the previous stage."""
        if op.stage == 0:
            return
        payload = tuple(
            g if g is not None else torch.zeros_like(x) for x, g in zip(inputs, grads, strict=True)
        )
        ctx.mail[produced(op.kind, op.pipe, op.stage, op.mb)] = payload


def check_output(op: Compute, got: Boundary, expected: Boundary, *, training: bool) -> None:
    """A stage's output must be the next stage's input: same leaves, and (training) no
    tensor that needs a gradient where the boundary sends none back."""
    lost = training and any(
        bool(g.grad) and not e.carries_grad
        for g, e in zip(got.tensors, expected.tensors, strict=False)
    )
    if not got.same_as(expected, grads=False) or lost:
        raise SetupError(
            f"{describe(op, places=True)} returned {got.describe()}, but stage "
            f"{op.stage + 1} takes {expected.describe()}"
            + (" (a tensor that needs a gradient would get none back)" if lost else "")
        )


def _carries(boundary: Boundary | None, tensors: Tensors) -> tuple[bool, ...]:
    """Which of a message's tensors carry a gradient back: as its boundary says, else the
    floating ones."""
    if boundary is not None and len(boundary.tensors) == len(tensors):
        return tuple(spec.carries_grad for spec in boundary.tensors)
    return tuple(t.dtype.is_floating_point or t.dtype.is_complex for t in tensors)


def take(ctx: StepContext, key: Message) -> Tensors:
    """Take a message's tensors out of the mailbox; absent is a wrong program."""
    found = ctx.mail.pop(key, None)
    if found is None:
        raise ProgramError(
            f"{message(key)} is not here: it was neither "
            "produced on this rank nor received by a completed wait before this instruction"
        )
    return found
