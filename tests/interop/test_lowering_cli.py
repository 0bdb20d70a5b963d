"""`--lowering pipecc|torch|torch-defer` on verify, simulate and compile, as a user runs them.

The verdicts of torch's lowering of the 18 exports (nine schedules, P=2 and P=4, M=8) are
pinned: torch's own lowering is the test oracle for the ops (test_torch_lowering.py) and its
gloo runtime for the mismatches (test_torch_runtime.py); this file checks what verify makes
of them under every comm model, and the command line's errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli

from pipecc.api import bundled_schedules, compile_schedule
from pipecc.interop import torch_csv
from pipecc.passes.insert_comms import strip_comms
from pipecc.passes.torch_program import lower_as_torch
from pipecc.verify import ALL_MODELS, Options, verify

SCHEDULES = tuple(name for name in bundled_schedules() if name != "dualpipe")
# defer_pp_recv=True: (violation codes, the models that deadlock); without it all pass
DEFER = {
    ("1f1b", 2): ("deadlock", "nccl nccl-single"),
    ("1f1b", 4): ("deadlock", "nccl nccl-single"),
    ("dualpipev", 2): ("deadlock", "nccl nccl-single"),
    ("dualpipev", 4): ("deadlock mismatch", "nccl nccl-single"),
    ("gpipe", 2): ("", ""),
    ("gpipe", 4): ("", ""),
    ("interleaved_1f1b", 2): ("deadlock", "nccl nccl-single"),
    ("interleaved_1f1b", 4): ("deadlock", "nccl nccl-single"),
    ("interleaved_zb", 2): ("deadlock mismatch", "nccl nccl-single"),
    ("interleaved_zb", 4): ("deadlock", "nccl nccl-single"),
    ("looped_bfs", 2): ("deadlock", "nccl nccl-single"),
    ("looped_bfs", 4): ("deadlock", "nccl-single"),
    ("zb_h1", 2): ("deadlock", "nccl nccl-single"),
    ("zb_h1", 4): ("deadlock", "nccl nccl-single"),
    ("zb_h2", 2): ("deadlock", "nccl nccl-single"),
    ("zb_h2", 4): ("deadlock", "nccl nccl-single"),
    ("zbv", 2): ("deadlock mismatch", "nccl nccl-single"),
    ("zbv", 4): ("deadlock mismatch", "nccl nccl-single"),
}


@pytest.mark.parametrize("defer", [False, True], ids=["torch", "torch-defer"])
@pytest.mark.parametrize(("schedule", "ranks"), sorted(DEFER))
def test_verdicts_of_torch_lowering(schedule: str, ranks: int, defer: bool) -> None:
    program = strip_comms(compile_schedule(schedule, ranks=ranks, microbatches=8))
    report = verify(lower_as_torch(program, defer=defer), Options(models=ALL_MODELS))
    codes = " ".join(sorted({v.code for v in report.violations}))
    stuck = " ".join(v.model.value for v in report.verdicts if v.status.name == "DEADLOCK")
    assert (codes, stuck) == (DEFER[(schedule, ranks)] if defer else ("", ""))


@pytest.fixture
def zbv_compute(tmp_path: Path) -> Path:
    path = tmp_path / "zbv_compute.csv"
    path.write_text(torch_csv.dumps(compile_schedule("zbv", ranks=4, microbatches=8)))
    return path


def test_verify_torch_defer_finds_the_swap(
    capsys: pytest.CaptureFixture[str], zbv_compute: Path
) -> None:
    code, out, _ = run_cli(capsys, "verify", str(zbv_compute), "--lowering", "torch-defer")
    assert code == 1
    assert "error[mismatch]: rank 2 → rank 3: messages 5 and 6 are swapped" in out
    assert "error[deadlock]: deadlock under nccl" in out
    assert "with defer_pp_recv=True (_add_send_recv, then _defer_recv_ops)" in out


def test_verify_torch_passes_every_model(
    capsys: pytest.CaptureFixture[str], zbv_compute: Path
) -> None:
    code, out, _ = run_cli(
        capsys, "verify", str(zbv_compute), "--lowering", "torch", "--comm", "all"
    )
    assert code == 0, out
    assert "nccl passes, nccl-single passes, rendezvous passes, eager passes" in out
    code, out, _ = run_cli(capsys, "verify", str(zbv_compute), "--comm", "all")
    assert code == 0  # pipecc's own lowering of the same file


def test_malformed_compute_schedule_is_a_violation(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # runnable with pipecc's lowering (rank 1 can run 1F1 before 1B0), not with torch's:
    # torch places rank 0's sends only as it places its compute, one action per round
    path = tmp_path / "order.csv"
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n")
    code, out, _ = run_cli(capsys, "verify", str(path), "--lowering", "torch")
    assert code == 0, out  # this one lowers fine; the next cannot
    path.write_text("0F0,0B1,0F1,0B0\n1F0,1F1,1B0,1B1\n")
    code, out, _ = run_cli(capsys, "verify", str(path), "--lowering", "torch")
    assert code == 1
    assert "error[torch-lowering]: torch's lowering fails: _add_send_recv raises" in out
    assert "rank 0 is stuck at `0B1` (action 1 of rank 0)" in out
    assert "`0B1` needs `0RECV_B1`, which rank 1 posts when it places `1B1` or `1I1`" in out
    code, out, _ = run_cli(capsys, "verify", str(path))
    assert code == 1  # pipecc finds the same order unrunnable, its own way


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("compile", "zbv.csv", "--align", "--cost", "F=1"), "--lowering torch and --align"),
        (("compile", "zbv.csv", "--comm-policy", "default"), "and --comm-policy both place"),
        (("verify", "comms.csv"), "already has its sends and receives"),
        (("simulate", "comms.csv"), "already has its sends and receives"),
        (("verify", "zbv.csv", "--sweep", "ranks=2"), "--sweep verifies pipecc's lowering"),
    ],
)
def test_bad_input_exits_2(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    argv: tuple[str, ...],
    message: str,
) -> None:
    program = compile_schedule("zbv", ranks=2, microbatches=4)
    (tmp_path / "zbv.csv").write_text(torch_csv.dumps(program))
    (tmp_path / "comms.csv").write_text(torch_csv.dumps(program, with_comms=True))
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, *argv, "--lowering", "torch")
    assert code == 2
    assert message in err


def test_simulate_and_compile_take_the_torch_lowering(
    capsys: pytest.CaptureFixture[str], zbv_compute: Path
) -> None:
    code, out, _ = run_cli(capsys, "simulate", str(zbv_compute), "--lowering", "torch", "--json")
    assert code == 0
    ops = [op["op"] for op in json.loads(out)["ops"] if op["rank"] == 0]
    lowered = lower_as_torch(
        strip_comms(compile_schedule("zbv", ranks=4, microbatches=8)), defer=False
    )
    assert len(ops) == len(lowered.ranks[0])
    code, out, _ = run_cli(
        capsys,
        "compile",
        str(zbv_compute),
        "--lowering",
        "torch-defer",
        "--format",
        "torch-csv-comms",
    )
    assert code == 0
    first = out.splitlines()[0].split(",")
    assert first[:4] == ["0UNSHARD", "7UNSHARD", "0F0", "0SEND_F0"]
    code, out, _ = run_cli(capsys, "compile", "zbv", "-P", "4", "-M", "8", "--lowering", "torch")
    assert code == 0
    assert json.loads(out)["comm"] == "torch"


def test_verify_torch_lowers_a_sched_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify --lowering torch on a .sched file compiles its compute order only: pipecc's own
    comm ops are never placed, to be stripped again before torch's rules lower it."""
    import pipecc.driver.compile as compile_module

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pipecc's comm policy ran under --lowering torch")

    monkeypatch.setattr(compile_module, "insert_comms", refuse)
    monkeypatch.setattr(compile_module, "align_comms", refuse)
    code, out, err = run_cli(capsys, "verify", "zb_h1", "-P", "4", "-M", "8", "--lowering", "torch")
    assert code == 0 and ": ok (" in out, (out, err)


@pytest.mark.parametrize("style", ["torch", "torch-defer"])
def test_stage_actions_in_a_compute_only_input_are_refused_at_the_cell(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, style: str
) -> None:
    path = tmp_path / "order.csv"
    path.write_text("0UNSHARD,0F0,0B0,0REDUCE_GRAD,0RESHARD\n1F0,1B0\n")
    code, out, err = run_cli(capsys, "verify", str(path), "--lowering", style)
    assert code == 2 and out.startswith(f"{path}: cannot use this input (input): {path}:1:1: ")
    assert err.startswith(
        f"{path}:1:1: error: --lowering {style} lowers a compute-only schedule, and torch's "
        "compute_only loader refuses UNSHARD/RESHARD/REDUCE_GRAD (it adds its own): this "
        "input holds some\n"
    ), err
