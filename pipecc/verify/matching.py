"""Orphans and mismatches: what FIFO matching per rank pair pairs up (DESIGN §5).

The k-th send of src to dst meets the k-th recv of dst from src, whatever they name: NCCL
and gloo match untagged ops by order. A pair whose names differ delivers the wrong tensor
without hanging; an op with no k-th partner never completes.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipecc.diagnostics import MismatchError, OrphanError
from pipecc.ir.ops import Kind, Msg, Recv, Send, computations
from pipecc.ir.printer import has_pipes, message, torch_name
from pipecc.verify.context import Context


def check_matching(ctx: Context) -> None:
    """Report orphans and mismatches for every ordered rank pair."""
    w = ctx.wiring
    for src in range(w.num_ranks):
        for dst in range(w.num_ranks):
            sends, recvs = w.sends[src][dst], w.recvs[dst][src]
            if not sends and not recvs:
                continue
            _check_pair(ctx, src, dst, sends, recvs)


def _check_pair(
    ctx: Context, src: int, dst: int, sends: Iterable[int], recvs: Iterable[int]
) -> None:
    w = ctx.wiring
    message = w.message
    sends_, recvs_ = list(sends), list(recvs)
    bad = [
        k for k, (s, r) in enumerate(zip(sends_, recvs_, strict=False)) if message[s] != message[r]
    ]
    if bad:
        _report_mismatch(ctx, src, dst, sends_, recvs_, bad)
    if len(sends_) != len(recvs_):
        _report_orphans(ctx, src, dst, sends_, recvs_)


def ordinal(k: int) -> str:
    """`1st` for k = 0: the (k+1)-th, in words."""
    n = k + 1
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _report_mismatch(
    ctx: Context, src: int, dst: int, sends: list[int], recvs: list[int], bad: list[int]
) -> None:
    w = ctx.wiring
    k = bad[0]
    message = w.message
    swapped = (
        k + 1 < min(len(sends), len(recvs))
        and message[sends[k]] == message[recvs[k + 1]]
        and message[sends[k + 1]] == message[recvs[k]]
    )
    send_at = [w.locate(s)[1] for s in sends]
    recv_at = [w.locate(r)[1] for r in recvs]
    if swapped:
        text = _swap_text(ctx, src, dst, k, send_at, recv_at)
    else:
        text = (
            f"rank {src} → rank {dst}: the {ordinal(k)} message is sent as "
            f"{_sent(ctx, src, send_at[k])} but received as "
            f"{_received(ctx, dst, recv_at[k])}"
        )
    text += (
        "; NCCL and gloo match untagged sends and receives in posting order, so rank "
        f"{dst} gets the wrong tensor (no error, no hang)"
    )
    rest = len(bad) - (2 if swapped else 1)
    if rest > 0:
        text += f"; {rest} more message(s) of this pair are mismatched after it"
    notes = [
        ctx.note(
            dst,
            recv_at[k],
            f"rank {dst} posts its {ordinal(k)} receive from "
            f"rank {src} here: {ctx.what(ctx.instr(dst, recv_at[k]))}",
        )
    ]
    ctx.report(
        MismatchError(
            text, ctx.span(src, send_at[k]), notes=tuple(notes), rank=src, index=send_at[k]
        )
    )


def _swap_text(
    ctx: Context, src: int, dst: int, k: int, send_at: list[int], recv_at: list[int]
) -> str:
    return (
        f"rank {src} → rank {dst}: messages {k + 1} and {k + 2} are swapped: rank {src} "
        f"sends {_sent(ctx, src, send_at[k])} then {_sent(ctx, src, send_at[k + 1])}, "
        f"rank {dst} receives {_received(ctx, dst, recv_at[k])} then "
        f"{_received(ctx, dst, recv_at[k + 1])}"
    )


def _sent(ctx: Context, rank: int, index: int) -> str:
    """`act stage 1 mb 2 (@5, output of 0F2)`."""
    send = ctx.instr(rank, index)
    assert type(send) is Send
    pipes = has_pipes(ctx.program)
    producer = _producer(ctx, rank, send)
    made = f", output of {producer}" if producer else ""
    return f"{message(send, pipes=pipes)} (@{index}{_torch_comm(ctx, send)}{made})"


def _received(ctx: Context, rank: int, index: int) -> str:
    recv = ctx.instr(rank, index)
    assert type(recv) is Recv
    pipes = has_pipes(ctx.program)
    return f"{message(recv, pipes=pipes)} (@{index}{_torch_comm(ctx, recv)})"


def _torch_comm(ctx: Context, op: Send | Recv) -> str:
    """` 0SEND_F2`: torch's name of a comm op (one-pipe programs only), which names the
    sending stage on a send and the receiving stage on a recv."""
    if has_pipes(ctx.program):
        return ""
    letter = "F" if op.what is Msg.ACT else "B"
    if type(op) is Recv:
        return f" {op.stage}RECV_{letter}{op.mb}"
    sender = op.stage - 1 if op.what is Msg.ACT else op.stage + 1
    return f" {sender}SEND_{letter}{op.mb}"


def _producer(ctx: Context, rank: int, send: Send) -> str:
    """torch's name of the computation on `rank` that makes the tensor `send` carries."""
    kinds: tuple[Kind, ...]
    if send.what is Msg.ACT:
        kinds, stage = (Kind.F,), send.stage - 1
    else:
        kinds, stage = (Kind.B, Kind.I), send.stage + 1
    for instr in ctx.program.ranks[rank]:
        for op in computations(instr):
            if op.kind in kinds and op.pipe == send.pipe and op.stage == stage and op.mb == send.mb:
                return torch_name(op)
    return ""


def _report_orphans(ctx: Context, src: int, dst: int, sends: list[int], recvs: list[int]) -> None:
    w = ctx.wiring
    extra, rank, verb = (sends, src, "send") if len(sends) > len(recvs) else (recvs, dst, "recv")
    k = min(len(sends), len(recvs))
    index = w.locate(extra[k])[1]
    more = len(extra) - k - 1
    text = (
        f"rank {src} posts {len(sends)} send(s) to rank {dst} and rank {dst} posts "
        f"{len(recvs)} receive(s) from rank {src}: the {ordinal(k)} {verb}, "
        f"{ctx.what(ctx.instr(rank, index))} (@{index}), has no partner and never completes"
    )
    if more:
        text += f" ({more} more after it)"
    ctx.report(OrphanError(text, ctx.span(rank, index), rank=rank, index=index))
