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
from .model_file import load_model


def moe_layers(stages: Sequence[torch.nn.Module]) -> tuple[int, ...]:
    """The MoE blocks of each stage (0 for a stage that is no MoE stage)."""
    return tuple(len(blocks_of(stage) or ()) for stage in stages)


def moe_layers_of(path: str, num_stages: int) -> tuple[int, ...]:
    """The MoE blocks of each of the model file's `num_stages` stages, built once here (the
    launcher's process: `pipecc run` on an ep mesh without --moe places them, as --moe
    would; docs/parallelism.md)."""
    return moe_layers(load_model(path).all_stages(num_stages))


def refuse_unsplit(program: Program, mesh: Any, layers: Sequence[int], model: str) -> None:
    """On a mesh with ep > 1 a model of MoE stages runs in phases, with their all-to-alls:
    the program `pipecc run --moe K` resolved and verified (the compiler's expand_moe), never
    one split after the verification. A MoE model given a program without them is refused."""
    if program.moe is not None or mesh is None or mesh.ep == 1 or not any(layers):
        return
    raise InputError(
        f"{model}: its stages hold MoE layers ({', '.join(map(str, layers))} by stage) and the "
        f"mesh has ep={mesh.ep}: give --moe K (K MoE layers a stage), so that the program run "
        "holds their dispatch and combine all-to-alls, verified with every other op "
        "(docs/parallelism.md)"
    )
