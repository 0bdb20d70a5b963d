"""What the GPU check runs on: Python, torch (its CUDA, NCCL and devices), lark, networkx,
pytest, and where pipecc and pipecc.runtime were imported from (benchmarks/gpu_check.sh's
first step). Exit 1 when pipecc does not come from this working tree, lark cannot be
imported, or torch is outside the range the runtime supports (2.11 to 2.13).

    python3 benchmarks/gpu_versions.py
"""

from __future__ import annotations

import importlib
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH_RANGE = ((2, 11), (2, 14))  # pyproject.toml's runtime extra: >=2.11,<2.14


def version_of(name: str) -> str:
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        return f"missing ({err})"
    return str(getattr(module, "__version__", "?")) + f" ({Path(module.__file__ or '?').parent})"


def torch_lines() -> tuple[list[str], list[str]]:
    """What torch says of itself and its devices; the problems found."""
    import torch

    lines = [f"torch {torch.__version__} (CUDA {torch.version.cuda})"]
    problems = []
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if not TORCH_RANGE[0] <= release < TORCH_RANGE[1]:
        problems.append(f"torch {torch.__version__} is outside 2.11 to 2.13")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    lines.append(f"CUDA devices: {count}")
    for index in range(count):
        lines.append(f"  cuda:{index} {torch.cuda.get_device_name(index)}")
    if count:
        lines.append(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    return lines, problems


def main() -> int:
    print(f"python {platform.python_version()} ({sys.executable})")
    problems = []
    for name in ("lark", "networkx", "pytest"):
        found = version_of(name)
        print(f"{name} {found}")
        if name == "lark" and found.startswith("missing"):
            problems.append("lark cannot be imported: see benchmarks/gpu_check.sh's header")
    lines, found = torch_lines()
    print("\n".join(lines))
    problems += found
    import pipecc.runtime

    import pipecc

    for module in (pipecc, pipecc.runtime):
        where = Path(module.__file__ or "?").resolve().parent
        print(f"{module.__name__} from {where}")
        if ROOT not in where.parents:
            problems.append(f"{module.__name__} comes from {where}, not from {ROOT}")
    for problem in problems:
        print(f"FAILED: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
