"""A per-layer profile (`--layers layers.toml`) and a cut of its layers into stages.

The profile lists the model's layers in model order, one `[[layer]]` table each
(docs/search.md "Searching the cut"):

    unit = "ms"            # optional, as in cost files
    comm = 0.05            # message latency between ranks, as in cost files
    post = 0.02            # optional: host time of each send or receive, as in cost files
    wait = 0.01            # optional: host time of each wait after its release
    F_fixed = 0.1          # optional: a stage's own work per F beyond its layers' F
    [[layer]]
    name = "embed"
    F = 0.3
    I = 0.1                # or B (then I = W = B/2, as in cost files)
    W = 0.3
    act_bytes = 524288     # saved by one microbatch's forward
    param_bytes = 0        # optional
    input_bytes = 65536    # optional: the layer's input per microbatch (what recomputation keeps)

`grad_bytes` and `optim_bytes` (optional, 0) are the layer's gradients and optimizer state;
with `param_bytes` they are held for the whole step by the rank holding the layer. A `Cut`
assigns contiguous layers to each stage of a placement's cut, in stage order, and says which
stages recompute their forward; `cut_toml` writes it (`--partition cut.toml`), `load_cut`
reads it back, `cut_layers` gives `split_model` its `layers`. Nothing here imports torch.
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipecc.diagnostics import InputError

LAYER_KEYS = (
    "name",
    "F",
    "B",
    "I",
    "W",
    "act_bytes",
    "param_bytes",
    "grad_bytes",
    "optim_bytes",
    "input_bytes",
)
TOP_KEYS = ("unit", "comm", "post", "wait", "F_fixed", "layer")
RECOMPUTE = "full"  # the one recomputation a stage can choose: its whole forward again
_UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@dataclass(frozen=True, slots=True)
class Layer:
    """One layer of the profile: its durations and its bytes."""

    name: str
    F: float
    I: float  # noqa: E741
    W: float
    act_bytes: float = 0.0
    param_bytes: float = 0.0
    grad_bytes: float = 0.0
    optim_bytes: float = 0.0
    input_bytes: float | None = None

    @property
    def static_bytes(self) -> float:
        """Bytes held for the whole step: parameters, gradients, optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optim_bytes


@dataclass(frozen=True, slots=True)
class Profile:
    """The layers of a model, in model order, the message latency and the time unit."""

    layers: tuple[Layer, ...]
    comm: float = 0.0
    unit: str = ""
    origin: str = ""
    post: float = 0.0  # host time of each send or receive (a run's, as in cost files)
    wait: float = 0.0  # host time of each wait after its release
    F_fixed: float = 0.0  # a stage's own work per F beyond its layers' (a run's)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.layers)

    @property
    def has_bytes(self) -> bool:
        """Whether the profile gives any size (a `--memory` cap needs them)."""
        return any(layer.act_bytes or layer.static_bytes for layer in self.layers)


@dataclass(frozen=True, slots=True)
class Cut:
    """Contiguous layers per stage: stage s holds layers `starts[s]` .. `starts[s+1] - 1`
    (the last up to the end), and recomputes its forward where `recompute[s]`."""

    starts: tuple[int, ...]
    layers: int
    recompute: tuple[bool, ...]

    def __post_init__(self) -> None:
        bounds = (*self.starts, self.layers)
        if (
            not self.starts
            or self.starts[0] != 0
            or any(a >= b for a, b in zip(bounds, bounds[1:], strict=False))
        ):
            raise ValueError(f"a cut needs stages of at least one layer, got {self.starts}")
        if len(self.recompute) != len(self.starts):
            raise ValueError("one recompute flag per stage")

    @property
    def stages(self) -> int:
        return len(self.starts)

    def span(self, stage: int) -> range:
        """The layer indices of `stage`."""
        end = self.starts[stage + 1] if stage + 1 < self.stages else self.layers
        return range(self.starts[stage], end)

    def counts(self) -> tuple[int, ...]:
        """Layers per stage."""
        return tuple(len(self.span(s)) for s in range(self.stages))

    def with_recompute(self, recompute: tuple[bool, ...]) -> Cut:
        return Cut(self.starts, self.layers, recompute)

    def describe(self) -> str:
        """`3 4 4 5` with `r` after a recomputed stage's count."""
        return " ".join(
            f"{n}{'r' if r else ''}" for n, r in zip(self.counts(), self.recompute, strict=True)
        )


def cut_of_counts(counts: tuple[int, ...] | list[int]) -> Cut:
    """The cut with these layers per stage, without recomputation."""
    starts = [0]
    for count in counts[:-1]:
        starts.append(starts[-1] + count)
    return Cut(tuple(starts), sum(counts), (False,) * len(counts))


def uniform_cut(layers: int, stages: int) -> Cut:
    """Equal layer counts (DeepSpeed's `partition_method="uniform"`): counts differ by at
    most one, the earlier stages taking the extra layers."""
    base, extra = divmod(layers, stages)
    return cut_of_counts([base + (1 if s < extra else 0) for s in range(stages)])


def load_layers(path: str | Path) -> Profile:
    """Read a per-layer profile; InputError (exit 2) names the file, the layer and the key
    of anything it cannot use."""
    where = str(path)
    data = _read_toml(where)
    for key in data:
        _check_key(key, TOP_KEYS, where)
    tables = data.get("layer")
    if not isinstance(tables, list) or not tables:
        raise InputError(f"{where}: expected [[layer]] tables, one per layer in model order")
    layers = tuple(_layer(table, f"{where}: layer {n}") for n, table in enumerate(tables))
    names = [layer.name for layer in layers]
    for n, name in enumerate(names):
        if name in names[:n]:
            raise InputError(
                f"{where}: layer {n}: name '{name}' is already layer {names.index(name)}"
            )
    comm, post, wait, fixed = (
        _number(key, data.get(key, 0.0), where) for key in ("comm", "post", "wait", "F_fixed")
    )
    return Profile(layers, comm, str(data.get("unit", "")), where, post, wait, fixed)


def _read_toml(where: str) -> dict[str, Any]:
    try:
        return tomllib.loads(Path(where).read_text("utf-8"))
    except FileNotFoundError:
        raise InputError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"{where}: cannot read: {err}") from None
    except tomllib.TOMLDecodeError as err:
        raise InputError(f"{where}: malformed TOML: {err}") from None


def _layer(table: Any, where: str) -> Layer:
    if not isinstance(table, dict):
        raise InputError(f"{where}: expected a table")
    name = table.get("name")
    if not isinstance(name, str) or not name:
        raise InputError(f"{where}: needs a name (a non-empty string)")
    where = f"{where} ({name})"
    for key in table:
        _check_key(key, LAYER_KEYS, where)
    values = {k: _number(k, v, where) for k, v in table.items() if k != "name"}
    if "F" not in values:
        raise InputError(f"{where}: needs F (the forward's duration)")
    i, w = _backward(values, where)
    sizes = {k: values[k] for k in ("act_bytes", "param_bytes", "grad_bytes", "optim_bytes")
             if k in values}  # fmt: skip
    return Layer(name, values["F"], i, w, input_bytes=values.get("input_bytes"), **sizes)


def _backward(values: dict[str, float], where: str) -> tuple[float, float]:
    """I and W as cost files resolve them: B alone splits in halves; B with one of I, W
    gives the other; all three must add up."""
    b, i, w = values.get("B"), values.get("I"), values.get("W")
    if b is None:
        if i is None or w is None:
            raise InputError(f"{where}: needs B, or I and W (the backward's durations)")
        return i, w
    if i is None and w is None:
        return b / 2, b / 2
    i = b - w if i is None and w is not None else i
    w = b - i if w is None and i is not None else w
    assert i is not None and w is not None
    if min(i, w) < 0 or abs(i + w - b) > 1e-9 * max(1.0, b):
        raise InputError(f"{where}: B={b:g} is not I + W = {i:g} + {w:g}")
    return i, w


def _number(key: str, value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(f"{where}: {key} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise InputError(f"{where}: {key} must be a finite number ≥ 0, got {value}")
    return float(value)


def _check_key(key: str, known: tuple[str, ...], where: str) -> None:
    if key not in known:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise InputError(f"{where}: unknown key '{key}' (known: {', '.join(known)}){hint}")


def parse_size(text: str, flag: str = "--memory") -> float:
    """`40GiB`, `1.5TiB`, `512MiB`, `65536` → bytes (binary units only)."""
    found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:[eE][0-9]+)?)\s*([KMGT]iB|B)?\s*", text)
    if not found:
        raise InputError(
            f"{flag}: expected a number of bytes or one with a binary unit (KiB, MiB, GiB, "
            f"TiB: 40GiB), got {text!r}"
        )
    value = float(found[1]) * _UNITS[found[2] or ""]
    if not math.isfinite(value) or value <= 0:
        raise InputError(f"{flag}: must be positive, got {text!r}")
    return value


def format_size(value: float) -> str:
    """Bytes in the largest binary unit that keeps a value ≥ 1: `40 GiB`, `512 B`."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if abs(value) >= _UNITS[unit]:
            return f"{value / _UNITS[unit]:.4g} {unit}"
    return f"{value:g} B"


def cut_toml(cut: Cut, profile: Profile, header: str = "") -> str:
    """The cut as `--partition` writes it: one `[[stage]]` per program stage, in order."""
    lines = [f"# {line}" for line in header.splitlines()]
    for stage in range(cut.stages):
        names = ", ".join(f'"{profile.layers[n].name}"' for n in cut.span(stage))
        lines += ["", "[[stage]]", f"index = {stage}", f"layers = [{names}]"]
        if cut.recompute[stage]:
            lines.append(f'recompute = "{RECOMPUTE}"')
    return "\n".join(lines).lstrip("\n") + "\n"


def load_cut(path: str | Path, names: tuple[str, ...] | None = None) -> tuple[Cut, tuple[str, ...]]:
    """Read a cut file: the cut and the layer names in order. With `names` (the model's
    layers), the file must cover exactly those, in that order."""
    where = str(path)
    data = _read_toml(where)
    tables = data.get("stage")
    if not isinstance(tables, list) or not tables:
        raise InputError(f"{where}: expected [[stage]] tables, one per program stage")
    order: list[str] = []
    counts, recompute = [], []
    for n, table in enumerate(tables):
        at = f"{where}: stage table {n}"
        if not isinstance(table, dict) or table.get("index") != n:
            raise InputError(f"{at}: needs index = {n} (stages in order, from 0)")
        layers = table.get("layers")
        if (
            not isinstance(layers, list)
            or not layers
            or not all(isinstance(x, str) for x in layers)
        ):
            raise InputError(f"{at}: layers must be a non-empty list of layer names")
        mode = table.get("recompute")
        if mode not in (None, RECOMPUTE):
            raise InputError(f'{at}: recompute must be "{RECOMPUTE}", got {mode!r}')
        order += layers
        counts.append(len(layers))
        recompute.append(mode == RECOMPUTE)
    if names is not None and tuple(order) != names:
        raise InputError(f"{where}: the stages' layers are not the model's layers in order")
    if len(set(order)) != len(order):
        raise InputError(f"{where}: a layer is named twice")
    return cut_of_counts(counts).with_recompute(tuple(recompute)), tuple(order)


def cut_layers(path: str | Path) -> list[list[str]]:
    """The layer names of each stage of a cut file, in stage order: `split_model`'s
    `layers` (`split_model(model, stage, num_stages, layers=cut_layers("cut.toml"), ...)`),
    where the profile's layer names are the model's module names."""
    cut, names = load_cut(path)
    return [[names[n] for n in cut.span(stage)] for stage in range(cut.stages)]
