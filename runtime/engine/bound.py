"""One static plan per shape signature: a rank's plans compiled once into bound steps.

`Binder.bind` runs when a step brings a shape signature this runtime has not bound yet
(`PlanCache`, runtime/engine/plan_cache.py, the one entry point: it gets the signature's
boundaries, `{stage: Boundary}` of one microbatch, and the receive specs) and turns the
training plan and the forward-only plan (runtime/plan/plan.py) into `Bound` plans of steps
(runtime/engine/steps.py). Everything an instruction would otherwise look up, allocate or
decide at each step is resolved there, once:

- its chunk and the `StageOps` method of its kind (no dispatch on the instruction's class
  or kind per step); a MoE stage's `Phase` its op bound as a compute step, an all-to-all
  its direction, layer and (chunk, mb) parsed from its `what` (runtime/engine/moe_ops.py);
- its mailbox slots: integers (runtime/plan/plan.py `mailbox`), not message names hashed
  into a dict;
- a forward's input boundary, how to rebuild its value from the received tensors, and which
  of them carry a gradient; the boundary its output must match, validated in full by the
  first step of the signature and afterwards by a count of the leaves and each tensor's
  shape, dtype and gradient flag (runtime/engine/compute.py `hand_on`);
- the split-backward method of each chunk whose backward is split: the weight-gradient
  contract (its own `Capture`) for a module with contracted submodules, the graph walk
  otherwise (`methods`), chosen when the runtime is built; per runtime, nothing global. A
  forward captures only where its microbatch's backward is an I (`split_keys`): one whose
  backward is a full B (most of DualPipeV's) runs plainly and leaves the weight gradients
  to autograd, as an uncaptured chunk's do, without the contract's hooks (measured:
  docs/performance.md, "Host overhead");
- each send's and receive's group-commit flag and point-to-point ops; each receive's
  buffers, allocated once per signature and shared by the signature's two plans. A buffer
  is reused by the same receive at every step: what it received was consumed within the
  step that received it (a step ends with every forward's backward and W done and its
  mailbox empty, `StepContext.leftovers`), so no consumer of the previous step can still
  read it. On CUDA the next receive is queued on NCCL's stream after the current stream,
  on which (or after whose side stream) the consumers ran; on gloo the wait completes the
  copy on the host. One reader can outlive the step: a parameter whose gradient autograd
  took as it came (a view of a received output gradient, when the stage adds a reshaped
  parameter to its output) would hold a receive buffer as its `.grad`; the first gradient of
  a step whose storage something else holds gets one of its own (`StageOps.drain`,
  runtime/engine/compute.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from pipecc.diagnostics import SetupError
from pipecc.ir.keys import Message, carried, consumed, produced
from pipecc.ir.ops import (
    Collective,
    CollectiveKind,
    Compute,
    Fused,
    Instr,
    Kind,
    Msg,
    Phase,
    Recv,
    Send,
    Sequential,
    StageOp,
    Wait,
)

from ..boundaries.placed import Placed, rebuilt
from ..boundaries.specs import Specs
from ..boundaries.trees import Boundary, TensorSpec
from ..comm.channel import Channel
from ..compat import pytree
from ..plan.binding import Chunk
from ..plan.plan import Plan
from .compute import StageOps
from .context import StepContext
from .fused import FusedOps
from .moe_ops import parse_what
from .steps import (
    AllToAllStep,
    Bound,
    CollectiveStep,
    ComputeStep,
    FusedStep,
    PhaseStep,
    PostStep,
    ReduceStep,
    SequentialStep,
    StageStep,
    Step,
    Tensors,
    WaitStep,
)
from .weight_contract import Capture, contracted

RecvSpecs = Mapping[tuple[Msg, int, int], Specs]


def methods(chunks: Mapping[int, Chunk], split: frozenset[int]) -> dict[int, Capture]:
    """The split-backward method of each chunk whose backward is split: a `Capture` of its
    own for a module with contracted submodules (the contract method), none (the walk)."""
    return {
        chunk: Capture(chunks[chunk].module)
        for chunk in sorted(split)
        if chunk in chunks and contracted(chunks[chunk].module)
    }


class Binder:
    """Binds this rank's plans to a signature (module docstring)."""

    def __init__(
        self,
        stage: StageOps,
        fused: FusedOps,
        channel: Channel,
        slots: dict[Message, int],
        captures: Mapping[int, Capture],
        *,
        mesh: Any = None,
    ) -> None:
        self.stage = stage
        self.fused = fused
        self.channel = channel
        self.slots = slots
        self.messages = tuple(slots)
        self.captures = dict(captures)
        self.count = 0  # signatures bound so far
        self.mesh = mesh  # the runtime's device mesh (DTensor boundaries' rebuild)
        self._split: frozenset[tuple[int, int]] = frozenset()  # the plan being bound's I

    def bind(
        self, plans: tuple[Plan, Plan], boundaries: Mapping[int, Boundary], specs: RecvSpecs
    ) -> tuple[Bound, Bound]:
        """The training and forward-only plans bound to `boundaries` (their receives share
        buffers: the two never run at once)."""
        self.count += 1
        buffers: dict[int, Tensors] = {}
        train, forward = (self._bind(plan, boundaries, specs, buffers) for plan in plans)
        return train, forward

    def _bind(
        self,
        plan: Plan,
        boundaries: Mapping[int, Boundary],
        specs: RecvSpecs,
        buffers: dict[int, Tensors],
    ) -> Bound:
        self._split = split_keys(plan)
        steps = tuple(self._step(index, instr, commit, boundaries) for index, instr, commit in plan)
        for step in steps:
            if isinstance(step, PostStep) and not step.send:
                self._receive(step, specs, buffers)
        return Bound(steps, self.messages)

    def _step(
        self, index: int, instr: Instr, commit: bool, boundaries: Mapping[int, Boundary]
    ) -> Step:
        if isinstance(instr, Compute):
            return self._compute(index, instr, boundaries)
        if isinstance(instr, Fused):
            halves = (
                self._compute(index, instr.forward, boundaries),
                self._compute(index, instr.backward, boundaries),
            )
            hook = None
            if instr.backward.kind is Kind.B:
                hook = self.fused.hooks.get((instr.forward.chunk, instr.backward.chunk))
            return FusedStep(index, instr, halves, hook)
        if isinstance(instr, Sequential):
            parts = tuple(self._compute(index, op, boundaries) for op in instr.parts)
            return SequentialStep(index, instr, parts)
        if isinstance(instr, (Send, Recv)):
            return PostStep(index, instr, self.slots[carried(instr)], commit)
        if isinstance(instr, Wait):
            return WaitStep(index, instr)
        if isinstance(instr, StageOp):
            chunk = self.stage.chunks.get(instr.chunk)
            return StageStep(index, instr, chunk.module if chunk is not None else None)
        if isinstance(instr, Phase | Collective):
            return self._collective(index, instr, boundaries)
        raise AssertionError(f"unknown instruction {instr!r}")

    def _collective(
        self, index: int, instr: Phase | Collective, boundaries: Mapping[int, Boundary]
    ) -> Step:
        """A collective's step; a MoE stage's phase and all-to-all (runtime/engine/moe_ops.py)."""
        if isinstance(instr, Phase):
            return PhaseStep(index, instr, self._compute(index, instr.op, boundaries))
        if instr.kind is CollectiveKind.ALL_TO_ALL:  # expert parallelism's, over ep
            return AllToAllStep(index, instr, *parse_what(instr))
        if instr.dims:  # over mesh dimensions: runtime/comm/mesh.py
            return ReduceStep(index, instr)
        return CollectiveStep(index, instr)

    def _compute(self, index: int, op: Compute, boundaries: Mapping[int, Boundary]) -> ComputeStep:
        unit = self.stage.chunks.get(op.chunk)
        if unit is None:  # the first step's checks refuse this before any binding
            raise SetupError(f"no stage module for chunk {op.chunk}")
        step = ComputeStep(index, op, unit)
        step.run = self._method(op.kind)
        if op.kind is not Kind.W:
            step.src = self.slots[consumed(op.kind, op.pipe, op.stage, op.mb)]
            step.dst = self.slots[produced(op.kind, op.pipe, op.stage, op.mb)]
        if op.kind is Kind.I or (op.kind is Kind.F and step.key in self._split):
            step.capture = self.captures.get(op.chunk)  # only a forward whose backward is I
        if op.kind is Kind.F:
            _bind_forward(step, boundaries, self.mesh)
        return step

    def _method(self, kind: Kind) -> Callable[[StepContext, ComputeStep], None]:
        stage = self.stage
        found = {
            Kind.F: stage.forward,
            Kind.B: stage.backward,
            Kind.I: stage.backward_input,
            Kind.W: stage.weight,
        }
        return found[kind]

    def _receive(self, step: PostStep, specs: RecvSpecs, buffers: dict[int, Tensors]) -> None:
        """A receive's buffers (allocated once per signature) and its ops over them."""
        instr = step.instr
        assert isinstance(instr, Recv)
        found = specs.get((instr.what, instr.pipe, instr.stage))
        if found is None:
            return  # reported by the first step's checks; posting it says so again
        if step.index not in buffers:
            device = self.stage.autocast_device
            buffers[step.index] = tuple(
                torch.empty(s.shape, dtype=s.dtype, device=device) for s in found
            )
        step.buffers = buffers[step.index]
        step.ops = [self.channel.p2p(False, tensor, instr.peer) for tensor in step.buffers]


def split_keys(plan: Plan) -> frozenset[tuple[int, int]]:
    """The (chunk, microbatch) of every I in `plan` (alone, or half of a fused or sequential
    op): the forwards that capture for the contract method."""
    found: set[tuple[int, int]] = set()
    for _, instr, _ in plan:
        ops: tuple[Compute, ...] = (instr,) if isinstance(instr, Compute) else ()
        if isinstance(instr, Fused):
            ops = (instr.forward, instr.backward)
        elif isinstance(instr, Sequential):
            ops = tuple(instr.parts)
        found.update((op.chunk, op.mb) for op in ops if op.kind is Kind.I)
    return frozenset(found)


def _bind_forward(step: ComputeStep, boundaries: Mapping[int, Boundary], mesh: Any) -> None:
    """A forward's boundaries: its input's (unless it takes the step's inputs) and, unless it
    computes the loss, the next stage's input, which its output must match."""
    if not step.unit.first:
        given = boundaries.get(step.stage)
        step.given = given
        if given is not None:
            step.carries = tuple(spec.carries_grad for spec in given.tensors)
            step.rebuild = rebuilder(given, mesh)
    if not step.unit.last:
        expected = boundaries.get(step.stage + 1)
        step.expected = expected
        if expected is not None:
            step.out_carries = tuple(spec.carries_grad for spec in expected.tensors)


_ONE = pytree.tree_flatten(0)[1]


def rebuilder(boundary: Boundary, mesh: Any = None) -> Callable[[Tensors], object]:
    """How a stage's input value is rebuilt from its tensors: one tensor as itself, a tuple
    of tensors as the tuple, anything else through the boundary's tree; the local shards of
    DTensor leaves rebuilt over `mesh` first (runtime/boundaries/placed.py)."""
    placed = tuple(spec.placed for spec in boundary.tensors)
    if any(p is not None for p in placed):
        plain = rebuilder(boundary._replace(leaves=_plain(boundary.leaves)))

        def rebuild(tensors: Tensors) -> object:
            return plain(tuple(_dtensor(t, p, mesh) for t, p in zip(tensors, placed, strict=True)))

        return rebuild
    count = len(boundary.leaves)
    if len(boundary.tensors) == count:
        if boundary.tree == _ONE:
            return _first
        if boundary.tree == pytree.tree_flatten(tuple(range(count)))[1]:
            return _same
    return boundary.rebuild


def _first(tensors: Tensors) -> object:
    return tensors[0]


def _same(tensors: Tensors) -> object:
    return tensors


def _plain(leaves: tuple[object, ...]) -> tuple[object, ...]:
    return tuple(
        leaf._replace(placed=None) if isinstance(leaf, TensorSpec) else leaf for leaf in leaves
    )


def _dtensor(tensor: torch.Tensor, placed: Placed | None, mesh: Any) -> torch.Tensor:
    return tensor if placed is None else rebuilt(tensor, placed, mesh)
