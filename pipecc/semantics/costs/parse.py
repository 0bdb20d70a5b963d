"""Parsing the costs: the `--cost` flag and a TOML cost file (`[cost]`, `[cost.stage.N]`),
against keys.py's table (docs/simulate.md "The cost model")."""

from __future__ import annotations

import difflib
import math
import tomllib
from pathlib import Path
from typing import Any

from pipecc.diagnostics import CostModelError

from .convert import Cut
from .keys import CUT_KEYS, GLOBAL_KEYS, HOST_KEYS, STAGE_KEYS
from .model import CostModel
from .stage import HostCost, StageCost


def _number(key: str, value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise CostModelError(f"{where}: {key} must be a number, got {value!r}") from None
    if not math.isfinite(value) or value < 0:
        raise CostModelError(f"{where}: {key} must be a finite number ≥ 0, got {value}")
    return float(value)


def _check_key(key: str, known: tuple[str, ...], where: str) -> None:
    if key not in known:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise CostModelError(f"{where}: unknown cost key '{key}' (known: {', '.join(known)}){hint}")


def _stage_cost(values: dict[str, Any], where: str, *, known: tuple[str, ...]) -> StageCost:
    fields = {}
    for key, value in values.items():
        if key in GLOBAL_KEYS and key not in known:
            raise CostModelError(f"{where}: '{key}' is global only: give it under [cost]")
        _check_key(key, known, where)
        fields[key] = _number(key, value, where)
    return StageCost(**fields)


def parse_cost_flag(text: str) -> CostModel:
    """`F=1,B=2,I=1,W=1,FB=2.5,comm=0.1` → CostModel (global values only)."""
    values: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise CostModelError(f"--cost: expected KEY=VALUE, got {item!r}")
        values[key.strip()] = value.strip()
    return _model(values, {}, "--cost")


def load_cost_file(path: str | Path) -> CostModel:
    """A TOML cost file: `[cost]` with global keys, `[cost.stage.N]` with overrides."""
    where = str(path)
    try:
        text = Path(path).read_text("utf-8")
    except FileNotFoundError:
        raise CostModelError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise CostModelError(f"{where}: cannot read: {err}") from None
    return parse_cost_text(text, where)


def parse_cost_text(text: str, where: str) -> CostModel:
    """The text of a TOML cost file; `where` names it in errors."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise CostModelError(f"{where}: malformed TOML: {err}") from None
    cost = data.get("cost")
    if not isinstance(cost, dict):
        raise CostModelError(f"{where}: expected a [cost] table")
    stages = cost.get("stage", {})
    values = {k: v for k, v in cost.items() if k != "stage"}
    return _model(values, stages, where)


def _model(values: dict[str, Any], stages: Any, where: str) -> CostModel:
    unit = str(values.pop("unit", ""))
    measured = _measured(values, where)
    shared = _shared(values.pop("shared"), where) if "shared" in values else ()
    bandwidth = values.pop("bandwidth", None)
    host = HostCost(
        **{key: _number(key, values.pop(key), where) for key in HOST_KEYS if key in values}
    )
    base = _stage_cost(values, where, known=GLOBAL_KEYS)
    if not isinstance(stages, dict):
        raise CostModelError(f"{where}: [cost.stage] must hold tables [cost.stage.N]")
    overrides = []
    for name, table in sorted(stages.items(), key=lambda item: str(item[0])):
        if not str(name).isdigit() or not isinstance(table, dict):
            raise CostModelError(f"{where}: [cost.stage.{name}]: N must be a stage number")
        table_where = f"{where} [cost.stage.{name}]"
        overrides.append((int(name), _stage_cost(table, table_where, known=STAGE_KEYS)))
    model = CostModel(
        base=base,
        stages=tuple(sorted(overrides)),
        bandwidth=_number("bandwidth", bandwidth, where) if bandwidth is not None else None,
        unit=unit,
        host=host,
        shared=shared,
        measured=measured,
        origin="" if where == "--cost" else where,
    )
    if measured is not None:
        model._check_stages(measured)
    model.stage(0)  # resolve once, so inconsistent values fail here with the file's name
    for stage, _ in overrides:
        model.stage(stage)
    return model


def _measured(values: dict[str, Any], where: str) -> Cut | None:
    """`placement`, `ranks`, `stages`: the cut a file was measured on (popped from
    `values`); `ranks` and `stages` come together, `placement` is its name."""
    given = {key: values.pop(key) for key in CUT_KEYS if key in values}
    if not given:
        return None
    if where == "--cost":
        raise CostModelError(
            f"--cost: {', '.join(given)}: what costs were measured on is given in a cost file only"
        )
    if "ranks" not in given or "stages" not in given:
        raise CostModelError(
            f"{where}: give ranks and stages together (the P and the stages per pipe the "
            "costs were measured on)"
        )
    sizes = []
    for key in ("ranks", "stages"):
        value = given[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CostModelError(f"{where}: {key} must be a positive integer, got {value!r}")
        sizes.append(value)
    placement = given.get("placement", "")
    if not isinstance(placement, str):
        raise CostModelError(f"{where}: placement must be a name, got {placement!r}")
    return Cut(ranks=sizes[0], stages=sizes[1], placement=placement)


def _shared(value: Any, where: str) -> tuple[tuple[int, ...], ...]:
    """`shared`: a list of groups of two or more distinct stage numbers (a file's
    `[[0, 7]]`, or the command line's `0+7/1+6`)."""
    if isinstance(value, str):
        try:
            value = [[int(s) for s in group.split("+")] for group in value.split("/")]
        except ValueError:
            raise CostModelError(
                f"{where}: shared must be groups of stage numbers like 0+7 or 0+7/1+6, "
                f"got {value!r}"
            ) from None
    if not isinstance(value, list) or not all(isinstance(group, list) for group in value):
        raise CostModelError(
            f"{where}: shared must be a list of groups of stage numbers, e.g. [[0, 7]]"
        )
    groups = []
    for group in value:
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in group):
            raise CostModelError(f"{where}: shared: {group!r} must hold stage numbers ≥ 0")
        if len(set(group)) < 2:
            raise CostModelError(
                f"{where}: shared: {group!r} must name two or more different stages"
            )
        groups.append(tuple(sorted(set(group))))
    return tuple(sorted(groups))
