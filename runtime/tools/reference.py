"""The single-process reference a pipelined step is checked against.

The whole model (all stages in pipe-0 order) runs every microbatch forward and backward in
microbatch order, stage by stage, each loss scaled by 1/M, so `.grad` holds the mean over
microbatches, as a pipelined step leaves it. Each stage's forward on each microbatch runs
under the RNG state the runtime derives for it (runtime/engine/rng.py), under the same autocast, on
the ranks' device type, so dropout masks and dtypes are the ones of the pipelined run.
Floating-point sums then differ from the pipeline's only in the order microbatches are
accumulated (and in the thread count, which the caller sets to the ranks').

A batch of three, `(inputs, targets, context)`, calls every stage with the microbatch's
context as keywords, as the runtime does. Losses added inside a stage (`add_loss`) are
collected around each microbatch's forward and added to its loss before the 1/M scaling,
as the runtime seeds them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from pipecc.diagnostics import InputError

from ..boundaries.context import split_context
from ..boundaries.specs import autocast_context
from ..boundaries.trees import call, split_tree, unwrap
from ..comm.shared import distinct_parameters
from ..engine.aux_loss import collecting
from ..engine.aux_loss import total as added_total
from ..engine.precision import Fp32Grads
from ..engine.rng import ForwardRng

ParamKey = tuple[int, str]  # (stage, parameter name)


class Options(NamedTuple):
    """How the pipelined run ran, for the reference to run alike."""

    step: int = 0
    seed: int = 0
    derive_rng: bool = True
    autocast: torch.dtype | None = None
    device: torch.device = torch.device("cpu")
    fp32_grads: bool = False


def reference_step(
    stages: Sequence[torch.nn.Module],
    batch: tuple[Any, ...],
    microbatches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    options: Options | None = None,
) -> tuple[float, dict[ParamKey, torch.Tensor]]:
    """The mean loss and every parameter's gradient of one step on one process."""
    options = options or Options()
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    device = options.device
    inputs = split_tree(batch[0], microbatches, "inputs", device)
    targets = split_tree(batch[1], microbatches, "targets", device)
    contexts = context_microbatches(batch, microbatches, device)
    rng = ForwardRng(device, options.seed, enabled=options.derive_rng)
    precision = Fp32Grads(distinct_parameters(stages)) if options.fp32_grads else None
    if precision is not None:
        precision.begin()
    total = 0.0
    with rng.step_scope():
        for mb in range(microbatches):
            added: list[torch.Tensor] = []
            with collecting(added):
                data = (inputs[mb], targets[mb], contexts[mb])
                loss = _microbatch(stages, data, loss_fn, rng, options, mb)
            extra = added_total(added)
            full = loss if extra is None else loss + extra
            torch.autograd.backward(full * (1.0 / microbatches))  # as the runtime scales
            if precision is not None:
                precision.drain(distinct_parameters(stages))
            total += float(loss.detach())
    if precision is not None:
        precision.end()
    return total / microbatches, gradients(stages)


def _microbatch(
    stages: Sequence[torch.nn.Module],
    data: tuple[object, object, dict[str, object]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    rng: ForwardRng,
    options: Options,
    mb: int,
) -> torch.Tensor:
    value, target, context = data
    with autocast_context(options.device, options.autocast):
        for index, stage in enumerate(stages):
            rng.seed(options.step, index, mb)
            value = call(stage, value, context)
        return loss_fn(unwrap(value), unwrap(target))


def context_microbatches(
    batch: tuple[Any, ...], microbatches: int, device: torch.device
) -> list[dict[str, object]]:
    """The context of each microbatch: the batch's third entry split, else empty."""
    context = batch[2] if len(batch) > 2 else None
    found: list[str] = []
    split = split_context(context, microbatches, device, found)
    if found:
        raise InputError(found[0])
    empty: list[dict[str, object]] = [{} for _ in range(microbatches)]
    return split or empty


def gradients(stages: Sequence[torch.nn.Module]) -> dict[ParamKey, torch.Tensor]:
    """Each parameter's `.grad` (zeros where None), keyed by (stage, name), on the CPU."""
    return {
        (index, name): (p.grad if p.grad is not None else torch.zeros_like(p))
        .detach()
        .cpu()
        .clone()
        for index, stage in enumerate(stages)
        for name, p in stage.named_parameters()
    }


class ParamDiff(NamedTuple):
    """How far one parameter's gradient on one rank is from the reference."""

    stage: int
    name: str
    rank: int
    max_abs: float
    max_rel: float  # max_abs / max |reference| of this parameter

    def describe(self) -> str:
        return (
            f"stage {self.stage} '{self.name}' on rank {self.rank}: max abs diff "
            f"{self.max_abs:.3g}, rel {self.max_rel:.3g}"
        )


def compare(
    got: dict[ParamKey, torch.Tensor], want: dict[ParamKey, torch.Tensor], rank: int = 0
) -> tuple[float, float, list[ParamDiff]]:
    """max |a - b| over all parameters, that divided by max |b| over all parameters, and
    each parameter's own differences."""
    worst = scale = 0.0
    diffs = []
    for (stage, name), value in got.items():
        ref = want[(stage, name)].float()
        diff = float((value.float().cpu() - ref).abs().max()) if value.numel() else 0.0
        size = float(ref.abs().max()) if ref.numel() else 0.0
        worst, scale = max(worst, diff), max(scale, size)
        diffs.append(ParamDiff(stage, name, rank, diff, diff / size if size > 0 else diff))
    return worst, (worst / scale if scale > 0 else worst), diffs


def default_tolerance(dtypes: Sequence[torch.dtype]) -> float:
    """fp32 (and fp64): 1e-5; any bf16 or fp16 among the parameters' or autocast's: 1e-2."""
    low = any(d in (torch.bfloat16, torch.float16) for d in dtypes)
    return 1e-2 if low else 1e-5


@contextlib.contextmanager
def threads(count: int) -> Iterator[None]:
    """Run with `count` intra-op threads (the ranks' count), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
