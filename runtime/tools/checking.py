"""`pipecc run --check`: every rank's gradients against the single-process reference.

The reference runs in the launcher with the ranks' intra-op thread count (one), on the ranks'
device type, with the runtime's RNG derivation and autocast (runtime/tools/reference.py), once per
step. Every copy of every parameter (both holders of a duplicated stage, both ends of a tied
weight) is compared, and the worst parameters are reported by name, stage and rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .model_file import ModelFile
from .reference import Options, ParamDiff, compare, reference_step, threads

RANK_THREADS = 1  # what `spawn` gives every rank
SHOWN = 5  # the worst parameters a report lists


class CheckResult(NamedTuple):
    max_abs: float
    max_rel: float
    reference_loss: float
    worst: tuple[ParamDiff, ...]  # the worst parameters over all steps, worst first
    failures: tuple[str, ...] = ()  # what fails whatever the tolerance (--reference whole)
    reference_added: float | None = None  # the reference's mean added loss (add_loss)


def tie(stages: Sequence[torch.nn.Module], groups: Sequence[Sequence[tuple[int, str]]]) -> None:
    """Make each declared group one Parameter in the reference (the model file's
    `shared(num_stages)`: stages `build_stage` built apart), its first key's object."""
    for group in groups:
        (stage, name), *others = group
        first = stages[stage].get_parameter(name)
        for other_stage, other in others:
            owner, _, leaf = other.rpartition(".")
            setattr(stages[other_stage].get_submodule(owner), leaf, first)


def check_run(
    model: ModelFile,
    num_stages: int,
    batches: Sequence[tuple[Any, Any]],
    microbatches: int,
    options: Options,
    grads: Sequence[Sequence[dict[tuple[int, str], torch.Tensor]]],
) -> CheckResult:
    """`grads[rank][step]`: each rank's gradients of each step, keyed (stage, name)."""
    with threads(RANK_THREADS):
        stages = [s.to(options.device) for s in model.all_stages(num_stages)]
        tie(stages, model.declared_shared(num_stages))
        worst_abs = worst_rel = loss = 0.0
        found: dict[tuple[int, str, int], ParamDiff] = {}
        for step, batch in enumerate(batches):
            loss, want = reference_step(
                stages, batch, microbatches, model.loss_fn, options._replace(step=step)
            )
            for rank, per_step in enumerate(grads):
                got_abs, got_rel, diffs = compare(per_step[step], want, rank)
                worst_abs, worst_rel = max(worst_abs, got_abs), max(worst_rel, got_rel)
                for diff in diffs:
                    key = (diff.stage, diff.name, diff.rank)
                    if key not in found or found[key].max_abs < diff.max_abs:
                        found[key] = diff
    ranked = sorted(found.values(), key=lambda d: (-d.max_rel, -d.max_abs))
    return CheckResult(worst_abs, worst_rel, loss, tuple(ranked[:SHOWN]))
