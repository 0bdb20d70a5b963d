"""The `slow` marker is true: `make test-fast` (`-m "not slow"`) starts no process.

tests/conftest.py marks the slow tests (`SLOW_FILES`, `SLOW_TESTS`) and refuses, in every
other test, to start a subprocess, a multiprocessing process or a torch process group. These
tests check the guard (this file's tests are not slow, so the guard is on here), that every
file that can start processes is marked, and that the lists name tests that exist.
"""

from __future__ import annotations

import ast
import multiprocessing
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import conftest
import pytest
from conftest import SLOW_FILES, SLOW_TESTS, SpawnInFastTest

TESTS = conftest.TESTS
# what starts a process or a process group in a test file
SPAWNS = re.compile(
    r"torchrun|subprocess\.|mp\.spawn|\bspawn\(|init_process_group|multiprocessing|Popen"
)
MARKED = re.compile(r"pytest\.mark\.slow|pytestmark\s*=.*slow")
NODE = "tests/test_tiers.py::test_a_fast_test_cannot_start_a_process"


def test_a_fast_test_cannot_start_a_process() -> None:
    with pytest.raises(SpawnInFastTest) as raised:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert str(raised.value) == (
        f"{NODE} starts a subprocess but is not marked slow: mark it @pytest.mark.slow, "
        "or list its file in tests/conftest.py's SLOW_FILES"
    )
    with pytest.raises(SpawnInFastTest, match="starts a process but"):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_a_fast_test_cannot_join_a_process_group() -> None:
    """The guard patches torch.distributed when a test module has imported it (this one
    imports it late, so it asks the guard itself)."""
    dist = pytest.importorskip("torch.distributed")
    with (
        conftest.refusing_processes(NODE),
        pytest.raises(SpawnInFastTest, match="starts a torch process group but"),
    ):
        dist.init_process_group("gloo", rank=0, world_size=1)


def test_the_guard_restores_what_it_patched() -> None:
    before = subprocess.Popen.__dict__["_execute_child"]
    with conftest.refusing_processes("t"):
        assert subprocess.Popen.__dict__["_execute_child"] is not before
    assert subprocess.Popen.__dict__["_execute_child"] is before


def _spawning_tests(path: Path) -> Iterator[str]:
    """The test functions of `path` whose own body starts processes (its fixtures are left
    to the guard)."""
    text = path.read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            source = ast.get_source_segment(text, node) or ""
            if SPAWNS.search(source) and not MARKED.search(source):
                yield node.name


def test_every_test_that_starts_processes_is_marked() -> None:
    unmarked = []
    for path in sorted(TESTS.rglob("test_*.py")):
        relative = path.relative_to(TESTS).as_posix()
        if relative == "test_tiers.py" or relative in SLOW_FILES:
            continue
        if MARKED.search(path.read_text().split("\ndef ", 1)[0]):  # a module-level pytestmark
            continue
        unmarked += [
            f"{relative}::{name}"
            for name in _spawning_tests(path)
            if f"{relative}::{name}" not in SLOW_TESTS
        ]
    assert not unmarked, f"tests that start processes but are not marked slow: {unmarked}"


def test_the_lists_name_tests_that_exist() -> None:
    missing = [name for name in SLOW_FILES if not (TESTS / name).is_file()]
    for name in SLOW_TESTS:
        file, function = name.split("::")
        path = TESTS / file
        if not path.is_file() or f"def {function}(" not in path.read_text():
            missing.append(name)
    assert not missing, f"tests/conftest.py lists tests that do not exist: {missing}"
