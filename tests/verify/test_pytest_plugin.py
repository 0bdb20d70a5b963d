"""The pytest plugin: `pytest --pipecc DIR` turns each .sched × size into a test item."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from helpers import SCHEDULES
from programs import DATA


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args, str(folder)],
        capture_output=True,
        text=True,
        cwd=folder,
        check=False,
    )


def test_items_per_size_with_skips_and_failures(tmp_path: Path) -> None:
    shutil.copy(SCHEDULES / "zb_h1.sched", tmp_path)
    shutil.copy(DATA / "megatron_5100.sched", tmp_path)
    result = _pytest(tmp_path, "--pipecc", "--pipecc-sizes", "ranks=2..3 microbatches=1..4")
    out = result.stdout
    assert result.returncode == 1, out
    # zb_h1: 8 sizes, 3 rejected by `require M >= P`; megatron_5100: 5 allowed, all fail
    assert "5 failed, 5 passed, 6 skipped" in out
    assert "SKIPPED [1] zb_h1.sched:1: P=3 M=2: requires M >= P" in out
    assert "_ megatron_5100.sched P=2 M=2 _" in out
    assert "error[needs-buffering]" in out


def test_the_comm_option_chooses_the_models(tmp_path: Path) -> None:
    # pair_order_cycle deadlocks under nccl only, so each --pipecc-comm gives its own verdict
    shutil.copy(DATA / "pair_order_cycle.sched", tmp_path)
    sizes = ("--pipecc-sizes", "ranks=2 microbatches=2")
    gloo = _pytest(tmp_path, "--pipecc", "--pipecc-comm", "rendezvous", *sizes)
    assert gloo.returncode == 0 and "1 passed" in gloo.stdout, gloo.stdout
    default = _pytest(tmp_path, "--pipecc", *sizes)
    assert default.returncode == 1 and "error[deadlock]: deadlock under nccl:" in default.stdout
    both = _pytest(tmp_path, "--pipecc", "--pipecc-comm", "all", *sizes)
    assert both.returncode == 1
    assert "nccl deadlock, nccl-single deadlock, rendezvous passes, eager passes" in both.stdout


def test_without_the_flag_nothing_is_collected(tmp_path: Path) -> None:
    shutil.copy(SCHEDULES / "zb_h1.sched", tmp_path)
    result = _pytest(tmp_path)
    assert result.returncode == 5  # pytest: no tests collected
    assert "no tests ran" in result.stdout


def _items(folder: Path, sizes: str) -> list[str]:
    """The test ids the plugin collects in `folder` at `sizes`."""
    listed = _pytest(folder, "--pipecc", "--pipecc-sizes", sizes, "--collect-only").stdout
    return [line for line in listed.splitlines() if "::" in line]


def test_a_file_that_does_not_parse_fails_once(tmp_path: Path) -> None:
    """One typo is one failure whatever the number of sizes, and the other files run."""
    shutil.copy(SCHEDULES / "zb_h1.sched", tmp_path)
    (tmp_path / "typo.sched").write_text("schedule typo\nplacement loop\nphase p { F B ]\n")
    (tmp_path / "binary.sched").write_bytes(b"schedule \xff\n")
    for sizes, count in (("ranks=2 microbatches=2", 1), ("ranks=2..4 microbatches=1..8", 24)):
        items = _items(tmp_path, sizes)
        assert [i for i in items if not i.startswith("zb_h1.sched::")] == [
            "binary.sched::parse",
            "typo.sched::parse",
        ]
        assert len(items) == 2 + count  # zb_h1 still gets every size
        result = _pytest(tmp_path, "--pipecc", "--pipecc-sizes", sizes)
        out = result.stdout
        assert result.returncode == 1, out
        assert "2 failed, " in out  # once each, whatever the number of sizes
        assert f"{tmp_path}/typo.sched:3:15: error: unexpected ']'" in out
        assert "binary.sched: not UTF-8 text (byte 9 cannot be decoded)" in out


def test_a_compile_error_every_size_shares_fails_once(tmp_path: Path) -> None:
    """A misspelt name parses, and fails at compile time at every size: it fails at the
    first size, and every other size is skipped with a reason naming that one."""
    text = (SCHEDULES / "1f1b.sched").read_text().replace("repeat warmup {", "repeat warmpu {")
    (tmp_path / "typo.sched").write_text(text)
    sizes = "ranks=2..4 microbatches=1..8"
    result = _pytest(tmp_path, "--pipecc", "--pipecc-sizes", sizes)
    out = result.stdout
    assert result.returncode == 1, out
    assert "1 failed, 23 skipped" in out
    assert out.count("error: unknown name 'warmpu'; did you mean 'warmup'?") == 1
    where = f"{tmp_path}/typo.sched:14:25"
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED [1] typo.sched")]
    assert len(skipped) == 23
    assert all(
        line.endswith(
            f"the same error as typo.sched::P2-M1 ({where}: unknown name 'warmpu'; "
            "did you mean 'warmup'?)"
        )
        for line in skipped
    )


def test_errors_that_differ_by_size_are_each_reported(tmp_path: Path) -> None:
    """torchtitan#775's warm-up arithmetic fails at every M < P - 1 with its own counts:
    different messages, different failures."""
    shutil.copy(DATA / "naive_1f1b.sched", tmp_path)
    result = _pytest(tmp_path, "--pipecc", "--pipecc-sizes", "ranks=4 microbatches=1..4")
    out = result.stdout
    assert result.returncode == 1, out
    assert "2 failed, 2 passed" in out
    assert "repeat count is -2, which is negative, on rank 0 (P=4, M=1)" in out
    assert "repeat count is -1, which is negative, on rank 0 (P=4, M=2)" in out


def test_sizes_sweep_the_parameters_a_file_declares(tmp_path: Path) -> None:
    # interleaved_1f1b declares V, zb_h1 does not: V multiplies only the former's items
    shutil.copy(SCHEDULES / "interleaved_1f1b.sched", tmp_path)
    shutil.copy(SCHEDULES / "zb_h1.sched", tmp_path)
    items = _items(tmp_path, "ranks=2 microbatches=4 V=2,3")
    assert sorted(items) == [
        "interleaved_1f1b.sched::P2-M4-V2",
        "interleaved_1f1b.sched::P2-M4-V3",
        "zb_h1.sched::P2-M4",
    ]
    result = _pytest(tmp_path, "--pipecc", "--pipecc-sizes", "ranks=2 microbatches=4 V=2,3")
    assert result.returncode == 0, result.stdout
