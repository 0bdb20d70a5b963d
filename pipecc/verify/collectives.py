"""Collectives: each names a set of ranks holding its own, and the members of a set issue
their collectives over it in the same order, with the same kind and `what` (DESIGN §5).

The k-th collective over a set of ranks on one member meets the k-th over that set on every
other member, as the k-th call on one communicator does in NCCL and gloo. Two that meet
with different kinds or contents exchange the wrong data (or hang inside the library): a
mismatch. One that some member never issues never completes: an orphan.
"""

from __future__ import annotations

from pipecc.diagnostics import MismatchError, OrphanError, RouteError
from pipecc.ir.ops import Collective
from pipecc.verify.context import Context
from pipecc.verify.matching import ordinal


def check_collectives(ctx: Context) -> None:
    """Report collectives over a malformed set of ranks, mismatched and orphaned ones."""
    w = ctx.wiring
    for g in w.bad_collectives:
        _report_bad(ctx, *w.locate(g))
    for ranks, lists in w.collectives:
        _check_set(ctx, ranks, lists)


def _report_bad(ctx: Context, rank: int, index: int) -> None:
    op = ctx.instr(rank, index)
    assert type(op) is Collective
    last = ctx.program.num_ranks - 1
    if rank not in op.ranks:
        why = f"does not include rank {rank} itself"
    elif len(set(op.ranks)) != len(op.ranks):
        why = "names a rank twice"
    else:
        why = f"names a rank outside 0..{last}"
    text = f"{ctx.describe(rank, index)} {why}: it takes part in no collective and never completes"
    ctx.report(RouteError(text, ctx.span(rank, index), rank=rank, index=index))


def _check_set(ctx: Context, ranks: tuple[int, ...], lists: tuple[tuple[int, ...], ...]) -> None:
    w = ctx.wiring
    over = ", ".join(str(r) for r in ranks)
    common = min(len(ids) for ids in lists)
    for k in range(common):
        first = ctx.wiring.instr(lists[0][k])
        for ids in lists[1:]:
            other = w.instr(ids[k])
            assert type(first) is Collective and type(other) is Collective
            if (other.kind, other.what) != (first.kind, first.what):
                _report_mismatch(ctx, over, k, (lists[0][k], ids[k]))
                return
    if any(len(ids) != common for ids in lists):
        _report_orphan(ctx, ranks, lists, common)


def _report_mismatch(ctx: Context, over: str, k: int, pair: tuple[int, int]) -> None:
    (rank, index), (other, at) = (ctx.wiring.locate(g) for g in pair)
    text = (
        f"collectives over ranks {over}: the {ordinal(k)} is {ctx.what(ctx.instr(rank, index))} "
        f"on rank {rank} (@{index}) but {ctx.what(ctx.instr(other, at))} on rank {other} "
        f"(@{at}); the k-th collective of one set of ranks meets the k-th of every member, so "
        "they exchange the wrong data or hang inside the library"
    )
    notes = (ctx.note(other, at, f"rank {other} issues its {ordinal(k)} one here"),)
    ctx.report(MismatchError(text, ctx.span(rank, index), notes=notes, rank=rank, index=index))


def _report_orphan(
    ctx: Context, ranks: tuple[int, ...], lists: tuple[tuple[int, ...], ...], common: int
) -> None:
    counts = ", ".join(f"rank {r} {len(ids)}" for r, ids in zip(ranks, lists, strict=True))
    rank, ids = next((r, ids) for r, ids in zip(ranks, lists, strict=True) if len(ids) > common)
    index = ctx.wiring.locate(ids[common])[1]
    over = ", ".join(str(r) for r in ranks)
    text = (
        f"collectives over ranks {over}: the members issue different numbers ({counts}): "
        f"the {ordinal(common)} on rank {rank}, {ctx.what(ctx.instr(rank, index))} "
        f"(@{index}), has no partner on every member and never completes"
    )
    ctx.report(OrphanError(text, ctx.span(rank, index), rank=rank, index=index))
