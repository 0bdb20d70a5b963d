"""The user's hook for fused F&B, in DualPipe's signature.

A stage module class may define

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0,
                                    module1, loss1, outputs1, output_grads1):
        ...  # forward module0 on inputs0 (and criterion0(*outputs0, *labels0) if given)
        ...  # while running the full backward of module1: loss1.backward() if loss1 is
        ...  # not None, else torch.autograd.backward(outputs1, output_grads1)
        return outputs0, loss0

The runtime calls it for every `F&B` whose two chunks have the same module class. `F&I` does
not use it: the signature has no way to ask for input gradients only, so the runtime runs
`F&I` as it runs `F&B` without a hook. `criterion0` returns the microbatch's loss already
scaled by 1/M, so that `loss1.backward()` inside the hook accumulates the mean over
microbatches, as the runtime's own backward does; `loss1` is scaled the same way.
Losses added inside the stages (`add_loss`, runtime/engine/aux_loss.py) are in what the
hook receives: `loss1` includes module1's (scaled by 1/M), `outputs1`/`output_grads1` end
with a middle stage's added loss and its seed 1/M, and the hook's forward of module0 is
collected like any forward. A step context reaches the hook's `module0(*inputs0)` call as
keywords (a forward pre-hook on module0).

`FusedOps` runs a fused step: through the hook when there is one (F&B only; found when the
plan is bound, runtime/engine/bound.py), else on CUDA the forward on a side stream
concurrently with the backward on the current one, else one after the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pipecc.diagnostics import ProgramError

from ..boundaries.trees import unwrap
from .aux_loss import collecting, scaled_roots
from .compute import StageOps, context_of, record_added
from .context import Saved, StepContext, Tensors
from .steps import ComputeStep, FusedStep
from .weight_contract import Capture, capturing

HOOK = "overlapped_forward_backward"
Hook = Callable[..., tuple[Any, Any]]


def find_hook(forward: torch.nn.Module, backward: torch.nn.Module) -> Hook | None:
    """The class hook, when both modules are of one class that defines it."""
    if type(forward) is not type(backward):
        return None
    hook = getattr(type(forward), HOOK, None)
    return hook if callable(hook) else None


class ScaledCriterion:
    """`criterion0` for the hook: the user's loss function, scaled by 1/M.

    Called as `criterion(*outputs, *labels)`; it remembers the unscaled loss for reporting.
    """

    def __init__(
        self, loss_fn: Callable[[Any, Any], torch.Tensor], scale: float, labels: int
    ) -> None:
        self.loss_fn = loss_fn
        self.scale = scale
        self.labels = labels
        self.raw: torch.Tensor | None = None

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        split = len(args) - self.labels
        loss = self.loss_fn(unwrap(args[:split]), unwrap(args[split:]))
        self.raw = loss.detach()
        return loss * self.scale


class FusedOps:
    """Fused F&B and F&I over this rank's chunks."""

    def __init__(self, ops: StageOps, device: torch.device) -> None:
        self.ops = ops
        chunks = ops.chunks
        self.hooks = {
            (f, b): hook
            for f, fc in chunks.items()
            for b, bc in chunks.items()
            if (hook := find_hook(fc.module, bc.module)) is not None
        }
        cuda = device.type == "cuda"
        self.device = device
        self.side = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]  # torch leaves it untyped

    def run(self, ctx: StepContext, step: FusedStep) -> None:
        forward, backward = step.forward, step.backward
        recomputed = {forward.stage, backward.stage} & self.ops.recompute
        if step.hook is not None and not recomputed:  # bound for an F&B only
            self._overlapped(ctx, step.hook, forward, backward)
        elif self.side is not None:
            self._on_two_streams(ctx, forward, backward)
        else:
            self.ops.forward(ctx, forward)
            backward.run(ctx, backward)

    def _on_two_streams(
        self, ctx: StepContext, forward: ComputeStep, backward: ComputeStep
    ) -> None:
        """The forward on a side stream, concurrently with the backward on the current one."""
        assert self.side is not None
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            self.ops.forward(ctx, forward)
        backward.run(ctx, backward)
        main.wait_stream(self.side)

    def _overlapped(
        self, ctx: StepContext, hook: Hook, forward: ComputeStep, backward: ComputeStep
    ) -> None:
        """F&B through the module class's `overlapped_forward_backward` (DualPipe's hook)."""
        ops = self.ops
        fchunk, bchunk = forward.unit, backward.unit
        value, inputs = ops.stage_inputs(ctx, forward)
        criterion, labels = None, []
        if fchunk.last:
            labels = _as_list(ops.target(ctx, forward.mb))
            criterion = ScaledCriterion(ops.loss_fn, ctx.scale, len(labels))
        saved = ops.replayed(ctx, ctx.saved.pop(backward.key))  # selected modules: again
        loss1, outputs1, grads1 = None, [], []
        if bchunk.last:
            loss1 = _with_added(saved, ctx.scale)
        else:
            outputs1, grads1 = (list(x) for x in ops.output_grads(ctx, backward, saved))
        ops.rng.seed(ctx.step, forward.stage, forward.mb)
        added: list[torch.Tensor] = []
        with (
            ops.autocast(),
            collecting(added),
            _keywords(fchunk.module, context_of(ctx, forward.mb)),
            ops.recording(ctx, forward) as selected,
            _captured(fchunk.module, forward.capture),
        ):
            outputs0, loss0 = hook(
                fchunk.module, _as_list(value), criterion, labels,
                bchunk.module, loss1, outputs1, grads1,
            )  # fmt: skip
        self._after(ctx, forward, inputs, outputs0, loss0, criterion)
        ctx.saved[forward.key] = ctx.saved[forward.key]._replace(
            added=record_added(ctx, forward, added), selected=selected
        )
        grads = tuple(x.grad if x.requires_grad else None for x in saved.inputs)
        ops.hand_back(ctx, backward, saved.inputs, grads)
        ops.drain(ctx, bchunk)

    def _after(
        self,
        ctx: StepContext,
        op: ComputeStep,
        inputs: Tensors,
        outputs0: Any,
        loss0: Any,
        criterion: ScaledCriterion | None,
    ) -> None:
        if criterion is not None:
            if not isinstance(loss0, torch.Tensor) or criterion.raw is None:
                raise ProgramError(
                    "overlapped_forward_backward must return (outputs0, loss0) "
                    "with loss0 = criterion0(*outputs0, *labels0)"
                )
            ctx.losses[op.mb] = criterion.raw
            outputs: Tensors = (loss0,)
        else:
            outputs = self.ops.hand_on(ctx, op, outputs0)
        ctx.saved[op.key] = Saved(inputs, outputs)


def _with_added(saved: Saved, scale: float) -> torch.Tensor:
    """`loss1` of the hook: the scaled main loss plus the scaled losses the forward added."""
    roots, _ = scaled_roots(saved.added, scale)
    return saved.outputs[0] + roots[0] * scale if roots else saved.outputs[0]


@contextmanager
def _captured(module: torch.nn.Module, capture: Capture | None) -> Iterator[None]:
    """The hook's forward under the weight-gradient contract's capture wherever the plain
    forward runs under it (its microbatch's backward is an `I`: runtime/engine/bound.py),
    so that `I` defers the same weight gradients to `W` and a run with the hook computes
    the same arithmetic as one without, not only the same values up to rounding."""
    if capture is None:
        yield
        return
    with capturing(module, capture):
        yield


@contextmanager
def _keywords(module: torch.nn.Module, context: dict[str, object]) -> Iterator[None]:
    """The hook calls `module0(*inputs0)`: the microbatch's context reaches that call as
    keyword arguments through a forward pre-hook, for the extent of the hook."""
    if not context:
        yield
        return

    def add(_: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return args, {**context, **kwargs}

    handle = module.register_forward_pre_hook(add, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _as_list(value: object) -> list[Any]:
    """A pytree as the hook's list of positional values."""
    return list(value) if isinstance(value, (tuple, list)) else [value]
