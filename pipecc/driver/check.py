"""The driver of `pipecc verify` and the pytest plugin for one input: load it, lower it if it
is compute-only, verify it.

    outcome = verify_file("schedules/zb_h1.sched", ranks=4, microbatches=8)
    outcome = verify_file("actions.csv")                  # torch CSV, lowered if compute-only

`pipecc.verify` itself never imports the compiler; this module decides when it runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pipecc.driver.compile import lower_program
from pipecc.driver.load import load, needs_lowering
from pipecc.ir.program import Backend, Program
from pipecc.verify import DEFAULT_OPTIONS, Options, Report, check_order, verify


@dataclass(frozen=True, slots=True)
class Outcome:
    """One verified input: what it was, the report, and notes (ignored CSV cells, lowering)."""

    label: str
    report: Report
    notes: tuple[str, ...] = ()


def verify_program(
    program: Program, options: Options = DEFAULT_OPTIONS, notes: tuple[str, ...] = ()
) -> tuple[Report, tuple[str, ...]]:
    """Verify a program; a compute-only one is first checked for a runnable compute order,
    then lowered with the default comm policy (DESIGN §5)."""
    if needs_lowering(program):
        refused = check_order(program, options)
        if refused is not None:
            return refused, notes
        program = lower_program(program)
        notes = (
            *notes,
            "compute-only input: sends, receives and waits placed by the "
            "default comm policy (docs/compile.md), then verified",
        )
    if program.backend is Backend.INDEPENDENT_PROGRESS and any(
        m.has_streams for m in options.models
    ):
        notes = (
            *notes,
            f"compiled with the {program.comm} comm policy, which is for gloo: NCCL's "
            "ordered streams deadlock on it by design (verify it with --comm rendezvous)",
        )
    return verify(program, options), notes


def verify_file(
    path: str,
    *,
    ranks: int | None = None,
    microbatches: int | None = None,
    defines: Mapping[str, int] | None = None,
    options: Options = DEFAULT_OPTIONS,
) -> Outcome:
    """Load and verify one input (module docstring)."""
    program, notes = load(
        path, ranks=ranks, microbatches=microbatches, defines=defines, lowering=None
    )
    report, notes = verify_program(program, options, notes)
    label = (
        path
        if ranks is None or path.endswith((".json", ".csv"))
        else (f"{path} P={ranks} M={microbatches}")
    )
    return Outcome(label, report, notes)
