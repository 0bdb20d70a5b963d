"""The byte profile of a step: per stage, the sizes the memory rule composes.

`ByteProfilingInterpreter` runs one step and records, per stage, what the memory rule of
`pipecc.analysis.memory` (docs/simulate.md, "Memory in bytes") reads:

- `act_bytes`: what each forward keeps for its backward, storage by storage, each once: every
  tensor autograd saves (caught with `torch.autograd.graph.saved_tensors_hooks`), the inputs
  and outputs the runtime keeps for the backward, and any other storage the forward created
  that is still alive after it (a closure's tensors: the weight-gradient contract's); the
  parameters, their buffers, the step's batch, the receive buffers and an input a stage of
  this rank handed on (a V shape's: counted in that stage's output) are left out;
- `out_bytes`: of the output a forward hands on, the storages nothing keeps for the backward
  (a recomputed stage's output; left out of `act_bytes`): the outgoing message;
- `act_bytes_w`: what stays from an `I` until its `W`, measured on the runtime's own split
  backward: the storages of that forward, of the gradient the `I` received and of everything
  the `I` created that are still alive after it, less the gradient it hands on and the
  parameters' gradients;
- `param_bytes` (parameters and module buffers), `grad_bytes` after the step, `grad_bytes_w`
  (what the stage's first `W` added to the gradients its first `I` left), `optim_bytes` (the
  optimizer's state: `optimizer_bytes`), `bytes` (each receive buffer);
- `workspace_<kind>`: each op's peak above the larger of before and after, and
  `workspace_sum`: the gradient sum of parameters held by several ranks after the program.

Live bytes come from `LiveStorages`: every storage an aten op creates (an output that aliases
none of its inputs), with a weak reference to it, checked after every op; the parameters and
buffers are counted from the start. It sees ops, not a kernel's scratch space inside one.
The largest sample of each figure over the step's microbatches is kept (a peak is what the
rule needs). A fused op's two parts run one after the other in this step (as on CPU), each
measured as the op it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from pipecc.ir.ops import Collective, Kind

from ..compat import DispatchMode, pytree, storage_weak_ref
from ..engine.context import StepContext, Tensors
from ..engine.interpreter import Interpreter
from ..engine.steps import Bound, ComputeStep, FusedStep, PostStep, SequentialStep

StorageWeakRef = Any  # torch's weak reference to a storage (`.expired()`; untyped)
tree_leaves = pytree.tree_leaves

# named optimizers: bytes of state per parameter element (AdamW, Adam: two fp32 moments)
OPTIMIZERS = {"adamw": 8, "adam": 8, "sgd": 0, "none": 0}


def _storage(tensor: torch.Tensor) -> tuple[int, int, Any]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes(), storage


class LiveStorages(DispatchMode):
    """Every tensor storage alive on this thread's ops, counted in bytes, and the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live = 0
        self.peak = 0
        self.recent: set[int] = set()  # storages created since `mark`

    def seed(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count storages that exist already (the parameters, their buffers)."""
        for tensor in tensors:
            self._add(tensor)
        self.peak = max(self.peak, self.live)

    def mark(self) -> int:
        """Start a new op: the peak from now, the storages it creates; returns live bytes."""
        self.sweep()
        self.peak = self.live
        self.recent = set()
        return self.live

    def sweep(self) -> None:
        dead = [ptr for ptr, (ref, _) in self.refs.items() if ref.expired()]
        for ptr in dead:
            self.live -= self.refs.pop(ptr)[1]

    def alive(self, ptr: int) -> bool:
        found = self.refs.get(ptr)
        return found is not None and not found[0].expired()

    def _add(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        ptr, nbytes, storage = _storage(tensor)
        if ptr and ptr not in self.refs:
            self.refs[ptr] = (storage_weak_ref(storage), nbytes)
            self.live += nbytes
            self.recent.add(ptr)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.sweep()  # before adding: a freed storage's address may be the new one's
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                if tensor.untyped_storage().data_ptr() not in inputs:
                    self._add(tensor)
        if self.live > self.peak:
            self.peak = self.live
        return out


def storages(tensors: Iterable[torch.Tensor]) -> dict[int, tuple[int, StorageWeakRef]]:
    """Distinct storages of `tensors`: address -> (bytes, a weak reference: holding the
    storage itself would keep it alive)."""
    found: dict[int, tuple[int, StorageWeakRef]] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            ptr, nbytes, storage = _storage(tensor)
            if ptr:
                found[ptr] = (nbytes, storage_weak_ref(storage))
    return found


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """A stage's parameters and buffers (what `param_bytes` counts)."""
    return [*module.parameters(), *module.buffers()]


def optimizer_bytes(module: torch.nn.Module, optimizer: object) -> int:
    """The optimizer state of a stage: a named optimizer's bytes per parameter element
    (AdamW: two fp32 moments), or a callable `optimizer(params)` stepped once on meta-device
    copies of the parameters and its state's bytes summed."""
    params = [p for p in module.parameters() if p.requires_grad]
    if isinstance(optimizer, str):
        return OPTIMIZERS[optimizer] * sum(p.numel() for p in params)
    if not callable(optimizer):
        raise TypeError(f"optimizer must be a name or a function, got {optimizer!r}")
    copies = [torch.empty_like(p, device="meta").requires_grad_(True) for p in params]
    for copy in copies:
        copy.grad = torch.empty_like(copy)
    built = optimizer(copies)
    built.step()
    return sum(
        t.numel() * t.element_size()
        for state in built.state.values()
        for t in tree_leaves(state)
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )


@dataclass
class ByteProfile:
    """What one rank measured in its byte-profiled step (plain data, pickled to the launcher):
    per stage lists of samples in bytes."""

    act: dict[int, list[int]] = field(default_factory=dict)
    act_w: dict[int, list[int]] = field(default_factory=dict)
    out: dict[int, list[int]] = field(default_factory=dict)  # `out_bytes`
    workspace: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    messages: dict[int, list[int]] = field(default_factory=dict)
    params: dict[int, int] = field(default_factory=dict)
    grads: dict[int, int] = field(default_factory=dict)
    grads_at_i: dict[int, int] = field(default_factory=dict)  # after the stage's first I
    optim: dict[int, int] = field(default_factory=dict)
    sum_workspace: int = 0  # the gradient sum after the program (duplicated stages)

    def add(self, table: dict[Any, list[int]], key: Any, value: int) -> None:
        table.setdefault(key, []).append(value)


class ByteProfilingInterpreter(Interpreter):
    """An `Interpreter` over `base`'s parts that records the byte profile of one step."""

    def __init__(self, base: Interpreter, profile: ByteProfile, live: LiveStorages) -> None:
        super().__init__(base.parts)
        self.profile = profile
        self.live = live
        self.skip: set[int] = set()  # parameters, buffers, the step's batch
        self.kept: dict[tuple[int, int], dict[int, tuple[int, StorageWeakRef]]] = {}
        self.end = 0  # live bytes when the program ended
        self.pool: list[torch.Tensor] = []  # the receive buffers of the plan in use

    def run(self, bound: Bound, ctx: StepContext) -> None:
        self.pool = pool_tensors(bound)  # counted apart: the rule holds them all step
        super().run(bound, ctx)
        self.end = self.live.mark()  # what follows is the gradient sum (pipeline.step)

    def begin(self, ctx: StepContext) -> None:
        """Leave out what is no activation: parameters, buffers and the batch."""
        for chunk in self.stage.chunks.values():
            self.skip |= set(storages(module_tensors(chunk.module)))
        batch = tree_leaves((ctx.inputs, ctx.targets))
        self.skip |= set(storages(t for t in batch if isinstance(t, torch.Tensor)))
        self.skip |= set(storages(self.pool))

    def compute(self, ctx: StepContext, instr: ComputeStep | FusedStep | SequentialStep) -> None:
        """A fused or sequential op's parts one after the other (its bytes are theirs: the
        rule applies them in that order), each measured as the op it is."""
        if isinstance(instr, FusedStep):
            self.compute(ctx, instr.forward)
            self.compute(ctx, instr.backward)
            return
        if isinstance(instr, SequentialStep):
            for part in instr.parts:
                self.compute(ctx, part)
            return
        if not self.skip:
            self.begin(ctx)
        if instr.kind is Kind.I:
            self._input_backward(ctx, instr)
            return
        before = self.live.mark()
        saved: dict[int, tuple[int, StorageWeakRef]] = {}
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(self._packer(saved), _unpack)
            if instr.kind is Kind.F
            else contextlib.nullcontext()
        )
        with hooks:
            super().compute(ctx, instr)
        if instr.kind is Kind.F:
            self._forward(ctx, instr, saved)
        self._workspace(instr, before)
        if instr.kind is not Kind.F:
            self.kept.pop((instr.chunk, instr.mb), None)

    def collective(self, instr: Collective) -> None:
        """The gradient sum placed in the program: its workspace (`workspace_sum`)."""
        before = self.live.mark()
        super().collective(instr)
        peak = self.live.peak
        self.live.sweep()
        used = max(peak - max(before, self.live.live), 0)
        self.profile.sum_workspace = max(self.profile.sum_workspace, used)

    def _packer(self, saved: dict[int, tuple[int, StorageWeakRef]]) -> Any:
        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved.update(storages((tensor,)))
            return tensor

        return pack

    def _forward(
        self, ctx: StepContext, op: ComputeStep, saved: dict[int, tuple[int, StorageWeakRef]]
    ) -> None:
        kept = ctx.saved.get((op.chunk, op.mb))
        if kept is not None:
            saved.update(storages((*kept.inputs, *kept.outputs)))
        held = set(saved)  # saved by autograd, or kept by the runtime for the backward
        # what autograd does not save but the forward keeps (a closure's tensors): every
        # storage it created that is still alive
        self.live.sweep()
        for ptr in self.live.recent:
            if ptr not in saved and self.live.alive(ptr):
                saved[ptr] = (self.live.refs[ptr][1], self.live.refs[ptr][0])
        # an input handed on by a stage of this rank (a V shape's local hand-off) is that
        # stage's output, counted in its activations (which outlive these): not again here
        others = {ptr for kept_by in self.kept.values() for ptr in kept_by}
        mine = {
            ptr: found
            for ptr, found in saved.items()
            if ptr not in self.skip and ptr not in others and not found[1].expired()
        }
        # of the output handed on, what nothing keeps for the backward (a recomputed
        # stage's): the outgoing message, until its send completes (`out_bytes`)
        out = {ptr for ptr in storages(_slot(ctx, op.dst)) if ptr in mine and ptr not in held}
        self.kept[(op.chunk, op.mb)] = {p: f for p, f in mine.items() if p not in out}
        unkept = sum(mine[ptr][0] for ptr in out)
        self.profile.add(self.profile.act, op.stage, sum(n for n, _ in mine.values()) - unkept)
        self.profile.add(self.profile.out, op.stage, unkept)

    def _input_backward(self, ctx: StepContext, op: ComputeStep) -> None:
        """I: what stays until W (module docstring); the gradients it allocates."""
        candidates = dict(self.kept.pop((op.chunk, op.mb), {}))
        candidates.update(storages(_slot(ctx, op.src)))
        before = self.live.mark()
        super().compute(ctx, op)
        created = set(self.live.recent)
        handed = set(storages(_slot(ctx, op.dst)))
        grads = set(storages(self._grads(op.chunk)))
        out = self.skip | handed | grads
        kept = {ptr: n for ptr, (n, ref) in candidates.items() if not ref.expired()}
        stays = sum(n for ptr, n in kept.items() if ptr not in out)
        stays += sum(
            self.live.refs[ptr][1] for ptr in created - out - set(kept) if self.live.alive(ptr)
        )
        self.profile.add(self.profile.act_w, op.stage, stays)
        if op.stage not in self.profile.grads_at_i:
            self.profile.grads_at_i[op.stage] = _nbytes(self._grads(op.chunk))
        self._workspace(op, before)

    def _grads(self, chunk: int) -> list[torch.Tensor]:
        module = self.stage.chunks[chunk].module
        return [p.grad for p in module.parameters() if p.grad is not None]

    def _workspace(self, op: ComputeStep, before: int) -> None:
        """An op's peak above the larger of before (for a W, with the gradients it made,
        which the rule counts from there: a stage's first W) and after."""
        peak = self.live.peak
        self.live.sweep()
        after = self.live.live
        made = 0
        if op.kind is Kind.W:
            found = storages(self._grads(op.chunk)).items()
            made = sum(n for ptr, (n, _) in found if ptr in self.live.recent)
        self.profile.add(
            self.profile.workspace, (op.kind.value, op.stage),
            max(peak - max(before + made, after), 0),
        )  # fmt: skip

    def post(self, ctx: StepContext, step: PostStep) -> None:
        super().post(ctx, step)
        if not step.send and step.buffers is not None:
            nbytes = sum(t.numel() * t.element_size() for t in step.buffers)
            self.profile.add(self.profile.messages, step.comm.stage, nbytes)

    def finish(self, optimizer: object) -> None:
        """After the step: each stage's parameters, gradients and optimizer state, and the
        gradient sum's workspace (0 where none ran)."""
        peak = self.live.peak
        self.live.sweep()
        after = max(peak - max(self.end, self.live.live), 0)
        self.profile.sum_workspace = max(self.profile.sum_workspace, after)
        for chunk, held in self.stage.chunks.items():
            stage = held.slot.stage
            self.profile.params[stage] = _nbytes(module_tensors(held.module))
            self.profile.grads[stage] = _nbytes(self._grads(chunk))
            self.profile.optim[stage] = optimizer_bytes(held.module, optimizer)


def pool_tensors(bound: Bound) -> list[torch.Tensor]:
    """The receive buffers of a bound plan (a signature's training and forward plans share
    them), allocated when it was bound and held for every step of it."""
    found: dict[int, torch.Tensor] = {}
    for step in bound.steps:
        if isinstance(step, PostStep) and not step.send and step.buffers is not None:
            found.update((id(t), t) for t in step.buffers)
    return list(found.values())


def _slot(ctx: StepContext, slot: int) -> Tensors:
    """The tensors in a mailbox slot (none for -1 or an empty slot)."""
    found = ctx.mail[slot] if 0 <= slot < len(ctx.mail) else None
    return found or ()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(n for n, _ in storages(tensors).values())


def byte_keys(profiles: list[ByteProfile]) -> dict[int, dict[str, int]]:
    """The byte keys of each stage's cost table (docs/simulate.md), from every rank's
    profile: the largest sample of each (a peak is what the rule needs), the stage's
    parameters, gradients and optimizer state as one holder has them."""
    tables: dict[int, dict[str, int]] = {}
    for profile in profiles:
        for stage, key, value in _figures(profile):
            table = tables.setdefault(stage, {})
            table[key] = max(table.get(key, 0), value)
    return tables


def _figures(profile: ByteProfile) -> Iterable[tuple[int, str, int]]:
    """(stage, key, bytes) of one rank's profile."""
    for stage, samples in profile.act.items():
        yield stage, "act_bytes", max(samples)
    for stage, samples in profile.act_w.items():
        yield stage, "act_bytes_w", max(samples)
    for stage, samples in profile.out.items():
        if max(samples):  # a stage that keeps its outputs: none (the key's default)
            yield stage, "out_bytes", max(samples)
    for (kind, stage), samples in profile.workspace.items():
        yield stage, f"workspace_{kind}", max(samples)
    for stage, samples in profile.messages.items():
        yield stage, "bytes", max(samples)
    for stage, nbytes in profile.params.items():
        yield stage, "param_bytes", nbytes
        yield stage, "grad_bytes", profile.grads[stage]
        yield stage, "optim_bytes", profile.optim[stage]
        if profile.sum_workspace:  # the rank's stages share it
            yield stage, "workspace_sum", profile.sum_workspace // len(profile.params)
    for stage, nbytes in profile.grads_at_i.items():
        yield stage, "grad_bytes_w", profile.grads[stage] - nbytes
