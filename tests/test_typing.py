"""The type-checking promise CI gates (`make typecheck` runs `mypy --strict pipecc runtime`):
at most 10 `# type: ignore` in pipecc and the runtime, each with its code and its reason on
the line, so that a suppression is a decision someone wrote down, not a way out."""

from __future__ import annotations

import re

from helpers import ROOT

IGNORE = re.compile(r"#\s*type:\s*ignore(?P<code>\[[\w, -]+\])?(?P<rest>.*)$")
LIMIT = 10


def _ignores() -> list[tuple[str, int, re.Match[str]]]:
    found = []
    for folder in (ROOT / "pipecc", ROOT / "runtime"):
        for path in sorted(folder.rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                match = IGNORE.search(line)
                if match:
                    found.append((str(path.relative_to(ROOT)), number, match))
    return found


def test_few_type_ignores_each_with_code_and_reason() -> None:
    found = _ignores()
    assert len(found) <= LIMIT, [f"{path}:{line}" for path, line, _ in found]
    bare = [
        f"{path}:{line}"
        for path, line, match in found
        if not match["code"] or not re.match(r"\s*#\s*\S", match["rest"])
    ]
    assert not bare, f"a type: ignore needs its error code and '# reason' after it: {bare}"
