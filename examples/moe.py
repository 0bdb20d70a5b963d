"""A model file for `pipecc run`: a mixture-of-experts model whose load-balancing losses are
added where they are computed, with `pipecc.runtime.add_loss` (docs/recipes.md).

    pipecc run zb_h1 --nproc 2 --microbatches 4 --model examples/moe.py --check --reference whole

Each MoE layer routes every token to its top-2 of E experts and computes the Switch
Transformer balancing loss of its own router on the microbatch it sees,
`E * sum_e f_e * P_e` (f_e: the share of routed slots that went to expert e, P_e: the mean
router probability of e), and adds it with `h = add_loss(h, COEF * balance)`. The layer
lives on whichever stage the split puts it: the loss's gradient flows in that stage's
backward, scaled like the main loss (the mean over microbatches), and `pipecc run --json`
reports it as `aux_loss` (summed over the stages), apart from `loss` (the cross-entropy).
The same file trains without pipecc: outside the runtime `add_loss` adds the loss with
scale 1 to any backward through `h`.
"""

from __future__ import annotations

import zlib

import torch
from pipecc.runtime import add_loss, split_model
from torch import nn

VOCAB, DIM, EXPERTS, TOP, LAYERS, SEQ = 48, 16, 4, 2, 4, 6
COEF = 0.1  # the balancing loss's weight (Mixtral's router_aux_loss_coef is 0.02)


class MoELayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
            for _ in range(EXPERTS)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h).reshape(-1, DIM)  # (tokens, dim)
        probs = self.router(x).softmax(-1)
        weights, chosen = probs.topk(TOP, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if len(rows):
                out = out.index_add(0, rows, weights[rows, slot, None] * expert(x[rows]))
        routed = nn.functional.one_hot(chosen, EXPERTS).float().mean((0, 1))  # f_e
        balance = EXPERTS * (routed * probs.mean(0)).sum()
        return add_loss(h + out.view_as(h), COEF * balance)


class MoEModel(nn.Module):
    """embed -> MoE layers -> norm -> head; a stage holds some of them (the others None)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(MoELayer() for _ in range(LAYERS))
        self.norm: nn.Module | None = nn.LayerNorm(DIM)
        self.head: nn.Module | None = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h) if self.head is not None else h


@torch.no_grad()
def init(model: nn.Module) -> None:
    """Each weight drawn from a generator seeded by its name: the same in any split."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            seed = zlib.crc32(f"{name}.weight".encode())
            module.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(seed))
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.zero_()
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()


def build_stage(stage: int, num_stages: int) -> nn.Module:
    with torch.device("meta"):
        whole = MoEModel()
    return split_model(whole, stage, num_stages, layers="layers", init=init)


def build_model() -> nn.Module:
    """The whole model (for `--reference whole`)."""
    model = MoEModel()
    init(model)
    return model


def make_batch(num_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (num_rows, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
