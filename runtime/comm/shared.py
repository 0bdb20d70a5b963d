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
so the step's gradient is the sum over the holders. Every rank adds the gradients of its
distinct local objects of a group (an object used by two local chunks has already
accumulated both uses) into one flat tensor per set of holders (and dtype), and the holders
sum it:

- where the program places the sum (`GradientSums`: the compiler appends one all_reduce
  `collective` per set of holders, `grad-sum s0+s7`, passes/sum_shared.py), the interpreter
  runs it there as `all_reduce` over the holders' process group. Those groups are created
  once, at set-up, on the ranks of each set, the sets in one global order (sorted), with
  `new_group(use_local_synchronization=True)` so that ranks outside a set (other pipelines
  of a larger world) need not take part, each warmed by one tiny all_reduce there (NCCL
  makes a communicator at its first collective: never inside a step). The reduction
  leaves the same bits on every holder (gloo's and NCCL's rings reduce each element once
  and copy the result).
- a program that places sums, but none over a set of ranks holding one parameter, is
  refused when the runtime is built (`refuse_unplaced`, `InputError`): every rank computes
  the same sets from the placement and the declared groups, so every rank refuses before it
  makes a group or takes a step, naming the stages and the `--shared` that places the sum.
  Sets only a rank's own parameters reveal (`GradientSums.problems`) stop every rank at the
  first step's agreement.
- a program that holds no collective (compiled before collectives existed, or a torch CSV,
  whose format has none) keeps, through the library, the old path: after its last
  instruction the holders of each set of ranks exchange their flat tensors point to point
  (the sets in a fixed global order, so no two ranks wait on each other in a cycle) and each
  adds the contributions in rank order. That exchange is outside the program, so the
  verifier never saw it and nothing it proved covers it. `RuntimeConfig(sums_in_program=
  True)` refuses such a program like the one above instead; `pipecc run` sets it, after
  resolving the model file's ties into the program it verifies (runtime/tools/ties.py), so
  no step of a run exchanges anything outside the verified program.

Two objects of one parameter on one rank (a tie built apart, both stages on that rank) are
added on that rank after the program whatever it places (`GradientSums.after_program`):
nothing is exchanged.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import NamedTuple, TypeAlias, TypeGuard

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pipecc.diagnostics import InputError
from pipecc.ir.ops import Collective, CollectiveKind
from pipecc.ir.placement import Placement
from pipecc.ir.program import Program

from ..comm.channel import Channel

ParamKey: TypeAlias = tuple[int, str]  # (stage, parameter name in that stage's module)
Bucket: TypeAlias = tuple[tuple[int, ...], torch.dtype]  # (the holders, the gradients' dtype)


class ParamGrads:
    """Where a parameter's gradient lives: `.grad` (`runtime/engine/precision.py` has the fp32
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
    merged = {key: tuple(sorted(group)) for group in merged_ties(declared) for key in group}
    objects: dict[tuple[ParamKey, ...], list[torch.nn.Parameter]] = defaultdict(list)
    for key, param in _held(placement, rank, modules):
        keys = merged.get(key, (key,))
        if all(param is not other for other in objects[keys]):
            objects[keys].append(param)
    return [
        Group(keys, _holders(placement, keys), tuple(objects[keys])) for keys in sorted(objects)
    ]


def merged_ties(declared: Iterable[Sequence[ParamKey]]) -> list[set[ParamKey]]:
    """The declared groups of keys that are one parameter, merged where they share a key,
    transitively (a chain of ties, A with B and B with C, is one parameter: the compiler
    places one sum over all their holders, passes/sum_shared.py)."""
    merged: list[set[ParamKey]] = []
    for keys in declared:
        group = {(int(stage), str(name)) for stage, name in keys}
        joined = [other for other in merged if other & group]
        merged = [other for other in merged if not other & group]
        merged.append(group.union(*joined))
    return merged


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
        _scatter(total, groups, grads)


def _scatter(total: torch.Tensor, groups: Sequence[Group], grads: ParamGrads) -> None:
    """Every copy's gradient of each group from the flat sum of the groups."""
    offset = 0
    for group in groups:
        shape = _local(group.local[0]).shape
        size = shape.numel()
        value = total[offset : offset + size].view(shape)
        for param in group.local:
            grads.set(param, _like(param, value.clone()))
        offset += size


def _flat(
    groups: Sequence[Group], device: torch.device, dtype: torch.dtype, grads: ParamGrads
) -> torch.Tensor:
    """This rank's contribution to each group (its distinct objects added), flattened."""
    parts = []
    for group in groups:
        found = [g for g in (grads.get(p) for p in group.local) if g is not None]
        total = torch.zeros(_local(group.local[0]).numel(), dtype=dtype, device=device)
        for grad in found:
            total += _local(grad).reshape(-1)
        parts.append(total)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=device)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded parameter's (an FSDP2 or tensor-parallel DTensor's) or its gradient's shard
    on this rank; any other tensor as it is. Every holder of a parameter shards it alike (one
    shape, one placement over a mesh dimension of its own size, the same coordinate on each
    rank of one pipeline), so the holders' sum of their shards is the sum's shard."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (this rank's shard of a gradient) as a gradient of `param`: a DTensor placed
    as `param` is, for a sharded one."""
    if not isinstance(param, DTensor):
        return value
    return DTensor.from_local(
        value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )


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


class GradientSums:
    """The gradient sums a program places (module docstring): each of its all_reduce
    collectives sums this rank's buckets over its ranks. `outside`: the program places none,
    and the sums run after it (`sum_shared`)."""

    def __init__(
        self,
        program: Program,
        rank: int,
        buckets: Mapping[Bucket, list[Group]],
        grads: ParamGrads,
        *,
        device: torch.device,
        enabled: bool = True,
        required: bool = False,
    ) -> None:
        self.rank = rank
        self.mine = [(i, op) for i, op in enumerate(program.ranks[rank]) if _is_sum(op)]
        self.outside = not any(_is_sum(op) for ops in program.ranks for op in ops)
        self.buckets = buckets
        self.grads = grads
        self.device = device
        self.groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self.enabled = enabled  # RuntimeConfig.sync_duplicated
        self.required = required  # RuntimeConfig.sums_in_program: no sum after the program

    def create_groups(
        self,
        program: Program,
        rank_map: Sequence[int],
        group: dist.ProcessGroup | None,
        timeout: float,
    ) -> None:
        """The process group of each set of ranks of the program's collectives that holds
        this rank, created once, in one global order (sorted sets) on every member, and
        warmed there (`warm`): no communicator is made inside a step."""
        sets = sorted({_set(op) for ops in program.ranks for op in ops if _is_sum(op)})
        for ranks in sets:
            if self.rank not in ranks or any(r >= len(rank_map) for r in ranks):
                continue
            if len(ranks) == len(rank_map):  # the whole pipeline: its own group
                self.groups[ranks] = group
                continue
            made = dist.new_group(
                [rank_map[r] for r in ranks],
                timeout=timedelta(seconds=timeout),
                use_local_synchronization=True,
            )
            warm(made, self.device)
            self.groups[ranks] = made

    def problems(self) -> list[str]:
        """Collectives this runtime cannot run, and sums the program does not place."""
        found = [
            f"instruction {index} ({op.kind.value} {op.what}): this runtime runs blocking "
            "all_reduce gradient sums only"
            for index, op in self.mine
            if op.kind is not CollectiveKind.ALL_REDUCE or op.asynchronous
        ]
        if self.outside and not self.required:
            return found
        placed = {_set(op) for _, op in self.mine}
        for ranks, _ in self.buckets:
            if ranks not in placed and len(ranks) > 1:
                groups = self.buckets[(ranks, _)]
                stages = sorted({s for g in groups for s, _n in g.keys})
                tie = any(len({s for s, _n in g.keys}) > 1 for g in groups)
                found.append(_unsummed(stages, ranks, tie=tie))
        return found

    def after_program(self) -> dict[Bucket, list[Group]]:
        """The buckets `sum_shared` adds after the program: every one for a program that
        places no sum (module docstring), else only those held by this rank alone (two
        objects of one parameter in two of its chunks: added here, nothing exchanged); none
        when the sums are off (RuntimeConfig.sync_duplicated)."""
        if not self.enabled:
            return {}
        if self.outside:
            return dict(self.buckets)
        return {key: groups for key, groups in self.buckets.items() if key[0] == (self.rank,)}

    def run(self, op: Collective) -> None:
        """`op`'s all_reduce of this rank's buckets over its ranks (nothing to add on every
        member alike: a stage without parameters)."""
        if not self.enabled:
            return
        members = _set(op)
        group = self.groups[members]
        for (ranks, dtype), groups in self.buckets.items():
            if ranks != members:
                continue
            total = _flat(groups, self.device, dtype, self.grads)
            dist.all_reduce(total, group=group)
            _scatter(total, groups, self.grads)


def refuse_unplaced(
    program: Program, rank: int, declared: Iterable[Sequence[ParamKey]], required: bool
) -> None:
    """Raise `InputError` on this rank (and, the finding being the same on all, on every
    rank, when its runtime is built) where `program` places no gradient sum for a set of
    ranks holding one parameter (`unplaced_sums`)."""
    found = unplaced_sums(program, declared, required=required)
    if found:
        raise InputError(
            f"rank {rank}: the program is refused before its first step: " + "; ".join(found)
        )


def unplaced_sums(
    program: Program, declared: Iterable[Sequence[ParamKey]], *, required: bool
) -> list[str]:
    """The sets of ranks that hold one parameter (a stage held twice; a declared group of
    keys, `merged_ties`) over which `program` places no gradient
    sum, each said with the stages and the `--shared` that places it. The same on every
    rank given the same program and declaration, so every rank can refuse before it makes
    a group or takes a step. A program that places no sum at all keeps the path after it
    (`sum_shared`) unless `required` (RuntimeConfig.sums_in_program)."""
    placed = {_set(op) for ops in program.ranks for op in ops if _is_sum(op)}
    if not placed and not required:
        return []
    placement = program.placement
    tied = [{stage for stage, _ in group} for group in merged_ties(declared)]
    twice = [{slot.stage} for slot in placement.slots]  # each stage's other parameters
    found: dict[tuple[int, ...], tuple[bool, set[int]]] = {}
    for is_tie, stages in [(True, s) for s in tied] + [(False, s) for s in twice]:
        ranks = _holders(placement, ((stage, "") for stage in stages))
        if len(ranks) > 1 and ranks not in placed:
            was_tie, seen = found.get(ranks, (is_tie, set()))
            if was_tie == is_tie:  # a tie's stages name the set, else the stages held twice
                found[ranks] = (is_tie, seen | stages)
    return [
        _unsummed(sorted(stages), ranks, tie=tie) for ranks, (tie, stages) in sorted(found.items())
    ]


def _unsummed(stages: Sequence[int], ranks: Sequence[int], *, tie: bool = True) -> str:
    """One set of holders the program sums no gradient over, and how to place its sum."""
    over = ", ".join(str(r) for r in ranks)
    if not tie:  # stages held twice: `pipecc compile` always places their sums
        held = "+".join(str(s) for s in stages)
        return (
            f"stage(s) {held} are held by ranks {over}, but the program sums no gradients "
            f"over ranks {over}: compile it again with pipecc compile, which places the sum "
            "of every stage held twice"
        )
    names = "+".join(str(s) for s in stages)
    return (
        f"stages {names} hold one parameter on ranks {over}, but the program sums no "
        f"gradients over ranks {over}: compile it with --shared {names} (pipecc run "
        f"--shared {names} places it too)"
    )


def warm(group: dist.ProcessGroup | None, device: torch.device) -> None:
    """One tiny all_reduce over a group just made, on the runtime's device: NCCL creates a
    group's communicator at its first collective, and that blocks every member; done at
    set-up, in the order the groups are made (one order on every rank), never in a step."""
    dist.all_reduce(torch.zeros(1, device=device), group=group)


def _is_sum(op: object) -> TypeGuard[Collective]:
    """A collective over ranks of the pipeline (a gradient sum); those over mesh dimensions
    are runtime/comm/mesh.py's."""
    return isinstance(op, Collective) and not op.dims


def _set(op: Collective) -> tuple[int, ...]:
    """A collective's ranks as a set in rank order (the key of its process group)."""
    return tuple(sorted(set(op.ranks)))
