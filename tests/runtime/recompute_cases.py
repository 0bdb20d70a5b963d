"""Cases of full recomputation, run inside one spawned process group of 2 ranks.

Each stage is Linear, dropout, GELU, Linear (with `aux`: a loss added by `add_loss`); a
step with recomputation is compared with single-process training that seeds each stage's
forward of (step 0, stage, microbatch) as the runtime derives it, so dropout draws the
same masks: the loss, the added losses and every gradient. The memory case measures a
rank's peak over one step (tools/memory.py, the exact CPU count) with and without.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from pipecc.runtime import PipelineRuntime, RuntimeConfig, add_loss
from pipecc.runtime.engine import selective
from pipecc.runtime.engine.rng import derive_seed
from pipecc.runtime.tools.memory import measuring
from torch import nn
from training_cases import _worst  # every held stage's gradients against the reference

from pipecc.diagnostics import PipeccError
from pipecc.ir.program import Program

HIDDEN = 8
WIDE = 64  # the memory case: activations dominate
ROWS = 3


class Mixer(nn.Module):
    """Linear, dropout, GELU: the submodule selective recomputation selects (`mix`)."""

    def __init__(self, width: int, inner: int) -> None:
        super().__init__()
        self.first = nn.Linear(width, inner)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.drop(self.first(x)))


class Block(nn.Module):
    """x + Linear(Mixer(x)) (Mixer: Linear, dropout, GELU); with `aux`, a loss on the output
    is added (or, with `record`, kept in `self.added` for the reference)."""

    def __init__(self, aux: bool, width: int = HIDDEN, inner: int = HIDDEN) -> None:
        super().__init__()
        self.mix = Mixer(width, inner)
        self.second = nn.Linear(inner, width)
        self.aux = aux
        self.record = False
        self.added: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + self.second(self.mix(x))
        if not self.aux:
            return out
        extra = 0.3 * (out**2).mean()
        if self.record:
            self.added.append(extra)
            return out
        return add_loss(out, extra)  # type: ignore[no-any-return]


class Hooked(Block):
    """A Block whose class defines DualPipe's overlap hook (forward, then backward), and
    counts its calls."""

    hook_calls = 0

    @classmethod
    def overlapped_forward_backward(
        cls, module0: Any, inputs0: Any, criterion0: Any, labels0: Any,
        module1: Any, loss1: Any, outputs1: Any, output_grads1: Any,
    ) -> tuple[Any, Any]:  # fmt: skip
        module0.hook_calls += 1
        outputs0 = [module0(*inputs0)]
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        if loss1 is not None:
            loss1.backward()
        else:
            torch.autograd.backward(outputs1, output_grads1)
        return outputs0, loss0


@dataclass(frozen=True)
class Case:
    """`recompute`: the runtime's spec; `aux`: the stages add a loss; `memory`: measure
    the peak with a wide model instead of comparing gradients."""

    name: str
    program: Program
    recompute: Any = "full"
    aux: bool = False
    memory: bool = False
    own_rng: bool = False  # derive_rng=False: compared with the same run without recompute
    hooked: bool = False  # the stages' class defines overlapped_forward_backward
    wrong_rng: bool = False  # selective replays drawn from a state one draw off (must fail)
    modes: tuple[Any, ...] = ("none", "full")  # the memory case: the modes measured


def build(count: int, aux: bool, wide: bool = False, hooked: bool = False) -> list[nn.Module]:
    torch.manual_seed(0)
    if hooked:
        return [Hooked(aux) for _ in range(count)]
    if wide:
        return [Block(aux, WIDE, 4 * WIDE) for _ in range(count)]
    return [Block(aux) for _ in range(count)]


def run_cases(rank: int, world: int, cases: list[Case]) -> dict[str, dict[str, Any]]:
    results = {}
    for case in cases:
        try:
            if case.wrong_rng:
                results[case.name] = _wrong_rng_case(rank, case)
            elif case.memory:
                results[case.name] = _memory_case(rank, case)
            elif case.own_rng:
                results[case.name] = _own_rng_case(rank, case)
            else:
                results[case.name] = _run_case(rank, case)
        except PipeccError as err:
            results[case.name] = {"error": type(err).__name__, "message": str(err)}
    return results


def _runtime(
    rank: int, case: Case, stages: list[nn.Module], recompute: Any, derive: bool = True
) -> PipelineRuntime:
    program = case.program
    modules = {s.chunk: stages[s.stage] for s in program.placement.chunks(rank)}
    config = RuntimeConfig(timeout=60.0, recompute=recompute, derive_rng=derive)
    return PipelineRuntime(program, modules, None, loss_fn=_mse, config=config)


def _run_case(rank: int, case: Case) -> dict[str, Any]:
    program = case.program
    num_stages = program.placement.num_stages(0)
    stages = build(num_stages, case.aux, hooked=case.hooked)
    runtime = _runtime(rank, case, stages, case.recompute)
    x, y = _batch(program.num_microbatches)
    runtime.step(x, y)
    total = float(runtime.global_loss())
    aux = {mb: {s: float(v) for s, v in d.items()} for mb, d in runtime.aux_losses.items()}
    want = _reference(num_stages, program.num_microbatches, case.aux, (x, y))
    held = {s.stage for s in program.placement.chunks(rank)}
    return {
        "grad_rel": _worst(stages, want["grads"], held),
        "total": total,
        "aux": aux,
        "want_total": want["total"],
        "want_aux": want["aux"],
        "hook_calls": sum(getattr(s, "hook_calls", 0) for s in stages),
    }


def _own_rng_case(rank: int, case: Case) -> dict[str, Any]:
    """Without derived RNG states: the ranks' own streams, seeded alike before each run; the
    replay restores the state F saved, so the gradients are those without recompute."""
    grads = {}
    for mode in ("none", case.recompute):
        stages = build(case.program.placement.num_stages(0), case.aux)
        runtime = _runtime(rank, case, stages, mode, derive=False)
        x, y = _batch(case.program.num_microbatches)
        torch.manual_seed(11 + rank)
        runtime.step(x, y)
        grads[str(mode)] = [
            p.grad.clone() for s in stages for p in s.parameters() if p.grad is not None
        ]
    same = all(
        torch.equal(a, b) for a, b in zip(grads["none"], grads[str(case.recompute)], strict=True)
    )
    return {"same": same, "count": len(grads["none"])}


def _wrong_rng_case(rank: int, case: Case) -> dict[str, Any]:
    """A selective replay whose generators are one draw past the state its forward started
    from: the dropout masks differ, and the gradients must show it."""
    restored = selective.restored

    @contextlib.contextmanager
    def off_by_one(state: Any, cuda: int | None) -> Iterator[None]:
        with restored(state, cuda):
            torch.rand(1)
            yield

    selective.restored = off_by_one  # type: ignore[assignment]
    try:
        return _run_case(rank, case)
    finally:
        selective.restored = restored  # type: ignore[assignment]


def _memory_case(rank: int, case: Case) -> dict[str, Any]:
    """The peak over the second step (the first binds the plan), for each mode."""
    peaks = {}
    for mode in case.modes:
        stages = build(case.program.placement.num_stages(0), False, wide=True)
        runtime = _runtime(rank, case, stages, mode)
        rows = 128 * case.program.num_microbatches
        x, y = torch.randn(rows, WIDE), torch.randn(rows, WIDE)
        runtime.step(x, y)
        for stage in stages:
            stage.zero_grad(set_to_none=False)
        with measuring(torch.device("cpu"), list(stages)) as found:
            runtime.step(x, y)
        peaks[str(mode)] = found[0]
    return {"peaks": peaks}


def _batch(microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    rows = ROWS * microbatches
    return (
        torch.randn(rows, HIDDEN, generator=generator),
        torch.randn(rows, HIDDEN, generator=generator),
    )


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _reference(
    num_stages: int, count: int, aux: bool, data: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, Any]:
    """One step by hand, each stage's forward seeded as the runtime derives it."""
    stages = build(num_stages, aux)
    for stage in stages:
        stage.record = True
    x, y = data
    total = 0.0
    found: dict[int, dict[int, float]] = {}
    for mb in range(count):
        rows = slice(mb * ROWS, (mb + 1) * ROWS)
        value = x[rows]
        for s, stage in enumerate(stages):
            torch.manual_seed(derive_seed(0, 0, s, mb))
            value = stage(value)
        loss = _mse(value, y[rows])
        added = [(s, stage.added.pop()) for s, stage in enumerate(stages) if stage.added]
        if added:
            found[mb] = {s: float(a) for s, a in added}
        whole = loss + sum(a for _, a in added)
        (whole / count).backward()
        total += float(whole) / count
    grads = {
        (s, n): (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
        for s, stage in enumerate(stages)
        for n, p in stage.named_parameters()
    }
    return {"grads": grads, "total": total, "aux": found}
