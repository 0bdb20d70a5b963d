"""A Program from any input: a .sched file (compiled for the sizes), a compiled program
(.json) or a torch.distributed.pipelining action CSV (.csv), chosen by extension."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from pipecc.diagnostics import InputError, RefusedProgramError
from pipecc.driver.compile import (
    DEFAULT_LOWERING,
    Lowering,
    compile_schedule,
    lower_program,
    place_again,
    places_again,
)
from pipecc.driver.files import read_program, read_text
from pipecc.interop import torch_csv
from pipecc.ir.ops import Recv, Send, Wait
from pipecc.ir.program import Program
from pipecc.passes.insert_comms import strip_comms
from pipecc.passes.torch_program import LoweringStyle
from pipecc.verify import check_input, check_order


def is_compute_only(program: Program) -> bool:
    """No Send, Recv or Wait anywhere: the comm ops are still to be placed."""
    return not any(type(x) in (Send, Recv, Wait) for instrs in program.ranks for x in instrs)


def needs_lowering(program: Program) -> bool:
    """A compute-only program of several ranks (a torch CSV without comm actions): its sends,
    receives and waits are placed before anything runs it (DESIGN §1, §5)."""
    return program.num_ranks > 1 and is_compute_only(program)


class Loaded(NamedTuple):
    """A loaded program and the notes its reader left (ignored CSV cells, JSON fields this
    version does not know)."""

    program: Program
    notes: tuple[str, ...]


def load(
    path: str,
    *,
    ranks: int | None = None,
    microbatches: int | None = None,
    defines: Mapping[str, int] | None = None,
    lowering: Lowering | None = DEFAULT_LOWERING,
) -> Loaded:
    """The one entry point to a Program from any input, chosen by extension: a .sched file
    (which needs the sizes) compiled with `lowering`, a compiled program (.json) or a torch
    action CSV (.csv). A compute-only .json or .csv is lowered with `lowering`; a lowered one
    gets its comm ops placed again only if `lowering` asks for an alignment or another policy
    (`place_again`). Either is first put through the verifier's input checks and refused
    (`RefusedProgramError`, exit 2) when it fails them: a command never runs a program with
    a missing computation, a misplaced op or an op before its data. `lowering=None` returns a
    .json or .csv as it was read, unchecked (`pipecc verify` reports its defects itself)."""
    if path.endswith(".csv"):
        program, notes = _read_csv(path)
    elif path.endswith(".json"):
        program, notes = read_program(path)
    else:
        p, m = _sizes(path, ranks, microbatches)
        lower = DEFAULT_LOWERING if lowering is None else lowering
        program = compile_schedule(path, ranks=p, microbatches=m, defines=defines, lowering=lower)
        return Loaded(program, ())
    if lowering is None:
        return Loaded(program, notes)
    if needs_lowering(program):
        refuse_invalid(path, program)
        return Loaded(lower_program(program, lowering), notes)
    refuse_torch_lowering(path, program, lowering.style)
    # a program whose comm ops are placed again is checked for its compute order; one kept,
    # in full
    refuse_invalid(path, strip_comms(program) if places_again(program, lowering) else program)
    return Loaded(place_again(program, lowering), notes)


def refuse_invalid(label: str, program: Program) -> None:
    """Raise `RefusedProgramError` when `program` fails the verifier's input checks: those of
    a compute order (`check_order`) for a compute-only program, else `check_input`."""
    check = check_order if is_compute_only(program) else check_input
    report = check(program)
    if report is None:
        return
    found = ", ".join(f"{code} {n}" for code, n in report.counts().items())
    raise RefusedProgramError(label, report.violations, found)


def refuse_torch_lowering(path: str, program: Program, style: LoweringStyle) -> None:
    """--lowering torch* lowers a compute order: an input with comm ops is bad input."""
    if style is not LoweringStyle.PIPECC and not is_compute_only(program):
        raise InputError(
            f"{path}: --lowering {style.value} lowers a compute-only schedule, and this input "
            "already has its sends and receives (torch runs them as written: check it without "
            "--lowering)"
        )


def _read_csv(path: str) -> tuple[Program, tuple[str, ...]]:
    loaded = torch_csv.loads(read_text(Path(path)), path)
    return loaded.program, loaded.notes


def _sizes(path: str, ranks: int | None, microbatches: int | None) -> tuple[int, int]:
    """-P and -M, which a .sched file needs."""
    if ranks is None or microbatches is None:
        missing = " and ".join(
            flag
            for flag, v in (("-P/--ranks", ranks), ("-M/--microbatches", microbatches))
            if v is None
        )
        raise InputError(f"{path}: a .sched file needs {missing}")
    return ranks, microbatches
