"""torch's per-stage actions, where a program holds them (a torch CSV's, or torch's lowering).

- `unshard-reshard`: on each rank, each stage's UNSHARD and RESHARD alternate, starting with
  UNSHARD and ending with RESHARD, and every computation of the stage lies inside such a
  pair (torch's runtime refuses to compute on a sharded FSDP stage). A stage may be resharded
  and fetched again between its computations: torch evicts stages when a rank holds more than
  its prefetch window. Checked when the program holds any UNSHARD or RESHARD.
- `reduce-grad`: exactly one REDUCE_GRAD per stage, after the stage's last weight-gradient
  op (its M-th B or W) on its rank: torch divides the gradients by M and runs FSDP's
  reduction there, so an earlier one leaves the later microbatches' gradients unscaled and
  unreduced, a missing one leaves every gradient M times too large. Checked when the program
  holds any REDUCE_GRAD.
- both: a stage action sits on the rank and chunk that hold its stage.

Witnesses are in torch's notation (`1UNSHARD`, `1B7`).
"""

from __future__ import annotations

from pipecc.diagnostics import Violation
from pipecc.ir.ops import Compute, Instr, Kind, StageAction, StageOp, computations
from pipecc.ir.printer import torch_name
from pipecc.verify.context import Context


class UnshardReshardError(Violation):
    """A stage computed outside an UNSHARD/RESHARD pair, or a pair out of order."""

    code = "unshard-reshard"


class ReduceGradError(Violation):
    """A stage's REDUCE_GRAD missing, repeated, or before its last backward."""

    code = "reduce-grad"


def _parts(instr: Instr) -> tuple[Compute, ...]:
    if type(instr) is Compute:
        return (instr,)
    return computations(instr)


def check_stage_ops(ctx: Context) -> None:
    """The module docstring's checks, on a program that holds stage actions."""
    found = {i.kind for instrs in ctx.program.ranks for i in instrs if type(i) is StageOp}
    if not found:
        return
    for rank, instrs in enumerate(ctx.program.ranks):
        _check_homes(ctx, rank, instrs)
        if found & {StageAction.UNSHARD, StageAction.RESHARD}:
            _check_pairs(ctx, rank, instrs)
        if StageAction.REDUCE_GRAD in found:
            _check_reduce(ctx, rank, instrs)


def _check_homes(ctx: Context, rank: int, instrs: tuple[Instr, ...]) -> None:
    placement = ctx.program.placement
    for index, instr in enumerate(instrs):
        if type(instr) is not StageOp:
            continue
        known = 0 <= instr.pipe < placement.num_pipes and (
            0 <= instr.stage < placement.num_stages(instr.pipe)
        )
        holder = placement.holder(instr.pipe, instr.stage) if known else None
        if holder is None or (holder.rank, holder.chunk) != (rank, instr.chunk):
            where = "no rank" if holder is None else f"rank {holder.rank} chunk {holder.chunk}"
            text = (
                f"rank {rank} @{index} `{torch_name(instr)}` (chunk {instr.chunk}) acts on stage "
                f"{instr.stage}, which {where} holds"
            )
            cls = ReduceGradError if instr.kind is StageAction.REDUCE_GRAD else UnshardReshardError
            ctx.report(cls(text, ctx.span(rank, index), rank=rank, index=index))


def _check_pairs(ctx: Context, rank: int, instrs: tuple[Instr, ...]) -> None:
    """UNSHARD ... RESHARD per stage, every computation inside."""
    open_at: dict[int, int] = {}  # stage -> index of the UNSHARD that opened its pair
    for index, instr in enumerate(instrs):
        if type(instr) is StageOp and instr.kind is not StageAction.REDUCE_GRAD:
            _pair_step(ctx, rank, index, instr, open_at)
            continue
        for op in _parts(instr):
            if op.stage not in open_at:
                _pair_error(
                    ctx, rank, index,
                    f"`{torch_name(op)}` computes on stage {op.stage} while it is sharded "
                    f"(no `{op.stage}UNSHARD` before it since its last RESHARD)",
                )  # fmt: skip
    for stage, index in sorted(open_at.items(), key=lambda item: item[1]):
        _pair_error(ctx, rank, index, f"`{stage}UNSHARD` has no `{stage}RESHARD` after it")


def _pair_step(ctx: Context, rank: int, index: int, op: StageOp, open_at: dict[int, int]) -> None:
    if op.kind is StageAction.UNSHARD:
        if op.stage in open_at:
            _pair_error(
                ctx, rank, index,
                f"`{torch_name(op)}` while stage {op.stage} is unsharded since its UNSHARD at "
                f"@{open_at[op.stage]} (UNSHARD and RESHARD alternate)",
            )  # fmt: skip
        open_at[op.stage] = index
    elif open_at.pop(op.stage, None) is None:
        _pair_error(
            ctx, rank, index,
            f"`{torch_name(op)}` without an UNSHARD of stage {op.stage} before it "
            "(UNSHARD and RESHARD alternate, starting with UNSHARD)",
        )  # fmt: skip


def _pair_error(ctx: Context, rank: int, index: int, text: str) -> None:
    ctx.report(
        UnshardReshardError(
            f"rank {rank} @{index}: {text}", ctx.span(rank, index), rank=rank, index=index
        )
    )


def _check_reduce(ctx: Context, rank: int, instrs: tuple[Instr, ...]) -> None:
    """One REDUCE_GRAD per stage of this rank, after its last B or W."""
    last: dict[int, tuple[int, Compute]] = {}
    reduces: dict[int, list[int]] = {}
    for index, instr in enumerate(instrs):
        if type(instr) is StageOp and instr.kind is StageAction.REDUCE_GRAD:
            reduces.setdefault(instr.stage, []).append(index)
        for op in _parts(instr):
            if op.kind is Kind.B or op.kind is Kind.W:
                last[op.stage] = (index, op)
    held = [s.stage for s in ctx.program.placement.chunks(rank)]
    for stage in held:
        at = reduces.get(stage, [])
        if len(at) != 1:
            where = at[1] if at else len(instrs) - 1
            what = f"{len(at)} REDUCE_GRADs" if at else "no REDUCE_GRAD"
            text = (
                f"rank {rank}: stage {stage} has {what}, torch needs exactly one (without it "
                f"torch leaves the stage's gradients M times too large)"
            )
            ctx.report(ReduceGradError(text, ctx.span(rank, where), rank=rank, index=where))
        elif stage in last and at[0] < last[stage][0]:
            index, op = last[stage]
            text = (
                f"rank {rank} @{at[0]} `{stage}REDUCE_GRAD` comes before `{torch_name(op)}` "
                f"(@{index}), the stage's last backward: torch scales and reduces the "
                "gradients at REDUCE_GRAD, so the later backwards' gradients are left out"
            )
            note = ctx.note(rank, index, f"`{torch_name(op)}`, the stage's last backward, is here")
            ctx.report(
                ReduceGradError(text, ctx.span(rank, at[0]), notes=(note,), rank=rank, index=at[0])
            )
