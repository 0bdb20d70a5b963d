"""The syntax tree of a .sched file: frozen nodes, each with the span it came from.

The parser builds these and nothing else; names are resolved and values computed later, by
`pipecc.passes.expand`, for each (P, M, rank).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pipecc.diagnostics import Span
from pipecc.ir.ops import Kind, Msg


class BinOp(enum.Enum):
    ADD = "+"
    SUB = "-"
    MUL = "*"
    DIV = "/"  # exact division: an inexact result is an error at its location
    FLOORDIV = "//"
    MOD = "%"
    EQ = "=="
    NE = "!="
    LT = "<"
    LE = "<="
    GT = ">"
    GE = ">="
    AND = "and"
    OR = "or"


@dataclass(frozen=True, slots=True)
class Num:
    value: int | bool
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Name:
    id: str
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Neg:
    operand: Expr
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Not:
    operand: Expr
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Binary:
    op: BinOp
    left: Expr
    right: Expr
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Call:
    func: str
    args: tuple[Expr, ...]
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Conditional:
    test: Expr
    then: Expr
    orelse: Expr
    span: Span | None = field(default=None, compare=False, repr=False)


Expr = Num | Name | Neg | Not | Binary | Call | Conditional


# ---- statements inside a phase -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpRef:
    """One computation as written: `F0`, `W`, `F(c)`, `B1[M - 1 - i]`.

    `chunk` is None for a bare letter (plain `W` takes the oldest pending I of the rank;
    plain F/B/I mean chunk 0 when the rank holds one chunk). `mb` is None when the compiler
    assigns the next microbatch of the op's counter.
    """

    kind: Kind
    chunk: Expr | None
    mb: Expr | None
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class OpStmt:
    """One instruction: a single op, or two fused ops `F0&B1` (forward first)."""

    ops: tuple[OpRef, ...]
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class CommStmt:
    """A hand-placed `send act|grad` or `recv act|grad` (see docs/dsl.md, "Placing comms")."""

    send: bool
    what: Msg
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class GroupStmt:
    """`group { ... }`: hand-placed sends and recvs posted together."""

    ops: tuple[CommStmt, ...]
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class WaitStmt:
    """`wait`: complete every hand-placed op posted so far and not yet waited."""

    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Let:
    name: str
    value: Expr
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Repeat:
    count: Expr
    body: tuple[Stmt, ...]
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class For:
    var: str
    start: Expr
    stop: Expr
    body: tuple[Stmt, ...]
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class If:
    branches: tuple[tuple[Expr, tuple[Stmt, ...]], ...]
    orelse: tuple[Stmt, ...]
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Fill:
    """`fill F I W cap N { ... }`: where the rank would idle inside the block (in the unit-cost
    timing), it runs a later written op of one of `kinds` that is ready (F, B, I), or its oldest
    pending W (docs/dsl.md 4.7)."""

    kinds: tuple[Kind, ...]
    cap: Expr | None
    body: tuple[Stmt, ...]
    span: Span | None = field(default=None, compare=False, repr=False)


Stmt = OpStmt | CommStmt | GroupStmt | WaitStmt | Let | Repeat | For | If | Fill


# ---- top-level declarations ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScheduleName:
    name: str
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    default: Expr
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Require:
    conditions: tuple[Expr, ...]
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Pad:
    """`pad microbatches to N`: generate for N ≥ M microbatches, drop ops on mb ≥ M."""

    count: Expr
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Recompute:
    """`recompute stage 0, P - 1`: these stages recompute their forward in full in their
    backward (the program's `recompute`)."""

    stages: tuple[Expr, ...]
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class NamedPlacement:
    name: str
    arg: Expr | None
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class ChunkEntry:
    chunk: int
    pipe: Expr | None
    stage: Expr
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class TablePlacement:
    """An explicit placement: per chunk, its pipe and stage as expressions of `rank`."""

    entries: tuple[ChunkEntry, ...]
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    body: tuple[Stmt, ...]
    span: Span | None = field(default=None, compare=False, repr=False)


Decl = (
    ScheduleName | Param | Require | Pad | Recompute | NamedPlacement | TablePlacement | Let | Phase
)


@dataclass(frozen=True, slots=True)
class ScheduleFile:
    """A parsed .sched file: its declarations in source order."""

    path: str
    decls: tuple[Decl, ...]
