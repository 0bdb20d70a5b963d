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
from pipecc.ir.ops import Compute, Fused, Instr, Kind, Msg, Recv, Send, Wait, computations
from pipecc.ir.placement import Placement, StageSlot, loop_placement, vshape_placement
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


# ---- reading (DESIGN §5, "Torch CSV input") ---------------------------------------------------

_ACTION = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
_COMPUTE = {"F": Kind.F, "B": Kind.B, "I": Kind.I, "W": Kind.W}
_IGNORED = ("UNSHARD", "RESHARD", "REDUCE_GRAD")


class Cell(NamedTuple):
    """One parsed action: stage, torch type name, microbatch (None for UNSHARD & co.), span;
    `parts` holds the two sub-actions of an OVERLAP_F_B cell."""

    stage: int
    action: str
    mb: int | None
    span: Span
    parts: tuple[Cell, ...] = ()


class Loaded(NamedTuple):
    """A program read from torch CSV, with notes on what was ignored."""

    program: Program
    notes: tuple[str, ...]


def loads(text: str, path: str = "<csv>") -> Loaded:
    """Read a torch action CSV (compute only, or with SEND/RECV cells) as a Program.

    P is the number of rows; each stage belongs to the row that holds it; M is the largest
    microbatch + 1; each comm cell is its own op posted at its position; a compute op waits
    for the recvs it consumes; sends are waited at the end. UNSHARD, RESHARD and REDUCE_GRAD
    are ignored (noted). Raises InputError, pointing at the cell, for anything malformed.
    """
    source = SourceFile(path, text)
    rows = [_parse_row(source, line_no, line) for line_no, line in enumerate(text.splitlines(), 1)]
    if not rows:
        raise InputError(f"{path}: empty CSV: expected one row of actions per rank")
    ignored = sum(1 for row in rows for cell in row if cell.action in _IGNORED)
    rows = [[cell for cell in row if cell.action not in _IGNORED] for row in rows]
    placement = _placement(rows, path)
    microbatches = 1 + max(
        (c.mb for row in rows for cell in row for c in (cell.parts or (cell,)) if c.mb is not None),
        default=-1,
    )
    if microbatches < 1:
        raise InputError(f"{path}: no compute actions: nothing to verify")
    with_comms = any(cell.action.startswith(("SEND", "RECV")) for row in rows for cell in row)
    builder = _RowBuilder(placement, with_comms)
    ranks = tuple(builder.build(rank, row) for rank, row in enumerate(rows))
    notes: tuple[str, ...] = ()
    if ignored:
        notes = (
            f"ignored {ignored} UNSHARD/RESHARD/REDUCE_GRAD cell(s): they move no pipeline data",
        )
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
    return Loaded(program, notes)


def _split_cells(line: str) -> list[tuple[int, str]]:
    """(1-based column, text) of each cell of one CSV line."""
    if '"' in line:  # quoted cells: positions are not recoverable cheaply; point at col 1
        return [(1, cell) for cell in next(csv.reader([line]))]
    cells, col = [], 1
    for cell in line.split(","):
        cells.append((col, cell))
        col += len(cell) + 1
    return cells


def _parse_row(source: SourceFile, line_no: int, line: str) -> list[Cell]:
    row = []
    for col, raw in _split_cells(line):
        text = raw.strip()
        if not text:
            continue
        col += len(raw) - len(raw.lstrip())
        span = Span(source, line_no, col, line_no, col + len(text))
        row.append(_parse_cell(text, span))
    return row


def _parse_cell(text: str, span: Span) -> Cell:
    overlap = _OVERLAP.fullmatch(text)
    if overlap:
        subs = [s.strip() for s in overlap.group(1).split(";")]
        parts = tuple(_parse_cell(s, span) for s in subs)
        kinds = sorted(p.action for p in parts)
        if len(parts) != 2 or kinds[1] != "F" or kinds[0] not in ("B", "I"):
            raise InputError(f"an OVERLAP_F_B cell holds one F and one B or I, got {text!r}", span)
        forward = parts[0] if parts[0].action == "F" else parts[1]
        backward = parts[1] if forward is parts[0] else parts[0]
        return Cell(-1, "OVERLAP_F_B", None, span, (forward, backward))
    match = _ACTION.fullmatch(text)
    if not match:
        raise InputError(
            f"not a torch action: {text!r} (expected e.g. 0F1, 2I0, 1SEND_F3, "
            "(0F7;7B3)OVERLAP_F_B)",
            span,
        )
    stage, action, mb = match.groups()
    if action not in _IGNORED and not mb:
        raise InputError(f"{text!r} needs a microbatch number", span)
    return Cell(int(stage), action, int(mb) if mb else None, span)


def _placement(rows: list[list[Cell]], path: str) -> Placement:
    """Each stage on the row that holds it; a rank's chunks are its stages in order."""
    holder: dict[int, tuple[int, Cell]] = {}
    for rank, row in enumerate(rows):
        for cell in row:
            for c in cell.parts or (cell,):
                stage = _own_stage(c)
                seen = holder.setdefault(stage, (rank, c))
                if seen[0] != rank:
                    raise InputError(
                        f"stage {stage} appears on rank {seen[0]} and rank {rank}: "
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


def _own_stage(cell: Cell) -> int:
    """The stage a cell's row holds: the stage itself (a SEND names the sender, a RECV the
    receiver, as torch does)."""
    return cell.stage


def _placement_name(slots: list[StageSlot], num_ranks: int) -> str:
    chunks = len(slots) // num_ranks
    for named in (loop_placement(num_ranks, chunks), vshape_placement(num_ranks)):
        if sorted(named.slots, key=_slot_key) == sorted(slots, key=_slot_key):
            return named.name
    return "csv"


def _slot_key(slot: StageSlot) -> tuple[int, int]:
    return slot.rank, slot.chunk


class _RowBuilder:
    """Turns one row of cells into instructions: comm ops at their positions, a wait before
    each compute for the recvs it consumes, a final wait for the sends."""

    def __init__(self, placement: Placement, with_comms: bool) -> None:
        self.placement = placement
        self.with_comms = with_comms
        self.last = placement.num_stages(0) - 1

    def build(self, rank: int, row: list[Cell]) -> tuple[Instr, ...]:
        out: list[Instr] = []
        recvs: dict[tuple[Msg, int, int], int] = {}  # posted, not yet waited
        sends: list[int] = []
        for cell in row:
            if cell.action in ("SEND_F", "SEND_B", "RECV_F", "RECV_B"):
                op = self._comm(cell)
                if type(op) is Recv:
                    recvs[(op.what, op.stage, op.mb)] = len(out)
                else:
                    sends.append(len(out))
                out.append(op)
                continue
            instr = self._compute(rank, cell)
            consumed = [recvs.pop(key) for key in self._inputs(instr) if key in recvs]
            if consumed:
                out.append(Wait(tuple(sorted(consumed)), cell.span))
            out.append(instr)
        if sends:
            out.append(Wait(tuple(sends), None))
        return tuple(out)

    def _compute(self, rank: int, cell: Cell) -> Compute | Fused:
        if cell.parts:
            forward, backward = (self._compute(rank, c) for c in cell.parts)
            assert type(forward) is Compute and type(backward) is Compute  # a part is one op
            return Fused(forward, backward, cell.span)
        holder = self.placement.holder(0, cell.stage)
        return Compute(_COMPUTE[cell.action], holder.chunk, 0, cell.stage, cell.mb or 0, cell.span)

    def _inputs(self, instr: Compute | Fused) -> list[tuple[Msg, int, int]]:
        parts = computations(instr)
        keys = []
        for op in parts:
            if op.kind is Kind.F:
                keys.append((Msg.ACT, op.stage, op.mb))
            elif op.kind is not Kind.W:
                keys.append((Msg.GRAD, op.stage, op.mb))
        return keys

    def _comm(self, cell: Cell) -> Send | Recv:
        stage, mb, action = cell.stage, cell.mb or 0, cell.action
        forward = action.endswith("_F")
        if action.startswith("SEND"):
            to = stage + 1 if forward else stage - 1
            self._check_stage(to, cell)
            peer = self.placement.holder(0, to).rank
            return Send(Msg.ACT if forward else Msg.GRAD, peer, 0, to, mb, None, cell.span)
        source = stage - 1 if forward else stage + 1
        self._check_stage(source, cell)
        peer = self.placement.holder(0, source).rank
        return Recv(Msg.ACT if forward else Msg.GRAD, peer, 0, stage, mb, None, cell.span)

    def _check_stage(self, stage: int, cell: Cell) -> None:
        if not 0 <= stage <= self.last:
            raise InputError(
                f"{cell.action} of stage {cell.stage}: there is no stage {stage} "
                f"(stages are 0..{self.last})",
                cell.span,
            )
