"""docs/architecture.md stays true of the tree: every path it names exists, every name it
gives as `module.name` (`ir/printer.describe`) is defined there, and every package folder of
pipecc is a row of its layers table."""

from __future__ import annotations

import importlib
import re

from helpers import ROOT

DOC = (ROOT / "docs" / "architecture.md").read_text()
CODE = re.compile(r"`([^`\s]+)`")
# a path inside pipecc/ (or from the repository root): `ir/keys.py`, `analysis/`
PATH = re.compile(r"^[a-z_]+(/[a-z_<>]+)*(/|\.py|\.md|\.json)$")
# a name defined in a module: `ir/printer.describe`, `ir/keys.MessageKeys.inputs/outputs`
NAME = re.compile(r"^(?P<module>[a-z_]+/[a-z_]+)\.(?P<name>[A-Za-z_]+)")


def _spans() -> list[str]:
    return CODE.findall(DOC)


def test_every_path_it_names_exists() -> None:
    paths = [s for s in _spans() if PATH.match(s) and "<" not in s]
    assert len(paths) > 20, paths
    missing = [p for p in paths if not ((ROOT / "pipecc" / p).exists() or (ROOT / p).exists())]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_module_name_it_gives_is_defined() -> None:
    found = [NAME.match(s) for s in _spans()]
    names = [
        (m["module"], m["name"])
        for m in found
        if m is not None and m["name"] != "py" and (ROOT / "pipecc" / f"{m['module']}.py").is_file()
    ]
    assert len(names) > 4, names
    missing = [
        f"{module}.{name}"
        for module, name in names
        if not hasattr(importlib.import_module("pipecc." + module.replace("/", ".")), name)
    ]
    assert not missing, f"docs/architecture.md names what the code does not define: {missing}"


def test_every_package_is_a_layer_of_the_table() -> None:
    rows = [line for line in DOC.splitlines() if line.startswith("| ")]
    folders = sorted(p.parent.name for p in (ROOT / "pipecc").glob("*/__init__.py"))
    absent = [f for f in folders if not any(f"`{f}/`" in row for row in rows)]
    assert not absent, f"pipecc folders missing from the layers table: {absent}"
