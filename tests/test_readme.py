"""The README shows real outputs: every `$ pipecc …` command of its code blocks (but `pipecc
run`, which spawns processes and is run by `make demo` and tests/runtime) is run in order in
one folder and its output compared line by line; a line that reports wall time (`seconds`)
is compared up to its first number. The search stops at its budget, or at the clock on a busy
host (docs/search.md), so its output and what reads it are held to their first line only."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
from helpers import ROOT

from pipecc.cli import main

BLOCK = re.compile(r"```\n(.*?)```", re.S)
TIMED = ("seconds ",)


def _commands() -> list[tuple[str, list[str]]]:
    """(command line, expected output lines) for each `$ pipecc` line of the README."""
    found: list[tuple[str, list[str]]] = []
    for block in BLOCK.findall((ROOT / "README.md").read_text()):
        current: list[str] | None = None
        for line in block.rstrip("\n").split("\n"):
            if line.startswith("$ "):
                current = []
                found.append((line[2:], current))
            elif current is not None:
                current.append(line)
    return [(c, out) for c, out in found if c.startswith("pipecc ") and " run " not in f"{c} "]


def _same(expected: str, got: str) -> bool:
    if expected.startswith(TIMED):
        return got.split()[0] == expected.split()[0]
    return expected == got


def _run(command: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(shlex.split(command)[1:])
    return code, out.getvalue()


def test_readme_outputs_are_real(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In order, in one folder (a later command reads what an earlier one wrote)."""
    commands = _commands()
    names = {command.split()[1] for command, _ in commands}
    assert {"list", "compile", "verify", "simulate", "search"} <= names, names
    for name in ("schedules", "docs", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    wrong = []
    for command, expected in commands:
        code, text = _run(command)
        got = text.rstrip("\n").split("\n")
        if " best." in command:  # the search's order: the clock may stop it on a busy host
            same = got[0].startswith(expected[0].split("(")[0]) and len(got) == len(expected)
        else:
            same = len(got) == len(expected) and all(map(_same, expected, got))
        if code != 0 or not same:
            wrong.append(f"$ {command}\n{text}")
    assert not wrong, "the README shows other outputs than these:\n" + "\n".join(wrong)
