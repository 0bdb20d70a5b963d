"""`PipelineRuntime`: one rank's part of a compiled `Program`, run one step at a time.

The runtime binds the program to this rank once (its chunks and their modules, the plans to
walk, the parameters it shares with other ranks), builds the parts an `Interpreter` dispatches
to, and for each step: splits the batch, learns the step's shapes with the other ranks
(runtime/boundaries/signatures.py; a new signature is checked on every rank together, before
any point-to-point op, runtime/plan/binding.py), runs the plan in a fresh `StepContext` (the
gradient sums of parameters held by several ranks are instructions of it,
runtime/comm/shared.py; a program without them gets them after it).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from pipecc.diagnostics import ProgramError, SetupError
from pipecc.ir.ops import Msg
from pipecc.ir.program import Program

from .boundaries.context import rows_problem, sample_context, split_context
from .boundaries.signatures import BoundaryFn, BoundaryFnError, Gather, Seen, Signatures
from .boundaries.specs import Boundary, Specs
from .comm import agreement, shared, training
from .comm.channel import Channel, uses_nccl
from .config import LossFn, RuntimeConfig, mse_loss
from .engine import aux_loss
from .engine.aux_loss import LossBreakdown
from .engine.compute import StageOps
from .engine.context import StepContext
from .engine.fused import FusedOps
from .engine.interpreter import Interpreter
from .engine.precision import Fp32Grads
from .engine.rng import ForwardRng
from .engine.split_backward import split_chunks
from .engine.transfers import Transfers
from .plan import binding
from .plan.plan import build_plan, forward_only
from .profiling.profiler import ProfilingInterpreter
from .profiling.recorder import Recorder


class PipelineRuntime:
    """Executes one rank's part of a compiled program, one step at a time.

    `modules[chunk]` is this rank's stage module for each chunk of the placement;
    `boundaries`: the input of each stage s for one microbatch, `{s: specs}` (fixed shapes),
    or a function of a sample microbatch of stage 0's input returning them (shapes learned
    per step), e.g. `lambda sample: infer_boundaries(stages, sample)`.
    """

    def __init__(
        self,
        program: Program,
        modules: Mapping[int, torch.nn.Module] | Sequence[torch.nn.Module],
        boundaries: Mapping[int, object] | BoundaryFn,
        *,
        loss_fn: LossFn = mse_loss,
        config: RuntimeConfig | None = None,
    ) -> None:
        self.program = program
        config = config or RuntimeConfig()
        self.config = config
        self.modules = dict(modules.items() if isinstance(modules, Mapping) else enumerate(modules))
        self.loss_fn = loss_fn
        self.group = config.group
        world = dist.get_world_size(self.group)
        self.rank_map = tuple(
            config.rank_map or dist.get_process_group_ranks(self.group or dist.group.WORLD)
        )
        self.device = config.device or _device_of(self.modules)
        nccl = uses_nccl(self.group, self.device)
        limit = None if nccl else config.timeout
        self.signatures = Signatures(boundaries, self.group, world, self.device, limit)
        self._problem = binding.world_problem(
            program, world, self.rank_map, dist.get_rank()
        ) or binding.backend_problem(program, nccl=nccl)
        self.rank = self.rank_map.index(dist.get_rank()) if self._problem is None else -1
        self.channel = Channel(self.group, self.rank_map, timeout=config.timeout, nccl=nccl)
        self.losses: dict[int, torch.Tensor] = {}
        self.aux_losses: dict[int, dict[int, torch.Tensor]] = {}  # by microbatch, then stage
        self.steps = 0  # completed training steps: the step index of the RNG derivation
        self._recv_specs: dict[int, dict[tuple[Msg, int, int], Specs]] = {}
        if self._problem is None:
            self._bind()

    def _bind(self) -> None:
        rank, config = self.rank, self.config
        self.chunks = binding.bind_chunks(self.program, rank, self.modules)
        self.plan = build_plan(list(enumerate(self.program.ranks[rank])))
        self.forward_plan = build_plan(forward_only(self.program.ranks[rank]))
        self.groups = shared.local_groups(self.program.placement, rank, self.modules, config.shared)
        params = shared.distinct(self.groups)
        self.grads = Fp32Grads(params) if config.fp32_grads else shared.ParamGrads()
        self.to_sum = shared.to_sum(self.groups, self.grads)
        self.rng = ForwardRng(self.device, config.seed, enabled=config.derive_rng)
        stage = StageOps(rank, self.chunks, self.loss_fn, self.rng, (self.device, config.autocast))
        stage.precision = self.grads if isinstance(self.grads, Fp32Grads) else None
        stage.split = split_chunks(self.program.ranks[rank])
        transfers = Transfers(self.channel, {}, self.device, config.timeout)
        self.sums = shared.GradientSums(
            self.program, rank, self.to_sum, self.grads, device=self.device
        )
        self.sums.enabled = config.sync_duplicated
        self.sums.create_groups(self.program, self.rank_map, self.group, config.timeout)
        self.interpreter = Interpreter(
            rank, stage, FusedOps(stage, self.device), transfers, self.sums
        )

    # ---- public API ------------------------------------------------------------------------

    def step(
        self,
        inputs: object = None,
        targets: object = None,
        *,
        context: object = None,
        recorder: Recorder | None = None,
    ) -> torch.Tensor | None:
        """One training step: forward and backward of all M microbatches.

        Gradients accumulate into `.grad` as the mean over microbatches (zero them before, as
        with a single-process step). Returns the mean loss of the microbatches whose last
        stage lives on this rank (None elsewhere); `self.losses` maps each to its loss, and
        `self.aux_losses` each microbatch to the losses its stages on this rank added
        (`add_loss`), by stage. `context`: a dict of every stage's keyword inputs, split
        into microbatches like the inputs (runtime/boundaries/context.py); every rank
        passes the same one. `recorder`: time every instruction into it
        (runtime/profiling/profiler.py).
        """
        ctx = self._context(inputs, targets, training=True, context=context)
        interpreter = self.interpreter
        if recorder is not None:
            interpreter = ProfilingInterpreter(interpreter, recorder)
        precision = self.grads if isinstance(self.grads, Fp32Grads) else None
        if self.config.sync_duplicated:
            shared.count_once(self.to_sum, self.rank)  # accumulated gradients counted once
        if precision is not None:
            precision.begin()
        with self.rng.step_scope():
            interpreter.run(self.plan, ctx)
        ctx.settle()
        self._finish(ctx)
        if self.config.sync_duplicated and self.to_sum and self.sums.outside:
            start = time.perf_counter()  # a program without its sums: after it (shared.py)
            shared.sum_shared(self.channel, self.rank, self.to_sum, self.device, self.grads)
            if recorder is not None:
                recorder.sync(start, time.perf_counter())
        if precision is not None:
            precision.end()
        self.steps += 1
        return self._loss_of(ctx)

    def forward(
        self, inputs: object = None, targets: object = None, *, context: object = None
    ) -> dict[int, object]:
        """Forward only (evaluation): the program's forwards and activation messages, under
        `torch.no_grad()`. Returns the outputs of the microbatches whose last stage lives
        here, by microbatch; with `targets`, `self.losses` holds their losses (and
        `self.aux_losses` the added ones). `context` as for `step`."""
        with torch.no_grad():
            ctx = self._context(inputs, targets, training=False, context=context)
            with self.rng.step_scope():
                self.interpreter.run(self.forward_plan, ctx)
            ctx.settle()
            self._finish(ctx)
        self._loss_of(ctx)
        return dict(sorted(ctx.outputs.items()))

    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameters, each object once (a weight used by two of its chunks, a
        tied weight, is listed once): what an optimizer on this rank should step."""
        return shared.distinct(self.groups)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every gradient so that the norm over the whole pipeline's parameters (each
        parameter held by several ranks counted once) is at most `max_norm`; returns the
        norm before clipping, the same on every rank. A collective: every rank calls it."""
        mine = shared.owned(self.groups, self.rank)
        total = training.global_norm(mine, self.grads, norm_type, self.group, self.device)
        training.scale_grads(self.parameters(), float(max_norm) / (float(total) + 1e-6))
        return total

    @overload
    def global_loss(self, *, breakdown: Literal[False] = False) -> torch.Tensor: ...
    @overload
    def global_loss(self, *, breakdown: Literal[True]) -> LossBreakdown: ...
    def global_loss(self, *, breakdown: bool = False) -> torch.Tensor | LossBreakdown:
        """The last step's loss over all M microbatches, on every rank (a collective: every
        rank calls it): the mean main loss plus the mean of the losses added inside the
        stages (`add_loss`), the loss whose gradient `.grad` holds. `breakdown=True`
        returns a `LossBreakdown`: total, main, added, and added by stage."""
        found = aux_loss.breakdown(  # one all-reduce, alike on every rank
            self.losses, self.aux_losses, self.program.placement.num_stages(0), self.group,
            self.device,
        )  # fmt: skip
        if breakdown:
            return found
        return torch.tensor(found.total, dtype=torch.float32, device=self.device)

    # ---- the step --------------------------------------------------------------------------

    def _context(
        self, inputs: object, targets: object, *, training: bool, context: object = None
    ) -> StepContext:
        """Split the batch, learn the step's shapes; a new signature is checked everywhere."""
        if self._problem is not None:
            raise SetupError(self._problem)
        found: list[str] = []
        holds_first = any(c.first for c in self.chunks.values())
        holds_last = any(c.last for c in self.chunks.values())
        split_inputs = split_targets = None  # ranks that do not use them copy nothing
        if holds_first:
            split_inputs = self._split(inputs, "inputs", found, required=True)
        if holds_last:
            split_targets = self._split(targets, "targets", found, required=training)
        contexts = split_context(context, self.program.num_microbatches, self.device, found)
        sample = split_inputs[0] if split_inputs else None
        if (wrong := rows_problem(sample, contexts[0] if contexts else None)) is not None:
            found.append(wrong)
        gather = self.signatures.start(sample, bool(found), contexts[0] if contexts else None)
        scale = 1.0 / self.program.num_microbatches
        ctx = StepContext(split_inputs, split_targets, scale, training, step=self.steps)
        ctx.context = contexts
        settle = in_context(functools.partial(self._settle, gather, found), contexts)
        # Known shapes (this rank's inputs have the current signature, or it has none and
        # a signature is current): compute until the first post while the gather completes.
        known = self.signatures.current != 0 and gather.code in (0, self.signatures.current)
        if known:
            ctx.before_post = settle
        else:
            settle()
        return ctx

    def _settle(self, gather: Gather, found: list[str]) -> None:
        """Complete the step's signature gather; check and switch to new boundaries."""
        where = f"rank {self.rank}, step {self.steps}"
        try:
            seen, boundaries = self.signatures.finish(gather, where)
        except BoundaryFnError as err:  # every rank reports it (the others are in _agree)
            self._agree([*found, f"step {self.steps}: {err.message}"])
            raise
        if seen is Seen.UNUSABLE:
            self._agree(found)
            raise SetupError("the pipeline cannot start: a rank's batch is unusable")
        if seen is Seen.NEW:
            self._agree(found or self._problems(boundaries))
        if seen is not Seen.CURRENT:
            self._use(boundaries)

    def _split(
        self, value: object, what: str, found: list[str], *, required: bool
    ) -> list[object] | None:
        return binding.split_batch(value, what, self.program, self.device, found, required=required)

    def _problems(self, boundaries: dict[int, Boundary]) -> list[str]:
        """Modules, boundaries, shapes and shared parameters (first step and new shapes)."""
        config = self.config
        found = binding.problems(
            self.program, self.rank, self.modules, boundaries,
            check_shapes=config.check_shapes, autocast=config.autocast,
        )  # fmt: skip
        placement = self.program.placement
        found += shared.sharing_problems(placement, self.rank, self.modules, config.shared)
        return found + self.sums.problems()

    def _agree(self, found: list[str]) -> None:
        named = [f"rank {self.rank}: {text}" for text in found]
        agreement.agree(named, self.group, self.program.num_ranks, self.device)

    def _use(self, boundaries: dict[int, Boundary]) -> None:
        """Switch the primitives to a signature's boundaries and receive buffers."""
        key = self.signatures.current
        if key not in self._recv_specs:
            self._recv_specs[key] = binding.recv_specs(self.program, self.rank, boundaries)
        self.interpreter.stage.boundaries = boundaries
        self.interpreter.transfers.specs = self._recv_specs[key]

    def _finish(self, ctx: StepContext) -> None:
        left = ctx.leftovers()
        if left:
            raise ProgramError(
                f"rank {self.rank}, step {ctx.step}: the program ended with work left over: "
                + "; ".join(left)
            )

    def _loss_of(self, ctx: StepContext) -> torch.Tensor | None:
        self.losses = dict(sorted(ctx.losses.items()))
        self.aux_losses = {mb: dict(sorted(v.items())) for mb, v in sorted(ctx.aux_losses.items())}
        if not self.losses:
            return None
        return torch.stack(list(self.losses.values())).mean()


def in_context(settle: Callable[[], None], contexts: list[Any] | None) -> Callable[[], None]:
    """`settle` run with this rank's first context microbatch as boundary inference's
    sample context (a new signature runs the stages on it)."""
    if not contexts:
        return settle

    def run() -> None:
        with sample_context(contexts[0]):
            settle()

    return run


def _device_of(modules: Mapping[int, torch.nn.Module]) -> torch.device:
    for module in modules.values():
        for param in module.parameters():
            return param.device
    return torch.device("cpu")
