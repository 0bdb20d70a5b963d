"""How a runtime fits into the job: its process group, rank map and options."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

LossFn = Callable[[Any, Any], torch.Tensor]


def mse_loss(output: Any, target: Any) -> torch.Tensor:
    """The default loss: mean squared error."""
    return torch.nn.functional.mse_loss(output, target)


@dataclass(frozen=True)
class RuntimeConfig:
    """How the runtime fits into the job.

    `group`: the pipeline's process group (default: the whole world). `rank_map[r]`: the
    global rank of pipeline rank r (default: the group's ranks in order). `sync_duplicated`:
    sum the gradients of a stage held by two ranks at the end of `step` (DualPipe); turn it
    off to do it in the optimizer. `timeout`: seconds a `wait` may block (gloo; NCCL relies
    on the process group's own timeout). `check_shapes`: check each stage's output shapes on
    the meta device on the first step.
    """

    group: dist.ProcessGroup | None = None
    rank_map: Sequence[int] | None = None
    sync_duplicated: bool = True
    timeout: float = 300.0
    device: torch.device | None = None
    check_shapes: bool = True
