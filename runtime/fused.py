"""The user's hook for fused F&B, in DualPipe's signature.

A stage module class may define

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0,
                                    module1, loss1, outputs1, output_grads1):
        ...  # forward module0 on inputs0 (and criterion0(*outputs0, *labels0) if given)
        ...  # while running the full backward of module1: loss1.backward() if loss1 is
        ...  # not None, else torch.autograd.backward(outputs1, output_grads1)
        return outputs0, loss0

The runtime calls it for every `F&B` whose two chunks have the same module class. `F&I` does
not use it: the signature has no way to ask for input gradients only, so the runtime runs
`F&I` as it runs `F&B` without a hook. `criterion0` returns the microbatch's loss already
scaled by 1/M, so that `loss1.backward()` inside the hook accumulates the mean over
microbatches, as the runtime's own backward does; `loss1` is scaled the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .context import unwrap

HOOK = "overlapped_forward_backward"
Hook = Callable[..., tuple[Any, Any]]


def find_hook(forward: torch.nn.Module, backward: torch.nn.Module) -> Hook | None:
    """The class hook, when both modules are of one class that defines it."""
    if type(forward) is not type(backward):
        return None
    hook = getattr(type(forward), HOOK, None)
    return hook if callable(hook) else None


class ScaledCriterion:
    """`criterion0` for the hook: the user's loss function, scaled by 1/M.

    Called as `criterion(*outputs, *labels)`; it remembers the unscaled loss for reporting.
    """

    def __init__(
        self, loss_fn: Callable[[Any, Any], torch.Tensor], scale: float, labels: int
    ) -> None:
        self.loss_fn = loss_fn
        self.scale = scale
        self.labels = labels
        self.raw: torch.Tensor | None = None

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        split = len(args) - self.labels
        loss = self.loss_fn(unwrap(args[:split]), unwrap(args[split:]))
        self.raw = loss.detach()
        return loss * self.scale
