"""Binding a program to this rank: its chunks, their modules and boundary shapes; and the
checks of the first step.

Every check that can fail differently on different ranks (a module missing on one rank, a
stage whose output does not match the next stage's input) runs on the first step, and the
findings of all ranks are gathered with one collective before any point-to-point op
(runtime/comm/agreement.py), so every rank raises the same `SetupError` instead of some ranks
hanging on a peer that gave up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pipecc.diagnostics import InputError
from pipecc.ir.ops import Msg, Recv
from pipecc.ir.placement import StageSlot
from pipecc.ir.program import Backend, Program

from ..boundaries.specs import Boundaries, Specs, stage_output
from ..boundaries.trees import split_tree


@dataclass(frozen=True)
class Chunk:
    """One stage held by this rank: its module and where its tensors come from and go."""

    slot: StageSlot
    module: torch.nn.Module
    params: frozenset[int]  # id() of each parameter, for split backward
    first: bool  # stage 0 of its pipe: takes the step's inputs
    last: bool  # last stage of its pipe: computes the loss


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


def problems(
    program: Program,
    rank: int,
    modules: Mapping[int, torch.nn.Module],
    boundaries: Boundaries,
    *,
    check_shapes: bool,
    autocast: torch.dtype | None = None,
) -> list[str]:
    """What is wrong on this rank: missing modules, boundaries, shape or dtype mismatches."""
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
    for what, pipe, stage in _messages(program, rank):
        if message_specs(what, stage, boundaries) is None:
            need = stage if what is Msg.ACT else stage + 1
            found.append(
                f"no boundary shapes for the input of stage {need} "
                f"({what.value} pipe {pipe} stage {stage})"
            )
    if check_shapes and not found:
        found.extend(_shape_problems(program, rank, modules, boundaries, autocast))
    return found


def _messages(program: Program, rank: int) -> set[tuple[Msg, int, int]]:
    return {(i.what, i.pipe, i.stage) for i in program.ranks[rank] if type(i) is Recv}


def _shape_problems(
    program: Program,
    rank: int,
    modules: Mapping[int, torch.nn.Module],
    boundaries: Boundaries,
    autocast: torch.dtype | None,
) -> list[str]:
    """Run each chunk (on the meta device, or for real under autocast) and compare with the
    next stage's input."""
    found = []
    placement = program.placement
    for slot in placement.chunks(rank):
        last = slot.stage == placement.num_stages(slot.pipe) - 1
        given, wanted = boundaries.get(slot.stage), boundaries.get(slot.stage + 1)
        if last or given is None or wanted is None:
            continue
        try:
            got = stage_output(modules[slot.chunk], given, autocast=autocast)
        except Exception:  # the stage fails on synthetic data: the check at send time remains
            continue
        if not got.same_as(wanted, grads=False):
            found.append(
                f"chunk {slot.chunk} (stage {slot.stage} of pipe {slot.pipe}) returns "
                f"{got.describe()} for input {given.describe()}, but stage "
                f"{slot.stage + 1} takes {wanted.describe()}"
            )
    return found


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
