"""Writing a compiled program as JSON (pipecc/interop/json_program.py: the format and its
reader). `dumps` gives the same bytes as one `json.dumps` per instruction, with the common
instructions (computes, sends, receives, waits: almost all of a large program) formatted
directly, as `json.dumps` would, for speed."""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any

from pipecc.diagnostics import Span
from pipecc.ir.ops import (
    Collective,
    Compute,
    Fused,
    Instr,
    Kind,
    Msg,
    Phase,
    Recv,
    Send,
    Sequential,
    StageOp,
    Wait,
)
from pipecc.ir.program import Program

FORMAT = "pipecc.program/1"
RECOMPUTE = "full"  # the one mode a program names: the stage's whole forward again
# the enums' values, looked up by member (`.value` is a property, slow over 10⁶ instructions)
_KIND = MappingProxyType({kind: kind.value for kind in Kind})
_MSG = MappingProxyType({msg: msg.value for msg in Msg})


def dumps(program: Program) -> str:
    """The program as JSON text (deterministic)."""
    header: dict[str, Any] = {
        "format": FORMAT,
        "schedule": program.schedule,
        "source": program.source,
        "ranks": program.num_ranks,
        "microbatches": program.num_microbatches,
        "params": dict(program.params),
        "comm": program.comm,
        "placement_name": program.placement.name,
        "placement": [
            {"rank": s.rank, "chunk": s.chunk, "pipe": s.pipe, "stage": s.stage}
            for s in program.placement.slots
        ],
    }
    if program.mesh is not None:  # absent: a pipeline on its own
        header["mesh"] = program.mesh.to_dict()
    if program.moe is not None:  # absent: no MoE layers (pipecc/passes/expand_moe.py)
        header["moe"] = list(program.moe)
    if program.recompute:  # absent: no stage recomputed
        header["recompute"] = [{"stage": s, "mode": RECOMPUTE} for s in program.recompute]
    lines = ["{"]
    for key, value in header.items():
        lines.append(f"  {json.dumps(key)}: {json.dumps(value)},")
    lines.append('  "programs": [')
    for rank, instrs in enumerate(program.ranks):
        lines.append("    [")
        if instrs:
            lines.append("      " + ",\n      ".join([instr_to_json(instr) for instr in instrs]))
        lines.append("    ]" + ("," if rank + 1 < program.num_ranks else ""))
    lines.append("  ]")
    lines.append("}")
    return "\n".join(line for line in lines if line) + "\n"


def _compute_dict(op: Compute) -> dict[str, Any]:
    return {"op": op.kind.value, "chunk": op.chunk, "pipe": op.pipe, "stage": op.stage, "mb": op.mb}


def _with_span(entry: dict[str, Any], span: Span | None) -> dict[str, Any]:
    if span is not None:
        entry["line"] = span.line
        entry["col"] = span.col
    return entry


def _collective_dict(op: Collective) -> dict[str, Any]:
    entry: dict[str, Any] = {"op": "collective", "kind": op.kind.value, "ranks": list(op.ranks)}
    entry["what"] = op.what
    if op.asynchronous:  # absent: blocking (DESIGN §4)
        entry["async"] = True
    if op.dims:  # absent: `ranks` are the members (docs/parallelism.md)
        entry["dims"] = list(op.dims)
    if op.stages:
        entry["stages"] = list(op.stages)
    if op.shards != 1:
        entry["shards"] = op.shards
    return entry


def instr_to_dict(instr: Instr) -> dict[str, Any]:
    """One instruction in its JSON form."""
    match instr:
        case Compute():
            return _with_span(_compute_dict(instr), instr.span)
        case Fused(forward=f, backward=b):
            name = f"F&{b.kind.value}"
            return _with_span(
                {"op": name, "f": _compute_dict(f), "b": _compute_dict(b)}, instr.span
            )
        case Phase(op=op, layer=layer, part=part):  # one part of a MoE stage's F, B or I
            entry = {"op": "phase", "of": _compute_dict(op), "layer": layer, "part": part.value}
            return _with_span(entry, instr.span)
        case Sequential(parts=parts):  # torch's OVERLAP_F_B: the parts run in this order
            ops = [_compute_dict(op) for op in parts]
            return _with_span({"op": "OVERLAP_F_B", "sequential": True, "ops": ops}, instr.span)
        case Send() | Recv():
            entry = {
                "op": "send" if type(instr) is Send else "recv",
                "what": instr.what.value,
                "peer": instr.peer,
                "pipe": instr.pipe,
                "stage": instr.stage,
                "mb": instr.mb,
                "group": instr.group,
            }
            return _with_span(entry, instr.span)
        case Wait():
            return _with_span({"op": "wait", "ops": list(instr.ops)}, instr.span)
        case StageOp(kind=kind, chunk=chunk, pipe=pipe, stage=stage):
            entry = {"op": kind.value, "chunk": chunk, "pipe": pipe, "stage": stage}
            return _with_span(entry, instr.span)
        case Collective():
            return _with_span(_collective_dict(instr), instr.span)
        case _:
            raise AssertionError(f"unknown instruction {instr!r}")


def instr_to_json(instr: Instr) -> str:
    """`json.dumps(instr_to_dict(instr))`, formatted directly for a send, receive, wait,
    compute or F&B / F&I (their fields are ints, None and enum values of plain letters,
    which `json.dumps` writes as `str` does; tests/interop/test_json_write.py compares the
    two): a large program is almost only these."""
    span: Span | None
    if type(instr) is Send or type(instr) is Recv:
        what, peer, pipe, stage, mb, group, span = instr
        name = "send" if type(instr) is Send else "recv"
        text = (
            f'{{"op": "{name}", "what": "{_MSG[what]}", "peer": {peer}, "pipe": {pipe}, '
            f'"stage": {stage}, "mb": {mb}, "group": {"null" if group is None else group}'
        )
    elif type(instr) is Wait:
        ops, span = instr
        text = '{"op": "wait", "ops": [' + ", ".join(map(str, ops)) + "]"
    elif type(instr) is Fused:
        forward, backward, span = instr
        text = (
            f'{{"op": "F&{_KIND[backward.kind]}", "f": {_compute_json(forward)}, '
            f'"b": {_compute_json(backward)}'
        )
    elif type(instr) is Compute:
        span = instr.span
        text = _compute_json(instr)[:-1]
    else:
        return json.dumps(instr_to_dict(instr))
    if span is not None:
        text += f', "line": {span.line}, "col": {span.col}'
    return text + "}"


def _compute_json(op: Compute) -> str:
    """`json.dumps(_compute_dict(op))`."""
    kind, chunk, pipe, stage, mb, _ = op
    return (
        f'{{"op": "{_KIND[kind]}", "chunk": {chunk}, "pipe": {pipe}, "stage": {stage}, "mb": {mb}}}'
    )
