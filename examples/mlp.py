"""A model file for `pipecc run`: an MLP of Linear+GELU blocks, cut into equal stages.

    pipecc run schedules/zb_h1.sched --nproc 4 --microbatches 8 --model examples/mlp.py --check

`pipecc run` calls `build_stages(num_stages)` on every rank (same seed, same weights),
`make_batch(num_rows, seed)` for each step, and `loss_fn(output, target)`. The sizes can be
changed with environment variables: PIPECC_MLP_HIDDEN (default 64) and PIPECC_MLP_BLOCKS
(default: 2 per stage). The default makes the model as deep as the cut: a V shape's 2P stages
are then twice a loop's P; to compare schedules on one model, give PIPECC_MLP_BLOCKS
(benchmarks/search_loop.py gives 2P).
"""

from __future__ import annotations

import os

import torch
from torch import nn

HIDDEN = int(os.environ.get("PIPECC_MLP_HIDDEN", "64"))
BLOCKS = int(os.environ.get("PIPECC_MLP_BLOCKS", "0"))  # 0: two blocks per stage


def block(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(hidden, hidden), nn.GELU())


def build_stages(num_stages: int) -> list[nn.Module]:
    """The whole model as `num_stages` consecutive stages of equal depth."""
    blocks = BLOCKS or 2 * num_stages
    if blocks % num_stages:
        raise ValueError(f"{blocks} blocks cannot be cut into {num_stages} equal stages")
    torch.manual_seed(0)
    per_stage = blocks // num_stages
    return [nn.Sequential(*(block(HIDDEN) for _ in range(per_stage))) for _ in range(num_stages)]


def make_batch(num_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and regression targets for one step: targets are a fixed smooth function of
    the inputs (the same for every seed), so training can learn it."""
    inputs = torch.randn(num_rows, HIDDEN, generator=torch.Generator().manual_seed(seed))
    teacher = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(1234))
    return inputs, torch.tanh(inputs @ teacher / HIDDEN**0.5)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)
