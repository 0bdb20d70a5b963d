"""The driver: compile a .sched file, or load a compiled program, in one call.

    program = compile_schedule("schedules/zb_h1.sched", ranks=4, microbatches=8)
    program = compile_schedule("dualpipe", ranks=8, microbatches=20)   # a bundled schedule
    program = load_program("prog.json")

The compiler is the front end (parse, expand) followed by the passes in `PASSES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path

from pipecc.diagnostics import InputError
from pipecc.frontend.ast import Param, ScheduleFile
from pipecc.frontend.expand import expand
from pipecc.frontend.parser import parse
from pipecc.interop import json_program
from pipecc.ir.program import Program
from pipecc.passes.assign_microbatches import assign_microbatches
from pipecc.passes.insert_comms import insert_comms
from pipecc.perf import paused_gc

Pass = Callable[[Program], Program]
PASSES: tuple[Pass, ...] = (insert_comms,)
SCHEDULE_SUFFIX = ".sched"


def bundled_schedules() -> dict[str, Path]:
    """The schedules shipped with pipecc, by name (file stem)."""
    folder = resources.files("pipecc.schedules")
    found = {}
    for entry in folder.iterdir():
        if entry.name.endswith(SCHEDULE_SUFFIX):
            found[entry.name[: -len(SCHEDULE_SUFFIX)]] = Path(str(entry))
    return dict(sorted(found.items()))


def resolve_schedule(name_or_path: str) -> Path:
    """A path as given, or a bare name (`dualpipe`) resolved to the bundled schedule."""
    path = Path(name_or_path)
    if path.exists() or path.suffix or "/" in name_or_path:
        return path
    bundled = bundled_schedules()
    if name_or_path in bundled:
        return bundled[name_or_path]
    known = ", ".join(bundled)
    raise InputError(
        f"{name_or_path}: no such file, and no bundled schedule of that name (bundled: {known})"
    )


def read_text(path: Path) -> str:
    """Read a user's input file, turning every way it can fail into one clear InputError."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, not a file") from None
    except OSError as err:
        raise InputError(f"{path}: cannot read: {err.strerror or err}") from None
    if b"\x00" in data:
        raise InputError(f"{path}: not a text file (it contains NUL bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text (byte {err.start} cannot be decoded)") from None


def compile_source(
    text: str,
    path: str,
    *,
    ranks: int,
    microbatches: int,
    defines: Mapping[str, int] | None = None,
) -> Program:
    """Compile .sched text: parse, expand for (P, M, -D), assign microbatches, lower."""
    return compile_tree(parse(text, path), ranks=ranks, microbatches=microbatches, defines=defines)


def compile_tree(
    tree: ScheduleFile,
    *,
    ranks: int,
    microbatches: int,
    defines: Mapping[str, int] | None = None,
) -> Program:
    """Compile a parsed .sched file for one size (a sweep parses once, compiles many)."""
    with paused_gc():
        streams = expand(tree, ranks=ranks, microbatches=microbatches, defines=defines)
        program = assign_microbatches(streams)
        del streams  # freed before lowering, which reuses its memory
        for step in PASSES:
            program = step(program)
    return program


def compile_schedule(
    name_or_path: str | Path,
    *,
    ranks: int,
    microbatches: int,
    defines: Mapping[str, int] | None = None,
) -> Program:
    """Compile a .sched file (or a bundled schedule by name) for P ranks and M microbatches."""
    path = resolve_schedule(str(name_or_path))
    return compile_source(
        read_text(path), str(path), ranks=ranks, microbatches=microbatches, defines=defines
    )


def schedule_parameters(path: str | Path) -> tuple[str, ...]:
    """The names of the parameters a .sched file declares (`param NAME = ...`)."""
    path = Path(path)
    tree = parse(read_text(path), str(path))
    return tuple(decl.name for decl in tree.decls if isinstance(decl, Param))


def load_program(path: str | Path) -> Program:
    """Load a compiled program written by `pipecc compile` (JSON)."""
    path = Path(path)
    text = read_text(path)
    with paused_gc():
        return json_program.loads(text, str(path))
