"""`PipelineRuntime`: one rank's part of a compiled `Program`, run one step at a time.

The runtime binds the program to this rank once (its chunks and their modules, the buffer
specs of what it receives, the plans to walk), builds the parts an `Interpreter` dispatches
to, and for each step makes a fresh `StepContext` (runtime/context.py), runs the plan and
sums the gradients of duplicated stages. The first step checks everything on every rank
together (runtime/setup.py) before any point-to-point op.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from pipecc.diagnostics import InputError, ProgramError, SetupError
from pipecc.ir.program import Program

from . import setup
from .comm import Channel, uses_nccl
from .config import LossFn, RuntimeConfig, mse_loss
from .context import StepContext, Tensors
from .duplicates import copies, sum_copies
from .fused import FusedOps
from .interpreter import Interpreter
from .plan import build_plan, forward_only
from .profile import Recorder
from .profiling import ProfilingInterpreter
from .specs import Boundaries, normalise_boundaries
from .stage import StageOps
from .transfers import Transfers


class PipelineRuntime:
    """Executes one rank's part of a compiled program, one step at a time.

    `modules[chunk]` is this rank's stage module for each chunk of the placement;
    `boundaries[s]` the specs of stage s's input (see `infer_boundaries`).
    """

    def __init__(
        self,
        program: Program,
        modules: Mapping[int, torch.nn.Module] | Sequence[torch.nn.Module],
        boundaries: Boundaries,
        *,
        loss_fn: LossFn = mse_loss,
        config: RuntimeConfig | None = None,
    ) -> None:
        self.program = program
        config = config or RuntimeConfig()
        self.config = config
        self.modules = dict(modules.items() if isinstance(modules, Mapping) else enumerate(modules))
        self.boundaries = normalise_boundaries(boundaries)
        self.loss_fn = loss_fn
        self.group = config.group
        world = dist.get_world_size(self.group)
        self.rank_map = tuple(
            config.rank_map or dist.get_process_group_ranks(self.group or dist.group.WORLD)
        )
        self.device = config.device or _device_of(self.modules)
        nccl = uses_nccl(self.group, self.device)
        self._problem = setup.world_problem(
            program, world, self.rank_map, dist.get_rank()
        ) or setup.backend_problem(program, nccl=nccl)
        self.rank = self.rank_map.index(dist.get_rank()) if self._problem is None else -1
        self.channel = Channel(self.group, self.rank_map, timeout=config.timeout, nccl=nccl)
        self.losses: dict[int, torch.Tensor] = {}
        self._ready = False
        if self._problem is None:
            self._bind()

    def _bind(self) -> None:
        rank = self.rank
        self.chunks = setup.bind_chunks(self.program, rank, self.modules)
        specs = setup.recv_specs(self.program, rank, self.boundaries)
        self.plan = build_plan(list(enumerate(self.program.ranks[rank])))
        self.forward_plan = build_plan(forward_only(self.program.ranks[rank]))
        self.shared = copies(self.program.placement, rank)
        stage = StageOps(rank, self.chunks, self.boundaries, self.loss_fn)
        transfers = Transfers(self.channel, specs, self.device, self.config.timeout)
        self.interpreter = Interpreter(rank, stage, FusedOps(stage, self.device), transfers)

    # ---- public API ------------------------------------------------------------------------

    def step(
        self, inputs: object = None, targets: object = None, *, recorder: Recorder | None = None
    ) -> torch.Tensor | None:
        """One training step: forward and backward of all M microbatches.

        Gradients accumulate into `.grad` as the mean over microbatches (zero them before, as
        with a single-process step). Returns the mean loss of the microbatches whose last
        stage lives on this rank (None elsewhere); `self.losses` maps each to its loss.
        `recorder`: time every instruction into it (runtime/profiling.py).
        """
        ctx = self._context(inputs, targets, training=True)
        interpreter = self.interpreter
        if recorder is not None:
            interpreter = ProfilingInterpreter(interpreter, recorder)
        interpreter.run(self.plan, ctx)
        self._finish(ctx)
        if self.config.sync_duplicated and self.shared:
            modules = {chunk: c.module for chunk, c in self.chunks.items()}
            start = time.perf_counter()
            sum_copies(self.channel, self.rank, self.shared, modules, self.device)
            if recorder is not None:
                recorder.sync(start, time.perf_counter())
        return self._loss_of(ctx)

    def forward(self, inputs: object = None, targets: object = None) -> dict[int, Tensors]:
        """Forward only (evaluation): the program's forwards and activation messages, under
        `torch.no_grad()`. Returns the outputs of the microbatches whose last stage lives
        here, by microbatch; with `targets`, `self.losses` holds their losses."""
        with torch.no_grad():
            ctx = self._context(inputs, targets, training=False)
            self.interpreter.run(self.forward_plan, ctx)
            self._finish(ctx)
        self._loss_of(ctx)
        return dict(sorted(ctx.outputs.items()))

    # ---- the step --------------------------------------------------------------------------

    def _context(self, inputs: object, targets: object, *, training: bool) -> StepContext:
        """Split the batch; on the first step, check everything on every rank together."""
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
        if not self._ready:
            self._first_step_checks(found)
        elif found:
            raise InputError(f"rank {self.rank}: " + "; ".join(found))
        scale = 1.0 / self.program.num_microbatches
        return StepContext(split_inputs, split_targets, scale, training)

    def _split(
        self, value: object, what: str, found: list[str], *, required: bool
    ) -> list[Tensors] | None:
        return setup.split_batch(value, what, self.program, self.device, found, required=required)

    def _first_step_checks(self, found: list[str]) -> None:
        """Modules, boundaries and shapes (runtime/setup.py), agreed by every rank."""
        if not found:
            config = self.config
            found = setup.problems(
                self.program, self.rank, self.modules, self.boundaries,
                check_shapes=config.check_shapes,
            )  # fmt: skip
        named = [f"rank {self.rank}: {text}" for text in found]
        setup.agree(named, self.group, self.program.num_ranks, self.device)
        self._ready = True

    def _finish(self, ctx: StepContext) -> None:
        left = ctx.leftovers()
        if left:
            raise ProgramError(
                f"rank {self.rank}: the program ended with work left over: " + "; ".join(left)
            )

    def _loss_of(self, ctx: StepContext) -> torch.Tensor | None:
        self.losses = dict(sorted(ctx.losses.items()))
        if not self.losses:
            return None
        return torch.stack(list(self.losses.values())).mean()


def _device_of(modules: Mapping[int, torch.nn.Module]) -> torch.device:
    for module in modules.values():
        for param in module.parameters():
            return param.device
    return torch.device("cpu")
