"""A model file for `pipecc run` tests that misbehaves on demand (PIPECC_TEST_FAULT).

raise   rank 1's stage raises in its second forward
kill    rank 1 kills its own process (SIGKILL) in its third forward, mid-step
random  every process draws different weights, so --check must fail
sleep   rank 1 sleeps in its first forward longer than the test's --timeout
noisy   stage 0's forward sleeps 20 ms in every odd step (every row of the batch starts with the
        step's seed), so a profile's per-step means of stage 0 F spread far over any bound
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

FAULT = os.environ.get("PIPECC_TEST_FAULT", "")
HIDDEN = 4


class Stage(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.calls = 0
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if dist.is_initialized() and dist.get_rank() == 1:
            if FAULT == "raise" and self.calls == 2:
                raise ValueError("stage exploded on purpose")
            if FAULT == "kill" and self.calls == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            if FAULT == "sleep" and self.calls == 1:
                time.sleep(30)
        if FAULT == "noisy" and self.index == 0 and round(float(x[0, 0])) % 2:
            time.sleep(0.02)
        return torch.tanh(self.linear(x))


def build_stages(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(os.getpid() if FAULT == "random" else 0)
    return [Stage(index) for index in range(num_stages)]


def make_batch(num_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(num_rows, HIDDEN, generator=generator)
    if FAULT == "noisy":
        inputs[:, 0] = seed
    return inputs, torch.randn(num_rows, HIDDEN, generator=generator)
