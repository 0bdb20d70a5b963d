"""The program's `recompute` field (issue 21): the stages recomputed round-trip through the
JSON format, validate against the schema, survive the comm lowering, and malformed entries
are refused (exit 2 with the field's path)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
from helpers import compile_bundled

from pipecc.diagnostics import InputError
from pipecc.interop import json_program
from pipecc.passes.insert_comms import insert_comms, strip_comms

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "docs" / "program.schema.json"


def test_recompute_round_trips_and_validates() -> None:
    program = replace(compile_bundled("zb_h1", 2, 4), recompute=(1,))
    text = json_program.dumps(program)
    data = json.loads(text)
    assert data["recompute"] == [{"stage": 1, "mode": "full"}]
    jsonschema.validate(data, json.loads(SCHEMA.read_text()))
    assert json_program.loads(text) == program
    plain = json.loads(json_program.dumps(compile_bundled("zb_h1", 2, 4)))
    assert "recompute" not in plain  # absent: none (programs written before stay the same)
    assert insert_comms(strip_comms(program)).recompute == (1,)


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([{"stage": 2, "mode": "full"}], "recompute[0]: stage 2: the placement has stages 0..1"),
        ([{"stage": 0, "mode": "selective"}], "recompute[0]: field 'mode' must be \"full\""),
        ([{"stage": 0, "mode": "full"}, {"stage": 0, "mode": "full"}], "named twice"),
        ([{"mode": "full"}], "recompute[0]: missing field 'stage'"),
        ({"0": "full"}, "recompute: expected a list"),
    ],
)
def test_a_malformed_recompute_is_refused(entries: object, message: str) -> None:
    data = json.loads(json_program.dumps(compile_bundled("zb_h1", 2, 4)))
    data["recompute"] = entries
    with pytest.raises(InputError) as found:
        json_program.loads(json.dumps(data), "p.json")
    assert message in str(found.value)
