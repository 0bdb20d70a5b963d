"""What `pipecc run` adds for training features: the step's context and its added losses.

Kept apart from the launcher's loop (runtime/tools/launcher.py calls these): the losses
the stages added (`add_loss`) as each rank reports them, their sum over the ranks for
`--json` (`aux_loss`, `aux_loss_by_stage`), and each rank's modules by stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from pipecc.ir.program import Program

from ..pipeline import PipelineRuntime


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
