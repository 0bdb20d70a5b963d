"""What a training loop needs across the pipeline: the global gradient norm, clipping, and
the step's loss on every rank. Each is one small collective over the pipeline group."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .agreement import finished
from .shared import ParamGrads


def global_norm(
    owned: Sequence[torch.nn.Parameter],
    grads: ParamGrads,
    norm_type: float,
    group: dist.ProcessGroup | None,
    device: torch.device,
    timeout: float | None = None,
) -> torch.Tensor:
    """The `norm_type` norm of all gradients of the pipeline: each rank adds those of the
    parameters it owns (`shared.owned`: every parameter counted on one rank), in fp64.
    `timeout`: seconds the all-reduce may take (gloo; None: the group's own)."""
    infinite = math.isinf(norm_type)
    local = torch.zeros((), dtype=torch.float64, device=device)
    for param in owned:
        grad = grads.get(param)
        if grad is None:
            continue
        value = _full(grad).detach().double()
        if infinite:
            local = torch.maximum(local, value.abs().max())
        else:
            local = local + value.abs().pow(norm_type).sum()
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    work = dist.all_reduce(local, op=op, group=group, async_op=True)
    finished(work, timeout, "the all-reduce of the gradient norm over the pipeline")
    return (local if infinite else local.pow(1.0 / norm_type)).float()


def _full(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as a whole tensor: a tensor-parallel parameter's (a DTensor) gathered, so
    that every rank of its tp group adds the same full norm (docs/parallelism.md)."""
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def scale_grads(params: Sequence[torch.nn.Parameter], coefficient: float) -> None:
    """Multiply every gradient by `coefficient` when it is below 1 (`.grad`, and the fp32
    accumulator `main_grad` where there is one)."""
    if coefficient >= 1.0:
        return
    for param in params:
        held = (param.grad, getattr(param, "main_grad", None))
        for grad in {id(g): g for g in held if g is not None}.values():
            grad.detach().mul_(coefficient)


def mean_loss(
    losses: Sequence[torch.Tensor], group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    """The mean of every rank's microbatch losses (sum and count all-reduced)."""
    total = sum((float(v) for v in losses), 0.0)
    both = torch.tensor([total, float(len(losses))], dtype=torch.float64, device=device)
    dist.all_reduce(both, group=group)
    return (both[0] / both[1]).float()
