"""`pipecc search --no-split`: full backwards only, with a lower bound that holds
(docs/search.md §3.1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import compile_bundled, run_cli

from pipecc.api import compile_schedule
from pipecc.interop.json_program import loads
from pipecc.ir.ops import Compute, Kind
from pipecc.search.bounds import lower_bound
from pipecc.search.problem import Problem
from pipecc.semantics import CommModel
from pipecc.semantics.costs import parse_cost_flag
from pipecc.simulate.timeline import simulate

COSTS = "F=1,B=2,comm=0.25"


@pytest.mark.parametrize("placement", ["loop", "vshape"])
def test_no_split_writes_only_f_and_b_and_its_bound_holds(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, placement: str
) -> None:
    out, sched = tmp_path / "best.json", tmp_path / "best.sched"
    code, text, err = run_cli(
        capsys, "search", "-P", "3", "-M", "6", "--cost", COSTS, "--memory", "3",
        "--placement", placement, "--no-split", "--time-limit", "0.3",
        "-o", str(out), "--sched", str(sched), "--json",
    )  # fmt: skip
    assert code == 0, err
    found = json.loads(text)
    assert found["lower_bound"] <= found["makespan"] + 1e-9
    for program in (loads(out.read_text()), compile_schedule(sched, ranks=3, microbatches=6)):
        kinds = {i.kind for instrs in program.ranks for i in instrs if type(i) is Compute}
        assert kinds == {Kind.F, Kind.B}
    assert " I" not in sched.read_text() and " W" not in sched.read_text()


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_the_no_split_bound_is_below_the_full_backward_schedules(name: str) -> None:
    costs = parse_cost_flag("F=1,B=2,comm=0")
    for ranks, microbatches in [(2, 4), (4, 8)]:
        problem = Problem.from_costs(
            costs, ranks=ranks, microbatches=microbatches, placement="loop",
            cap=microbatches, split=False,
        )  # fmt: skip
        program = compile_bundled(name, ranks, microbatches)
        step = simulate(program, costs, model=CommModel.EAGER).makespan
        assert lower_bound(problem) <= step + 1e-9
