"""The compute primitives of one rank: forward, backward (B), input backward (I), weight (W).

`StageOps` runs one compute instruction of one (chunk, microbatch) against the step's
`StepContext`: a forward takes its inputs (the step's inputs on stage 0, the mailbox
elsewhere), leaves its outputs for the next stage and what its backward needs; a backward
takes the output gradients from the mailbox (ones of the scaled loss on a last stage) and
leaves the input gradients for the previous stage. Stage inputs are detached leaves, so each
(chunk, microbatch) has its own autograd graph from its input to its output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipecc.diagnostics import InputError, ProgramError, SetupError
from pipecc.ir.keys import Message
from pipecc.ir.ops import Compute, Kind, Msg
from pipecc.ir.printer import message

from .config import LossFn
from .context import MessageKey, Saved, StepContext, Tensors, unwrap
from .setup import Chunk
from .specs import Specs, TensorSpec, as_tuple, describe_specs
from .split_backward import full_backward, input_backward


class StageOps:
    """The compute primitives over this rank's chunks."""

    def __init__(
        self, rank: int, chunks: dict[int, Chunk], boundaries: dict[int, Specs], loss_fn: LossFn
    ) -> None:
        self.rank = rank
        self.chunks = chunks
        self.boundaries = boundaries
        self.loss_fn = loss_fn

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
        inputs = self.stage_inputs(ctx, op)
        outputs = as_tuple(chunk.module(*inputs), op.stage)
        if chunk.last:
            outputs = self.loss(ctx, op.mb, outputs)
        else:
            self.hand_on(ctx, op, outputs)
        if ctx.training:
            ctx.saved[(op.chunk, op.mb)] = Saved(inputs, outputs)

    def backward(self, ctx: StepContext, op: Compute) -> None:
        saved = ctx.saved.pop((op.chunk, op.mb))
        outputs, grads = self.output_grads(ctx, op, saved)
        self.hand_back(ctx, op, saved.inputs, full_backward(outputs, grads, saved.inputs))

    def backward_input(self, ctx: StepContext, op: Compute) -> None:
        saved = ctx.saved.pop((op.chunk, op.mb))
        outputs, grads = self.output_grads(ctx, op, saved)
        params = self.chunks[op.chunk].params
        input_grads, weight = input_backward(outputs, grads, saved.inputs, params)
        ctx.weights[(op.chunk, op.mb)] = weight
        self.hand_back(ctx, op, saved.inputs, input_grads)

    def weight(self, ctx: StepContext, op: Compute) -> None:
        ctx.weights.pop((op.chunk, op.mb)).run()

    # ---- tensors in and out of a stage -----------------------------------------------------

    def stage_inputs(self, ctx: StepContext, op: Compute) -> Tensors:
        """A forward's inputs: detached leaves of this stage's graph when training."""
        chunk = self.chunks[op.chunk]
        if chunk.first:
            if ctx.inputs is None:
                raise InputError(f"rank {self.rank} holds stage 0 and needs the step's inputs")
            return ctx.inputs[op.mb]
        inputs = take(ctx, (Msg.ACT, op.pipe, op.stage, op.mb))
        return tuple(_leaf(t) for t in inputs) if ctx.training else inputs

    def target(self, ctx: StepContext, mb: int) -> Tensors:
        if ctx.targets is None:
            raise InputError(f"rank {self.rank} holds a last stage and needs the step's targets")
        return ctx.targets[mb]

    def loss(self, ctx: StepContext, mb: int, outputs: Tensors) -> Tensors:
        """On a last stage: record the microbatch's loss; a backward starts from loss/M."""
        if not ctx.training:
            ctx.outputs[mb] = tuple(o.detach() for o in outputs)
            if ctx.targets is None:
                return ()
        loss = self.loss_fn(unwrap(outputs), unwrap(self.target(ctx, mb)))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise InputError(f"the loss function must return a scalar tensor, got {loss!r}")
        ctx.losses[mb] = loss.detach()
        return (loss * ctx.scale,)

    def hand_on(self, ctx: StepContext, op: Compute, outputs: Tensors) -> None:
        """Leave a forward's outputs for the next stage (a send, or a local forward)."""
        expected = self.boundaries.get(op.stage + 1)
        got = tuple(TensorSpec(tuple(o.shape), o.dtype) for o in outputs)
        if expected is not None and got != expected:
            raise SetupError(
                f"{describe_op(op)} returned {describe_specs(got)}, but stage "
                f"{op.stage + 1} takes {describe_specs(expected)}"
            )
        ctx.mail[(Msg.ACT, op.pipe, op.stage + 1, op.mb)] = tuple(o.detach() for o in outputs)

    def output_grads(self, ctx: StepContext, op: Compute, saved: Saved) -> tuple[Tensors, Tensors]:
        """The outputs a backward starts from, with their gradients."""
        if self.chunks[op.chunk].last:
            return saved.outputs, tuple(torch.ones_like(o) for o in saved.outputs)
        received = iter(take(ctx, (Msg.GRAD, op.pipe, op.stage, op.mb)))
        pairs = [(o, next(received)) for o in saved.outputs if is_floating(o)]
        live = [(o, g) for o, g in pairs if o.requires_grad]
        return tuple(o for o, _ in live), tuple(g for _, g in live)

    def hand_back(
        self, ctx: StepContext, op: Compute, inputs: Tensors, grads: Sequence[torch.Tensor | None]
    ) -> None:
        """Leave a backward's input gradients for the previous stage."""
        if op.stage == 0:
            return
        payload = tuple(
            g if g is not None else torch.zeros_like(x)
            for x, g in zip(inputs, grads, strict=True)
            if is_floating(x)
        )
        ctx.mail[(Msg.GRAD, op.pipe, op.stage - 1, op.mb)] = payload


def take(ctx: StepContext, key: MessageKey) -> Tensors:
    """Take a message's tensors out of the mailbox; absent is a wrong program."""
    found = ctx.mail.pop(key, None)
    if found is None:
        raise ProgramError(
            f"{message(Message(*key))} is not here: it was neither "
            "produced on this rank nor received by a completed wait before this instruction"
        )
    return found


def describe_op(op: Compute) -> str:
    return f"{op.kind.value}{op.chunk}.{op.mb} (stage {op.stage} of pipe {op.pipe})"


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    """A stage input as a leaf of this stage's graph (its gradient goes upstream)."""
    if is_floating(tensor):
        return tensor.detach().requires_grad_(True)
    return tensor


def is_floating(tensor: torch.Tensor) -> bool:
    return tensor.dtype.is_floating_point or tensor.dtype.is_complex
