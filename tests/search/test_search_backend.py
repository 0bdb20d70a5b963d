"""`pipecc search --backend`: the written program is placed as `pipecc run` places a
compute-only program on that backend, verified under that backend's comm models, says in
its `comm` field how it was placed, and the printed makespan (and the baseline's) is that
placement's under the backend's comm model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipecc.api import load_program
from pipecc.cli import main
from pipecc.ir.program import Backend
from pipecc.semantics import CommModel
from pipecc.semantics.costs import load_cost_file
from pipecc.simulate.timeline import simulate
from pipecc.verify import ALL_MODELS, Options, verify

# (ranks, microbatches, costs, cap, placement): uniform and uneven costs, both placements
CASES = [
    (2, 4, "F=1,I=1,W=1,comm=0.3", "2", "loop"),
    (4, 8, "F=1,I=1.2,W=0.6,comm=0.5", "4", "loop"),
    (3, 6, "F=1.3,I=0.8,W=0.9,comm=0.1", "3", "auto"),
    (2, 6, "F=1,I=1.5,W=0.5,comm=0.2", "2", "vshape"),
]
# backend -> (the program's comm field, what it needs, the models it must complete under,
# the model its makespan is reported under)
EXPECTED = {
    "gloo": ("early-recv", Backend.INDEPENDENT_PROGRESS,
             (CommModel.RENDEZVOUS, CommModel.EAGER), CommModel.RENDEZVOUS),
    "nccl": ("aligned", Backend.ANY, ALL_MODELS, CommModel.NCCL_SINGLE),
}  # fmt: skip


def _search(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["search", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize(("ranks", "mbs", "cost", "cap", "placement"), CASES)
def test_the_result_is_placed_and_verified_for_the_backend(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    backend: str,
    ranks: int,
    mbs: int,
    cost: str,
    cap: str,
    placement: str,
) -> None:
    out_json = tmp_path / "best.json"
    code, out, _ = _search(capsys, "-P", str(ranks), "-M", str(mbs), "--cost", cost,
                           "--memory", cap, "--placement", placement, "--backend", backend,
                           "--time-limit", "0.1", "--json", "-o", str(out_json))  # fmt: skip
    assert code == 0
    report = json.loads(out)
    comm, needs, models, reported = EXPECTED[backend]
    assert (report["backend"], report["comm"]) == (backend, comm)
    program = load_program(out_json)
    assert (program.comm, program.backend) == (comm, needs), "the .json records the placement"
    assert verify(program, Options(models=models)).ok
    costs = load_cost_file(out_json.with_suffix(".costs.toml"))
    assert simulate(program, costs, model=reported).makespan == report["makespan"]
    assert report["makespan"] <= report["baseline"]["makespan"] + 1e-9


def test_gloo_output_deadlocks_only_where_the_backend_is_not_gloo(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The gloo placement is early-recv: it completes under rendezvous and eager, and under
    NCCL's ordered streams it does not (which is why it is not the nccl placement)."""
    out_json = tmp_path / "gloo.json"
    code, _, _ = _search(capsys, "-P", "4", "-M", "8", "--cost", "F=1,I=1,W=1,comm=0.3",
                         "--memory", "4", "--backend", "gloo", "--json",
                         "-o", str(out_json))  # fmt: skip
    assert code == 0
    program = load_program(out_json)
    assert verify(program, Options(models=(CommModel.RENDEZVOUS, CommModel.EAGER))).ok
    assert not verify(program, Options(models=(CommModel.NCCL,))).ok


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_the_baseline_is_the_bundled_schedule_as_placed_on_the_backend(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, backend: str
) -> None:
    """With uniform costs at P=4, M=8 and cap 4 the best bundled schedule is ZB-H1; its
    baseline is what `pipecc compare zb_h1 --backend B` prints with the same costs: ZB-H1 as
    `pipecc run` places it on B (gloo: early-recv, under rendezvous; nccl: the default)."""
    cost = ("--cost", "F=1,I=1,W=1,comm=0.3")
    code, out, _ = _search(capsys, "-P", "4", "-M", "8", *cost, "--memory", "4",
                           "--backend", backend, "--json",
                           "-o", str(tmp_path / "best.json"))  # fmt: skip
    assert code == 0
    baseline = json.loads(out)["baseline"]
    assert baseline["name"] == "zb_h1"
    assert main(["compare", "zb_h1", "-P", "4", "-M", "8", *cost, "--backend", backend,
                 "--json"]) == 0  # fmt: skip
    (row,) = json.loads(capsys.readouterr().out)
    assert baseline["makespan"] == pytest.approx(row["makespan"], abs=1e-9)


def test_an_explicit_policy_and_model_on_gloo(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_json = tmp_path / "aligned.json"
    code, out, _ = _search(capsys, "-P", "2", "-M", "4", "--cost", "F=1,I=1,W=1,comm=0.3",
                           "--memory", "2", "--backend", "gloo", "--comm-policy", "aligned",
                           "--json", "-o", str(out_json))  # fmt: skip
    assert code == 0
    report = json.loads(out)
    program = load_program(out_json)
    assert report["comm"] == program.comm == "aligned"
    assert verify(program, Options(models=ALL_MODELS)).ok
    costs = load_cost_file(out_json.with_suffix(".costs.toml"))
    assert simulate(program, costs, model=CommModel.RENDEZVOUS).makespan == report["makespan"]


def test_the_table_says_how_the_program_was_placed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _search(capsys, "-P", "2", "-M", "4", "--cost", "F=1", "--memory", "2",
                           "--backend", "gloo")  # fmt: skip
    assert code == 0
    assert "placed       early-recv (backend gloo), verified under rendezvous, eager\n" in out
    assert "(rendezvous)" in out.splitlines()[1]


@pytest.mark.parametrize(
    "args",
    [
        ["--comm-policy", "early-recv"],
        ["--backend", "nccl", "--comm-policy", "early-recv", "--comm", "rendezvous"],
        ["--backend", "gloo", "--comm", "nccl"],
        ["--backend", "gloo", "--comm", "nccl-single"],
    ],
)
def test_early_recv_where_ops_do_not_progress_on_their_own_exits_2(
    capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    code, out, err = _search(capsys, "-P", "2", "-M", "4", "--cost", "F=1", "--memory", "2",
                             *args)  # fmt: skip
    assert code == 2 and out == ""
    assert "early-recv needs every posted op to progress on its own" in err
