"""Compile a .sched file: the front end (parse, expand, assign microbatches), then the
passes in `PASSES`.

    program = compile_schedule("schedules/zb_h1.sched", ranks=4, microbatches=8)
    program = compile_schedule("dualpipe", ranks=8, microbatches=20)   # a bundled schedule
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from pipecc.driver.files import read_text, resolve_schedule
from pipecc.frontend.ast import Param, ScheduleFile
from pipecc.frontend.expand import expand
from pipecc.frontend.parser import parse
from pipecc.ir.program import Program
from pipecc.passes.assign_microbatches import assign_microbatches
from pipecc.passes.insert_comms import insert_comms
from pipecc.perf import paused_gc

Pass = Callable[[Program], Program]
PASSES: tuple[Pass, ...] = (insert_comms,)


def compile_source(
    text: str,
    path: str,
    *,
    ranks: int,
    microbatches: int,
    defines: Mapping[str, int] | None = None,
) -> Program:
    """Compile .sched text: parse, expand for (P, M, -D), assign microbatches, lower."""
    return compile_tree(parse(text, path), ranks=ranks, microbatches=microbatches, defines=defines)


def compile_tree(
    tree: ScheduleFile,
    *,
    ranks: int,
    microbatches: int,
    defines: Mapping[str, int] | None = None,
) -> Program:
    """Compile a parsed .sched file for one size (a sweep parses once, compiles many)."""
    with paused_gc():
        streams = expand(tree, ranks=ranks, microbatches=microbatches, defines=defines)
        program = assign_microbatches(streams)
        del streams  # freed before lowering, which reuses its memory
        for step in PASSES:
            program = step(program)
    return program


def compile_schedule(
    name_or_path: str | Path,
    *,
    ranks: int,
    microbatches: int,
    defines: Mapping[str, int] | None = None,
) -> Program:
    """Compile a .sched file (or a bundled schedule by name) for P ranks and M microbatches."""
    path = resolve_schedule(str(name_or_path))
    return compile_source(
        read_text(path), str(path), ranks=ranks, microbatches=microbatches, defines=defines
    )


def schedule_parameters(path: str | Path) -> tuple[str, ...]:
    """The names of the parameters a .sched file declares (`param NAME = ...`)."""
    path = Path(path)
    tree = parse(read_text(path), str(path))
    return tuple(decl.name for decl in tree.decls if isinstance(decl, Param))
