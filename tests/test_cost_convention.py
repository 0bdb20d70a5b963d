"""One cost convention in every command (docs/simulate.md): global costs per share of the
model, `[cost.stage.N]` as given for stage N of the program, profiles converted for the
program they are applied to, `peak_activations` in DESIGN §2's unit.

tests/data/profile_zbv_p2.toml is a real profile, written by
`pipecc run zbv --nproc 2 -M 4 --model examples/mlp.py --profile tests/data/profile_zbv_p2.toml`
(a V shape: 2 ranks, 4 stages; host costs, comm and bytes measured on gloo).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipecc.api import compile_schedule
from pipecc.cli import main
from pipecc.diagnostics import CostModelError
from pipecc.semantics.costs import Cut, load_cost_file, parse_cost_flag

DATA = Path(__file__).parent / "data"
PROFILE = DATA / "profile_zbv_p2.toml"
SCHEDULES = ("1f1b", "zb_h1", "zbv", "dualpipev", "interleaved_1f1b", "dualpipe")
HAND = (
    '[cost]\nunit = "ms"\nF = 1\nI = 1.5\nW = 0.5\ncomm = 0.2\npost = 0.05\n[cost.stage.0]\nF = 2\n'
)
LOOP_PROFILE = (
    '[cost]\nplacement = "loop"\nranks = 4\nstages = 4\nF = 1\nB = 2\ncomm = 0.3\n'
    "[cost.stage.0]\nF = 1.5\nI = 1\nW = 1\n[cost.stage.3]\nF = 0.5\nB = 3\n"
)


def _cost_sources(tmp_path: Path) -> list[list[str]]:
    hand = tmp_path / "hand.toml"
    hand.write_text(HAND)
    loop = tmp_path / "loop.toml"
    loop.write_text(LOOP_PROFILE)
    return [
        ["--cost", "F=1,B=2,I=1,W=1,comm=0.1"],
        ["--cost-file", str(hand)],
        ["--cost-file", str(loop)],
        ["--cost-file", str(PROFILE)],
        ["--cost-file", str(PROFILE), "--cost", "comm=0"],
    ]


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> object:
    capsys.readouterr()
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


# ---- the conversion ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "ranks", "factor"),
    [("1f1b", 4, 1), ("zbv", 4, 0.5), ("dualpipev", 2, 0.5), ("dualpipe", 4, 1)]
    + [("interleaved_1f1b", 2, 0.5)],
)
def test_global_work_is_per_share_messages_and_host_time_are_not(
    name: str, ranks: int, factor: float
) -> None:
    costs = parse_cost_flag("F=2,B=4,FB=5,UNSHARD=2,act_bytes=8,comm=0.3,bytes=64,post=0.1")
    program = compile_schedule(name, ranks=ranks, microbatches=2 * ranks)
    stage = costs.for_program(program).stage(program.placement.num_stages(0) - 1)
    assert (stage.F, stage.B, stage.I, stage.W) == (2 * factor, 4 * factor, 2 * factor, 2 * factor)
    assert (stage.FB, stage.UNSHARD, stage.act_bytes) == (5 * factor, 2 * factor, 8 * factor)
    assert (stage.comm, stage.bytes) == (0.3, 64), "a message is the same at any cut"
    assert costs.for_program(program).host == costs.host


def test_defaults_scale_too_and_the_conversion_is_done_once() -> None:
    program = compile_schedule("zbv", ranks=2, microbatches=4)
    for text in ("comm=0", "B=4", "I=1,W=3"):
        given = parse_cost_flag(text).stage(0)
        converted = parse_cost_flag(text).for_program(program)
        stage = converted.stage(1)
        assert (stage.F, stage.B, stage.I, stage.W) == (
            given.F / 2,
            given.B / 2,
            given.I / 2,
            given.W / 2,
        ), text
        assert converted.for_program(program) is converted


def test_a_stage_table_is_the_programs_stage_as_given(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[cost]\nF = 4\n[cost.stage.5]\nF = 3\nI = 1\nW = 1\n")
    program = compile_schedule("zbv", ranks=4, microbatches=8)
    converted = load_cost_file(path).for_program(program)
    assert converted.stage(5).F == 3 and converted.stage(5).B == 2, "never rescaled"
    assert converted.stage(2).F == 2, "the global F is per share"
    loop = compile_schedule("zb_h1", ranks=4, microbatches=8)
    with pytest.raises(CostModelError, match=r"\[cost.stage.5\] names a stage that loop P=4"):
        load_cost_file(path).for_program(loop)


def test_a_v_profile_applied_to_a_loop_adds_its_stage_pairs() -> None:
    profile = load_cost_file(PROFILE)
    assert profile.measured == Cut(2, 4, "vshape")
    measured = profile.for_cut(Cut(2, 4))
    loop = profile.for_program(compile_schedule("zb_h1", ranks=2, microbatches=4))
    for s in range(2):
        for key in ("F", "I", "W"):
            pair = getattr(measured.stage(2 * s), key) + getattr(measured.stage(2 * s + 1), key)
            assert getattr(loop.stage(s), key) == pytest.approx(pair)
    assert "measured on vshape P=2 (4 stages), converted for loop P=2" in loop.conversion()
    assert "stage s = measured stages 2s..2s+1 added" in loop.conversion()
    assert measured.conversion() == "", "applied to what it was measured on: nothing to say"


def test_a_loop_profile_applied_to_a_v_halves_each_stage(tmp_path: Path) -> None:
    path = tmp_path / "loop.toml"
    path.write_text(LOOP_PROFILE)
    profile = load_cost_file(path)
    vee = profile.for_program(compile_schedule("zbv", ranks=4, microbatches=8))
    assert [vee.stage(s).F for s in range(8)] == [0.75, 0.75, 0.5, 0.5, 0.5, 0.5, 0.25, 0.25]
    assert vee.stage(7).B == 1.5 and vee.stage(0).I == 0.5
    two = profile.for_program(compile_schedule("zbv", ranks=2, microbatches=4))
    assert [two.stage(s).F for s in range(4)] == [1.5, 1, 1, 0.5], "same stages, as given"
    assert two.stage(1).B == 2 * 4 / 4, "[cost] per share of the measured P=4"


def test_shared_stage_groups_follow_the_cut(tmp_path: Path) -> None:
    path = tmp_path / "tied.toml"
    path.write_text(
        "[cost]\nranks = 2\nstages = 4\nF = 1\nshared = [[0, 3]]\n[cost.stage.1]\nF=1\n"
    )
    loop = load_cost_file(path).for_program(compile_schedule("1f1b", ranks=2, microbatches=2))
    assert loop.shared == ((0, 1),)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[cost]\nranks = 2\n", "give ranks and stages together"),
        ("[cost]\nranks = 2\nstages = 0\n", "stages must be a positive integer, got 0"),
        ("[cost]\nranks = 2\nstages = 2.5\n", "stages must be a positive integer"),
        ("[cost]\nranks = 2\nstages = 4\nplacement = 3\n", "placement must be a name"),
        (
            "[cost]\nranks = 2\nstages = 2\n[cost.stage.2]\nF = 1\n",
            "[cost.stage.2] names a stage that P=2 (2 stages) does not have",
        ),
    ],
)
def test_bad_measured_keys(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(CostModelError) as err:
        load_cost_file(path)
    assert message in str(err.value)


def test_measured_keys_belong_in_a_file() -> None:
    with pytest.raises(CostModelError, match="given in a cost file only"):
        parse_cost_flag("F=1,ranks=2")


# ---- the commands --------------------------------------------------------------------------


@pytest.mark.parametrize("comm", ["nccl", "rendezvous", "eager"])
def test_simulate_and_compare_print_the_same_makespan(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, comm: str
) -> None:
    for costs in _cost_sources(tmp_path):
        sizes = ["-P", "4", "-M", "8", "--comm", comm, *costs]
        rows = _json(capsys, "compare", *SCHEDULES, *sizes, "--json")
        assert isinstance(rows, list) and len(rows) == len(SCHEDULES)
        for row in rows:
            one = _json(capsys, "simulate", row["schedule"], *sizes, "--json")
            assert isinstance(one, dict)
            assert row["makespan"] == pytest.approx(one["makespan"], abs=1e-9), (row, costs)
            peak = max(rank["peak_activations"] for rank in one["ranks"])
            assert row["peak_activations"] == peak, "DESIGN §2's unit, as simulate's"


def test_the_stall_budget_replays_what_simulate_does(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for costs in _cost_sources(tmp_path):
        for name in ("zbv", "zb_h1"):
            sizes = ["-P", "4", "-M", "8", "--comm", "nccl-single", *costs]
            one = _json(capsys, "simulate", name, *sizes, "--json")
            report = _json(capsys, "verify", name, *sizes, "--stall-budget", "100%",
                           "--format", "json")  # fmt: skip
            assert isinstance(one, dict) and isinstance(report, dict)
            assert report["waits"][0]["makespan"] == pytest.approx(one["makespan"], abs=1e-8)


def test_peak_shares_compare_memory_across_cuts(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _json(capsys, "compare", "zbv", "zb_h1", "-P", "4", "-M", "8", "--json")
    assert isinstance(rows, list)
    by_name = {row["schedule"]: row for row in rows}
    assert (by_name["zbv"]["peak_activations"], by_name["zb_h1"]["peak_activations"]) == (8, 4)
    assert by_name["zbv"]["peak_shares"] == by_name["zb_h1"]["peak_shares"] == 4
    capsys.readouterr()
    assert main(["compare", "zbv", "zb_h1", "-P", "4", "-M", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-5:] == ["act", "peak", "shares", "stall", "total"]


@pytest.mark.parametrize(
    ("placement", "comm", "source"),
    [("loop", "nccl", 0), ("loop", "rendezvous", 3), ("vshape", "nccl", 3)]
    + [("vshape", "eager", 1), ("loop", "nccl", 2), ("auto", "nccl", 4)],
)
def test_the_search_baseline_is_compares_number(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, placement: str, comm: str, source: int
) -> None:
    costs = _cost_sources(tmp_path)[source]
    ranks = "2" if PROFILE.name in " ".join(costs) else "4"
    sizes = ["-P", ranks, "-M", "8", "--comm", comm, *costs]
    found = _json(capsys, "search", *sizes, "--memory", "8", "--placement", placement,
                  "--json", "--time-limit", "0.2")  # fmt: skip
    assert isinstance(found, dict) and found["baseline"] is not None
    base = found["baseline"]
    rows = _json(capsys, "compare", base["name"], *sizes, "--json")
    assert isinstance(rows, list)
    assert base["makespan"] == pytest.approx(rows[0]["makespan"], abs=1e-9)
    assert found["makespan"] <= base["makespan"] + 1e-9


def test_the_written_program_simulates_to_the_searchs_makespan(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "found.json"
    sizes = ["-P", "2", "-M", "4", "--cost-file", str(PROFILE)]
    found = _json(capsys, "search", *sizes, "--memory", "4", "--placement", "auto", "--json",
                  "-o", str(out))  # fmt: skip
    rows = _json(capsys, "compare", str(out), *sizes, "--json")
    assert isinstance(found, dict) and isinstance(rows, list)
    assert rows[0]["makespan"] == pytest.approx(found["makespan"], abs=1e-9)


def test_every_command_takes_the_v_profile(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Measured on a V shape, usable by every command, converted with a note where applied
    to a loop program."""
    costs = ["--cost-file", str(PROFILE)]
    commands = [
        ["simulate", "zb_h1", "-P", "2", "-M", "4", *costs],
        ["compare", "zb_h1", "zbv", "-P", "2", "-M", "4", *costs],
        ["verify", "zb_h1", "-P", "2", "-M", "4", "--stall-budget", "100%", *costs],
        ["search", "-P", "2", "-M", "4", "--memory", "4", *costs, "--time-limit", "0.2"],
        ["explain", "zb_h1", "-P", "2", "-M", "4", "--op", "1:0", *costs],
    ]
    for args in commands:
        capsys.readouterr()
        assert main(args) == 0, args
        captured = capsys.readouterr()
        shown = captured.err + captured.out
        assert "measured on vshape P=2 (4 stages), converted for loop P=2" in shown, args


def test_compare_per_stage_takes_costs_as_given_and_refuses_a_converted_profile(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = ["-P", "4", "-M", "8", "--cost", "F=1,B=2,I=1,W=1,comm=0.1"]
    rows = _json(capsys, "compare", "zbv", *flags, "--per-stage", "--json")
    one = _json(capsys, "simulate", "zbv", "-P", "4", "-M", "8", "--json",
                "--cost", "F=2,B=4,I=2,W=2,comm=0.1")  # fmt: skip
    assert isinstance(rows, list) and isinstance(one, dict)
    assert rows[0]["makespan"] == pytest.approx(one["makespan"]), "each stage at the costs given"
    capsys.readouterr()
    code = main(["compare", "zb_h1", "-P", "2", "-M", "4", "--cost-file", str(PROFILE),
                 "--per-stage"])  # fmt: skip
    assert code == 2
    assert "measured on vshape P=2 (4 stages), so per stage they are not" in capsys.readouterr().err
