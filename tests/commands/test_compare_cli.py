"""`pipecc compare` labels each row by its input: a file by its name, a bundled schedule by
its name and the -D values it takes; labels are unique within the table, in text and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipecc.commands.compare import input_labels
from tests.helpers import run_cli

SIZES = ("-P", "4", "-M", "8", "--cost", "F=1,B=2,I=1,W=1,comm=0.1")


@pytest.fixture
def zbv_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """ZB-V four ways: compiled, aligned, torch-lowered, and as a torch action CSV."""
    flags = {
        "zbv.json": (),
        "zbv_aligned.json": ("--align", "--cost", "F=1,B=2,I=1,W=1,comm=0.1"),
        "zbv_torch.json": ("--lowering", "torch"),
        "zbv.csv": ("--format", "torch-csv"),
    }
    for name, extra in flags.items():
        path = str(tmp_path / name)
        code, _, err = run_cli(capsys, "compile", "zbv", "-P", "4", "-M", "8", *extra, "-o", path)
        assert code == 0, err
    return [str(tmp_path / name) for name in flags]


def _table(out: str) -> list[str]:
    """The label of every row, as printed (labels may hold spaces: cut at the makespan)."""
    lines = out.splitlines()
    assert lines[1].split()[0] == "input"
    width = lines[1].index("makespan") - 2  # the label column, a space, makespan in 9
    return [line[:width].rstrip() for line in lines[2:]]


def test_each_input_of_one_schedule_is_its_own_row(
    zbv_files: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "compare", "zbv", *zbv_files, *SIZES)
    assert code == 0
    assert sorted(_table(out)) == sorted(
        ["zbv", "zbv.json", "zbv_aligned.json", "zbv_torch.json", "zbv.csv"]
    )
    code, out, _ = run_cli(capsys, "compare", "zbv", *zbv_files, *SIZES, "--json")
    rows = json.loads(out)
    assert isinstance(rows, list) and len(rows) == 5
    assert all(isinstance(row["label"], str) for row in rows)
    assert len({row["label"] for row in rows}) == 5
    assert {row["schedule"] for row in rows} == {"zbv"}
    text = run_cli(capsys, "compare", "zbv", *zbv_files, *SIZES)[1]
    assert sorted(row["label"] for row in rows) == sorted(_table(text))


def test_a_schedule_is_labelled_with_the_values_it_declares(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(
        capsys, "compare", "interleaved_1f1b", "zb_h1", "-D", "V=3", *SIZES, "--json"
    )
    assert code == 0
    labels = {row["label"]: row["schedule"] for row in json.loads(out)}
    assert labels == {"interleaved_1f1b -D V=3": "interleaved_1f1b", "zb_h1": "zb_h1"}


def test_a_skipped_row_has_its_label(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "compare", "dualpipe", "1f1b", "-P", "4", "-M", "6", "--json")
    assert code == 0
    rows = json.loads(out)
    assert rows[-1] == {
        "label": "dualpipe",
        "schedule": "dualpipe",
        "skipped": "requires M >= 2 * P, got M=6, P=4",
    }


@pytest.mark.parametrize(
    ("files", "defines", "labels"),
    [
        (["a/zbv.json", "b/zbv.json"], [], ["a/zbv.json", "b/zbv.json"]),
        (["a/zbv.json", "zbv.csv"], [], ["zbv.json", "zbv.csv"]),
        (["zbv", "zbv", "zbv"], [], ["zbv", "zbv #2", "zbv #3"]),
        (["x/y.json", "x/y.json"], [], ["x/y.json", "x/y.json #2"]),
        (["interleaved_1f1b", "1f1b"], [("V", 2), ("Q", 1)], ["interleaved_1f1b -D V=2", "1f1b"]),
        (["prog.json"], [("V", 2)], ["prog.json"]),
    ],
)
def test_labels_are_unique_and_name_the_input(
    files: list[str], defines: list[tuple[str, int]], labels: list[str]
) -> None:
    assert input_labels(files, defines) == labels


def test_a_sched_file_is_labelled_by_its_file_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = tmp_path / "my_1f1b.sched"
    mine.write_text((Path(__file__).parents[2] / "schedules" / "1f1b.sched").read_text())
    code, out, _ = run_cli(capsys, "compare", "1f1b", str(mine), *SIZES)
    assert code == 0
    assert sorted(_table(out)) == ["1f1b", "my_1f1b.sched"]
