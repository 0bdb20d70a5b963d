"""Waits and buffers: every posted op is completed by exactly one wait, waits name real ops,
and no message buffer is posted again while its previous post is outstanding.

On gloo every op returns its own work object, and one left unwaited hangs the step
(pytorch/pytorch#132644); under NCCL an unwaited op's buffer may be freed or reused while
the transfer still runs.
"""

from __future__ import annotations

from typing import cast

from pipecc.diagnostics import (
    BufferReuseError,
    DoubleWaitError,
    UnwaitedError,
    WaitTargetError,
)
from pipecc.ir.ops import Wait
from pipecc.semantics.wiring import COLL, RECV, SEND
from pipecc.verify.context import Context


def check_waits(ctx: Context) -> None:
    """Report bad wait targets, ops waited twice, ops never waited, and reused buffers."""
    if _all_waited_once(ctx) and _messages_unique(ctx):
        return  # the common case, decided with whole-list operations
    w = ctx.wiring
    for rank, instrs in enumerate(ctx.program.ranks):
        base = w.offsets[rank]
        waited_by = [-1] * len(instrs)  # index of the first wait listing each op
        for g in w.waits[rank]:
            _check_one_wait(ctx, rank, g - base, cast(Wait, instrs[g - base]), waited_by)
        _check_unwaited(ctx, rank, waited_by)
        _check_reuse(ctx, rank, waited_by)


def _all_waited_once(ctx: Context) -> bool:
    """True when every wait lists only Send/Recv ops of its rank and every such op is
    listed exactly once."""
    w = ctx.wiring
    listed = 0
    targets: list[int] = []
    for rank, waits in enumerate(w.waits):
        instrs = ctx.program.ranks[rank]
        base = w.offsets[rank]
        listed += sum(len(cast(Wait, instrs[g - base]).ops) for g in waits)
        for g in waits:
            targets.extend(w.deps[g])
    return listed == len(targets) == len(set(targets)) == w.num_comm - len(w.blocking)


def _messages_unique(ctx: Context) -> bool:
    """True when no rank posts one message twice in one direction (so no buffer reuse)."""
    w = ctx.wiring
    message = w.message
    for rank in range(w.num_ranks):
        sends = [message[g] for row in w.sends[rank] for g in row]
        recvs = [message[g] for row in w.recvs[rank] for g in row]
        if len(set(sends)) != len(sends) or len(set(recvs)) != len(recvs):
            return False
    return w.num_paired == w.num_comm  # ops with a bad peer are in no list: check slowly


def _check_one_wait(ctx: Context, rank: int, index: int, wait: Wait, waited_by: list[int]) -> None:
    w = ctx.wiring
    base = w.offsets[rank]
    for target in wait.ops:
        if not 0 <= target < len(waited_by):
            text = (
                f"rank {rank} @{index} {ctx.what(wait)} lists @{target}, but rank {rank} "
                f"has instructions @0..@{len(waited_by) - 1}"
            )
            ctx.report(WaitTargetError(text, ctx.span(rank, index), rank=rank, index=index))
        elif not _waitable(ctx, base + target):
            blocking = w.code[base + target] == COLL
            why = (
                "a blocking collective: it completes where it stands"
                if blocking
                else "not a send or receive"
            )
            text = (
                f"rank {rank} @{index} {ctx.what(wait)} lists @{target}, "
                f"{ctx.what(ctx.instr(rank, target))}, which is {why}"
            )
            ctx.report(WaitTargetError(text, ctx.span(rank, index), rank=rank, index=index))
        elif waited_by[target] >= 0:
            first = waited_by[target]
            text = (
                f"rank {rank} @{index} waits for {ctx.describe(rank, target)}, already "
                f"waited at @{first}"
            )
            notes = (ctx.note(rank, first, "the first wait is here"),)
            ctx.report(
                DoubleWaitError(text, ctx.span(rank, index), notes=notes, rank=rank, index=index)
            )
        else:
            waited_by[target] = index


def _check_unwaited(ctx: Context, rank: int, waited_by: list[int]) -> None:
    w = ctx.wiring
    base = w.offsets[rank]
    for index, by in enumerate(waited_by):
        if by < 0 and _waitable(ctx, base + index):
            text = (
                f"{ctx.describe(rank, index)} is posted but never waited: on gloo its "
                "work object is never completed (the step hangs), and its buffer may be "
                "reused while the transfer runs"
            )
            ctx.report(UnwaitedError(text, ctx.span(rank, index), rank=rank, index=index))


def _waitable(ctx: Context, g: int) -> bool:
    """A send, a receive or an async collective: what a wait completes."""
    code = ctx.wiring.code[g]
    return code == SEND or code == RECV or (code == COLL and g not in ctx.wiring.blocking)


def _check_reuse(ctx: Context, rank: int, waited_by: list[int]) -> None:
    """A second post of one message (same direction) before the first one's wait."""
    w = ctx.wiring
    base = w.offsets[rank]
    code, message = w.code, w.message
    outstanding: dict[tuple[int, int], int] = {}  # (code, message) -> index of the post
    for index in range(len(waited_by)):
        c = code[base + index]
        if c != SEND and c != RECV:
            continue
        key = (c, message[base + index])
        earlier = outstanding.get(key)
        if earlier is not None and not 0 <= waited_by[earlier] < index:
            whose = "wait comes later" if waited_by[earlier] >= 0 else "post is never waited"
            text = (
                f"{ctx.describe(rank, index)} reuses the buffer of @{earlier} (the same "
                f"message), whose {whose}: the two transfers write (or read) one tensor "
                "at the same time"
            )
            notes = (ctx.note(rank, earlier, "the first post is here"),)
            ctx.report(
                BufferReuseError(text, ctx.span(rank, index), notes=notes, rank=rank, index=index)
            )
        outstanding[key] = index
