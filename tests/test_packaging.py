"""What `pip install .` ships: pyproject.toml lists its packages by hand, so a new folder of
pipecc (a layer, such as `search/`) that is not listed imports from the checkout's editable
install but is missing from a wheel, and its command fails there with an ImportError."""

from __future__ import annotations

import tomllib

from helpers import ROOT


def _folders() -> set[str]:
    """Every package of the source tree, by its import name."""
    found = set()
    for init in (ROOT / "pipecc").rglob("__init__.py"):
        parts = init.parent.relative_to(ROOT).parts
        found.add(".".join(parts))
    return found


def test_every_package_of_the_tree_is_shipped() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    missing = sorted(_folders() - listed)
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}"
    mapped = config["tool"]["setuptools"]["package-dir"]
    for package, folder in mapped.items():
        assert package in listed and (ROOT / folder / "__init__.py").is_file(), package
