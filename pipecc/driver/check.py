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
from pipecc.driver.compile import DEFAULT_LOWERING, Lowering, violation_report
from pipecc.driver.load import (
    DEFAULT_BACKEND,
    Choice,
    Resolved,
    RunBackend,
    Source,
    read_source,
    refuse_torch_lowering,
    resolve_source,
)
from pipecc.driver.mesh import whole_mesh
from pipecc.ir.program import Backend, Program
from pipecc.passes.torch_lowering import MalformedSchedule
from pipecc.passes.torch_program import LoweringStyle, compute_only
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
    program: Program, options: Options = DEFAULT_OPTIONS, notes: tuple[str, ...] = ()
) -> tuple[Report, tuple[str, ...]]:
    """Verify a program as any input is verified (`verify_source`, read as a .json is): a
    compute-only one is checked for a runnable order, then its comm ops placed by the
    default backend's policy."""
    source = Source.of(program.schedule, program, notes, compiled=False)
    outcome, _ = verify_source(source, options)
    return outcome.report, outcome.notes


def _verify_resolved(
    program: Program, options: Options, notes: tuple[str, ...]
) -> tuple[Report, tuple[str, ...]]:
    """Verify a resolved program (its comm ops placed): a pipeline's program on a mesh is
    replayed as the whole mesh."""
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
    resolution: Resolution = DEFAULT_RESOLUTION,
) -> Outcome:
    """Load and verify one input (module docstring): the program `pipecc run` runs on
    `resolution.backend` with the same flags (`pipecc.driver.load.resolve`)."""
    source = read_source(path, ranks=ranks, microbatches=microbatches, defines=defines)
    return verify_source(source, options, resolution)[0]


def verify_source(
    source: Source, options: Options, resolution: Resolution = DEFAULT_RESOLUTION
) -> tuple[Outcome, Resolved | None]:
    """Resolve an input as `pipecc run` does on `resolution.backend` (the one resolution,
    `driver/load.resolve_source`, torch's lowering one of its branches) and verify that
    program once; the resolved program too, None when none could be placed (a violation:
    a compute order that cannot run, hand-placed messages that mismatch, a torch lowering
    that fails where torch's raises)."""
    lowering = resolution.lowering
    refused = _order_refused(source, lowering, options)
    if refused is not None and _stops(refused, lowering):
        return Outcome(source.label, refused, source.notes), None
    try:
        resolved = resolve_source(source, resolution.backend, lowering, checked=False)
    except LoweringViolation:
        report = violation_report(source.program, options) if source.compiled else None
        if report is None:
            raise
        return Outcome(source.label, report, source.notes), None
    except MalformedSchedule as err:  # with pipecc's witness of the cycle, if it found one
        found = (err, *(refused.violations if refused else ()))
        peaks = refused.peaks if refused is not None else ()
        report = Report(compute_only(source.program), options, found, (), peaks, ())
        return Outcome(source.label, report, source.notes), None
    if refused is not None:  # torch lowered an order pipecc finds unrunnable
        return Outcome(source.label, refused, source.notes), None
    notes = (*resolved.notes, *_lowered_note(source, resolved))
    report, notes = _verify_resolved(resolved.program, options, notes)
    return Outcome(source.label, report, notes), resolved


def _order_refused(source: Source, lowering: Lowering, options: Options) -> Report | None:
    """The compute order's own checks, where the comm ops are still to be placed: a
    compute-only .json or .csv, and any input a torch lowering places afresh (a .json or
    .csv with comm ops is refused there: torch's rules lower a compute order)."""
    if lowering.style is not LoweringStyle.PIPECC:
        refuse_torch_lowering(source, lowering.style)
        return check_order(compute_only(source.program), options)
    if not source.compiled and source.needs_placement:
        return check_order(source.program, options)
    return None


def _stops(refused: Report, lowering: Lowering) -> bool:
    """Whether the order's violations end the check before any lowering: always for
    pipecc's own; for torch's only coverage or placement (an order pipecc finds unrunnable
    is lowered anyway, to report where torch's own lowering raises)."""
    if lowering.style is LoweringStyle.PIPECC:
        return True
    return any(v.code != UNRUNNABLE for v in refused.violations)


def _lowered_note(source: Source, resolved: Resolved) -> tuple[str, ...]:
    """The note of a compute-only .json or .csv lowered by the backend's policy."""
    if source.compiled or resolved.choice is not Choice.BACKEND:
        return ()
    return (
        f"compute-only input: sends, receives and waits placed by the {resolved.program.comm} "
        "comm policy (docs/compile.md), then verified",
    )
