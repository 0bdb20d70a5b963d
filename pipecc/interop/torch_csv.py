"""torch.distributed.pipelining's action CSV: one row per rank, one action per cell.

Actions are written as torch prints them: `0F1` (stage 0, forward, microbatch 1), `0I1`,
`0W1`, `1B0`, `(0F7;7B3)OVERLAP_F_B`; with comms, `0SEND_F1` names the sending stage and
`1RECV_F1` the receiving stage (torch's convention). torch knows one pipe whose stages are
numbered 0..S-1; a placement with two pipes (DualPipe) cannot be written.

`loads` reads such a CSV back as a Program, as DESIGN §5 ("Torch CSV input") says: each cell
keeps its file:line:col, so the verifier's messages point at the cell.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path
from typing import NamedTuple

from pipecc.diagnostics import InputError, SourceFile, Span
from pipecc.ir.ops import (
    Collective,
    Compute,
    Fused,
    Instr,
    Msg,
    Recv,
    Send,
    Sequential,
    StageOp,
    Wait,
    is_compute,
)
from pipecc.ir.placement import Placement, StageSlot, loop_placement, vshape_placement
from pipecc.ir.printer import describe
from pipecc.ir.program import Program
from pipecc.passes.torch_actions import (
    Action,
    ActionKind,
    RowBuilder,
    compute_actions,
    of_compute,
    of_instr,
    overlap,
    peer_stage,
)
from pipecc.passes.torch_lowering import stage_op_slots


def action(op: Compute) -> str:
    """torch's string for one computation: stage, type letter, microbatch."""
    return str(of_compute(op))


def _cell(instr: Instr, with_comms: bool) -> str | None:
    match instr:
        case Compute() | Fused() | Sequential():
            return str(of_instr(instr))
        case StageOp() if with_comms:
            return str(of_instr(instr))
        case StageOp():
            return None
        case Send(what=what, stage=stage, mb=mb) if with_comms:
            # torch names the sending stage on a send; pipecc names the receiving stage
            sender = stage - 1 if what is Msg.ACT else stage + 1
            return f"{sender}SEND_{'F' if what is Msg.ACT else 'B'}{mb}"
        case Recv(what=what, stage=stage, mb=mb) if with_comms:
            return f"{stage}RECV_{'F' if what is Msg.ACT else 'B'}{mb}"
        case Send() | Recv() | Wait() | Collective():  # `dumps` refuses a collective first
            return None
        case _:
            raise AssertionError(f"unknown instruction {instr!r}")


def _comms_row(program: Program, instrs: tuple[Instr, ...], actions: list[Action]) -> list[str]:
    """One rank's cells with comms, and UNSHARD/RESHARD/REDUCE_GRAD where torch's lowering
    puts them around the compute (torch adds nothing to a compute_comms CSV itself, and
    scales gradients by 1/M only in REDUCE_GRAD). An UNSHARD or RESHARD goes just before its
    compute; a REDUCE_GRAD after the backward that completes its stage and the sends that
    directly follow it, as torch's own lowering orders them."""
    slots = stage_op_slots(actions, program.num_microbatches)
    cells: list[str] = []
    after: tuple[Action, ...] = ()
    k = 0
    for instr in instrs:
        if after and type(instr) is not Send:
            cells += map(str, after)
            after = ()
        if is_compute(instr):
            cells += map(str, slots.before[k])
            after = slots.after[k]
            k += 1
        cell = _cell(instr, True)
        if cell is not None:
            cells.append(cell)
    return cells + [str(a) for a in after + slots.tail]


def dumps(program: Program, *, with_comms: bool = False) -> str:
    """The program as torch action CSV (compute only, or with SEND/RECV cells and torch's
    UNSHARD/RESHARD/REDUCE_GRAD cells).

    Raises InputError for a placement with more than one pipe, or a program that holds a
    collective (torch's actions have none: REDUCE_GRAD is a stage's FSDP reduction, not a
    sum across pipeline ranks).
    """
    if program.placement.num_pipes != 1:
        raise InputError(
            f"torch.distributed.pipelining cannot express placement "
            f"'{program.placement.name}': it has {program.placement.num_pipes} pipes (two "
            "directions of data flow) and torch has one; use --format json"
        )
    found = _first_collective(program)
    if found is not None:
        rank, index, op = found
        raise InputError(
            f"torch.distributed.pipelining's action format has no collective: rank {rank} "
            f"instruction {index} ({describe(op)}) cannot be written (REDUCE_GRAD is a "
            "stage's FSDP reduction, not a sum across pipeline ranks); use --format json"
        )
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    kept = has_stage_ops(program)  # a torch CSV's own: written where they are
    for instrs, actions in zip(program.ranks, compute_actions(program), strict=True):
        if with_comms and not kept:
            writer.writerow(_comms_row(program, instrs, actions))
        else:
            row = (_cell(instr, with_comms) for instr in instrs)
            writer.writerow([cell for cell in row if cell is not None])
    return buffer.getvalue()


def _first_collective(program: Program) -> tuple[int, int, Collective] | None:
    for rank, instrs in enumerate(program.ranks):
        for index, instr in enumerate(instrs):
            if type(instr) is Collective:
                return rank, index, instr
    return None


def has_stage_ops(program: Program) -> bool:
    return any(type(i) is StageOp for instrs in program.ranks for i in instrs)


def dump_notes(program: Program, *, with_comms: bool) -> tuple[str, ...]:
    """What `dumps` leaves out: a compute-only CSV holds no UNSHARD/RESHARD/REDUCE_GRAD
    (torch's compute_only loader refuses them and adds its own)."""
    if with_comms or not has_stage_ops(program):
        return ()
    return (
        "torch-csv (compute only) holds no UNSHARD/RESHARD/REDUCE_GRAD: the program's were "
        "left out, and torch adds its own when it lowers the file (use torch-csv-comms to "
        "keep them)",
    )


# ---- reading (DESIGN §5, "Torch CSV input") ---------------------------------------------------

_ACTION = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
_COMPUTE_KINDS = (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)


class Loaded(NamedTuple):
    """A program read from torch CSV, with notes on what was ignored."""

    program: Program
    notes: tuple[str, ...]


def loads(text: str, path: str = "<csv>") -> Loaded:
    """Read a torch action CSV (compute only, or with SEND/RECV cells) as a Program.

    P is the number of rows; each stage belongs to the row that holds it; M is the largest
    microbatch + 1; each comm cell is its own op posted at its position; a compute op waits
    for the recvs it consumes; sends are waited at the end. UNSHARD, RESHARD and REDUCE_GRAD
    are kept as StageOps where they stand. Raises InputError, pointing at the cell, for
    anything malformed.
    """
    source = SourceFile(path, text)
    rows = [_parse_row(source, line_no, line) for line_no, line in enumerate(text.splitlines(), 1)]
    if not rows:
        raise InputError(f"{path}: empty CSV: expected one row of actions per rank")
    placement = _placement(rows, path)
    microbatches = 1 + max(
        (c.mb for row in rows for cell in row for c in cell.leaves() if c.mb is not None),
        default=-1,
    )
    if microbatches < 1:
        raise InputError(f"{path}: no compute actions: nothing to verify")
    with_comms = any(cell.kind.is_comm for row in rows for cell in row)
    _check_peers(rows, placement.num_stages(0) - 1)
    builder = RowBuilder(placement)
    ranks = tuple(builder.build(row) for row in rows)
    program = Program(
        schedule=Path(path).stem,
        source=path,
        num_ranks=len(rows),
        num_microbatches=microbatches,
        params=(),
        comm="torch-csv" if with_comms else "none",
        placement=placement,
        ranks=ranks,
    )
    return Loaded(program, ())


def _split_cells(line: str) -> list[tuple[int, str]]:
    """(1-based column, text) of each cell of one CSV line."""
    if '"' in line:  # quoted cells: positions are not recoverable cheaply; point at col 1
        return [(1, cell) for cell in next(csv.reader([line]))]
    cells, col = [], 1
    for cell in line.split(","):
        cells.append((col, cell))
        col += len(cell) + 1
    return cells


def _parse_row(source: SourceFile, line_no: int, line: str) -> list[Action]:
    row = []
    for col, raw in _split_cells(line):
        text = raw.strip()
        if not text:
            continue
        col += len(raw) - len(raw.lstrip())
        span = Span(source, line_no, col, line_no, col + len(text))
        row.append(_parse_cell(text, span))
    return row


def _parse_cell(text: str, span: Span) -> Action:
    found = _OVERLAP.fullmatch(text)
    if found:  # any non-empty list of computations, kept in the order written
        subs = [s.strip() for s in found.group(1).split(";")]
        if not all(subs):
            raise InputError(f"an OVERLAP_F_B cell lists computations, got {text!r}", span)
        parts = tuple(_parse_cell(s, span) for s in subs)
        if any(p.kind not in _COMPUTE_KINDS for p in parts):
            raise InputError(
                f"an OVERLAP_F_B cell holds only F, B, I and W actions, got {text!r}", span
            )
        return overlap(parts, span)
    match = _ACTION.fullmatch(text)
    if not match:
        raise InputError(
            f"not a torch action: {text!r} (expected e.g. 0F1, 2I0, 1SEND_F3, "
            "(0F7;7B3)OVERLAP_F_B)",
            span,
        )
    stage, name, mb = match.groups()
    kind = ActionKind(name)
    if not kind.is_stage_op and not mb:
        raise InputError(f"{text!r} needs a microbatch number", span)
    if kind.is_stage_op and mb:  # torch ignores it; counted, it would change M
        raise InputError(
            f"{text!r}: {name} acts on a whole stage and takes no microbatch number "
            f"(write {stage}{name})",
            span,
        )
    return Action(int(stage), kind, int(mb) if mb else None, (), span)


def _placement(rows: list[list[Action]], path: str) -> Placement:
    """Each stage on the row that holds it (a SEND names the sender, a RECV the receiver, as
    torch does); a rank's chunks are its stages in order."""
    holder: dict[int, tuple[int, Action]] = {}
    for rank, row in enumerate(rows):
        for cell in row:
            for c in cell.leaves():
                seen = holder.setdefault(c.stage, (rank, c))
                if seen[0] != rank:
                    raise InputError(
                        f"stage {c.stage} appears on rank {seen[0]} and rank {rank}: "
                        "each stage lives on one rank",
                        c.span,
                    )
    stages = sorted(holder)
    if stages != list(range(len(stages))):
        missing = sorted(set(range(max(stages, default=-1) + 1)) - set(stages))
        raise InputError(
            f"{path}: stages must be 0..S-1 with every stage on some rank; "
            f"no row holds stage(s) {missing}"
        )
    slots = []
    for rank in range(len(rows)):
        mine = [s for s in stages if holder[s][0] == rank]
        if not mine:
            raise InputError(f"{path}: rank {rank} (row {rank + 1}) holds no stage")
        slots += [StageSlot(rank, chunk, 0, stage) for chunk, stage in enumerate(mine)]
    return Placement(_placement_name(slots, len(rows)), tuple(slots))


def _placement_name(slots: list[StageSlot], num_ranks: int) -> str:
    chunks = len(slots) // num_ranks
    for named in (loop_placement(num_ranks, chunks), vshape_placement(num_ranks)):
        if sorted(named.slots, key=_slot_key) == sorted(slots, key=_slot_key):
            return named.name
    return "csv"


def _slot_key(slot: StageSlot) -> tuple[int, int]:
    return slot.rank, slot.chunk


def _check_peers(rows: list[list[Action]], last: int) -> None:
    """Every comm cell's peer stage exists."""
    for cell in (c for row in rows for c in row if c.kind.is_comm):
        other = peer_stage(cell)
        if not 0 <= other <= last:
            raise InputError(
                f"{cell.kind.value} of stage {cell.stage}: there is no stage {other} "
                f"(stages are 0..{last})",
                cell.span,
            )
