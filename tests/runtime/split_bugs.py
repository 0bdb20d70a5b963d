"""examples/decoder.py with a wrong split, chosen by PIPECC_SPLIT_BUG, for `--reference
whole`: `drop-norm` (the last stage leaves out the final layer norm), `forget-layer` (the
stage holding layer 1 leaves it out), `unused-norm` (the last stage holds the final norm
but never applies it). The stage-by-stage reference cannot see any of them."""

from __future__ import annotations

import os
import runpy
from pathlib import Path

from torch import nn

decoder = runpy.run_path(str(Path(__file__).parents[2] / "examples" / "decoder.py"))
make_batch, loss_fn, build_model = decoder["make_batch"], decoder["loss_fn"], decoder["build_model"]


def build_stage(stage: int, num_stages: int) -> nn.Module:
    return broken(decoder["build_stage"](stage, num_stages), os.environ.get("PIPECC_SPLIT_BUG"))


def broken(module: nn.Module, bug: str | None) -> nn.Module:
    if bug == "drop-norm" and module.norm is not None:
        module.norm = None
    if bug == "forget-layer" and "1" in module.layers._modules:
        del module.layers._modules["1"]
    if bug == "unused-norm" and module.norm is not None:
        module.norm.forward = lambda h: h  # held, never applied
    return module
