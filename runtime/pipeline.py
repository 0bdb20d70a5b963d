"""`PipelineRuntime`: one rank's part of a compiled `Program`, run one step at a time.

The runtime binds the program to this rank once (its chunks, plans, split-backward methods,
shared parameters) and builds the parts an `Interpreter` dispatches to. Each step splits the
batch and computes its input signature from host metadata (runtime/boundaries/signatures.py);
a new signature's boundaries are discovered with every rank on real data
(runtime/boundaries/discovery.py) and kept, with the plans bound to them, by the plan cache
(runtime/engine/plan_cache.py); then the bound plan runs in a fresh `StepContext`. A step
whose signature is known exchanges nothing outside the program.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace as dataclass_replace
from typing import Any, Literal, cast, overload

import torch
import torch.distributed as dist

from pipecc.diagnostics import InputError, ProgramError, RankError, SetupError
from pipecc.ir.program import Program

from .boundaries import discovery
from .boundaries.context import sample_context, split_context
from .boundaries.discovery import Exchange, Forward, PipeStages, StageFailed
from .boundaries.fingerprint import Fingerprint
from .boundaries.signatures import BoundaryFn, Signature, Signatures
from .boundaries.specs import Boundary
from .comm import agreement, mesh, shared, training
from .comm.agreement import ExchangeTimeout
from .comm.channel import Channel, uses_nccl
from .comm.failure import Guard, guarded
from .config import LossFn, RuntimeConfig, mse_loss
from .declared import declared_of, declared_problems, runtime_device
from .engine import aux_loss, stage_actions
from .engine.aux_loss import LossBreakdown
from .engine.bound import Binder, methods
from .engine.compute import StageOps, StageOptions
from .engine.context import Mailbox, StepContext
from .engine.fused import FusedOps
from .engine.interpreter import InstructionError, Interpreter, Parts
from .engine.moe_block import expert_params
from .engine.moe_ops import moe_ops, unsplit_problems
from .engine.plan_cache import PlanCache
from .engine.precision import Fp32Grads
from .engine.recompute import recomputed, selected_modules
from .engine.rng import ForwardRng, derive_seed
from .engine.split_backward import split_chunks
from .engine.transfers import Transfers
from .engine.watch import StepStats, check_losses, nonfinite_norm, nonfinite_stages, rows_of
from .plan import binding
from .plan.plan import build_plan, forward_only, mailbox
from .profiling.profiler import ProfilingInterpreter
from .profiling.recorder import Recorder


class PipelineRuntime:
    """Executes one rank's part of a compiled program, one step at a time.

    `modules[chunk]` is this rank's stage module for each chunk of the placement. The
    boundaries of each input signature are discovered on real data along the pipeline.
    `boundaries` (optional) declares them: `{s: specs}`, or a function of a sample
    microbatch of stage 0's input returning them; a declared boundary that the real run
    contradicts stops every rank (with `check_shapes`).
    """

    def __init__(
        self,
        program: Program,
        modules: Mapping[int, torch.nn.Module] | Sequence[torch.nn.Module],
        boundaries: Mapping[int, object] | BoundaryFn | None = None,
        *,
        loss_fn: LossFn = mse_loss,
        config: RuntimeConfig | None = None,
    ) -> None:
        self.program = program
        config = config or RuntimeConfig()
        self.config = config
        self.modules = dict(modules.items() if isinstance(modules, Mapping) else enumerate(modules))
        self.loss_fn = loss_fn
        self.group, rank_map = config.group, config.rank_map
        if config.mesh is not None:  # the pipeline is the mesh's pp dimension (comm/mesh.py)
            self.group, rank_map = mesh.pipeline_of(config.mesh, config.pp_dim)
        world = dist.get_world_size(self.group)
        self.rank_map = tuple(
            rank_map or dist.get_process_group_ranks(self.group or dist.group.WORLD)
        )
        self.device = runtime_device(config.device, self.modules, self.group)
        nccl = uses_nccl(self.group, self.device)
        limit = None if nccl else config.timeout
        self.declared = declared_of(boundaries)  # checked against the discovered ones
        self.signatures = Signatures(program.num_microbatches)
        self._limit = limit  # seconds the discovery's agreement waits for a rank (gloo)
        self._problem = binding.world_problem(
            program, world, self.rank_map, dist.get_rank()
        ) or binding.backend_problem(program, nccl=nccl)
        self.rank = self.rank_map.index(dist.get_rank()) if self._problem is None else -1
        self.channel = Channel(
            self.group, self.rank_map, timeout=config.timeout, nccl=nccl,
            poster_thread=config.gloo_poster_thread,
            direction_groups=config.gloo_direction_groups,
        )  # fmt: skip
        self.losses: dict[int, torch.Tensor] = {}
        self.aux_losses: dict[int, dict[int, torch.Tensor]] = {}  # by microbatch, then stage
        self.steps = 0  # completed training steps: the step index of the RNG derivation
        self.last_step: StepStats | None = None  # the last training step's times and rows
        self.guard = Guard(self.rank, self.rank_map)  # failures (runtime/comm/failure.py)
        self.peers = Exchange(self.group, self.rank_map, self.rank, self.device, limit, config.mesh)
        # what every rank must share, compared before any group of the program's is made
        discovery.agree_program(self.peers, Fingerprint.of(program, self.rank, self.modules))
        if self._problem is None:
            shared.refuse_unplaced(program, self.rank, config.shared, config.sums_in_program)
            self._bind()
            groups = (self.group, self.channel.downward, *self.sums.groups.values())
            self.guard = Guard(self.rank, self.rank_map, groups, close=not nccl)

    def _bind(self) -> None:
        """This rank's part of the program bound once: chunks, plans, sums, interpreter."""
        rank, config = self.rank, self.config
        self.chunks = binding.bind_chunks(self.program, rank, self.modules)
        stage_actions.accumulate_only(c.module for c in self.chunks.values())  # FSDP2 stages
        plans = (
            build_plan(list(enumerate(self.program.ranks[rank]))),
            build_plan(forward_only(self.program.ranks[rank])),
        )
        self.groups = shared.local_groups(self.program.placement, rank, self.modules, config.shared)
        params = shared.distinct(self.groups)
        self.grads = Fp32Grads(params) if config.fp32_grads else shared.ParamGrads()
        self.to_sum = shared.to_sum(self.groups, self.grads)
        first = mesh.replica_index(config.mesh, config.pp_dim) * (
            self.program.num_microbatches
        )  # microbatches numbered over the global batch (runtime/engine/rng.py)
        self.rng = ForwardRng(self.device, config.seed, enabled=config.derive_rng, first=first)
        stage = StageOps(rank, self.chunks, self.loss_fn, self.rng, self._stage_options())
        captures = methods(self.chunks, split_chunks(self.program.ranks[rank]))
        transfers = Transfers(self.channel, self.device, config.timeout)
        self.sums = shared.GradientSums(
            self.program, rank, self.to_sum, self.grads, device=self.device,
            enabled=config.sync_duplicated, required=config.sums_in_program,
        )  # fmt: skip
        self.sums.create_groups(self.program, self.rank_map, self.group, config.timeout)
        fused = FusedOps(stage, self.device)
        self.moe = moe_ops(self.program.ranks, rank, stage, config.mesh, config.timeout)
        experts = expert_params([c.module for c in self.chunks.values()])  # this EP rank's
        self.mesh = mesh.DataParallel(
            self.program, rank, self.modules, config.mesh, device=self.device, experts=experts
        )
        parts = Parts(rank, stage, fused, transfers, self.sums, self.mesh, self.moe)
        self.interpreter = Interpreter(parts)
        slots = mailbox(self.program.ranks[rank])
        binder = Binder(stage, fused, self.channel, slots, captures, mesh=config.mesh)
        self.plans = PlanCache(binder, plans, self.program, rank, kept=config.plans_kept)

    def _stage_options(self) -> StageOptions:
        """How the stages compute (RuntimeConfig: autocast, fp32 gradients, recomputation)."""
        placement = self.program.placement
        stages = max(placement.num_stages(p) for p in range(placement.num_pipes))
        recompute, grads = self.config.recompute, self.grads
        selected = selected_modules(recompute, stages, self.chunks)
        precision = grads if isinstance(grads, Fp32Grads) else None
        options = (recomputed(recompute, stages), selected)
        return StageOptions(self.device, self.config.autocast, precision, *options)

    # ---- public API ------------------------------------------------------------------------

    @guarded(after=0)
    def step(
        self,
        inputs: object = None,
        targets: object = None,
        *,
        context: object = None,
        recorder: Recorder | None = None,
        loss_scale: float = 1.0,
        through: Callable[[Interpreter], Interpreter] | None = None,
    ) -> torch.Tensor | None:
        """One training step: forward and backward of all M microbatches.

        Gradients accumulate into `.grad` as the mean over microbatches (zero them before, as
        with a single-process step). Returns the mean loss of the microbatches whose last
        stage lives on this rank (None elsewhere); `self.losses` maps each to its loss, and
        `self.aux_losses` each microbatch to the losses its stages on this rank added
        (`add_loss`), by stage. `context`: a dict of every stage's keyword inputs, split
        into microbatches like the inputs (runtime/boundaries/context.py); every rank
        passes the same one. `recorder`: time every instruction into it
        (runtime/profiling/profiler.py). `loss_scale`: each microbatch's loss (and added
        loss) is multiplied by it before its backward, so `.grad` gets `loss_scale` times the
        mean; `1/K` for K accumulated steps leaves the mean over their K·M microbatches
        (losses reported unscaled). `through`: run the step through the interpreter it makes
        of the runtime's (runtime/engine/interpreter.py). Then `self.last_step` holds the
        step's times and rows; a failure fails the runtime on every rank (`RuntimeFailed`)."""
        start = time.perf_counter()
        ctx = self._context(inputs, targets, training=True, context=context, loss_scale=loss_scale)
        interpreter = self.interpreter
        if recorder is not None:
            interpreter = ProfilingInterpreter(interpreter, recorder)
        if through is not None:
            interpreter = through(interpreter)
        precision = self.grads if isinstance(self.grads, Fp32Grads) else None
        if self.config.sync_duplicated:
            shared.count_once(self.to_sum, self.rank)  # accumulated gradients counted once
        if precision is not None:
            precision.begin()
        with self.rng.step_scope():
            interpreter.run(self.plans.bound(training=True), ctx)
        self._finish(interpreter, ctx)
        if after := self.sums.after_program():  # no sums placed, or this rank's own copies
            summed = time.perf_counter()
            shared.sum_shared(self.channel, self.rank, after, self.device, self.grads)
            if recorder is not None:
                recorder.sync(summed, time.perf_counter())
        if precision is not None:
            precision.end()
        if self.config.check_finite:
            self._check_finite(ctx)
        self.steps += 1
        seconds = time.perf_counter() - start
        rows = rows_of(self.plans.boundaries(), self.program)
        self.last_step = StepStats(ctx.step, seconds, interpreter.waited, rows)
        return self._loss_of(ctx)

    def _check_finite(self, ctx: StepContext) -> None:
        last = self.program.placement.num_stages(0) - 1
        check_losses((self.rank, ctx.step), ctx.losses, ctx.aux_losses, last)

    @guarded(after=0)
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
                self.interpreter.run(self.plans.bound(training=False), ctx)
            self._finish(self.interpreter, ctx)
        self._loss_of(ctx)
        return dict(sorted(ctx.outputs.items()))

    @property
    def boundaries(self) -> dict[int, Boundary]:
        """The current signature's boundaries, `{stage: input of one microbatch}` (empty
        before the first step)."""
        return self.plans.boundaries()

    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameters, each object once (a weight used by two of its chunks, a
        tied weight, is listed once): what an optimizer on this rank should step."""
        return shared.distinct(self.groups)

    @property
    def needs_inputs(self) -> bool:
        """Whether this rank consumes the step's inputs: it holds stage 0 of a pipe (DualPipe:
        both end ranks; a V shape: rank 0). Under `static_shapes` only these ranks need to
        load the batch's inputs (docs/recipes.md, "Data where it is needed")."""
        return any(slot.stage == 0 for slot in self._slots())

    @property
    def needs_targets(self) -> bool:
        """Whether this rank consumes the step's targets: it holds the last stage of a pipe."""
        placement = self.program.placement
        return any(placement.is_last_stage(s.pipe, s.stage) for s in self._slots())

    def _slots(self) -> list[Any]:
        if self._problem is not None:
            raise SetupError(self._problem)
        return list(self.program.placement.chunks(self.rank))

    def state_dict(self) -> dict[str, int]:
        """The runtime's own state, for a checkpoint (runtime/checkpoint.py): the completed
        steps (the step index of the dropout masks' derivation) and the seed."""
        return {"steps": self.steps, "seed": self.config.seed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from a `state_dict()`: the next step is step `steps` of the run that
        saved it, its dropout masks derived from the saved seed."""
        self.steps = int(state["steps"])
        self.config = dataclass_replace(self.config, seed=int(state["seed"]))
        if self._problem is None:
            self.rng.seed_value = self.config.seed

    @guarded(after=1)
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Scale every gradient so that the norm over the whole pipeline's parameters (each
        parameter held by several ranks counted once) is at most `max_norm`; returns the
        norm before clipping, the same on every rank. A collective: every rank calls it.
        `error_if_nonfinite` (or `RuntimeConfig(check_finite=True)`): a norm that is nan or
        inf raises `NonFiniteError` on every rank, the gradients untouched (as torch's)."""
        mine = shared.owned(self.groups, self.rank)
        total = training.global_norm(
            mine, self.grads, norm_type, self.group, self.device, self._limit
        )
        value = float(total)
        if (error_if_nonfinite or self.config.check_finite) and not torch.isfinite(total):
            stages = nonfinite_stages(self.chunks.values(), self.grads.get)
            where = (self.rank, max(self.steps - 1, 0))
            raise self.guard.passing(nonfinite_norm(where, total, norm_type, stages))
        training.scale_grads(self.parameters(), float(max_norm) / (value + 1e-6))
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
        found = self._breakdown()
        if breakdown:
            return found
        return torch.tensor(found.total, dtype=torch.float32, device=self.device)

    @guarded(after=1)
    def _breakdown(self) -> LossBreakdown:
        found = aux_loss.breakdown(  # one all-reduce, alike on every rank
            self.losses, self.aux_losses, self.program.placement.num_stages(0), self.group,
            self.device, self._limit,
        )  # fmt: skip
        return aux_loss.over_replicas(found, self.config.mesh, self.config.pp_dim, self.device)

    # ---- the step --------------------------------------------------------------------------

    def _context(
        self,
        inputs: object,
        targets: object,
        *,
        training: bool,
        context: object = None,
        loss_scale: float = 1.0,
    ) -> StepContext:
        """Split the batch and learn the step's signature; a new one is discovered. Each
        microbatch's loss is scaled by `loss_scale` / M."""
        if self._problem is not None:  # the same on every rank: it fails nothing
            raise self.guard.passing(SetupError(self._problem))
        found: list[str] = []
        where, microbatches = f"rank {self.rank}, step {self.steps}", self.program.num_microbatches
        try:  # raised alike on every rank given the batch: it fails nothing
            binding.check_rows(inputs, "inputs", microbatches, where)
            if self.needs_targets:
                binding.check_rows(targets, "targets", microbatches, where)
        except InputError as err:
            raise self.guard.passing(err) from None
        contexts = split_context(context, self.program.num_microbatches, self.device, found)
        signature = self._signature(inputs, found, context if contexts else None)
        split_inputs = split_targets = None  # ranks that do not use them copy nothing
        if self.needs_inputs and not found:
            split_inputs = self._split(inputs, "inputs", found, required=True)
        if self.needs_targets:
            split_targets = self._split(targets, "targets", found, required=training)
        if signature is None or not self.plans.known(signature.code):
            # discovery runs on the sample context; what its forwards add (add_loss) is dropped
            with sample_context(contexts[0] if contexts else None), aux_loss.collecting([]):
                self._settle(signature, found, split_inputs)
        elif found:  # a known signature: nothing is exchanged, this rank stops alone
            raise SetupError(f"rank {self.rank}, step {self.steps}: " + "; ".join(found))
        elif signature.code != self.plans.code:  # seen before: switched to locally
            self.plans.use(signature.code)
        scale = loss_scale / self.program.num_microbatches
        mail = Mailbox(self.plans.bound(training).messages)
        return StepContext(
            split_inputs, split_targets, scale, training, step=self.steps, mail=mail,
            context=contexts,
        )  # fmt: skip

    def _signature(
        self, inputs: object, found: list[str], context: object = None
    ) -> Signature | None:
        """The step's signature from this rank's inputs (host metadata only); under
        `static_shapes` a rank without inputs keeps the current one. None: to be learned
        from the other ranks (first step, static shapes), or unusable (in `found`)."""
        current = self.plans.code
        where = f"rank {self.rank}, step {self.steps}"
        if inputs is None:
            if self.config.static_shapes:
                return Signature(current, self._input_boundary()) if current else None
            if current:
                raise SetupError(f"{where}: {NO_INPUTS}")
            found.append(NO_INPUTS)
            return None
        try:
            signature = self.signatures.of(inputs, cast(Mapping[str, Any] | None, context))
        except InputError as err:
            found.append(err.message)
            return None
        if self.config.static_shapes and current and signature.code != current:
            # raised alike on every rank given the inputs: it fails nothing
            raise self.guard.passing(
                SetupError(
                    f"{where}: RuntimeConfig(static_shapes=True) declares that the shapes never "
                    f"change, but the step's inputs are {signature.boundary.describe()} per "
                    f"microbatch, not {self._input_boundary().describe()}"
                )
            )
        return signature

    def _settle(
        self, signature: Signature | None, found: list[str], split_inputs: list[object] | None
    ) -> None:
        """Discover a new signature with every rank (runtime/boundaries/discovery.py), check
        it and switch to it. Its errors are the same on every rank and fail nothing, but a
        rank that does not come (a timeout) fails the runtime."""
        try:
            agreed, boundaries = self._discover(signature, found, split_inputs)
        except SetupError as err:
            raise self.guard.passing(err) from err.__cause__
        except ExchangeTimeout as err:
            raise RankError(
                f"rank {self.rank}, step {self.steps}: the discovery of the step's boundaries "
                f"did not complete within {self._limit:g} s: {err}"
            ) from err
        self.plans.learn(agreed.code, boundaries)

    def _discover(
        self, signature: Signature | None, found: list[str], split_inputs: list[object] | None
    ) -> tuple[Signature, dict[int, Boundary]]:
        config = self.config
        forward = Forward(config.autocast, self._seed_of, f"rank {self.rank}, step {self.steps}")
        exchange, problems = self.peers, found + self._problems()
        agreed = discovery.agree_signature(exchange, signature, problems, forward)
        stages = PipeStages.of(self.program, self.rank, self.modules)
        first = split_inputs[0] if split_inputs else None
        try:
            boundaries = discovery.along_pipeline(exchange, stages, first, agreed, forward)
        except StageFailed as err:  # the user's exception, with its traceback
            raise self.guard.passing(InstructionError(err.message)) from err.__cause__
        self._agree(binding.boundary_problems(self.program, self.rank, boundaries)
                    + self._declared_problems(agreed, boundaries))  # fmt: skip
        return agreed, boundaries

    def _input_boundary(self) -> Boundary:
        """Stage 0's input boundary of the signature in use."""
        return self.plans.current.boundaries[0]

    def _seed_of(self, stage: int) -> int | None:
        """The RNG seed of (this step, `stage`, this process's microbatch 0), as its forward
        derives it."""
        if not self.config.derive_rng:
            return None
        return derive_seed(self.config.seed, self.steps, stage, self.rng.first)

    def _split(
        self, value: object, what: str, found: list[str], *, required: bool
    ) -> list[object] | None:
        return binding.split_batch(value, what, self.program, self.device, found, required=required)

    def _problems(self) -> list[str]:
        """Modules and shared parameters (checked with every new signature)."""
        config = self.config
        found = binding.module_problems(self.program, self.rank, self.modules)
        held = {chunk: held.module for chunk, held in self.chunks.items()}
        found += stage_actions.fsdp_problems(self.program.ranks[self.rank], held)
        placement = self.program.placement
        found += shared.sharing_problems(placement, self.rank, self.modules, config.shared)
        found += self.moe.problems() if self.moe is not None else []
        found += unsplit_problems(self.program.ranks[self.rank], held, config.mesh)
        return found + self.sums.problems() + self.mesh.problems()

    def _declared_problems(self, agreed: Signature, boundaries: dict[int, Boundary]) -> list[str]:
        """Where the boundaries the user declared differ from those found."""
        if self.declared is None or not self.config.check_shapes:
            return []
        return declared_problems(
            self.declared, agreed.boundary, boundaries, (self.program, self.rank, self.steps)
        )

    def _agree(self, found: list[str]) -> None:
        named = [f"rank {self.rank}: {text}" for text in found]
        agreement.agree(named, self.group, self.program.num_ranks, self.device, self._limit)

    def _finish(self, interpreter: Interpreter, ctx: StepContext) -> None:
        left = interpreter.leftovers(ctx)
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


NO_INPUTS = (
    "was given no inputs: every rank needs the step's inputs to learn the step's shape "
    "signature (only their shapes are read; nothing is copied), or declare "
    "RuntimeConfig(static_shapes=True) when the shapes never change"
)
