"""A Report as text, JSON, or GitHub Actions annotations (`pipecc verify --format`), and an
input pipecc cannot use as one line, one JSON object or one annotation beside the reports."""

from __future__ import annotations

from typing import Any

from pipecc.analysis.memory import format_bytes
from pipecc.diagnostics import ParseError, PipeccError, ScheduleError, Span, Violation
from pipecc.verify import Report


def summary(report: Report, label: str) -> str:
    """One line: the verdict under each model, the violation count, the activation peaks."""
    program = report.program
    verdicts = ", ".join(f"{v.model.value} {v.status.value}" for v in report.verdicts)
    if report.ok:
        size = f"{program.num_instructions()} instructions on {program.num_ranks} ranks"
        head = f"{label}: ok ({size}"
        head += f"; {verdicts})" if verdicts else ")"
    else:
        counts = report.counts()
        kinds = ", ".join(f"{code} {n}" for code, n in counts.items())
        head = f"{label}: {sum(counts.values())} violation(s) ({kinds})"
        if verdicts:
            head += f"; {verdicts}"
    peaks = " ".join(str(p.peak) for p in report.peaks)
    lines = [head, f"peak activations per rank (stage units): {peaks}"]
    if report.byte_peaks:
        in_bytes = " ".join(format_bytes(p.peak) for p in report.byte_peaks)
        budget = format_bytes(report.options.memory_budget or 0.0)
        lines.append(f"predicted peak bytes per rank (budget {budget}): {in_bytes}")
    for totals in report.waits:
        pairs = " ".join(
            f"{d:g}/{p:g}" for d, p in zip(totals.dependency, totals.placement, strict=True)
        )
        lines.append(
            f"wait per rank under {totals.model.value} (dependency-bound/placement-"
            f"bound; makespan {totals.makespan:g}; budget "
            f"{report.options.stall_budget}): {pairs}"
        )
    return "\n".join(lines)


def text(report: Report, label: str, notes: tuple[str, ...] = ()) -> str:
    """Every violation in full (location, caret, notes), then the summary."""
    parts = [str(v) for v in report.violations]
    parts += [
        f"note: {code}: {more} more violation(s) of this kind not shown"
        for code, more in report.dropped
    ]
    parts += [f"note: {note}" for note in (*report.notes, *notes)]
    parts.append(summary(report, label))
    return "\n\n".join(parts) + "\n"


def _span_json(span: Span | None) -> dict[str, Any]:
    if span is None:
        return {}
    return {"file": span.file, "line": span.line, "col": span.col}


def violation_json(v: Violation) -> dict[str, Any]:
    return {
        "code": v.code,
        "message": v.message,
        "rank": v.rank,
        "index": v.index,
        **_span_json(v.span),
        "notes": [{"message": text, **_span_json(span)} for span, text in v.notes],
    }


def as_json(report: Report, label: str, notes: tuple[str, ...] = ()) -> dict[str, Any]:
    """The report as a JSON-ready object (docs/verify.md lists the fields)."""
    program = report.program
    return {
        "input": label,
        "schedule": program.schedule,
        "ranks": program.num_ranks,
        "microbatches": program.num_microbatches,
        "ok": report.ok,
        "verdicts": {v.model.value: v.status.value for v in report.verdicts},
        "violations": [violation_json(v) for v in report.violations],
        "dropped": dict(report.dropped),
        "peak_activations": [
            {"rank": p.rank, "peak": p.peak, "index": p.index} for p in report.peaks
        ],
        **_byte_peaks(report),
        "waits": [
            {
                "model": t.model.value,
                "makespan": t.makespan,
                "dependency_bound": list(t.dependency),
                "placement_bound": list(t.placement),
            }
            for t in report.waits
        ],
        "notes": [*report.notes, *notes],
    }


def _byte_peaks(report: Report) -> dict[str, Any]:
    """With --memory-budget: each rank's predicted peak in bytes (simulate's names)."""
    if not report.byte_peaks:
        return {}
    return {
        "peak_bytes": [
            {
                "rank": rank,
                "peak_bytes": p.peak,
                "peak_bytes_at": p.at,
                "peak_breakdown": p.breakdown.to_json(),
            }
            for rank, p in enumerate(report.byte_peaks)
        ]
    }


def _escape(text: str, *, prop: bool = False) -> str:
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    if prop:
        text = text.replace(":", "%3A").replace(",", "%2C")
    return text


def error_annotation(err: PipeccError, title: str, *, file: str | None = None) -> str:
    """`::error file=…,line=…,col=…,title=…::message` for an error at its span (or at
    `file`, without a line, when it has none)."""
    props = []
    if err.span is not None:
        props += [
            f"file={_escape(err.span.file, prop=True)}",
            f"line={err.span.line}",
            f"col={err.span.col}",
        ]
    elif file is not None:
        props.append(f"file={_escape(file, prop=True)}")
    props.append(f"title={_escape(title, prop=True)}")
    return f"::error {','.join(props)}::{_escape(err.message)}"


def annotation(v: Violation, label: str) -> str:
    """The annotation of one violation, titled with its code and the input."""
    return error_annotation(v, f"pipecc verify [{v.code}] {label}")


def input_error_code(err: PipeccError) -> str:
    """What kind of unusable input: `parse` (syntax), `compile` (a schedule that cannot be
    compiled at these sizes, a violated `require` included), or `input` (unreadable file,
    malformed JSON or CSV, unknown name)."""
    if isinstance(err, ParseError):
        return "parse"
    if isinstance(err, ScheduleError):
        return "compile"
    return "input"


def unusable_line(label: str, err: PipeccError) -> str:
    """The one-line verdict of an input pipecc cannot use, beside the others' summaries."""
    where = f"{err.span.location()}: " if err.span is not None else ""
    first = err.message.splitlines()[0] if err.message else ""
    return f"{label}: cannot use this input ({input_error_code(err)}): {where}{first}"


def unusable_annotation(label: str, path: str, err: PipeccError) -> str:
    """The `::error` of an input pipecc cannot use: at the error's file, line and column."""
    return error_annotation(err, f"pipecc verify [{input_error_code(err)}] {label}", file=path)


def error_json(err: PipeccError) -> dict[str, Any]:
    """Why an input cannot be used: `code` (parse, compile, input), `message`, and where."""
    return {"code": input_error_code(err), "message": err.message, **_span_json(err.span)}


def github(report: Report, label: str, notes: tuple[str, ...] = ()) -> str:
    """One annotation per violation, then the summary as a notice."""
    lines = [annotation(v, label) for v in report.violations]
    status = "ok" if report.ok else "failed"
    lines.append(
        f"::notice title={_escape(f'pipecc verify {status}', prop=True)}::"
        f"{_escape(summary(report, label))}"
    )
    lines += [f"::notice::{_escape(note)}" for note in (*report.notes, *notes)]
    return "\n".join(lines) + "\n"
