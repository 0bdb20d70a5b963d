"""The model file of `pipecc run`: what it must and may define.

Required: `build_stages(num_stages) -> list[nn.Module]` (the whole model as consecutive
stages, deterministic: every rank builds the same weights) and `make_batch(num_rows, seed)
-> (inputs, targets)` (inputs and targets any pytree of tensors, split along dim 0).
Optional: `loss_fn(output, target)` (default: mean squared error, for floating targets),
`boundaries(example_inputs)` (the boundary specs for one microbatch of stage 0's input, when
they cannot be inferred by running the stages) and `autocast` (a dtype the forwards run
under, e.g. `torch.bfloat16`).
"""

from __future__ import annotations

import runpy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from pipecc.diagnostics import InputError

from .config import mse_loss

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelFile:
    build_stages: Callable[[int], list[torch.nn.Module]]
    make_batch: Callable[..., tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    has_loss_fn: bool = True
    boundaries: Callable[[Any], Mapping[int, object]] | None = None
    autocast: torch.dtype | None = None


def load_model(path: str) -> ModelFile:
    """Read a model file; every way it can be unusable is an InputError."""
    if not Path(path).is_file():
        raise InputError(f"{path}: no such model file")
    try:
        names = runpy.run_path(path, run_name="pipecc_model")
    except Exception as err:
        raise InputError(
            f"{path}: the model file fails to load: {type(err).__name__}: {err}"
        ) from err
    for name in ("build_stages", "make_batch"):
        if not callable(names.get(name)):
            raise InputError(f"{path}: the model file must define {name}()")
    loss_fn = names.get("loss_fn", mse_loss)
    if not callable(loss_fn):
        raise InputError(f"{path}: loss_fn must be a function")
    boundaries = names.get("boundaries")
    if boundaries is not None and not callable(boundaries):
        raise InputError(f"{path}: boundaries must be a function of the example inputs")
    autocast = names.get("autocast")
    if autocast is not None and not isinstance(autocast, torch.dtype):
        raise InputError(f"{path}: autocast must be a torch dtype, e.g. torch.bfloat16")
    return ModelFile(
        names["build_stages"], names["make_batch"], loss_fn, "loss_fn" in names, boundaries,
        autocast,
    )  # fmt: skip


def check_targets(path: str, model: ModelFile, targets: object) -> None:
    """Integer targets need a loss_fn: the default (MSE) cannot take them."""
    if model.has_loss_fn:
        return
    for leaf in pytree.tree_leaves(targets):
        if isinstance(leaf, torch.Tensor) and not leaf.dtype.is_floating_point:
            dtype = str(leaf.dtype).removeprefix("torch.")
            raise InputError(
                f"{path}: make_batch returns {dtype} targets, but the model file defines no "
                "loss_fn and the default (mean squared error) needs floating targets: define "
                "loss_fn(output, target), e.g. a cross-entropy"
            )


def param_dtypes(stages: list[torch.nn.Module]) -> list[torch.dtype]:
    return sorted({p.dtype for s in stages for p in s.parameters()}, key=str)
