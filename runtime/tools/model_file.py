"""The model file of `pipecc run`: what it must and may define.

Required: `make_batch(num_rows, seed) -> (inputs, targets)` or `(inputs, targets, context)`
(inputs and targets any pytree of tensors, split along dim 0; context a dict of every
stage's keyword inputs, split alike and given to every rank, runtime/boundaries/context.py)
and one of two ways to build the model, both deterministic (every process builds the same
weights):

- `build_stage(stage, num_stages) -> nn.Module`: that one stage. Each rank calls it only for
  the stages it holds, so no rank constructs another rank's stages (a model that fits only
  split over the ranks; `pipecc.runtime.split_model` cuts a stage out of a model built on
  the meta device). Used whenever the file defines it.
- `build_stages(num_stages) -> list[nn.Module]`: the whole model as consecutive stages (small
  models; every rank builds all and keeps its own, and a Parameter object in two stages is a
  tied weight).

For a cut chosen elsewhere (`pipecc run --partition cut.toml`, the cut `pipecc search
--layers` writes), the file also defines `build_layers_model() -> nn.Module`: the whole model
on the meta device (`with torch.device("meta"): ...`), whose module names are the cut's
layer names (`embed`, `blocks.0`, ..., `head`), and `init_stage(module)`, which initialises a
materialized stage deterministically (e.g. each weight from a generator seeded by its name,
so every cut has the same weights). Each rank then builds its own stages as
`split_model(build_layers_model(), stage, num_stages, layers=<the cut>, init=init_stage)`,
and so does `--check`'s reference; `build_stage`/`build_stages` are not called. The same two
let `pipecc run --profile-layers` time each layer (runtime/profiling/layers.py).

Optional: `loss_fn(output, target)` (default: mean squared error, for floating targets),
`boundaries(example_inputs)` (the boundary specs for one microbatch of stage 0's input,
declared: checked against those the runtime finds by running the stages on real data),
`autocast` (a dtype the forwards run under, e.g. `torch.bfloat16`), `build_model() ->
nn.Module` (the whole, unsplit model: `model(inputs, **context)` returns what `loss_fn`
takes; its parameter names are the stages', for `--check --reference whole`,
runtime/tools/whole_reference.py) and `parallelize(module, stage, tp_mesh)` (tensor
parallelism of one stage module over the mesh's tp dimension, `parallelize_module` as
torchtitan applies it; `pipecc run --mesh tp=N` calls it on every stage it builds) and
`optimizer` (`"adamw"`, `"adam"`, `"sgd"`, `"none"` or a function of the parameters
returning a torch optimizer: the optimizer whose state `pipecc run --memory` and
`--profile` report in bytes; AdamW when not given) and `recompute` (a mode for every stage,
`"full"`, `"none"` or a selection of submodules such as `"attn"` or
`"type=Attention+name=mlp"`, or {stage: mode}: what runs again in the backward,
runtime/engine/recompute.py; `pipecc run --recompute` overrides it) and `shared(num_stages)`
(the parameters that are one object in the whole model but built apart by `build_stage`, a
tied embedding and LM head: groups of `(stage, parameter name)`, what
`RuntimeConfig(shared=...)` takes; the run sums their gradients across the ranks holding
them, and the stage-by-stage reference ties them).
`--check` builds every stage in the launcher for its single-process reference (with
`build_stage` when defined, so the reference has the ranks' weights).
"""

from __future__ import annotations

import runpy
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pipecc.diagnostics import InputError

from ..compat import pytree
from ..config import mse_loss
from ..engine.recompute import Spec
from .split_model import split_model, stage_layers

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelFile:
    build_stages: Callable[[int], list[torch.nn.Module]] | None
    make_batch: Callable[..., tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    has_loss_fn: bool = True
    boundaries: Callable[[Any], Mapping[int, object]] | None = None
    autocast: torch.dtype | None = None
    build_stage: Callable[[int, int], torch.nn.Module] | None = None
    path: str = "the model file"
    build_model: Callable[[], torch.nn.Module] | None = None
    parallelize: Callable[[torch.nn.Module, int, Any], object] | None = None
    optimizer: str | Callable[..., Any] | None = None  # for its bytes (`pipecc run --memory`)
    recompute: Spec = None
    build_layers_model: Callable[[], torch.nn.Module] | None = None  # on meta, for a cut
    init_stage: Callable[[torch.nn.Module], object] | None = None
    layers: tuple[tuple[str, ...], ...] | None = None  # `--partition`: each stage's layers
    shared: Callable[[int], object] | None = None  # `shared(num_stages)`: the declared ties

    def declared_shared(self, num_stages: int) -> tuple[tuple[tuple[int, str], ...], ...]:
        """`shared(num_stages)`: groups of (stage, parameter name) that are one parameter,
        for `RuntimeConfig(shared=...)` and the reference's ties; () without it."""
        if self.shared is None:
            return ()
        found = self.shared(num_stages)
        groups = _groups(found)
        if not groups or any(len(g) < 2 or not 0 <= s < num_stages for g in groups for s, _ in g):
            raise InputError(
                f"{self.path}: shared({num_stages}) must return groups of two or more "
                f"(stage, parameter name) pairs with stages below {num_stages}, e.g. "
                f"[((0, 'embed.weight'), ({num_stages - 1}, 'head.weight'))]; got {found!r}"
            )
        return groups

    @property
    def own_stages(self) -> bool:
        """Each rank builds only its own stages (`build_stage`, or a cut)."""
        return self.build_stage is not None or self.layers is not None

    def with_cut(self, layers: tuple[tuple[str, ...], ...] | None) -> ModelFile:
        """This model file with its stages cut as `layers` (`--partition`): needs
        `build_layers_model` and `init_stage`."""
        if layers is None:
            return self
        missing = [
            name
            for name, value in (
                ("build_layers_model", self.build_layers_model),
                ("init_stage", self.init_stage),
            )
            if value is None
        ]
        if missing:
            raise InputError(
                f"{self.path}: --partition builds the stages from a cut, which needs "
                f"{' and '.join(missing)} in the model file (build_layers_model(): the whole "
                "model on the meta device; init_stage(module): its initialisation)"
            )
        return replace(self, layers=layers)

    def check_cut(self, num_stages: int) -> None:
        """The cut's layers are the model's and hold every parameter (InputError else)."""
        if self.layers is None:
            return
        try:
            stage_layers(self._meta_model(), num_stages, self.layers)
        except InputError as err:
            raise InputError(f"--partition: the cut does not fit {self.path}: {err}") from None

    def layers_model(self) -> torch.nn.Module:
        """The whole model of `build_layers_model`, materialized on the CPU and initialised
        by `init_stage` (`--profile-layers`)."""
        whole = self.meta_layers_model().to_empty(device="cpu")
        assert self.init_stage is not None  # meta_layers_model checked it
        self.init_stage(whole)
        return whole

    def meta_layers_model(self) -> torch.nn.Module:
        """The whole model of `build_layers_model` on the meta device (`--profile-layers`:
        InputError without it or `init_stage`)."""
        if self.build_layers_model is None or self.init_stage is None:
            raise InputError(
                f"{self.path}: --profile-layers times the layers of build_layers_model() (the "
                "whole model on the meta device), initialised by init_stage(module): define both"
            )
        return self._meta_model()

    def _meta_model(self) -> torch.nn.Module:
        assert self.build_layers_model is not None
        found = self.build_layers_model()
        if not isinstance(found, torch.nn.Module):
            raise InputError(
                f"{self.path}: build_layers_model() returned {type(found).__name__}, not a "
                "torch.nn.Module"
            )
        return found

    def batch(self, num_rows: int, seed: int) -> tuple[Any, ...]:
        """`make_batch(num_rows, seed)`: (inputs, targets) or (inputs, targets, context)."""
        found = self.make_batch(num_rows, seed=seed)
        if not isinstance(found, tuple) or len(found) not in (2, 3):
            raise InputError(
                f"{self.path}: make_batch must return (inputs, targets) or (inputs, targets, "
                f"context), got {type(found).__name__}"
                + (f" of {len(found)}" if isinstance(found, tuple) else "")
            )
        if len(found) == 3 and not isinstance(found[2], Mapping):
            raise InputError(
                f"{self.path}: make_batch's context (its third value) must be a dict of "
                f"keyword arguments, got {type(found[2]).__name__}"
            )
        return found

    def stages(self, wanted: Iterable[int], num_stages: int) -> dict[int, torch.nn.Module]:
        """The modules of the `wanted` stages, each built once: with `build_stage` only
        those; with `build_stages` the whole model, of which the others are dropped."""
        wanted = sorted(set(wanted))
        if self.layers is not None:
            return {
                stage: split_model(
                    self._meta_model(), stage, num_stages, layers=self.layers, init=self.init_stage
                )
                for stage in wanted
            }
        if self.build_stage is None:
            assert self.build_stages is not None
            whole = self.build_stages(num_stages)
            if len(whole) != num_stages:
                raise InputError(
                    f"{self.path}: build_stages({num_stages}) returned {len(whole)} stages"
                )
            return {stage: whole[stage] for stage in wanted}
        found = {}
        for stage in wanted:
            module = self.build_stage(stage, num_stages)
            if not isinstance(module, torch.nn.Module):
                raise InputError(
                    f"{self.path}: build_stage({stage}, {num_stages}) returned "
                    f"{type(module).__name__}, not a torch.nn.Module"
                )
            found[stage] = module
        return found

    def all_stages(self, num_stages: int) -> list[torch.nn.Module]:
        """Every stage in order (the single-process reference)."""
        return list(self.stages(range(num_stages), num_stages).values())


def _groups(found: object) -> tuple[tuple[tuple[int, str], ...], ...] | None:
    """`shared(num_stages)`'s value as groups of (stage, name), or None when it is not."""
    if not isinstance(found, list | tuple):
        return None
    groups = []
    for group in found:
        keys = [k for k in group if _is_key(k)] if isinstance(group, list | tuple) else []
        if not keys or len(keys) != len(group):
            return None
        groups.append(tuple((int(k[0]), str(k[1])) for k in keys))
    return tuple(groups)


def _is_key(key: object) -> bool:
    return (
        isinstance(key, list | tuple)
        and len(key) == 2
        and isinstance(key[0], int)
        and isinstance(key[1], str)
    )


def load_model(path: str) -> ModelFile:
    """Read a model file; every way it can be unusable is an InputError."""
    if not Path(path).is_file():
        raise InputError(f"{path}: no such model file")
    try:
        names = runpy.run_path(path, run_name="pipecc_model")
    except Exception as err:
        raise InputError(
            f"{path}: the model file fails to load: {type(err).__name__}: {err}"
            + _user_frames(err, path)
        ) from err
    builders = {name: names.get(name) for name in ("build_stage", "build_stages")}
    if not any(callable(value) for value in builders.values()):
        raise InputError(
            f"{path}: the model file must define build_stage(stage, num_stages) (one stage) "
            "or build_stages(num_stages) (all of them)"
        )
    for name, value in builders.items():
        if value is not None and not callable(value):
            raise InputError(f"{path}: {name} must be a function")
    if not callable(names.get("make_batch")):
        raise InputError(f"{path}: the model file must define make_batch()")
    loss_fn = names.get("loss_fn", mse_loss)
    if not callable(loss_fn):
        raise InputError(f"{path}: loss_fn must be a function")
    boundaries = _optional_function(names, "boundaries", path, " of the example inputs")
    build_model = _optional_function(names, "build_model", path)
    autocast = names.get("autocast")
    if autocast is not None and not isinstance(autocast, torch.dtype):
        raise InputError(f"{path}: autocast must be a torch dtype, e.g. torch.bfloat16")
    parallelize = _optional_function(names, "parallelize", path)
    return ModelFile(
        builders["build_stages"], names["make_batch"], loss_fn, "loss_fn" in names, boundaries,
        autocast, builders["build_stage"], path, build_model, parallelize,
        _optimizer(path, names.get("optimizer")), _recompute(path, names.get("recompute")),
        _optional_function(names, "build_layers_model", path),
        _optional_function(names, "init_stage", path, " of a stage module"),
        shared=_optional_function(names, "shared", path, " of the number of stages"),
    )  # fmt: skip


def _optional_function(
    names: dict[str, Any], name: str, path: str, what: str = ""
) -> Callable[..., Any] | None:
    """An optional name of the model file: absent, or a function."""
    value = names.get(name)
    if value is not None and not callable(value):
        raise InputError(f"{path}: {name} must be a function{what}")
    return value


OPTIMIZER_NAMES = ("adamw", "adam", "sgd", "none")


def _optimizer(path: str, value: object) -> str | Callable[..., Any] | None:
    """`optimizer`: a name (adamw, adam: two fp32 states per parameter; sgd, none: no state)
    or a callable `optimizer(params) -> torch.optim.Optimizer`."""
    if value is None or callable(value) or value in OPTIMIZER_NAMES:
        return value
    raise InputError(
        f"{path}: optimizer must be one of {', '.join(OPTIMIZER_NAMES)} or a function of the "
        f"parameters returning a torch optimizer, got {value!r}"
    )


def _recompute(path: str, value: object) -> Spec:
    """`recompute`: a mode for every stage, or a dict of stage to mode (its stages are
    checked against the program's when the job starts)."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        if not all(isinstance(k, int) and isinstance(v, str) for k, v in value.items()):
            raise InputError(f"{path}: recompute must map stage numbers to modes, got {value!r}")
        return dict(value)
    if isinstance(value, str):
        return value
    raise InputError(
        f"{path}: recompute must be a mode ('full', 'none', a module selection such as 'attn') "
        f"or {{stage: mode}}, got {value!r}"
    )


def _user_frames(err: BaseException, path: str) -> str:
    """The traceback of `err` from its first frame in the model file on (the user's code,
    with what it called), or nothing when no frame is in the file (a SyntaxError names
    its line itself)."""
    frames = traceback.extract_tb(err.__traceback__)
    mine = str(Path(path).resolve())
    start = next((i for i, f in enumerate(frames) if str(Path(f.filename).resolve()) == mine), None)
    if start is None:
        return ""
    lines = traceback.format_list(frames[start:])
    return "\nTraceback (most recent call last):\n" + "".join(lines).rstrip()


def check_targets(path: str, model: ModelFile, targets: object) -> None:
    """Integer targets need a loss_fn: the default (MSE) cannot take them."""
    if model.has_loss_fn:
        return
    for leaf in pytree.tree_leaves(targets):
        if isinstance(leaf, torch.Tensor) and not leaf.dtype.is_floating_point:
            dtype = str(leaf.dtype).removeprefix("torch.")
            raise InputError(
                f"{path}: make_batch returns {dtype} targets, but the model file defines no "
                "loss_fn and the default (mean squared error) needs floating targets: define "
                "loss_fn(output, target), e.g. a cross-entropy"
            )


def param_dtypes(stages: Iterable[torch.nn.Module]) -> list[torch.dtype]:
    return sorted({p.dtype for s in stages for p in s.parameters()}, key=str)
