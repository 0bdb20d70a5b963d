"""The compiled program as JSON: the contract of DESIGN §4 (schema: docs/program.schema.json).

`dumps` writes deterministic text (the same program gives the same bytes): the header fields,
then `programs`, one instruction per line. `loads` reads it back, checking every field and
naming the rank and instruction of anything malformed; `loads(dumps(p)) == p`.

Fields beyond the contract: `placement_name`, and `line`/`col` on instructions that came from a
.sched line (so the verifier can point at the source).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipecc.diagnostics import InputError, SourceFile, Span
from pipecc.interop.json_write import FORMAT, RECOMPUTE, dumps, instr_to_dict, instr_to_json
from pipecc.ir.mesh import DIMS, Mesh
from pipecc.ir.ops import (
    Collective,
    CollectiveKind,
    Compute,
    Fused,
    Instr,
    Kind,
    Msg,
    Phase,
    PhasePart,
    Recv,
    Send,
    Sequential,
    StageAction,
    StageOp,
    Wait,
)
from pipecc.ir.placement import Placement, PlacementError, StageSlot
from pipecc.ir.program import Program
from pipecc.passes.comm.placement import backend_of

__all__ = ["FORMAT", "dumps", "instr_to_dict", "instr_to_json", "loads", "read"]

# ---- reading -------------------------------------------------------------------------------


# The fields the reader knows, per object (what `dumps` writes, and a fused op's
# "sequential", which it refuses); tests/interop/test_json_program.py checks they agree.
SPAN = ("line", "col")
HEADER_FIELDS = frozenset(
    ("format", "schedule", "source", "ranks", "microbatches", "params", "comm",
     "placement_name", "placement", "programs", "mesh", "recompute", "moe")
)  # fmt: skip
RECOMPUTE_FIELDS = frozenset(("stage", "mode"))
PLACEMENT_FIELDS = frozenset(("rank", "chunk", "pipe", "stage"))
COMPUTE_FIELDS = frozenset(("op", "chunk", "pipe", "stage", "mb", *SPAN))
FUSED_FIELDS = frozenset(("op", "f", "b", *SPAN))
SEQUENTIAL_FIELDS = frozenset(("op", "sequential", "ops", *SPAN))
COMM_FIELDS = frozenset(("op", "what", "peer", "pipe", "stage", "mb", "group", *SPAN))
WAIT_FIELDS = frozenset(("op", "ops", *SPAN))
PHASE_FIELDS = frozenset(("op", "of", "layer", "part", *SPAN))
STAGE_OP_FIELDS = frozenset(("op", "chunk", "pipe", "stage", *SPAN))
COLLECTIVE_FIELDS = frozenset(
    ("op", "kind", "ranks", "what", "async", "dims", "stages", "shards", *SPAN)
)
SHOWN_UNKNOWN = 8  # unknown fields named in the note; the rest are counted


class _Reader:
    """Checks fields as it reads them; errors name the file and the JSON path. Fields it
    does not know are collected (`unknown`): the format lets a later version add fields,
    so they are not an error, but they are never dropped silently either."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.source: SourceFile | None = None
        self.unknown: list[str] = []

    def known(self, obj: dict[str, Any], where: str, fields: frozenset[str]) -> None:
        """Note the fields of `obj` outside `fields`."""
        for key in obj:
            if key not in fields:
                self.unknown.append(f"{where}.{key}" if where else str(key))

    def notes(self) -> tuple[str, ...]:
        if not self.unknown:
            return ()
        shown = ", ".join(self.unknown[:SHOWN_UNKNOWN])
        more = len(self.unknown) - SHOWN_UNKNOWN
        rest = f" and {more} more" if more > 0 else ""
        return (
            f"{self.path}: ignored {len(self.unknown)} field(s) this version of pipecc does "
            f"not know: {shown}{rest}",
        )

    def fail(self, where: str, message: str) -> InputError:
        return InputError(f"{self.path}: {where}: {message}")

    def field(
        self, obj: Any, key: str, where: str, check: Callable[[Any], bool], expected: str
    ) -> Any:
        if not isinstance(obj, dict):
            raise self.fail(where, "expected a JSON object")
        if key not in obj:
            raise self.fail(where, f"missing field '{key}'")
        value = obj[key]
        if not check(value):
            raise self.fail(where, f"field '{key}' must be {expected}, got {json.dumps(value)}")
        return value

    def integer(self, obj: Any, key: str, where: str, minimum: int = 0) -> int:
        return int(
            self.field(
                obj, key, where, lambda v: _is_int(v) and v >= minimum, f"an integer ≥ {minimum}"
            )
        )

    def span(self, obj: dict[str, Any]) -> Span | None:
        line, col = obj.get("line"), obj.get("col")
        if isinstance(line, int) and isinstance(col, int):
            return Span(self.source, line, col)
        return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def loads(text: str, path: str = "<program>") -> Program:
    """Read a program written by `dumps`; InputError (naming rank and index) if malformed."""
    return read(text, path)[0]


def read(text: str, path: str = "<program>") -> tuple[Program, tuple[str, ...]]:
    """`loads`, and the notes of the reading: the fields it did not know and ignored."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        where = Span(SourceFile(path, text), err.lineno, err.colno)
        raise InputError(f"malformed JSON: {err.msg}", where) from None
    reader = _Reader(path)
    if not isinstance(data, dict):
        raise reader.fail("top level", "expected a JSON object")
    reader.known(data, "", HEADER_FIELDS)
    fmt = data.get("format")
    if fmt != FORMAT:
        raise reader.fail("format", f"expected {json.dumps(FORMAT)}, got {json.dumps(fmt)}")
    num_ranks = reader.integer(data, "ranks", "header", 1)
    microbatches = reader.integer(data, "microbatches", "header", 1)
    source = str(data.get("source", ""))
    reader.source = _source_file(source, path)
    placement = _read_placement(data, reader)
    if placement.num_ranks != num_ranks:
        raise reader.fail(
            "placement", f"places {placement.num_ranks} ranks, header says {num_ranks}"
        )
    programs = reader.field(
        data,
        "programs",
        "header",
        lambda v: isinstance(v, list),
        "a list with one instruction list per rank",
    )
    if len(programs) != num_ranks:
        raise reader.fail("programs", f"has {len(programs)} rank lists, header says {num_ranks}")
    params = reader.field(
        data,
        "params",
        "header",
        lambda v: isinstance(v, dict) and all(_is_int(x) for x in v.values()),
        "an object of integers",
    )
    ranks = tuple(
        tuple(
            _read_instr(item, f"programs[{rank}][{index}]", reader)
            for index, item in enumerate(_rank_list(programs[rank], rank, reader))
        )
        for rank in range(num_ranks)
    )
    comm = str(data.get("comm", "unknown"))
    mesh = _read_mesh(data, num_ranks, reader)
    recompute = _read_recompute(data, placement.num_stages(0), reader)
    moe = _read_moe(data, placement.num_stages(0), reader)
    program = Program(
        schedule=str(data.get("schedule", Path(path).stem)),
        source=source,
        num_ranks=num_ranks,
        num_microbatches=microbatches,
        params=tuple(sorted((str(k), int(v)) for k, v in params.items())),
        comm=comm,
        placement=placement,
        ranks=ranks,
        backend=backend_of(comm),
        mesh=mesh,
        recompute=recompute,
        moe=moe,
    )
    return program, reader.notes()


def _read_moe(data: dict[str, Any], stages: int, reader: _Reader) -> tuple[int, ...] | None:
    """`"moe": [K0, K1, ...]`: the MoE layers of each stage (pipe 0's numbering), absent: none."""
    if "moe" not in data:
        return None
    moe = data["moe"]
    if not (
        isinstance(moe, list) and len(moe) == stages and all(_is_int(k) and k >= 0 for k in moe)
    ):
        raise reader.fail(
            "moe", f"expected a list of {stages} layer counts ≥ 0 (one per stage), got "
            f"{json.dumps(moe)}"
        )  # fmt: skip
    return tuple(moe)


def _read_recompute(data: dict[str, Any], stages: int, reader: _Reader) -> tuple[int, ...]:
    """`"recompute": [{"stage": 0, "mode": "full"}, ...]`: the stages recomputed, each once
    and within the placement's stages (absent: none)."""
    entries = data.get("recompute", [])
    if not isinstance(entries, list):
        raise reader.fail("recompute", f"expected a list of {{stage, mode}} objects, got "
                          f"{json.dumps(entries)}")  # fmt: skip
    found: list[int] = []
    for n, entry in enumerate(entries):
        where = f"recompute[{n}]"
        stage = reader.integer(entry, "stage", where)
        reader.known(entry, where, RECOMPUTE_FIELDS)
        reader.field(entry, "mode", where, lambda v: v == RECOMPUTE, json.dumps(RECOMPUTE))
        if stage >= stages:
            raise reader.fail(where, f"stage {stage}: the placement has stages 0..{stages - 1}")
        if stage in found:
            raise reader.fail(where, f"stage {stage} is named twice")
        found.append(stage)
    return tuple(sorted(found))


def _read_mesh(data: dict[str, Any], num_ranks: int, reader: _Reader) -> Mesh | None:
    """`"mesh": {"pp": 2, "dp_shard": 2}`: the mesh, with `ranks` either pp (a pipeline's
    program) or the product of the sizes (the whole mesh)."""
    if "mesh" not in data:
        return None
    sizes = data["mesh"]
    names = ", ".join(DIMS)
    if not isinstance(sizes, dict) or not all(
        k in DIMS and _is_int(v) and v >= 1 for k, v in sizes.items()
    ):
        raise reader.fail(
            "mesh", f"expected an object of sizes ≥ 1 named {names}, got {json.dumps(sizes)}"
        )
    mesh = Mesh(**{str(k): int(v) for k, v in sizes.items()})
    if num_ranks not in (mesh.pp, mesh.world):
        raise reader.fail(
            "mesh",
            f"{mesh.describe()} has pp={mesh.pp} and {mesh.world} ranks in all, but the "
            f"program has {num_ranks} rank lists (a pipeline's program has pp, the whole "
            "mesh's one per global rank)",
        )
    return mesh


def _source_file(source: str, path: str) -> SourceFile | None:
    """The .sched file a program came from, when it is still there, so errors can quote it."""
    if not source:
        return None
    candidate = Path(source)
    if not candidate.is_absolute():
        candidate = Path(path).parent / candidate if not candidate.exists() else candidate
    try:
        return SourceFile(source, candidate.read_text("utf-8"))
    except (OSError, UnicodeDecodeError):
        return SourceFile(source, "")


def _rank_list(value: Any, rank: int, reader: _Reader) -> list[Any]:
    if not isinstance(value, list):
        raise reader.fail(f"programs[{rank}]", "expected a list of instructions")
    return value


def _read_placement(data: dict[str, Any], reader: _Reader) -> Placement:
    entries = reader.field(
        data, "placement", "header", lambda v: isinstance(v, list) and bool(v), "a non-empty list"
    )
    slots = []
    for i, entry in enumerate(entries):
        where = f"placement[{i}]"
        if isinstance(entry, dict):
            reader.known(entry, where, PLACEMENT_FIELDS)
        slots.append(
            StageSlot(
                *(reader.integer(entry, key, where) for key in ("rank", "chunk", "pipe", "stage"))
            )
        )
    try:
        return Placement(str(data.get("placement_name", "table")), tuple(slots))
    except PlacementError as err:
        raise reader.fail("placement", str(err)) from None


_KINDS = {kind.value: kind for kind in Kind}
_MSGS = {msg.value: msg for msg in Msg}
_STAGE_ACTIONS = {action.value: action for action in StageAction}
_COLLECTIVES = {kind.value: kind for kind in CollectiveKind}
_PARTS = {part.value: part for part in PhasePart}


def _read_compute(obj: Any, where: str, reader: _Reader, kind: Kind | None = None) -> Compute:
    if kind is None:
        name = reader.field(obj, "op", where, lambda v: v in _KINDS, "one of F, B, I, W")
        kind = _KINDS[name]
    chunk, pipe, stage, mb = (
        reader.integer(obj, key, where) for key in ("chunk", "pipe", "stage", "mb")
    )
    reader.known(obj, where, COMPUTE_FIELDS)
    return Compute(kind, chunk, pipe, stage, mb, reader.span(obj))


def _read_sequential(obj: dict[str, Any], where: str, reader: _Reader) -> Sequential:
    """`{"op": "OVERLAP_F_B", "sequential": true, "ops": [...]}`: torch's OVERLAP_F_B."""
    reader.field(obj, "sequential", where, lambda v: v is True, "true")
    ops = reader.field(
        obj, "ops", where, lambda v: isinstance(v, list) and bool(v), "a non-empty list"
    )
    parts = tuple(_read_compute(item, f"{where}.ops[{i}]", reader) for i, item in enumerate(ops))
    reader.known(obj, where, SEQUENTIAL_FIELDS)
    return Sequential(parts, reader.span(obj))


def _read_fused(obj: dict[str, Any], op: str, where: str, reader: _Reader) -> Fused:
    """`{"op": "F&B", "f": ..., "b": ...}`: a .sched file's overlapped pair."""
    if "sequential" in obj:
        raise reader.fail(
            where,
            "field 'sequential' belongs to OVERLAP_F_B (its sub-actions in 'ops', run in "
            f"the order written); an {op} is an overlapped forward and backward and has none",
        )
    forward = _read_compute(obj.get("f"), f"{where}.f", reader)
    backward = _read_compute(obj.get("b"), f"{where}.b", reader)
    if forward.kind is not Kind.F or backward.kind.value != op[-1]:
        raise reader.fail(where, f"a {op} holds an F in 'f' and a {op[-1]} in 'b'")
    reader.known(obj, where, FUSED_FIELDS)
    return Fused(forward, backward, reader.span(obj))


def _read_phase(obj: dict[str, Any], where: str, reader: _Reader) -> Phase:
    """`{"op": "phase", "of": {F, B or I}, "layer": l, "part": "pre"}`: a MoE phase."""
    op = _read_compute(obj.get("of"), f"{where}.of", reader)
    if op.kind is Kind.W:
        raise reader.fail(where, "a phase is part of an F, B or I; a W is not split")
    layer = reader.integer(obj, "layer", where)
    part = reader.field(obj, "part", where, lambda v: v in _PARTS, "one of pre, experts, post")
    reader.known(obj, where, PHASE_FIELDS)
    return Phase(op, layer, _PARTS[part], reader.span(obj))


def _read_stage_op(obj: dict[str, Any], op: str, where: str, reader: _Reader) -> StageOp:
    """`{"op": "UNSHARD", "chunk", "pipe", "stage"}`: torch's per-stage actions."""
    if "mb" in obj:
        raise reader.fail(where, f"field 'mb': {op} acts on a whole stage and takes no microbatch")
    chunk, pipe, stage = (reader.integer(obj, key, where) for key in ("chunk", "pipe", "stage"))
    reader.known(obj, where, STAGE_OP_FIELDS)
    return StageOp(_STAGE_ACTIONS[op], chunk, pipe, stage, reader.span(obj))


def _read_collective(obj: dict[str, Any], where: str, reader: _Reader) -> Collective:
    """`{"op": "collective", "kind", "ranks", "what"[, "async": true]}` (DESIGN §4). The
    ranks are read as written, in any order; the verifier judges them (own rank, range)."""
    kinds = ", ".join(_COLLECTIVES)
    kind = reader.field(obj, "kind", where, lambda v: v in _COLLECTIVES, f"one of {kinds}")
    ranks = reader.field(
        obj,
        "ranks",
        where,
        lambda v: isinstance(v, list) and bool(v) and all(_is_int(r) and r >= 0 for r in v),
        "a non-empty list of ranks",
    )
    what = reader.field(obj, "what", where, lambda v: isinstance(v, str), "a string")
    asynchronous = obj.get("async", False)
    if not isinstance(asynchronous, bool):
        raise reader.fail(
            where, f"field 'async' must be true or false, got {json.dumps(asynchronous)}"
        )
    dims = obj.get("dims", [])
    if not isinstance(dims, list) or not all(isinstance(d, str) for d in dims):
        raise reader.fail(
            where, f"field 'dims' must be a list of mesh dimensions, got {json.dumps(dims)}"
        )
    stages = obj.get("stages", [])
    if not isinstance(stages, list) or not all(_is_int(x) and x >= 0 for x in stages):
        raise reader.fail(
            where, f"field 'stages' must be a list of stages, got {json.dumps(stages)}"
        )
    shards = obj.get("shards", 1)
    if not _is_int(shards) or shards < 1:
        raise reader.fail(where, f"field 'shards' must be an integer ≥ 1, got {json.dumps(shards)}")
    reader.known(obj, where, COLLECTIVE_FIELDS)
    return Collective(
        _COLLECTIVES[kind],
        tuple(ranks),
        what,
        asynchronous,
        tuple(dims),
        tuple(stages),
        shards,
        reader.span(obj),
    )


def _read_instr(obj: Any, where: str, reader: _Reader) -> Instr:
    op = reader.field(obj, "op", where, lambda v: isinstance(v, str), "an op name")
    if op in _KINDS:
        return _read_compute(obj, where, reader)
    if op in ("F&B", "F&I"):
        return _read_fused(obj, op, where, reader)
    if op == "OVERLAP_F_B":
        return _read_sequential(obj, where, reader)
    if op in ("send", "recv"):
        what = _MSGS[reader.field(obj, "what", where, lambda v: v in _MSGS, '"act" or "grad"')]
        peer, pipe, stage, mb = (
            reader.integer(obj, key, where) for key in ("peer", "pipe", "stage", "mb")
        )
        group = obj.get("group")
        if group is not None and not (_is_int(group) and group >= 0):
            raise reader.fail(
                where, f"field 'group' must be null or an integer ≥ 0, got {json.dumps(group)}"
            )
        reader.known(obj, where, COMM_FIELDS)
        cls = Send if op == "send" else Recv
        return cls(what, peer, pipe, stage, mb, group, reader.span(obj))
    if op == "wait":
        ops = reader.field(
            obj,
            "ops",
            where,
            lambda v: isinstance(v, list) and bool(v) and all(_is_int(i) and i >= 0 for i in v),
            "a non-empty list of instruction indices",
        )
        reader.known(obj, where, WAIT_FIELDS)
        return Wait(tuple(ops), reader.span(obj))
    if op in _STAGE_ACTIONS:
        return _read_stage_op(obj, op, where, reader)
    if op == "collective":
        return _read_collective(obj, where, reader)
    if op == "phase":
        return _read_phase(obj, where, reader)
    raise reader.fail(
        where,
        f"unknown op {json.dumps(op)} (expected F, B, I, W, F&B, F&I, OVERLAP_F_B, phase, "
        "send, recv, wait, collective, UNSHARD, RESHARD or REDUCE_GRAD)",
    )
