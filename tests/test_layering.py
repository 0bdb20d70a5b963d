"""The import rules of DESIGN §1 and STYLE §1: each folder is a layer, imports go down.

`LAYERS` lists, for every layer, exactly the pipecc layers and third-party packages it may
import; the tests check that every module of pipecc and the runtime falls under a rule, that
no import (at module level, inside `if`/`try` blocks such as TYPE_CHECKING, or inside a
function) breaks one, that a function-local import is one of the few optional heavy ones of
`LAZY`, and that every allowance is used (so the list shows what the layers need, no more).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"pipecc": ROOT / "pipecc", "pipecc.runtime": ROOT / "runtime"}

# layer -> the other layers and the third-party packages its modules may import (a module
# may always import the standard library and its own layer). The longest matching prefix
# names a module's layer.
LAYERS: dict[str, tuple[str, ...]] = {
    "pipecc": (),  # the package itself: its version
    "pipecc.diagnostics": (),
    "pipecc.perf": (),
    "pipecc.ir": ("pipecc.diagnostics",),
    "pipecc.frontend": ("pipecc.diagnostics", "pipecc.ir", "lark"),
    "pipecc.semantics": ("pipecc.ir",),
    "pipecc.semantics.costs": ("pipecc.diagnostics", "pipecc.ir"),
    "pipecc.semantics.costs.keys": (),  # the cost key table: the standard library only
    "pipecc.analysis": ("pipecc.ir", "pipecc.semantics"),
    # the comm lowering pauses the collector over its 10⁶ objects, as align_comms does
    "pipecc.passes": ("pipecc.diagnostics", "pipecc.ir", "pipecc.perf"),
    # the alignment pass asks the replay engine how its candidates run (DESIGN §1)
    "pipecc.passes.align_comms": (
        "pipecc.ir",
        "pipecc.passes.insert_comms",
        "pipecc.perf",
        "pipecc.semantics",
        "pipecc.analysis.gaps",
    ),
    # a .json names its comm policy; what that policy needs of the backend is the passes' word;
    # a torch CSV is torch's actions, and a comms export carries torch's own UNSHARD/RESHARD/
    # REDUCE_GRAD placement (docs/interop.md)
    "pipecc.interop": (
        "pipecc.diagnostics",
        "pipecc.ir",
        "pipecc.passes.comm.placement",
        "pipecc.passes.torch_actions",
        "pipecc.passes.torch_lowering",
    ),
    "pipecc.verify": (
        "pipecc.diagnostics",
        "pipecc.ir",
        "pipecc.perf",
        "pipecc.semantics",
        "pipecc.analysis",
        "networkx",
    ),
    "pipecc.simulate": (
        "pipecc.diagnostics",
        "pipecc.ir",
        "pipecc.perf",
        "pipecc.semantics",
        "pipecc.analysis",
    ),
    "pipecc.render": ("pipecc.ir", "pipecc.simulate", "matplotlib"),
    "pipecc.driver": (
        "pipecc.diagnostics",
        "pipecc.frontend",
        "pipecc.interop",
        "pipecc.ir",
        "pipecc.passes",
        "pipecc.perf",
        "pipecc.semantics",
        "pipecc.verify",
    ),
    "pipecc.api": ("pipecc.driver",),
    "pipecc.commands": (
        "pipecc.analysis",
        "pipecc.api",
        "pipecc.diagnostics",
        "pipecc.driver",
        "pipecc.frontend",
        "pipecc.interop",
        "pipecc.ir",
        "pipecc.passes",
        "pipecc.render",
        "pipecc.runtime",  # `pipecc run` only, inside the function (LAZY)
        "pipecc.search",
        "pipecc.semantics",
        "pipecc.simulate",
        "pipecc.verify",
    ),
    "pipecc.cli": ("pipecc", "pipecc.commands", "pipecc.diagnostics"),
    "pipecc.pytest_plugin": (
        "pipecc.diagnostics",
        "pipecc.driver",
        "pipecc.semantics",
        "pipecc.verify",
        "pytest",
    ),
    # the runtime's own layers, bottom up (docs/architecture.md); its top (`__init__`, the
    # facade, and `pipeline`, the runtime that binds them) may import every one of them
    "pipecc.runtime": ("pipecc.diagnostics", "pipecc.ir", "torch"),
    "pipecc.runtime.compat": ("torch",),  # torch's private APIs, each tested (test_compat)
    "pipecc.runtime.config": ("pipecc.diagnostics", "torch"),
    "pipecc.runtime.comm": ("pipecc.diagnostics", "pipecc.ir", "torch", "pipecc.runtime.compat"),
    "pipecc.runtime.boundaries": (
        "pipecc.diagnostics",
        "pipecc.ir",
        "torch",
        "pipecc.runtime.compat",
        "pipecc.runtime.config",
        "pipecc.runtime.comm",
    ),
    "pipecc.runtime.plan": (
        "pipecc.diagnostics",
        "pipecc.ir",
        "torch",
        "pipecc.runtime.boundaries",
    ),
    "pipecc.runtime.engine": (
        "pipecc.diagnostics",
        "pipecc.ir",
        "torch",
        "pipecc.runtime.compat",
        "pipecc.runtime.config",
        "pipecc.runtime.comm",
        "pipecc.runtime.boundaries",
        "pipecc.runtime.plan",
    ),
    "pipecc.runtime.profiling": (
        "pipecc.ir",
        "torch",
        "pipecc.runtime.compat",  # profiling.memory: a dispatch mode, weak storage references
        "pipecc.runtime.engine",
        # the cost file's writer names its keys from the readers' own table, so the two agree
        # by construction; that module imports the standard library only (its own layer)
        "pipecc.semantics.costs.keys",
    ),
    # checkpoints: the runtime's stages, optimizer and own state through torch's DCP
    # the step's shapes from the loading ranks (a stand-in of meta tensors elsewhere)
    "pipecc.runtime.data": ("torch", "pipecc.runtime.compat", "pipecc.runtime.pipeline"),
    "pipecc.runtime.checkpoint": ("pipecc.diagnostics", "torch", "pipecc.runtime.pipeline"),
    # a runtime's device and the boundaries a user declares (beside pipeline.py)
    "pipecc.runtime.declared": (
        "pipecc.diagnostics",
        "pipecc.ir",
        "torch",
        "pipecc.runtime.boundaries",
        "pipecc.runtime.engine",
        "pipecc.runtime.plan",
    ),
    "pipecc.runtime.tools": (
        "pipecc.diagnostics",
        "pipecc.ir",
        "torch",
        "pipecc.runtime.compat",
        "pipecc.runtime.config",
        "pipecc.runtime.comm",
        "pipecc.runtime.boundaries",
        "pipecc.runtime.engine",
        "pipecc.runtime.profiling",
        "pipecc.runtime.pipeline",
    ),
    "pipecc.search": (
        "pipecc.analysis",  # search.partition: a cut's peak bytes by the one memory rule
        "pipecc.api",  # search.baseline: the bundled schedules' orders
        "pipecc.diagnostics",
        "pipecc.ir",
        "pipecc.passes",  # search.lower: alignment of the found order
        "pipecc.semantics",
        "pipecc.simulate",  # search.lower: the makespans of the result
        "pipecc.verify",  # search.lower: the result verified under every comm model
        "ortools",  # search.exact: the optional exact solver
    ),
}
# function-local imports: optional heavy dependencies only (STYLE §1)
LAZY = {
    ("pipecc.render.png", "matplotlib"),
    ("pipecc.commands.run", "pipecc.runtime"),
    ("pipecc.search.exact", "ortools"),  # the optional exact solver
}
STDLIB = set(sys.stdlib_module_names)


def _modules() -> list[tuple[str, Path]]:
    found = []
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found.append((".".join((package, *parts)), path))
    return found


def _imports(path: Path, module: str = "") -> list[tuple[str, bool]]:
    """(imported module, inside a function) for every import of the file, wherever it is
    (a relative import resolved against `module`)."""
    tree = ast.parse(path.read_text())
    local = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for inner in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in local) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((_absolute(node, module, path.name == "__init__.py"), id(node) in local))
    return found


def _absolute(node: ast.ImportFrom, module: str, package: bool) -> str:
    if node.level == 0:
        assert node.module
        return node.module
    parts = module.split(".")
    base = parts if package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join((*base, *([node.module] if node.module else [])))


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _layer(module: str) -> str | None:
    matches = [prefix for prefix in LAYERS if _within(module, prefix)]
    return max(matches, key=len) if matches else None


def _target(module: str, imported: str) -> str | None:
    """The allowance of `module`'s layer that permits importing `imported` (the layer itself
    for its own modules, "" for the standard library), or None: a broken rule."""
    top = imported.split(".")[0]
    if top in STDLIB or top == "__future__":
        return ""
    layer = _layer(module)
    assert layer is not None
    if _within(imported, layer) and (layer != "pipecc" or imported == "pipecc"):
        return layer
    allowed = [p for p in LAYERS[layer] if _within(imported, p)]
    return max(allowed, key=len) if allowed else None


MODULES = _modules()


@pytest.mark.parametrize(("module", "path"), MODULES, ids=[m for m, _ in MODULES])
def test_imports_follow_the_layers(module: str, path: Path) -> None:
    assert _layer(module) is not None, f"{module} belongs to no layer of LAYERS"
    bad = [name for name, _ in _imports(path, module) if _target(module, name) is None]
    assert not bad, f"{module} imports {bad} against the layering rules"
    lazy = [name for name, local in _imports(path, module) if local]
    unlisted = [n for n in lazy if not any(_within(module, m) and _within(n, t) for m, t in LAZY)]
    assert not unlisted, f"{module} imports {unlisted} inside a function"


def test_every_allowance_is_used() -> None:
    used = {
        (_layer(module), _target(module, name))
        for module, path in MODULES
        for name, _ in _imports(path, module)
    }
    unused = [
        f"{layer} -> {target}"
        for layer, targets in LAYERS.items()
        for target in targets
        if (layer, target) not in used
    ]
    assert not unused, f"allowed but never imported (remove them from LAYERS): {unused}"


def test_the_rules_see_imports_in_blocks_and_functions(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import pipecc.passes\n"
        "try:\n    import lark\nexcept ImportError:\n    pass\n"
        "def f():\n    import torch\n"
    )
    found = _imports(source)
    assert ("pipecc.passes", False) in found and ("lark", False) in found
    assert ("torch", True) in found
    assert _target("pipecc.ir.ops", "pipecc.passes") is None
    assert _target("pipecc.ir.ops", "lark") is None
    assert _target("pipecc.semantics.engine", "pipecc.semantics.costs") == "pipecc.semantics"


def test_compiler_verifier_simulator_run_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import pipecc.cli, pipecc.api\n"
        "from pipecc.api import compile_schedule\n"
        "compile_schedule('dualpipe', ranks=4, microbatches=8)\n"
        "raise SystemExit(pipecc.cli.main(['list']) or 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert result.returncode == 0, result.stderr


ENVIRONMENT = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _environment_reads(path: Path) -> list[int]:
    """The lines of `path` that touch the process environment (`os.environ`, `os.getenv`,
    or those names imported from os)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ENVIRONMENT:
            found.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [node.lineno for alias in node.names if alias.name in ENVIRONMENT]
    return sorted(found)


def test_the_runtime_reads_no_environment_below_its_tools() -> None:
    """A runtime setting is a `RuntimeConfig` field; only runtime/tools/ (what `pipecc run`
    starts) maps `PIPECC_*` variables onto fields (runtime/tools/environment.py)."""
    found = [
        f"{module}:{line}"
        for module, path in MODULES
        if _within(module, "pipecc.runtime") and not _within(module, "pipecc.runtime.tools")
        for line in _environment_reads(path)
    ]
    assert found == []


def test_the_environment_rule_sees_every_form(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import os\nfrom os import getenv\na = os.environ.get('X')\nb = os.getenv('Y')\n"
    )
    assert _environment_reads(source) == [2, 3, 4]
