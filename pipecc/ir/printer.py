"""Text forms of a program: the per-rank grid of compute ops, and the full listing.

The grid reads like the papers' figures: one row per rank, one column per compute
instruction, `F0.3` = forward of chunk 0 on microbatch 3, `F0.4&B1.1` = a fused pair.
The listing shows every instruction of every rank with its index, comm ops and waits included.
"""

from __future__ import annotations

from pipecc.ir.ops import Compute, Fused, Instr, Recv, Send, Wait
from pipecc.ir.program import Program


def header(program: Program) -> str:
    params = " ".join(f"{k}={v}" for k, v in program.params)
    extra = f"  {params}" if params else ""
    return (
        f"# {program.schedule}  P={program.num_ranks} M={program.num_microbatches}  "
        f"placement {program.placement.name}{extra}"
    )


def format_grid(program: Program) -> str:
    """One row per rank, one column per compute instruction, columns aligned."""
    rows = [
        [instr.label() for instr in instrs if type(instr) is Compute or type(instr) is Fused]
        for instrs in program.ranks
    ]
    width = max((len(row) for row in rows), default=0)
    columns = [max((len(row[j]) for row in rows if j < len(row)), default=0) for j in range(width)]
    name = len(f"rank {program.num_ranks - 1}")
    lines = [header(program)]
    for rank, row in enumerate(rows):
        cells = " ".join(cell.ljust(columns[j]) for j, cell in enumerate(row))
        lines.append(f"{f'rank {rank}'.ljust(name)} | {cells}".rstrip())
    return "\n".join(lines) + "\n"


def describe(instr: Instr) -> str:
    """A one-line description of an instruction, as the listing and diagnostics show it."""
    match instr:
        case Compute() | Fused():
            return instr.label()
        case Send() | Recv():
            verb = "send" if type(instr) is Send else "recv"
            arrow = "to" if type(instr) is Send else "from"
            group = f" [group {instr.group}]" if instr.group is not None else ""
            return (
                f"{verb} {instr.what.value} pipe {instr.pipe} stage {instr.stage} mb {instr.mb} "
                f"{arrow} rank {instr.peer}{group}"
            )
        case Wait(ops=ops):
            return "wait " + " ".join(str(i) for i in ops)
        case _:
            raise AssertionError(f"unknown instruction {instr!r}")


def format_listing(program: Program) -> str:
    """Every instruction of every rank, numbered as in the JSON program."""
    lines = [header(program)]
    for rank, instrs in enumerate(program.ranks):
        lines.append(f"rank {rank}:")
        digits = len(str(max(len(instrs) - 1, 0)))
        lines.extend(
            f"  {index:>{digits}}  {describe(instr)}" for index, instr in enumerate(instrs)
        )
    return "\n".join(lines) + "\n"
