"""The tied parameters of a model file, found before `pipecc run` resolves its program.

A model file's ties are the groups of stages that hold one parameter: those its
`shared(num_stages)` declares (stages built apart by `build_stage`, callable without
building anything), and, for `build_stages` (every rank builds the whole model), the
`Parameter` objects found in two stages, on stages built on the meta device (no memory,
no initialisation: the identity of the objects is all that is read). `pipecc run` passes
them to the resolution as `--shared` would (pipecc/commands/run.py), so the program it
verifies holds the gradient sum of every tie across ranks, and the ranks refuse a program
that lacks one (`RuntimeConfig.sums_in_program`, runtime/comm/shared.py).
"""

from __future__ import annotations

import torch

from ..comm.shared import shared_parameters
from .model_file import load_model

Ties = tuple[tuple[int, ...], ...]  # groups of stages, as `--shared 0+3/1+2` gives them


def model_ties(path: str, num_stages: int, layers: tuple[tuple[str, ...], ...] | None) -> Ties:
    """The groups of two or more stages that hold one parameter in the model file at
    `path` cut into `num_stages` stages (`layers`: `--partition`'s cut), sorted. Where the
    stages cannot be built on the meta device, the ties found by identity are left to the
    ranks, which refuse a program without their sums (exit 2, naming the `--shared` that
    places them)."""
    model = load_model(path).with_cut(layers)
    groups = list(model.declared_shared(num_stages))
    if not model.own_stages:
        try:
            with torch.device("meta"):
                stages = model.all_stages(num_stages)
        except Exception:  # noqa: BLE001 - a model that needs real tensors to build
            stages = []
        groups += shared_parameters(stages) if stages else ()
    found = {tuple(sorted({stage for stage, _ in keys})) for keys in groups}
    return tuple(sorted(stages for stages in found if len(stages) > 1))
