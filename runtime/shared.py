"""Parameters held by several ranks: duplicated stages and tied (shared) weights, one mechanism.

A model-level parameter is named by its key (stage, name): the stage in pipe 0's numbering
and its name in that stage's module. Two things make one parameter live in several places:

- a stage held twice (DualPipe's two pipes over the same stages: stage s on ranks s and
  P-1-s), so every key of that stage has a copy on each holder;
- a parameter shared by several stages (GPT-2's tied embedding: the token embedding of the
  first stage is the LM head of the last), declared as a group of keys (`shared_parameters`
  finds the groups from the whole model by `Parameter` identity).

A group is a set of keys that are one parameter; its holders are the ranks holding a stage
of one of its keys. Each copy's gradient holds only what its own microbatches and uses gave,
so the step's gradient is the sum over the holders. At the end of `step` every rank adds the
gradients of its distinct local objects of a group (an object used by two local chunks has
already accumulated both uses), then the holders of each set of ranks exchange one flat
tensor of all their groups in one batch (one exchange per set of ranks, the sets in a
fixed global order, so no two ranks wait on each other in a cycle), and every holder adds the
contributions in rank order, so all copies end bitwise equal. These exchanges are the only
point-to-point traffic outside the program, after its last instruction.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple, TypeAlias

import torch

from pipecc.ir.placement import Placement

from .comm import Channel

ParamKey: TypeAlias = tuple[int, str]  # (stage, parameter name in that stage's module)
Bucket: TypeAlias = tuple[tuple[int, ...], torch.dtype]  # (the holders, the gradients' dtype)


class ParamGrads:
    """Where a parameter's gradient lives: `.grad` (`runtime/precision.py` has the fp32
    accumulator, with the same three methods)."""

    def get(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        return param.grad

    def set(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        param.grad = value

    def dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        return param.dtype


def shared_parameters(stages: Sequence[torch.nn.Module]) -> tuple[tuple[ParamKey, ...], ...]:
    """The groups of keys that are one `Parameter` object in the whole model (`stages` in
    stage order, as every rank builds it), for `RuntimeConfig(shared=...)`."""
    found: dict[int, list[ParamKey]] = defaultdict(list)
    for stage, module in enumerate(stages):
        for name, param in module.named_parameters():
            found[id(param)].append((stage, name))
    return tuple(tuple(keys) for keys in found.values() if len({s for s, _ in keys}) > 1)


def shared_stages(groups: Sequence[Sequence[ParamKey]]) -> list[list[int]]:
    """The groups of stages that hold one parameter, sorted (the cost file's `shared`, from
    which the simulator decides whether a placement sums gradients across ranks)."""
    found = {tuple(sorted({stage for stage, _ in keys})) for keys in groups}
    return [list(group) for group in sorted(found)]


class Group(NamedTuple):
    """One model-level parameter held by this rank: its keys, the ranks that hold a copy,
    and this rank's distinct objects of it."""

    keys: tuple[ParamKey, ...]
    ranks: tuple[int, ...]
    local: tuple[torch.nn.Parameter, ...]


def local_groups(
    placement: Placement,
    rank: int,
    modules: Mapping[int, torch.nn.Module],
    declared: Iterable[Sequence[ParamKey]],
) -> list[Group]:
    """Every parameter this rank holds, as groups in key order (declared groups merged)."""
    merged: dict[ParamKey, tuple[ParamKey, ...]] = {}
    for keys in declared:
        group = tuple(sorted((int(s), str(n)) for s, n in keys))
        for key in group:
            merged[key] = tuple(sorted({*merged.get(key, ()), *group}))
    objects: dict[tuple[ParamKey, ...], list[torch.nn.Parameter]] = defaultdict(list)
    for key, param in _held(placement, rank, modules):
        keys = merged.get(key, (key,))
        if all(param is not other for other in objects[keys]):
            objects[keys].append(param)
    return [
        Group(keys, _holders(placement, keys), tuple(objects[keys])) for keys in sorted(objects)
    ]


def _held(
    placement: Placement, rank: int, modules: Mapping[int, torch.nn.Module]
) -> Iterator[tuple[ParamKey, torch.nn.Parameter]]:
    """Each (key, parameter) of this rank's chunks, in chunk order."""
    for slot in placement.chunks(rank):
        module = modules.get(slot.chunk)
        for name, param in module.named_parameters() if module is not None else ():
            yield (slot.stage, name), param


def _holders(placement: Placement, keys: Iterable[ParamKey]) -> tuple[int, ...]:
    return tuple(
        sorted(
            {
                placement.holder(pipe, stage).rank
                for stage, _ in keys
                for pipe in range(placement.num_pipes)
                if stage < placement.num_stages(pipe)
            }
        )
    )


def to_sum(groups: Sequence[Group], grads: ParamGrads) -> dict[Bucket, list[Group]]:
    """The groups whose gradient is a sum of several copies, by their set of holders and
    the dtype of their gradients, in one global order (the same on every rank)."""
    buckets: dict[Bucket, list[Group]] = defaultdict(list)
    for group in groups:
        if len(group.ranks) > 1 or len(group.local) > 1:
            buckets[(group.ranks, grads.dtype(group.local[0]))].append(group)
    return dict(sorted(buckets.items(), key=lambda item: (item[0][0], str(item[0][1]))))


def distinct(groups: Sequence[Group]) -> list[torch.nn.Parameter]:
    """Each parameter object of this rank once, in group order (for an optimizer)."""
    seen: set[int] = set()
    found = []
    for group in groups:
        for param in group.local:
            if id(param) not in seen:
                seen.add(id(param))
                found.append(param)
    return found


def owned(groups: Sequence[Group], rank: int) -> list[torch.nn.Parameter]:
    """The objects whose parameter this rank counts once for the whole pipeline (the lowest
    holding rank counts a parameter held by several), each object once."""
    mine = [g for g in groups if g.ranks[0] == rank]
    return distinct([Group(g.keys, g.ranks, g.local[:1]) for g in mine])


def count_once(buckets: Mapping[Bucket, list[Group]], rank: int) -> None:
    """Before a step: keep what the gradient of each summed parameter already holds (the
    same on every copy after the last step's sum) only in the owner's first copy (the lowest
    holding rank's), so that the step's sum adds it once. Without this, a second step
    without zeroing (gradient accumulation) would count the first step's sum once per copy."""
    for groups in buckets.values():
        for group in groups:
            for index, param in enumerate(group.local):
                if index > 0 or group.ranks[0] != rank:
                    param.grad = None


def sum_shared(
    channel: Channel,
    rank: int,
    buckets: Mapping[Bucket, list[Group]],
    device: torch.device,
    grads: ParamGrads,
) -> None:
    """Make every copy's gradient the sum over all copies of its parameter (`grads`: where
    the gradients live)."""
    for (ranks, dtype), groups in buckets.items():
        own = _flat(groups, device, dtype, grads)
        peers = [r for r in ranks if r != rank]
        received = {peer: torch.empty_like(own) for peer in peers}
        if peers:
            channel.exchange(dict.fromkeys(peers, own), received)
        parts = {rank: own, **received}
        total = parts[ranks[0]].clone()
        for other in ranks[1:]:
            total += parts[other]
        offset = 0
        for group in groups:
            size = group.local[0].numel()
            value = total[offset : offset + size].view_as(group.local[0])
            for param in group.local:
                grads.set(param, value.clone())
            offset += size


def _flat(
    groups: Sequence[Group], device: torch.device, dtype: torch.dtype, grads: ParamGrads
) -> torch.Tensor:
    """This rank's contribution to each group (its distinct objects added), flattened."""
    parts = []
    for group in groups:
        found = [g for g in (grads.get(p) for p in group.local) if g is not None]
        total = torch.zeros(group.local[0].numel(), dtype=dtype, device=device)
        for grad in found:
            total += grad.reshape(-1)
        parts.append(total)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=device)


def sharing_problems(
    placement: Placement,
    rank: int,
    modules: Mapping[int, torch.nn.Module],
    declared: Iterable[Sequence[ParamKey]],
) -> list[str]:
    """Declared keys this rank should hold but does not; one object under two keys of
    stages also held elsewhere that no declaration joins (its copies would not be summed as
    one parameter)."""
    declared = [tuple((int(s), str(n)) for s, n in keys) for keys in declared]
    together = {key: set(keys) for keys in declared for key in keys}
    held = dict(_held(placement, rank, modules))
    mine = {slot.stage for slot in placement.chunks(rank)}
    found = [
        f"the shared parameter '{name}' of stage {stage} is not a parameter of that stage"
        for keys in declared
        for stage, name in keys
        if stage in mine and (stage, name) not in held
    ]
    first: dict[int, ParamKey] = {}
    for key, param in held.items():
        other = first.setdefault(id(param), key)
        spread = len(_holders(placement, (key, other))) > 1
        if other != key and key not in together.get(other, ()) and spread:
            found.append(
                f"'{key[1]}' of stage {key[0]} is the same Parameter as '{other[1]}' of stage "
                f"{other[0]}, but no declaration joins them: pass "
                "RuntimeConfig(shared=shared_parameters(stages))"
            )
    return found


def distinct_parameters(stages: Iterable[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """Every parameter of `stages` once (a tied weight once), in stage order."""
    seen: dict[int, torch.nn.Parameter] = {}
    for stage in stages:
        for param in stage.parameters():
            seen.setdefault(id(param), param)
    return list(seen.values())
