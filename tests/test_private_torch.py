"""runtime/compat.py's promise, held: no private torch API anywhere else.

Every private torch name the runtime uses sits behind a named function of runtime/compat.py
with its own test (tests/runtime/test_compat.py), so a torch release that changes one fails
that test by name. This test fails on any use elsewhere: an import of a private torch module
(`torch._C`, `torch.utils._pytree`, `torch.distributed._tensor`, ...), an attribute path from
`torch` (or `dist`) through a private name, or a private attribute torch's objects are known
to carry (`._parameters`, `._modules`, `._buffers`, `._version`, `._local_tensor`, ...) on any
object.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("runtime", "pipecc", "examples")
COMPAT = ROOT / "runtime" / "compat.py"
TORCH_ROOTS = {"torch", "dist"}  # `import torch.distributed as dist` is the house alias
# private attributes of torch's objects (modules, tensors, DTensors, process groups, nodes)
KNOWN_PRIVATE = {
    "_parameters", "_modules", "_buffers", "_version", "_base", "_local_tensor", "_cdata",
    "_execution_engine", "_get_backend", "_backward_hooks", "_post_accumulate_grad_hooks",
    "_state_ctx", "_fsdp_param_groups", "_root_post_backward_final_callback", "_C",
    "_forward_hooks", "_forward_pre_hooks", "_grad_fn", "_typed_storage", "_spec",
}  # fmt: skip


def _is_private_path(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(p.startswith("_") for p in parts[1:])


def _root_and_path(node: ast.Attribute) -> tuple[str | None, list[str]]:
    path: list[str] = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        path.append(current.attr)
        current = current.value
    root = current.id if isinstance(current, ast.Name) else None
    return root, list(reversed(path))


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for every private torch API the source uses."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _is_private_path(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _is_private_path(node.module):
                found.append((node.lineno, node.module))
            elif node.module.startswith("torch"):
                found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                          if a.name.startswith("_")]  # fmt: skip
        elif isinstance(node, ast.Attribute):
            root, path = _root_and_path(node)
            if node.attr in KNOWN_PRIVATE:
                found.append((node.lineno, "." + node.attr))
            elif root in TORCH_ROOTS and any(p.startswith("_") for p in path):
                found.append((node.lineno, ".".join([root or "", *path])))
    return sorted(set(found))


def _files() -> list[Path]:
    return sorted(
        path for folder in SCANNED for path in (ROOT / folder).rglob("*.py") if path != COMPAT
    )


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_torch_api_outside_compat(path: Path) -> None:
    uses = private_uses(path.read_text())
    assert not uses, (
        f"{path.relative_to(ROOT)} uses private torch API "
        + ", ".join(f"{what} (line {line})" for line, what in uses)
        + ": put it behind a named function of runtime/compat.py with its own test"
    )


@pytest.mark.parametrize(
    "source",
    [
        "import torch._C\n",
        "import torch.utils._pytree as pytree\n",
        "from torch.utils._pytree import tree_leaves\n",
        "from torch.distributed import _functional_collectives\n",
        "x = torch._C._functions.AccumulateGrad\n",
        "v = t._version\n",
        "m._parameters['w'] = p\n",
        "for k in module._modules: pass\n",
        "s = dt._local_tensor.shape\n",
        "dist.distributed_c10d._get_default_group()\n",
    ],
)
def test_each_kind_of_private_use_is_found(source: str) -> None:
    assert private_uses(source)


def test_public_api_and_own_private_names_pass() -> None:
    source = (
        "import torch\nimport torch.distributed as dist\n"
        "from torch.utils.checkpoint import checkpoint\n"
        "self._cache = {}\nx = torch.nn.functional.relu(y)\ndist.get_rank()\n"
    )
    assert private_uses(source) == []


def test_compat_exports_every_function_it_defines() -> None:
    tree = ast.parse(COMPAT.read_text())
    defined = {
        node.name
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")
    }
    exported = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    )
    assert defined <= set(exported), sorted(defined - set(exported))
