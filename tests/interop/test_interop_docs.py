"""docs/interop.md shows real outputs: every `$ pipecc …` block is run and compared (stdout
and stderr together, as a terminal shows them; `(… cut here)` stands for any lines), and its
example of torch's 1F1B table is what torch dumps."""

from __future__ import annotations

import csv
import io
import re
import shlex

import pytest
from helpers import ROOT

from pipecc.cli import main

DOC = ROOT / "docs" / "interop.md"
BLOCK = re.compile(r"```\n\$ pipecc (.*?)\n(.*?)```", re.S)
SKIP_ANY = "(… cut here)"


def _blocks() -> list[tuple[str, list[str]]]:
    return [
        (m.group(1), m.group(2).rstrip("\n").split("\n")) for m in BLOCK.finditer(DOC.read_text())
    ]


def _matches(expected: list[str], got: list[str]) -> bool:
    if not expected:
        return not got
    if expected[0] == SKIP_ANY:
        return any(_matches(expected[1:], got[k:]) for k in range(len(got) + 1))
    return bool(got) and got[0] == expected[0] and _matches(expected[1:], got[1:])


def test_every_block_is_found() -> None:
    assert len(_blocks()) >= 8


@pytest.mark.parametrize(("command", "expected"), _blocks(), ids=lambda v: str(v)[:50])
def test_documented_output_is_what_the_tool_prints(
    command: str,
    expected: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(ROOT)
    main(shlex.split(command))
    captured = capsys.readouterr()
    got = (captured.out + captured.err).rstrip("\n").split("\n")
    assert _matches(expected, got), "\n".join(got)


def test_torch_1f1b_example_is_what_torch_dumps() -> None:
    oracle = pytest.importorskip("torch_oracle")
    order = oracle.bare_schedule("Schedule1F1B", 2, 4, 1)._get_pipeline_order()
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for rank in range(2):
        writer.writerow(["" if a is None else str(a) for a in order[rank]])
    path = ROOT / "docs" / "examples" / "interop" / "torch_1f1b_pipeline_order.csv"
    assert path.read_text() == buffer.getvalue()
