"""Placement and routing: every op runs where its stage lives, every message goes between the
ranks that hold the two stages it connects (DESIGN §2).

A V-shaped schedule run with a loop placement (pytorch/torchtitan#774) shows up here: its
ops name chunk 1 as stage 2P-1-r while the placement says P+r. When every op fits one of the
named placements better, the report says which.
"""

from __future__ import annotations

from typing import cast

from pipecc.diagnostics import MisplacedOpError, RouteError
from pipecc.ir.ops import Compute, Instr, Msg, Recv, Send, computations, works_on
from pipecc.ir.placement import (
    Placement,
    bidirectional_placement,
    loop_placement,
    vshape_placement,
)
from pipecc.semantics.wiring import RECV, SEND
from pipecc.verify.context import Context


def check_placement(ctx: Context) -> int:
    """Report computations on a (rank, chunk) that does not hold their (pipe, stage); return
    how many there are."""
    table = _table(ctx.program.placement)
    w = ctx.wiring
    wrong: list[tuple[int, int, Compute]] = []
    for rank, instrs in enumerate(ctx.program.ranks):
        base = w.offsets[rank]
        slots = table[rank]
        used = {op[1:4] for g in w.computes[rank] for op in _parts(instrs[g - base])}
        if all(
            0 <= chunk < len(slots) and slots[chunk] == (pipe, stage) for chunk, pipe, stage in used
        ):
            continue
        for g in w.computes[rank]:
            for op in _parts(instrs[g - base]):
                _, chunk, pipe, stage, _, _ = op
                if not (0 <= chunk < len(slots) and slots[chunk] == (pipe, stage)):
                    wrong.append((rank, g - base, op))
    code = MisplacedOpError.code
    hint = _hint_placement(ctx, len(wrong)) if wrong else None
    for n, (rank, index, op) in enumerate(wrong):
        if ctx.kept[code] >= ctx.limit:  # the rest are only counted: no message to build
            ctx.dropped[code] += len(wrong) - n
            break
        _report_misplaced(ctx, (rank, index, op), hint if n == 0 else None)
    return len(wrong)


def _parts(instr: Instr) -> tuple[Compute, ...]:
    return works_on(instr)  # every MoE phase sits on its op's rank


def _table(placement: Placement) -> list[list[tuple[int, int]]]:
    return [
        [(slot.pipe, slot.stage) for slot in placement.chunks(rank)]
        for rank in range(placement.num_ranks)
    ]


def _report_misplaced(ctx: Context, where: tuple[int, int, Compute], hint: str | None) -> None:
    rank, index, op = where
    placement = ctx.program.placement
    if placement.has_chunk(rank, op.chunk):
        slot = placement.slot(rank, op.chunk)
        held = f"rank {rank} chunk {op.chunk} holds stage {slot.stage}"
        if placement.num_pipes > 1:
            held += f" of pipe {slot.pipe}"
    else:
        held = f"rank {rank} has no chunk {op.chunk}"
    text = (
        f"{op.label()} on rank {rank} (@{index}) computes stage {op.stage}"
        f"{f' of pipe {op.pipe}' if placement.num_pipes > 1 else ''}, but in placement "
        f"'{placement.name}' {held}"
    )
    notes = ((None, hint),) if hint else ()
    ctx.report(MisplacedOpError(text, ctx.span(rank, index), notes=notes, rank=rank, index=index))


def _hint_placement(ctx: Context, wrong: int) -> str | None:
    """A note naming a standard placement that every op fits, when there is one."""
    program = ctx.program
    fits = [p for p in _candidates(program.num_ranks) if _fits(ctx, p)]
    if not fits:
        return None
    hint = fits[0]
    return (
        f"{wrong} op(s) do not fit placement '{program.placement.name}', but every op "
        f"fits placement '{hint.name}': the schedule was written for '{hint.name}' and "
        "is run with another stage-to-rank map (as in pytorch/torchtitan#774, a V "
        "schedule on a loop placement)"
    )


def _candidates(num_ranks: int) -> list[Placement]:
    found = [loop_placement(num_ranks, v) for v in range(1, 5)]
    found.append(vshape_placement(num_ranks))
    if num_ranks % 2 == 0:
        found.append(bidirectional_placement(num_ranks))
    return found


def _fits(ctx: Context, placement: Placement) -> bool:
    table = _table(placement)
    for rank, instrs in enumerate(ctx.program.ranks):
        for instr in instrs:
            for op in computations(instr):
                chunk = op.chunk
                if not (
                    0 <= chunk < len(table[rank]) and table[rank][chunk] == (op.pipe, op.stage)
                ):
                    return False
    return True


def check_routes(ctx: Context) -> None:
    """Report sends and recvs whose peer is not the holder of the neighbouring stage."""
    w = ctx.wiring
    route = _route_table(ctx)
    period = len(route)
    num_ranks = w.num_ranks
    suspects: list[int] = []
    message = w.message
    for lists, sending in ((w.sends, True), (w.recvs, False)):
        for rank, row in enumerate(lists):
            for peer, ops in enumerate(row):
                if ops:
                    want = rank * num_ranks + peer if sending else peer * num_ranks + rank
                    suspects += [
                        g for g in ops if message[g] < 0 or route[message[g] % period] != want
                    ]
    if w.num_paired != w.num_comm:  # ops whose peer is not another rank are in no pair list
        suspects += [g for g, c in enumerate(w.code) if (c == SEND or c == RECV) and w.peer[g] < 0]
    placement = ctx.program.placement
    for g in sorted(suspects):
        rank, index = w.locate(g)
        problem = _route_problem(placement, rank, cast("Send | Recv", ctx.instr(rank, index)))
        if problem:
            text = f"{ctx.describe(rank, index)}: {problem}"
            ctx.report(RouteError(text, ctx.span(rank, index), rank=rank, index=index))


def _route_table(ctx: Context) -> list[int]:
    """For each message key modulo the table length: src * P + dst of the ranks that hold
    the sending and receiving stages, or -1 when no such message exists."""
    keys, placement = ctx.keys, ctx.program.placement
    table = [-1] * (keys.pipes * keys.stride * 2)
    for pipe in range(keys.pipes):
        ranks = keys.ranks_of[pipe]
        for stage in range(keys.stages[pipe]):
            if stage > 0:
                act = keys.key(Msg.ACT, pipe, stage, 0)
                table[act] = ranks[stage - 1] * placement.num_ranks + ranks[stage]
            if stage + 1 < len(ranks):
                grad = keys.key(Msg.GRAD, pipe, stage, 0)
                table[grad] = ranks[stage + 1] * placement.num_ranks + ranks[stage]
    return table


def _route_problem(placement: Placement, rank: int, op: Send | Recv) -> str:
    """Why `op` on `rank` is misrouted, or "" when it is right."""
    _, peer, pipe, stage, _, _, _ = op
    if not (0 <= pipe < placement.num_pipes and 0 <= stage < placement.num_stages(pipe)):
        return f"the placement has no stage {stage} in pipe {pipe}"
    other = stage - 1 if op.what is Msg.ACT else stage + 1
    if not 0 <= other < placement.num_stages(pipe):
        return f"no stage sends {op.what.value} to stage {stage} (it is at the end of its pipe)"
    src, dst = placement.holder(pipe, other).rank, placement.holder(pipe, stage).rank
    mine, theirs = (src, dst) if type(op) is Send else (dst, src)
    if not 0 <= peer < placement.num_ranks:
        return f"peer {peer} is not a rank (0..{placement.num_ranks - 1})"
    if src == dst:
        return (
            f"stages {min(stage, other)} and {max(stage, other)} are both on rank {src}: "
            "they pass the tensor locally, with no message"
        )
    if rank != mine or peer != theirs:
        return (
            f"this message goes from rank {src} (stage {other}) to rank {dst} (stage "
            f"{stage}) in placement '{placement.name}'"
        )
    return ""
