"""A model file whose LM head is tied to its embedding by `Parameter` identity
(`build_stages`), and which cannot be built on the meta device: `pipecc run` cannot find the
tie before it resolves the program (runtime/tools/ties.py), so the program it verifies has
no sum for it and every rank refuses it when its runtime is built (exit 2, naming
`--shared 0+1`); with `--shared 0+1` it runs and `--check` passes."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, DIM = 16, 8


def build_stages(num_stages: int) -> list[nn.Module]:
    if torch.empty(()).is_meta:
        raise RuntimeError("this model is built on real tensors only")
    torch.manual_seed(0)
    embed = nn.Embedding(VOCAB, DIM)
    head = nn.Linear(DIM, VOCAB, bias=False)
    head.weight = embed.weight  # tied: one Parameter in both stages
    return [embed, nn.Sequential(nn.Tanh(), head)]


def make_batch(num_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(VOCAB, (num_rows, 5), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
