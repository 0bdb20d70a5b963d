"""Source spans and the one error type every layer raises.

This module is the bottom layer: it imports only the standard library, and every other
module of pipecc may import it. A user-facing failure is a `PipeccError`; its `str()` is the
whole message, in the `file:line:col: error: ...` form with a caret snippet under the source
line. `exit_code` says what the command line returns for it (DESIGN §8): 2 for input pipecc
cannot use, 1 for a schedule or program that is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SourceFile:
    """The text of one input file, kept so that errors can quote the offending line."""

    name: str
    text: str = field(repr=False)

    def line_text(self, line: int) -> str:
        """Return line `line` (1-based) without its newline, or "" when out of range."""
        lines = self.text.splitlines()
        if 1 <= line <= len(lines):
            return lines[line - 1]
        return ""


@dataclass(frozen=True, slots=True)
class Span:
    """A region of a source file: 1-based line and column, end column exclusive."""

    source: SourceFile | None
    line: int
    col: int
    end_line: int | None = None
    end_col: int | None = None

    @property
    def file(self) -> str:
        return self.source.name if self.source is not None else "<input>"

    def location(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"

    def text(self) -> str:
        """The source text the span covers when it lies on one line, else ""."""
        if self.source is None or self.end_line != self.line or self.end_col is None:
            return ""
        return self.source.line_text(self.line)[self.col - 1 : self.end_col - 1]

    def snippet(self) -> str:
        """The source line and a caret line under the span, or "" without source text."""
        if self.source is None:
            return ""
        text = self.source.line_text(self.line)
        if not text:
            return ""
        width = 1
        if self.end_line == self.line and self.end_col is not None:
            width = max(1, self.end_col - self.col)
        width = min(width, max(1, len(text) - self.col + 1))
        gutter = f"{self.line:>5} | "
        caret = " " * (len(gutter) - 2) + "| " + " " * (self.col - 1) + "^" * width
        return f"{gutter}{text}\n{caret}"


Note = tuple[Span | None, str]


class PipeccError(Exception):
    """A failure the user must see: a message, an optional location, optional notes.

    Subclasses set `exit_code`: 2 when pipecc cannot use its input, 1 when the schedule or
    program is wrong (DESIGN §8).
    """

    exit_code = 2

    def __init__(
        self, message: str, span: Span | None = None, *, notes: tuple[Note, ...] = ()
    ) -> None:
        super().__init__(message)
        self.message = message
        self.span = span
        self.notes = notes

    @property
    def kind(self) -> str:
        """The word before the message: `error`, or `error[code]` for a violation."""
        return "error"

    def __str__(self) -> str:
        parts = [_render_one(self.span, self.kind, self.message)]
        parts.extend(_render_one(span, "note", text) for span, text in self.notes)
        return "\n".join(parts)


def _render_one(span: Span | None, kind: str, message: str) -> str:
    if span is None:
        return f"{kind}: {message}"
    head = f"{span.location()}: {kind}: {message}"
    snippet = span.snippet()
    return f"{head}\n{snippet}" if snippet else head


class InputError(PipeccError):
    """Input pipecc cannot use: a missing or unreadable file, a bad flag, malformed JSON/CSV."""


class ParseError(InputError):
    """A `.sched` file that does not follow the grammar."""


class ScheduleError(InputError):
    """A schedule that cannot be compiled into a complete program (unknown name, violated
    `require`, negative loop count, a stage or microbatch left without its ops, ...)."""


class RequirementError(ScheduleError):
    """A `require` the sizes violate: the schedule is not defined there (a sweep or a
    comparison skips that size). `requirement` is the condition as written."""

    def __init__(self, requirement: str, values: str, span: Span | None = None) -> None:
        got = f", got {values}" if values else ""
        super().__init__(f"requires {requirement}{got}", span)
        self.requirement = requirement


class LoweringViolation(ScheduleError):
    """A compute order that cannot run, or hand-placed messages that two ranks post in
    different orders: no correct program exists, and the verifier says why (the cycle, the
    two messages). Raised by the comm passes; the driver replaces it by the verifier's
    report of the program as far as it can be built (`ViolatedScheduleError`, exit 1)."""


class RefusedProgramError(InputError):
    """A compiled program or torch CSV that fails the verifier's input checks, given to a
    command that needs a well-formed program (`verify` reports the same defects as
    violations). Shown as the violations, then one line that names the input."""

    def __init__(self, label: str, violations: tuple[Violation, ...], counts: str) -> None:
        super().__init__(
            f"{label}: pipecc cannot use this program: it fails the verifier's input checks "
            f"({counts}; 'pipecc verify {label}' shows every check)"
        )
        self.violations = violations

    def __str__(self) -> str:
        return "\n\n".join([*(str(v) for v in self.violations), f"error: {self.message}"])


class CostModelError(InputError):
    """A cost model that cannot be used (unknown key, negative duration, bad TOML)."""


class ProgramError(PipeccError):
    """A compiled program that is wrong: found by the verifier, or by the runtime."""

    exit_code = 1


class ViolatedScheduleError(ProgramError):
    """A .sched file that compiles to no correct program at these sizes (a compute order
    that deadlocks, hand-placed messages that mismatch): shown as the verifier's violations,
    then one line that names the input (exit 1, as `pipecc verify` of it)."""

    def __init__(self, label: str, violations: tuple[Violation, ...], counts: str) -> None:
        super().__init__(
            f"{label}: the schedule is wrong: the verifier finds {counts} ('pipecc verify' "
            "of it shows every check)"
        )
        self.violations = violations

    def __str__(self) -> str:
        return "\n\n".join([*(str(v) for v in self.violations), f"error: {self.message}"])


class SetupError(ProgramError):
    """The runtime's program, stage modules and boundary shapes do not fit together (a
    program for another world size, a chunk without its module, a shape or dtype mismatch
    between stages). Raised on the first step, on every rank of the pipeline."""


class RankError(ProgramError):
    """A rank failed while running a program; the message names the rank and instruction."""


class RecvTimeoutError(RankError):
    """A posted op did not complete within the runtime's timeout."""


# ---- verifier violations (docs/verify.md) ---------------------------------------------------


class Violation(ProgramError):
    """A defect `pipecc verify` found in a program. `code` names the check; `rank` and
    `index` locate the instruction when there is one."""

    code = "violation"

    def __init__(
        self,
        message: str,
        span: Span | None = None,
        *,
        notes: tuple[Note, ...] = (),
        rank: int | None = None,
        index: int | None = None,
    ) -> None:
        super().__init__(message, span, notes=notes)
        self.rank = rank
        self.index = index

    @property
    def kind(self) -> str:
        return f"error[{self.code}]"


class DeadlockError(Violation):
    """Under the chosen comm model some rank waits forever (the message names the cycle)."""

    code = "deadlock"


class NeedsBufferingError(Violation):
    """The program completes only if sends are buffered (eager): it hangs for large
    messages or across nodes."""

    code = "needs-buffering"


class MismatchError(Violation):
    """The k-th send of a rank pair and the k-th receive carry different messages."""

    code = "mismatch"


class OrphanError(Violation):
    """A send or receive that nothing matches."""

    code = "orphan"


class RouteError(Violation):
    """A send or receive whose peer is not the rank that holds the neighbouring stage."""

    code = "route"


class UnwaitedError(Violation):
    """A posted send or receive that no wait completes."""

    code = "unwaited"


class DoubleWaitError(Violation):
    """An op listed by two waits."""

    code = "double-wait"


class WaitTargetError(Violation):
    """A wait that lists an index that is not a send or receive of its rank."""

    code = "bad-wait"


class BufferReuseError(Violation):
    """A message posted again on a rank while its previous post is still outstanding."""

    code = "buffer-reuse"


class DataflowError(Violation):
    """A computation or send placed before the data it needs exists."""

    code = "dataflow"


class ForwardBeforeInputError(DataflowError):
    """A forward before the forward of the stage upstream on the same rank."""

    code = "forward-before-input"


class BackwardBeforeGradientError(DataflowError):
    """A backward before the backward of the stage downstream on the same rank."""

    code = "backward-before-gradient"


class BackwardBeforeForwardError(DataflowError):
    """A backward (B or I) before its own forward."""

    code = "backward-before-forward"


class WeightBeforeInputGradError(DataflowError):
    """A W before the I it completes."""

    code = "weight-before-input-grad"


class SendBeforeComputeError(DataflowError):
    """A send posted before the computation that produces its tensor."""

    code = "send-before-compute"


class RecvAfterUseError(DataflowError):
    """A computation that consumes a received tensor before its receive is posted."""

    code = "recv-after-use"


class MissingRecvError(DataflowError):
    """A computation that needs a tensor from another rank that its rank never receives."""

    code = "missing-recv"


class UnrunnableOrderError(DataflowError):
    """A compute order that cannot run under any lowering: a cycle of program order and
    data dependencies."""

    code = "unrunnable-order"


class CoverageError(Violation):
    """A (pipe, stage, mb) without exactly one F and either one B or one I and one W."""

    code = "coverage"


class MisplacedOpError(Violation):
    """A computation on a rank or chunk that does not hold its stage."""

    code = "placement"


class ActivationLimitError(Violation):
    """Peak live activations on a rank above `--max-activations`."""

    code = "memory"


class MemoryBudgetError(Violation):
    """A rank whose predicted peak in bytes is above `--memory-budget`."""

    code = "memory-budget"


class StallError(Violation):
    """A wait longer than `--stall-budget` that better-placed comm ops would remove (a
    placement-bound wait, docs/align.md)."""

    code = "stall"
