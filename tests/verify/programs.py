"""Small edits of compiled programs for the verifier's error tests.

Edits keep wait indices pointing at the same ops (mutants._rebuild renumbers them).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from helpers import ROOT, compile_bundled
from mutants import _rebuild

from pipecc.diagnostics import Violation
from pipecc.ir.ops import Instr
from pipecc.ir.program import Program
from pipecc.verify import Options, Report, verify


def compiled(name: str, ranks: int, microbatches: int, **defines: int) -> Program:
    return compile_bundled(name, ranks, microbatches, **defines)


def with_rank(program: Program, rank: int, instrs: tuple[Instr, ...]) -> Program:
    ranks = list(program.ranks)
    ranks[rank] = instrs
    return replace(program, ranks=tuple(ranks))


def move(program: Program, rank: int, index: int, to: int) -> Program:
    """Move instruction `index` of `rank` to position `to` (waits follow their ops)."""
    order = [(i, False) for i in range(len(program.ranks[rank]))]
    entry = order.pop(index)
    order.insert(to, entry)
    return with_rank(program, rank, _rebuild(program.ranks[rank], order))


def drop(program: Program, rank: int, index: int) -> Program:
    order = [(i, False) for i in range(len(program.ranks[rank])) if i != index]
    return with_rank(program, rank, _rebuild(program.ranks[rank], order))


def duplicate(program: Program, rank: int, index: int, to: int) -> Program:
    order = [(i, False) for i in range(len(program.ranks[rank]))]
    order.insert(to, (index, True))
    return with_rank(program, rank, _rebuild(program.ranks[rank], order))


def put(program: Program, rank: int, index: int, instr: Instr) -> Program:
    instrs = list(program.ranks[rank])
    instrs[index] = instr
    return with_rank(program, rank, tuple(instrs))


def report(program: Program, **options: object) -> Report:
    return verify(program, Options(**options))  # type: ignore[arg-type]


def codes(result: Report) -> list[str]:
    return [v.code for v in result.violations]


def rendered(v: Violation | Exception) -> str:
    """The message as printed, with this checkout's path made relative."""
    return str(v).replace(str(ROOT) + "/", "")


def first(result: Report, code: str) -> Violation:
    return next(v for v in result.violations if v.code == code)


DATA = Path(__file__).resolve().parent / "data"
