"""The single-process reference a pipelined step is checked against.

The whole model (all stages in pipe-0 order) runs every microbatch forward and backward in
microbatch order, each loss scaled by 1/M, so `.grad` holds the mean over microbatches, as a
pipelined step leaves it. Floating-point sums then differ from the pipeline's only in the
order microbatches are accumulated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .context import split_microbatches, unwrap

ParamKey = tuple[int, str]  # (stage, parameter name)


def reference_step(
    stages: Sequence[torch.nn.Module],
    batch: tuple[Any, Any],
    microbatches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
) -> tuple[float, dict[ParamKey, torch.Tensor]]:
    """The mean loss and every parameter's gradient of one step on one process."""
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    device = torch.device("cpu")
    inputs = split_microbatches(batch[0], microbatches, "inputs", device)
    targets = split_microbatches(batch[1], microbatches, "targets", device)
    total = 0.0
    for mb in range(microbatches):
        values: Any = inputs[mb]
        for stage in stages:
            out = stage(*values)
            values = out if isinstance(out, tuple) else (out,)
        loss = loss_fn(unwrap(values), unwrap(targets[mb]))
        (loss * (1.0 / microbatches)).backward()  # type: ignore[no-untyped-call]  # as the runtime scales
        total += float(loss.detach())
    return total / microbatches, gradients(stages)


def gradients(stages: Sequence[torch.nn.Module]) -> dict[ParamKey, torch.Tensor]:
    """Each parameter's `.grad` (zeros where None), keyed by (stage, name)."""
    return {
        (index, name): (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for index, stage in enumerate(stages)
        for name, p in stage.named_parameters()
    }


def compare(
    got: dict[ParamKey, torch.Tensor], want: dict[ParamKey, torch.Tensor]
) -> tuple[float, float]:
    """max |a - b| over all parameters, and that divided by max |b| over all parameters."""
    worst = 0.0
    scale = 0.0
    for key, value in got.items():
        ref = want[key]
        worst = max(worst, float((value.cpu() - ref).abs().max()) if value.numel() else 0.0)
        scale = max(scale, float(ref.abs().max()) if ref.numel() else 0.0)
    return worst, (worst / scale if scale > 0 else worst)
