"""What crosses a stage boundary: shapes and dtypes, known before the first receive.

A stage takes a tuple of tensors and returns a tensor or a tuple of tensors. The runtime
allocates every receive buffer from a `TensorSpec` before it posts the receive, so the shapes
of all boundaries must be known before the first step. They are never exchanged between
ranks (DESIGN §5: the runtime issues no point-to-point traffic outside the program): either
the user gives them, or `infer_boundaries` computes them locally from the whole model on the
`meta` device (no memory, no arithmetic, no side effects on the real modules).

Boundaries are keyed by stage index in pipe 0's numbering (the `stage` of the program): entry
s is the input of stage s. Two pipes over the same stages (DualPipe) share the keys, since
stage s of either pipe is the same model stage. All microbatches of a step have the same
shapes (the batch splits evenly into M microbatches).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, TypeAlias

import torch
from torch.func import functional_call

from pipecc.diagnostics import InputError


class TensorSpec(NamedTuple):
    """The shape and dtype of one tensor of one microbatch at a stage boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def is_floating(self) -> bool:
        """Floating tensors carry a gradient backwards; others (masks, indices) do not."""
        return self.dtype.is_floating_point or self.dtype.is_complex

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype}[{', '.join(str(s) for s in self.shape)}]"

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype)


Specs: TypeAlias = tuple[TensorSpec, ...]
Boundaries: TypeAlias = Mapping[int, Specs]


def as_tuple(value: object, stage: int | None = None) -> tuple[torch.Tensor, ...]:
    """A stage's inputs or outputs as a tuple of tensors (a lone tensor becomes a 1-tuple);
    anything else is an InputError (naming `stage` when given: what it returned)."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    subject = "a stage must take and return" if stage is None else f"stage {stage} must return"
    raise InputError(f"{subject} a tensor or a tuple of tensors, got {type(value).__name__}")


def specs_of(tensors: Sequence[torch.Tensor]) -> Specs:
    return tuple(TensorSpec.of(t) for t in tensors)


def describe_specs(specs: Specs) -> str:
    return "(" + ", ".join(spec.describe() for spec in specs) + ")"


def normalise_boundaries(boundaries: Mapping[int, object]) -> dict[int, Specs]:
    """Accept a TensorSpec, a tuple of TensorSpecs or (shape, dtype) pairs for each stage."""
    result: dict[int, Specs] = {}
    for stage, value in boundaries.items():
        items = (value,) if isinstance(value, TensorSpec) else value
        if not isinstance(items, (tuple, list)):
            raise InputError(f"boundary of stage {stage}: expected TensorSpec(s), got {value!r}")
        specs = []
        for item in items:
            if isinstance(item, TensorSpec):
                specs.append(item)
            elif isinstance(item, (tuple, list)) and len(item) == 2:
                specs.append(TensorSpec(tuple(int(s) for s in item[0]), item[1]))
            else:
                raise InputError(f"boundary of stage {stage}: cannot read {item!r} as a spec")
        result[int(stage)] = tuple(specs)
    return result


def meta_forward(module: torch.nn.Module, specs: Specs) -> Specs:
    """The output specs of `module` on inputs of `specs`, computed on the meta device.

    The module's parameters and buffers are replaced by meta tensors for the call, so the real
    module is untouched (no running-statistics update, no allocation).
    """
    state = {
        name: torch.empty_like(value, device="meta")
        for name, value in (*module.named_parameters(), *module.named_buffers())
    }
    inputs = tuple(torch.empty(spec.shape, dtype=spec.dtype, device="meta") for spec in specs)
    with torch.no_grad():
        outputs = functional_call(module, state, inputs)
    return specs_of(as_tuple(outputs))


def infer_boundaries(
    stages: Sequence[torch.nn.Module], sample: torch.Tensor | Sequence[torch.Tensor]
) -> dict[int, Specs]:
    """Every stage's input specs, from the whole model in stage order and one microbatch.

    `sample` is the input of stage 0 for one microbatch (only its shapes and dtypes are used).
    Entry 0 is the sample itself; entry len(stages) is the model's output.
    """
    specs = specs_of(as_tuple(sample))
    boundaries = {0: specs}
    for index, stage in enumerate(stages):
        try:
            specs = meta_forward(stage, specs)
        except Exception as err:  # an op without a meta kernel, a data-dependent shape, ...
            raise InputError(
                f"cannot infer the output shapes of stage {index} on the meta device ({err}); "
                "pass the boundaries explicitly"
            ) from err
        boundaries[index + 1] = specs
    return boundaries
