"""What crosses a stage boundary: structure, shapes and dtypes, known before each receive.

The runtime allocates every receive buffer from a `TensorSpec` before it posts the receive,
so the boundaries of a step's shapes must be known before the step runs. They are never sent
point to point outside the program (DESIGN §5): the ranks learn a step's input shapes with
one small collective (runtime/boundaries/signatures.py) and each computes the boundaries
locally, from the whole model (`infer_boundaries`) or from specs the user gives.

Boundaries are keyed by stage index in pipe 0's numbering (the `stage` of the program): entry
s is the input of stage s. Two pipes over the same stages (DualPipe) share the keys, since
stage s of either pipe is the same model stage. All microbatches of a step have the same
shapes (the batch splits evenly into M microbatches).

`infer_boundaries` runs each stage on the `meta` device (no memory, no arithmetic, the real
modules untouched). When that fails (an op without a meta kernel, data-dependent code such
as `.item()`) or when autocast is on (the meta device has no autocast), it runs the stage
for real on a microbatch of synthetic data on the stage's device, with copies of its buffers
and the RNG state restored after, so no parameter, buffer or random stream changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import torch
import torch.utils._pytree as pytree
from torch.func import functional_call

from pipecc.diagnostics import InputError

from .context import current_sample, on_device, on_meta, sample_context
from .trees import Boundary, TensorSpec, boundary_of, flatten

__all__ = ["Boundaries", "Boundary", "Specs", "TensorSpec", "infer_boundaries"]

Specs: TypeAlias = tuple[TensorSpec, ...]  # the tensors of one message, in leaf order
Boundaries: TypeAlias = Mapping[int, Boundary]


def normalise_boundaries(boundaries: Mapping[int, object]) -> dict[int, Boundary]:
    """Accept a Boundary, a TensorSpec, or a tuple of TensorSpecs or (shape, dtype) pairs
    for each stage."""
    result: dict[int, Boundary] = {}
    for stage, value in boundaries.items():
        if isinstance(value, Boundary):
            result[int(stage)] = value
            continue
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
        leaves = tuple(specs)
        tree = pytree.tree_flatten(0 if isinstance(value, TensorSpec) else _slots(leaves))[1]
        result[int(stage)] = Boundary(tree, leaves)
    return result


def _slots(leaves: tuple[TensorSpec, ...]) -> tuple[int, ...]:
    return tuple(range(len(leaves)))  # a tuple with one leaf per spec


def meta_forward(module: torch.nn.Module, given: Boundary) -> Boundary:
    """The output boundary of `module` for inputs of `given`, computed on the meta device.

    The module's parameters and buffers are replaced by meta tensors for the call (with the
    parameters' requires_grad, so the outputs say which carry a gradient)."""
    state = {
        name: torch.empty_like(value, device="meta").requires_grad_(value.requires_grad)
        for name, value in module.named_parameters()
    }
    state.update({name: torch.empty_like(b, device="meta") for name, b in module.named_buffers()})
    inputs = given.rebuild(
        tuple(
            torch.empty(s.shape, dtype=s.dtype, device="meta").requires_grad_(_wants_grad(s))
            for s in given.tensors
        )
    )
    with torch.enable_grad():
        outputs = functional_call(module, state, _args(inputs), on_meta(current_sample()))
    return boundary_of(outputs, "a stage's output")


def real_forward(
    module: torch.nn.Module,
    given: Boundary,
    device: torch.device,
    autocast: torch.dtype | None = None,
) -> Boundary:
    """The output boundary of `module` run for real on synthetic inputs of `given` on
    `device` (under autocast when given), with no side effects: the buffers are copies and
    the RNG state is restored."""
    buffers = {name: b.clone() for name, b in module.named_buffers()}
    with _fork_rng(device):
        inputs = given.rebuild(synthetic(given.tensors, device))
        with autocast_context(device, autocast), torch.enable_grad():
            kwargs = on_device(current_sample(), device)
            outputs = functional_call(module, buffers, _args(inputs), kwargs, strict=False)
    return boundary_of(outputs, "a stage's output")


def stage_output(
    module: torch.nn.Module,
    given: Boundary,
    device: torch.device | None = None,
    autocast: torch.dtype | None = None,
) -> Boundary:
    """The output boundary of a stage: on the meta device, else for real (module docs)."""
    device = device or _device_of(module)
    if autocast is None:
        try:
            with _fork_rng(device):  # a meta dropout may still advance the generator
                return meta_forward(module, given)
        except Exception:  # no meta kernel, data-dependent code: run it for real
            pass
    return real_forward(module, given, device, autocast)


def infer_boundaries(
    stages: Sequence[torch.nn.Module],
    sample: object,
    *,
    autocast: torch.dtype | None = None,
    device: torch.device | None = None,
    context: Mapping[str, Any] | None = None,
) -> dict[int, Boundary]:
    """Every stage's input boundary, from the whole model in stage order and one microbatch.

    `sample` is the input of stage 0 for one microbatch, any pytree (only its structure,
    shapes, dtypes and constants are used). Entry 0 is the sample itself; entry len(stages)
    is the model's output, absent when it is not a pytree of tensors and constants (a
    dataclass: only `loss_fn` reads it, nothing sends it). `autocast`: the dtype the forwards
    run under, if any. `context`: one microbatch of the step's context (every stage's
    keyword inputs, runtime/boundaries/context.py); by default the one the runtime
    installs while it learns a new signature.
    """
    if context is not None:
        with sample_context(context):
            return infer_boundaries(stages, sample, autocast=autocast, device=device)
    boundary = flatten(sample, "the sample input")[1]
    boundaries = {0: boundary}
    for index, stage in enumerate(stages):
        try:
            boundary = stage_output(stage, boundary, device, autocast)
        except InputError:
            if index == len(stages) - 1:  # the model's output, which no stage receives
                break
            raise
        except Exception as err:
            raise InputError(
                f"cannot infer the output shapes of stage {index} ({type(err).__name__}: "
                f"{err}); give the boundaries explicitly (a model file's boundaries())"
            ) from err
        boundaries[index + 1] = boundary
    return boundaries


def synthetic(specs: Specs, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Tensors of `specs` with fixed values (floats from a seeded normal, integers and
    booleans zero), so every rank computes the same shapes from them."""
    generator = torch.Generator(device=device).manual_seed(0)
    found = []
    for spec in specs:
        if spec.is_floating:
            tensor = torch.randn(spec.shape, generator=generator, device=device).to(spec.dtype)
            found.append(tensor.requires_grad_(_wants_grad(spec)))
        else:
            found.append(torch.zeros(spec.shape, dtype=spec.dtype, device=device))
    return tuple(found)


def _wants_grad(spec: TensorSpec) -> bool:
    return spec.is_floating and bool(spec.grad)


def _args(value: object) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


@contextlib.contextmanager
def _fork_rng(device: torch.device) -> Iterator[None]:
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


def autocast_context(
    device: torch.device, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager[Any]:
    """`torch.autocast` on `device`'s type with `dtype`; nothing when `dtype` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _device_of(module: torch.nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")
