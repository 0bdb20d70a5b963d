"""One stage's costs (`StageCost`: given, or resolved with defaults and derivations) and the
host's (`HostCost`). Their fields are the keys of keys.py's table (a test holds them equal)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

from pipecc.diagnostics import CostModelError

from .keys import BY_NAME, STAGE_KEYS

T = TypeVar("T", "StageCost", "HostCost")


def _merged(top: T, base: T) -> T:
    """`top`'s values where given (not None), `base`'s elsewhere."""
    given = {f.name: v for f in fields(top) if (v := getattr(top, f.name)) is not None}
    return replace(base, **given)


@dataclass(frozen=True, slots=True)
class StageCost:
    """Durations and sizes of one stage, a field per stage key of keys.py (None: not given).

    `resolved()` applies the defaults and derivations and returns the same type with every
    key the table marks `filled` set (`FilledCost`, which narrows those fields' types)."""

    F: float | None = None
    B: float | None = None
    I: float | None = None  # noqa: E741
    W: float | None = None
    FB: float | None = None
    FI: float | None = None
    comm: float | None = None
    bytes: float | None = None
    out_bytes: float | None = None
    act_bytes: float | None = None
    act_bytes_w: float | None = None
    param_bytes: float | None = None
    grad_bytes: float | None = None
    grad_bytes_w: float | None = None
    optim_bytes: float | None = None
    sharded_param_bytes: float | None = None
    unsharded_param_bytes: float | None = None
    workspace_F: float | None = None
    workspace_B: float | None = None
    workspace_I: float | None = None
    workspace_W: float | None = None
    workspace_sum: float | None = None
    a2a: float | None = None
    moe_experts: float | None = None
    moe_layers: float | None = None
    UNSHARD: float | None = None
    RESHARD: float | None = None
    REDUCE_GRAD: float | None = None

    def over(self, base: StageCost) -> StageCost:
        """This stage's values where given, `base`'s elsewhere."""
        return _merged(self, base)

    def values(self) -> dict[str, float | None]:
        """Every key's value (None where not given), in the table's order."""
        return {name: getattr(self, name) for name in STAGE_KEYS}

    def resolved(self, bandwidth: float | None, scale: float = 1.0) -> FilledCost:
        """Defaults and derivations applied; the defaults F=1 and B=2 are per share, times
        `scale` (a converted model's shares per stage). A derived duration is a plain sum or
        half: B = I + W, I = W = B / 2 (`dispatch` enters the conversion of a given duration
        to another cut, not these; docs/simulate.md says what was measured). `comm` gains
        `bytes / bandwidth` where both are known."""
        # Any: every key the table marks filled is set below (a test checks FilledCost)
        values: dict[str, Any] = {
            name: BY_NAME[name].default if value is None else value
            for name, value in self.values().items()
        }
        values["F"] = self.F if self.F is not None else scale
        values["B"], values["I"], values["W"] = _backward(self.B, self.I, self.W, scale)
        if self.bytes is not None and bandwidth:
            values["comm"] += self.bytes / bandwidth
        return FilledCost(**values)


@dataclass(frozen=True, slots=True)
class FilledCost(StageCost):
    """A resolved `StageCost`: the keys the table marks `filled` are set. It declares no key
    of its own, only narrows the types of those (keys.FILLED_KEYS, a test holds them equal)."""

    F: float = 0.0
    B: float = 0.0
    I: float = 0.0  # noqa: E741
    W: float = 0.0
    comm: float = 0.0
    moe_experts: float = 0.5
    UNSHARD: float = 0.0
    RESHARD: float = 0.0
    REDUCE_GRAD: float = 0.0


def _backward(
    B: float | None,  # noqa: N803
    I: float | None,  # noqa: E741, N803
    W: float | None,  # noqa: N803
    scale: float,
) -> tuple[float, float, float]:
    """(B, I, W) from those given: B = I + W; one half given: the other the same, B twice it;
    neither: B = 2 per share, halved."""
    if B is None and I is not None and W is not None:
        B = I + W
    if B is None and I is None and W is None:
        B = 2.0 * scale
    elif B is None:  # one half given: the other the same
        B = 2 * (I or W or 1.0)
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
    return B, I, W


@dataclass(frozen=True, slots=True)
class HostCost:
    """Time outside the transfers and compute ops, a field per host key of keys.py (None:
    not given, 0).

    `post`: host time a rank spends posting each Send/Recv (the op, or its group, is posted
    at the end of it); `wait`: host time after each Wait's release; `sync`: the
    duplicated-stage gradient sum after the program, once per step; `collective`: one
    collective instruction's duration; `dispatch`: the part of each compute instruction's
    duration that does not scale with its stage's share.
    """

    post: float | None = None
    wait: float | None = None
    sync: float | None = None
    collective: float | None = None
    dispatch: float | None = None

    def over(self, base: HostCost) -> HostCost:
        """This one's values where given, `base`'s elsewhere."""
        return _merged(self, base)
