"""Import pipecc from this working tree without installing it (benchmarks/gpu_check.sh).

With this folder on PYTHONPATH, every Python process started with that environment (the
check's steps, and the ranks `pipecc run` spawns) runs this at start-up: the working tree
goes on `sys.path` (the `pipecc` package), and a finder maps the three packages that
pyproject.toml's `[tool.setuptools.package-dir]` moves into `pipecc` when installed:
`pipecc.runtime` is runtime/, `pipecc.grammars` grammars/, `pipecc.schedules` schedules/.
Their submodules then resolve through their packages' paths as usual.
"""

from __future__ import annotations

import importlib.machinery
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
MAPPED = {"pipecc.runtime", "pipecc.grammars", "pipecc.schedules"}


class TreeFinder:
    """Finds the three moved packages in the working tree's top-level folders."""

    @classmethod
    def find_spec(
        cls, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name not in MAPPED:
            return None
        return importlib.machinery.PathFinder.find_spec(name, [str(ROOT)])


if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.meta_path.insert(0, TreeFinder)
