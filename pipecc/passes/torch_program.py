"""A compute-only Program lowered as torch 2.13's runtime lowers it (`--lowering torch`,
`--lowering torch-defer`), so that `verify` proves what torch will actually run.

    program = lower_as_torch(compute_only, defer=True)     # _load_csv + defer_pp_recv=True
    program = lower_in_style(compute_only, LoweringStyle.TORCH)

The comm ops follow torch's rules (`torch_lowering`), with torch's runtime semantics for
each of them (`torch_actions.RowBuilder`): every SEND and RECV is its own op, a compute
waits for the receives it consumes, sends are waited at the end of the step. Where torch
would refuse the schedule, `MalformedSchedule` says which rank, which action, and why each
stuck rank cannot go on, in torch's notation.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import replace

from pipecc.diagnostics import InputError, Note
from pipecc.ir.ops import Instr, Recv, Send, StageOp, Wait
from pipecc.ir.program import Program
from pipecc.passes.torch_actions import (
    Action,
    ActionKind,
    RowBuilder,
    compute_actions,
    stage_ranks,
)
from pipecc.passes.torch_lowering import MalformedSchedule, lower


class LoweringStyle(enum.Enum):
    """Whose rules place the comm ops of a compute-only input (`--lowering`)."""

    PIPECC = "pipecc"  # pipecc's default comm policy
    TORCH = "torch"  # torch's _add_send_recv
    TORCH_DEFER = "torch-defer"  # _add_send_recv, then _defer_recv_ops (defer_pp_recv=True)


def lower_as_torch(program: Program, *, defer: bool) -> Program:
    """`program` (compute only, one pipe) with the sends and receives torch's lowering
    places. Raises InputError for two pipes, MalformedSchedule where torch raises."""
    if program.placement.num_pipes != 1:
        raise InputError(
            f"torch.distributed.pipelining cannot run placement '{program.placement.name}' "
            f"({program.placement.num_pipes} pipes): there is no torch lowering to verify"
        )
    held = [i for instrs in program.ranks for i in instrs if type(i) is StageOp]
    if held:
        style = LoweringStyle.TORCH_DEFER if defer else LoweringStyle.TORCH
        raise InputError(
            f"--lowering {style.value} lowers a compute-only schedule, and torch's "
            "compute_only loader refuses UNSHARD/RESHARD/REDUCE_GRAD (it adds its own): this "
            "input holds some",
            held[0].span,
        )
    compute = compute_actions(program)
    stage_rank = stage_ranks(program)
    try:
        lowered = lower(compute, program.num_microbatches, stage_rank, defer=defer)
    except MalformedSchedule as err:
        raise _explained(err, compute, stage_rank, defer) from None
    builder = RowBuilder(program.placement)
    ranks = tuple(builder.build(row) for row in lowered)
    return replace(
        program,
        ranks=ranks,
        comm=(LoweringStyle.TORCH_DEFER if defer else LoweringStyle.TORCH).value,
    )


def _explained(
    err: MalformedSchedule,
    compute: Sequence[Sequence[Action]],
    stage_rank: Mapping[int, int],
    defer: bool,
) -> MalformedSchedule:
    """The error with the first stuck rank, its action's index and span, and a note per
    stuck rank saying what it waits for."""
    rank = min(err.stuck, default=None)
    if rank is None:
        return err
    action = err.stuck[rank]
    index = next((i for i, a in enumerate(compute[rank]) if a is action), None)
    if action.kind.is_comm:  # a receive _defer_recv_ops found no consumer for
        message = (
            f"torch's lowering fails (defer_pp_recv=True: _defer_recv_ops raises 'Malformed "
            f"input schedule'): {err.message}"
        )
        return MalformedSchedule(message, err.stuck, rank=rank)
    where = "" if index is None else f" (action {index} of rank {rank})"
    message = (
        f"torch's lowering fails: _add_send_recv raises 'Malformed compute schedule, can't "
        f"schedule sends/recvs': no rank can place its next action; rank {rank} is stuck at "
        f"`{action}`{where}"
    )
    notes = tuple(_why(r, a, err.stuck, compute, stage_rank) for r, a in sorted(err.stuck.items()))
    return MalformedSchedule(
        message, err.stuck, span=action.span, notes=notes, rank=rank, index=index
    )


def _why(
    rank: int,
    action: Action,
    stuck: Mapping[int, Action],
    compute: Sequence[Sequence[Action]],
    stage_rank: Mapping[int, int],
) -> Note:
    """Why `rank` cannot place `action`: the input each of its sub-actions needs."""
    last = len(stage_rank) - 1
    needs = []
    for leaf in action.leaves():
        if leaf.kind is ActionKind.F and leaf.stage != 0:
            source = stage_rank[leaf.stage - 1]
            producer = f"`{leaf.stage - 1}F{leaf.mb}`"
            recv = Action(leaf.stage, ActionKind.RECV_F, leaf.mb)
        elif leaf.kind in (ActionKind.B, ActionKind.I) and leaf.stage != last:
            source = stage_rank[leaf.stage + 1]
            producer = f"`{leaf.stage + 1}B{leaf.mb}` or `{leaf.stage + 1}I{leaf.mb}`"
            recv = Action(leaf.stage, ActionKind.RECV_B, leaf.mb)
        else:
            continue
        if source == rank:
            needs.append(f"`{leaf}` needs {producer} to run first on this rank")
            continue
        state = (
            f"rank {source} is stuck at `{stuck[source]}`"
            if source in stuck
            else f"rank {source} has placed all its actions"
        )
        needs.append(
            f"`{leaf}` needs `{recv}`, which rank {source} posts when it places {producer}: {state}"
        )
    return action.span, f"rank {rank} at `{action}`: " + "; ".join(needs or ["(no input)"])


def lower_in_style(program: Program, style: LoweringStyle) -> Program:
    """A compute-only program (hand-placed comm ops of a .sched file are dropped, as another
    comm policy drops them) lowered with torch's rules, `style` TORCH or TORCH_DEFER."""
    assert style is not LoweringStyle.PIPECC
    return lower_as_torch(compute_only(program), defer=style is LoweringStyle.TORCH_DEFER)


def compute_only(program: Program) -> Program:
    """`program` without its sends, receives and waits."""
    ranks = tuple(tuple(i for i in instrs if not _is_comm(i)) for instrs in program.ranks)
    return replace(program, ranks=ranks, comm="none")


def _is_comm(instr: Instr) -> bool:
    return type(instr) is Send or type(instr) is Recv or type(instr) is Wait
