"""A model file whose LM head is tied to its embedding, built one stage at a time.

`build_stage` cuts each stage out of the model on the meta device (`split_model`), so the
first stage's `embed.weight` and the last stage's `head.weight` are two objects on two
ranks, drawn alike: nothing in the stages says they are one parameter. `build_model()` is
the whole model, where they are one. With PIPECC_TIED_DECLARED=1 the file declares the tie
(`shared(num_stages)`), and the run sums the two copies' gradients; without it the run
trains two parameters, `--check` fails against the whole model (its default where the file
defines `build_model`) and `--check --reference stages` cannot see it.
"""

from __future__ import annotations

import os
import zlib

import torch
from pipecc.runtime import split_model
from torch import nn

VOCAB, DIM, SEQ, LAYERS = 32, 16, 8, 4
TIED = {"head.weight": "embed.weight"}  # drawn alike: the same generator seed


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Dropout(0.1)) for _ in range(LAYERS)
        )
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


@torch.no_grad()
def init(module: nn.Module) -> None:
    for name, param in module.named_parameters():
        seed = zlib.crc32(TIED.get(name, name).encode())
        nn.init.normal_(param, std=0.2, generator=torch.Generator().manual_seed(seed))


def build_model() -> nn.Module:
    model = LM()
    init(model)
    return model


def build_stage(stage: int, num_stages: int) -> nn.Module:
    with torch.device("meta"):
        whole = LM()
    return split_model(whole, stage, num_stages, layers="layers", init=init)


if os.environ.get("PIPECC_TIED_DECLARED") == "1":

    def shared(num_stages: int) -> list[tuple[tuple[int, str], ...]]:
        return [((0, "embed.weight"), (num_stages - 1, "head.weight"))]


def make_batch(num_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCAB, (num_rows, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
