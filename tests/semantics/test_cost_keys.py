"""The cost key table (pipecc/semantics/costs/keys.py) is the one list of keys: every row is
a field of the model, parsed from a TOML file, converted between cuts as its `Scale` says,
documented in docs/simulate.md, and the runtime's profile writer writes table keys only. A
new key is a row of the table; these tests name what else it needs, if anything."""

from __future__ import annotations

import ast
import re
import tomllib
import typing
from dataclasses import fields
from pathlib import Path

import pytest

from pipecc.semantics.costs import (
    KEYS,
    Cut,
    FilledCost,
    HostCost,
    Scale,
    Scope,
    StageCost,
    parse_cost_text,
)
from pipecc.semantics.costs.keys import FILLED_KEYS, HOST_KEYS, STAGE_KEYS, key

ROOT = Path(__file__).resolve().parents[2]
TEXT_VALUES = {"shared": "[[0, 1]]", "unit": '"ms"', "placement": '"loop"'}
INT_VALUES = {"ranks": 2, "stages": 2}


def _value(name: str, index: int) -> str:
    return TEXT_VALUES.get(name) or str(INT_VALUES.get(name, 0.5 * (index + 1)))


def test_the_models_fields_are_the_tables_keys() -> None:
    assert tuple(f.name for f in fields(StageCost)) == STAGE_KEYS
    assert tuple(f.name for f in fields(HostCost)) == HOST_KEYS
    assert tuple(f.name for f in fields(FilledCost)) == STAGE_KEYS, "FilledCost adds no key"
    hints = typing.get_type_hints(FilledCost)
    narrowed = tuple(name for name in STAGE_KEYS if hints[name] is float)
    assert narrowed == FILLED_KEYS


def test_every_key_is_parsed_from_a_cost_file() -> None:
    text = "\n".join(f"{k.name} = {_value(k.name, i)}" for i, k in enumerate(KEYS))
    model = parse_cost_text(f"[cost]\n{text}\n", "all.toml")
    for index, row in enumerate(KEYS):
        expected = 0.5 * (index + 1)
        if row.scope is Scope.STAGE:
            assert getattr(model.base, row.name) == expected, row.name
        elif row.name in HOST_KEYS:
            assert getattr(model.host, row.name) == expected, row.name
    assert model.bandwidth == 0.5 * (1 + STAGE_KEYS.index("REDUCE_GRAD") + 1)
    assert (model.shared, model.unit, model.measured) == (((0, 1),), "ms", Cut(2, 2, "loop"))
    handled = {*STAGE_KEYS, *HOST_KEYS, "bandwidth", "shared", "unit", "ranks", "stages"}
    assert {k.name for k in KEYS} - handled == {"placement"}  # the Cut's name, checked above


def test_every_stage_key_is_parsed_from_a_stage_table_and_no_other() -> None:
    table = "\n".join(f"{name} = {i + 1}" for i, name in enumerate(STAGE_KEYS))
    model = parse_cost_text(f"[cost]\n[cost.stage.1]\n{table}\n", "stage.toml")
    given = dict(model.stages)[1]
    assert [getattr(given, name) for name in STAGE_KEYS] == list(range(1, len(STAGE_KEYS) + 1))
    for row in KEYS:
        if row.scope is not Scope.STAGE:
            text = f"[cost]\n[cost.stage.0]\n{row.name} = {_value(row.name, 0)}\n"
            with pytest.raises(Exception, match=f"'{row.name}' is global only"):
                parse_cost_text(text, "bad.toml")


def test_every_stage_key_is_converted_as_its_scale_says() -> None:
    """Two measured stages of one share each, added into the one stage of P=2 S=1: a scaled
    key is their sum (F, B, I, W derived from both); a message key the first stage's."""
    first = "\n".join(f"{name} = 1" for name in STAGE_KEYS)
    second = "\n".join(f"{name} = 2" for name in STAGE_KEYS)
    text = (
        '[cost]\nplacement = "loop"\nranks = 2\nstages = 2\n'
        f"[cost.stage.0]\n{first}\n[cost.stage.1]\n{second}\n"
    )
    converted = parse_cost_text(text, "measured.toml").for_cut(Cut(2, 1))
    stage = dict(converted.stages)[0]
    for row in KEYS:
        if row.scope is not Scope.STAGE:
            continue
        expected = 3 if row.scaled else 1
        assert getattr(stage, row.name) == expected, (row.name, row.scale)
    assert {row.scale for row in KEYS if row.scope is Scope.STAGE} == {
        Scale.OP,
        Scale.WORK,
        Scale.BYTES,
        Scale.MESSAGE,
    }


def test_every_key_is_in_the_docs_table() -> None:
    text = (ROOT / "docs" / "simulate.md").read_text()
    section = text.split("## The cost model", 1)[1].split("\n\n", 2)[1]
    documented = {
        name for line in section.splitlines() for name in re.findall(r"`(\w+)`", line.split("|")[1])
    }
    assert documented == {k.name for k in KEYS}


def test_a_key_outside_the_table_is_refused_where_it_is_named() -> None:
    assert key("comm") == "comm"
    with pytest.raises(KeyError, match="no cost key 'com'"):
        key("com")


def test_the_key_table_imports_the_standard_library_only() -> None:
    path = ROOT / "pipecc" / "semantics" / "costs" / "keys.py"
    tree = ast.parse(path.read_text())
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported <= {"__future__", "enum", "types", "typing"}


def test_the_runtimes_profile_writes_table_keys_only() -> None:
    recorder_module = pytest.importorskip("pipecc.runtime.profiling.recorder")
    from pipecc.api import compile_schedule
    from pipecc.ir.keys import Message
    from pipecc.ir.ops import Msg

    a, b = recorder_module.Recorder(step=0), recorder_module.Recorder(step=0)
    for stage, recorder in ((0, a), (1, b)):
        for kind in ("F", "B", "FB"):
            recorder.compute(kind, stage, 0.001 * (stage + 1))
        recorder.post(0.0001)
    act = Message(Msg.ACT, 0, 1, 0)
    b.posted(False, act, 9.0, 128)
    a.posted(True, act, 10.0, 128)
    b.wait(((False, act),), (9.5, 10.0005, 10.0006))
    a.sync(40.0, 40.010)
    a.phase("F", 0, "experts", 0, 0.0004)  # a MoE stage's phase and all-to-all
    a.phase("F", 0, "post", 1, 0.0006)
    a.a2a(0, True, (1.0, 1.0, 1.0002))
    loop = compile_schedule("1f1b", ranks=2, microbatches=2)
    text = recorder_module.render_cost_file(
        [a, b], "header", measured_on=loop, shared=((0, 1),), sizes={0: {"act_bytes": 10}}
    )
    cost = tomllib.loads(text)["cost"]
    written = set(cost) - {"stage"} | {k for table in cost["stage"].values() for k in table}
    names = {k.name for k in KEYS}
    assert written <= names, written - names
    assert {"F", "B", "FB", "comm", "bytes", "post", "wait", "sync", "unit", "shared"} <= written
    assert {"a2a", "moe_experts", "moe_layers"} <= written  # 1f1b's program names no K
    parse_cost_text(text, "written.toml")
