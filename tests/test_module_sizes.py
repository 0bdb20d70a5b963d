"""No module of the compiler or the runtime over 500 lines (STYLE: modules <= 500 lines): a
module that grows past it is split into modules of one job each."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 500


def test_no_module_is_over_500_lines() -> None:
    long = {
        path.relative_to(ROOT).as_posix(): count
        for folder in ("pipecc", "runtime")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (count := len(path.read_text(encoding="utf-8").splitlines())) > LIMIT
    }
    assert not long, f"modules over {LIMIT} lines (split them): {long}"
