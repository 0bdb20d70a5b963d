"""Own stages only: `split_model` cuts this rank's stage out of a whole model on the meta device.

`split_model` cuts one stage out of a whole model built on the meta device (no memory): a
copy of the model with the other stages' layers removed, every remaining name unchanged, so
a checkpoint of the whole model loads into it by name and its gradients compare by name
with a single-process reference; only then are its tensors allocated (`to_empty`) and the
caller's initialisation run on them. It splits as torchtitan's pipeline split does: a deep
copy of the meta model per stage, the layers of other stages deleted from the layer
containers (a container the stage holds nothing of stays, empty), and any other module the
stage does not hold set to None, so the model's forward skips a None part, as torchtitan's
models do (`if self.embed is not None`). Unlike torchtitan, which rebuilds a `ModuleList`
from the kept layers (renumbering them: only a `ModuleDict` keeps its keys there), every
container here keeps the keys of its kept layers, so the names are the whole model's in
any container; the forward iterates over its containers (positions change, names do not),
and names may be nested at any depth (`trunk.layers.3`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence

import torch

from pipecc.diagnostics import InputError

from ..compat import buffer_table, child_table, parameter_table

__all__ = ["split_model", "stage_layers"]

CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def split_model(
    model: torch.nn.Module,
    stage: int,
    num_stages: int,
    *,
    layers: str | Sequence[Sequence[str]],
    init: Callable[[torch.nn.Module], object] | None,
    device: torch.device | str = "cpu",
) -> torch.nn.Module:
    """Stage `stage` of `num_stages` of `model` (built on the meta device), materialized.

    `layers`: the names (FQNs) of the modules each stage holds, one list per stage (a name
    holds the module and everything under it, e.g. `["embed", "blocks.0", "blocks.1"]`), or
    the name of the model's layer container (a ModuleList, ModuleDict or Sequential): its
    layers cut into `num_stages` consecutive runs of equal size (the first stages one more
    when they do not divide), the modules registered before it (beside it, and beside each
    module above it) on the first stage, those after it on the last. Every parameter and
    buffer of the model must belong to a stage.
    `init(module)` initialises the materialized stage (its parameters and its buffers, which
    `to_empty` leaves uninitialised like the parameters); None leaves them uninitialised, to
    load a checkpoint into right after. `model` itself is left on the meta device, unchanged.
    """
    keep = stage_layers(model, num_stages, layers)[_index(stage, num_stages)]
    on_device = sorted(
        f"{name} ({tensor.device})"
        for name, tensor in (*model.named_parameters(), *model.named_buffers())
        if tensor.device.type != "meta"
    )
    if on_device:
        raise InputError(
            f"split_model takes a model built on the meta device (with torch.device('meta'):"
            f" ...), but {', '.join(on_device[:3])} {'is' if len(on_device) == 1 else 'are'} "
            "not on it"
        )
    part = copy.deepcopy(model)  # meta tensors: no memory is copied
    _prune(part, "", frozenset(keep))
    part.to_empty(device=device)
    if init is not None:
        init(part)
    return part


def stage_layers(
    model: torch.nn.Module, num_stages: int, layers: str | Sequence[Sequence[str]]
) -> list[list[str]]:
    """The module names each stage holds (`split_model`'s `layers`, checked)."""
    names = dict(model.named_modules())
    if isinstance(layers, str):
        found = _cut(model, names, num_stages, layers)
    else:
        found = [list(stage) for stage in layers]
        if len(found) != num_stages:
            raise InputError(
                f"split_model: layers names {len(found)} stages, but the model is cut into "
                f"{num_stages}"
            )
    tensors = list(dict.fromkeys(name for name, _ in _tensors(model)))  # in model order
    for index, stage in enumerate(found):
        unknown = [n for n in stage if n not in names and n not in tensors]
        if unknown:
            raise InputError(
                f"split_model: stage {index}'s layers name {unknown}, which the model does not "
                "have (its children: " + ", ".join(n for n, _ in model.named_children()) + ")"
            )
    placed = [n for stage in found for n in stage]
    homeless = [t for t in tensors if not any(_under(t, n) for n in placed)]
    if homeless:
        raise InputError(
            f"split_model: the model's {', '.join(homeless[:4])}"
            f"{' and others' if len(homeless) > 4 else ''} belong to no stage's layers"
        )
    return found


def _cut(
    model: torch.nn.Module, names: Mapping[str, torch.nn.Module], num_stages: int, name: str
) -> list[list[str]]:
    container = names.get(name)
    if not isinstance(container, CONTAINERS):
        kind = "no module" if container is None else type(container).__name__
        raise InputError(
            f"split_model: layers={name!r} must name the model's ModuleList, ModuleDict or "
            f"Sequential of layers, but the model has {kind} there"
        )
    keys = [f"{name}.{key}" for key, child in child_table(container).items() if child is not None]
    if len(keys) < num_stages:
        raise InputError(
            f"split_model: {name} has {len(keys)} layers, fewer than the {num_stages} stages"
        )
    size, extra = divmod(len(keys), num_stages)
    found, start = [], 0
    for index in range(num_stages):
        end = start + size + (index < extra)
        found.append(keys[start:end])
        start = end
    parts = name.split(".")  # at each level up, siblings before go first, after go last
    for depth in reversed(range(len(parts))):
        parent = ".".join(parts[:depth])
        prefix = parent + "." if parent else ""
        order = [prefix + child for child, _ in names[parent].named_children()]
        at = order.index(prefix + parts[depth])
        found[0][:0] = order[:at]
        found[-1].extend(order[at + 1 :])
    return found


def _prune(module: torch.nn.Module, prefix: str, keep: frozenset[str]) -> None:
    """Remove from `module` (named `prefix`) every part not held: kept names keep their
    whole subtree; a container's other entries are deleted (keys of the rest unchanged; a
    container held not at all stays, empty), any other module not held becomes None;
    parameters and buffers registered on a module only partly held stay only when named."""
    for name, child in list(child_table(module).items()):
        if child is None:
            continue
        fqn = prefix + name
        if fqn in keep:
            continue
        if isinstance(child, CONTAINERS) or any(k.startswith(fqn + ".") for k in keep):
            _prune(child, fqn + ".", keep)
        elif isinstance(module, CONTAINERS):
            del child_table(module)[name]
        else:
            setattr(module, name, None)
    for table in (parameter_table(module), buffer_table(module)):
        for name in list(table):
            if table[name] is not None and prefix + name not in keep:
                table[name] = None


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def _under(name: str, holder: str) -> bool:
    return name == holder or name.startswith(holder + ".")


def _index(stage: int, num_stages: int) -> int:
    if not 0 <= stage < num_stages:
        raise InputError(f"split_model: stage {stage} of {num_stages} stages does not exist")
    return stage
