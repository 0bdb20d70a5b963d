"""The JSON program on a mesh (DESIGN §4, docs/parallelism.md): the `mesh` header field and a
collective's `dims`, `stages` and `shards` round-trip, validate against the schema, and
malformed ones are refused with the field named."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from helpers import ROOT, compile_bundled

from pipecc.diagnostics import InputError
from pipecc.driver.mesh import MeshOptions, place_mesh
from pipecc.interop import json_program
from pipecc.ir.ops import Collective
from pipecc.ir.program import Program
from pipecc.passes.expand_mesh import expand_mesh

SCHEMA = ROOT / "docs" / "program.schema.json"


def _mesh_program(text: str = "dp_replicate=2,dp_shard=2") -> Program:
    return place_mesh(compile_bundled("zbv", 2, 4), MeshOptions(text))


@pytest.mark.parametrize("whole", [False, True])
def test_a_mesh_program_round_trips_and_validates(whole: bool) -> None:
    program = _mesh_program()
    if whole:
        program = expand_mesh(program)
    text = json_program.dumps(program)
    data = json.loads(text)
    assert data["mesh"] == {"pp": 2, "dp_replicate": 2, "dp_shard": 2}
    reductions = [e for e in data["programs"][0] if e.get("what", "").startswith("dp-grad")]
    assert reductions and all(e["shards"] == 2 and len(e["stages"]) == 1 for e in reductions)
    assert all(("dims" in e) is not whole for e in reductions)
    again, notes = json_program.read(text, "p.json")
    assert again == program and notes == ()
    assert json_program.dumps(again) == text
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(data, json.loads(SCHEMA.read_text()))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d.update(mesh={"pp": 2, "dp": 2}),
            "mesh: expected an object of sizes ≥ 1 named pp, dp_replicate, dp_shard, ep, cp, tp, "
            'got {"pp": 2, "dp": 2}',
        ),
        (
            lambda d: d.update(mesh={"pp": 3, "dp_replicate": 2}),
            "mesh: pp=3,dp_replicate=2 has pp=3 and 6 ranks in all, but the program has 2 rank "
            "lists (a pipeline's program has pp, the whole mesh's one per global rank)",
        ),
        (
            lambda d: d["programs"][0][-2].update(dims="dp_replicate"),
            "field 'dims' must be a list of mesh dimensions, got \"dp_replicate\"",
        ),
    ],
)
def test_malformed_mesh_fields_are_refused(
    edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    data = json.loads(json_program.dumps(_mesh_program("dp_replicate=2")))
    data["programs"][0][-2] = next(
        e for e in data["programs"][0] if e.get("what", "").startswith("dp-grad")
    )
    edit(data)
    with pytest.raises(InputError) as err:
        json_program.loads(json.dumps(data), "p.json")
    assert message in str(err.value)


def test_dims_outside_the_mesh_are_refused_before_the_replay() -> None:
    program = _mesh_program("dp_replicate=2")
    ranks = list(program.ranks)
    at, op = next((i, x) for i, x in enumerate(ranks[0]) if type(x) is Collective)
    assert type(op) is Collective
    ranks[0] = (*ranks[0][:at], op._replace(dims=("pp",)), *ranks[0][at + 1 :])
    with pytest.raises(
        InputError, match=r"rank 0 @\d+: collective 'dp-grad s\d' spans dims \['pp'\]"
    ):
        expand_mesh(replace(program, ranks=tuple(ranks)))
