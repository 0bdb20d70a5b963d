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
plan is bound, runtime/engine/bound.py), else on CUDA its two halves concurrently on two
streams (`TwoStreams`), else one after the other.

On two streams: autograd runs each backward kernel on the stream its forward ran on, so the
backward half runs, as the ambient stream, on the stream its (chunk, mb)'s forward ran on, and
the fused forward on the other one. Plain forwards run on the current stream; a fused forward
goes to the side stream unless its backward half's forward ran there, then to the current one;
two streams always suffice. The side stream first waits for the current one, and the current
one waits for the side stream at the op's end (the join). The forward is queued first, and
every tensor the two halves read (the forward's input message, the backward's output
gradients and what its forward saved) is held until the join, so that the caching allocator
cannot hand a block read by one stream to the other before the read is done.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
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


Key = tuple[int, int]  # (chunk, mb)


class TwoStreams:
    """The current stream and one side stream of a device, and which of them each
    (chunk, mb)'s forward ran on in the step (module docstring).

    `side` is a stream object with `wait_stream`; `current()` gives the current stream and
    `use(stream)` makes a stream the current one for a block (`torch.cuda.current_stream`
    and `torch.cuda.stream` on CUDA; a test passes stand-ins)."""

    def __init__(
        self,
        side: Any,
        current: Callable[[], Any],
        use: Callable[[Any], AbstractContextManager[Any]],
    ) -> None:
        self.side = side
        self.current = current
        self.use = use
        self.on_side: set[Key] = set()  # the step's forwards that ran on the side stream
        self._step: weakref.ref[StepContext] | None = None

    @classmethod
    def of(cls, device: torch.device) -> TwoStreams | None:
        """The device's two streams (None off CUDA: fused halves run one after the other)."""
        if device.type != "cuda":
            return None
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch leaves it untyped
        return cls(side, lambda: torch.cuda.current_stream(device), torch.cuda.stream)

    def pick(self, ctx: StepContext, forward: Key, backward: Key) -> tuple[bool, bool]:
        """Whether a fused op's forward, and its backward half, run on the side stream: the
        backward where its forward ran, the forward on the other stream."""
        if self._step is None or self._step() is not ctx:  # a new step: keys start again
            self.on_side.clear()
            self._step = weakref.ref(ctx)
        backward_side = backward in self.on_side
        self.on_side.discard(backward)
        if not backward_side:
            self.on_side.add(forward)
        return not backward_side, backward_side


class FusedOps:
    """Fused F&B and F&I over this rank's chunks."""

    def __init__(
        self, ops: StageOps, device: torch.device, streams: TwoStreams | None = None
    ) -> None:
        self.ops = ops
        chunks = ops.chunks
        self.hooks = {
            (f, b): hook
            for f, fc in chunks.items()
            for b, bc in chunks.items()
            if (hook := find_hook(fc.module, bc.module)) is not None
        }
        self.device = device
        self.streams = streams if streams is not None else TwoStreams.of(device)

    def run(self, ctx: StepContext, step: FusedStep) -> None:
        forward, backward = step.forward, step.backward
        recomputed = {forward.stage, backward.stage} & self.ops.recompute
        if step.hook is not None and not recomputed:  # bound for an F&B only
            self._overlapped(ctx, step.hook, forward, backward)
        elif self.streams is not None:
            self._on_two_streams(ctx, self.streams, forward, backward)
        else:
            self.ops.forward(ctx, forward)
            backward.run(ctx, backward)

    def _on_two_streams(
        self, ctx: StepContext, streams: TwoStreams, forward: ComputeStep, backward: ComputeStep
    ) -> None:
        """The two halves concurrently, each on its stream (module docstring)."""
        main, side = streams.current(), streams.side
        forward_side, backward_side = streams.pick(ctx, forward.key, backward.key)
        held = _read(ctx, forward, backward)  # alive until the join
        side.wait_stream(main)
        with streams.use(side if forward_side else main):
            self.ops.forward(ctx, forward)
        with streams.use(side if backward_side else main):
            backward.run(ctx, backward)
        main.wait_stream(side)
        del held

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


def _read(ctx: StepContext, forward: ComputeStep, backward: ComputeStep) -> tuple[object, ...]:
    """What the halves of a fused op read that the step may drop before the streams join:
    the forward's input message, the backward's output gradients, and its forward's `Saved`
    (a slot that holds nothing gives None)."""
    mail = ctx.mail
    return (
        mail[forward.src] if forward.src >= 0 else None,
        mail[backward.src] if backward.src >= 0 else None,
        ctx.saved.get(backward.key),
    )


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
