"""`--sweep` over any `-D` parameter, with every failing size reported and grouped into
distinct failures (issue 32, part 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli

from pipecc.driver.sweep import Size, sweep_file

# 1F1B with `extra` warm-up forwards and a bug: for M > 4, rank 1 runs all its forwards
# before any backward, so the order cannot run (rank 0 needs a gradient first)
BUGGY = """schedule sw
param extra = 0
require M >= P
let warmup = min(P - 1 - rank + extra, M)
phase warmup   { repeat warmup { F } }
phase steady   { if rank == 1 and M > 4 { repeat M - warmup { F } repeat M - warmup { B } }
                 else { repeat M - warmup { F B } } }
phase cooldown { repeat warmup { B } }
"""
SIZES = (
    "P=2 M=5 extra=0, P=2 M=5 extra=1, P=2 M=6 extra=0, P=2 M=6 extra=1, P=3 M=5 extra=0, "
    "P=3 M=5 extra=1, P=3 M=6 extra=0, P=3 M=6 extra=1"
)


@pytest.fixture
def buggy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    Path("sw.sched").write_text(BUGGY)
    return "sw.sched"


def _sweep(capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str]:
    code, out, _ = run_cli(
        capsys, "verify", "sw.sched", "--sweep", "ranks=2,3", "microbatches=2..6", *flags
    )
    return code, out


def test_every_failing_size_is_listed_under_its_failure(
    buggy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _sweep(capsys, "extra=0,1", "--jobs", "1")
    assert code == 1
    assert out.count("error[unrunnable-order]") == 2  # the first size's report, the summary
    assert "sw.sched P=2 M=5 extra=0: 1 violation(s) (unrunnable-order 1)" in out
    assert out.splitlines()[-3:] == [
        "sw.sched: FAILED at 8 size(s), 1 distinct failure(s): 10 size(s) verified, 2 skipped",
        f"  error[unrunnable-order] at sw.sched:7:47: 8 size(s): {SIZES}",
        "  skipped 2 size(s), requires M >= P: P=3 extra=0: M=2; P=3 extra=1: M=2",
    ]


def test_parallel_sweep_matches_serial(buggy: str, capsys: pytest.CaptureFixture[str]) -> None:
    serial = _sweep(capsys, "extra=0,1", "--jobs", "1")
    assert _sweep(capsys, "extra=0,1", "--jobs", "2") == serial


def test_a_fixed_define_and_the_json_report(buggy: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _sweep(capsys, "-D", "extra=1", "--format", "json", "--jobs", "1")
    assert code == 1
    (data,) = json.loads(out)
    assert (data["ok"], data["verified"], len(data["skipped"])) == (False, 5, 1)
    assert data["failed"]["input"] == "sw.sched P=2 M=5"
    (failure,) = data["failures"]
    assert failure["failure"] == "error[unrunnable-order] at sw.sched:7:47"
    assert failure["sizes"] == [{"ranks": p, "microbatches": m} for p in (2, 3) for m in (5, 6)]
    assert failure["first"]["input"] == "sw.sched P=2 M=5"
    assert [(s["ranks"], s["microbatches"], s["verdict"]) for s in data["sizes"]] == [
        (2, 2, "ok"), (2, 3, "ok"), (2, 4, "ok"), (2, 5, "failed"), (2, 6, "failed"),
        (3, 2, "skipped"), (3, 3, "ok"), (3, 4, "ok"), (3, 5, "failed"), (3, 6, "failed"),
    ]  # fmt: skip


def test_distinct_failures_each_get_a_line(tmp_path: Path) -> None:
    # a negative repeat count (M < P at one line) and the deadlock above (M > 4 at another)
    path = tmp_path / "two.sched"
    path.write_text(
        BUGGY.replace("require M >= P\n", "").replace(
            "min(P - 1 - rank + extra, M)", "P - 1 - rank + extra"
        )
    )
    result = sweep_file(str(path), ranks=(3,), microbatches=range(1, 7), params={"extra": (0,)})
    groups = result.distinct()
    assert [(g.signature, [s.label for s in g.sizes]) for g in groups] == [
        (f"does not compile: error at {path}:6:32", ["P=3 M=1 extra=0"]),
        (f"error[unrunnable-order] at {path}:6:47", ["P=3 M=5 extra=0", "P=3 M=6 extra=0"]),
    ]
    assert result.compile_failed and result.verified == 3
    assert Size(3, 1, (("extra", 0),)).name == "P3-M1-extra0"
