"""A model file that defines only `build_stage`: each stage cut by `split_model` out of one
model built on the meta device, each parameter initialised from its name, so any split gives
the weights of the whole model.

PIPECC_TEST_LOG: a file to which every `build_stage` call appends one JSON line: the process
(its distributed rank, or null in a process without one, the launcher's reference), the
stage, the device of each parameter of the built stage, and the number of parameters of the
whole meta model not on the meta device (which must stay 0).
PIPECC_TEST_FAULT=raise: stage 1 raises in its forward in the step (a bug in the user's
model).
"""

from __future__ import annotations

import json
import os
import zlib

import torch
import torch.distributed as dist
from pipecc.runtime import split_model
from torch import nn

WIDTH = 8
BLOCKS = int(os.environ.get("PIPECC_TEST_BLOCKS", "4"))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Raising(Block):
    """Fails from its second call on: in the step (the first call is the runtime's
    discovery of the boundaries, on the step's first microbatch)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1:
            raise ValueError("a bug in the user's block")  # the line the traceback names
        return super().forward(x)


class Net(nn.Module):
    """embed, blocks, head: a stage holds the parts that are not None."""

    def __init__(self, raising: int | None = None, blocks: int = BLOCKS) -> None:
        super().__init__()
        self.embed = nn.Linear(4, WIDTH)
        self.blocks = nn.ModuleList(
            Raising() if index == raising else Block() for index in range(blocks)
        )
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def init(module: nn.Module) -> None:
    """Every parameter drawn from a generator seeded by its name: the same in any split."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))


def build_stage(stage: int, num_stages: int) -> nn.Module:
    raising = None
    if os.environ.get("PIPECC_TEST_FAULT") == "raise":
        raising = BLOCKS * 1 // num_stages  # the first block of stage 1
    with torch.device("meta"):
        whole = Net(raising)
    part = split_model(whole, stage, num_stages, layers="blocks", init=init)
    log = os.environ.get("PIPECC_TEST_LOG")
    if log:
        record = {
            "rank": dist.get_rank() if dist.is_initialized() else None,
            "stage": stage,
            "params": {name: str(p.device) for name, p in part.named_parameters()},
            "whole_off_meta": sum(p.device.type != "meta" for p in whole.parameters()),
        }
        with open(log, "a") as out:
            out.write(json.dumps(record) + "\n")
    return part


def make_batch(num_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(num_rows, 4, generator=generator)
    return inputs, torch.randn(num_rows, 4, generator=generator)
