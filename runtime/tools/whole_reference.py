"""The check against the unsplit model: `pipecc run --check --reference whole` and
`check_against`.

The stage-by-stage reference (runtime/tools/reference.py) runs the user's own stages one
after another, so it checks the schedule, not the split: a stage that forgets a layer or
skips a norm passes it. This one runs the *whole model* (`build_model()` of the model file;
`model(inputs, **context)` returns what `loss_fn` takes) one microbatch at a time, each
loss (plus the losses added inside it, `add_loss`) scaled by 1/M, and compares the
pipelined step with it **by parameter name**: stages must keep the model's names (stages
cut by `split_model`, or `build_stage` modules whose `named_parameters()` are the model's
fully qualified names). It fails, naming what differs, when

* a parameter of the model is in no stage (a layer the split forgot),
* a stage holds a parameter the model does not have (a name the split changed),
* a parameter is held but no stage used it (no gradient, where the model has one),
* a parameter's gradient differs beyond the tolerance (a layer skipped, a norm dropped, a
  rotary embedding computed differently), or
* the main loss or the added losses differ.

The whole model runs on the ranks' RNG streams, not the per-stage derivation, so a model
with dropout must be compared in a mode without it: `pipecc run` sets every dropout module's
probability to 0 on both sides (`dropout_off`; a functional dropout in a forward stays).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from pipecc.diagnostics import InputError

from ..boundaries.specs import autocast_context
from ..boundaries.trees import split_tree, unwrap
from ..comm.agreement import gather_texts
from ..engine.aux_loss import collecting
from ..engine.aux_loss import total as added_total
from ..pipeline import PipelineRuntime
from .checking import RANK_THREADS, CheckResult
from .model_file import ModelFile
from .reference import Options, ParamDiff, context_microbatches, threads

SHOWN = 5  # differing gradients a failure lists


class WholeStep(NamedTuple):
    """One step of the whole model: mean main loss, mean added loss, `.grad` by name
    (None: the model itself gives the parameter no gradient)."""

    loss: float
    added: float
    grads: dict[str, torch.Tensor | None]


class Held(NamedTuple):
    """One stage parameter's gradient after a pipelined step, where it was held."""

    rank: int
    stage: int
    name: str
    grad: torch.Tensor | None  # None: no stage used it


def whole_step(
    model: torch.nn.Module,
    batch: tuple[Any, ...],
    microbatches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    autocast: torch.dtype | None = None,
) -> WholeStep:
    """One training step of the unsplit model, microbatch by microbatch, as the runtime
    scales it; the model's gradients are zeroed first and hold the step's after."""
    device = _device_of(model)
    model.zero_grad(set_to_none=True)
    inputs = split_tree(batch[0], microbatches, "inputs", device)
    targets = split_tree(batch[1], microbatches, "targets", device)
    contexts = context_microbatches(batch, microbatches, device)
    main = added = 0.0
    for mb in range(microbatches):
        found: list[torch.Tensor] = []
        with collecting(found), autocast_context(device, autocast):
            value = inputs[mb]
            args = tuple(value) if isinstance(value, (tuple, list)) else (value,)
            loss = loss_fn(unwrap(model(*args, **contexts[mb])), unwrap(targets[mb]))
        extra = added_total(found)
        full = loss if extra is None else loss + extra
        torch.autograd.backward(full * (1.0 / microbatches))
        main += float(loss.detach())
        added += 0.0 if extra is None else float(extra.detach())
    grads = {
        name: None if p.grad is None else p.grad.detach().cpu().clone()
        for name, p in model.named_parameters(remove_duplicate=False)  # a tied weight: both
    }
    return WholeStep(main / microbatches, added / microbatches, grads)


def held_grads(stages: Mapping[int, torch.nn.Module], rank: int) -> list[Held]:
    """Every parameter of this rank's stages (`{stage: module}`) with its gradient."""
    return [
        Held(rank, stage, name, None if p.grad is None else p.grad.detach().cpu().clone())
        for stage, module in sorted(stages.items())
        for name, p in module.named_parameters(remove_duplicate=False)
    ]


class Comparison(NamedTuple):
    """The pipelined step against the whole model's: failures (empty: equal) and the
    largest relative gradient difference."""

    failures: list[str]
    max_rel: float


def compare_by_name(
    held: Iterable[Held], whole: WholeStep, losses: tuple[float, float], tolerance: float
) -> Comparison:
    """`held`: every stage parameter of every rank; `losses`: the pipelined step's mean
    main and added losses."""
    held = list(held)
    diffs = grad_diffs(held, whole)
    return _verdict(
        coverage(held, whole), diffs, tolerance, _loss_failures(losses, whole, tolerance)
    )


def grad_diffs(held: Iterable[Held], whole: WholeStep) -> list[tuple[float, str]]:
    """Each held gradient's relative difference from the whole model's, with its line (a
    gradient of another shape than the model's differs infinitely)."""
    diffs = []
    for item in held:
        want = whole.grads.get(item.name)
        if want is None or item.grad is None or not want.numel():
            continue
        where = f"stage {item.stage} '{item.name}' on rank {item.rank}"
        if want.shape != item.grad.shape:
            shapes = f"{list(item.grad.shape)}, the model's {list(want.shape)}"
            diffs.append((math.inf, f"{where}: shape {shapes}"))
            continue
        size = float(want.abs().max())
        diff = float((item.grad.float() - want.float()).abs().max())
        rel = diff / size if size > 0 else diff
        numbers = f"max abs diff {diff:.3g}, rel {rel:.3g}"
        diffs.append((rel, f"{where}: gradient differs from the whole model's ({numbers})"))
    return diffs


def _verdict(
    failures: list[str], diffs: list[tuple[float, str]], tolerance: float, losses: list[str]
) -> Comparison:
    diffs = sorted(diffs, key=lambda d: -d[0])
    bad = [line for rel, line in diffs if rel > tolerance]
    failures = failures + bad[:SHOWN]
    if len(bad) > SHOWN:
        failures.append(f"... and {len(bad) - SHOWN} more gradients differ")
    return Comparison(failures + losses, diffs[0][0] if diffs else 0.0)


def coverage(held: list[Held], whole: WholeStep) -> list[str]:
    """Parameters in no stage, in no model, held but used by no stage (a held gradient of
    None: no stage used it)."""
    names = {item.name for item in held}
    failures = [
        f"the model's parameter '{name}' is in no stage"
        for name in whole.grads
        if name not in names
    ]
    foreign = sorted({(h.stage, h.name) for h in held if h.name not in whole.grads})
    failures += [
        f"stage {stage} holds '{name}', which is no parameter of the model (stages must keep "
        "the model's parameter names)"
        for stage, name in foreign
    ]
    failures += [
        f"stage {h.stage} '{h.name}' on rank {h.rank} has shape {list(h.grad.shape)}, the "
        f"model's has {list(want.shape)}"
        for h in held
        if h.grad is not None and h.grad is not _USED
        and (want := whole.grads.get(h.name)) is not None and want.shape != h.grad.shape
    ]  # fmt: skip
    used = {h.name for h in held if h.grad is not None}
    idle = sorted(
        {h.name for h in held if h.name not in used and whole.grads.get(h.name) is not None}
    )
    stages = {h.name: h.stage for h in held}
    failures += [
        f"stage {stages[name]} holds '{name}', but no stage uses it (no gradient; the whole "
        "model gives it one)"
        for name in idle
    ]
    return failures


def _loss_failures(losses: tuple[float, float], whole: WholeStep, tolerance: float) -> list[str]:
    found = []
    for what, got, want in (
        ("loss", losses[0], whole.loss),
        ("added loss", losses[1], whole.added),
    ):
        if abs(got - want) > tolerance * max(abs(want), 1e-30):
            found.append(f"the {what} {got!r} differs from the whole model's {want!r}")
    return found


class WholeCheck(NamedTuple):
    """What `check_against` found, the same on every rank."""

    ok: bool
    loss: float  # the pipelined step's mean main loss
    reference_loss: float  # the whole model's
    added: float  # the pipelined step's mean added loss (add_loss)
    reference_added: float
    max_rel_grad_diff: float
    failures: list[str]


def check_against(
    model: torch.nn.Module,
    runtime: PipelineRuntime,
    inputs: object = None,
    targets: object = None,
    *,
    context: object = None,
    tolerance: float = 1e-5,
) -> WholeCheck:
    """Run one pipelined step and the same step of the unsplit `model`, and compare them
    by parameter name (module docstring). A collective: every rank of the pipeline calls it
    with the same batch (every rank needs the inputs and targets here, for the whole
    model). The stages' gradients are zeroed first and hold the step's after.

    The reference is a private copy of `model` whose every parameter takes the current
    value of the stage that holds it (sent by the lowest rank holding it): a model that
    shares parameters with the stages, or whose other layers went stale while each rank
    trained only its stages, cannot make the reference wrong. The model must be
    materialized (not on the meta device) with the stages' parameter names."""
    if any(p.is_meta for p in model.parameters()):
        raise InputError("check_against needs the whole model materialized, not on meta")
    for param in runtime.parameters():
        param.grad = None
    runtime.step(inputs, targets, context=context)
    losses = runtime.global_loss(breakdown=True)
    mine = {c.slot.stage: c.module for c in runtime.chunks.values()}
    reference = _synced_copy(model, runtime, mine)
    batch = (inputs, targets) if context is None else (inputs, targets, context)
    whole = whole_step(
        reference, batch, runtime.program.num_microbatches, runtime.loss_fn,
        runtime.config.autocast,
    )  # fmt: skip
    held = held_grads(mine, runtime.rank)
    gathered = _gathered(runtime, held, grad_diffs(held, whole))
    compared = _verdict(
        coverage(gathered.held, whole), gathered.diffs, tolerance,
        _loss_failures((losses.main, losses.added), whole, tolerance),
    )  # fmt: skip
    return WholeCheck(
        not compared.failures, losses.main, whole.loss, losses.added, whole.added,
        compared.max_rel, compared.failures,
    )  # fmt: skip


def _synced_copy(
    model: torch.nn.Module, runtime: PipelineRuntime, mine: Mapping[int, torch.nn.Module]
) -> torch.nn.Module:
    """A copy of `model` on the runtime's device, every parameter held by a stage set to
    that stage's current value (broadcast from the lowest rank holding it)."""
    reference = copy.deepcopy(model).to(runtime.device)
    local = {n: p for m in mine.values() for n, p in m.named_parameters(remove_duplicate=False)}
    shapes = json.dumps({name: list(p.shape) for name, p in local.items()})
    holders = gather_texts(shapes, runtime.group, runtime.program.num_ranks, runtime.device)
    owner: dict[str, tuple[int, list[int]]] = {}
    for rank, text in enumerate(holders):
        for name, shape in json.loads(text).items():
            owner.setdefault(name, (rank, shape))
    with torch.no_grad():
        for name, param in reference.named_parameters(remove_duplicate=False):
            rank, shape = owner.get(name, (-1, []))
            if rank < 0 or shape != list(param.shape):  # in no stage, or another shape:
                continue  # the comparison reports it
            mine_now = rank == runtime.rank
            buffer = local[name].detach().to(param.dtype).clone() if mine_now else param.data
            dist.broadcast(buffer, runtime.rank_map[rank], group=runtime.group)
            param.data.copy_(buffer)
    return reference


class _Gathered(NamedTuple):
    held: list[Held]  # every rank's (gradients only as used or not: a placeholder)
    diffs: list[tuple[float, str]]  # every rank's own gradient differences


def _gathered(
    runtime: PipelineRuntime, held: list[Held], diffs: list[tuple[float, str]]
) -> _Gathered:
    """Every rank's held parameters and gradient differences: each rank compares the
    gradients it holds, only the names, whether each was used and the lines travel."""
    mine = {"held": [[h.stage, h.name, h.grad is not None] for h in held], "diffs": diffs}
    texts = gather_texts(json.dumps(mine), runtime.group, runtime.program.num_ranks, runtime.device)
    found = _Gathered([], [])
    for rank, text in enumerate(texts):
        other = json.loads(text)
        found.held.extend(Held(rank, s, n, _USED if used else None) for s, n, used in other["held"])
        found.diffs.extend((rel, line) for rel, line in other["diffs"])
    return found


_USED = torch.zeros(())  # stands for a gradient another rank holds (and compared)


def _device_of(model: torch.nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def check_whole_run(
    model: ModelFile,
    batches: Sequence[tuple[Any, ...]],
    microbatches: int,
    options: Options,
    held: Sequence[Sequence[list[Held]]],
) -> CheckResult:
    """`pipecc run --check --reference whole`: `held[rank][step]`, each rank's stage
    parameters of each step; the whole model is built once (`build_model()`)."""
    if model.build_model is None:
        raise InputError(
            f"{model.path}: --reference whole needs build_model() (the whole, unsplit model) "
            "in the model file"
        )
    with threads(RANK_THREADS):
        whole_model = model.build_model().to(options.device)
        dropout_off([whole_model])
        worst: dict[tuple[int, str, int], ParamDiff] = {}
        failures: list[str] = []
        step_of = WholeStep(0.0, 0.0, {})
        for step, batch in enumerate(batches):
            torch.manual_seed(options.seed)
            step_of = whole_step(whole_model, batch, microbatches, model.loss_fn, options.autocast)
            items = [item for per_step in held for item in per_step[step]]
            failures += [f for f in coverage(items, step_of) if f not in failures]
            for diff in _param_diffs(items, step_of):
                key = (diff.stage, diff.name, diff.rank)
                if key not in worst or worst[key].max_abs < diff.max_abs:
                    worst[key] = diff
    ranked = sorted(worst.values(), key=lambda d: (-d.max_rel, -d.max_abs))
    max_abs = max((d.max_abs for d in ranked), default=0.0)
    max_rel = max((d.max_rel for d in ranked), default=0.0)
    return CheckResult(
        max_abs, max_rel, step_of.loss, tuple(ranked[:SHOWN]), tuple(failures), step_of.added
    )


DROPOUTS = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


def dropout_off(modules: Iterable[torch.nn.Module]) -> None:
    """Every dropout module's probability set to 0 (`--check` against the whole model,
    whose random streams cannot be the stages' derived ones)."""
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, DROPOUTS):
                sub.p = 0.0


def _param_diffs(items: Iterable[Held], whole: WholeStep) -> list[ParamDiff]:
    found = []
    for item in items:
        want = whole.grads.get(item.name)
        if want is None or item.grad is None or not want.numel() or want.shape != item.grad.shape:
            continue
        size = float(want.abs().max())
        diff = float((item.grad.float() - want.float()).abs().max())
        rel = diff / size if size > 0 else diff
        found.append(ParamDiff(item.stage, item.name, item.rank, diff, rel))
    return found
