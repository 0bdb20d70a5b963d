"""Reading a user's input files (text, a compiled program), and the schedules bundled with
pipecc."""

from __future__ import annotations

import warnings
from importlib import resources
from pathlib import Path

from pipecc.diagnostics import InputError
from pipecc.interop import json_program
from pipecc.ir.program import Program
from pipecc.perf import paused_gc

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


def load_program(path: str | Path) -> Program:
    """Load a compiled program written by `pipecc compile` (JSON). Fields this version does
    not know are read past, each file's in one `UserWarning` naming them."""
    program, notes = read_program(path)
    for note in notes:
        warnings.warn(note, stacklevel=2)
    return program


def read_program(path: str | Path) -> tuple[Program, tuple[str, ...]]:
    """`load_program`, and the notes of the reading (fields it did not know, ignored)."""
    path = Path(path)
    text = read_text(path)
    with paused_gc():
        return json_program.read(text, str(path))
