"""docs/parallelism.md shows real outputs: every `$ pipecc …` block (compile, verify,
simulate; not run) is run and compared line by line, notes (stderr) first; a line `(… cut
here)` stands for any number of lines."""

from __future__ import annotations

import contextlib
import io
import re
import shlex

import pytest
from helpers import ROOT

from pipecc.cli import main

DOC = ROOT / "docs" / "parallelism.md"
BLOCK = re.compile(r"```\n\$ pipecc (.*?)\n(.*?)```", re.S)
SKIP_ANY = "(… cut here)"


def _blocks() -> list[tuple[str, list[str]]]:
    """The page's command blocks, but `pipecc run` (it spawns 4 processes and reports wall
    time: tests/runtime/test_mesh_runtime.py runs it)."""
    return [
        (m.group(1), m.group(2).rstrip("\n").split("\n"))
        for m in BLOCK.finditer(DOC.read_text())
        if not m.group(1).startswith("run ")
    ]


def _matches(expected: list[str], got: list[str]) -> bool:
    if not expected:
        return not got
    head, rest = expected[0], expected[1:]
    if head == SKIP_ANY:
        return any(_matches(rest, got[k:]) for k in range(len(got) + 1))
    return bool(got) and got[0] == head and _matches(rest, got[1:])


def test_the_page_has_its_examples() -> None:
    commands = [command.split()[0] for command, _ in _blocks()]
    assert commands.count("compile") == 2 and commands.count("verify") == 2
    assert commands.count("simulate") == 2


@pytest.mark.parametrize(("command", "expected"), _blocks(), ids=lambda x: str(x)[:60])
def test_each_example_is_the_real_output(
    command: str, expected: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        main(shlex.split(command))
    got = (err.getvalue() + out.getvalue()).rstrip("\n").split("\n")
    assert _matches(expected, got), "\n".join(got)
