"""A model file for `pipecc run` in which each rank builds only its own stages: the GPT of
examples/gpt.py, built whole on the meta device (no memory) and cut with
`pipecc.runtime.split_model`, as a model too large for one device would be.

    pipecc run zbv --nproc 2 --microbatches 4 --model examples/gpt_stages.py --check

`build_stage(stage, num_stages)` returns one stage: examples/gpt.py's `Stage` holding the
embedding (first stage), a consecutive run of the blocks, the head (last stage), with the
parameter names of the whole model (`blocks.3.attn.qkv.weight` on whichever stage holds
block 3), so a checkpoint of the whole model loads into it by name. Every parameter is
initialised from its name (GPT-2's N(0, 0.02) for Linear and Embedding weights, zero biases,
LayerNorm at one and zero), so the weights are the same in any split and in the launcher's
reference; they are not those of examples/gpt.py's `build_stages`, which draws them in
construction order. The sizes are examples/gpt.py's PIPECC_GPT_* variables; a tied head
(PIPECC_GPT_TIED=1) needs `build_stages` there, since two ranks' separately built stages
cannot share one Parameter object.

`build_layers_model()` and `init_stage` let `pipecc run --partition cut.toml` build the
stages from a cut `pipecc search --layers` chose (layer names `embed`, `blocks.K`, `head`):

    pipecc run 1f1b --nproc 2 -M 4 --model examples/gpt_stages.py --partition cut.toml --check
"""

from __future__ import annotations

import runpy
import zlib
from pathlib import Path

import torch
from pipecc.runtime import split_model
from torch import nn

gpt = runpy.run_path(str(Path(__file__).with_name("gpt.py")))
make_batch, loss_fn = gpt["make_batch"], gpt["loss_fn"]


def whole_model(num_stages: int) -> nn.Module:
    """The whole GPT as one `Stage` (embedding, every block, head), on the meta device."""
    config = gpt["GPTConfig"]()
    if config.tied:
        raise ValueError("PIPECC_GPT_TIED=1 needs examples/gpt.py (build_stages)")
    with torch.device("meta"):
        blocks = [gpt["Block"](config) for _ in range(config.layers or num_stages)]
        return gpt["Stage"](blocks, gpt["Embedding"](config), gpt["Head"](config))


@torch.no_grad()
def init(stage: nn.Module) -> None:
    """GPT-2's initialisation, each weight drawn from a generator seeded by its name."""
    for name, module in stage.named_modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            seed = zlib.crc32(f"{name}.weight".encode())
            module.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(seed))
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.zero_()
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()


def build_stage(stage: int, num_stages: int) -> nn.Module:
    """Stage `stage` of `num_stages`: only its layers are ever materialized."""
    return split_model(whole_model(num_stages), stage, num_stages, layers="blocks", init=init)


def build_layers_model() -> nn.Module:
    """The whole GPT on the meta device, for `pipecc run --partition cut.toml`: its layers
    are `embed`, `blocks.0` ... `blocks.N-1` (PIPECC_GPT_LAYERS, default 4) and `head`."""
    return whole_model(gpt["GPTConfig"]().layers or 4)


init_stage = init  # initialises a stage of any cut (`--partition`) as build_stage's
