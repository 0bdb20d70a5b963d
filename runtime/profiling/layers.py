"""The per-layer profile of `pipecc run --profile-layers`: what `pipecc search --layers` reads.

Each layer (a module of the model file's `build_layers_model()`, named as in the cut) is
first timed alone, in one process on one thread, on one microbatch of the run's batch: the
whole model runs once with a forward pre-hook on every layer that keeps the layer's real
input; then the layers run on their inputs in rounds (every layer once a round, `ROUNDS`
rounds, so that a slow moment of the machine lands on all of them alike) as the runtime runs
a split backward (runtime/engine/split_backward.py): F its forward (inside the weight contract's
capture when it holds a contracted module, as the runtime's forward of a split chunk), I
`input_backward` from its output and W the weight work that I left, each the median of
`perf_counter` times. The last layer's F and I include the loss (`loss_fn` on its output).

Then the layer times are **calibrated against the run** (`calibrate`): the same run's
recorder measured each stage's F, I and W (or B) inside real steps, with the run's threads,
the other ranks beside it, the runtime's own work around each op (RNG states, boundary
checks, the capture) and its comm; each layer's F is scaled by its stage's measured F over
the sum of its layers' F alone, and I and W likewise (by the measured B over the alone I + W
where the run did not split). So a stage of the run's cut costs in the profile what it cost
in the run, and the layers' shares within it are the measured ones alone. `post` and `wait`
(the host time of each send or receive and of each wait) and `comm` (the fitted message
latency) are the run's own (runtime/profiling/recorder.py). `act_bytes` are the bytes of
the tensors its forward saves for backward (counted with `saved_tensors_hooks`, each
storage once), `param_bytes` its parameters', `input_bytes` its input's.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from pipecc.semantics.costs.keys import key as cost_key

from ..compat import child_table
from ..engine.split_backward import input_backward
from ..engine.weight_contract import Capture, capturing, contracted

__all__ = [
    "LayerClock",
    "calibrate",
    "layer_names",
    "profile_layers",
    "render_layers",
    "stage_of_layers",
]

Finish = Callable[[Any], Any]  # a layer's output -> what its backward starts from


class Times(NamedTuple):
    """One run of a layer: its F, I and W (seconds)."""

    F: float
    I: float  # noqa: E741
    W: float


ROUNDS = 15  # rounds of alone timings per layer (`profile_layers`)
CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


class LayerClock:
    """Each layer's forward time inside the run's own steps: a forward pre-hook and a
    forward hook on every layer module of a rank's stages, counting forwards that build a
    graph (a training F) while `step` is set (a timed step's index)."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.total: dict[tuple[str, int], float] = {}
        self.calls: dict[tuple[str, int], int] = {}
        self._start: dict[str, float] = {}

    def attach(self, module: torch.nn.Module, name: str) -> None:
        """Time `module`'s forwards as layer `name`."""

        def pre(_: torch.nn.Module, args: Any) -> None:
            if self.step is not None and torch.is_grad_enabled():
                self._start[name] = time.perf_counter()

        def post(_: torch.nn.Module, args: Any, out: Any) -> None:
            start = self._start.pop(name, None)
            if start is not None and self.step is not None:
                key = (name, self.step)
                self.total[key] = self.total.get(key, 0.0) + time.perf_counter() - start
                self.calls[key] = self.calls.get(key, 0) + 1

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    def means(self) -> dict[str, float]:
        """Milliseconds per forward, per layer timed: the median over the timed steps of
        each step's mean, as the recorder takes a stage's (runtime/profiling/recorder.py)."""
        steps: dict[str, list[float]] = {}
        for key, calls in sorted(self.calls.items()):
            steps.setdefault(key[0], []).append(self.total[key] / calls)
        return {name: statistics.median(means) * 1e3 for name, means in steps.items()}


def layer_names(model: torch.nn.Module) -> list[str]:
    """The model's layers when no cut names them: its children, a container's entries
    each a layer (`embed`, `blocks.0` ... `blocks.N-1`, `head`)."""
    names = []
    for name, child in model.named_children():
        if isinstance(child, CONTAINERS):
            names += [f"{name}.{key}" for key, sub in child_table(child).items() if sub is not None]
        else:
            names.append(name)
    return names


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a tensor, tuple, list or dict (nested)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, tuple | list):
        return [t for item in value for t in _tensors(item)]
    return []


def _map(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """`value` with `fn` applied to each of its tensors (in tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map(fn, item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_map(fn, item) for item in value)
    return value


def _inputs(
    model: torch.nn.Module, names: Sequence[str], batch: tuple[Any, ...]
) -> dict[str, tuple[Any, ...]]:
    """Each layer's positional input, captured on one forward of the whole model."""
    found: dict[str, tuple[Any, ...]] = {}
    modules = dict(model.named_modules())
    handles = []
    for name in names:

        def keep(_: torch.nn.Module, args: tuple[Any, ...], name: str = name) -> None:
            found[name] = _map(lambda t: t.detach().clone(), args)

        handles.append(modules[name].register_forward_pre_hook(keep))
    context = batch[2] if len(batch) == 3 else {}
    with torch.no_grad():
        model(batch[0], **context)
    for handle in handles:
        handle.remove()
    return found


def _leaves(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The layer's input as the runtime gives a stage: detached leaves, floating tensors
    requiring a gradient."""
    return tuple(_map(lambda t: t.detach().requires_grad_(t.is_floating_point()), args))


def _saved_bytes(module: torch.nn.Module, args: tuple[Any, ...], finish: Finish) -> int:
    """Bytes of the tensors one forward saves for its backward, each storage once."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        finish(module(*_leaves(args)))
    return sum(saved.values())


def _split_once(module: torch.nn.Module, args: tuple[Any, ...], finish: Finish) -> Times:
    """One F, I and W of `module` on `args` as the runtime splits a chunk's backward (the
    contract method where the layer holds a contracted module, else the graph walk);
    seconds each."""
    inputs = _leaves(args)
    capture = Capture(module) if contracted(module) else None
    start = time.perf_counter()
    with capturing(module, capture) if capture is not None else contextlib.nullcontext():
        out = finish(module(*inputs))
    forward = time.perf_counter()
    outs = [t for t in _tensors(out) if t.requires_grad]
    params = {id(p) for p in module.parameters()}
    leaves = _tensors(inputs)
    _, weight = input_backward(outs, [torch.ones_like(t) for t in outs], leaves, params, capture)
    backward = time.perf_counter()
    weight.run()
    end = time.perf_counter()
    module.zero_grad(set_to_none=True)
    return Times(forward - start, backward - forward, end - backward)


def _layer_facts(module: torch.nn.Module, args: tuple[Any, ...], finish: Finish) -> dict[str, int]:
    """The bytes of one layer on its input: what its forward saves, its parameters, its
    input."""
    return {
        cost_key("act_bytes"): _saved_bytes(module, args, finish),
        cost_key("param_bytes"): sum(p.numel() * p.element_size() for p in module.parameters()),
        "input_bytes": sum(t.numel() * t.element_size() for t in _tensors(args)),
    }


def _time_loss(module: torch.nn.Module, args: tuple[Any, ...], finish: Finish) -> float:
    """One call of the loss on the last layer's output (seconds)."""
    out = module(*_leaves(args))
    start = time.perf_counter()
    finish(out)
    return time.perf_counter() - start


def profile_layers(
    model: torch.nn.Module,
    names: Sequence[str],
    batch: tuple[Any, ...],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    repeats: int = ROUNDS,
) -> list[dict[str, Any]]:
    """One entry per layer, in model order, each timed alone: name, F, I, W (ms, medians),
    act_bytes, param_bytes, input_bytes, on the microbatch `batch` ((inputs, targets) or
    with a context).

    The layers are timed in `repeats` rounds (after one warm-up round), each round every
    layer once in model order, not each layer's repeats one after the other: a slow moment
    of a shared machine then lands on every layer of a round alike instead of on the few
    layers timed during it. Each layer's times enter the calibration through its stage's
    sum (`calibrate`), so one layer measured slow makes its stage's other layers look fast,
    and a cut that moves those layers to another stage is mispredicted by as much."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (runtime/tools/spawn.py)
    try:
        inputs = _inputs(model, names, batch)
        modules = dict(model.named_modules())
        finishes = [_finish(loss_fn, batch, last=i == len(names) - 1) for i in range(len(names))]
        runs: list[list[Times]] = [[] for _ in names]
        losses: list[float] = []
        for round_ in range(repeats + 1):  # round 0 warms up
            for index, name in enumerate(names):
                times = _split_once(modules[name], inputs[name], finishes[index])
                if round_ > 0:
                    runs[index].append(times)
            if round_ > 0:
                losses.append(_time_loss(modules[names[-1]], inputs[names[-1]], finishes[-1]))
        entries = []
        for index, name in enumerate(names):
            entry: dict[str, Any] = {
                "name": name,
                **{k: statistics.median(getattr(r, k) for r in runs[index]) * 1e3 for k in "FIW"},
                **_layer_facts(modules[name], inputs[name], finishes[index]),
            }
            if index == len(names) - 1:  # the loss alone too: the run's layer hooks miss it
                entry["loss"] = statistics.median(losses) * 1e3
            entries.append(entry)
    finally:
        torch.set_num_threads(before)
    return entries


def _finish(
    loss_fn: Callable[[Any, Any], torch.Tensor], batch: tuple[Any, ...], *, last: bool
) -> Finish:
    """What a layer's backward starts from: the loss on its output for the last layer, the
    output itself otherwise."""
    if last:
        return lambda out: loss_fn(out, batch[1])
    return lambda out: out


def stage_of_layers(names: Sequence[str], held: Mapping[int, Sequence[str]]) -> list[int]:
    """The stage of the run that held each layer, from the parameter names each stage held
    (`split_model` keeps the whole model's names): a layer whose parameters one stage holds
    is that stage's; a layer without parameters goes with the layer before it (the first
    with stage 0's)."""
    owner = {param: stage for stage, params in held.items() for param in params}
    found: list[int] = []
    for name in names:
        stages = {s for param, s in owner.items() if param.startswith(f"{name}.")}
        found.append(min(stages) if stages else (found[-1] if found else 0))
    return found


def calibrate(
    entries: Sequence[dict[str, Any]],
    stages: Sequence[int],
    measured: Mapping[int, Mapping[str, float]],
    in_run: Mapping[str, float] | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """The layers' F, I and W scaled so that each stage of the run sums to what the run
    measured for it (`measured`: per stage, the recorder's F, I, W or B in ms): F by the
    stage's F over its layers' F alone; I and W by its I and W, or both by its B over their
    I + W where the run did not split. A stage or op the run did not measure keeps the
    alone times. Each entry keeps the alone times as `alone` and the factors as `scale`.

    With `in_run` (each layer's F timed inside the run's steps, `LayerClock`) a stage whose
    layers all have one takes those as its layers' F (the last layer's with its `loss`
    timed alone, which the hooks do not see), and what its measured F has beyond their sum
    is the stage's own work per F (its inputs, RNG state, output checks): the second value
    returned is the mean of that over those stages (0 without), `F_fixed`."""
    scales: dict[int, dict[str, float]] = {}
    fixed: list[float] = []
    timed: set[int] = set()  # the stages whose layers' F come from the run
    for stage in set(stages):
        layers = [e for e, s in zip(entries, stages, strict=True) if s == stage]
        sums = {k: sum(e[k] for e in layers) for k in "FIW"}
        scales[stage] = _scales(sums, measured.get(stage, {}))
        run_f = measured.get(stage, {}).get("F")
        if in_run and run_f is not None and all(e["name"] in in_run for e in layers):
            inside = sum(in_run[e["name"]] + e.get("loss", 0.0) for e in layers)
            fixed.append(max(0.0, run_f - inside))
            timed.add(stage)
    found = []
    for entry, stage in zip(entries, stages, strict=True):
        scale = scales[stage]
        alone = {k: entry[k] for k in "FIW"}
        times = {k: alone[k] * scale[k] for k in "FIW"}
        if stage in timed and in_run:
            times["F"] = in_run[entry["name"]] + entry.get("loss", 0.0)
            scale = {**scale, "F": times["F"] / alone["F"] if alone["F"] else 1.0}
        found.append({**entry, **times, "alone": alone, "scale": scale})
    return found, (sum(fixed) / len(fixed) if fixed else 0.0)


def _scales(alone: Mapping[str, float], run: Mapping[str, float]) -> dict[str, float]:
    """Per op kind, the run's time over the layers' sum alone (1 where either is missing)."""

    def ratio(got: float | None, sum_alone: float) -> float:
        return got / sum_alone if got is not None and sum_alone > 0 else 1.0

    backward = ratio(run.get("B"), alone["I"] + alone["W"])
    return {
        "F": ratio(run.get("F"), alone["F"]),
        "I": ratio(run["I"], alone["I"]) if "I" in run else backward,
        "W": ratio(run["W"], alone["W"]) if "W" in run else backward,
    }


def render_layers(entries: Sequence[dict[str, Any]], host: Mapping[str, float], header: str) -> str:
    """The layer profile as TOML (docs/search.md section 12's format); `host` holds the
    run's `comm`, `post`, `wait` and `F_fixed` (ms; those it has)."""
    lines = [f"# {line}" for line in header.splitlines()]
    lines += ['unit = "ms"']
    lines += [
        f"{name} = {host[name]:.4g}"
        for name in (cost_key("comm"), cost_key("post"), cost_key("wait"), "F_fixed")
        if name in host
    ]
    for entry in entries:
        lines += ["", "[[layer]]", f'name = "{entry["name"]}"']
        if "alone" in entry:
            alone, scale = entry["alone"], entry["scale"]
            lines.append(
                "# alone: "
                + ", ".join(f"{k} {alone[k]:.4g}" for k in "FIW")
                + "; run / alone: "
                + ", ".join(f"{k} {scale[k]:.3g}" for k in "FIW")
            )
        lines += [
            f"{name} = {entry[name]:.4g}" for name in (cost_key("F"), cost_key("I"), cost_key("W"))
        ]
        lines += [
            f"{name} = {int(entry[name])}"
            for name in (cost_key("act_bytes"), cost_key("param_bytes"))
        ]
        lines.append(f"input_bytes = {int(entry['input_bytes'])}")
    return "\n".join(lines) + "\n"
