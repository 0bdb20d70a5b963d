"""torch's UNSHARD, RESHARD and REDUCE_GRAD are IR: kept from a CSV, written back, verified,
simulated (zero time unless costed), and absent from every program compiled from .sched."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from csv_mutants import mutated, reduce_first
from helpers import compile_bundled, run_cli

from pipecc.api import bundled_schedules
from pipecc.interop import json_program, torch_csv
from pipecc.ir.ops import Instr, StageAction, StageOp, Wait
from pipecc.ir.program import Program
from pipecc.passes.insert_comms import strip_comms
from pipecc.passes.torch_program import lower_as_torch
from pipecc.semantics.costs import parse_cost_flag
from pipecc.simulate.timeline import simulate
from pipecc.verify import ALL_MODELS, Options, verify

SCHEDULES = tuple(name for name in bundled_schedules() if name != "dualpipe")
EXPORTS = [(s, p) for s in SCHEDULES for p in (2, 4)]


def comms_csv(schedule: str, ranks: int, microbatches: int = 8) -> str:
    return torch_csv.dumps(compile_bundled(schedule, ranks, microbatches), with_comms=True)


def stage_ops(program: Program) -> list[list[StageOp]]:
    return [[i for i in instrs if type(i) is StageOp] for instrs in program.ranks]


@pytest.mark.parametrize(("schedule", "ranks"), EXPORTS)
def test_kept_written_back_and_verified(schedule: str, ranks: int) -> None:
    text = comms_csv(schedule, ranks)
    program = torch_csv.loads(text).program
    held = stage_ops(program)
    assert all(held), "every rank holds UNSHARD, RESHARD and REDUCE_GRAD"
    for rank, ops in enumerate(held):
        reduces = [op.stage for op in ops if op.kind is StageAction.REDUCE_GRAD]
        assert sorted(reduces) == [s.stage for s in program.placement.chunks(rank)]
    assert torch_csv.dumps(program, with_comms=True) == text
    again = json_program.loads(json_program.dumps(program))
    assert stage_ops(again) == held
    assert torch_csv.dumps(again, with_comms=True) == text
    report = verify(program, Options(models=ALL_MODELS))
    assert report.ok, [str(v) for v in report.violations]


@pytest.mark.parametrize(("schedule", "ranks"), EXPORTS)
def test_torch_lowering_holds_torch_stage_ops(schedule: str, ranks: int) -> None:
    program = compile_bundled(schedule, ranks, 8)
    assert not any(stage_ops(program)), ".sched programs hold no stage ops"
    lowered = lower_as_torch(strip_comms(program), defer=False)
    assert all(stage_ops(lowered))
    assert verify(lowered).ok


MUTANTS = {
    "reduce-before-last-backward": (reduce_first, "reduce-grad", "comes before"),
    "reduce-missing": (
        lambda row: [c for c in row if not c.endswith("REDUCE_GRAD")],
        "reduce-grad",
        "has no REDUCE_GRAD",
    ),
    "reduce-twice": (
        lambda row: [*row, next(c for c in row if c.endswith("REDUCE_GRAD"))],
        "reduce-grad",
        "2 REDUCE_GRADs",
    ),
    "unshard-missing": (
        lambda row: [c for c in row if not c.endswith("UNSHARD")],
        "unshard-reshard",
        "while it is sharded",
    ),
    "reshard-first": (
        lambda row: [next(c for c in row if c.endswith("RESHARD")), *row],
        "unshard-reshard",
        "without an UNSHARD",
    ),
    "reshard-missing": (
        lambda row: [c for c in row if not c.endswith("RESHARD")],
        "unshard-reshard",
        "has no",
    ),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
@pytest.mark.parametrize(("schedule", "ranks"), [("zb_h1", 2), ("zbv", 4), ("dualpipev", 2)])
def test_misplaced_stage_ops_are_violations(schedule: str, ranks: int, mutant: str) -> None:
    edit, code, words = MUTANTS[mutant]
    text = mutated(comms_csv(schedule, ranks), ranks - 1, edit)
    report = verify(torch_csv.loads(text, "m.csv").program)
    found = [v for v in report.violations if v.code == code]
    assert found, [str(v) for v in report.violations]
    assert words in found[0].message
    assert found[0].rank == ranks - 1 and found[0].index is not None


def test_violation_names_the_cell(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "bad.csv"
    path.write_text(mutated(comms_csv("1f1b", 2, 2), 0, reduce_first))
    code, out, _ = run_cli(capsys, "verify", str(path))
    assert code == 1
    assert (
        "bad.csv:1:58: error[reduce-grad]: rank 0 @9 `0REDUCE_GRAD` comes before `0B1` (@11), "
        "the stage's last backward"
    ) in out
    assert "bad.csv:1:71: note: `0B1`, the stage's last backward, is here" in out


def test_simulate_gives_zero_time_unless_costed() -> None:
    program = torch_csv.loads(comms_csv("zb_h1", 4)).program
    bare = replace(program, ranks=tuple(_without_stage_ops(r) for r in program.ranks))
    assert verify(bare, Options()).ok  # the waits renumbered: the same program less its ops
    costs = parse_cost_flag("F=1,B=2,I=1,W=1")
    with_ops = simulate(program, costs)
    without = simulate(bare, costs)
    assert with_ops.makespan == without.makespan
    names = [name for _, _, instr, _, _ in with_ops.ops() if (name := instr.label()) == "UNSHARD0"]
    assert names, "the timeline lists the stage ops"
    slower = simulate(program, parse_cost_flag("F=1,B=2,I=1,W=1,REDUCE_GRAD=3"))
    assert slower.makespan == pytest.approx(without.makespan + 3)


def _without_stage_ops(instrs: tuple[Instr, ...]) -> tuple[Instr, ...]:
    kept = [k for k, instr in enumerate(instrs) if type(instr) is not StageOp]
    index = {old: new for new, old in enumerate(kept)}
    return tuple(
        Wait(tuple(index[t] for t in i.ops), i.span) if type(i) is Wait else i
        for i in (instrs[k] for k in kept)
    )


def test_sched_programs_hold_none() -> None:
    for schedule in bundled_schedules():
        text = json_program.dumps(compile_bundled(schedule, 4, 8))
        ops = {i["op"] for rank in json.loads(text)["programs"] for i in rank}
        assert not ops & {"UNSHARD", "RESHARD", "REDUCE_GRAD"}


def test_format_notes(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "zb.csv"
    path.write_text(comms_csv("zb_h1", 2, 4))
    code, out, err = run_cli(capsys, "compile", str(path), "--format", "text")
    assert code == 0 and "UNSHARD" not in out
    assert "note: the text grid shows compute ops only" in err
    code, out, err = run_cli(capsys, "compile", str(path), "--format", "torch-csv")
    assert code == 0 and "UNSHARD" not in out
    assert "torch adds its own when it lowers the file" in err
    code, out, err = run_cli(capsys, "compile", str(path), "--format", "listing")
    assert code == 0 and "UNSHARD stage 0" in out and not err


@pytest.mark.parametrize("cell", ["0UNSHARD3", "0RESHARD0", "0REDUCE_GRAD12"])
def test_stage_action_with_a_microbatch_is_refused_at_the_cell(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, cell: str
) -> None:
    # it named no microbatch to torch's runtime, and pipecc took its number for the largest
    # microbatch: M grew and every real microbatch was reported missing its ops
    rows = comms_csv("1f1b", 2, 2).splitlines()
    kind = cell.rstrip("0123456789")[1:]
    rows[0] = rows[0].replace(f"0{kind}", cell, 1)
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(rows) + "\n")
    col = rows[0].split(",").index(cell)
    col = 1 + sum(len(c) + 1 for c in rows[0].split(",")[:col])
    for command in ("verify", "simulate", "compile"):
        code, out, err = run_cli(capsys, command, str(path))
        # verify gives the unusable input its line in the report, beside any others
        line = f"{path}: cannot use this input (input): " if command == "verify" else ""
        assert code == 2 and out.startswith(line) and out.count("\n") == (command == "verify")
        assert err.startswith(
            f"{path}:1:{col}: error: {cell!r}: {kind} acts on a whole stage and takes no "
            "microbatch number"
        ), err


def test_a_stage_action_cost_on_a_program_without_them_is_noted(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # a .sched program (or a compute-only CSV under pipecc's lowering) holds no stage
    # actions: the cost added nothing to the makespan, without a word
    code, _, err = run_cli(
        capsys, "simulate", "zb_h1", "-P", "2", "-M", "4", "--cost", "REDUCE_GRAD=3"
    )
    assert code == 0
    assert (
        "note: the costs name UNSHARD, RESHARD or REDUCE_GRAD, and this program holds none" in err
    )
    path = tmp_path / "zb.csv"
    path.write_text(comms_csv("zb_h1", 2, 4))
    code, _, err = run_cli(capsys, "simulate", str(path), "--cost", "REDUCE_GRAD=3")
    assert code == 0 and "note:" not in err
