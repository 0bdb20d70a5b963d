"""The per-layer profile of `pipecc run --profile-layers`: what `pipecc search --layers` reads.

Each layer (a module of the model file's `build_layers_model()`, named as in the cut) is
timed alone, in one process, on one microbatch of the run's batch: the whole model runs
once with a forward pre-hook on every layer that keeps the layer's real input; then each
layer runs on that input `repeats` times, F being the median time of its forward and B the
median time of its whole backward (`torch.autograd.backward` from its output, its input
requiring a gradient), both with `time.perf_counter`, on one thread as each rank runs. The
format's `B` key is written, so the search takes I = W = B/2 (the split into I and W is
not measured). The last layer's F and B include the loss (`loss_fn` on its output).
`act_bytes` are the bytes of the tensors its forward saves for backward (counted with
`saved_tensors_hooks`, each storage once), `param_bytes` its parameters', `input_bytes` its
input's. `comm` is the message latency the run's own steps fitted
(runtime/profiling/recorder.py), 0 when it has none.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["layer_names", "profile_layers", "render_layers"]

CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def layer_names(model: torch.nn.Module) -> list[str]:
    """The model's layers when no cut names them: its children, a container's entries
    each a layer (`embed`, `blocks.0` ... `blocks.N-1`, `head`)."""
    names = []
    for name, child in model.named_children():
        if isinstance(child, CONTAINERS):
            names += [f"{name}.{key}" for key, sub in child._modules.items() if sub is not None]
        else:
            names.append(name)
    return names


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a tensor, tuple, list or dict (nested)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, tuple | list):
        return [t for item in value for t in _tensors(item)]
    return []


def _map(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """`value` with `fn` applied to each of its tensors (in tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map(fn, item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_map(fn, item) for item in value)
    return value


def _inputs(
    model: torch.nn.Module, names: Sequence[str], batch: tuple[Any, ...]
) -> dict[str, tuple[Any, ...]]:
    """Each layer's positional input, captured on one forward of the whole model."""
    found: dict[str, tuple[Any, ...]] = {}
    modules = dict(model.named_modules())
    handles = []
    for name in names:

        def keep(_: torch.nn.Module, args: tuple[Any, ...], name: str = name) -> None:
            found[name] = _map(lambda t: t.detach().clone(), args)

        handles.append(modules[name].register_forward_pre_hook(keep))
    context = batch[2] if len(batch) == 3 else {}
    with torch.no_grad():
        model(batch[0], **context)
    for handle in handles:
        handle.remove()
    return found


def _run(
    module: torch.nn.Module, args: tuple[Any, ...], finish: Callable[[Any], Any]
) -> tuple[Any, tuple[Any, ...]]:
    args = _map(lambda t: t.detach().requires_grad_(t.is_floating_point()), args)
    return finish(module(*args)), args


def _time_layer(
    module: torch.nn.Module, args: tuple[Any, ...], finish: Callable[[Any], Any], repeats: int
) -> dict[str, float]:
    """F and B (ms, medians over `repeats`) and the bytes of one layer on its input."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _run(module, args, finish)
    forward, backward = [], []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        out, _ = _run(module, args, finish)
        forward.append(time.perf_counter() - start)
        outs = [t for t in _tensors(out) if t.requires_grad]
        start = time.perf_counter()
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        backward.append(time.perf_counter() - start)
        module.zero_grad(set_to_none=True)
    return {
        "F": statistics.median(forward[1:]) * 1e3,
        "B": statistics.median(backward[1:]) * 1e3,
        "act_bytes": sum(saved.values()),
        "param_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
        "input_bytes": sum(t.numel() * t.element_size() for t in _tensors(args)),
    }


def profile_layers(
    model: torch.nn.Module,
    names: Sequence[str],
    batch: tuple[Any, ...],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    repeats: int = 9,
) -> list[dict[str, Any]]:
    """One entry per layer, in model order: name, F, B (ms), act_bytes, param_bytes,
    input_bytes, on the microbatch `batch` ((inputs, targets) or with a context)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (runtime/tools/spawn.py)
    try:
        inputs = _inputs(model, names, batch)
        modules = dict(model.named_modules())
        entries = []
        for index, name in enumerate(names):
            last = index == len(names) - 1

            def finish(out: Any, last: bool = last) -> Any:
                return loss_fn(out, batch[1]) if last else out

            timed = _time_layer(modules[name], inputs[name], finish, repeats)
            entries.append({"name": name, **timed})
    finally:
        torch.set_num_threads(before)
    return entries


def render_layers(entries: Sequence[dict[str, Any]], comm: float, header: str) -> str:
    """The layer profile as TOML (docs/search.md section 12's format)."""
    lines = [f"# {line}" for line in header.splitlines()]
    lines += ['unit = "ms"', f"comm = {comm:.4g}"]
    for entry in entries:
        lines += ["", "[[layer]]", f'name = "{entry["name"]}"']
        lines += [f"{key} = {entry[key]:.4g}" for key in ("F", "B")]
        lines += [f"{key} = {int(entry[key])}" for key in ("act_bytes", "param_bytes")]
        lines.append(f"input_bytes = {int(entry['input_bytes'])}")
    return "\n".join(lines) + "\n"
