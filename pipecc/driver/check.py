"""The driver of `pipecc verify` and the pytest plugin for one input: load it, lower it if it
is compute-only, verify it.

    outcome = verify_file("schedules/zb_h1.sched", ranks=4, microbatches=8)
    outcome = verify_file("actions.csv")                  # torch CSV, lowered if compute-only

An input pipecc cannot use raises its `InputError`; `pipecc verify` keeps it as an
`Unusable` beside the other inputs' outcomes, so that every input gets its verdict.

`pipecc.verify` itself never imports the compiler; this module decides when it runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pipecc.diagnostics import InputError, LoweringViolation
from pipecc.driver.compile import DEFAULT_LOWERING, Lowering, lower_program, violation_report
from pipecc.driver.load import (
    DEFAULT_BACKEND,
    Choice,
    Resolved,
    RunBackend,
    Source,
    needs_lowering,
    read_source,
    resolve_source,
)
from pipecc.driver.lowering import compute_order, lower_torch
from pipecc.driver.mesh import whole_mesh
from pipecc.ir.program import Backend, Program
from pipecc.passes.torch_lowering import MalformedSchedule
from pipecc.passes.torch_program import LoweringStyle
from pipecc.verify import DEFAULT_OPTIONS, Options, Report, check_order, verify


@dataclass(frozen=True, slots=True)
class Outcome:
    """One verified input: what it was, the report, and notes (ignored CSV cells, lowering)."""

    label: str
    report: Report
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Unusable:
    """An input pipecc cannot use (unreadable, does not parse or compile, malformed): its
    path as given, its label (as an Outcome's), and the error that says why (exit 2)."""

    path: str
    label: str
    error: InputError


def input_label(path: str, ranks: int | None, microbatches: int | None) -> str:
    """How reports name an input: a .sched file with its sizes, a program by its path."""
    if ranks is None or path.endswith((".json", ".csv")):
        return path
    return f"{path} P={ranks} M={microbatches}"


UNRUNNABLE = "unrunnable-order"  # the compute order's own dependency cycle


def verify_program(
    program: Program,
    options: Options = DEFAULT_OPTIONS,
    notes: tuple[str, ...] = (),
    style: LoweringStyle = LoweringStyle.PIPECC,
    path: str = "",
) -> tuple[Report, tuple[str, ...]]:
    """Verify a program; a compute-only one is first checked for a runnable compute order,
    then lowered with the default comm policy (DESIGN §5), or with torch's rules (`style`,
    where a .sched file's program is first reduced to its compute order)."""
    if style is not LoweringStyle.PIPECC:
        return _verify_torch_lowering(compute_order(program, path, style), options, notes, style)
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
    program, whole = whole_mesh(program)  # a pipeline's program on a mesh: every rank of it
    notes = (*notes, *whole)
    if program.backend is Backend.INDEPENDENT_PROGRESS and any(
        m.has_streams for m in options.models
    ):
        notes = (
            *notes,
            f"compiled with the {program.comm} comm policy, which is for gloo: NCCL's "
            "ordered streams deadlock on it by design (verify it with --comm rendezvous)",
        )
    return verify(program, options), notes


def _verify_torch_lowering(
    compute: Program, options: Options, notes: tuple[str, ...], style: LoweringStyle
) -> tuple[Report, tuple[str, ...]]:
    """--lowering torch|torch-defer: the compute order's own checks, then torch's lowering
    (a violation where torch raises), then every check on what torch would run."""
    refused = check_order(compute, options)
    if refused is not None and any(v.code != UNRUNNABLE for v in refused.violations):
        return refused, notes  # coverage or placement: nothing to lower
    try:
        lowered, note = lower_torch(compute, style)
    except MalformedSchedule as err:  # with pipecc's witness of the cycle, if it found one
        found = (err, *(refused.violations if refused else ()))
        peaks = refused.peaks if refused is not None else ()
        return Report(compute, options, found, (), peaks, ()), notes
    if refused is not None:
        return refused, notes
    return verify(lowered, options), (*notes, note)


@dataclass(frozen=True, slots=True)
class Resolution:
    """The backend and the --comm-policy/--align a program is resolved for (`resolve`)."""

    backend: RunBackend = DEFAULT_BACKEND
    lowering: Lowering = DEFAULT_LOWERING


DEFAULT_RESOLUTION = Resolution()


def verify_file(
    path: str,
    *,
    ranks: int | None = None,
    microbatches: int | None = None,
    defines: Mapping[str, int] | None = None,
    options: Options = DEFAULT_OPTIONS,
    style: LoweringStyle = LoweringStyle.PIPECC,
    resolution: Resolution = DEFAULT_RESOLUTION,
) -> Outcome:
    """Load and verify one input (module docstring): the program `pipecc run` runs on
    `resolution.backend` with the same flags (`pipecc.driver.load.resolve`). A .sched file
    verified with torch's lowering is compiled to its compute order only, which torch's
    rules then lower."""
    source = read_source(path, ranks=ranks, microbatches=microbatches, defines=defines)
    if style is not LoweringStyle.PIPECC:
        report, notes = verify_program(source.program, options, source.notes, style, path)
        return Outcome(source.label, report, notes)
    return verify_source(source, options, resolution)[0]


def verify_source(
    source: Source, options: Options, resolution: Resolution = DEFAULT_RESOLUTION
) -> tuple[Outcome, Resolved | None]:
    """Resolve an input as `pipecc run` does on `resolution.backend` and verify that program
    once; the resolved program too, None when its compute order cannot run (a violation)."""
    # a compute order that cannot run is a violation of a .json or .csv, and so is it of a
    # .sched file, whose lowering stops on it (as on hand-placed messages that mismatch)
    if not source.compiled and needs_lowering(source.program):
        refused = check_order(source.program, options)
        if refused is not None:
            return Outcome(source.label, refused, source.notes), None
    try:
        resolved = resolve_source(source, resolution.backend, resolution.lowering, checked=False)
    except LoweringViolation:
        report = violation_report(source.program, options) if source.compiled else None
        if report is None:
            raise
        return Outcome(source.label, report, source.notes), None
    notes = (*resolved.notes, *_lowered_note(source, resolved))
    report, notes = verify_program(resolved.program, options, notes)
    return Outcome(source.label, report, notes), resolved


def _lowered_note(source: Source, resolved: Resolved) -> tuple[str, ...]:
    """The note of a compute-only .json or .csv lowered by the backend's policy."""
    if source.compiled or resolved.choice is not Choice.BACKEND:
        return ()
    return (
        f"compute-only input: sends, receives and waits placed by the {resolved.program.comm} "
        "comm policy (docs/compile.md), then verified",
    )
