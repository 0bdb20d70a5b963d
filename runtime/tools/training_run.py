"""What `pipecc run` adds for training features: the step's context and its added losses.

Kept apart from the launcher's loop (runtime/tools/launcher.py calls these): the first
microbatch of a batch with its context (boundary inference runs the stages on both), the
losses the stages added (`add_loss`) as each rank reports them, and their sum over the
ranks for `--json` (`aux_loss`, `aux_loss_by_stage`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pipecc.ir.program import Program

from ..boundaries.trees import split_tree
from ..pipeline import PipelineRuntime
from .reference import context_microbatches


def first_microbatch(batch: tuple[Any, ...], program: Program) -> tuple[Any, dict[str, Any]]:
    """Microbatch 0 of the batch's inputs and of its context (empty without one), on CPU."""
    cpu = torch.device("cpu")
    inputs = split_tree(batch[0], program.num_microbatches, "inputs", cpu)[0]
    return inputs, context_microbatches(batch, program.num_microbatches, cpu)[0]


def reported_aux(runtime: PipelineRuntime) -> dict[int, dict[int, float]]:
    """This rank's added losses of the last step, by microbatch then stage."""
    return {
        mb: {stage: float(v) for stage, v in by_stage.items()}
        for mb, by_stage in runtime.aux_losses.items()
    }


def aux_by_stage(
    per_rank: Sequence[Mapping[int, Mapping[int, float]]], microbatches: int
) -> dict[int, float]:
    """Each stage's added losses over every rank, as the mean over the microbatches."""
    found: dict[int, float] = {}
    for by_mb in per_rank:
        for by_stage in by_mb.values():
            for stage, value in by_stage.items():
                found[stage] = found.get(stage, 0.0) + value / microbatches
    return dict(sorted(found.items()))


def stages_of(
    program: Program, rank: int, modules: Mapping[int, torch.nn.Module]
) -> dict[int, torch.nn.Module]:
    """This rank's modules by stage (each of its chunks is another stage)."""
    return {slot.stage: modules[slot.chunk] for slot in program.placement.chunks(rank)}
