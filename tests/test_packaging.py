"""What `pip install .` ships: pyproject.toml lists its packages by hand, so a new folder of
pipecc (a layer, such as `search/`) that is not listed imports from the checkout's editable
install but is missing from a wheel, and its command fails there with an ImportError."""

from __future__ import annotations

import tomllib

from helpers import ROOT


def _folders() -> set[str]:
    """Every package of the source tree, by its import name (`runtime/` is installed as
    `pipecc.runtime`)."""
    found = set()
    for root, name in ((ROOT / "pipecc", "pipecc"), (ROOT / "runtime", "pipecc.runtime")):
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            found.add(".".join((name, *parts)))
    return found


def test_every_package_of_the_tree_is_shipped() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    missing = sorted(_folders() - listed)
    absent = sorted(
        p for p in listed - _folders() if not p.startswith(("pipecc.grammars", "pipecc.schedules"))
    )
    assert not absent, f"pyproject.toml lists packages that do not exist: {absent}"
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}"
    mapped = config["tool"]["setuptools"]["package-dir"]
    for package, folder in mapped.items():
        assert package in listed and (ROOT / folder / "__init__.py").is_file(), package
