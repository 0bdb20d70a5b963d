"""Every reference in the code and the docs leads somewhere.

Scanned: pipecc/, runtime/, tests/, benchmarks/, examples/, schedules/, grammars/, docs/,
README.md and the Makefile. Checked:

- `DESIGN §N` (also `DESIGN §5, §6`): docs/design.md has a heading numbered N (`## N. ...`);
  `STYLE §N`: docs/style.md has one (`### N. ...`);
- `docs/x.md`: the file exists; `docs/x.md#anchor`: it has a heading of that GitHub anchor;
  `docs/x.md, "Heading"` (or with a space or `;` before the quote): a heading of that text;
  `docs/x.md §N` (or `§N.M`): a heading numbered so.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
from helpers import ROOT

FOLDERS = ("pipecc", "runtime", "tests", "benchmarks", "examples", "schedules", "grammars", "docs")
FILES = ("README.md", "Makefile")
SELF = Path(__file__).resolve()  # its examples of broken references are meant
SUFFIXES = {".py", ".md", ".sched", ".lark", ".toml", ".json", ".svg"}
# a citation of the design or the style card; a line break (and a comment's `#`) may split it
CARD = re.compile(r"\b(DESIGN|STYLE)\s*(?:#\s*)?(§\s*\d+(?:\s*,\s*§\s*\d+)*)")
CARDS = {"DESIGN": "docs/design.md", "STYLE": "docs/style.md"}
DOC_REF = re.compile(
    r"\bdocs/(?P<file>[A-Za-z0-9_-]+\.md)"
    r"(?:#(?P<anchor>[A-Za-z0-9_-]+)"
    r"|(?:,|;)?\s?\"(?P<title>[^\"\n]{3,80})\""
    r"|\s§(?P<section>\d+(?:\.\d+)*))?"
)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
NUMBERED = re.compile(r"^(\d+(?:\.\d+)*)\.?\s")


def _sources() -> Iterator[Path]:
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and path != SELF:
                yield path
    for name in FILES:
        yield ROOT / name


@cache
def headings(doc: str) -> tuple[str, ...]:
    """The heading texts of docs file `doc` (outside fenced code)."""
    found, fenced = [], False
    for line in (ROOT / doc).read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := HEADING.match(line)):
            found.append(match[1])
    return tuple(found)


def anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]", lambda m: "_" if m[0] == "_" else "", title.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(doc: str) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for title in headings(doc):
        base = anchor(title)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def numbered(doc: str, section: str) -> bool:
    return any((m := NUMBERED.match(t)) and m[1] == section for t in headings(doc))


def _plain(title: str) -> str:
    """A heading's text without markup and without its number (`12. Searching the cut`)."""
    return NUMBERED.sub("", re.sub(r"[`*]", "", title).strip()).lower()


def titled(doc: str, title: str) -> bool:
    want = _plain(title)
    return any(_plain(t) == want or _plain(t).startswith(want) for t in headings(doc))


def problems_in(path: Path) -> Iterator[str]:
    text = path.read_text(errors="replace")
    where = path.relative_to(ROOT).as_posix()
    for match in CARD.finditer(text):
        doc = CARDS[match[1]]
        for section in re.findall(r"\d+", match[2]):
            if not numbered(doc, section):
                yield f"{where}: {match[1]} §{section}: no section {section} in {doc}"
    for match in DOC_REF.finditer(text):
        doc = f"docs/{match['file']}"
        if not (ROOT / doc).is_file():
            yield f"{where}: {doc} does not exist"
        elif match["anchor"] and match["anchor"] not in anchors(doc):
            yield f"{where}: {doc}#{match['anchor']}: no such heading"
        elif match["title"] and not titled(doc, match["title"]):
            yield f'{where}: {doc}, "{match["title"]}": no such heading'
        elif match["section"] and not numbered(doc, match["section"]):
            yield f"{where}: {doc} §{match['section']}: no such section"


def test_every_reference_resolves() -> None:
    problems = [p for path in _sources() for p in problems_in(path)]
    assert not problems, "references that lead nowhere:\n" + "\n".join(problems)


def test_the_scan_sees_the_references() -> None:
    """A positive control: the patterns find the citations the tree is known to hold."""
    text = "\n".join(p.read_text(errors="replace") for p in _sources())
    assert len(CARD.findall(text)) > 80
    assert len(DOC_REF.findall(text)) > 200


@pytest.mark.parametrize(
    ("title", "want"),
    [
        ("5. Semantics verify and simulate share", "5-semantics-verify-and-simulate-share"),
        ("Calibrating `comm` on the run", "calibrating-comm-on-the-run"),
        ("What each target is (and how to run it)", "what-each-target-is-and-how-to-run-it"),
        ("run_cases: one group", "run_cases-one-group"),
    ],
)
def test_anchors_are_githubs(title: str, want: str) -> None:
    assert anchor(title) == want


def test_a_broken_reference_is_found(tmp_path: Path) -> None:
    """A negative control: each kind of broken reference is reported."""
    bad = ROOT / "tests" / "data"
    source = bad / "_broken_references.md"
    source.write_text(
        'DESIGN §9, docs/nowhere.md, docs/design.md#no-such, docs/design.md, "No such"\n'
        "docs/design.md §12, STYLE §10\n"
    )
    try:
        found = list(problems_in(source))
    finally:
        source.unlink()
    assert found == [
        "tests/data/_broken_references.md: DESIGN §9: no section 9 in docs/design.md",
        "tests/data/_broken_references.md: STYLE §10: no section 10 in docs/style.md",
        "tests/data/_broken_references.md: docs/nowhere.md does not exist",
        "tests/data/_broken_references.md: docs/design.md#no-such: no such heading",
        'tests/data/_broken_references.md: docs/design.md, "No such": no such heading',
        "tests/data/_broken_references.md: docs/design.md §12: no such section",
    ]
