"""The JSON contract (DESIGN §4): round trip, determinism, schema, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import ROOT, compile_bundled

from pipecc.diagnostics import InputError
from pipecc.interop import json_program

SCHEMA = ROOT / "docs" / "program.schema.json"


@pytest.mark.parametrize(
    ("schedule", "ranks", "microbatches"),
    [("dualpipe", 4, 8), ("zbv", 3, 4), ("interleaved_1f1b", 2, 4), ("zb_h1", 3, 5)],
)
def test_round_trip_is_equal(schedule: str, ranks: int, microbatches: int) -> None:
    program = compile_bundled(schedule, ranks, microbatches)
    text = json_program.dumps(program)
    again = json_program.loads(text, "p.json")
    assert again == program
    assert json_program.dumps(again) == text  # same bytes after a round trip


def test_contract_fields() -> None:
    data = json.loads(json_program.dumps(compile_bundled("dualpipe", 4, 8)))
    assert data["format"] == "pipecc.program/1"
    assert (data["ranks"], data["microbatches"], data["schedule"]) == (4, 8, "dualpipe")
    assert data["placement"][0] == {"rank": 0, "chunk": 0, "pipe": 0, "stage": 0}
    ops = {entry["op"] for rank in data["programs"] for entry in rank}
    assert ops == {"F", "B", "I", "W", "F&B", "send", "recv", "wait"}
    send = next(e for e in data["programs"][1] if e["op"] == "send")
    assert set(send) >= {"op", "what", "peer", "pipe", "stage", "mb", "group"}
    fused = next(e for e in data["programs"][1] if e["op"] == "F&B")
    assert set(fused["f"]) == {"op", "chunk", "pipe", "stage", "mb"}


def test_schema_validates_output() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text())
    for name, ranks, microbatches in (("dualpipe", 4, 8), ("zbv", 2, 3)):
        data = json.loads(json_program.dumps(compile_bundled(name, ranks, microbatches)))
        jsonschema.validate(data, schema)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d.update(format="other/1"),
            'p.json: format: expected "pipecc.program/1", got "other/1"',
        ),
        (
            lambda d: d["programs"][1].__setitem__(2, {"op": "F", "chunk": 0}),
            "p.json: programs[1][2]: missing field 'pipe'",
        ),
        (
            lambda d: d["programs"][0].__setitem__(0, {"op": "X"}),
            'p.json: programs[0][0]: unknown op "X" (expected F, B, I, W, F&B, F&I, OVERLAP_F_B, '
            "send, recv, wait, UNSHARD, RESHARD or REDUCE_GRAD)",
        ),
        (
            lambda d: d["programs"][0][1].__setitem__("mb", -1),
            "p.json: programs[0][1]: field 'mb' must be an integer ≥ 0, got -1",
        ),
        (
            lambda d: d.__setitem__("programs", d["programs"][:1]),
            "p.json: programs: has 1 rank lists, header says 2",
        ),
    ],
)
def test_malformed_program_names_rank_and_index(edit, message: str) -> None:  # type: ignore[no-untyped-def]
    assert _refusal(edit, "1f1b") == f"error: {message}"


def _refusal(edit, schedule: str) -> str:  # type: ignore[no-untyped-def]
    """The reader's error on the JSON of `schedule` (P=2; M=2 for 1f1b, else 4) after `edit`."""
    data = json.loads(
        json_program.dumps(compile_bundled(schedule, 2, 2 if schedule == "1f1b" else 4))
    )
    edit(data)
    with pytest.raises(InputError) as info:
        json_program.loads(json.dumps(data), "p.json")
    return str(info.value)


def test_malformed_json_gives_position(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"p.json:1:2: malformed JSON"):
        json_program.loads("{oops", "p.json")


def _first(data: dict, op: str) -> dict:  # type: ignore[type-arg]
    return next(i for rank in data["programs"] for i in rank if i["op"] == op)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (  # torch's sequential OVERLAP_F_B has its own shape; F&B stays overlapped
            lambda d: _first(d, "F&B").__setitem__("sequential", True),
            "field 'sequential' belongs to OVERLAP_F_B (its sub-actions in 'ops', run in the "
            "order written); an F&B is an overlapped forward and backward and has none",
        ),
        (  # a stage action acts on a whole stage
            lambda d: d["programs"][0].insert(0, {**_stage_op(), "mb": 3}),
            "field 'mb': UNSHARD acts on a whole stage and takes no microbatch",
        ),
    ],
)
def test_a_field_the_new_ops_do_not_have_is_refused(edit, message: str) -> None:  # type: ignore[no-untyped-def]
    assert message in _refusal(edit, "dualpipev")


def _stage_op() -> dict:  # type: ignore[type-arg]
    return {"op": "UNSHARD", "chunk": 0, "pipe": 0, "stage": 0}
