"""Name resolution, type checking and closure compilation of .sched expressions and bodies.

Every name is resolved once, before any rank is evaluated: an unknown name is an error at
its location with a suggestion, and every expression gets a static type (int or bool), so a
comparison used as a number or a number used as a condition is caught without running
anything. The result is a tree of Python closures over a flat environment (a list of slot
values), which is what makes expanding 10⁵–10⁶ ops per schedule fast.

Integers: `/` is exact (an inexact one is an error there), `//` floors, `%` as in Python.
"""

from __future__ import annotations

import difflib
import enum
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from pipecc.diagnostics import ScheduleError, Span
from pipecc.frontend import ast
from pipecc.ir.ops import Kind
from pipecc.ir.streams import (
    CommSpec,
    FillEndSpec,
    FillSpec,
    FusedSpec,
    OpSpec,
    StreamItem,
    WaitSpec,
)

Env = list[int]
ExprFn = Callable[[Env], int]
StmtFn = Callable[[Env, list[StreamItem]], None]

# Slots every environment has; the rest are allocated by `Scope.define`.
SLOT_P, SLOT_M, SLOT_RANK = 0, 1, 2
BUILTIN_NAMES = {"P": SLOT_P, "M": SLOT_M, "rank": SLOT_RANK}
FUNCTIONS = ("min", "max", "abs")
_OP_NAME = re.compile(r"[FBIW][0-9]*")
_new = tuple.__new__


class Type(enum.Enum):
    INT = "integer"
    BOOL = "true/false"


class NameKind(enum.Enum):
    """What kind of name a binding is (its value is how errors say it)."""

    SIZE = "size"  # P, M
    RANK = "rank"
    PARAM = "param"
    LET = "let"
    LOOP = "loop variable"


@dataclass(frozen=True, slots=True)
class Binding:
    slot: int
    type: Type
    kind: NameKind


@dataclass
class Slots:
    """Allocates environment slots; shared by all scopes of one schedule."""

    count: int = len(BUILTIN_NAMES)

    def new(self) -> int:
        self.count += 1
        return self.count - 1


@dataclass
class Scope:
    """A lexical scope: the file's top level, a phase, a block, a loop body."""

    slots: Slots
    parent: Scope | None = None
    names: dict[str, Binding] = field(default_factory=dict)

    def lookup(self, name: str) -> Binding | None:
        scope: Scope | None = self
        while scope is not None:
            if name in scope.names:
                return scope.names[name]
            scope = scope.parent
        return None

    def visible(self) -> list[str]:
        seen: list[str] = []
        scope: Scope | None = self
        while scope is not None:
            seen.extend(scope.names)
            scope = scope.parent
        return seen

    def child(self) -> Scope:
        return Scope(self.slots, self)

    def define(self, name: str, type_: Type, kind: NameKind, span: Span | None) -> Binding:
        """Bind `name` in this scope. Redefining a name visible here is an error, except that
        a `let` in a loop body is re-evaluated, not redefined, at each iteration."""
        if _OP_NAME.fullmatch(name):
            raise ScheduleError(f"'{name}' is an op and cannot name a value", span)
        existing = self.lookup(name)
        if existing is not None:
            raise ScheduleError(f"'{name}' is already defined (as a {existing.kind.value})", span)
        binding = Binding(self.slots.new(), type_, kind)
        self.names[name] = binding
        return binding


def root_scope() -> Scope:
    scope = Scope(Slots())
    for name, slot in BUILTIN_NAMES.items():
        scope.names[name] = Binding(
            slot, Type.INT, NameKind.SIZE if name != "rank" else NameKind.RANK
        )
    return scope


def where(env: Env) -> str:
    """The evaluation context for an error message: rank and sizes."""
    return f"on rank {env[SLOT_RANK]} (P={env[SLOT_P]}, M={env[SLOT_M]})"


def _suggest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


# ---- expressions ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Typed:
    fn: ExprFn
    type: Type


def compile_expr(node: ast.Expr, scope: Scope) -> Typed:
    """Resolve names and types in `node` and return a closure computing its value."""
    match node:
        case ast.Num(value=value):
            constant = value
            return Typed(lambda env: constant, Type.BOOL if type(value) is bool else Type.INT)
        case ast.Name():
            return _compile_name(node, scope)
        case ast.Neg(operand=operand):
            inner = expect(operand, scope, Type.INT).fn
            return Typed(lambda env: -inner(env), Type.INT)
        case ast.Not(operand=operand):
            inner = expect(operand, scope, Type.BOOL).fn
            return Typed(lambda env: not inner(env), Type.BOOL)
        case ast.Binary():
            return _compile_binary(node, scope)
        case ast.Call():
            return _compile_call(node, scope)
        case ast.Conditional(test=test, then=then, orelse=orelse):
            return _compile_conditional(test, then, orelse, scope)
        case _:
            raise AssertionError(f"unknown expression node {node!r}")


def expect(node: ast.Expr, scope: Scope, wanted: Type) -> Typed:
    """Compile `node` and check that its type is `wanted`."""
    typed = compile_expr(node, scope)
    if typed.type is not wanted:
        raise ScheduleError(
            f"expected {_article(wanted)} here, but this is {_article(typed.type)}",
            node.span,
        )
    return typed


def _article(type_: Type) -> str:
    return "an integer" if type_ is Type.INT else "a condition (true/false)"


def _compile_name(node: ast.Name, scope: Scope) -> Typed:
    binding = scope.lookup(node.id)
    if binding is None:
        hint = _suggest(node.id, scope.visible() + list(FUNCTIONS))
        raise ScheduleError(f"unknown name '{node.id}'{hint}", node.span)
    slot = binding.slot
    return Typed(lambda env: env[slot], binding.type)


def _compile_conditional(test: ast.Expr, then: ast.Expr, orelse: ast.Expr, scope: Scope) -> Typed:
    cond = expect(test, scope, Type.BOOL).fn
    yes = compile_expr(then, scope)
    no = expect(orelse, scope, yes.type)
    yes_fn, no_fn = yes.fn, no.fn
    return Typed(lambda env: yes_fn(env) if cond(env) else no_fn(env), yes.type)


def _compile_call(node: ast.Call, scope: Scope) -> Typed:
    if node.func not in FUNCTIONS:
        hint = _suggest(node.func, list(FUNCTIONS))
        raise ScheduleError(f"unknown function '{node.func}'{hint}", node.span)
    args = [expect(arg, scope, Type.INT).fn for arg in node.args]
    if node.func == "abs":
        if len(args) != 1:
            raise ScheduleError("abs takes one argument", node.span)
        (arg,) = args
        return Typed(lambda env: abs(arg(env)), Type.INT)
    if len(args) < 2:
        raise ScheduleError(f"{node.func} takes two or more arguments", node.span)
    pick = min if node.func == "min" else max
    return Typed(lambda env: pick(a(env) for a in args), Type.INT)


_COMPARE: dict[ast.BinOp, Callable[[int, int], bool]] = {
    ast.BinOp.EQ: lambda a, b: a == b,
    ast.BinOp.NE: lambda a, b: a != b,
    ast.BinOp.LT: lambda a, b: a < b,
    ast.BinOp.LE: lambda a, b: a <= b,
    ast.BinOp.GT: lambda a, b: a > b,
    ast.BinOp.GE: lambda a, b: a >= b,
}


def _compile_binary(node: ast.Binary, scope: Scope) -> Typed:
    op = node.op
    if op in (ast.BinOp.AND, ast.BinOp.OR):
        left = expect(node.left, scope, Type.BOOL).fn
        right = expect(node.right, scope, Type.BOOL).fn
        if op is ast.BinOp.AND:
            return Typed(lambda env: left(env) and right(env), Type.BOOL)
        return Typed(lambda env: left(env) or right(env), Type.BOOL)
    if op in _COMPARE:
        return _compile_compare(node, scope)
    left = expect(node.left, scope, Type.INT).fn
    right = expect(node.right, scope, Type.INT).fn
    if op is ast.BinOp.ADD:
        return Typed(lambda env: left(env) + right(env), Type.INT)
    if op is ast.BinOp.SUB:
        return Typed(lambda env: left(env) - right(env), Type.INT)
    if op is ast.BinOp.MUL:
        return Typed(lambda env: left(env) * right(env), Type.INT)
    return Typed(_division(op, left, right, node.span), Type.INT)


def _compile_compare(node: ast.Binary, scope: Scope) -> Typed:
    left = compile_expr(node.left, scope)
    right = expect(node.right, scope, left.type)
    if left.type is Type.BOOL and node.op not in (ast.BinOp.EQ, ast.BinOp.NE):
        raise ScheduleError(f"'{node.op.value}' compares integers, not conditions", node.span)
    apply = _COMPARE[node.op]
    left_fn, right_fn = left.fn, right.fn
    return Typed(lambda env: apply(left_fn(env), right_fn(env)), Type.BOOL)


def _division(op: ast.BinOp, left: ExprFn, right: ExprFn, span: Span | None) -> ExprFn:
    """`/`, `//` or `%`, one closure each: schedules divide in their innermost loops."""

    def by_zero(a: int, env: Env) -> ScheduleError:
        return ScheduleError(f"division by zero ({a} {op.value} 0) {where(env)}", span)

    def exact(env: Env) -> int:
        a, b = left(env), right(env)
        if not b:
            raise by_zero(a, env)
        if a % b:
            raise ScheduleError(
                f"'/' is exact division, but {a} / {b} leaves a remainder {where(env)} "
                "(write '//' to round down)",
                span,
            )
        return a // b

    def floor(env: Env) -> int:
        a, b = left(env), right(env)
        if b:
            return a // b
        raise by_zero(a, env)

    def modulo(env: Env) -> int:
        a, b = left(env), right(env)
        if b:
            return a % b
        raise by_zero(a, env)

    if op is ast.BinOp.DIV:
        return exact
    return floor if op is ast.BinOp.FLOORDIV else modulo


# ---- statements ----------------------------------------------------------------------------


def compile_body(body: tuple[ast.Stmt, ...], scope: Scope) -> StmtFn:
    """Compile a block: its statements run in order and append to the rank's stream."""
    steps = [_compile_stmt(stmt, scope) for stmt in body]

    def run(env: Env, out: list[StreamItem]) -> None:
        for step in steps:
            step(env, out)

    return steps[0] if len(steps) == 1 else run


def _compile_stmt(stmt: ast.Stmt, scope: Scope) -> StmtFn:
    match stmt:
        case ast.OpStmt():
            return _compile_op(stmt, scope)
        case ast.Let(name=name, value=value, span=span):
            return _compile_let(name, value, span, scope)
        case ast.Repeat(count=count, body=body, span=span):
            return _compile_repeat(count, body, span, scope)
        case ast.For():
            return _compile_for(stmt, scope)
        case ast.If(branches=branches, orelse=orelse):
            return _compile_if(branches, orelse, scope)
        case ast.CommStmt() | ast.GroupStmt() | ast.WaitStmt():
            return _compile_comm(stmt)
        case ast.Fill():
            return _compile_fill(stmt, scope)
        case _:
            raise AssertionError(f"unknown statement {stmt!r}")


def _compile_fill(stmt: ast.Fill, scope: Scope) -> StmtFn:
    """`fill KINDS [cap N] { ... }`: the body between a `FillSpec` and a `FillEndSpec`."""
    _check_fill_body(stmt.body)
    cap = expect(stmt.cap, scope, Type.INT).fn if stmt.cap is not None else None
    inner = compile_body(stmt.body, scope.child()) if stmt.body else None
    kinds, span, end = frozenset(stmt.kinds), stmt.span, FillEndSpec(stmt.span)

    def fill(env: Env, out: list[StreamItem]) -> None:
        out.append(FillSpec(kinds, cap(env) if cap is not None else None, span))
        if inner is not None:
            inner(env, out)
        out.append(end)

    return fill


def _check_fill_body(body: tuple[ast.Stmt, ...]) -> None:
    """A fill block holds no other fill block and no hand-placed comm op: the fill decides
    where the ops around them run."""
    for stmt in body:
        match stmt:
            case ast.Fill():
                raise ScheduleError("fill blocks do not nest", stmt.span)
            case ast.CommStmt() | ast.GroupStmt() | ast.WaitStmt():
                raise ScheduleError(
                    "a fill block cannot hold hand-placed sends, receives or waits (the fill "
                    "decides where its ops run)",
                    stmt.span,
                )
            case ast.Repeat(body=inner) | ast.For(body=inner):
                _check_fill_body(inner)
            case ast.If(branches=branches, orelse=orelse):
                for _, inner in branches:
                    _check_fill_body(inner)
                _check_fill_body(orelse)


def _compile_let(name: str, value: ast.Expr, span: Span | None, scope: Scope) -> StmtFn:
    typed = compile_expr(value, scope)
    slot = scope.define(name, typed.type, NameKind.LET, span).slot
    fn = typed.fn

    def bind(env: Env, out: list[StreamItem]) -> None:
        env[slot] = fn(env)

    return bind


def _loop_count(value: int, what: str, span: Span | None, env: Env) -> int:
    if value < 0:
        raise ScheduleError(f"{what} count is {value}, which is negative, {where(env)}", span)
    return value


def _compile_repeat(
    count: ast.Expr, body: tuple[ast.Stmt, ...], span: Span | None, scope: Scope
) -> StmtFn:
    count_fn = expect(count, scope, Type.INT).fn
    inner = compile_body(body, scope.child()) if body else None
    count_span = count.span or span

    def repeat(env: Env, out: list[StreamItem]) -> None:
        times = _loop_count(count_fn(env), "repeat", count_span, env)
        if inner is not None:
            for _ in range(times):
                inner(env, out)

    return repeat


def _compile_for(stmt: ast.For, scope: Scope) -> StmtFn:
    start = expect(stmt.start, scope, Type.INT).fn
    stop = expect(stmt.stop, scope, Type.INT).fn
    loop_scope = scope.child()
    slot = loop_scope.define(stmt.var, Type.INT, NameKind.LOOP, stmt.span).slot
    steps = [_compile_stmt(body_stmt, loop_scope) for body_stmt in stmt.body]
    span = stmt.span

    def loop(env: Env, out: list[StreamItem]) -> None:
        first, last = start(env), stop(env)
        _loop_count(last - first, f"for {stmt.var} in {first} .. {last}: the loop", span, env)
        for value in range(first, last):  # the body's steps run here, not through a wrapper
            env[slot] = value
            for step in steps:
                step(env, out)

    return loop


def _compile_if(
    branches: tuple[tuple[ast.Expr, tuple[ast.Stmt, ...]], ...],
    orelse: tuple[ast.Stmt, ...],
    scope: Scope,
) -> StmtFn:
    compiled = [
        (expect(cond, scope, Type.BOOL).fn, compile_body(body, scope.child()) if body else None)
        for cond, body in branches
    ]
    otherwise = compile_body(orelse, scope.child()) if orelse else None

    def choose(env: Env, out: list[StreamItem]) -> None:
        for cond, body in compiled:
            if cond(env):
                if body is not None:
                    body(env, out)
                return
        if otherwise is not None:
            otherwise(env, out)

    return choose


def _compile_op(stmt: ast.OpStmt, scope: Scope) -> StmtFn:
    if len(stmt.ops) == 1:
        return _compile_single(stmt.ops[0], scope)
    makers = [_compile_opref(op, scope) for op in stmt.ops]
    forward, backward = stmt.ops
    if forward.kind is not Kind.F or not backward.kind.is_backward:
        raise ScheduleError("a fused op is a forward then a backward: F0&B1 or F0&I1", stmt.span)
    make_f, make_b = makers
    span = stmt.span
    return lambda env, out: out.append(FusedSpec(make_f(env), make_b(env), span))


def _compile_single(op: ast.OpRef, scope: Scope) -> StmtFn:
    """A statement of one op: `_compile_opref` and the append in one closure for the forms
    loops repeat most (a constant op, an op with a computed chunk)."""
    if op.mb is None and op.chunk is not None and not isinstance(op.chunk, ast.Num):
        chunk = expect(op.chunk, scope, Type.INT).fn
        kind, span = op.kind, op.span
        return lambda env, out: out.append(_new(OpSpec, (kind, chunk(env), None, span)))
    make = _compile_opref(op, scope)
    if op.mb is None:
        constant = make([])
        return lambda env, out: out.append(constant)
    return lambda env, out: out.append(make(env))


def _compile_opref(op: ast.OpRef, scope: Scope) -> Callable[[Env], OpSpec]:
    chunk = expect(op.chunk, scope, Type.INT).fn if op.chunk is not None else None
    mb = expect(op.mb, scope, Type.INT).fn if op.mb is not None else None
    if op.mb is not None and op.kind is Kind.W and op.chunk is None:
        raise ScheduleError("W[mb] needs a chunk: write W0[...] or W1[...]", op.span)
    kind, span = op.kind, op.span
    if mb is None and (chunk is None or isinstance(op.chunk, ast.Num)):
        constant = OpSpec(kind, None if chunk is None else chunk([]), None, span)
        return lambda env: constant
    if mb is None:
        assert chunk is not None
        return lambda env: _new(OpSpec, (kind, chunk(env), None, span))
    if chunk is None:
        return lambda env: _new(OpSpec, (kind, None, mb(env), span))
    return lambda env: _new(OpSpec, (kind, chunk(env), mb(env), span))


def _compile_comm(stmt: ast.CommStmt | ast.GroupStmt | ast.WaitStmt) -> StmtFn:
    match stmt:
        case ast.WaitStmt(span=span):
            wait = WaitSpec(span)
            return lambda env, out: out.append(wait)
        case ast.CommStmt(send=send, what=what, span=span):
            single = CommSpec(send, what, None, span)
            return lambda env, out: out.append(single)
        case ast.GroupStmt(ops=ops):
            members = [(op.send, op.what, op.span) for op in ops]

            def group(env: Env, out: list[StreamItem]) -> None:
                group_id = len(out)  # unique on this rank; renumbered by later passes
                out.extend(CommSpec(send, what, group_id, span) for send, what, span in members)

            return group
        case _:
            raise AssertionError(f"unknown comm statement {stmt!r}")
