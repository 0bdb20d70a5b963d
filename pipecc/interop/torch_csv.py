"""torch.distributed.pipelining's action CSV: one row per rank, one action per cell.

Actions are written as torch prints them: `0F1` (stage 0, forward, microbatch 1), `0I1`,
`0W1`, `1B0`, `(0F7;7B3)OVERLAP_F_B`; with comms, `0SEND_F1` names the sending stage and
`1RECV_F1` the receiving stage (torch's convention). torch knows one pipe whose stages are
numbered 0..S-1; a placement with two pipes (DualPipe) cannot be written.
"""

from __future__ import annotations

import csv
import io

from pipecc.diagnostics import InputError
from pipecc.ir.ops import Compute, Fused, Instr, Msg, Recv, Send, Wait
from pipecc.ir.program import Program


def action(op: Compute) -> str:
    """torch's string for one computation: stage, type letter, microbatch."""
    return f"{op.stage}{op.kind.value}{op.mb}"


def _cell(instr: Instr, with_comms: bool) -> str | None:
    match instr:
        case Compute():
            return action(instr)
        case Fused(forward=f, backward=b):
            return f"({action(f)};{action(b)})OVERLAP_F_B"
        case Send(what=what, stage=stage, mb=mb) if with_comms:
            # torch names the sending stage on a send; pipecc names the receiving stage
            sender = stage - 1 if what is Msg.ACT else stage + 1
            return f"{sender}SEND_{'F' if what is Msg.ACT else 'B'}{mb}"
        case Recv(what=what, stage=stage, mb=mb) if with_comms:
            return f"{stage}RECV_{'F' if what is Msg.ACT else 'B'}{mb}"
        case Send() | Recv() | Wait():
            return None
        case _:
            raise AssertionError(f"unknown instruction {instr!r}")


def dumps(program: Program, *, with_comms: bool = False) -> str:
    """The program as torch action CSV (compute only, or with SEND/RECV cells).

    Raises InputError for a placement with more than one pipe.
    """
    if program.placement.num_pipes != 1:
        raise InputError(
            f"torch.distributed.pipelining cannot express placement "
            f"'{program.placement.name}': it has {program.placement.num_pipes} pipes (two "
            "directions of data flow) and torch has one; use --format json"
        )
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for instrs in program.ranks:
        row = [_cell(instr, with_comms) for instr in instrs]
        writer.writerow([cell for cell in row if cell is not None])
    return buffer.getvalue()
