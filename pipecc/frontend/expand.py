"""Expand a parsed schedule for given sizes into per-rank op streams.

The declarations of a file run in source order, once per rank, with `P`, `M` and `rank`
bound: parameters take their `-D` value or their default, `let`s are evaluated, `require`s
are checked (a violated one is an error quoting it with the values involved), then the phases
append their ops to the rank's stream.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePath

from pipecc.diagnostics import RequirementError, ScheduleError, Span
from pipecc.frontend import ast
from pipecc.frontend.evaluate import (
    SLOT_RANK,
    Env,
    NameKind,
    Scope,
    StmtFn,
    Type,
    compile_body,
    compile_expr,
    expect,
    root_scope,
    where,
)
from pipecc.ir.placement import (
    Placement,
    PlacementError,
    StageSlot,
    bidirectional_placement,
    loop_placement,
    vshape_placement,
)
from pipecc.ir.streams import StreamItem, Streams

PLACEMENTS = ("loop", "vshape", "bidirectional")
Step = Callable[[Env, "_RankState"], None]


@dataclass
class _RankState:
    """What running the declarations for one rank produces."""

    stream: list[StreamItem] = field(default_factory=list)
    params: dict[str, int] = field(default_factory=dict)
    generated: int | None = None
    table: list[StageSlot] = field(default_factory=list)
    placement_arg: int | None = None
    recompute: list[int] = field(default_factory=list)


@dataclass
class _Declarations:
    """The compiled declarations of a file, ready to run for each rank."""

    name: str
    steps: list[Step]
    param_names: list[str]
    env_size: int
    placement: ast.NamedPlacement | ast.TablePlacement | None


def expand(
    file: ast.ScheduleFile,
    *,
    ranks: int,
    microbatches: int,
    defines: Mapping[str, int] | None = None,
) -> Streams:
    """Evaluate `file` for P=`ranks`, M=`microbatches` and `-D` values `defines`.

    Raises ScheduleError for unknown names or parameters, violated requirements, negative
    loop counts, inexact divisions and invalid placements.
    """
    defines = dict(defines or {})
    _check_sizes(ranks, microbatches)
    decls = _compile_declarations(file, defines)
    states = [_run_rank(decls, rank, ranks, microbatches) for rank in range(ranks)]
    _check_rank_independent(file, states)
    placement = _build_placement(decls, states, ranks)
    _check_pipes(file, placement, states[0], microbatches)
    generated = states[0].generated if states[0].generated is not None else microbatches
    params = tuple(sorted(states[0].params.items()))
    recompute = _recompute_stages(file, states[0].recompute, placement)
    return Streams(
        schedule=decls.name,
        source=file.path,
        num_ranks=ranks,
        num_microbatches=microbatches,
        generated_microbatches=generated,
        params=params,
        placement=placement,
        ranks=tuple(tuple(state.stream) for state in states),
        recompute=recompute,
    )


def _recompute_stages(
    file: ast.ScheduleFile, stages: list[int], placement: Placement
) -> tuple[int, ...]:
    """The stages of `recompute stage ...`: each a stage of the placement, named once."""
    span = next((d.span for d in file.decls if isinstance(d, ast.Recompute)), None)
    count = placement.num_stages(0)
    for n, stage in enumerate(stages):
        if not 0 <= stage < count:
            raise ScheduleError(
                f"recompute stage {stage}: the placement {placement.name} has stages "
                f"0..{count - 1}",
                span,
            )
        if stage in stages[:n]:
            raise ScheduleError(f"recompute: stage {stage} is named twice", span)
    return tuple(sorted(stages))


def _check_rank_independent(file: ast.ScheduleFile, states: list[_RankState]) -> None:
    """Parameters, the placement's argument and `pad` are one value for the whole schedule."""
    for decl in file.decls:
        values: list[object] = []
        match decl:
            case ast.Param(name=name):
                what, values = f"param {name}", [state.params[name] for state in states]
            case ast.NamedPlacement(arg=arg) if arg is not None:
                what, values = f"placement {decl.name}(...)", [s.placement_arg for s in states]
            case ast.Pad():
                what, values = "pad microbatches", [state.generated for state in states]
            case ast.Recompute():
                what, values = "recompute", [state.recompute for state in states]
        if any(value != values[0] for value in values):
            differs = next(r for r, value in enumerate(values) if value != values[0])
            raise ScheduleError(
                f"{what} must be the same on every rank, but it is {values[0]} on rank 0 and "
                f"{values[differs]} on rank {differs} (it must not depend on `rank`)",
                decl.span,
            )


def _check_pipes(
    file: ast.ScheduleFile, placement: Placement, state: _RankState, microbatches: int
) -> None:
    """Two pipes split M evenly, and cannot be padded (DESIGN §2)."""
    if placement.num_pipes == 1:
        return
    spans = {type(decl): decl.span for decl in file.decls}
    where = spans.get(ast.NamedPlacement) or spans.get(ast.TablePlacement)
    if microbatches % placement.num_pipes:
        raise ScheduleError(
            f"placement {placement.name} splits the microbatches over {placement.num_pipes} "
            f"pipes, so M must be a multiple of {placement.num_pipes}; got M={microbatches}",
            where,
        )
    if state.generated is not None and state.generated != microbatches:
        raise ScheduleError(
            "'pad microbatches' needs a placement with one pipe", spans.get(ast.Pad)
        )


def _check_sizes(ranks: int, microbatches: int) -> None:
    if ranks < 1:
        raise ScheduleError(f"the number of ranks must be at least 1, got {ranks}")
    if microbatches < 1:
        raise ScheduleError(f"the number of microbatches must be at least 1, got {microbatches}")


def _compile_declarations(file: ast.ScheduleFile, defines: dict[str, int]) -> _Declarations:
    scope = root_scope()
    steps: list[Step] = []
    single: dict[type, ast.Decl] = {}
    phases: dict[str, Span | None] = {}
    for decl in file.decls:
        _check_single(decl, single)
        if isinstance(decl, ast.Phase):
            _check_phase_name(decl, phases)
        steps.extend(_steps_of(decl, scope, defines))
    names = [decl.name for decl in file.decls if isinstance(decl, ast.Param)]
    _check_defines(defines, names)
    schedule = single.get(ast.ScheduleName)
    name = schedule.name if isinstance(schedule, ast.ScheduleName) else PurePath(file.path).stem
    placement = single.get(ast.NamedPlacement) or single.get(ast.TablePlacement)
    assert placement is None or isinstance(placement, ast.NamedPlacement | ast.TablePlacement)
    return _Declarations(name, steps, names, scope.slots.count, placement)


def _steps_of(decl: ast.Decl, scope: Scope, defines: dict[str, int]) -> list[Step]:
    """What a declaration does for each rank, in source order."""
    match decl:
        case ast.Param():
            return [_param_step(decl, scope, defines)]
        case ast.Let():
            return [_let_step(decl, scope)]
        case ast.Require():
            return [_require_step(cond, decl, scope) for cond in decl.conditions]
        case ast.Pad():
            return [_pad_step(decl, scope)]
        case ast.Recompute():
            return [_recompute_step(decl, scope)]
        case ast.Phase():
            return [_phase_step(decl, scope)]
        case ast.TablePlacement():
            return [_table_step(decl, scope)]
        case ast.NamedPlacement(arg=arg):
            return [_placement_arg_step(arg, scope)] if arg is not None else []
        case ast.ScheduleName():
            return []
        case _:
            raise AssertionError(f"unknown declaration {decl!r}")


def _check_phase_name(decl: ast.Phase, phases: dict[str, Span | None]) -> None:
    if decl.name in phases:
        raise ScheduleError(
            f"phase '{decl.name}' is defined twice",
            decl.span,
            notes=((phases[decl.name], "first here"),),
        )
    phases[decl.name] = decl.span


def _check_single(decl: ast.Decl, seen: dict[type, ast.Decl]) -> None:
    """`schedule`, `placement`, `pad` and `recompute` may appear once each."""
    key: type | None = None
    if isinstance(decl, ast.NamedPlacement | ast.TablePlacement):
        key = ast.NamedPlacement if isinstance(decl, ast.NamedPlacement) else ast.TablePlacement
        other = seen.get(ast.NamedPlacement) or seen.get(ast.TablePlacement)
        if other is not None:
            raise ScheduleError(
                "a schedule has one placement", decl.span, notes=((other.span, "first one here"),)
            )
    elif isinstance(decl, ast.ScheduleName | ast.Pad | ast.Recompute):
        key = type(decl)
        if key in seen:
            word = {ast.ScheduleName: "schedule", ast.Pad: "pad"}.get(key, "recompute")
            raise ScheduleError(
                f"'{word}' may appear once", decl.span, notes=((seen[key].span, "first one here"),)
            )
    if key is not None:
        seen[key] = decl


def _check_defines(defines: dict[str, int], names: list[str]) -> None:
    for name in defines:
        if name not in names:
            known = ", ".join(names) if names else "none"
            lowered = {known.lower(): known for known in names}
            close = difflib.get_close_matches(name.lower(), list(lowered), n=1)
            hint = f"; did you mean '{lowered[close[0]]}'?" if close else ""
            raise ScheduleError(
                f"-D {name}: the schedule has no parameter '{name}' (its parameters: {known}){hint}"
            )


def _param_step(decl: ast.Param, scope: Scope, defines: dict[str, int]) -> Step:
    default = expect(decl.default, scope, Type.INT).fn
    slot = scope.define(decl.name, Type.INT, NameKind.PARAM, decl.span).slot
    name, override = decl.name, defines.get(decl.name)

    def bind(env: Env, state: _RankState) -> None:
        env[slot] = override if override is not None else default(env)
        state.params[name] = env[slot]

    return bind


def _let_step(decl: ast.Let, scope: Scope) -> Step:
    typed = compile_expr(decl.value, scope)
    slot = scope.define(decl.name, typed.type, NameKind.LET, decl.span).slot
    fn = typed.fn

    def bind(env: Env, state: _RankState) -> None:
        env[slot] = fn(env)

    return bind


def _require_step(cond: ast.Expr, decl: ast.Require, scope: Scope) -> Step:
    check = expect(cond, scope, Type.BOOL).fn
    shown = _names_in(cond)
    slots = [(name, binding.slot) for name in shown if (binding := scope.lookup(name))]
    text = (cond.span.text() if cond.span else "") or "the requirement"

    def require(env: Env, state: _RankState) -> None:
        if not check(env):
            values = ", ".join(f"{name}={env[slot]}" for name, slot in slots)
            raise RequirementError(text, values, cond.span or decl.span)

    return require


def _names_in(expr: ast.Expr) -> list[str]:
    """The names an expression mentions, in order of first appearance, builtins last."""
    found: list[str] = []
    stack: list[ast.Expr] = [expr]
    while stack:
        node = stack.pop()
        match node:
            case ast.Name(id=name):
                if name not in found:
                    found.append(name)
            case ast.Neg(operand=x) | ast.Not(operand=x):
                stack.append(x)
            case ast.Binary(left=left, right=right):
                stack.extend((right, left))
            case ast.Call(args=args):
                stack.extend(reversed(args))
            case ast.Conditional(test=test, then=then, orelse=orelse):
                stack.extend((orelse, then, test))
    order = {"M": 1, "P": 2, "rank": 3}
    return sorted(found, key=lambda name: order.get(name, 0))


def _pad_step(decl: ast.Pad, scope: Scope) -> Step:
    count = expect(decl.count, scope, Type.INT).fn

    def pad(env: Env, state: _RankState) -> None:
        value = count(env)
        if value < env[1]:
            raise ScheduleError(
                f"pad microbatches to {value}: that is fewer than M={env[1]}", decl.span
            )
        state.generated = value

    return pad


def _recompute_step(decl: ast.Recompute, scope: Scope) -> Step:
    stages = [expect(stage, scope, Type.INT).fn for stage in decl.stages]

    def recompute(env: Env, state: _RankState) -> None:
        state.recompute = [stage(env) for stage in stages]

    return recompute


def _phase_step(decl: ast.Phase, scope: Scope) -> Step:
    body: StmtFn | None = compile_body(decl.body, scope.child()) if decl.body else None

    def run(env: Env, state: _RankState) -> None:
        if body is not None:
            body(env, state.stream)

    return run


def _placement_arg_step(arg: ast.Expr, scope: Scope) -> Step:
    value = expect(arg, scope, Type.INT).fn

    def evaluate(env: Env, state: _RankState) -> None:
        state.placement_arg = value(env)

    return evaluate


def _table_step(decl: ast.TablePlacement, scope: Scope) -> Step:
    entries = [
        (
            entry.chunk,
            expect(entry.pipe, scope, Type.INT).fn if entry.pipe is not None else None,
            expect(entry.stage, scope, Type.INT).fn,
            entry.span,
        )
        for entry in decl.entries
    ]

    def place(env: Env, state: _RankState) -> None:
        for chunk, pipe, stage, span in entries:
            pipe_value = pipe(env) if pipe is not None else 0
            stage_value = stage(env)
            if pipe_value < 0 or stage_value < 0:
                raise ScheduleError(
                    f"chunk {chunk} gets pipe {pipe_value}, stage {stage_value} {where(env)}; "
                    "both must be ≥ 0",
                    span,
                )
            state.table.append(StageSlot(env[SLOT_RANK], chunk, pipe_value, stage_value))

    return place


def _run_rank(decls: _Declarations, rank: int, ranks: int, microbatches: int) -> _RankState:
    env: Env = [0] * decls.env_size
    env[0], env[1], env[2] = ranks, microbatches, rank
    state = _RankState()
    for step in decls.steps:
        step(env, state)
    return state


def _build_placement(decls: _Declarations, states: list[_RankState], ranks: int) -> Placement:
    decl = decls.placement
    try:
        match decl:
            case None:
                return loop_placement(ranks, 1)
            case ast.TablePlacement():
                return Placement("table", tuple(s for state in states for s in state.table))
            case ast.NamedPlacement(name="loop"):
                return loop_placement(ranks, _loop_chunks(decl, states[0]))
            case ast.NamedPlacement(name="vshape" | "bidirectional" as name, arg=arg):
                if arg is not None:
                    raise ScheduleError(f"placement {name} takes no argument", arg.span)
                if name == "vshape":
                    return vshape_placement(ranks)
                return bidirectional_placement(ranks)
            case ast.NamedPlacement(name=name):
                close = difflib.get_close_matches(name, PLACEMENTS, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ScheduleError(
                    f"unknown placement '{name}' (known: {', '.join(PLACEMENTS)}, or a table "
                    f"'placement {{ chunk 0: stage ... }}'){hint}",
                    decl.span,
                )
            case _:
                raise AssertionError(decl)
    except PlacementError as err:
        span = decl.span if decl is not None else None
        raise ScheduleError(f"invalid placement for P={ranks}: {err}", span) from err


def _loop_chunks(decl: ast.NamedPlacement, state: _RankState) -> int:
    chunks = state.placement_arg if state.placement_arg is not None else 1
    if chunks < 1:
        raise ScheduleError(
            f"placement loop({chunks}): the number of chunks must be ≥ 1", decl.span
        )
    return chunks
