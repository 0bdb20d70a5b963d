"""The MoE vocabulary of the IR (issue 33, /docs/parallelism.md Expert parallelism): the `ep`
mesh dimension, the all-to-all collective kind, and `Phase`: labels, the order of an op's
phases, which phase completes its op, and the JSON form (round trip, schema, errors)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from helpers import ROOT, compile_bundled

from pipecc.diagnostics import InputError
from pipecc.interop import json_program
from pipecc.ir.mesh import DIMS, parse_mesh
from pipecc.ir.ops import (
    Collective,
    CollectiveKind,
    Compute,
    Kind,
    Phase,
    PhasePart,
    computations,
    is_compute,
    phases,
)
from pipecc.ir.printer import describe

F = Compute(Kind.F, 0, 0, 1, 3)
B = Compute(Kind.B, 1, 0, 2, 2)


def test_ep_sits_after_dp_shard_and_before_cp() -> None:
    assert DIMS == ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
    mesh = parse_mesh("pp=2,ep=2")
    assert (mesh.world, mesh.pipelines, mesh.describe()) == (4, 2, "pp=2,ep=2")
    assert mesh.group(1, ("ep",)) == (0, 1)
    assert parse_mesh("pp=2,dp_shard=2,ep=2").group(5, ("ep",)) == (4, 5)


def test_phase_labels_and_long_form() -> None:
    assert Phase(F, 1, PhasePart.PRE).label() == "F0.3:pre1"
    assert Phase(F, 1, PhasePart.EXPERTS).label() == "F0.3:experts1"
    assert Phase(F, 2, PhasePart.POST).label() == "F0.3:post"
    assert Phase(B, 0, PhasePart.EXPERTS).label() == "B1.2:experts0"
    assert describe(Phase(B, 0, PhasePart.EXPERTS), places=True) == (
        "B1.2:experts0 (pipe 0 stage 2 mb 2)"
    )
    assert is_compute(Phase(F, 0, PhasePart.PRE))


def test_an_ops_phases_run_forward_in_order_and_backward_reversed() -> None:
    labels = [p.label() for p in phases(F, 2)]
    assert labels == ["F0.3:pre0", "F0.3:experts0", "F0.3:pre1", "F0.3:experts1", "F0.3:post"]
    labels = [p.label() for p in phases(B, 2)]
    assert labels == ["B1.2:post", "B1.2:experts1", "B1.2:pre1", "B1.2:experts0", "B1.2:pre0"]
    assert phases(Compute(Kind.W, 0, 0, 0, 0), 2) == ()
    assert phases(F, 0) == ()


@pytest.mark.parametrize("op", [F, B, Compute(Kind.I, 0, 0, 0, 0)])
def test_only_the_last_phase_completes_its_op(op: Compute) -> None:
    found = phases(op, 3)
    assert [p.is_first for p in found] == [True] + [False] * (len(found) - 1)
    assert [p.is_last for p in found] == [False] * (len(found) - 1) + [True]
    assert [computations(p) for p in found] == [()] * (len(found) - 1) + [(op,)]


def test_phase_equality_ignores_the_span_and_the_class() -> None:
    assert Phase(F, 0, PhasePart.PRE) == Phase(F, 0, PhasePart.PRE, None)
    assert Phase(F, 0, PhasePart.PRE) != Phase(F, 0, PhasePart.EXPERTS)
    assert hash(Phase(F, 0, PhasePart.PRE)) != hash(F)


def test_phases_and_all_to_alls_round_trip_and_validate() -> None:
    program = compile_bundled("1f1b", 2, 2)
    a2a = Collective(CollectiveKind.ALL_TO_ALL, (0,), "dispatch L0 F0.0", True, ("ep",), (0,))
    ranks = (tuple(phases(Compute(Kind.F, 0, 0, 0, 0), 1)) + (a2a,) + program.ranks[0],)
    program = replace(program, ranks=ranks + program.ranks[1:], moe=(1, 1))
    text = json_program.dumps(program)
    data = json.loads(text)
    assert data["moe"] == [1, 1]
    assert data["programs"][0][0] == {
        "op": "phase",
        "of": {"op": "F", "chunk": 0, "pipe": 0, "stage": 0, "mb": 0},
        "layer": 0,
        "part": "pre",
    }
    assert data["programs"][0][3] == {
        "op": "collective",
        "kind": "all_to_all",
        "ranks": [0],
        "what": "dispatch L0 F0.0",
        "async": True,
        "dims": ["ep"],
        "stages": [0],
    }
    assert json_program.read(text, "p.json") == (program, ())
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(data, json.loads((ROOT / "docs" / "program.schema.json").read_text()))


@pytest.mark.parametrize(
    ("entry", "moe", "message"),
    [
        (
            {"op": "phase", "of": {"op": "W", "chunk": 0, "pipe": 0, "stage": 0, "mb": 0},
             "layer": 0, "part": "pre"},
            None,
            "error: p.json: programs[0][0]: a phase is part of an F, B or I; a W is not split",
        ),
        (
            {"op": "phase", "of": {"op": "F", "chunk": 0, "pipe": 0, "stage": 0, "mb": 0},
             "layer": 0, "part": "middle"},
            None,
            "error: p.json: programs[0][0]: field 'part' must be one of pre, experts, post, got "
            '"middle"',
        ),
        (None, [1],
         "error: p.json: moe: expected a list of 2 layer counts ≥ 0 (one per stage), got [1]"),
    ],
)  # fmt: skip
def test_malformed_phases_are_refused(
    entry: dict[str, object] | None, moe: list[int] | None, message: str
) -> None:
    data = json.loads(json_program.dumps(compile_bundled("1f1b", 2, 2)))
    if entry is not None:
        data["programs"][0].insert(0, entry)
    if moe is not None:
        data["moe"] = moe
    with pytest.raises(InputError) as err:
        json_program.loads(json.dumps(data), "p.json")
    assert str(err.value) == message
