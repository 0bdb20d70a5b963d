"""Checkpoints of a pipelined training job, on `torch.distributed.checkpoint` (DCP).

`save_checkpoint(path, runtime, optimizer, scheduler=..., extra=...)` writes, and
`load_checkpoint` reads back, everything a resumed run needs, keyed by the **whole model's
parameter names** so that a checkpoint loads into another schedule, P or cut whose stages
carry the same names:

- `model.NAME`: every parameter and persistent buffer of the stages this rank holds. A
  parameter held by several ranks (DualPipe's duplicated stages) or under several names (a
  tied weight, declared in `RuntimeConfig(shared=...)`, runtime/comm/shared.py) is one
  entry, under the name of its first key (lowest stage, then name): DCP writes an entry that
  several ranks give once, from the lowest of them.
- `optim.NAME.KEY`: the optimizer's state of each parameter (AdamW's `exp_avg`, `step`,
  ...), `optim_group.NAME`: the hyperparameters of its parameter group (`lr`, ...).
- `runtime`: `PipelineRuntime.state_dict()` (the completed steps, the dropout seed);
  `scheduler`: the LR scheduler's `state_dict()`; `extra`: the user's dict (rank 0's).

Both are collectives over every process of the default group (DCP's), i.e. the pipeline's
ranks and, on a mesh, every other dimension's: DTensor parameters (FSDP2, tensor parallel)
are written and read as shards, each rank its own. Before either, one gather over the
pipeline's group checks that no name means two different parameters on two ranks (stages
built with stage-local names), which DCP would otherwise write once, silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from pipecc.diagnostics import InputError

from .pipeline import PipelineRuntime

Key = tuple[int, str]  # (stage, name in that stage's module)


class Scheduler(Protocol):
    """What a checkpoint needs of an LR scheduler (torch.optim.lr_scheduler's have it)."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class Names(NamedTuple):
    """The checkpoint name of each key this rank holds, and of each parameter object."""

    of_key: dict[Key, str]
    of_param: dict[int, str]  # id(parameter) -> name


def save_checkpoint(
    path: str | Path,
    runtime: PipelineRuntime,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scheduler: Scheduler | None = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write the stages' parameters and buffers, the optimizer's and scheduler's state, the
    runtime's own state and `extra` (the user's data position: rank 0's) into the folder
    `path`. A collective: every process of the job calls it."""
    names = checkpoint_names(runtime)
    state, _ = _model_state(runtime, names)
    if optimizer is not None:
        state.update(_optimizer_state(optimizer, names))
    state["runtime"] = runtime.state_dict()
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    state["extra"] = ("extra", dict(extra or {}))  # in a tuple: DCP drops an empty dict
    planner = DefaultSavePlanner(flatten_state_dict=False, dedup_save_to_lowest_rank=True)
    dcp_save(state, checkpoint_id=str(path), planner=planner)


def load_checkpoint(
    path: str | Path,
    runtime: PipelineRuntime,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scheduler: Scheduler | None = None,
) -> dict[str, Any]:
    """Read a checkpoint of `save_checkpoint` into this rank's stages, `optimizer`,
    `scheduler` and `runtime` (its step count and seed), in place; returns the saved
    `extra` (`{}` without), on every rank. A collective: every process calls it. The
    stages may be cut otherwise than when it was saved, as long as they carry the same
    parameter names; a name this rank needs that the checkpoint lacks is an InputError."""
    names = checkpoint_names(runtime)
    saved = _saved_keys(path)
    state, aliases = _model_state(runtime, names)
    if optimizer is not None:
        _initialise(optimizer)
        state.update(_optimizer_state(optimizer, names))
    objects = ["runtime", "extra"] + (["scheduler"] if scheduler is not None else [])
    state.update({key: None for key in objects})
    _require(path, saved, state)
    # flat keys, and objects loaded into `state` itself (a flattening copies it)
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    dcp_load(state, checkpoint_id=str(path), planner=planner)
    with torch.no_grad():
        for target, key in aliases:  # a second object of one parameter on this rank
            target.copy_(state[key])
    if optimizer is not None:
        _restore_optimizer(optimizer, names, state)
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    runtime.load_state_dict(state["runtime"])
    return dict(state["extra"][1])


def checkpoint_names(runtime: PipelineRuntime) -> Names:
    """The name of every key this rank holds (a shared parameter: its first key's name),
    checked with every rank of the pipeline: one name, one parameter (InputError else)."""
    of_key: dict[Key, str] = {}
    of_param: dict[int, str] = {}
    meaning: dict[str, tuple[Key, ...]] = {}
    for group in runtime.groups:
        name = group.keys[0][1]
        for key in group.keys:
            of_key[key] = name
        for param in group.local:
            of_param.setdefault(id(param), name)
        meaning.setdefault(name, group.keys)
        if meaning[name] != group.keys:
            meaning[name] = (*meaning[name], *group.keys)
    for slot in runtime.program.placement.chunks(runtime.rank):
        for name, _ in runtime.modules[slot.chunk].named_buffers():
            of_key[(slot.stage, name)] = name
            meaning.setdefault(name, ((slot.stage, name),))
    _check_unique(runtime, meaning)
    return Names(of_key, of_param)


def _check_unique(runtime: PipelineRuntime, meaning: dict[str, tuple[Key, ...]]) -> None:
    """One gather over the pipeline: a name that stands for two parameters is an error."""
    gathered: list[Any] = [None] * dist.get_world_size(runtime.group)
    dist.all_gather_object(gathered, meaning, group=runtime.group)
    seen: dict[str, set[tuple[Key, ...]]] = {}
    for found in gathered:
        for name, keys in found.items():
            seen.setdefault(name, set()).add(tuple(sorted(set(keys))))
    clashes = sorted(name for name, keys in seen.items() if len(keys) > 1)
    if clashes:
        name = clashes[0]
        stages = sorted({stage for keys in seen[name] for stage, _ in keys})
        raise InputError(
            f"checkpoint: {len(clashes)} names stand for several parameters, e.g. '{name}' "
            f"in stages {', '.join(map(str, stages))}: a checkpoint keys parameters by the "
            "whole model's names, so build the stages with them (split_model, or blocks "
            "numbered as in the whole model) or declare a tied weight in "
            "RuntimeConfig(shared=...)"
        )


def _model_state(
    runtime: PipelineRuntime, names: Names
) -> tuple[dict[str, Any], list[tuple[torch.Tensor, str]]]:
    """`model.NAME` -> the live tensor of each parameter and buffer held here (loaded in
    place), and the other objects of a name already given (copied after a load)."""
    state: dict[str, Any] = {}
    aliases: list[tuple[torch.Tensor, str]] = []
    objects: dict[str, int] = {}
    for slot in runtime.program.placement.chunks(runtime.rank):
        module = runtime.modules[slot.chunk]
        for name, value in module.state_dict(keep_vars=True).items():
            key = "model." + names.of_key.get((slot.stage, name), name)
            if key not in state:
                state[key], objects[key] = _detached(value), id(value)
            elif objects[key] != id(value):
                aliases.append((value, key))
    return state, aliases


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _optimizer_state(optimizer: torch.optim.Optimizer, names: Names) -> dict[str, Any]:
    """`optim.NAME.KEY` -> each parameter's state, `optim_group.NAME` -> its group's
    hyperparameters."""
    state: dict[str, Any] = {}
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for param in group["params"]:
            name = _name_of(param, names)
            state[f"optim_group.{name}"] = hyper
            for key, value in optimizer.state.get(param, {}).items():
                state[f"optim.{name}.{key}"] = value
    return state


def _name_of(param: torch.Tensor, names: Names) -> str:
    name = names.of_param.get(id(param))
    if name is None:
        raise InputError(
            "checkpoint: the optimizer steps a parameter that is not one of the runtime's "
            "(give it runtime.parameters())"
        )
    return name


def _initialise(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state where it has none yet (it makes it at its first step),
    so that a load has tensors to read into: one step on zero gradients with every group's
    learning rate 0, which moves no parameter, as torch.distributed.checkpoint.state_dict
    does."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    grads = [p.grad for p in params]
    rates = [g["lr"] for g in optimizer.param_groups]
    for param in params:
        param.grad = torch.zeros_like(param)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad


def _restore_optimizer(
    optimizer: torch.optim.Optimizer, names: Names, state: Mapping[str, Any]
) -> None:
    """Put what the load returned as objects (not tensors, which were read in place) back
    into the optimizer: each group's hyperparameters and non-tensor state."""
    for group in optimizer.param_groups:
        params = group["params"]
        if params:
            group.update(state[f"optim_group.{_name_of(params[0], names)}"])
        for param in params:
            name = _name_of(param, names)
            held = optimizer.state[param]
            for key in list(held):
                if not isinstance(held[key], torch.Tensor):
                    held[key] = state[f"optim.{name}.{key}"]


def _saved_keys(path: str | Path) -> set[str]:
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except (OSError, ValueError) as err:
        raise InputError(f"{path}: not a checkpoint of save_checkpoint ({err})") from None
    return set(metadata.state_dict_metadata)


def _require(path: str | Path, saved: set[str], state: Mapping[str, Any]) -> None:
    """Every key this rank reads is in the checkpoint; one gather, so that every rank
    raises alike (a rank that stopped alone would leave the others in DCP's collectives)."""
    mine = sorted(key for key in state if key not in saved)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    missing = sorted({key for found in gathered for key in found})
    if missing:
        kinds: dict[str, list[str]] = {}
        for key in missing:
            kinds.setdefault(WHAT.get(key.split(".")[0], key), []).append(key)
        parts = [f"{what} ({len(keys)}, e.g. '{keys[0]}')" for what, keys in kinds.items()]
        raise InputError(
            f"{path}: the checkpoint has no {'; no '.join(parts)}: it was saved without "
            "them, or from a model whose parameters have other names"
        )


WHAT = {
    "model": "parameters or buffers of these stages",
    "optim": "optimizer state",
    "optim_group": "optimizer hyperparameters",
    "scheduler": "LR scheduler state",
}
