"""`dispatch`: the host time of every compute instruction that does not grow with its stage's
share of the model (docs/simulate.md, the cost convention). The conversion between cuts
scales only the part of F, B, I, W, FB, FI above it; a model without the key (a hand-written
file, an older profile) converts exactly as before; `pipecc run --profile` writes `[cost]`
per share with the same rule, so a profile read back on the cut it was measured on gives the
measured durations, and the search, simulate and compare see the same durations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pipecc.runtime.profiling.recorder import Recorder, dispatch_ms, render_cost_file

from pipecc.api import compile_schedule
from pipecc.cli import main
from pipecc.diagnostics import CostModelError
from pipecc.search.problem import stage_costs
from pipecc.semantics.costs import Cut, load_cost_file, parse_cost_flag, scale_duration

LOOP = '[cost]\nplacement = "loop"\nranks = 2\nstages = 2\nF = 1\nI = 1\nW = 1\n'
TABLES = "[cost.stage.0]\nF = 1.2\nI = 0.9\nW = 0.1\n[cost.stage.1]\nF = 0.8\nI = 1\nW = 1.4\n"


def test_without_dispatch_the_conversion_is_the_share_alone() -> None:
    for value, factor in ((1.0, 0.5), (0.3, 2.0), (2.5, 1 / 3)):
        assert scale_duration(value, factor, 0.0) == value * factor, "bit for bit"
    program = compile_schedule("zbv", ranks=2, microbatches=4)
    plain = parse_cost_flag("F=1,I=1.5,W=0.5,FB=3,comm=0.2").for_program(program)
    zero = parse_cost_flag("F=1,I=1.5,W=0.5,FB=3,comm=0.2,dispatch=0").for_program(program)
    for stage in range(4):
        assert plain.stage(stage) == zero.stage(stage)
    assert (plain.stage(0).F, plain.stage(0).I, plain.stage(0).FB) == (0.5, 0.75, 1.5)


def test_the_part_up_to_dispatch_is_not_scaled() -> None:
    costs = parse_cost_flag("F=1,I=1.5,W=0.1,FB=3,UNSHARD=1,comm=0.2,dispatch=0.2")
    vee = costs.for_program(compile_schedule("zbv", ranks=2, microbatches=4)).stage(1)
    assert vee.F == pytest.approx(0.2 + 0.8 / 2)
    assert vee.I == pytest.approx(0.2 + 1.3 / 2)
    assert vee.W == pytest.approx(0.1), "a duration under dispatch is all fixed"
    assert vee.FB == pytest.approx(0.2 + 2.8 / 2)
    assert vee.UNSHARD == pytest.approx(0.5), "torch's stage actions scale as before"
    assert vee.comm == 0.2
    loop = costs.for_program(compile_schedule("zb_h1", ranks=2, microbatches=4)).stage(1)
    assert (loop.F, loop.I) == (1, 1.5), "one share per stage: as given"


def test_a_loop_profile_and_a_v_profile_convert_into_each_other(tmp_path: Path) -> None:
    loop = tmp_path / "loop.toml"
    loop.write_text(LOOP + "dispatch = 0.2\n" + TABLES)
    vee = load_cost_file(loop).for_cut(Cut(2, 4, "vshape"))
    assert vee.stage(0).F == pytest.approx(0.2 + 1.0 / 2)
    assert vee.stage(3).W == pytest.approx(0.2 + 1.2 / 2)
    assert vee.stage(1).W == pytest.approx(0.1), "under dispatch: kept whole in each half"
    assert "each op's first dispatch=0.2 not scaled" in vee.conversion()
    # written back as a V profile and converted to the loop: the stages measured
    measured = tmp_path / "vee.toml"
    tables = "".join(
        f"[cost.stage.{s}]\n" + "".join(f"{k} = {getattr(vee.stage(s), k)}\n" for k in "FIW")
        for s in range(4)
    )
    measured.write_text(
        '[cost]\nplacement = "vshape"\nranks = 2\nstages = 4\ndispatch = 0.2\n' + tables
    )
    back = load_cost_file(measured).for_cut(Cut(2, 2, "loop"))
    for stage, (f, i, w) in enumerate(((1.2, 0.9, 0.1), (0.8, 1, 1.4))):
        assert back.stage(stage).F == pytest.approx(f)
        assert back.stage(stage).I == pytest.approx(i)
        assert back.stage(stage).W == pytest.approx(w)


def test_a_hand_written_file_converts_as_before(tmp_path: Path) -> None:
    path = tmp_path / "loop.toml"
    path.write_text(LOOP + TABLES)
    vee = load_cost_file(path).for_cut(Cut(2, 4, "vshape"))
    assert [vee.stage(s).F for s in range(4)] == [0.6, 0.6, 0.4, 0.4]
    assert [vee.stage(s).W for s in range(4)] == [0.05, 0.05, 0.7, 0.7]
    assert "dispatch" not in vee.conversion()


def test_the_profile_writes_dispatch_and_per_share_durations_with_it() -> None:
    program = compile_schedule("zbv", ranks=2, microbatches=2)  # 4 stages: half a share each
    records = []
    for step in range(3):
        record = Recorder(step=step)
        for stage in range(4):
            record.compute("F", stage, 3e-3)
        for seconds in (1e-3, 1e-3, 5e-3):
            record.outside(seconds)
        records.append(record)
    assert dispatch_ms(records) == 1.0, "the median over the forwards"
    text = render_cost_file(records, "test", measured_on=program)
    assert "\ndispatch = 1.0\n" in text
    assert "\nF = 5.0\n" in text, "1 + (3 - 1) × 2 per share"


def test_search_simulate_and_compare_see_the_same_durations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "loop.toml"
    path.write_text(LOOP + "dispatch = 0.2\n" + TABLES)
    costs = load_cost_file(path)
    problem = stage_costs(costs.for_cut(Cut(2, 4, "vshape")), 4)
    converted = costs.for_program(compile_schedule("zbv", ranks=2, microbatches=4))
    assert problem.f[0] == pytest.approx(converted.stage(0).F)
    assert problem.w[3] == pytest.approx(converted.stage(3).W)
    sizes = ["zbv", "-P", "2", "-M", "4", "--cost-file", str(path)]
    assert main(["simulate", *sizes, "--json"]) == 0
    simulated = capsys.readouterr().out
    assert main(["compare", *sizes, "--json"]) == 0
    compared = capsys.readouterr().out
    assert json.loads(simulated)["makespan"] == pytest.approx(json.loads(compared)[0]["makespan"])


def test_dispatch_is_global_and_not_negative(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[cost]\nF = 1\n[cost.stage.0]\ndispatch = 0.1\n")
    with pytest.raises(CostModelError, match=r"'dispatch' is global only: give it under \[cost\]"):
        load_cost_file(path)
    with pytest.raises(CostModelError, match="dispatch must be a finite number ≥ 0"):
        parse_cost_flag("dispatch=-1")


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"I": 0.5, "W": 0.4}, (0.9, 0.5, 0.4)),  # B = I + W, dispatch or not
        ({"B": 0.8}, (0.8, 0.4, 0.4)),
        ({"B": 0.8, "I": 0.5}, (0.8, 0.5, 0.3)),
        ({"B": 0.8, "W": 0.4}, (0.8, 0.4, 0.4)),
        ({"I": 0.5}, (1.0, 0.5, 0.5)),
    ],
)
def test_a_derived_duration_is_a_plain_sum_or_half(
    given: dict[str, float], expected: tuple[float, float, float]
) -> None:
    """With dispatch=0.2 in the file a B derived from I and W is still I + W, and the halves
    of a B are B / 2: a B of this runtime costs what its split halves cost together (1F1B's
    B against ZB-H1's I + W on one model, docs/simulate.md), where I + W - dispatch predicted
    1F1B's B 20-30% short."""
    costs = parse_cost_flag(",".join(["dispatch=0.2", *(f"{k}={v}" for k, v in given.items())]))
    stage = costs.stage(0)
    assert (stage.B, stage.I, stage.W) == pytest.approx(expected)
