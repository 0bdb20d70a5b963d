"""`pipecc run --profile` over several steps: each (stage, op) is the median over the timed steps
of each step's mean, a stage's spread is the relative interquartile range of its compute time
per step (runtime/profiling/recorder.py), the cost file records both in `[profile]`, and every
command that reads a cost file accepts it."""

from __future__ import annotations

import statistics
import tomllib
from pathlib import Path

import pytest
from pipecc.runtime.profiling.figures import relative_iqr
from pipecc.runtime.profiling.recorder import (
    SPREAD_BOUND,
    Recorder,
    compute_costs,
    compute_figures,
    render_cost_file,
    stage_spreads,
    worst_spread,
)

from pipecc.api import compile_schedule
from pipecc.cli import main
from pipecc.semantics.costs import load_cost_file

# per step, the F samples (ms) of stage 0 on rank 0 and of stage 1 on rank 1: step 3 of stage
# 0 is disturbed as a whole; stage 1 is steady
STAGE0 = ([1.0, 1.0], [2.0, 2.0], [2.5, 3.5], [10.0, 10.0])
STAGE1 = ([4.0], [4.0], [4.2], [3.8])
LOOP = compile_schedule("1f1b", ranks=2, microbatches=2)  # the program they were measured on


def _records(stage0: tuple[list[float], ...], stage1: tuple[list[float], ...]) -> list[Recorder]:
    records = []
    for step, (first, second) in enumerate(zip(stage0, stage1, strict=True)):
        a, b = Recorder(step=step), Recorder(step=step)  # ranks 0 and 1
        for ms in first:
            a.compute("F", 0, ms / 1e3)
        for ms in second:
            b.compute("F", 1, ms / 1e3)
        b.compute("B", 1, (ms + 1) / 1e3)
        records += [a, b]
    return records


def test_relative_iqr_is_the_inclusive_quartiles_over_the_median() -> None:
    assert relative_iqr([1.0, 2.0, 3.0, 10.0]) == pytest.approx((4.75 - 1.75) / 2.5)
    assert relative_iqr([5.0, 5.0, 5.0]) == 0.0
    assert relative_iqr([1.0, 3.0]) == pytest.approx(0.5)  # Q1 1.5, Q3 2.5, median 2
    assert relative_iqr([7.0]) is None, "one step has no spread"


def test_each_figure_is_the_median_of_the_step_means_and_the_worst_spread_is_named() -> None:
    records = _records(STAGE0, STAGE1)
    top, per_stage = compute_costs(records)
    assert per_stage[0]["F"] == pytest.approx(2.5), "step means 1, 2, 3, 10: the median"
    assert per_stage[1]["F"] == pytest.approx(4.0)
    # overall F per step: the mean of both stages' samples of that step
    overall = [statistics.fmean([*a, *b]) for a, b in zip(STAGE0, STAGE1, strict=True)]
    assert top["F"] == pytest.approx(statistics.median(overall), abs=1e-4)
    worst = worst_spread(records)
    assert worst is not None
    assert (worst.stage, worst.kind) == (0, "F")
    assert worst.spread == pytest.approx(1.2)
    assert worst.spread > SPREAD_BOUND


def test_the_cost_file_records_the_steps_and_every_spread(tmp_path: Path) -> None:
    path = tmp_path / "costs.toml"
    path.write_text(render_cost_file(_records(STAGE0, STAGE1), "four steps", measured_on=LOOP))
    data = tomllib.loads(path.read_text())
    profile = data["profile"]
    assert {k: v for k, v in profile.items() if k != "stage"} == {
        "steps": 4,
        "spread": pytest.approx(1.2),
        "spread_at": "stage 0",
        "spread_bound": SPREAD_BOUND,
    }
    assert profile["stage"]["0"] == {"F_spread": pytest.approx(1.2), "spread": pytest.approx(1.2)}
    b_means = [ms + 1 for (ms,) in STAGE1]
    assert profile["stage"]["1"] == {
        "F_spread": pytest.approx(relative_iqr([4.0, 4.0, 4.2, 3.8]), abs=1e-4),
        "B_spread": pytest.approx(relative_iqr(b_means), abs=1e-4),
        "spread": pytest.approx(relative_iqr([9.0, 9.0, 9.4, 8.6]), abs=1e-4),
    }
    model = load_cost_file(path)  # the simulator's reader takes it
    assert model.stage(0).F == pytest.approx(2.5)
    assert model.stage(1).B == pytest.approx(5.0)


def test_one_step_keeps_the_mean_and_records_no_spread(tmp_path: Path) -> None:
    records = _records(STAGE0[2:3], STAGE1[2:3])
    _, per_stage = compute_costs(records)
    assert per_stage[0]["F"] == pytest.approx(3.0), "one step: the mean of its samples"
    assert worst_spread(records) is None
    data = tomllib.loads(render_cost_file(records, "one step", measured_on=LOOP))
    assert data["profile"] == {"steps": 1}


@pytest.mark.parametrize(
    "command",
    [
        ["simulate", "1f1b", "-P", "2", "-M", "4"],
        ["compare", "1f1b", "zb_h1", "-P", "2", "-M", "4"],
        ["verify", "1f1b", "-P", "2", "-M", "4", "--stall-budget", "100"],
        ["search", "-P", "2", "-M", "4", "--memory", "2", "--time-limit", "0.05"],
        ["compile", "1f1b", "-P", "2", "-M", "4", "--align"],
    ],
)
def test_every_command_that_reads_costs_accepts_a_profile_with_its_spread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    path = tmp_path / "costs.toml"
    path.write_text(render_cost_file(_records(STAGE0, STAGE1), "four steps", measured_on=LOOP))
    assert main([*command, "--cost-file", str(path)]) == 0, capsys.readouterr().err


def test_an_op_that_is_a_small_part_of_its_stage_does_not_make_the_profile_noisy() -> None:
    """A stage's spread is that of its compute time per step: a W of 0.01 ms that doubles
    every other step spreads by far more than the bound alone, and moves its stage by 0.1%."""
    records = []
    for step in range(6):
        record = Recorder(step=step)
        record.compute("F", 0, 5e-3)
        record.compute("I", 0, 5e-3)
        record.compute("W", 0, (1e-5 if step % 2 else 2e-5))
        records.append(record)
    _, per_stage = compute_figures(records)
    assert per_stage[0]["W"].spread is not None and per_stage[0]["W"].spread > SPREAD_BOUND
    worst = worst_spread(records)
    assert worst is not None and worst.stage == 0 and worst.kind == "W"
    assert worst.spread < 0.002, "the stage's time per step barely moves"
    assert stage_spreads(records) == {0: worst.spread}
    # the same W taking most of the stage's time: now the stage spreads as much as it does
    for record in records:
        record.computes[2] = ("W", 0, 0.5 if record.step % 2 else 1.0)
    assert stage_spreads(records)[0] > SPREAD_BOUND
