"""A Program from any input: a .sched file (compiled for the sizes), a compiled program
(.json) or a torch.distributed.pipelining action CSV (.csv), chosen by extension."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pipecc.diagnostics import InputError
from pipecc.driver.compile import compile_schedule
from pipecc.driver.files import read_text
from pipecc.interop import json_program, torch_csv
from pipecc.ir.ops import Recv, Send, Wait
from pipecc.ir.program import Program
from pipecc.perf import paused_gc


def load_program(path: str | Path) -> Program:
    """Load a compiled program written by `pipecc compile` (JSON)."""
    path = Path(path)
    text = read_text(path)
    with paused_gc():
        return json_program.loads(text, str(path))


def is_compute_only(program: Program) -> bool:
    """No Send, Recv or Wait anywhere: the comm ops are still to be placed."""
    return not any(type(x) in (Send, Recv, Wait) for instrs in program.ranks for x in instrs)


def load(
    path: str,
    *,
    ranks: int | None = None,
    microbatches: int | None = None,
    defines: Mapping[str, int] | None = None,
) -> tuple[Program, tuple[str, ...]]:
    """A program from .sched (needs the sizes), .json or torch .csv, chosen by extension."""
    if path.endswith(".csv"):
        loaded = torch_csv.loads(read_text(Path(path)), path)
        return loaded.program, loaded.notes
    if path.endswith(".json"):
        return load_program(path), ()
    if ranks is None or microbatches is None:
        missing = " and ".join(
            flag
            for flag, v in (("-P/--ranks", ranks), ("-M/--microbatches", microbatches))
            if v is None
        )
        raise InputError(f"{path}: a .sched file needs {missing}")
    program = compile_schedule(path, ranks=ranks, microbatches=microbatches, defines=defines)
    return program, ()
