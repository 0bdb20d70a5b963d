"""Losses added from inside a stage's forward (`add_loss`): MoE load balancing, z-losses.

`add_loss(x, loss)` returns `x` and makes the scalar `loss` contribute to the gradient with
the scaling of the main loss. How it does so depends on who runs the forward:

* **Inside pipecc** (the runtime's forwards, the single-process references of `--check`
  and `check_against`), a *collector* is installed around each stage forward
  (`collecting`): `add_loss` appends `loss` to it and returns `x` itself, untouched. The
  runtime keeps the collected losses of each (chunk, microbatch) beside the stage's outputs
  and makes them extra roots of that stage's backward, each seeded with the main loss's
  scale 1/M (`scaled_roots`): `B`, `I` then `W` (both split-backward methods take roots as
  they come), the fused `F&B`/`F&I` and the user's overlap hook all start from (outputs,
  output gradients) plus (added losses, 1/M). So `.grad` holds the gradient of
  mean over microbatches of (main loss + every added loss), wherever they were added.
* **Outside pipecc** (plain training, no collector installed) `add_loss` returns `x`
  through an identity autograd function whose backward also sends a gradient of 1 into
  `loss`: `loss` contributes with scale 1 to any backward that flows through the returned
  tensor, as if it had been added to the loss the caller backpropagates. So the returned
  tensor must be used (`h = add_loss(h, aux)`), as it is in a stage that passes it on.

One model file therefore works in both (no pipecc-specific branch). The collector is
process-wide, not thread-local: only a forward installs it.

pipecc recomputes nothing itself. A user's activation checkpointing inside a stage re-runs
forwards during the backward, outside any collector: with torch's non-reentrant
checkpointing the recomputed `add_loss` is in plain mode but its node is not in the graph
being differentiated, so nothing counts twice; reentrant checkpointing (its forward under
`no_grad`) would seed the loss with 1 instead of 1/M. Neither is covered by the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist

from pipecc.diagnostics import InputError

from ..comm.agreement import finished
from ..comm.mesh import replicas_mean

Tensors = tuple[torch.Tensor, ...]


class _State:
    """The collector of the forward running now (None: plain mode)."""

    collector: list[torch.Tensor] | None = None


def add_loss(x: Any, loss: torch.Tensor) -> Any:
    """Return `x` unchanged; make the scalar `loss` contribute to the gradient of the
    stage's backward with the main loss's scaling (module docstring)."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = (
            f"a tensor of shape {list(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else (type(loss).__name__)
        )
        raise InputError(f"add_loss takes a scalar tensor loss, got {got}")
    collector = _State.collector
    if collector is not None:
        collector.append(loss.reshape(()))
        return x
    if not (torch.is_grad_enabled() and loss.requires_grad):
        return x
    if not isinstance(x, torch.Tensor) or not (x.dtype.is_floating_point or x.is_complex()):
        raise InputError(
            "add_loss outside pipecc carries the loss in the backward of x: x must be a "
            f"floating tensor the model's output depends on, got {_kind(x)}"
        )
    apply = cast(Callable[[torch.Tensor, torch.Tensor], torch.Tensor], _AddLoss.apply)
    return apply(x, loss)


def _kind(x: object) -> str:
    return f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__


class _AddLoss(torch.autograd.Function):
    """Identity on `x`; the backward also seeds `loss` with a gradient of 1."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.loss_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


@contextmanager
def collecting(found: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """`add_loss` calls inside append their losses to `found` (the block is one forward)."""
    previous, _State.collector = _State.collector, found
    try:
        yield found
    finally:
        _State.collector = previous


def total(losses: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The sum of a forward's added losses (None when it added none)."""
    if not losses:
        return None
    found = losses[0]
    for loss in losses[1:]:
        found = found + loss.to(found.device)
    return found


def scaled_roots(added: torch.Tensor | None, scale: float) -> tuple[Tensors, Tensors]:
    """The extra roots of a backward: the added loss, seeded with `scale` (1/M)."""
    if added is None or not added.requires_grad:
        return (), ()
    return (added,), (torch.full_like(added, scale),)


class LossBreakdown(NamedTuple):
    """A step's loss over the whole pipeline, the same on every rank (`global_loss`).

    `main`: the mean over the M microbatches of `loss_fn`; `added`: the mean over the
    microbatches of every loss added with `add_loss`, summed over the stages; `total`:
    `main + added`, the loss whose gradient `.grad` holds; `by_stage[s]`: stage s's part of
    `added` (its own mean over microbatches; stages that added nothing are absent)."""

    total: float
    main: float
    added: float
    by_stage: dict[int, float]


def breakdown(
    losses: Mapping[int, torch.Tensor],
    aux_losses: Mapping[int, Mapping[int, torch.Tensor]],
    num_stages: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    timeout: float | None = None,
) -> LossBreakdown:
    """Every rank's main and added losses, summed in one all-reduce (a collective): the
    main losses' sum and count, then per stage its added losses' sum and count. `timeout`:
    seconds the all-reduce may take (gloo; None: the group's own)."""
    sums = torch.zeros(2 + 2 * num_stages, dtype=torch.float64, device=device)
    sums[0] = sum((float(v) for v in losses.values()), 0.0)
    sums[1] = float(len(losses))
    for stages in aux_losses.values():
        for stage, value in stages.items():
            sums[2 + stage] += float(value)
            sums[2 + num_stages + stage] += 1.0
    work = dist.all_reduce(sums, group=group, async_op=True)
    finished(work, timeout, "the all-reduce of the step's losses over the pipeline")
    values: list[float] = sums.tolist()
    count = max(values[1], 1.0)
    by_stage = {
        s: values[2 + s] / count for s in range(num_stages) if values[2 + num_stages + s] > 0
    }
    main, added = values[0] / count, sum(by_stage.values())
    return LossBreakdown(main + added, main, added, by_stage)


def over_replicas(
    found: LossBreakdown, mesh: Any, pp_dim: str, device: torch.device
) -> LossBreakdown:
    """A pipeline's breakdown averaged over every pipeline of the mesh (one all-reduce over
    the other dimensions; as it is without a mesh). Every replica runs the same stages, so
    each adds losses in the same stages."""
    if mesh is None:
        return found
    stages = sorted(found.by_stage)
    parts = [found.total, found.main, found.added, *(found.by_stage[s] for s in stages)]
    values = torch.tensor(parts, dtype=torch.float64, device=device)
    mean = replicas_mean(values, mesh, pp_dim).tolist()
    return LossBreakdown(mean[0], mean[1], mean[2], dict(zip(stages, mean[3:], strict=True)))
