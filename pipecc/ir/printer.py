"""The one formatter of instructions, and the text forms of a program built on it.

An instruction has a short form, its `label()` (`F0.3` = forward of chunk 0 on microbatch
3, `F0.4&B1.1` = a fused pair, `send act s2.3→r1`), for grids and pictures; and a long form,
`describe` (`send act stage 2 mb 3 to rank 1 [group 0]`, with the pipe when the program has
two), for listings, diagnostics, the simulator's and explain's reasons and the runtime's
errors. `message` names a tensor that crosses a stage boundary the same way; `torch_name`
gives a computation's name in torch's notation (`1B7`), for the checks of torch programs.

The grid reads like the papers' figures: one row per rank, one column per compute
instruction. The listing shows every instruction of every rank with its index.
"""

from __future__ import annotations

from typing import Protocol

from pipecc.ir.ops import (
    Collective,
    Compute,
    Fused,
    Instr,
    Msg,
    Phase,
    Recv,
    Send,
    Sequential,
    StageOp,
    Wait,
    computations,
    is_compute,
)
from pipecc.ir.program import Program


def header(program: Program) -> str:
    params = " ".join(f"{k}={v}" for k, v in program.params)
    extra = f"  {params}" if params else ""
    if program.is_whole_mesh:  # the whole mesh: one list per global rank
        assert program.mesh is not None
        extra += f"  mesh {program.mesh.describe()} ({program.num_ranks} ranks)"
    elif program.mesh is not None:
        extra += f"  mesh {program.mesh.describe()}"
    return (
        f"# {program.schedule}  P={program.num_ranks} M={program.num_microbatches}  "
        f"placement {program.placement.name}{extra}"
    )


def format_grid(program: Program) -> str:
    """One row per rank, one column per compute instruction, columns aligned."""
    rows = [[instr.label() for instr in instrs if is_compute(instr)] for instrs in program.ranks]
    width = max((len(row) for row in rows), default=0)
    columns = [max((len(row[j]) for row in rows if j < len(row)), default=0) for j in range(width)]
    name = len(f"rank {program.num_ranks - 1}")
    lines = [header(program)]
    for rank, row in enumerate(rows):
        cells = " ".join(cell.ljust(columns[j]) for j, cell in enumerate(row))
        lines.append(f"{f'rank {rank}'.ljust(name)} | {cells}".rstrip())
    return "\n".join(lines) + "\n"


class Named(Protocol):
    """Anything that names a message: a Send, a Recv, a `Message`."""

    @property
    def what(self) -> Msg: ...
    @property
    def pipe(self) -> int: ...
    @property
    def stage(self) -> int: ...
    @property
    def mb(self) -> int: ...


def message(op: Named, *, pipes: bool = True) -> str:
    """`act pipe 0 stage 1 mb 2`: a message by its receiving stage (the pipe when `pipes`)."""
    pipe = f"pipe {op.pipe} " if pipes else ""
    return f"{op.what.value} {pipe}stage {op.stage} mb {op.mb}"


def describe(instr: Instr, *, pipes: bool = True, places: bool = False, groups: bool = True) -> str:
    """The long form of an instruction. `pipes`: name the pipe (a program with two pipes);
    `places`: give a computation's stage and microbatch too (`F0.2 (stage 3 mb 2)`);
    `groups`: a comm op's posting group."""
    match instr:
        case Phase(op=op):
            pipe = f"pipe {op.pipe} " if pipes else ""
            return (
                f"{instr.label()} ({pipe}stage {op.stage} mb {op.mb})" if places else instr.label()
            )
        case Compute() | Fused() | Sequential():
            if not places:
                return instr.label()
            where = "; ".join(
                (f"pipe {op.pipe} " if pipes else "") + f"stage {op.stage} mb {op.mb}"
                for op in computations(instr)
            )
            return f"{instr.label()} ({where})"
        case Send() | Recv():
            verb, arrow = ("send", "to") if type(instr) is Send else ("recv", "from")
            group = f" [group {instr.group}]" if groups and instr.group is not None else ""
            return f"{verb} {message(instr, pipes=pipes)} {arrow} rank {instr.peer}{group}"
        case Wait(ops=ops):
            return "wait " + " ".join(str(i) for i in ops)
        case StageOp(kind=kind, stage=stage):
            return f"{kind.value} stage {stage}"
        case Collective():
            return collective(instr)
        case _:
            raise AssertionError(f"unknown instruction {instr!r}")


def collective(op: Collective) -> str:
    """`all_reduce grad-sum s0+s7 over ranks 0, 7` (`[async]` when a later wait completes it)."""
    ranks = ", ".join(str(r) for r in op.ranks)
    tail = " [async]" if op.asynchronous else ""
    if op.dims:  # a pipeline's program on a mesh: its pipeline ranks times these dimensions
        over = "pipeline rank" if len(op.ranks) == 1 else "pipeline ranks"
        return f"{op.kind.value} {op.what} over {over} {ranks} × {' × '.join(op.dims)}{tail}"
    return f"{op.kind.value} {op.what} over ranks {ranks}{tail}"


def torch_name(op: Compute | StageOp) -> str:
    """torch.distributed.pipelining's name of a computation or a stage action: stage, letter,
    microbatch (`1B7`), or stage and action (`1UNSHARD`)."""
    if isinstance(op, StageOp):
        return f"{op.stage}{op.kind.value}"
    return f"{op.stage}{op.kind.value}{op.mb}"


def has_pipes(program: Program) -> bool:
    """The program has two pipes (bidirectional placement): the long forms name the pipe."""
    return program.placement.num_pipes > 1


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
