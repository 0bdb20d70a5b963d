"""Split backward: I then W gives the gradients of B, and W never redoes I's work.

Counted at the dispatcher: for a stage of Linear+GELU blocks, B runs 2 matmuls per Linear
(input gradient and weight gradient); I runs exactly the input-gradient ones and W exactly
the weight-gradient ones, so I + W does the same arithmetic as B.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
from pipecc.runtime.engine.split_backward import full_backward, input_backward
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

H = 8


class CountOps(TorchDispatchMode):
    """Counts every aten op run inside the `with` block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class Tied(nn.Module):
    """A weight used twice, an extra scale parameter, two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(H, H)
        self.b = nn.Linear(H, H)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, H))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = nn.functional.gelu(self.a(x))
        h = self.a(h) * self.scale
        return self.b(h) + y, h.sum(-1)


def mlp(blocks: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(blocks) for m in (nn.Linear(H, H), nn.GELU())))


def _run(module: nn.Module, inputs: list[torch.Tensor], split: bool) -> dict[str, Any]:
    module = copy.deepcopy(module)
    leaves = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    out = module(*leaves)
    outputs = out if isinstance(out, tuple) else (out,)
    torch.manual_seed(1)
    grads = [torch.randn_like(o) for o in outputs]
    counted = [CountOps(), CountOps()]
    if split:
        ids = {id(p) for p in module.parameters()}
        with counted[0]:
            input_grads, weight = input_backward(outputs, grads, leaves, ids)
        with counted[1]:
            weight.run()
    else:
        with counted[0]:
            input_grads = full_backward(outputs, grads, leaves)
    return {
        "inputs": input_grads,
        "params": [p.grad for p in module.parameters()],
        "first": counted[0].ops,
        "second": counted[1].ops,
    }


def test_mlp_i_plus_w_does_exactly_the_matmuls_of_b() -> None:
    x = torch.randn(4, H, requires_grad=True)
    full = _run(mlp(), [x], split=False)
    split = _run(mlp(), [x], split=True)
    assert full["first"]["mm"] == 6
    assert split["first"]["mm"] == 3, "I: one matmul per Linear, the input gradient"
    assert split["second"]["mm"] == 3, "W: one matmul per Linear, the weight gradient"
    assert split["second"]["gelu_backward"] == 0, "W does not walk the input path again"
    assert split["first"]["sum"] == 0 and split["second"]["sum"] == 3, "bias gradients in W"
    for a, b in zip(full["params"], split["params"], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(full["inputs"][0], split["inputs"][0])


def test_first_stage_defers_everything_to_w() -> None:
    x = torch.randn(4, H)  # stage 0: its input needs no gradient
    full = _run(mlp(), [x], split=False)
    split = _run(mlp(), [x], split=True)
    assert sum(split["first"].values()) == 0, "I has nothing to do"
    assert split["second"]["mm"] == full["first"]["mm"]
    assert split["inputs"] == (None,)
    for a, b in zip(full["params"], split["params"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("needs_grad", [True, False])
def test_tied_weight_two_outputs(needs_grad: bool) -> None:
    torch.manual_seed(0)
    module = Tied()
    inputs = [torch.randn(4, H, requires_grad=needs_grad) for _ in range(2)]
    full = _run(module, inputs, split=False)
    split = _run(module, inputs, split=True)
    for a, b in zip(full["params"], split["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(full["inputs"], split["inputs"], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_w_of_several_microbatches_in_any_order() -> None:
    module = mlp()
    reference = copy.deepcopy(module)
    ids = {id(p) for p in module.parameters()}
    pending = []
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn(4, H, requires_grad=True)
        g = torch.randn(4, H)
        pending.append(input_backward((module(x),), (g,), (x,), ids)[1])
        full_backward((reference(x),), (g,), (x,))
    for weight in reversed(pending):
        weight.run()
    for a, b in zip(reference.parameters(), module.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)  # summed in another order
