"""The library's entry points: compile a .sched file, or load a compiled program, in one call.

    program = compile_schedule("schedules/zb_h1.sched", ranks=4, microbatches=8)
    program = compile_schedule("dualpipe", ranks=8, microbatches=20)   # a bundled schedule
    program = load_program("prog.json")

They live in `pipecc.driver`; this module names the ones a user (and the runtime's
launcher) imports. Any input (.sched, .json, .csv), checked and lowered as the commands do,
is `pipecc.driver.load.load` (it imports the verifier, which compiling does not need).
"""

from __future__ import annotations

from pipecc.driver.compile import (
    Alignment,
    Lowering,
    compile_schedule,
    compile_source,
    compile_tree,
    schedule_parameters,
)
from pipecc.driver.files import bundled_schedules, load_program, read_text, resolve_schedule

__all__ = [
    "Alignment",
    "Lowering",
    "bundled_schedules",
    "compile_schedule",
    "compile_source",
    "compile_tree",
    "load_program",
    "read_text",
    "resolve_schedule",
    "schedule_parameters",
]
