"""What a step shows of itself: its times and rows (`StepStats`), and non-finite values.

`PipelineRuntime.last_step` is the last step's `StepStats`: its wall time on this rank, the
host time spent in the program's waits (a rank that waits much is starved by its peers), and
the rows of its batch (M microbatches), from which a script derives its throughput.

With `RuntimeConfig(check_finite=True)` every loss of the step on this rank (the main loss of
each microbatch whose last stage lives here, and each loss added with `add_loss`) is checked
once, at the end of the step: one `isfinite` over all of them stacked and one host read (the
step's only added sync); only when that finds one is the first non-finite loss looked for,
by microbatch, then stage, the added losses of a stage before the main loss of the last.
Off (the default), nothing is checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from pipecc.diagnostics import RankError
from pipecc.ir.program import Program

from ..boundaries.trees import Boundary
from ..plan.binding import Chunk


class NonFiniteError(RankError):
    """A non-finite loss or gradient norm (`RuntimeConfig(check_finite=True)`, or
    `clip_grad_norm_(error_if_nonfinite=True)`): the message names the rank, the step, the
    stage and the microbatch where it first appeared."""


@dataclass(frozen=True)
class StepStats:
    """One step on this rank: `seconds` of wall time, `waiting` of them on the host in the
    program's waits (0 under a `Recorder`, which times the waits itself), the `rows` of its
    batch (M microbatches of the step's signature), and its index `step`."""

    step: int
    seconds: float
    waiting: float
    rows: int


def check_losses(
    where: tuple[int, int],
    losses: Mapping[int, torch.Tensor],
    added: Mapping[int, Mapping[int, torch.Tensor]],
    last_stage: int,
) -> None:
    """Raise `NonFiniteError` at the first non-finite loss of the step (module docstring);
    `where`: (rank, step)."""
    values = [*losses.values(), *(v for stages in added.values() for v in stages.values())]
    if not values:
        return
    stacked = torch.stack([v.detach().reshape(()).float() for v in values])
    if bool(torch.isfinite(stacked).all()):  # the one host read
        return
    rank, step = where
    for mb in sorted({*losses, *added}):
        mine = sorted(added.get(mb, {}).items())
        found = [(stage, "the loss it added (add_loss)", value) for stage, value in mine]
        if mb in losses:
            found.append((last_stage, "the loss", losses[mb]))
        for stage, what, value in found:
            if not bool(torch.isfinite(value).all()):
                raise NonFiniteError(
                    f"rank {rank}, step {step}: {what} is {float(value)} at stage {stage}, "
                    f"microbatch {mb}: the first non-finite loss of the step "
                    "(RuntimeConfig(check_finite=True))"
                )


def nonfinite_norm(
    where: tuple[int, int], total: torch.Tensor, norm_type: float, stages: list[int]
) -> NonFiniteError:
    """The error for a gradient norm that is not finite; `stages`: this rank's stages whose
    gradients hold a non-finite value."""
    rank, step = where
    here = (
        f"the gradients of stage {', '.join(map(str, stages))} on this rank hold non-finite values"
        if stages
        else "no gradient on this rank is: another rank's stage holds them"
    )
    return NonFiniteError(
        f"rank {rank}, step {step}: the gradient norm of order {norm_type:g} over the pipeline "
        f"is {float(total)}, so the gradients cannot be clipped ({here}); the norm is the "
        "same on every rank: every rank raises this"
    )


def nonfinite_stages(
    chunks: Iterable[Chunk], grad_of: Callable[[torch.nn.Parameter], torch.Tensor | None]
) -> list[int]:
    """The stages among `chunks` whose gradients hold a nan or inf (an error's words)."""
    found = set()
    for chunk in chunks:
        for param in chunk.module.parameters():
            grad = grad_of(param)
            if grad is not None and not bool(torch.isfinite(grad).all()):
                found.add(chunk.slot.stage)
    return sorted(found)


def rows_of(boundaries: Mapping[int, Boundary] | None, program: Program) -> int:
    """The rows of a step's batch: M times those of a microbatch of its signature (0 when
    stage 0's input has no tensor with a leading dimension)."""
    tensors = boundaries[0].tensors if boundaries else ()
    rows = tensors[0].shape[0] if tensors and tensors[0].shape else 0
    return int(rows) * program.num_microbatches
