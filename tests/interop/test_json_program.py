"""The JSON contract (DESIGN §4): round trip, determinism, schema, clear errors."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import ROOT, SCHEDULES, compile_bundled

from pipecc.diagnostics import InputError
from pipecc.interop import json_program
from pipecc.ir.ops import Collective, CollectiveKind, Compute, Sequential, StageAction, StageOp
from pipecc.ir.program import Program

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
    assert ops == {"F", "B", "I", "W", "F&B", "send", "recv", "wait", "collective"}
    # DualPipe's duplicated stages: ranks 0 and 3 both hold stages 0 and 3, and sum them
    assert data["programs"][0][-1] == {
        "op": "collective",
        "kind": "all_reduce",
        "ranks": [0, 3],
        "what": "grad-sum s0+s3",
    }
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
    for program in _every_instruction_kind()[-1:]:  # an async collective of every kind's form
        jsonschema.validate(json.loads(json_program.dumps(program)), schema)


@pytest.mark.parametrize("kind", list(CollectiveKind))
@pytest.mark.parametrize("asynchronous", [False, True])
def test_collectives_round_trip(kind: CollectiveKind, asynchronous: bool) -> None:
    """Every kind, blocking or async (`"async": true`, absent when blocking), reads back equal
    and writes the same bytes again."""
    base = compile_bundled("1f1b", 2, 2)
    op = Collective(kind, (0, 1), "grad-sum s0+s1", asynchronous)
    program = replace(base, ranks=tuple(instrs + (op,) for instrs in base.ranks))
    text = json_program.dumps(program)
    entry = json.loads(text)["programs"][0][-1]
    assert entry.get("async", False) is asynchronous and ("async" in entry) is asynchronous
    again, notes = json_program.read(text, "p.json")
    assert again == program and notes == ()
    assert json_program.dumps(again) == text


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"kind": "all_sum"}, "field 'kind' must be one of all_reduce, all_gather, "),
        ({"ranks": []}, "field 'ranks' must be a non-empty list of ranks, got []"),
        ({"ranks": [0, -1]}, "field 'ranks' must be a non-empty list of ranks, got [0, -1]"),
        ({"what": 3}, "field 'what' must be a string, got 3"),
        ({"async": "yes"}, "field 'async' must be true or false, got \"yes\""),
    ],
)
def test_a_malformed_collective_is_refused(entry: dict, message: str) -> None:  # type: ignore[type-arg]
    op = {"op": "collective", "kind": "all_reduce", "ranks": [0, 1], "what": "x", **entry}
    error = _refusal(lambda d: d["programs"][0].append(op), "1f1b")
    assert error.startswith("error: p.json: programs[0][")
    assert message in error, error


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
            "phase, send, recv, wait, collective, UNSHARD, RESHARD or REDUCE_GRAD)",
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
    with pytest.raises(InputError, match=r"p.json:1:2: error: malformed JSON") as info:
        json_program.loads("{oops", "p.json")
    span = info.value.span  # a location of its own, for --format github's annotation
    assert span is not None and (span.file, span.line, span.col) == ("p.json", 1, 2)


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


def _every_instruction_kind() -> list[Program]:
    """Programs that hold every instruction the writer writes: each bundled schedule, and
    one with torch's OVERLAP_F_B and a stage action added (the reader does not check order)."""
    programs = [compile_bundled(path.stem, 2, 4) for path in sorted(SCHEDULES.glob("*.sched"))]
    base = programs[0]
    computes = [i for i in base.ranks[0] if type(i) is Compute]
    f, b = computes[0], computes[-1]
    extra = (
        StageOp(StageAction.UNSHARD, 0, 0, 0, None),
        Sequential((f, b), None),
        Collective(CollectiveKind.BROADCAST, (0, 1), "x", True),  # the optional field
    )
    programs.append(replace(base, ranks=(base.ranks[0] + extra, *base.ranks[1:])))
    return programs


def test_the_reader_knows_every_field_the_writer_writes() -> None:
    """No note for what pipecc wrote itself: a field added to the writer but not taught to
    the reader would be reported as unknown."""
    for program in _every_instruction_kind():
        again, notes = json_program.read(json_program.dumps(program), "p.json")
        assert again == program
        assert notes == (), (program.schedule, notes)


def test_fields_the_reader_does_not_know_are_named_not_dropped() -> None:
    """The format lets a later version add fields, so an unknown one is read past, and it
    is named in a note: in the header, in an op, inside a fused op, in the placement."""
    data = json.loads(json_program.dumps(compile_bundled("dualpipe", 2, 4)))
    data["producer"] = "a tool"
    send = _first(data, "send")
    send["gruop"] = send.pop("group")  # a typo: the send is read as posted alone
    _first(data, "F&B")["f"]["shape"] = [4, 8]
    data["placement"][1]["device"] = "cuda:1"
    program, notes = json_program.read(json.dumps(data), "p.json")
    assert program.num_ranks == 2
    (note,) = notes
    assert note.startswith("p.json: ignored 4 field(s) this version of pipecc does not know: ")
    for path in ("producer", ".gruop", ".f.shape", "placement[1].device"):
        assert path in note, (path, note)
    for rank in data["programs"]:
        for entry in rank:
            entry["x"] = 1
    total = 4 + sum(len(rank) for rank in data["programs"])
    (note,) = json_program.read(json.dumps(data), "p.json")[1]
    assert f"ignored {total} field(s)" in note
    assert note.endswith(f" and {total - json_program.SHOWN_UNKNOWN} more")


def test_the_python_api_warns_of_the_fields_it_ignored(tmp_path: Path) -> None:
    from pipecc.api import load_program

    data = json.loads(json_program.dumps(compile_bundled("1f1b", 2, 2)))
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a program pipecc wrote reads without a warning
        load_program(path)
    data["producer"] = "a tool"
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="ignored 1 field.*: producer"):
        assert load_program(path).num_ranks == 2
