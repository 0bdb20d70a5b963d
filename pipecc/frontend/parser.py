"""Parse .sched text into a `ScheduleFile` (grammar: grammars/sched.lark).

The grammar is loaded once and cached (LALR, positions propagated). One `Transformer` builds
the AST nodes of `pipecc.frontend.ast`, each with its span; nothing is resolved here. Syntax
errors become `ParseError`s with file:line:col, a caret and what was expected there.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Any

import lark
from lark import Token, Transformer, v_args
from lark.tree import Meta

from pipecc.diagnostics import ParseError, SourceFile, Span
from pipecc.frontend import ast
from pipecc.ir.ops import Kind, Msg


@functools.cache
def _parser() -> lark.Lark:
    grammar = resources.files("pipecc.grammars").joinpath("sched.lark").read_text("utf-8")
    return lark.Lark(
        grammar,
        parser="lalr",
        start=["start", "op_stmt"],
        propagate_positions=True,
        maybe_placeholders=True,
    )


def parse(text: str, path: str = "<input>") -> ast.ScheduleFile:
    """Parse the text of a .sched file.

    Raises ParseError (with the location and a caret) when the text does not follow the grammar.
    """
    source = SourceFile(path, text)
    try:
        tree = _parser().parse(text, start="start")
    except lark.UnexpectedInput as err:
        raise _parse_error(err, source) from err
    try:
        decls = _Builder(source).transform(tree)
    except lark.exceptions.VisitError as err:  # a ParseError raised while building the AST
        if isinstance(err.orig_exc, ParseError):
            raise err.orig_exc from None
        raise
    return ast.ScheduleFile(path, tuple(decls))


def parse_op_name(text: str, path: str = "<op>") -> tuple[tuple[Kind, int, int], ...]:
    """The computations an op's name names, as (kind, chunk, mb): `W0.0` and `W0[0]` give
    ((W, 0, 0),), `F0.4&B1.1` and `F0[4]&B1[1]` the fused pair. Chunk and microbatch must be
    integer literals (a name picks one instruction, nothing is evaluated).

    Raises ParseError when the text is not one op statement or leaves a number out.
    """
    source = SourceFile(path, text)
    try:
        tree = _parser().parse(text, start="op_stmt")
    except lark.UnexpectedInput as err:
        raise _parse_error(err, source) from err
    try:
        stmt: object = _Builder(source).transform(tree)  # an op_stmt's tree builds an OpStmt
    except lark.exceptions.VisitError as err:
        if isinstance(err.orig_exc, ParseError):
            raise err.orig_exc from None
        raise
    assert isinstance(stmt, ast.OpStmt)
    named = []
    for op in stmt.ops:
        if not isinstance(op.chunk, ast.Num) or not isinstance(op.mb, ast.Num):
            raise ParseError(
                "an op's name gives its chunk and microbatch as numbers: F0.3 or F0[3]", op.span
            )
        named.append((op.kind, int(op.chunk.value), int(op.mb.value)))
    return tuple(named)


# ---- syntax errors -------------------------------------------------------------------------

_TOKEN_WORDS = {
    "LBRACE": "'{'",
    "RBRACE": "'}'",
    "LPAR": "'('",
    "RPAR": "')'",
    "LSQB": "'['",
    "RSQB": "']'",
    "COMMA": "','",
    "COLON": "':'",
    "EQUAL": "'='",
    "AMPERSAND": "'&'",
    "NAME": "a name",
    "INT": "an integer",
    "OPCODE": "an op (F0, B1, I1, W, ...)",
    "OPNAME": "an op (F0, B1, I1, W, ...)",
    "MSGKIND": "'act' or 'grad'",
    "COMPOP": "a comparison",
    "__ANON_0": "'..'",
    "$END": "end of file",
}


def _describe_expected(expected: set[str]) -> str:
    names = sorted(
        expected,
        key=lambda name: (name not in _FIRST, _FIRST.get(name, 0), name in _LAST, name),
    )
    words = list(dict.fromkeys(_TOKEN_WORDS.get(name, _keyword(name)) for name in names))
    if len(words) > 8:
        words = words[:8] + ["..."]
    return ", ".join(words)


# What a reader most needs to see first in "expected ..." lists.
_FIRST = {"OPCODE": 0, "RBRACE": 1, "NAME": 2, "INT": 3, "LBRACE": 4}
_LAST = {"FILL"}  # after the other keywords: the everyday ones are named first
_TOP_LEVEL = {"phase", "placement", "schedule", "param", "require", "pad"}


def _keyword(name: str) -> str:
    pattern = _terminal_patterns().get(name)
    return f"'{pattern}'" if pattern else name.lower()


@functools.cache
def _terminal_patterns() -> dict[str, str]:
    patterns: dict[str, str] = {}
    for terminal in _parser().terminals:
        if isinstance(terminal.pattern, lark.lexer.PatternStr):
            patterns[terminal.name] = terminal.pattern.value
    return patterns


def _parse_error(err: lark.UnexpectedInput, source: SourceFile) -> ParseError:
    line = getattr(err, "line", 1) or 1
    col = getattr(err, "column", 1) or 1
    expected: set[str]
    if isinstance(err, lark.UnexpectedEOF):
        line, col = _end_position(source.text)
        message = "unexpected end of file"
        expected = {str(name) for name in err.expected}
    elif isinstance(err, lark.UnexpectedToken):
        token: Token = err.token
        shown = "end of file" if token.type == "$END" else repr(str(token))
        message = f"unexpected {shown}"
        expected = set(err.expected)
        if token.type == "$END":
            line, col = _end_position(source.text)
    elif isinstance(err, lark.UnexpectedCharacters):
        at = err.pos_in_stream or 0
        char = source.text[at] if at < len(source.text) else "?"
        message = f"unexpected character {char!r}"
        expected = set(err.allowed or ())
    else:
        message, expected = str(err), set()
    token_text = None
    if isinstance(err, lark.UnexpectedToken) and err.token.type != "$END":
        token_text = str(err.token)
    if isinstance(err, lark.UnexpectedCharacters):
        hint = _dot_hint(source.text, err.pos_in_stream or 0)
    else:
        hint = _hint(message, expected, token_text)
    if expected and not hint.startswith("comparisons"):
        message += f"; expected {_describe_expected(set(expected))}"
    if hint:
        message += f" ({hint})"
    width = _token_width(err)
    return ParseError(message, Span(source, line, col, line, col + width))


def _hint(message: str, expected: Any, token: str | None) -> str:
    names = set(expected or ())
    if token is not None and token in {"<", ">", "<=", ">=", "==", "!="}:
        return "comparisons do not chain: write 0 < M and M < 5"
    if token == "&":
        return "a fused op is two ops joined by '&': F0&B1"
    if "RBRACE" in names and (token is None or token in _TOP_LEVEL):
        return "is a '}' missing?"
    if "OPCODE" in names and token is not None and token.isidentifier():
        return "a block holds ops (F0, B1, I1, W, F0&B1), repeat/for/if/let, and send/recv/wait"
    return ""


# What stands before and after a '.' that does not make an op name like F0.3.
_BEFORE_DOT = re.compile(r"(?:(?<![A-Za-z0-9_])([FBIW])([0-9]*)|(\)))(\s*)$")
_AFTER_DOT = re.compile(r"\s*([A-Za-z0-9_]*)")


def _dot_hint(text: str, at: int) -> str:
    """A hint for a '.' next to an op that is not the name pipecc prints (`F0.3`): `F0.i`,
    `F.3`, `F(c).3`, `F0 .3`, `F0.3.1`. Empty when the '.' is not next to an op."""
    if not text.startswith(".", at):
        return ""
    before = _BEFORE_DOT.search(text[max(0, at - 40) : at])
    if before is None:
        return ""
    letter, digits, paren, space = before.groups()
    after = _AFTER_DOT.match(text, at + 1)
    shown = after.group(1) if after is not None and after.group(1) else "..."
    if paren:
        op = _op_before_paren(text, at - len(space) - 1) or "F(c)"
        return f"a computed chunk takes its microbatch in brackets: {op}[{shown}]"
    if not digits:
        example = f"{letter}0.{shown if shown.isdigit() else 3}"
        if letter == "W":  # W[mb] needs a chunk too (docs/dsl.md §4.1)
            return f"a dotted op name has its chunk: {example}"
        one_chunk = f"{letter}[{shown}] on a rank with one chunk"
        return f"a dotted op name has its chunk: {example}, or {one_chunk}"
    if after is not None and text.startswith(".", after.end()):
        return f"an op name has one dot: {letter}{digits}.{shown}"
    if space:
        return f"an op name is written without spaces: {letter}{digits}.{shown}"
    if shown.isdigit():  # the name itself is fine: it stands where a value is wanted
        return f"{letter}{digits}.{shown} is an op: it stands in a block, not in an expression"
    return (
        f"after the dot only an integer microbatch ({letter}{digits}.3); "
        f"write {letter}{digits}[{shown}] for an expression"
    )


def _op_before_paren(text: str, close: int) -> str:
    """`I(c)` when `text[close]` is the ')' of an op's computed chunk; empty otherwise."""
    depth = 0
    for at in range(close, max(-1, close - 200), -1):
        depth += {")": 1, "(": -1}.get(text[at], 0)
        if depth == 0:
            letter = text[at - 1] if at > 0 else ""
            return text[at - 1 : close + 1] if letter in "FBIW" and letter else ""
    return ""


def _token_width(err: lark.UnexpectedInput) -> int:
    token = getattr(err, "token", None)
    if isinstance(token, Token) and token.type != "$END":
        return max(1, len(str(token)))
    return 1


def _end_position(text: str) -> tuple[int, int]:
    lines = text.splitlines() or [""]
    return len(lines), len(lines[-1]) + 1


# ---- tree to AST ---------------------------------------------------------------------------


_COMPARE = {op.value: op for op in ast.BinOp}


@v_args(inline=True, meta=True)
class _Builder(Transformer[Token, list[ast.Decl]]):
    """Builds AST nodes from the parse tree; one method per grammar rule."""

    def __init__(self, source: SourceFile) -> None:
        super().__init__()
        self._source = source

    def _span(self, meta: Meta) -> Span | None:
        if getattr(meta, "empty", True):
            return None
        return Span(self._source, meta.line, meta.column, meta.end_line, meta.end_column)

    def _token_span(self, token: Token) -> Span:
        return Span(
            self._source, token.line or 1, token.column or 1, token.end_line, token.end_column
        )

    def start(self, meta: Meta, *decls: ast.Decl) -> list[ast.Decl]:
        return list(decls)

    # declarations
    def schedule_decl(self, meta: Meta, name: Token) -> ast.ScheduleName:
        return ast.ScheduleName(str(name), self._span(meta))

    def param_decl(self, meta: Meta, name: Token, value: ast.Expr) -> ast.Param:
        return ast.Param(str(name), value, self._span(meta))

    def require_decl(self, meta: Meta, *conditions: ast.Expr) -> ast.Require:
        return ast.Require(tuple(conditions), self._span(meta))

    def pad_decl(self, meta: Meta, count: ast.Expr) -> ast.Pad:
        return ast.Pad(count, self._span(meta))

    def recompute_decl(self, meta: Meta, *stages: ast.Expr) -> ast.Recompute:
        return ast.Recompute(tuple(stages), self._span(meta))

    def phase_decl(self, meta: Meta, name: Token, body: tuple[ast.Stmt, ...]) -> ast.Phase:
        return ast.Phase(str(name), body, self._span(meta))

    def named_placement(self, meta: Meta, name: Token, arg: ast.Expr | None) -> ast.NamedPlacement:
        return ast.NamedPlacement(str(name), arg, self._span(meta))

    def table_placement(self, meta: Meta, *entries: ast.ChunkEntry) -> ast.TablePlacement:
        return ast.TablePlacement(tuple(entries), self._span(meta))

    def chunk_entry(
        self, meta: Meta, chunk: Token, pipe: ast.Expr | None, stage: ast.Expr
    ) -> ast.ChunkEntry:
        return ast.ChunkEntry(int(chunk), pipe, stage, self._span(meta))

    # statements
    def block(self, meta: Meta, *stmts: ast.Stmt) -> tuple[ast.Stmt, ...]:
        return stmts

    def let_stmt(self, meta: Meta, name: Token, value: ast.Expr) -> ast.Let:
        return ast.Let(str(name), value, self._span(meta))

    def repeat_stmt(self, meta: Meta, count: ast.Expr, body: tuple[ast.Stmt, ...]) -> ast.Repeat:
        return ast.Repeat(count, body, self._span(meta))

    def for_stmt(
        self, meta: Meta, var: Token, start: ast.Expr, stop: ast.Expr, body: tuple[ast.Stmt, ...]
    ) -> ast.For:
        return ast.For(str(var), start, stop, body, self._span(meta))

    def if_stmt(self, meta: Meta, cond: ast.Expr, body: tuple[ast.Stmt, ...], *rest: Any) -> ast.If:
        branches = [(cond, body)]
        orelse: tuple[ast.Stmt, ...] = ()
        for clause in rest:
            if clause is None:
                continue
            kind, value = clause
            if kind == "elif":
                branches.append(value)
            else:
                orelse = value
        return ast.If(tuple(branches), orelse, self._span(meta))

    def elif_clause(
        self, meta: Meta, cond: ast.Expr, body: tuple[ast.Stmt, ...]
    ) -> tuple[str, tuple[ast.Expr, tuple[ast.Stmt, ...]]]:
        return ("elif", (cond, body))

    def else_clause(
        self, meta: Meta, body: tuple[ast.Stmt, ...]
    ) -> tuple[str, tuple[ast.Stmt, ...]]:
        return ("else", body)

    def op_stmt(self, meta: Meta, *ops: ast.OpRef) -> ast.OpStmt:
        return ast.OpStmt(tuple(ops), self._span(meta))

    def compute(
        self, meta: Meta, opcode: Token, chunk: ast.Expr | None, mb: ast.Expr | None
    ) -> ast.OpRef:
        text = str(opcode)
        kind = Kind(text[0])
        digits = text[1:]
        if digits and chunk is not None:
            raise ParseError(
                f"'{text}' already names chunk {digits}; write {text[0]}(expr) for a computed "
                "chunk",
                self._span(meta),
            )
        if digits:
            chunk = ast.Num(int(digits), self._token_span(opcode))
        return ast.OpRef(kind, chunk, mb, self._span(meta))

    def named_compute(
        self, meta: Meta, name: Token, chunk: ast.Expr | None, mb: ast.Expr | None
    ) -> ast.OpRef:
        """`F0.3`, the name pipecc prints: exactly `F0[3]`."""
        text = str(name)
        digits, _, number = text[1:].partition(".")
        if chunk is not None or mb is not None:
            instead = (
                f"{text[0]}(expr)[{number}] for a computed chunk"
                if chunk is not None
                else f"{text[0]}{digits}[expr] for a computed microbatch"
            )
            raise ParseError(
                f"'{text}' already names chunk {digits} and microbatch {number}; write {instead}",
                self._span(meta),
            )
        line, col = name.line or 1, name.column or 1
        chunk_span = Span(self._source, line, col + 1, line, col + 1 + len(digits))
        mb_span = Span(self._source, line, col + 2 + len(digits), line, col + len(text))
        return ast.OpRef(
            Kind(text[0]),
            ast.Num(int(digits), chunk_span),
            ast.Num(int(number), mb_span),
            self._span(meta),
        )

    def chunk_expr(self, meta: Meta, expr: ast.Expr) -> ast.Expr:
        return expr

    def mb_expr(self, meta: Meta, expr: ast.Expr) -> ast.Expr:
        return expr

    def send_stmt(self, meta: Meta, what: Token) -> ast.CommStmt:
        return ast.CommStmt(True, Msg(str(what)), self._span(meta))

    def recv_stmt(self, meta: Meta, what: Token) -> ast.CommStmt:
        return ast.CommStmt(False, Msg(str(what)), self._span(meta))

    def wait_stmt(self, meta: Meta) -> ast.WaitStmt:
        return ast.WaitStmt(self._span(meta))

    def group_stmt(self, meta: Meta, *ops: ast.CommStmt) -> ast.GroupStmt:
        return ast.GroupStmt(tuple(ops), self._span(meta))

    def fill_stmt(self, meta: Meta, *parts: Any) -> ast.Fill:
        *codes, cap, body = parts
        kinds: list[Kind] = []
        for code in codes:
            text = str(code)
            if len(text) > 1:
                raise ParseError(
                    f"fill takes op letters without a chunk (F, B, I, W), got '{text}'",
                    self._token_span(code),
                )
            if Kind(text) in kinds:
                raise ParseError(f"fill names '{text}' twice", self._token_span(code))
            kinds.append(Kind(text))
        return ast.Fill(tuple(kinds), cap, body, self._span(meta))

    # expressions
    def number(self, meta: Meta, token: Token) -> ast.Num:
        return ast.Num(int(token), self._span(meta))

    def true(self, meta: Meta) -> ast.Num:
        return ast.Num(True, self._span(meta))

    def false(self, meta: Meta) -> ast.Num:
        return ast.Num(False, self._span(meta))

    def name(self, meta: Meta, token: Token) -> ast.Name:
        return ast.Name(str(token), self._span(meta))

    def call(self, meta: Meta, func: Token, *args: ast.Expr | None) -> ast.Call:
        return ast.Call(str(func), tuple(a for a in args if a is not None), self._span(meta))

    def neg(self, meta: Meta, operand: ast.Expr) -> ast.Neg:
        return ast.Neg(operand, self._span(meta))

    def not_op(self, meta: Meta, operand: ast.Expr) -> ast.Not:
        return ast.Not(operand, self._span(meta))

    def conditional(
        self, meta: Meta, test: ast.Expr, then: ast.Expr, orelse: ast.Expr
    ) -> ast.Conditional:
        return ast.Conditional(test, then, orelse, self._span(meta))

    def compare(self, meta: Meta, left: ast.Expr, op: Token, right: ast.Expr) -> ast.Binary:
        return ast.Binary(_COMPARE[str(op)], left, right, self._span(meta))

    def _binary(self, op: ast.BinOp, meta: Meta, left: ast.Expr, right: ast.Expr) -> ast.Binary:
        return ast.Binary(op, left, right, self._span(meta))

    def add(self, meta: Meta, left: ast.Expr, right: ast.Expr) -> ast.Binary:
        return self._binary(ast.BinOp.ADD, meta, left, right)

    def sub(self, meta: Meta, left: ast.Expr, right: ast.Expr) -> ast.Binary:
        return self._binary(ast.BinOp.SUB, meta, left, right)

    def mul(self, meta: Meta, left: ast.Expr, right: ast.Expr) -> ast.Binary:
        return self._binary(ast.BinOp.MUL, meta, left, right)

    def div(self, meta: Meta, left: ast.Expr, right: ast.Expr) -> ast.Binary:
        return self._binary(ast.BinOp.DIV, meta, left, right)

    def floordiv(self, meta: Meta, left: ast.Expr, right: ast.Expr) -> ast.Binary:
        return self._binary(ast.BinOp.FLOORDIV, meta, left, right)

    def mod(self, meta: Meta, left: ast.Expr, right: ast.Expr) -> ast.Binary:
        return self._binary(ast.BinOp.MOD, meta, left, right)

    def and_op(self, meta: Meta, left: ast.Expr, right: ast.Expr) -> ast.Binary:
        return self._binary(ast.BinOp.AND, meta, left, right)

    def or_op(self, meta: Meta, left: ast.Expr, right: ast.Expr) -> ast.Binary:
        return self._binary(ast.BinOp.OR, meta, left, right)
