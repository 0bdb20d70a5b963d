"""A model file for `pipecc run` in the shape of torchtitan's llama3 stages: every stage takes
`positions` and `attention_masks` as keyword arguments (docs/recipes.md).

    pipecc run zbv --nproc 2 -M 4 --model examples/titan_stages.py --check --reference whole

The model is torchtitan's layout in torch.nn only: `tok_embeddings`, a `ModuleDict` of
`layers` keyed "0", "1", ..., `norm`, `output`, and a forward
`forward(tokens, attention_masks=None, positions=None)` that skips the parts a stage does
not hold. The batch packs several documents into each row (as torchtitan's dataloader
does): `positions` restart at every document and `attention_masks` is block-causal (a
token sees the earlier tokens of its own document). Both come from `make_batch` as the
context, so every stage gets them and only the hidden state crosses a boundary. Stages are
cut with `split_model` (ZBV's V shape gives rank 0 stages 0 and 3 of 4, and a ModuleDict
keeps its keys); every weight is drawn from its name, so `build_model()` has the weights of
any split.
"""

from __future__ import annotations

import zlib

import torch
from pipecc.runtime import split_model
from torch import nn

VOCAB, DIM, HEADS, LAYERS, SEQ, THETA = 64, 32, 4, 4, 12, 10000.0


def rope(positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary embedding at `positions` (rows, seq): (rows, 1, seq, dim)."""
    inv = 1.0 / (THETA ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = positions.float()[..., None] * inv.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
        rows, seq, _ = x.shape
        q, k, v = (
            w(x).view(rows, seq, HEADS, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        cos, sin = cos_sin
        half = q.shape[-1] // 2
        q, k = (t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin for t in (q, k))
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(rows, seq, DIM))


class TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = nn.Sequential(
            nn.Linear(DIM, 3 * DIM, bias=False), nn.SiLU(), nn.Linear(3 * DIM, DIM, bias=False)
        )

    def forward(self, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
        h = h + self.attention(self.attention_norm(h), cos_sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(LAYERS)})
        self.norm: nn.Module | None = nn.RMSNorm(DIM)
        self.output: nn.Module | None = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, attention_masks: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if len(self.layers):
            assert positions is not None and attention_masks is not None
            cos_sin = rope(positions, DIM // HEADS)
            for layer in self.layers.values():
                h = layer(h, cos_sin, attention_masks)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


@torch.no_grad()
def init(model: nn.Module) -> None:
    """Each weight drawn from a generator seeded by its name: the same in any split."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            seed = zlib.crc32(f"{name}.weight".encode())
            module.weight.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(seed))
        if isinstance(module, nn.RMSNorm):
            module.reset_parameters()


def build_stage(stage: int, num_stages: int) -> nn.Module:
    with torch.device("meta"):
        whole = Transformer()
    return split_model(whole, stage, num_stages, layers="layers", init=init)


def build_model() -> nn.Module:
    """The whole model (for `--reference whole`): `model(tokens, **context)`."""
    model = Transformer()
    init(model)
    return model


def make_batch(
    num_rows: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Rows of packed documents: token ids, next-token targets, and the context:
    `positions` restarting at each document, block-causal `attention_masks`."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (num_rows, SEQ + 1), generator=generator)
    starts = torch.rand(num_rows, SEQ, generator=generator) < 0.25
    starts[:, 0] = True
    document = starts.cumsum(-1)  # (rows, seq): which document each token belongs to
    first = torch.arange(SEQ).expand(num_rows, SEQ).masked_fill(~starts, 0).cummax(-1).values
    positions = torch.arange(SEQ) - first
    same = document[:, :, None] == document[:, None, :]
    masks = (same & torch.ones(SEQ, SEQ, dtype=torch.bool).tril())[:, None]
    return tokens[:, :-1], tokens[:, 1:], {"positions": positions, "attention_masks": masks}


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
