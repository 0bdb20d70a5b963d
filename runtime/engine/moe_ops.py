"""A MoE stage run in phases: the `Phase` steps and the all-to-alls between them.

The program splits each F, B and I of a MoE stage (`Program.moe`: K layers) at every MoE
layer's dispatch and combine (pipecc/ir/ops.py `Phase`, the contract of issue 33):

    F:  pre0, dispatch L0, experts0, combine L0, pre1, ..., experts(K-1), combine L(K-1), post
    B/I: post, combine-grad L(K-1), experts(K-1), dispatch-grad L(K-1), pre(K-1), ..., pre0

`MoEOps` runs them over the stage's parts (runtime/engine/moe_block.py): pre0 takes the
stage's input as a forward does (runtime/engine/compute.py `stage_inputs`) and runs the
head and block 0's `route`; pre l (l > 0) runs block l-1's `combine` and block l's `route`;
experts l runs block l's `experts_forward` on the tokens received; post runs the last
combine and the tail, then hands the output on (or takes the loss) as a forward does. Each
phase's inputs are detached leaves (the received tokens, the combined outputs, the tensors
`route` keeps for `combine`), so a backward phase is one autograd call from the phase's
outputs, with the gradients received by the reverse all-to-all or left by the later phase,
to its leaves: `B` accumulates the weight gradients as it goes, `I` records each phase's
weight work (runtime/engine/split_backward.py) and its W runs them all. Losses added in a
phase (`add_loss`, the balancing loss) are that phase's extra roots, seeded 1/M.

The all-to-alls are plain collectives over the EP group (`all_to_all_single`), posted by
`post`: completed at once when blocking, by the `Wait` that lists them when async. Token
counts vary with routing, so the dispatch first exchanges the counts (a small blocking
all_to_all of E integers: each rank learns how many rows it receives from each rank for
each of its experts) and then moves rows of exactly those sizes; the combine and both
backward all-to-alls reuse those sizes reversed. No capacity, no dropped tokens: the run is
the single-process model's, token for token. An expert or a whole rank that receives no
tokens computes on, sends and receives zero-row tensors: every EP rank posts every
all-to-all of the program, whatever the routing.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from pipecc.diagnostics import ProgramError
from pipecc.ir.ops import Collective, Instr, Kind, Phase, PhasePart

from ..boundaries.placed import local
from ..boundaries.trees import unwrap
from ..comm.shared import warm
from .aux_loss import collecting, scaled_roots, total
from .compute import StageOps, context_of, record_added
from .context import Saved, StepContext, Tensors
from .moe_block import Block, blocks_of, keep_own
from .moe_post import Exchange, Layer, Ticket, a2a_group
from .selective import Selected
from .split_backward import WeightGrad, full_backward, input_backward
from .steps import AllToAllStep, ComputeStep, PhaseStep

_NOTHING: contextlib.nullcontext[None] = contextlib.nullcontext()
WHAT = re.compile(r"^(dispatch|combine|combine-grad|dispatch-grad) L(\d+) [FBI](\d+)\.(\d+)$")


def parse_what(instr: Collective) -> tuple[str, int, tuple[int, int]]:
    """An all-to-all's direction, layer and (chunk, mb), from its `what`."""
    found = WHAT.match(instr.what)
    if found is None:
        raise ProgramError(
            f"all_to_all {instr.what!r}: expected '<dispatch|combine|combine-grad|"
            "dispatch-grad> L<layer> <F|B|I><chunk>.<mb>'"
        )
    direction, layer, chunk, mb = found.groups()
    return direction, int(layer), (int(chunk), int(mb))


Run = Callable[[bool], Tensors]


@dataclass
class PhaseRecord:
    """A forward phase's graph, for its backward phase: its leaves, outputs and added loss;
    on a recomputed stage no outputs but `run`, which computes them again; `selected`: the
    regions of selectively recomputed modules."""

    leaves: Tensors
    outputs: Tensors
    added: torch.Tensor | None
    run: Run | None = None
    selected: Selected | None = None


@dataclass
class Flight:
    """One (chunk, mb) of a MoE stage between its forward's first phase and its backward's
    last: its layers, its phases' graphs, its losses added and I's weight work."""

    layers: list[Layer]
    records: dict[tuple[PhasePart, int], PhaseRecord] = field(default_factory=dict)
    added: list[torch.Tensor] = field(default_factory=list)
    weights: list[WeightGrad] = field(default_factory=list)


class MoEOps:
    """Runs the phases and all-to-alls of this rank's MoE stages (module docstring).

    `group`: the EP group through this rank (None with ep = 1: the all-to-alls are local
    copies). `waited`: seconds this rank's compute thread blocked on all-to-alls (the count
    exchanges included), summed over the runtime's life (the benchmark reads it)."""

    def __init__(
        self,
        stage: StageOps,
        group: dist.ProcessGroup | None,
        size: int,
        timeout: float = 300.0,
        problems: Sequence[str] = (),
    ) -> None:
        self.stage = stage
        self.group = group
        self.size = size
        self.flights: dict[tuple[int, int], Flight] = {}
        self.exchange = Exchange(group, size, timeout)
        self._problems = list(problems)

    def problems(self) -> list[str]:
        """What this rank's MoE stages cannot run (`stage_problems`, the experts' split)."""
        return list(self._problems)

    def begin(self) -> None:
        """A new step: nothing of the last one is kept."""
        self.flights = {}

    def leftovers(self) -> list[str]:
        """MoE ops of the step that did not finish."""
        return (
            [f"MoE phases unfinished: (chunk, mb) {sorted(self.flights)}"] if self.flights else []
        )

    # ---- phases ----------------------------------------------------------------------------

    def phase(self, ctx: StepContext, step: PhaseStep) -> None:
        if step.phase.op.kind is Kind.F:
            self._forward(ctx, step)
        else:
            self._backward(ctx, step)

    def _forward(self, ctx: StepContext, step: PhaseStep) -> None:
        phase, op = step.phase, step.op
        blocks = _blocks(op.unit.module)
        if phase.part is PhasePart.PRE and phase.layer == 0:
            self.flights[op.key] = Flight([Layer() for _ in blocks])
        flight = self._flight(op.key)
        replay = ctx.training and op.stage in self.stage.recompute  # full recomputation
        leaves, run = self._prepare(ctx, op, flight, blocks, phase)
        added: list[torch.Tensor] = []
        graph = torch.enable_grad() if ctx.training and not replay else torch.no_grad()
        with graph, self.stage.autocast(), collecting(added):
            with self.stage.recording(ctx, op) if not replay else _NOTHING as selected:
                outputs = run(True)
        flight.added.extend(added)
        if ctx.training:
            flight.records[(phase.part, phase.layer)] = PhaseRecord(
                leaves, () if replay else outputs, total(added), run if replay else None, selected
            )
        if phase.part is PhasePart.POST:
            record_added(ctx, op, flight.added)
            flight.added = []
            if not ctx.training:
                del self.flights[op.key]

    def _prepare(
        self,
        ctx: StepContext,
        op: ComputeStep,
        flight: Flight,
        blocks: list[Block],
        phase: Phase,
    ) -> tuple[Tensors, Run]:
        """A forward phase's leaves, and what computes its outputs from them (`run(first)`:
        the first run also leaves what the next all-to-all or stage takes; a recomputed
        stage's backward runs it again)."""
        index = phase.layer
        if phase.part is PhasePart.EXPERTS:
            layer, block = flight.layers[index], blocks[index]
            leaf = _leaf(_got(layer.received, "dispatch"), ctx.training)
            return (leaf,), lambda first: self._experts(layer, block, leaf, first)
        if index == 0:  # the stage's input, through the head
            value, leaves = self.stage.stage_inputs(ctx, op)
            self.stage.rng.seed(ctx.step, op.stage, op.mb)
            head = _part(op.unit.module, "moe_head")
            context = context_of(ctx, op.mb)
            enter: Callable[[], torch.Tensor] = lambda: head(value, **context)  # noqa: E731
        else:  # the previous layer's combine
            prev = flight.layers[index - 1]
            assert prev.routed is not None
            combined = _leaf(_got(prev.combined, "combine"), ctx.training)
            keep = tuple(
                _leaf(k, ctx.training and k.dtype.is_floating_point) for k in prev.routed.keep
            )
            leaves, routed = (combined, *keep), prev.routed._replace(keep=keep)
            enter = partial(blocks[index - 1].combine, combined, routed)
        if phase.part is PhasePart.PRE:
            layer, block = flight.layers[index], blocks[index]
            return leaves, lambda first: self._route(layer, block, enter(), first)
        tail = _part(op.unit.module, "moe_tail")
        return leaves, lambda first: self._leave(ctx, op, tail(enter()), first)

    def _experts(self, layer: Layer, block: Block, leaf: torch.Tensor, first: bool) -> Tensors:
        out = block.experts_forward(leaf, layer.runs)
        if first:
            layer.out = out.detach()
        return (out,)

    def _route(self, layer: Layer, block: Block, h: torch.Tensor, first: bool) -> Tensors:
        routed = block.route(h)
        if first:
            layer.routed = routed._replace(keep=tuple(k.detach() for k in routed.keep))
            layer.tokens = routed.tokens.detach()
        return (routed.tokens, *routed.keep)

    def _leave(self, ctx: StepContext, op: ComputeStep, output: object, first: bool) -> Tensors:
        """The post phase's output: the loss on a last stage, else handed on (the first
        run); the tensors a gradient comes back for (a recomputed stage's second run)."""
        if op.unit.last:
            if first:
                return self.stage.loss(ctx, op.mb, output)
            loss = self.stage.loss_fn(unwrap(output), unwrap(self.stage.target(ctx, op.mb)))
            return (loss * ctx.scale,)
        if first:
            return self.stage.hand_on(ctx, op, output)
        tensors, _ = self.stage.checked_output(ctx, op, output)
        carries = op.out_carries or tuple(t.requires_grad for t in tensors)
        return tuple(local(t) for t, c in zip(tensors, carries, strict=True) if c)

    def _backward(self, ctx: StepContext, step: PhaseStep) -> None:
        phase, op = step.phase, step.op
        flight = self._flight(op.key)
        record = self._again(ctx, flight.records.pop((phase.part, phase.layer)))
        outputs, grads = self._roots(ctx, op, flight, phase.part, phase.layer, record)
        if op.kind is Kind.B:
            got = full_backward(outputs, grads, record.leaves)
        else:
            got, weight = input_backward(outputs, grads, record.leaves, op.unit.weights())
            flight.weights.append(weight)
        if phase.part is PhasePart.PRE and phase.layer == 0:
            self.stage.hand_back(ctx, op, record.leaves, got)
            if op.kind is Kind.I:
                ctx.weights[op.key] = _merged(flight.weights)
            del self.flights[op.key]
        else:
            for leaf in record.leaves:
                leaf.grad = None
            self._hand_down(flight, phase.part, phase.layer, record.leaves, got)
        self.stage.drain(ctx, op.unit)

    def _again(self, ctx: StepContext, record: PhaseRecord) -> PhaseRecord:
        """A recomputed phase run again from its leaves, with its graph (its added losses
        the roots now); selected modules' regions replayed (runtime/engine/selective.py)."""
        if record.selected is not None:
            self.stage.replayed(ctx, Saved((), (), None, None, record.selected))
        if record.run is None:
            return record
        added: list[torch.Tensor] = []
        with torch.enable_grad(), self.stage.autocast(), collecting(added):
            outputs = record.run(False)
        return PhaseRecord(record.leaves, outputs, total(added))

    def _roots(
        self,
        ctx: StepContext,
        op: ComputeStep,
        flight: Flight,
        part: PhasePart,
        index: int,
        record: PhaseRecord,
    ) -> tuple[Tensors, Tensors]:
        """A backward phase's roots and their gradients (the added losses' last)."""
        if part is PhasePart.POST:
            return self.stage.output_grads(ctx, op, Saved((), record.outputs, record.added))
        layer = flight.layers[index]
        if part is PhasePart.EXPERTS:
            given: tuple[torch.Tensor | None, ...] = (_got(layer.grad_out, "combine-grad"),)
        else:
            given = (_got(layer.grad_tokens, "dispatch-grad"), *layer.grad_keep)
        live = [(o, g) for o, g in zip(record.outputs, given, strict=True) if o.requires_grad]
        roots, seeds = scaled_roots(record.added, ctx.scale)
        outputs = tuple(o for o, _ in live) + roots
        grads = tuple(g if g is not None else torch.zeros_like(o) for o, g in live) + seeds
        return outputs, grads

    def _hand_down(
        self,
        flight: Flight,
        part: PhasePart,
        index: int,
        leaves: Tensors,
        got: tuple[torch.Tensor | None, ...],
    ) -> None:
        """A backward phase's leaf gradients, left for the all-to-all or phase that takes them."""
        filled = tuple(
            g if g is not None else torch.zeros_like(x) for x, g in zip(leaves, got, strict=True)
        )
        if part is PhasePart.EXPERTS:
            flight.layers[index].grad_received = filled[0]
            return
        prev = flight.layers[index - 1]  # pre l (l > 0) and post: leaves of layer l-1's combine
        prev.grad_combined = filled[0]
        prev.grad_keep = tuple(
            g if x.requires_grad else None for x, g in zip(leaves[1:], filled[1:], strict=True)
        )

    def _flight(self, key: tuple[int, int]) -> Flight:
        found = self.flights.get(key)
        if found is None:
            raise ProgramError(f"no MoE forward of (chunk, mb) {key} is in flight")
        return found

    # ---- all-to-alls -----------------------------------------------------------------------

    def post(self, ctx: StepContext, step: AllToAllStep) -> list[Ticket]:
        """Post an all-to-all (its result lands where the phase that consumes it looks);
        the interpreter completes it: at once, or at the `Wait` that lists it."""
        return [self.exchange.post(self._flight(step.key).layers[step.layer], step.direction)]

    @property
    def waited(self) -> float:
        """Seconds the compute thread blocked on all-to-alls, over the runtime's life."""
        return self.exchange.waited[0]

    @property
    def counted(self) -> float:
        """Seconds the poster spent exchanging token counts (hidden from compute)."""
        return self.exchange.counted[0]


def moe_ops(
    ranks: Sequence[Sequence[Instr]],
    rank: int,
    stage: StageOps,
    mesh: Any,
    timeout: float,
) -> MoEOps | None:
    """This rank's `MoEOps` when the program has phases (None otherwise: the runtime's path
    is as it was). Every rank makes the all-to-alls' groups (`a2a_group`); each MoE block
    keeps its EP rank's share of the experts; the group is warmed at set-up. What cannot
    run is in `problems()` (reported with every rank's before the first step)."""
    if not any(type(instr) is Phase for instrs in ranks for instr in instrs):
        return None
    group, size, index = a2a_group(mesh)
    if not any(type(instr) is Phase for instr in ranks[rank]):
        return None
    found = stage_problems(ranks[rank], stage)
    if not found:  # the stages the program runs in phases keep their EP rank's experts
        phased = {x.op.chunk: x.op.stage for x in ranks[rank] if type(x) is Phase}
        held = [(s, stage.chunks[c].module, stage.chunks[c].sharded) for c, s in phased.items()]
        found = keep_own(sorted(held, key=lambda h: h[0]), index, size)
    if group is not None:
        warm(group, stage.autocast_device)
    return MoEOps(stage, group, size, timeout, found)


def unsplit_problems(
    instrs: Sequence[Instr], modules: dict[int, nn.Module], mesh: Any
) -> list[str]:
    """On a mesh with ep > 1, each chunk of MoE blocks must run in the program's phases: run
    whole, its EP rank's experts would see only its own tokens and their gradients would not
    be reduced over ep (runtime/comm/mesh.py), a wrong gradient."""
    if mesh is None or "ep" not in (mesh.mesh_dim_names or ()) or mesh["ep"].size() == 1:
        return []
    phased = {x.op.chunk for x in instrs if type(x) is Phase}
    found = []
    for chunk, module in sorted(modules.items()):
        blocks = blocks_of(module)
        if blocks and chunk not in phased:
            found.append(
                f"chunk {chunk} holds {len(blocks)} MoE block(s) and the program runs it "
                f"without MoE phases on a mesh with ep={mesh['ep'].size()}: compile it with "
                "--moe K (pipecc run places the model file's layers; docs/parallelism.md)"
            )
    return found


def stage_problems(instrs: Sequence[Instr], stage: StageOps) -> list[str]:
    """Each chunk the program runs in phases must be a MoE stage with as many blocks as
    the program has MoE layers there (the layer of its post phase)."""
    layers = {
        x.op.chunk: (x.op.stage, x.layer)
        for x in instrs
        if type(x) is Phase and x.part is PhasePart.POST
    }
    found = []
    for chunk, (number, k) in sorted(layers.items()):
        held = stage.chunks.get(chunk)
        module = held.module if held is not None else None
        blocks = blocks_of(module) if module is not None else None
        if module is not None and blocks is None:
            found.append(
                f"stage {number} runs in MoE phases, but its module "
                f"({type(module).__name__}) has no moe_blocks (docs/runtime.md, MoE stages in "
                "phases)"
            )
        elif blocks is not None and len(blocks) != k:
            found.append(
                f"stage {number} runs in {k} MoE layer(s), but its module has "
                f"{len(blocks)} moe_blocks"
            )
    return found


def _blocks(module: nn.Module) -> list[Block]:
    found = blocks_of(module)
    if found is None:
        raise ProgramError(
            f"the program runs {type(module).__name__} in MoE phases, but it has no "
            "moe_blocks (runtime/engine/moe_block.py: the MoE stage contract)"
        )
    return list(found)


def _part(module: nn.Module, name: str) -> Callable[..., Any]:
    """A MoE stage's `moe_head` or `moe_tail` (the contract, runtime/engine/moe_block.py)."""
    found = getattr(module, name, None)
    if not callable(found):
        raise ProgramError(f"the MoE stage {type(module).__name__} has no method {name}")
    return cast(Callable[..., Any], found)


def _leaf(tensor: torch.Tensor, grad: bool) -> torch.Tensor:
    return tensor.detach().requires_grad_(True) if grad else tensor.detach()


def _got(tensor: torch.Tensor | None, what: str) -> torch.Tensor:
    if tensor is None:
        raise ProgramError(f"the MoE phase needs what {what} leaves, and it has not run")
    return tensor


def _merged(weights: list[WeightGrad]) -> WeightGrad:
    """One W's work: every phase's, in the order I ran them."""
    merged = WeightGrad([], {})
    for weight in weights:
        merged.groups.extend(weight.groups)
        merged.recorded.update(weight.recorded)
        merged.deferred.extend(weight.deferred)
    return merged
