"""A model file for `pipecc run`: an HF-style decoder whose position ids and attention mask
are context, not boundary values (docs/recipes.md).

    pipecc run 1f1b --nproc 2 --microbatches 4 --model examples/decoder.py --check --reference whole

Every decoder layer needs the position ids (its rotary embedding) and the attention mask
(causal, plus the padding of each row), as in a Hugging Face Llama. They are the same for
every stage, so `make_batch` returns them as the third value, the context: `pipecc run`
splits it into microbatches like the inputs and every stage is called
`stage(hidden, position_ids=..., attention_mask=...)` on the rank that holds it, so nothing
but the hidden state crosses a boundary. The rotary tables are computed from the position
ids in each stage that has layers (cheap, and never sent).

The stages are cut from the whole model with `split_model` (their parameter names are the
model's), and every weight is drawn from its name, so `build_model()` (the whole model, for
`--reference whole`) has the weights of any split.
"""

from __future__ import annotations

import zlib

import torch
from pipecc.runtime import split_model
from torch import nn

VOCAB, DIM, HEADS, LAYERS, SEQ = 64, 32, 4, 4, 8


def rotary(position_ids: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary embedding for `position_ids` (rows, seq): (rows, seq, dim)."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = position_ids.float()[..., None] * inv.to(position_ids.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + turned * sin[:, None]


class DecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.o_proj = nn.Linear(DIM, DIM)
        self.post_norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
        rows, seq, _ = h.shape
        q, k, v = self.qkv(self.input_norm(h)).view(rows, seq, 3, HEADS, -1).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (rows, heads, seq, head_dim)
        q, k = rotate(q, *rope), rotate(k, *rope)
        att = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + self.o_proj(att.transpose(1, 2).reshape(rows, seq, DIM))
        return h + self.mlp(self.post_norm(h))


class Decoder(nn.Module):
    """embed -> layers -> norm -> lm_head; a stage holds some of them (the others None)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(LAYERS))
        self.norm: nn.Module | None = nn.LayerNorm(DIM)
        self.lm_head: nn.Module | None = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor, *, position_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
        h = self.embed(x) if self.embed is not None else x
        if len(self.layers):
            rope = rotary(position_ids, DIM // HEADS)  # in the stage that needs it
            mask = causal_mask(attention_mask)
            for layer in self.layers:
                h = layer(h, rope, mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


def causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(rows, seq) padding mask (1 = a token) -> (rows, 1, seq, seq) boolean: causal, and
    no query attends to padding (a padded query attends to itself, so no row is empty)."""
    seq = attention_mask.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).tril()
    keys = attention_mask.bool()[:, None, None, :]
    return (causal & keys) | torch.eye(seq, dtype=torch.bool, device=attention_mask.device)


@torch.no_grad()
def init(model: nn.Module) -> None:
    """Each weight drawn from a generator seeded by its name: the same in any split."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            seed = zlib.crc32(f"{name}.weight".encode())
            module.weight.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(seed))
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.zero_()
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()


def build_stage(stage: int, num_stages: int) -> nn.Module:
    with torch.device("meta"):
        whole = Decoder()
    return split_model(whole, stage, num_stages, layers="layers", init=init)


def build_model() -> nn.Module:
    """The whole decoder (for `--reference whole`): `model(tokens, **context)`."""
    model = Decoder()
    init(model)
    return model


def make_batch(
    num_rows: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Token ids, next-token targets (-100 on padding), and the context: position ids and
    the padding mask; every third row is left-padded by a seed-dependent amount."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (num_rows, SEQ + 1), generator=generator)
    pads = torch.randint(1, SEQ // 2, (num_rows,), generator=generator)
    pads[torch.arange(num_rows) % 3 != 0] = 0
    attention_mask = (torch.arange(SEQ)[None, :] >= pads[:, None]).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    targets = tokens[:, 1:].masked_fill(attention_mask == 0, -100)
    context = {"position_ids": position_ids, "attention_mask": attention_mask}
    return tokens[:, :-1], targets, context


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
