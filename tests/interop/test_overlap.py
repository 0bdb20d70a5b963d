"""torch's OVERLAP_F_B as torch runs it: any non-empty list of sub-actions, in the order
written, read as one sequential instruction (`Sequential`), written back in that order,
simulated as the sum of its parts, with memory applied part by part. A .sched file's F&B
keeps its meaning and its JSON shape."""

from __future__ import annotations

import json

import pytest
from csv_mutants import OVERLAPS, merge
from helpers import compile_bundled, run_cli

from pipecc.interop import json_program, torch_csv
from pipecc.ir.ops import Fused, Sequential
from pipecc.semantics.costs import parse_cost_flag
from pipecc.simulate.timeline import simulate
from pipecc.verify import ALL_MODELS, Options, verify


def overlap_csv(name: str) -> str:
    schedule, ranks, microbatches, rank, start, count = OVERLAPS[name]
    text = torch_csv.dumps(compile_bundled(schedule, ranks, microbatches))
    return merge(text, rank, start, count)


def sequentials(text: str) -> list[Sequential]:
    program = torch_csv.loads(text).program
    return [i for instrs in program.ranks for i in instrs if type(i) is Sequential]


@pytest.mark.parametrize("name", sorted(OVERLAPS))
def test_read_in_order_and_written_back(name: str) -> None:
    text = overlap_csv(name)
    (seq,) = sequentials(text)
    cell = next(c for c in text.split("\n")[0].split(",") if c.startswith("("))
    assert "(" + ";".join(f"{p.stage}{p.kind.value}{p.mb}" for p in seq.parts) + ")" in cell
    program = torch_csv.loads(text).program
    assert torch_csv.dumps(program) == text
    again = json_program.loads(json_program.dumps(program))
    assert again.ranks == program.ranks
    assert torch_csv.dumps(again) == text
    entry = next(
        i
        for i in json.loads(json_program.dumps(program))["programs"][0]
        if i["op"] == "OVERLAP_F_B"
    )
    assert entry["sequential"] is True and len(entry["ops"]) == len(seq.parts)


@pytest.mark.parametrize("name", sorted(OVERLAPS))
def test_verified_and_lowered(name: str, capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "overlap.csv"
    path.write_text(overlap_csv(name))
    for lowering in ("pipecc", "torch", "torch-defer"):
        code, out, _ = run_cli(capsys, "verify", str(path), "--lowering", lowering, "--comm", "all")
        assert code == 0 or lowering == "torch-defer", out
    code, out, _ = run_cli(capsys, "compile", str(path), "--format", "torch-csv-comms")
    assert code == 0 and next(c for c in overlap_csv(name).split(",") if "OVERLAP" in c) in out


def test_duration_is_the_sum_of_the_parts() -> None:
    text = overlap_csv("I;W;F")
    program = torch_csv.loads(text).program
    costs = parse_cost_flag("F=1,I=2,W=3")
    timeline = simulate(program, costs)
    (entry,) = [e for e in timeline.ops() if type(e[2]) is Sequential]
    assert entry[4] - entry[3] == pytest.approx(2 + 3 + 1)
    assert "(I0.1;W0.1;F0.3)" in {e[2].label() for e in timeline.ops()}


def test_memory_is_applied_in_the_order_written() -> None:
    # 1f1b P=2 M=4 rank 0 after 0F0 0F1: B then F frees before it allocates (peak 2);
    # F then B allocates first (peak 3), like a .sched F&B
    backward_first = overlap_csv("B;F")
    forward_first = backward_first.replace("(0B0;0F2)", "(0F2;0B0)")
    peaks = [
        verify(torch_csv.loads(t).program).peaks[0].peak for t in (backward_first, forward_first)
    ]
    assert peaks == [2, 3]
    timeline = simulate(torch_csv.loads(backward_first).program, parse_cost_flag("F=1"))
    assert timeline.ranks[0].peak_activations == 2


def test_sched_fused_ops_keep_their_meaning_and_shape() -> None:
    program = compile_bundled("dualpipev", 2, 4)
    assert any(type(i) is Fused for i in program.ranks[0])
    assert not any(type(i) is Sequential for r in program.ranks for i in r)
    entries = [i for i in json.loads(json_program.dumps(program))["programs"][0] if "&" in i["op"]]
    assert entries and all(set(e) >= {"f", "b"} and "sequential" not in e for e in entries)
    report = verify(program, Options(models=ALL_MODELS))
    assert report.ok


def test_an_overlap_of_non_compute_actions_is_bad_input(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "bad.csv"
    path.write_text("(0F0;0SEND_F0)OVERLAP_F_B,0B0\n1F0,1B0\n")
    code, _, err = run_cli(capsys, "verify", str(path))
    assert code == 2
    assert "an OVERLAP_F_B cell holds only F, B, I and W actions" in err


def test_schema_validates_stage_ops_and_sequential_ops() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from helpers import ROOT

    schema = json.loads((ROOT / "docs" / "program.schema.json").read_text())
    text = overlap_csv("I;W;F")
    program = torch_csv.loads(text).program
    comms = torch_csv.loads(torch_csv.dumps(program, with_comms=True)).program
    data = json.loads(json_program.dumps(comms))
    ops = {i["op"] for rank in data["programs"] for i in rank}
    assert {"OVERLAP_F_B", "UNSHARD", "RESHARD", "REDUCE_GRAD"} <= ops
    jsonschema.validate(data, schema)
    data["programs"][0][0] = {"op": "OVERLAP_F_B", "sequential": True, "ops": []}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, schema)
