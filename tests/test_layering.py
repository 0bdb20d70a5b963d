"""The import rules of DESIGN §1 and STYLE §1: no import runs against an arrow.

Module-level imports are parsed from the sources (imports inside functions are allowed only
for optional heavy dependencies, and are checked separately: never torch outside the runtime
and `pipecc run`).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"pipecc": ROOT / "pipecc", "pipecc.runtime": ROOT / "runtime"}

# module prefix -> pipecc prefixes it may import (besides itself, the standard library and
# the third-party packages listed in THIRD_PARTY)
ALLOWED = {
    "pipecc.diagnostics": (),
    "pipecc.perf": (),
    "pipecc.ir": ("pipecc.diagnostics",),
    "pipecc.frontend": ("pipecc.diagnostics", "pipecc.ir"),
    "pipecc.passes": ("pipecc.diagnostics", "pipecc.ir"),
    # the alignment pass asks the replay engine how its candidates run (DESIGN §1)
    "pipecc.passes.align_comms": (
        "pipecc.diagnostics",
        "pipecc.ir",
        "pipecc.passes",
        "pipecc.semantics.costs",
        "pipecc.semantics",
        "pipecc.analysis.gaps",
        "pipecc.perf",
    ),
    "pipecc.interop": ("pipecc.diagnostics", "pipecc.ir", "pipecc.passes", "pipecc.perf"),
    "pipecc.semantics.costs": ("pipecc.diagnostics", "pipecc.ir"),
    "pipecc.semantics": ("pipecc.diagnostics", "pipecc.ir", "pipecc.perf"),
    "pipecc.verify": (
        "pipecc.diagnostics",
        "pipecc.ir",
        "pipecc.semantics",
        "pipecc.perf",
        "pipecc.semantics.costs",
        "pipecc.analysis.gaps",
    ),
    "pipecc.analysis": (
        "pipecc.diagnostics",
        "pipecc.ir",
        "pipecc.semantics",
    ),
    # explain's critical path reads a simulated Timeline (until it takes a Replay)
    "pipecc.analysis.critical_path": (
        "pipecc.diagnostics",
        "pipecc.ir",
        "pipecc.semantics",
        "pipecc.simulate",
    ),
    "pipecc.simulate": (
        "pipecc.diagnostics",
        "pipecc.ir",
        "pipecc.semantics",
        "pipecc.perf",
        "pipecc.analysis.gaps",
    ),
    "pipecc.render": (
        "pipecc.diagnostics",
        "pipecc.ir",
        "pipecc.simulate",
        "pipecc.semantics",
    ),
    "pipecc.runtime": ("pipecc.diagnostics", "pipecc.ir", "pipecc.semantics.costs"),
    "pipecc.runtime.launcher": (
        "pipecc.diagnostics",
        "pipecc.ir",
        "pipecc.api",
        "pipecc.semantics.costs",
        "pipecc.runtime",
    ),
}
THIRD_PARTY = {
    "pipecc.frontend": {"lark"},
    "pipecc.semantics": {"networkx"},
    "pipecc.verify": {"networkx"},
    "pipecc.runtime": {"torch"},
}
STDLIB = set(sys.stdlib_module_names)


def _modules() -> list[tuple[str, Path]]:
    found = []
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            if package == "pipecc" and name.startswith("pipecc.runtime"):
                continue
            found.append((name, path))
    return found


def _module_level_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.If | ast.Try):  # TYPE_CHECKING blocks, optional imports
            continue
    return names


def _rule(module: str) -> str | None:
    matches = [prefix for prefix in ALLOWED if module == prefix or module.startswith(prefix + ".")]
    return max(matches, key=len) if matches else None


def _allowed(module: str, imported: str) -> bool:
    top = imported.split(".")[0]
    if top in STDLIB or top == "__future__":
        return True
    if imported == module or imported.startswith(module + "."):
        return True
    rule = _rule(module)
    if top != "pipecc":
        extra = {
            lib
            for prefix, libs in THIRD_PARTY.items()
            if module == prefix or module.startswith(prefix + ".")
            for lib in libs
        }
        return top in extra
    if rule is None:  # the top layer (cli, commands, api, pytest plugin) may import pipecc
        return True
    own_package = rule
    allowed = (*ALLOWED[rule], own_package)
    return any(imported == p or imported.startswith(p + ".") for p in allowed)


@pytest.mark.parametrize(("module", "path"), _modules(), ids=lambda v: str(v))
def test_imports_follow_the_arrows(module: str, path: Path) -> None:
    bad = [name for name in _module_level_imports(path) if not _allowed(module, name)]
    top = _rule(module) is None
    if top:  # the CLI layer: anything in pipecc, but torch only inside `pipecc run`
        bad = [name for name in _module_level_imports(path) if name.split(".")[0] == "torch"]
    assert not bad, f"{module} imports {bad} against the layering rules"


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
