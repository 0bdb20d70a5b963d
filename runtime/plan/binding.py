"""Binding a program to this rank: its chunks, their modules and boundary shapes; and the
checks of a new input signature.

Every check that can fail differently on different ranks (a module missing on one rank, a
declared boundary the real run contradicts) runs when a step brings a signature not seen
before (the first step included), and the findings of all ranks are gathered before any
point-to-point op of the program (runtime/boundaries/discovery.py, runtime/comm/agreement.py),
so every rank raises the same `SetupError` instead of some ranks hanging on a peer that gave
up. A step whose signature is known runs none of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule

from pipecc.diagnostics import InputError
from pipecc.ir.ops import Msg, Recv
from pipecc.ir.placement import StageSlot
from pipecc.ir.program import Backend, Program

from ..boundaries.specs import Boundaries, Specs
from ..boundaries.trees import split_tree


@dataclass(frozen=True)
class Chunk:
    """One stage held by this rank: its module and where its tensors come from and go."""

    slot: StageSlot
    module: torch.nn.Module
    params: frozenset[int]  # id() of each parameter, for split backward
    first: bool  # stage 0 of its pipe: takes the step's inputs
    last: bool  # last stage of its pipe: computes the loss
    # an FSDP2 module: its graphs' leaves are the unsharded parameters FSDP swaps in while
    # gathered, not those `params` holds (`weights`)
    sharded: bool = False

    def weights(self) -> frozenset[int] | None:
        """What a split backward of the chunk takes as its weights: `params`, or None for an
        FSDP2 module (every leaf of the graph that is no stage input: the unsharded
        parameters its forward computed with, whether the stage is gathered when I runs or
        not; runtime/engine/split_backward.py)."""
        return None if self.sharded else self.params


def bind_chunks(
    program: Program, rank: int, modules: Mapping[int, torch.nn.Module]
) -> dict[int, Chunk]:
    """The chunks of `rank` that have a module (missing ones are reported by `problems`)."""
    placement = program.placement
    chunks = {}
    for slot in placement.chunks(rank):
        module = modules.get(slot.chunk)
        if module is None:
            continue
        chunks[slot.chunk] = Chunk(
            slot=slot,
            module=module,
            params=frozenset(id(p) for p in module.parameters()),
            first=slot.stage == 0,
            last=placement.is_last_stage(slot.pipe, slot.stage),
            sharded=isinstance(module, FSDPModule),
        )
    return chunks


def recv_specs(
    program: Program, rank: int, boundaries: Boundaries
) -> dict[tuple[Msg, int, int], Specs]:
    """The buffer specs of every message this rank receives, keyed by (what, pipe, stage)."""
    specs: dict[tuple[Msg, int, int], Specs] = {}
    for instr in program.ranks[rank]:
        if type(instr) is Recv:
            key = (instr.what, instr.pipe, instr.stage)
            found = message_specs(instr.what, instr.stage, boundaries)
            if found is not None:
                specs[key] = found
    return specs


def message_specs(what: Msg, stage: int, boundaries: Boundaries) -> Specs | None:
    """An activation for stage s carries the tensors of the input of s; a gradient for
    stage s the gradients of s's output (the input of s+1) that carry one."""
    if what is Msg.ACT:
        found = boundaries.get(stage)
        return None if found is None else found.tensors
    found = boundaries.get(stage + 1)
    return None if found is None else found.grads


def world_problem(program: Program, world: int, rank_map: Sequence[int], me: int) -> str | None:
    """A mismatch every rank sees alike (checked before anything else, no collective)."""
    if program.num_ranks != world:
        return (
            f"the program was compiled for {program.num_ranks} ranks but the pipeline group "
            f"has {world}; recompile it with -P {world}"
        )
    if len(rank_map) != world or len(set(rank_map)) != world:
        return f"the rank map {list(rank_map)} must list {world} distinct global ranks"
    if me not in rank_map:
        return f"this process (global rank {me}) is not in the rank map {list(rank_map)}"
    return None


def backend_problem(program: Program, *, nccl: bool) -> str | None:
    """A program NCCL cannot run, when its tensors go over NCCL (every rank sees it alike):
    one compiled with a gloo-only comm policy that has receives to post early."""
    posts_early = any(type(i) is Recv for instrs in program.ranks for i in instrs)
    if nccl and program.backend is Backend.INDEPENDENT_PROGRESS and posts_early:
        return (
            f"the program was compiled with the {program.comm} comm policy, which is for gloo: "
            "under NCCL its early receives block the sends queued behind them and the step "
            "deadlocks; compile it with the default policy (--comm-policy default)"
        )
    return None


def module_problems(
    program: Program, rank: int, modules: Mapping[int, torch.nn.Module]
) -> list[str]:
    """What is wrong with this rank's modules: a chunk without one, one for a chunk it does
    not hold (checked before the discovery pass, which runs them)."""
    found = []
    placement = program.placement
    for slot in placement.chunks(rank):
        if slot.chunk not in modules:
            found.append(
                f"no stage module for chunk {slot.chunk} (stage {slot.stage} of "
                f"pipe {slot.pipe}); this rank holds {placement.num_chunks(rank)} chunks"
            )
    extra = sorted(set(modules) - {s.chunk for s in placement.chunks(rank)})
    if extra:
        found.append(f"stage modules given for chunks {extra} that this rank does not hold")
    return found


def boundary_problems(program: Program, rank: int, boundaries: Boundaries) -> list[str]:
    """The messages this rank receives that no boundary describes (a stage before the last
    whose output only `loss_fn` could read)."""
    found = []
    for what, pipe, stage in sorted(_messages(program, rank), key=_message_order):
        if message_specs(what, stage, boundaries) is None:
            need = stage if what is Msg.ACT else stage + 1
            found.append(
                f"no boundary shapes for the input of stage {need} "
                f"({what.value} pipe {pipe} stage {stage})"
            )
    return found


def declared_problems(
    program: Program, rank: int, declared: Boundaries, found: Boundaries
) -> list[str]:
    """Where boundaries the user declared differ from those the real run found: each
    reported by the rank holding, in pipe 0, the stage that produced it (stage 0's input,
    the step's inputs, by the holder of stage 0). The model's output, which no stage
    receives, is not compared."""
    problems = []
    placement = program.placement
    for slot in placement.chunks(rank):
        if slot.pipe != 0:
            continue
        given, wanted = found.get(slot.stage), declared.get(slot.stage)
        if slot.stage == 0 and given is not None and wanted is not None:
            if not wanted.same_as(given, grads=False):
                problems.append(
                    f"the step's inputs are {given.describe()} per microbatch, but the "
                    f"boundaries were given for {wanted.describe()}"
                )
        got, wanted = found.get(slot.stage + 1), declared.get(slot.stage + 1)
        last = placement.is_last_stage(slot.pipe, slot.stage)
        if last or given is None or got is None or wanted is None:
            continue
        if not got.same_as(wanted, grads=False):
            problems.append(
                f"chunk {slot.chunk} (stage {slot.stage} of pipe {slot.pipe}) returns "
                f"{got.describe()} for input {given.describe()}, but stage "
                f"{slot.stage + 1} takes {wanted.describe()}"
            )
    return problems


def _messages(program: Program, rank: int) -> set[tuple[Msg, int, int]]:
    return {(i.what, i.pipe, i.stage) for i in program.ranks[rank] if type(i) is Recv}


def _message_order(key: tuple[Msg, int, int]) -> tuple[str, int, int]:
    return (key[0].value, key[1], key[2])


def check_rows(value: object, what: str, microbatches: int, where: str) -> None:
    """A batch whose rows do not split into M equal microbatches stops this rank at once with
    an InputError saying what to do: every rank given the batch finds it alike, before any
    exchange (a data loader's last, short batch is the usual cause). Other problems of the
    batch are the split's (`split_batch`)."""
    rows = set(_rows(value))
    if len(rows) != 1:
        return
    (count,) = rows
    if count and count % microbatches == 0:
        return
    raise InputError(
        f"{where}: the step's {what} have {count} rows, which do not split into M="
        f"{microbatches} microbatches of equal size: give every step a multiple of "
        f"{microbatches} rows (a DataLoader: drop_last=True and a batch size that is a "
        f"multiple of {microbatches})"
    )


def _rows(value: object) -> list[int]:
    """The rows (dim 0) of every tensor in nested tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return [value.shape[0] if value.dim() else 0]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [rows for item in value for rows in _rows(item)]
    return []


def split_batch(
    value: object,
    what: str,
    program: Program,
    device: torch.device,
    found: list[str],
    *,
    required: bool,
) -> list[object] | None:
    """The microbatches of `value` (`what`: "inputs" or "targets") for a rank that uses
    them; a problem is appended to `found` (the first step gathers them from every rank)."""
    if value is None:
        if required:
            kind = "first" if what == "inputs" else "last"
            found.append(f"this rank holds a {kind} stage and needs {what}, got None")
        return None
    try:
        return split_tree(value, program.num_microbatches, what, device)
    except InputError as err:
        found.append(err.message)
        return None
