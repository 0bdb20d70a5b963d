"""A model file for `pipecc run`: a small GPT (token + position embedding, pre-LN blocks with
causal attention, LM head), cut into stages of equal depth. torch.nn only.

    pipecc run schedules/zb_h1.sched --nproc 2 --microbatches 4 --model examples/gpt.py --check

Stage 0 embeds the int64 tokens, every stage runs its blocks, the last stage applies the final
LayerNorm and the LM head; `loss_fn` is the cross-entropy of the logits against the next
tokens. The sizes are small enough for CPU tests and can be changed with environment
variables:

| variable | meaning | default |
|---|---|---|
| PIPECC_GPT_VOCAB | vocabulary size | 64 |
| PIPECC_GPT_DIM | model width | 32 |
| PIPECC_GPT_HEADS | attention heads | 2 |
| PIPECC_GPT_SEQ | tokens per row | 16 |
| PIPECC_GPT_LAYERS | blocks in all (0: one per stage) | 0 |
| PIPECC_GPT_TIED | 1: the LM head is the token embedding (GPT-2 style, one Parameter) | 0 |
| PIPECC_GPT_DROPOUT | dropout probability (attention and residual) | 0.0 |
| PIPECC_GPT_SP | 1: `parallelize` is `parallelize_sequence` (stage boundaries are DTensors) | 0 |

`parallelize(module, stage, tp_mesh)` shards each block's MLP over the mesh's tp dimension
(`pipecc run --mesh tp=2`). `GPTConfig` and `build_stages(num_stages, config)` can also be
imported (with `runpy` or as a module) to build the same model with other sizes.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, str(default)))


@dataclass(frozen=True)
class GPTConfig:
    """The model's sizes; the defaults read the PIPECC_GPT_* environment variables."""

    vocab: int = field(default_factory=lambda: _env_int("PIPECC_GPT_VOCAB", 64))
    dim: int = field(default_factory=lambda: _env_int("PIPECC_GPT_DIM", 32))
    heads: int = field(default_factory=lambda: _env_int("PIPECC_GPT_HEADS", 2))
    seq: int = field(default_factory=lambda: _env_int("PIPECC_GPT_SEQ", 16))
    layers: int = field(default_factory=lambda: _env_int("PIPECC_GPT_LAYERS", 0))
    tied: bool = field(default_factory=lambda: os.environ.get("PIPECC_GPT_TIED", "0") == "1")
    dropout: float = field(
        default_factory=lambda: float(os.environ.get("PIPECC_GPT_DROPOUT", "0.0"))
    )


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask, through scaled_dot_product_attention."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.dim % config.heads:
            raise ValueError(f"width {config.dim} is not a multiple of {config.heads} heads")
        self.heads = config.heads
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.dropout = config.dropout
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, tokens, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        shape = (rows, tokens, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(rows, tokens, width)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """A pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.dim)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.dim)
        self.mlp = nn.Sequential(
            nn.Linear(config.dim, 4 * config.dim),
            nn.GELU(),
            nn.Linear(4 * config.dim, config.dim),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token plus learned position embedding, then dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab, config.dim)
        self.positions = nn.Embedding(config.seq, config.dim)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.tokens(tokens) + self.positions(positions))


class Head(nn.Module):
    """The final LayerNorm and the LM head (logits over the vocabulary)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.dim)
        self.lm = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


class Stage(nn.Module):
    """One pipeline stage: the embedding (first stage), its blocks, the head (last stage)."""

    def __init__(
        self,
        blocks: list[Block],
        embed: Embedding | None = None,
        head: Head | None = None,
        first_block: int = 0,
    ) -> None:
        super().__init__()
        self.embed = embed
        # keyed by the block's index in the whole model, so every parameter has the whole
        # model's name on any stage (`blocks.3.attn.qkv.weight`), as a checkpoint needs
        numbered = OrderedDict((str(first_block + i), block) for i, block in enumerate(blocks))
        self.blocks = nn.Sequential(numbered)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        x = self.blocks(x)
        return self.head(x) if self.head is not None else x


def build_stages(num_stages: int, config: GPTConfig | None = None) -> list[nn.Module]:
    """The whole GPT as `num_stages` consecutive stages with the same number of blocks.

    With `tied`, the LM head's weight is the token embedding's Parameter (held by the first
    and the last stage). Every parameter has its name in the whole model (`embed.*`,
    `blocks.K.*` with K the block's index in the model, `head.*`), whatever the cut, so
    checkpoints (`pipecc.runtime.save_checkpoint`) load into another number of stages."""
    config = config or GPTConfig()
    layers = config.layers or num_stages
    if layers % num_stages:
        raise ValueError(f"{layers} blocks cannot be cut into {num_stages} equal stages")
    torch.manual_seed(0)
    embed, head = Embedding(config), Head(config)
    if config.tied:
        head.lm.weight = embed.tokens.weight
    per_stage = layers // num_stages
    stages = []
    for index in range(num_stages):
        blocks = [Block(config) for _ in range(per_stage)]
        first, last = index == 0, index == num_stages - 1
        stage = Stage(blocks, embed if first else None, head if last else None, index * per_stage)
        stages.append(stage)
    for stage in stages:
        stage.apply(_gpt2_init)
    return stages


def _gpt2_init(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights for Linear and Embedding, zero biases (with
    torch's defaults, N(0, 1) embeddings, a tied LM head starts with a loss near 40, not
    near ln(vocab))."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def make_batch(
    num_rows: int, seed: int, config: GPTConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows and their next tokens. Each row follows a fixed rule (next = 3·t + 1 mod
    vocab, with a random start and 10% random tokens), so training can learn it."""
    config = config or GPTConfig()
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(config.vocab, (num_rows, 1), generator=g)
    sequence = starts.clone()
    for _ in range(config.seq):
        sequence = torch.cat([sequence, (3 * sequence[:, -1:] + 1) % config.vocab], dim=1)
    noise = torch.rand(num_rows, config.seq + 1, generator=g) < 0.1
    random = torch.randint(config.vocab, sequence.shape, generator=g)
    sequence = torch.where(noise, random, sequence)
    return sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits [rows, tokens, vocab] against the int64 next tokens."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def parallelize(module: nn.Module, stage: int, tp_mesh: Any) -> None:
    """Tensor parallelism of one stage over the mesh's tp dimension (`pipecc run --mesh
    tp=N`), as torchtitan applies it to an MLP: the first Linear of every block's MLP split by
    output features, the second by input features, so each rank computes half of the hidden
    layer and the block's output is whole again (replicated, a plain tensor) after the second
    Linear's all-reduce, which lies inside the module. The attention and the embeddings stay
    whole. With PIPECC_GPT_SP=1, `parallelize_sequence` instead."""
    if os.environ.get("PIPECC_GPT_SP", "0") == "1":
        parallelize_sequence(module, stage, tp_mesh)
        return
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    for name, sub in module.named_modules():
        if name.endswith("mlp"):
            parallelize_module(sub, tp_mesh, plan)


def parallelize_sequence(module: nn.Module, stage: int, tp_mesh: Any) -> None:
    """Sequence parallelism of one stage over the tp mesh, as torchtitan's plan: between the
    layers the hidden state is a DTensor sharded along the tokens (`Shard(1)`), and so is the
    stage boundary. The embedding's output is cut into token shards; in every block the
    LayerNorms run on their shard (`SequenceParallel`), the attention and the MLP gather the
    tokens first (`Shard(1)` to `Replicate()`), the MLP's second Linear reduce-scatters its
    sum back into token shards (`output_layouts=Shard(1)`, kept a DTensor), the attention's
    whole output is cut again; the head gathers the tokens and computes whole logits."""
    del stage
    stage_module: Any = module
    if stage_module.embed is not None:
        to_shards = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
        )
        parallelize_module(stage_module.embed, tp_mesh, to_shards)
    for block in stage_module.blocks:
        parallelize_module(block, tp_mesh, _block_plan())
    if stage_module.head is not None:
        gather = PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True
        )
        parallelize_module(stage_module.head, tp_mesh, gather)


def _block_plan() -> dict[str, Any]:
    attention = PrepareModuleInputOutput(
        input_layouts=Shard(1),
        desired_input_layouts=Replicate(),
        use_local_input=True,
        output_layouts=Replicate(),
        desired_output_layouts=Shard(1),
        use_local_output=False,
    )
    return {
        "ln1": SequenceParallel(),
        "ln2": SequenceParallel(),
        "attn": attention,
        "mlp": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
