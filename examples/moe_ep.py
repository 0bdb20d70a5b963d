"""A model file for `pipecc run` with expert parallelism: every stage is a MoE stage.

    pipecc run dualpipev --nproc 4 --mesh pp=2,ep=2 -M 8 --model examples/moe_ep.py --check

(`pipecc run` counts each stage's MoE blocks and places their phases and all-to-alls, as
`--moe 2` would.)

Each stage is `pipecc.runtime.MoEStage`: stage 0 embeds the tokens, the last one ends in a
norm and the vocabulary head, and each holds PIPECC_MOE_LAYERS (default 2) `MoEBlock`s: a
dense sublayer (an MLP standing in for attention), a router choosing the top 2 of
PIPECC_MOE_EXPERTS (default 4) experts per token, and the Switch balancing loss added with
`add_loss`. The runtime runs each stage in phases (docs/parallelism.md, "Expert
parallelism"): with `--mesh ...,ep=E` each EP rank holds E/ep of every block's experts and
the tokens travel to them and back by all-to-all. The routing depends on the data; each
stage's second block never routes to the upper half of the experts (its router's fixed
offset), so with ep=2 EP rank 1 receives no token in that layer, and the first block never
routes to the last expert: experts and whole ranks without tokens are part of every run.
PIPECC_MOE_DIM (default 16), PIPECC_MOE_SEQ (default 6) size the model for a benchmark.
"""

from __future__ import annotations

import os

import torch
from pipecc.runtime import MoEBlock, MoEStage
from torch import nn

VOCAB = 48
DIM = int(os.environ.get("PIPECC_MOE_DIM", "16"))
SEQ = int(os.environ.get("PIPECC_MOE_SEQ", "6"))
EXPERTS = int(os.environ.get("PIPECC_MOE_EXPERTS", "4"))
LAYERS = int(os.environ.get("PIPECC_MOE_LAYERS", "2"))
TOP, BALANCE, AWAY = 2, 0.01, -30.0


def block(layer: int) -> MoEBlock:
    """Layer 0 of a stage: no token for the last expert; layer 1: none for the upper half."""
    half = EXPERTS // 2
    bias = [0.0] * (EXPERTS - 1) + [AWAY] if layer % 2 == 0 else [0.0] * half + [AWAY] * half
    mixer = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM), nn.GELU())
    return MoEBlock(DIM, 2 * DIM, EXPERTS, TOP, mixer=mixer, balance=BALANCE, bias=bias)


def build_stages(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    stages = []
    for stage in range(num_stages):
        head = nn.Embedding(VOCAB, DIM) if stage == 0 else None
        last = stage == num_stages - 1
        tail = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)) if last else None
        stages.append(MoEStage(head, [block(layer) for layer in range(LAYERS)], tail))
    return stages


def make_batch(num_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (num_rows, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
