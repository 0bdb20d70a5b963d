"""The program writer formats computes, sends, receives and waits directly: each line is
exactly what `json.dumps` writes for the instruction's dict (the same bytes as before)."""

from __future__ import annotations

import json

import pytest
from helpers import compile_bundled

from pipecc.api import compile_schedule
from pipecc.diagnostics import Span
from pipecc.driver.mesh import MeshOptions, place_mesh
from pipecc.interop.json_write import instr_to_dict, instr_to_json
from pipecc.ir.ops import Collective, Compute, Kind, Msg, Recv, Send, Wait
from pipecc.passes.expand_mesh import expand_mesh


@pytest.mark.parametrize(
    ("schedule", "ranks", "microbatches"),
    [("dualpipe", 4, 8), ("zbv", 3, 4), ("interleaved_1f1b", 2, 4), ("zb_h1", 3, 5)],
)
def test_each_line_is_what_json_dumps_writes(schedule: str, ranks: int, microbatches: int) -> None:
    program = compile_bundled(schedule, ranks, microbatches)
    instrs = [instr for rank in program.ranks for instr in rank]
    assert any(instr.span is not None for instr in instrs), "with a line and a column"
    for instr in instrs:
        assert instr_to_json(instr) == json.dumps(instr_to_dict(instr)), instr


def test_groups_spans_and_empty_waits_are_written_as_json_dumps_does() -> None:
    span = Span(None, 12, 3)
    instrs = [
        Compute(Kind.W, 1, 1, 5, 130, span),
        Send(Msg.GRAD, 3, 1, 0, 7, 42, span),
        Recv(Msg.ACT, 0, 0, 2, 9, None),
        Wait((), None),
        Wait((0, 17, 2048), span),
    ]
    for instr in instrs:
        assert instr_to_json(instr) == json.dumps(instr_to_dict(instr)), instr


def test_a_mesh_programs_lines_are_what_json_dumps_writes() -> None:
    base = compile_schedule("1f1b", ranks=2, microbatches=4)
    program = expand_mesh(place_mesh(base, MeshOptions("dp_replicate=2")))
    assert any(type(instr) is Collective for rank in program.ranks for instr in rank)
    for instr in (instr for rank in program.ranks for instr in rank):
        assert instr_to_json(instr) == json.dumps(instr_to_dict(instr)), instr
