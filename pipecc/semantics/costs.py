"""The cost model of the simulator (DESIGN §6): op durations, message latency, sizes.

Keys (the same on the command line, `--cost F=1,B=2,comm=0.1`, and in a TOML file under
`[cost]`, with per-stage overrides under `[cost.stage.N]`):

    F, B, I, W    durations of a forward, full backward, input-gradient and weight-gradient op
    FB, FI        duration of a fused F&B / F&I instruction (default F + B / F + I: no overlap
                  benefit unless the user says so)
    comm          latency of one message: from the moment a transfer can start to the data
                  being at the receiver (not busy time on either rank)
    bytes         size of one message (with `bandwidth`, adds bytes / bandwidth to `comm`)
    bandwidth     bytes per time unit (global only)
    act_bytes     bytes of one microbatch's activations of a stage (for peak memory in bytes)
    UNSHARD, RESHARD, REDUCE_GRAD
                  durations of torch's per-stage actions, where a program holds them (a torch
                  CSV's; docs/interop.md); 0 unless given
    post          host time a rank spends posting one send or receive (global only; 0)
    wait          host time a rank spends in a wait after it is released (global only; 0)
    sync          time of the gradient sum of parameters held by several ranks at the end of
                  a step: duplicated stages (DualPipe) and shared weights whose stages lie on
                  different ranks (`shared`); added to the step, not to the program's
                  makespan (global only; 0)
    collective    duration of one collective instruction (a program's gradient sum): from the
                  moment its last member is ready to its completion on every member (global
                  only; 0). A program that holds its gradient sums pays this, not `sync`
    shared        groups of stages that hold one parameter (tied embeddings: the first and
                  the last stage), `shared = [[0, 7]]` in a file, `shared=0+7` on the
                  command line (groups separated by `/`); a program sums such a group's
                  gradients, and so pays `sync`, when its placement puts the group's stages
                  on more than one rank (global only; `pipecc run --profile` writes it)
    unit          the name of the time unit, for display ("ms" in files the runtime writes)

Defaults: F=1, B=2, I=1, W=1. Given only B, I = W = B/2; given I and W, B = I + W; given B
and I, W = B - I. A stage override `[cost.stage.N]` applies to stage N of every pipe (the two
pipes of DualPipe hold the same layers at the same stage index).
"""

from __future__ import annotations

import difflib
import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from pipecc.diagnostics import CostModelError
from pipecc.ir.ops import Collective, Compute, Fused, Kind, Send, Sequential, StageOp

# torch's per-stage actions (docs/interop.md): 0 unless given
STAGE_OP_KEYS = ("UNSHARD", "RESHARD", "REDUCE_GRAD")

DURATION_KEYS = ("F", "B", "I", "W", "FB", "FI", "comm", "bytes", "act_bytes", *STAGE_OP_KEYS)
HOST_KEYS = ("post", "wait", "sync", "collective")  # global only: host time, sync, collectives
GLOBAL_KEYS = (*DURATION_KEYS, "bandwidth", *HOST_KEYS, "shared", "unit")


@dataclass(frozen=True, slots=True)
class StageCost:
    """Durations and sizes for one stage (None: not given, derived or defaulted)."""

    F: float | None = None
    B: float | None = None
    I: float | None = None  # noqa: E741
    W: float | None = None
    FB: float | None = None
    FI: float | None = None
    comm: float | None = None
    bytes: float | None = None
    act_bytes: float | None = None
    UNSHARD: float | None = None
    RESHARD: float | None = None
    REDUCE_GRAD: float | None = None

    def over(self, base: StageCost) -> StageCost:
        """This stage's values where given, `base`'s elsewhere."""
        merged = {key: getattr(self, key) for key in DURATION_KEYS}
        return replace(base, **{k: v for k, v in merged.items() if v is not None})


@dataclass(frozen=True, slots=True)
class ResolvedCost:
    """Every duration of one stage, defaults and derivations applied."""

    F: float
    B: float
    I: float  # noqa: E741
    W: float
    FB: float | None
    FI: float | None
    comm: float
    bytes: float | None
    act_bytes: float | None
    UNSHARD: float = 0.0
    RESHARD: float = 0.0
    REDUCE_GRAD: float = 0.0


@dataclass(frozen=True, slots=True)
class HostCost:
    """Time outside the transfers and compute ops (None: not given, 0).

    `post`: host time a rank spends posting each Send/Recv (the op, or its group, is posted
    at the end of it); `wait`: host time after each Wait's release; `sync`: the
    duplicated-stage gradient sum after the program, once per step.
    """

    post: float | None = None
    wait: float | None = None
    sync: float | None = None
    collective: float | None = None  # one collective instruction's duration

    def over(self, base: HostCost) -> HostCost:
        """This one's values where given, `base`'s elsewhere."""
        return HostCost(
            self.post if self.post is not None else base.post,
            self.wait if self.wait is not None else base.wait,
            self.sync if self.sync is not None else base.sync,
            self.collective if self.collective is not None else base.collective,
        )


@dataclass(frozen=True, slots=True)
class CostModel:
    """Global costs, per-stage overrides, the bandwidth that turns bytes into time, and the
    host overheads."""

    base: StageCost = StageCost()
    stages: tuple[tuple[int, StageCost], ...] = ()
    bandwidth: float | None = None
    unit: str = ""
    host: HostCost = HostCost()
    shared: tuple[tuple[int, ...], ...] = ()
    _resolved: dict[int, ResolvedCost] = field(default_factory=dict, compare=False, repr=False)

    def stage(self, stage: int) -> ResolvedCost:
        """The resolved costs of `stage` (cached)."""
        cached = self._resolved.get(stage)
        if cached is None:
            raw = dict(self.stages).get(stage, StageCost()).over(self.base)
            cached = _resolve(raw, self.bandwidth)
            self._resolved[stage] = cached
        return cached

    def compute(self, op: Compute) -> float:
        cost = self._resolved.get(op.stage) or self.stage(op.stage)
        kind = op.kind
        if kind is Kind.F:
            return cost.F
        if kind is Kind.B:
            return cost.B
        return cost.I if kind is Kind.I else cost.W

    def stage_op(self, op: StageOp) -> float:
        """UNSHARD, RESHARD, REDUCE_GRAD: their given duration on the stage, else 0."""
        value: float = getattr(self.stage(op.stage), op.kind.value)
        return value

    def names_stage_ops(self) -> bool:
        """Whether a duration is given to UNSHARD, RESHARD or REDUCE_GRAD anywhere."""
        return any(
            getattr(cost, key) is not None
            for cost in (self.base, *(c for _, c in self.stages))
            for key in STAGE_OP_KEYS
        )

    def has_bytes(self) -> bool:
        """Whether activation sizes are given (for peak memory in bytes)."""
        return self.base.act_bytes is not None or any(
            cost.act_bytes is not None for _, cost in self.stages
        )

    def fused(self, op: Fused) -> float:
        """F&B (or F&I): the given FB/FI of the forward's stage, else the two durations added."""
        given = self.stage(op.forward.stage)
        value = given.FB if op.backward.kind is Kind.B else given.FI
        if value is not None:
            return value
        return self.compute(op.forward) + self.compute(op.backward)

    def latency(self, stage: int) -> float:
        """Time for one message named by receiving stage `stage` to arrive."""
        cost = self.stage(stage)
        return cost.comm

    def overhead(self) -> tuple[float, float]:
        """Host time per post and per Wait, (post, wait) (0 where not given)."""
        return (self.host.post or 0.0, self.host.wait or 0.0)

    @property
    def sync(self) -> float:
        """The duplicated-stage gradient sum's time per step (0 where not given)."""
        return self.host.sync or 0.0

    def scaled(self, factor: float) -> CostModel:
        """Compute durations multiplied by `factor` (comm and sizes unchanged): the same
        model cut into more, smaller stages."""
        if factor == 1:
            return self

        def scale(cost: StageCost) -> StageCost:
            values = {key: getattr(cost, key) for key in ("F", "B", "I", "W", "FB", "FI")}
            return replace(cost, **{k: v * factor for k, v in values.items() if v is not None})

        base = self.base
        if all(getattr(base, key) is None for key in ("F", "B", "I", "W")):
            base = replace(base, F=1.0, B=2.0)  # scale the defaults too
        return CostModel(
            scale(base),
            tuple((n, scale(c)) for n, c in self.stages),
            self.bandwidth,
            self.unit,
            self.host,
            self.shared,
        )

    def overridden_by(self, other: CostModel) -> CostModel:
        """This model with `other`'s global values where `other` gives them."""
        return CostModel(
            base=other.base.over(self.base),
            stages=self.stages,
            bandwidth=other.bandwidth if other.bandwidth is not None else self.bandwidth,
            unit=other.unit or self.unit,
            host=other.host.over(self.host),
            shared=other.shared or self.shared,
        )

    def describe(self) -> str:
        """One line: the global costs as given (for report headers)."""
        given = [
            f"{k}={_fmt(getattr(self.base, k))}"
            for k in DURATION_KEYS
            if getattr(self.base, k) is not None
        ]
        if self.bandwidth is not None:
            given.append(f"bandwidth={_fmt(self.bandwidth)}")
        given += [
            f"{key}={_fmt(value)}"
            for key in HOST_KEYS
            if (value := getattr(self.host, key)) is not None
        ]
        if self.shared:
            given.append(f"shared={format_shared(self.shared)}")
        resolved = self.stage(0)
        shown = ", ".join(given) if given else "defaults"
        return (
            f"{shown} (F={_fmt(resolved.F)}, B={_fmt(resolved.B)}, I={_fmt(resolved.I)}, "
            f"W={_fmt(resolved.W)}, comm={_fmt(resolved.comm)})"
        )


def _fmt(value: float) -> str:
    return f"{value:g}"


def format_shared(groups: tuple[tuple[int, ...], ...]) -> str:
    """`((0, 7), (1, 6))` → `0+7/1+6`, the command-line form of `shared`."""
    return "/".join("+".join(str(stage) for stage in group) for group in groups)


def _resolve(cost: StageCost, bandwidth: float | None) -> ResolvedCost:
    F = cost.F if cost.F is not None else 1.0
    B, I, W = cost.B, cost.I, cost.W  # noqa: E741
    if B is None and I is not None and W is not None:
        B = I + W
    if B is None:
        B = 2.0 if I is None and W is None else (I or W or 1.0) * 2
    if I is None and W is None:
        I = W = B / 2  # noqa: E741
    elif I is None:
        assert W is not None  # the first branch took both None
        I = B - W  # noqa: E741
    elif W is None:
        W = B - I
    assert I is not None and W is not None  # every branch above set both
    if I < 0 or W < 0:
        raise CostModelError(f"B={B:g} is less than its given half (I={I:g}, W={W:g})")
    comm = cost.comm or 0.0
    if cost.bytes is not None and bandwidth:
        comm += cost.bytes / bandwidth
    return ResolvedCost(
        F,
        B,
        I,
        W,
        cost.FB,
        cost.FI,
        comm,
        cost.bytes,
        cost.act_bytes,
        cost.UNSHARD or 0.0,
        cost.RESHARD or 0.0,
        cost.REDUCE_GRAD or 0.0,
    )


@dataclass(frozen=True, slots=True)
class CostTiming:
    """A cost model as the replay engine's `Timing` (pipecc.semantics): how long each compute
    instruction runs, each message's latency, and the host time of posts and waits."""

    costs: CostModel
    # durations by (kind, stage) or (kind, stage, kind, stage): a program of 10⁶ instructions
    # has a few dozen distinct ones
    _known: dict[tuple[object, ...], float] = field(default_factory=dict, compare=False)

    def duration(
        self, rank: int, index: int, instr: Compute | Fused | Sequential | StageOp
    ) -> float:
        return self.op_duration(instr)

    def op_duration(self, instr: Compute | Fused | Sequential | StageOp) -> float:
        if isinstance(instr, StageOp):
            return self.costs.stage_op(instr)
        if isinstance(instr, Sequential):  # its parts one after another
            return sum(self._compute_duration(op) for op in instr.parts)
        return self._compute_duration(instr)

    def _compute_duration(self, instr: Compute | Fused) -> float:
        if type(instr) is Compute:
            key: tuple[object, ...] = (instr.kind, instr.stage)
            value = self._known.get(key)
            if value is None:
                value = self._known[key] = self.costs.compute(instr)
            return value
        fused = cast(Fused, instr)
        f, b = fused.forward, fused.backward
        key = (f.kind, f.stage, b.kind, b.stage)
        value = self._known.get(key)
        if value is None:
            value = self._known[key] = self.costs.fused(fused)
        return value

    def latency(self, rank: int, index: int, send: Send) -> float:
        return self.costs.latency(send.stage)

    def collective(self, rank: int, index: int, op: Collective) -> float:
        return self.costs.host.collective or 0.0

    def overhead(self, rank: int) -> tuple[float, float]:
        return self.costs.overhead()


# ---- parsing -------------------------------------------------------------------------------


def _number(key: str, value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise CostModelError(f"{where}: {key} must be a number, got {value!r}") from None
    if not math.isfinite(value) or value < 0:
        raise CostModelError(f"{where}: {key} must be a finite number ≥ 0, got {value}")
    return float(value)


def _check_key(key: str, known: tuple[str, ...], where: str) -> None:
    if key not in known:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise CostModelError(f"{where}: unknown cost key '{key}' (known: {', '.join(known)}){hint}")


def _stage_cost(values: dict[str, Any], where: str, *, known: tuple[str, ...]) -> StageCost:
    fields = {}
    for key, value in values.items():
        if key in GLOBAL_KEYS and key not in known:
            raise CostModelError(f"{where}: '{key}' is global only: give it under [cost]")
        _check_key(key, known, where)
        fields[key] = _number(key, value, where)
    return StageCost(**fields)


def parse_cost_flag(text: str) -> CostModel:
    """`F=1,B=2,I=1,W=1,FB=2.5,comm=0.1` → CostModel (global values only)."""
    values: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise CostModelError(f"--cost: expected KEY=VALUE, got {item!r}")
        values[key.strip()] = value.strip()
    return _model(values, {}, "--cost")


def load_cost_file(path: str | Path) -> CostModel:
    """A TOML cost file: `[cost]` with global keys, `[cost.stage.N]` with overrides."""
    where = str(path)
    try:
        data = tomllib.loads(Path(path).read_text("utf-8"))
    except FileNotFoundError:
        raise CostModelError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise CostModelError(f"{where}: cannot read: {err}") from None
    except tomllib.TOMLDecodeError as err:
        raise CostModelError(f"{where}: malformed TOML: {err}") from None
    cost = data.get("cost")
    if not isinstance(cost, dict):
        raise CostModelError(f"{where}: expected a [cost] table")
    stages = cost.get("stage", {})
    values = {k: v for k, v in cost.items() if k != "stage"}
    return _model(values, stages, where)


def _model(values: dict[str, Any], stages: Any, where: str) -> CostModel:
    unit = str(values.pop("unit", ""))
    shared = _shared(values.pop("shared"), where) if "shared" in values else ()
    bandwidth = values.pop("bandwidth", None)
    host = HostCost(
        **{key: _number(key, values.pop(key), where) for key in HOST_KEYS if key in values}
    )
    base = _stage_cost(values, where, known=GLOBAL_KEYS)
    if not isinstance(stages, dict):
        raise CostModelError(f"{where}: [cost.stage] must hold tables [cost.stage.N]")
    overrides = []
    for name, table in sorted(stages.items(), key=lambda item: str(item[0])):
        if not str(name).isdigit() or not isinstance(table, dict):
            raise CostModelError(f"{where}: [cost.stage.{name}]: N must be a stage number")
        table_where = f"{where} [cost.stage.{name}]"
        overrides.append((int(name), _stage_cost(table, table_where, known=DURATION_KEYS)))
    model = CostModel(
        base=base,
        stages=tuple(sorted(overrides)),
        bandwidth=_number("bandwidth", bandwidth, where) if bandwidth is not None else None,
        unit=unit,
        host=host,
        shared=shared,
    )
    model.stage(0)  # resolve once, so inconsistent values fail here with the file's name
    for stage, _ in overrides:
        model.stage(stage)
    return model


def _shared(value: Any, where: str) -> tuple[tuple[int, ...], ...]:
    """`shared`: a list of groups of two or more distinct stage numbers (a file's
    `[[0, 7]]`, or the command line's `0+7/1+6`)."""
    if isinstance(value, str):
        try:
            value = [[int(s) for s in group.split("+")] for group in value.split("/")]
        except ValueError:
            raise CostModelError(
                f"{where}: shared must be groups of stage numbers like 0+7 or 0+7/1+6, "
                f"got {value!r}"
            ) from None
    if not isinstance(value, list) or not all(isinstance(group, list) for group in value):
        raise CostModelError(
            f"{where}: shared must be a list of groups of stage numbers, e.g. [[0, 7]]"
        )
    groups = []
    for group in value:
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in group):
            raise CostModelError(f"{where}: shared: {group!r} must hold stage numbers ≥ 0")
        if len(set(group)) < 2:
            raise CostModelError(
                f"{where}: shared: {group!r} must name two or more different stages"
            )
        groups.append(tuple(sorted(set(group))))
    return tuple(sorted(groups))
