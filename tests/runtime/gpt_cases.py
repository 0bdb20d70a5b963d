"""GPT cases the runtime tests run inside one spawned process group (P=2).

The model is examples/gpt.py at a small size. Each case builds the whole model on every
rank, runs one or more steps through a `PipelineRuntime` and compares this rank's gradients
with a single-process reference it computes itself (same RNG derivation, same autocast).
Variants: plain, tied embeddings, tied embeddings with gradients accumulated over two steps
(no zeroing between), dict boundaries, a last stage returning a dataclass, a shape change
between steps, dropout, bf16 parameters (with and without fp32 accumulation), autocast with
a bf16 boundary, and AdamW training against single-process training. Functions here run in
the spawned processes: keep them importable and picklable.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from pipecc.runtime import (
    PipelineRuntime,
    RuntimeConfig,
    broadcast_shapes,
    infer_boundaries,
    shared_parameters,
)
from pipecc.runtime.tools.reference import Options, gradients, reference_step
from torch import nn

from pipecc.diagnostics import PipeccError
from pipecc.ir.program import Program

ROOT = Path(__file__).resolve().parents[2]
ROWS = 2  # rows per microbatch
BF16 = torch.bfloat16
# Adam divides by sqrt(v) + eps: a gradient that is zero in exact arithmetic (the attention's
# key bias: softmax ignores a shift) is rounding noise of 1e-9 here, which the default eps
# (1e-8) turns into a full-size step of either sign in both runs alike; with 1e-6 such noise
# moves nothing, and every real gradient is far above it.
EPS = 1e-6


def _gpt() -> Any:
    """examples/gpt.py as a module (one copy per process, so its classes pickle)."""
    if "pipecc_example_gpt" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "pipecc_example_gpt", ROOT / "examples/gpt.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["pipecc_example_gpt"] = module
        spec.loader.exec_module(module)
    return sys.modules["pipecc_example_gpt"]


def config(variant: str, seq: int = 8) -> Any:
    gpt = _gpt()
    dropout = 0.2 if variant == "dropout" else 0.0
    tied = variant in ("tied", "undeclared", "accumulate", "accumulate-mean")
    return gpt.GPTConfig(vocab=32, dim=16, heads=2, seq=seq, layers=0, tied=tied,
                         dropout=dropout)  # fmt: skip


class DictStage(nn.Module):
    """A GPT stage that takes and returns a dict: the hidden state, an integer mask that
    carries no gradient, a detached float, None and a constant; the last stage returns a
    dict whose logits the loss reads."""

    def __init__(self, inner: nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        self.inner, self.first, self.last = inner, first, last

    def forward(self, value: Any) -> dict[str, Any]:
        if self.first:
            h, mask = self.inner(value), (value % 2).to(torch.int64)
        else:
            h = self.inner(value["h"] * value["mask"].unsqueeze(-1).to(value["h"].dtype).add(1))
            mask = value["mask"]
        if self.last:
            return {"logits": h, "aux": None}
        return {"h": h, "mask": mask, "plain": h.detach() * 0.5, "none": None, "k": 2}


@dataclass
class GptOutput:
    """What an HF-style last stage returns: a dataclass (no pytree) that loss_fn reads."""

    logits: torch.Tensor
    aux: float = 0.0


class DataclassOut(nn.Module):
    """The last GPT stage, returning a `GptOutput`."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> GptOutput:
        return GptOutput(self.inner(x))


class Bf16Out(nn.Module):
    """A GPT stage ending with a Linear, so under bf16 autocast its output is bf16."""

    def __init__(self, inner: nn.Module, dim: int) -> None:
        super().__init__()
        self.inner, self.out = inner, nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


def build(variant: str, num_stages: int) -> list[nn.Module]:
    cfg = config(variant)
    stages: list[nn.Module] = list(_gpt().build_stages(num_stages, cfg))
    torch.manual_seed(1)
    if variant == "dict":
        stages = [DictStage(s, i == 0, i == num_stages - 1) for i, s in enumerate(stages)]
    if variant == "dataclass":
        stages[-1] = DataclassOut(stages[-1])
    if variant == "autocast":
        stages = [Bf16Out(s, cfg.dim) if i < num_stages - 1 else s for i, s in enumerate(stages)]
    if variant in ("bf16", "bf16-fp32"):
        stages = [s.to(BF16) for s in stages]
    return stages


def batch(variant: str, microbatches: int, step: int) -> tuple[Any, Any]:
    seq = 6 if variant in ("shapes", "loaders") and step % 2 else 8
    return _gpt().make_batch(ROWS * microbatches, seed=step, config=config(variant, seq))


def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = output["logits"] if isinstance(output, dict) else getattr(output, "logits", output)
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())


@dataclass(frozen=True)
class GptCase:
    """One GPT configuration: the program, the variant and how many steps."""

    name: str
    program: Program
    variant: str = "plain"
    steps: int = 1
    train: bool = False  # AdamW steps, compared with single-process training

    @property
    def options(self) -> Options:
        autocast = BF16 if self.variant == "autocast" else None
        return Options(seed=3, autocast=autocast, fp32_grads=self.variant == "bf16-fp32")


def run_gpt_cases(rank: int, world: int, cases: list[GptCase]) -> dict[str, dict[str, Any]]:
    """Run every case on this rank; per case, what the tests assert on."""
    results = {}
    for case in cases:
        start = time.perf_counter()
        try:
            result = _train_case(rank, case) if case.train else _check_case(rank, case)
        except PipeccError as err:
            result = {"error": type(err).__name__, "message": str(err)}
        result["seconds"] = time.perf_counter() - start
        results[case.name] = result
    return results


def _runtime(rank: int, case: GptCase, stages: list[nn.Module]) -> PipelineRuntime:
    program, options = case.program, case.options
    modules = {s.chunk: stages[s.stage] for s in program.placement.chunks(rank)}
    shared = () if case.variant == "undeclared" else shared_parameters(stages)
    cfg = RuntimeConfig(shared=shared, seed=options.seed, static_shapes=case.variant == "static",
                        autocast=options.autocast, fp32_grads=options.fp32_grads)  # fmt: skip

    def boundaries(sample: Any) -> Any:
        return infer_boundaries(stages, sample, autocast=options.autocast)

    return PipelineRuntime(program, modules, boundaries, loss_fn=loss_fn, config=cfg)


def _check_case(rank: int, case: GptCase) -> dict[str, Any]:
    num_stages = case.program.placement.num_stages(0)
    stages = build(case.variant, num_stages)
    runtime = _runtime(rank, case, stages)
    reference = build(case.variant, num_stages)
    held = {slot.stage for slot in case.program.placement.chunks(rank)}
    worst, losses, specs = 0.0, [], []
    accumulated: dict[Any, torch.Tensor] = {}
    for step in range(case.steps):
        accumulating = case.variant in ("accumulate", "accumulate-mean")
        if not accumulating:  # else: gradients accumulate over the steps
            for stage in stages:
                stage.zero_grad(set_to_none=True)
        data = batch(case.variant, case.program.num_microbatches, step)
        scale = 1.0 / case.steps if case.variant == "accumulate-mean" else 1.0
        runtime.step(*_given(runtime, case.variant, data), loss_scale=scale)
        specs.append({s: b.describe() for s, b in runtime.boundaries.items()})
        options = case.options._replace(step=step)
        want_loss, want = reference_step(reference, data, case.program.num_microbatches,
                                         loss_fn, options)  # fmt: skip
        if accumulating:  # the sum of the steps' gradients, or their mean (loss_scale 1/K)
            accumulated = want = {k: (accumulated[k] if accumulated else 0) + scale * v
                                  for k, v in want.items()}  # fmt: skip
        worst = max(worst, _worst(gradients(stages), want, held))
        losses.append((float(runtime.global_loss()), want_loss))
    main = None
    if case.options.fp32_grads:  # the fp32 sums themselves, before the rounding to bf16
        main = _worst(_main_grads(stages, held), _main_grads(reference, held), held)
    copies = None
    if case.variant == "tied":  # each parameter held on both ranks: its summed gradient here
        copies = {g.keys: g.local[0].grad for g in runtime.groups if len(g.ranks) > 1}
    return {"grad_rel": worst, "losses": losses, "boundaries": specs, "main_rel": main,
            "dropout_active": _dropout_active(case, reference, data), "copies": copies,
            "inside": not runtime.sums.outside,
            "needs": (runtime.needs_inputs, runtime.needs_targets)}  # fmt: skip


def _given(runtime: PipelineRuntime, variant: str, data: Any) -> tuple[Any, Any]:
    """What this rank gives `step`: the whole batch, or (loaders, static) only what it
    needs: its shapes broadcast from the loading rank where they change, None under
    static_shapes."""
    if variant not in ("loaders", "static"):
        return data[0], data[1]
    inputs = data[0] if runtime.needs_inputs else None
    targets = data[1] if runtime.needs_targets else None
    if variant == "loaders":
        inputs = broadcast_shapes(runtime, inputs)
    return inputs, targets


def _main_grads(stages: list[nn.Module], held: set[int]) -> dict[Any, torch.Tensor]:
    return {
        (i, n): p.main_grad
        for i, s in enumerate(stages)
        if i in held
        for n, p in s.named_parameters()
    }


def _worst(got: dict[Any, torch.Tensor], want: dict[Any, torch.Tensor], held: set[int]) -> float:
    worst = 0.0
    for key, ref in want.items():
        if key[0] in held:
            scale = float(ref.float().abs().max()) or 1.0
            worst = max(worst, float((got[key].float() - ref.float()).abs().max()) / scale)
    return worst


def _dropout_active(case: GptCase, reference: list[nn.Module], data: Any) -> bool | None:
    """With dropout, another seed must give other gradients (the masks matter)."""
    if case.variant != "dropout":
        return None
    microbatches = case.program.num_microbatches
    _, one = reference_step(reference, data, microbatches, loss_fn, case.options)
    _, other = reference_step(reference, data, microbatches, loss_fn,
                              case.options._replace(seed=4))  # fmt: skip
    return any(not torch.equal(one[k], other[k]) for k in one)


def _train_case(rank: int, case: GptCase) -> dict[str, Any]:
    """AdamW with gradient clipping for `steps` steps, pipelined and on one process."""
    num_stages = case.program.placement.num_stages(0)
    stages = build(case.variant, num_stages)
    runtime = _runtime(rank, case, stages)
    optimizer = torch.optim.AdamW(runtime.parameters(), lr=1e-2, eps=EPS)
    single = build(case.variant, num_stages)
    single_params = list({id(p): p for s in single for p in s.parameters()}.values())
    reference_optimizer = torch.optim.AdamW(single_params, lr=1e-2, eps=EPS)
    norms, losses = [], []
    for step in range(case.steps):
        data = batch(case.variant, case.program.num_microbatches, step)
        optimizer.zero_grad(set_to_none=True)
        runtime.step(*data)
        norm = runtime.clip_grad_norm_(0.5)
        optimizer.step()
        options = case.options._replace(step=step)
        want_loss, _ = reference_step(single, data, case.program.num_microbatches, loss_fn, options)
        want_norm = nn.utils.clip_grad_norm_(single_params, 0.5)
        reference_optimizer.step()
        norms.append((float(norm), float(want_norm)))
        losses.append((float(runtime.global_loss()), want_loss))
    held = {slot.stage for slot in case.program.placement.chunks(rank)}
    weights = {
        (i, n): p.detach().clone() for i, s in enumerate(stages) for n, p in s.named_parameters()
    }
    want = {
        (i, n): p.detach().clone() for i, s in enumerate(single) for n, p in s.named_parameters()
    }
    return {"weight_rel": _worst(weights, want, held), "norms": norms, "losses": losses,
            "optimized": len(optimizer.param_groups[0]["params"]),
            "distinct": len({id(p) for p in _listed(runtime)})}  # fmt: skip


def _listed(runtime: PipelineRuntime) -> list[nn.Parameter]:
    return [p for m in runtime.modules.values() for p in m.parameters()]


def with_variant(case: GptCase, variant: str, name: str) -> GptCase:
    return replace(case, variant=variant, name=name)
