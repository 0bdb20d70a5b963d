"""`pipecc search --placement bidirectional` and `--placement-from FILE.sched` (docs/search.md
§3.1): a verified order, a lower bound that holds, Chimera's step beaten."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import ROOT, compile_bundled, run_cli

from pipecc.analysis.memory import peak_activations
from pipecc.api import compile_schedule
from pipecc.interop.json_program import loads
from pipecc.ir.ops import Compute, Kind
from pipecc.ir.placement import bidirectional_placement
from pipecc.ir.program import Program
from pipecc.search import exact
from pipecc.search.bounds import lower_bound
from pipecc.search.problem import Problem
from pipecc.semantics import CommModel
from pipecc.semantics.costs import parse_cost_flag
from pipecc.simulate.timeline import simulate

DATA = ROOT / "tests" / "data"
CHIMERA = DATA / "chimera.sched"


def _peak(program: Program) -> int:
    return max(peak_activations(instrs).peak for instrs in program.ranks)


def _search(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    code, out, err = run_cli(capsys, "search", *argv, "--json")
    assert code == 0, err
    return dict(json.loads(out))


def test_chimera_is_beaten_within_the_default_time_limit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    costs = parse_cost_flag("F=1,B=2")
    chimera = compile_schedule(CHIMERA, ranks=4, microbatches=8)
    hand = simulate(chimera, costs, model=CommModel.NCCL).makespan
    assert hand <= 32
    cap = _peak(chimera)  # a bidirectional stage is one share
    sched = tmp_path / "best.sched"
    found = _search(
        capsys, "-P", "4", "-M", "8", "--cost", "F=1,B=2", "--memory", str(cap),
        "--placement", "bidirectional", "--sched", str(sched),
    )  # fmt: skip
    assert found["placement"] == "bidirectional"
    assert float(str(found["lower_bound"])) <= float(str(found["makespan"])) <= hand
    code, out, err = run_cli(capsys, "verify", str(sched), "-P", "4", "-M", "8", "--comm", "all")
    assert code == 0, out + err


@pytest.mark.parametrize(("name", "path"), [("dualpipe", None), ("chimera", CHIMERA)])
def test_the_bidirectional_bound_is_below_the_hand_written_schedules(
    name: str, path: Path | None
) -> None:
    costs = parse_cost_flag("F=1,B=2,comm=0")
    for ranks, microbatches in [(2, 4), (4, 8), (4, 12)]:
        if path is None:
            program = compile_bundled(name, ranks, microbatches)
        else:
            program = compile_schedule(path, ranks=ranks, microbatches=microbatches)
        problem = Problem.from_costs(
            costs, ranks=ranks, microbatches=microbatches, placement="bidirectional",
            cap=_peak(program), layout=bidirectional_placement(ranks),
        )  # fmt: skip
        step = simulate(program, costs, model=CommModel.EAGER).makespan
        assert lower_bound(problem) <= step + 1e-9


def test_placement_from_a_table_and_no_split(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out, sched = tmp_path / "best.json", tmp_path / "best.sched"
    found = _search(
        capsys, "-P", "4", "-M", "8", "--cost", "F=1,B=2,comm=0.25", "--memory", "6",
        "--placement-from", str(DATA / "two_pipes_table.sched"), "--no-split",
        "--time-limit", "0.3", "-o", str(out), "--sched", str(sched),
    )  # fmt: skip
    assert found["placement"] == "table"
    assert float(str(found["lower_bound"])) <= float(str(found["makespan"])) + 1e-9
    for program in (loads(out.read_text()), compile_schedule(sched, ranks=4, microbatches=8)):
        assert program.placement.num_pipes == 2
        kinds = {i.kind for instrs in program.ranks for i in instrs if type(i) is Compute}
        assert kinds == {Kind.F, Kind.B}


def test_placement_from_a_named_placement_searches_it_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    found = _search(
        capsys, "-P", "2", "-M", "4", "--cost", "F=1,I=1,W=1", "--memory", "2",
        "--placement-from", str(ROOT / "schedules" / "zbv.sched"), "--time-limit", "0.2",
    )  # fmt: skip
    assert found["placement"] == "vshape"


def test_bidirectional_needs_an_even_m(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capsys, "search", "-P", "4", "-M", "7", "--cost", "F=1", "--memory", "4",
        "--placement", "bidirectional",
    )  # fmt: skip
    assert code == 2
    assert err.strip() == (
        "error: placement bidirectional splits M over 2 pipes: M must be a multiple of 2, got 7"
    )


@pytest.mark.parametrize("split", [True, False])
def test_the_bound_is_below_the_proven_optimum_of_two_pipes(split: bool) -> None:
    pytest.importorskip("ortools")
    costs = parse_cost_flag("F=1,I=1.5,W=0.5,comm=0.5")
    problem = Problem.from_costs(
        costs, ranks=2, microbatches=4, placement="bidirectional", cap=3,
        layout=bidirectional_placement(2), split=split,
    )  # fmt: skip
    solved = exact.solve(problem, time_limit=60)
    assert solved.optimal
    assert lower_bound(problem) <= solved.value + 1e-9


def test_two_pipes_run_under_one_forward_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    base = ("-P", "4", "-M", "8", "--cost", "F=1,B=2", "--placement", "bidirectional")
    code, out, err = run_cli(capsys, "search", *base, "--memory", "0.5")
    assert code == 1
    assert err.strip() == (
        "error: no schedule fits --memory 0.5: the smallest cap that has one is 1 "
        "(bidirectional placement, one microbatch in flight at a time)"
    )
    found = _search(capsys, *base, "--memory", "2", "--time-limit", "0.3")
    assert found["peak"] == [2.0] * 4
    assert float(str(found["lower_bound"])) <= float(str(found["makespan"]))


def test_the_span_objective_takes_one_pipe(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capsys, "search", "-P", "4", "-M", "8", "--cost", "F=1", "--memory", "4",
        "--placement", "bidirectional", "--objective", "span",
    )  # fmt: skip
    assert code == 2
    assert err.strip() == (
        "error: --objective span measures a rank from its first forward, which with several "
        "pipes need not be its first op: use --objective makespan"
    )
