"""What `pipecc run` checks of a model file's MoE stages against the program it runs.

The compiler splits a program for `--moe K` (pipecc/passes/expand_moe.py): each F, B and I of
a stage with K MoE layers becomes its phases with an all-to-all over `ep` between each two,
verified with every other op. `pipecc run` runs such a program as it is, and refuses a model
of MoE stages on an `ep` mesh given a program without them (`refuse_unsplit`): splitting it
after the verification would run what the verifier never saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pipecc.diagnostics import InputError
from pipecc.ir.program import Program

from ..engine.moe_block import blocks_of
from .model_file import ModelFile, load_model


def moe_layers(stages: Sequence[torch.nn.Module]) -> tuple[int, ...]:
    """The MoE blocks of each stage (0 for a stage that is no MoE stage)."""
    return tuple(len(blocks_of(stage) or ()) for stage in stages)


def moe_layers_of(path: str, num_stages: int) -> tuple[int, ...]:
    """The MoE blocks of each of the model file's `num_stages` stages (`pipecc run` on an ep
    mesh without --moe places them, as --moe would; docs/parallelism.md)."""
    return stage_moe_layers(load_model(path), num_stages)


def stage_moe_layers(model: ModelFile, num_stages: int) -> tuple[int, ...]:
    """The MoE blocks of each stage, counted on stages built on the meta device in the
    launcher's process (no memory, no initialisation: only the structure is read; a rank
    builds its own stages for real), or built for real where the model needs real tensors
    to build."""
    try:
        with torch.device("meta"):
            return moe_layers(model.all_stages(num_stages))
    except Exception:  # noqa: BLE001 - a model that needs real tensors to build
        return moe_layers(model.all_stages(num_stages))


def refuse_unsplit(program: Program, mesh: Any, layers: Sequence[int], model: str) -> None:
    """On a mesh with ep > 1 a model's MoE stages run in phases, with their all-to-alls:
    the program `pipecc run` resolved and verified with them (--moe K, or the model file's
    layers), never one split after the verification. A program that does not split every
    stage holding MoE blocks (none, or --moe 0) is refused: its experts, each EP rank's
    own, would be neither exchanged nor reduced over ep (a wrong gradient)."""
    if mesh is None or mesh.ep == 1:
        return
    split = program.moe or (0,) * len(layers)
    unsplit = [s for s, k in enumerate(layers) if k and not split[s]]
    if not unsplit:
        return
    said = ", ".join(f"stage {s} ({layers[s]})" for s in unsplit)
    raise InputError(
        f"{model}: on the mesh with ep={mesh.ep} its stages hold MoE blocks the program does "
        f"not run in phases: {said}; leave --moe out (the model file's layers are placed) "
        "or give --moe K, so that the program run holds their dispatch and combine "
        "all-to-alls, verified with every other op (docs/parallelism.md)"
    )
