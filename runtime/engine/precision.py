"""fp32 gradient accumulation for low-precision (bf16, fp16) parameters.

With bf16 parameters each microbatch's backward adds into a bf16 `.grad`, and M roundings
lose what a single-process fp32 sum keeps. With `RuntimeConfig(fp32_grads=True)` every
low-precision parameter gets an fp32 accumulator, `param.main_grad`: at the start of a step
it takes the parameter's `.grad` (zeros when None, so zeroing `.grad` as usual starts a new
sum), after each op that adds weight gradients (B, W, a fused op) the chunk's `.grad`s are
added into it and cleared, the shared-parameter sum works on it, and at the end of the step
`.grad` is the accumulator rounded once to the parameter's dtype. `main_grad` keeps the fp32
value for an optimizer that wants it. Other parameters are left as they are.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..comm.shared import ParamGrads

LOW = (torch.bfloat16, torch.float16)


class Fp32Grads(ParamGrads):
    """The gradients of `params`, low-precision ones accumulated in fp32."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.low = [p for p in params if p.dtype in LOW]
        self.ids = {id(p) for p in self.low}
        self.acc: dict[int, torch.Tensor] = {}  # id(param) -> its fp32 accumulator

    def get(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        if id(param) in self.ids:
            return self.acc.get(id(param))
        return param.grad

    def set(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        if id(param) in self.ids:
            self._keep(param, value)
        else:
            param.grad = value

    def dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        return torch.float32 if id(param) in self.ids else param.dtype

    def begin(self) -> None:
        """Start each accumulator from the parameter's `.grad`."""
        for p in self.low:
            self._keep(
                p, torch.zeros_like(p, dtype=torch.float32) if p.grad is None else p.grad.float()
            )
            p.grad = None

    def drain(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Add the `.grad`s of `params` into their accumulators and clear them."""
        for p in params:
            if id(p) in self.ids and p.grad is not None:
                self.acc[id(p)] += p.grad
                p.grad = None

    def end(self) -> None:
        """`.grad` = the accumulator in the parameter's dtype."""
        for p in self.low:
            p.grad = self.acc[id(p)].to(p.dtype)

    def _keep(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        self.acc[id(param)] = value
        param.main_grad = value  # type: ignore[attr-defined]  # for the user's optimizer
