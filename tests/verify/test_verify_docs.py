"""docs/verify.md shows real outputs: every `$ pipecc verify …` block is run and compared.

A line `(… cut here)` in a block stands for any number of lines; a line ending in `…
(cut here)` for any line that starts with the text before the `…`. Everything else must match
the tool's output exactly.
"""

from __future__ import annotations

import re
import shlex

import pytest
from helpers import ROOT

from pipecc.cli import main

DOC = ROOT / "docs" / "verify.md"
BLOCK = re.compile(r"```\n\$ pipecc verify (.*?)\n(.*?)```", re.S)
SKIP_ANY = "(… cut here)"
CUT = "… (cut here)"


def _blocks() -> list[tuple[str, list[str]]]:
    found = []
    for match in BLOCK.finditer(DOC.read_text()):
        command, body = match.group(1), match.group(2)
        if "--sweep" in command and "schedules/*.sched" in command:
            continue  # the full sweep of §6 takes a minute; the CLI tests cover sweeps
        found.append((command, body.rstrip("\n").split("\n")))
    return found


def _matches(expected: list[str], got: list[str]) -> bool:
    if not expected:
        return not got
    head, rest = expected[0], expected[1:]
    if head == SKIP_ANY:
        return any(_matches(rest, got[k:]) for k in range(len(got) + 1))
    if not got:
        return False
    if head.endswith(CUT):
        ok = got[0].startswith(head[: -len(CUT)])
    else:
        ok = got[0] == head
    return ok and _matches(rest, got[1:])


@pytest.mark.parametrize(("command", "expected"), _blocks(), ids=lambda v: str(v)[:60])
def test_documented_output_is_what_the_tool_prints(
    command: str,
    expected: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(ROOT)
    main(["verify", *shlex.split(command)])
    out = capsys.readouterr().out.rstrip("\n").split("\n")
    assert _matches(expected, out), "\n".join(out)


def test_every_example_input_is_documented() -> None:
    text = DOC.read_text()
    for path in sorted((ROOT / "docs" / "examples" / "verify").iterdir()):
        assert path.name in text, path.name
