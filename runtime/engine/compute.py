"""The compute primitives of one rank: forward, backward (B), input backward (I), weight (W).

`StageOps` runs one compute step of one (chunk, microbatch) against the step's
`StepContext`, as bound to the signature's boundaries (runtime/engine/bound.py: its chunk,
mailbox slots, boundaries and split-backward method resolved): a forward takes its inputs
(the step's inputs on stage 0, the mailbox elsewhere, rebuilt into the stage's pytree),
leaves the tensors of its outputs for the next stage and what its backward needs; a backward
takes the output gradients from the mailbox (ones of the scaled loss on a last stage) and
leaves the input gradients for the previous stage. Stage inputs are detached leaves, so each
(chunk, microbatch) has its own autograd graph from its input to its output. Only tensors
that carry a gradient (runtime/boundaries/trees.py)
get one: the boundary of the stage says which, on both sides alike.

Each forward runs under the RNG state derived for its (step, stage, microbatch)
(runtime/engine/rng.py) and, when configured, under `torch.autocast`.

A forward's output is checked against the next stage's input boundary in full (flattened,
compared leaf by leaf, described in the error) by the first step of a signature; later steps
only pull its tensor leaves and compare their count, shapes, dtypes and gradient flags,
falling back to the full check (and its error) on any difference. Text is formatted only
when an error is raised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from pipecc.diagnostics import InputError, SetupError
from pipecc.ir.ops import Compute
from pipecc.ir.printer import describe

from ..boundaries.placed import local, placed_of
from ..boundaries.specs import autocast_context
from ..boundaries.trees import Boundary, TensorSpec, call, flatten, unwrap
from ..compat import pytree, storage_shared
from ..config import LossFn
from ..plan.binding import Chunk
from .aux_loss import collecting, scaled_roots, total
from .context import Replay, Saved, StepContext, Tensors
from .precision import Fp32Grads
from .rng import ForwardRng
from .selective import Selected, recording
from .split_backward import full_backward, input_backward
from .steps import ComputeStep
from .weight_contract import capturing

_NOTHING: contextlib.nullcontext[None] = contextlib.nullcontext()  # reusable, yields None


class StageOptions(NamedTuple):
    """How the stages compute, fixed when the runtime is built: the device and autocast dtype,
    fp32 gradient accumulation (None: off), the stages recomputed in full, and by chunk the
    submodules recomputed selectively (runtime/engine/recompute.py)."""

    device: torch.device
    autocast: torch.dtype | None = None
    precision: Fp32Grads | None = None
    recompute: frozenset[int] = frozenset()
    selected: Mapping[int, tuple[torch.nn.Module, ...]] = {}


class StageOps:
    """The compute primitives over this rank's chunks."""

    def __init__(
        self,
        rank: int,
        chunks: dict[int, Chunk],
        loss_fn: LossFn,
        rng: ForwardRng,
        options: StageOptions,
    ) -> None:
        self.rank = rank
        self.chunks = chunks
        self.loss_fn = loss_fn
        self.rng = rng
        self.autocast_device, self.autocast_dtype = options.device, options.autocast
        self.precision = options.precision
        self._params: dict[int, tuple[torch.nn.Parameter, ...]] = {}  # each chunk's, by id
        self.recompute = options.recompute  # stages recomputed in full
        # by chunk: the submodules recomputed selectively (runtime/engine/selective.py)
        self.selected = dict(options.selected)

    def forward(self, ctx: StepContext, op: ComputeStep) -> None:
        chunk = op.unit
        value, inputs = self.stage_inputs(ctx, op)
        replay = ctx.training and op.stage in self.recompute
        state = self.rng.snapshot() if replay else None
        self.rng.seed(ctx.step, op.stage, op.mb)
        capture = op.capture if ctx.training and not replay else None
        added: list[torch.Tensor] = []
        context = context_of(ctx, op.mb)
        graph = torch.no_grad() if replay else contextlib.nullcontext()
        with graph, self.autocast(), self.recording(ctx, op) as selected:
            with collecting(added):
                if capture is not None:  # the contract method (runtime/engine/bound.py)
                    with capturing(chunk.module, capture):
                        output = call(chunk.module, value, context)
                else:
                    output = call(chunk.module, value, context)
            outputs = self.loss(ctx, op.mb, output) if chunk.last else None
        if outputs is None:
            outputs = self.hand_on(ctx, op, output)
        elif not ctx.training and not chunk.first and op.mb in ctx.outputs:
            ctx.outputs[op.mb] = _own(ctx.outputs[op.mb], value)
        if replay:  # only the input stays: the backward runs the forward again
            record_added(ctx, op, added)
            ctx.saved[op.key] = Saved(inputs, (), None, Replay(value, op, state))
        elif ctx.training:
            added_sum = record_added(ctx, op, added)
            ctx.saved[op.key] = Saved(inputs, outputs, added_sum, None, selected)
        else:
            record_added(ctx, op, added)

    def recording(
        self, ctx: StepContext, op: ComputeStep
    ) -> contextlib.AbstractContextManager[Selected | None]:
        """Around a forward of a stage that recomputes selected modules (training): their
        calls keep only their inputs (runtime/engine/selective.py); the block gets what
        their replay needs, None elsewhere (a shared no-op: no generator per forward)."""
        modules = self.selected.get(op.chunk) if ctx.training else None
        if not modules or op.stage in self.recompute:
            return _NOTHING
        return self._recorded(modules, op)

    @contextlib.contextmanager
    def _recorded(
        self, modules: tuple[torch.nn.Module, ...], op: ComputeStep
    ) -> Iterator[Selected | None]:
        cuda = self.rng.index if self.rng.cuda else None
        selected = Selected([], op.capture, op.unit.module)
        with recording(modules, self.autocast_device, cuda, selected):
            yield selected

    def replayed(self, ctx: StepContext, saved: Saved) -> Saved:
        """A recomputed stage's forward run again, with its graph, before its B or I: under
        the same RNG state (dropout draws the same masks), autocast and contract capture;
        its added losses are the extra roots (they were reported by the first run)."""
        if saved.selected is not None:
            cuda = self.rng.index if self.rng.cuda else None
            saved.selected.replay(self.autocast_device.type, cuda)
            return saved._replace(selected=None)
        replay = saved.replay
        if replay is None:
            return saved
        fop: ComputeStep = replay.op
        chunk = fop.unit
        added: list[torch.Tensor] = []
        with (
            self.rng.replaying(ctx.step, fop.stage, fop.mb, replay.rng_state),
            torch.enable_grad(),
            self.autocast(),
        ):
            with collecting(added):
                context = context_of(ctx, fop.mb)
                if fop.capture is not None:
                    with capturing(chunk.module, fop.capture):
                        output = call(chunk.module, replay.value, context)
                else:
                    output = call(chunk.module, replay.value, context)
            if chunk.last:
                loss = self.loss_fn(unwrap(output), unwrap(self.target(ctx, fop.mb)))
                outputs: Tensors = (loss * ctx.scale,)
        if not chunk.last:
            tensors, got = flatten(output, f"the output of {describe(fop.instr, places=True)}")
            carries = fop.out_carries
            if carries is None or len(carries) != len(tensors):
                carries = _carries(fop.expected or got, tuple(tensors))
            outputs = tuple(local(t) for t, c in zip(tensors, carries, strict=True) if c)
        return Saved(saved.inputs, outputs, total(added))

    def backward(self, ctx: StepContext, op: ComputeStep) -> None:
        saved = self.replayed(ctx, ctx.saved.pop(op.key))
        outputs, grads = self.output_grads(ctx, op, saved)
        self.hand_back(ctx, op, saved.inputs, full_backward(outputs, grads, saved.inputs))
        self.drain(ctx, op.unit)

    def backward_input(self, ctx: StepContext, op: ComputeStep) -> None:
        saved = self.replayed(ctx, ctx.saved.pop(op.key))
        outputs, grads = self.output_grads(ctx, op, saved)
        params = op.unit.weights()  # None on an FSDP2 stage: every leaf (plan/binding.py)
        input_grads, weight = input_backward(outputs, grads, saved.inputs, params, op.capture)
        ctx.weights[op.key] = weight
        self.hand_back(ctx, op, saved.inputs, input_grads)
        self.drain(ctx, op.unit)  # by contract, I leaves the gradients of non-Linear parameters

    def weight(self, ctx: StepContext, op: ComputeStep) -> None:
        ctx.weights.pop(op.key).run()
        self.drain(ctx, op.unit)

    def drain(self, ctx: StepContext, chunk: Chunk) -> None:
        """After an op that adds weight gradients: with fp32 accumulation, move the chunk's
        new weight gradients into it; else give each new gradient a storage of its own.

        A parameter's first gradient of a step may be a tensor autograd handed over instead of
        a copy: a view of the output gradient (`pos.unsqueeze(0)` in a stage, one row per
        microbatch). Later microbatches add into `.grad` in place, so while anything else holds
        that storage (W's deferred work or recorded gradients, a message in flight, a receive
        buffer) it would change under it and a later W would compute from the sum. So each
        parameter's first gradient of the step is copied when its storage is shared
        (checked once per parameter and step: later ones are added in place)."""
        if self.precision is not None:
            self.precision.drain(chunk.module.parameters())
            return
        key = id(chunk)
        waiting = ctx.unowned.get(key)
        if waiting is None:
            waiting = self._params.get(key)
            if waiting is None:
                waiting = self._params[key] = tuple(chunk.module.parameters())
        if waiting:
            ctx.unowned[key] = own_grads(waiting)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return autocast_context(self.autocast_device, self.autocast_dtype)

    # ---- tensors in and out of a stage -----------------------------------------------------

    def stage_inputs(self, ctx: StepContext, op: ComputeStep) -> tuple[object, Tensors]:
        """A forward's input value, and its tensors that send a gradient back (detached
        leaves of this stage's graph when training)."""
        if op.unit.first:
            if ctx.inputs is None:
                raise InputError(f"rank {self.rank} holds stage 0 and needs the step's inputs")
            return ctx.inputs[op.mb], ()
        tensors = ctx.mail.take(op.src)
        carries = op.carries
        if carries is None or len(carries) != len(tensors):
            carries = _carries(op.given, tensors)
        if not ctx.training:
            return op.rebuild(tensors), ()
        tensors = tuple(
            t.detach().requires_grad_(True) if c else t
            for t, c in zip(tensors, carries, strict=True)
        )
        return op.rebuild(tensors), tuple(t for t, c in zip(tensors, carries, strict=True) if c)

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

    def hand_on(self, ctx: StepContext, op: ComputeStep, output: object) -> Tensors:
        """Leave a forward's output tensors for the next stage (a send, or a local forward);
        return those a gradient comes back for."""
        tensors, carries = None, op.out_carries
        if op.checked and op.expected is not None:
            tensors = pulled(output, op.expected, carries, training=ctx.training)
        if tensors is None:  # the first step of the signature, or a difference: in full
            tensors, got = self.checked_output(ctx, op, output)
            carries = _carries(op.expected or got, tuple(tensors))
        tensors = [local(t) for t in tensors]  # a DTensor's local shard, in the graph
        ctx.mail[op.dst] = tuple(t.detach() for t in tensors)
        assert carries is not None  # bound from `expected`, which `pulled` needs
        return tuple(t for t, c in zip(tensors, carries, strict=True) if c)

    def checked_output(
        self, ctx: StepContext, op: ComputeStep, output: object
    ) -> tuple[list[torch.Tensor], Boundary]:
        """A forward's output flattened and checked against the next stage's input in full
        (an error describes both); the step is marked checked when it matches."""
        tensors, got = flatten(output, f"the output of {describe(op.instr, places=True)}")
        if op.expected is not None:
            check_output(op.op, got, op.expected, training=ctx.training)
            op.checked = True
        return tensors, got

    def output_grads(
        self, ctx: StepContext, op: ComputeStep, saved: Saved
    ) -> tuple[Tensors, Tensors]:
        """The outputs a backward starts from, with their gradients; then the forward's
        added loss, seeded with 1/M (runtime/engine/aux_loss.py)."""
        roots, seeds = scaled_roots(saved.added, ctx.scale)
        if op.unit.last:
            ones = tuple(torch.ones_like(o) for o in saved.outputs)
            return saved.outputs + roots, ones + seeds
        received = ctx.mail.take(op.src)
        live = [(o, g) for o, g in zip(saved.outputs, received, strict=True) if o.requires_grad]
        return tuple(o for o, _ in live) + roots, tuple(g for _, g in live) + seeds

    def hand_back(
        self,
        ctx: StepContext,
        op: ComputeStep,
        inputs: Tensors,
        grads: Sequence[torch.Tensor | None],
    ) -> None:
        """Leave a backward's input gradients for the previous stage.

        The input leaves let go of their `.grad`: a deferred W's work keeps a leaf alive
        (autograd's node for a leaf holds it, reached from the Linear contract's saved
        input, or the graph kept for W), and through `.grad` it kept the gradient handed on,
        a boundary-sized tensor per deferred W, after its send had completed."""
        if op.stage == 0:
            return
        payload = tuple(
            g if g is not None else torch.zeros_like(x) for x, g in zip(inputs, grads, strict=True)
        )
        for x in inputs:
            x.grad = None
        ctx.mail[op.dst] = payload


def context_of(ctx: StepContext, mb: int) -> dict[str, object]:
    """The keyword arguments of every stage's forward on microbatch `mb` (the step's
    context, split like the inputs; none without one)."""
    return ctx.context[mb] if ctx.context is not None else {}


def record_added(
    ctx: StepContext, op: ComputeStep, added: list[torch.Tensor]
) -> torch.Tensor | None:
    """Report a forward's added losses (by microbatch, then stage); return their sum."""
    found = total(added)
    if found is not None:
        ctx.aux_losses.setdefault(op.mb, {})[op.stage] = found.detach()
    return found


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


def _own(output: object, given: object) -> object:
    """An evaluation output with every tensor that shares storage with the stage's input
    (a receive buffer, received into again at the next step; a DTensor's local shard may be
    one) copied."""
    inputs = [t for t in pytree.tree_leaves(given) if isinstance(t, torch.Tensor)]
    storages = {_storage(t) for t in inputs}

    def own(tensor: torch.Tensor) -> torch.Tensor:
        shared = _storage(tensor) in storages
        return tensor.clone() if shared else tensor

    return pytree.tree_map_only(torch.Tensor, own, output)


def _storage(tensor: torch.Tensor) -> int:
    """Where a tensor's data lies (a DTensor's: its local shard's; the wrapper has none)."""
    return int(local(tensor).untyped_storage().data_ptr())


def pulled(
    output: object,
    expected: Boundary,
    carries: tuple[bool, ...] | None,
    *,
    training: bool,
) -> list[torch.Tensor] | None:
    """The tensor leaves of a forward's output when it matches `expected` in the cheap
    check (the leaf count; each tensor's shape and dtype; a gradient needed only where one
    comes back; each constant), None on any difference."""
    leaves = [output] if type(output) is torch.Tensor else pytree.tree_leaves(output)
    specs = expected.leaves
    if len(leaves) != len(specs):
        return None
    tensors = []
    for leaf, spec in zip(leaves, specs, strict=True):
        if type(spec) is TensorSpec:
            if not _matches(leaf, spec):
                return None
            tensors.append(leaf)
        elif isinstance(leaf, torch.Tensor) or leaf != spec:
            return None
    if training and carries is not None:
        for tensor, carried in zip(tensors, carries, strict=True):
            if tensor.requires_grad and not carried:
                return None
    return tensors


def _matches(leaf: object, spec: TensorSpec) -> bool:
    """A tensor leaf as `spec` says: shape and dtype; a DTensor (its local shape) where and
    only where the spec has its layout."""
    if type(leaf) is torch.Tensor:  # the common case, first
        return spec.placed is None and leaf.shape == spec.shape and leaf.dtype == spec.dtype
    if not isinstance(leaf, torch.Tensor) or leaf.dtype != spec.dtype:
        return False
    if spec.placed is None:
        return not isinstance(leaf, DTensor) and leaf.shape == spec.shape
    return isinstance(leaf, DTensor) and placed_of(leaf) == spec.placed


def own_grads(params: Sequence[torch.nn.Parameter]) -> tuple[torch.nn.Parameter, ...]:
    """Copy each gradient among `params` whose storage something else holds (`drain`);
    returns the parameters that have no gradient yet."""
    left = []
    for param in params:
        grad = param.grad
        if grad is None:
            left.append(param)
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad  # a TP/FSDP shard
        if storage_shared(local):
            param.grad = grad.clone()
    return tuple(left)
