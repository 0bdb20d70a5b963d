"""What the user gives a runtime besides the program: its device, and the boundaries it declares.

`runtime_device` decides the device a runtime computes and communicates on; `declared_of`
and `declared_problems` take the boundaries a user may declare (`PipelineRuntime(...,
boundaries=)`: `{stage: specs}`, or a function of a sample microbatch) and say where the
ones found on real data differ (runtime/plan/binding.py `declared_problems`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from pipecc.diagnostics import PipeccError
from pipecc.ir.program import Program

from .boundaries.signatures import BoundaryFn
from .boundaries.specs import Boundary, normalise_boundaries, synthetic
from .engine.rng import cuda_index
from .plan import binding

Declared = dict[int, Boundary] | BoundaryFn | None


def declared_of(boundaries: Mapping[int, object] | BoundaryFn | None) -> Declared:
    """The declared boundaries, normalised (a function is called per new signature)."""
    if boundaries is None or callable(boundaries):
        return boundaries
    return normalise_boundaries(boundaries)


def declared_problems(
    declared: dict[int, Boundary] | BoundaryFn,
    given: Boundary,
    boundaries: dict[int, Boundary],
    where: tuple[Program, int, int],
) -> list[str]:
    """Where `declared` differs from the `boundaries` found for a signature whose stage 0
    input is `given` (`where`: the program, this rank and the step)."""
    program, rank, step = where
    if callable(declared):
        sample = given.rebuild(synthetic(given.tensors, torch.device("cpu")))
        try:
            declared = normalise_boundaries(declared(sample))
        except Exception as err:  # the user's function: reported on every rank
            text = err.message if isinstance(err, PipeccError) else str(err).split("\n")[0]
            return [
                f"step {step}: the boundaries function failed on a sample microbatch "
                f"{given.describe()}: {type(err).__name__}: {text[:200]}"
            ]
    return binding.declared_problems(program, rank, declared, boundaries)


def runtime_device(
    given: torch.device | None,
    modules: Mapping[int, torch.nn.Module],
    group: dist.ProcessGroup | None,
) -> torch.device:
    """The runtime's device: the configured one (`cuda` without an index: the current CUDA
    device), else the first parameter's; a rank whose stages have no parameters takes the
    current CUDA device where the group runs NCCL (its peers' messages go over NCCL), else
    the CPU."""
    if given is not None:
        return torch.device("cuda", cuda_index(given)) if given.type == "cuda" else given
    for module in modules.values():
        for param in module.parameters():
            return param.device
    if torch.cuda.is_available() and "nccl" in dist.get_backend_config(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
