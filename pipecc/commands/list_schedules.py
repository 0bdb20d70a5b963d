"""`pipecc list`: the bundled schedules, with their placement, parameters and constraints."""

from __future__ import annotations

import argparse

from pipecc.api import bundled_schedules, read_text
from pipecc.commands.common import SubParsers
from pipecc.diagnostics import Span
from pipecc.frontend import ast
from pipecc.frontend.parser import parse


def register(commands: SubParsers) -> None:
    cmd = commands.add_parser(
        "list",
        help="list the bundled schedules with their parameters and constraints",
        description="List the schedules shipped with pipecc (usable by name in every command).",
    )
    cmd.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    rows = [("NAME", "PLACEMENT", "PARAMETERS", "REQUIRES", "ORIGIN")]
    for name, path in bundled_schedules().items():
        text = read_text(path)
        rows.append((name, *summary(parse(text, str(path)), text)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])]
        print("  ".join([*cells, row[-1]]).rstrip())
    return 0


def summary(tree: ast.ScheduleFile, text: str) -> tuple[str, str, str, str]:
    """Placement, parameters with defaults, requirements, and the first comment line."""
    placement = "loop"
    params: list[str] = []
    requires: list[str] = []
    for decl in tree.decls:
        match decl:
            case ast.NamedPlacement(name=name, arg=arg):
                placement = name + (f"({_text(arg.span)})" if arg is not None else "")
            case ast.TablePlacement():
                placement = "table"
            case ast.Param(name=name, default=default):
                params.append(f"{name}={_text(default.span)}")
            case ast.Require(conditions=conditions):
                requires.extend(_text(cond.span) for cond in conditions)
    origin = next(
        (line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#")), ""
    )
    return placement, " ".join(params) or "-", ", ".join(requires) or "-", origin


def _text(span: Span | None) -> str:
    return span.text() if span is not None else ""
