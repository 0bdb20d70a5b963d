"""What the spawned ranks of tests/runtime/test_discovery.py run: shapes found on real data.

Every case runs in one process group of 2 ranks (starting processes costs seconds, a step of
these models milliseconds). Each rank builds the whole tiny model (seeded alike), keeps its
own stages, gives the runtime no boundaries (they are discovered on the step's real data)
and compares its own stages' gradients and the losses with a single-process reference it
computes itself. Counting: every collective of torch.distributed and every host read of a
tensor (`.item()`, `.tolist()`, `.cpu()`) made while a step runs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from pipecc.runtime import PipelineRuntime, RuntimeConfig
from pipecc.runtime.tools.reference import Options, gradients, reference_step
from torch import nn

from pipecc.api import compile_schedule
from pipecc.diagnostics import PipeccError
from pipecc.ir.ops import Collective

DIM = 8
ROWS = 2  # rows per microbatch
MICROBATCHES = 4
TOLERANCE = 1e-6
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
    "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "monitored_barrier",
)  # fmt: skip
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


# ---- models ----------------------------------------------------------------------------------


def mask_helper(h: torch.Tensor) -> torch.Tensor | None:
    """HF's pattern (its SDPA mask helper): None when the attention's own causal path
    applies, as on real data, a bool mask otherwise, as on the meta device."""
    if h.device.type == "meta":
        seq = h.shape[1]
        return torch.ones(h.shape[0], seq, seq, dtype=torch.bool).tril()
    return None


class MaskEmbed(nn.Module):
    """Stage 0: returns (hidden, the helper's mask): (float[rows, seq, dim], None) for real."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.linear(x)
        return h, mask_helper(h)


class MaskBlock(nn.Module):
    """Causal self-mixing over the sequence, by mask or by its own causal path."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.last = last

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None) -> Any:
        scores = h @ h.transpose(-1, -2) / math.sqrt(DIM)
        if mask is None:
            mask = torch.ones_like(scores, dtype=torch.bool).tril()
        h = h + torch.softmax(scores.masked_fill(~mask, -1e9), -1) @ torch.tanh(self.linear(h))
        return h if self.last else (h, None)


class OwnAutocast(nn.Module):
    """Enters autocast(bfloat16) inside its own forward: returns a bf16 boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.tanh(self.linear(x.float()))


class FromBf16(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.float())


class MoE(nn.Module):
    """Top-1 routing that depends on the values: each expert runs on the rows routed to it
    (their number known only from the data); returns (output, per-expert row counts)."""

    def __init__(self, experts: int = 3) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, experts)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(experts))

    def forward(self, x: torch.Tensor, *counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, choice = torch.softmax(self.router(x), -1).max(-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero().squeeze(-1)
            out = out.index_add(0, rows, expert(x[rows]) * gate[rows, None])
        return x + out, torch.bincount(choice, minlength=len(self.experts))


class Head(nn.Linear):
    """The MoE model's last stage: a Linear of the hidden state (the counts are unused)."""

    def __init__(self) -> None:
        super().__init__(DIM, DIM)

    def forward(self, x: torch.Tensor, *counts: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def build(kind: str, num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    if kind == "mask":
        blocks = [MaskBlock(last=s == num_stages - 1) for s in range(1, num_stages)]
        return [MaskEmbed(), *blocks]
    if kind == "autocast":
        return [OwnAutocast() if s % 2 == 0 else FromBf16() for s in range(num_stages)]
    return [*(MoE() for _ in range(num_stages - 1)), Head()]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def batch(kind: str, seed: int, seq: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    rows = ROWS * MICROBATCHES
    shape = (rows, seq, DIM) if kind == "mask" else (rows, DIM)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


# ---- cases -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One model on one schedule over several steps. `seqs`: each step's sequence length
    (the mask model); `given`: per rank, instead (ranks given different signatures).
    `inputs`: "all" ranks are given the inputs, "first" only the ranks that use them.
    `static`: RuntimeConfig(static_shapes=True). `raising`: stage 1 raises."""

    name: str
    kind: str
    schedule: str
    seqs: tuple[int, ...] = (4,)
    inputs: str = "all"
    static: bool = False
    given: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    raising: bool = False
    timeout: float = 60.0


CASES = (
    Case("mask-zbv", "mask", "zbv", seqs=(4, 4, 4)),
    Case("mask-dualpipe", "mask", "dualpipe", seqs=(4, 4, 4)),
    Case("autocast-zbv", "autocast", "zbv"),
    Case("autocast-1f1b", "autocast", "1f1b"),
    Case("moe-zbv", "moe", "zbv", seqs=(4, 4, 4)),
    Case("moe-dualpipe", "moe", "dualpipe"),
    Case("mask-1f1b-warm", "mask", "1f1b", seqs=(4, 4, 4, 4)),
    Case("seqs-zbv", "mask", "zbv", seqs=(4, 6, 6, 4, 6)),
    Case("static-zbv", "mask", "zbv", seqs=(4, 4, 4), inputs="first", static=True),
    Case("no-inputs-zbv", "mask", "zbv", inputs="first"),
    Case("static-change-zbv", "mask", "zbv", seqs=(4, 6), static=True),
    Case("different-zbv", "mask", "zbv", given=((4,), (6,))),
    Case("raising-1f1b", "mask", "1f1b", raising=True),
    Case("after-errors-zbv", "mask", "zbv", seqs=(4, 6)),
    Case("missing-1f1b", "mask", "1f1b", given=((4, 4), (4, 6)), timeout=1.0),  # the last
)


def run_cases(rank: int, world: int, payload: object) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for case in CASES:
        try:
            found[case.name] = _run(rank, case)
        except PipeccError as err:
            found[case.name] = {"error": type(err).__name__, "message": str(err),
                                "cause": type(err.__cause__).__name__}  # fmt: skip
    return found


@dataclass
class Counts:
    """Calls made while counting, by function name."""

    calls: dict[str, int] = field(default_factory=dict)

    def total(self, names: tuple[str, ...]) -> int:
        return sum(self.calls.get(name, 0) for name in names)


COUNTED = ((dist, COLLECTIVES), (torch.Tensor, HOST_READS))


@contextlib.contextmanager
def counting(
    counts: Counts, counted: tuple[tuple[Any, tuple[str, ...]], ...] = COUNTED
) -> Iterator[None]:
    """Count the calls of each (owner, names) of `counted` while the block runs: by default
    every collective (and blocking send/recv) of torch.distributed and every host read of a
    tensor (the mesh cases and benchmarks/gpu_mesh_check.py count FSDP2's own)."""
    saved: list[tuple[Any, str, Any]] = []
    for owner, names in counted:
        for name in names:
            original = getattr(owner, name, None)
            if original is not None:
                saved.append((owner, name, original))
                setattr(owner, name, _counted(counts, name, original))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _counted(counts: Counts, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        counts.calls[name] = counts.calls.get(name, 0) + 1
        return original(*args, **kwargs)

    return counted


def _run(rank: int, case: Case) -> dict[str, Any]:
    program = compile_schedule(case.schedule, ranks=2, microbatches=MICROBATCHES)
    num_stages = program.placement.num_stages(0)
    stages = build(case.kind, num_stages)
    if case.raising:
        stages[1].forward = _raise  # type: ignore[method-assign]
    slots = program.placement.chunks(rank)
    modules = {slot.chunk: stages[slot.stage] for slot in slots}
    config = RuntimeConfig(timeout=case.timeout, static_shapes=case.static)
    runtime = PipelineRuntime(program, modules, loss_fn=loss_fn, config=config)
    first = any(slot.stage == 0 for slot in slots)
    last = any(program.placement.is_last_stage(slot.pipe, slot.stage) for slot in slots)
    held = {slot.stage for slot in slots}
    steps = []
    seqs = case.seqs if case.given is None else case.given[rank]
    for step, seq in enumerate(seqs):
        inputs, targets = batch(case.kind, seed=step, seq=seq)
        given = (inputs if case.inputs == "all" or first else None, targets if last else None)
        steps.append(_step(runtime, stages, given, held, (inputs, targets)))
    collectives = sum(1 for i in program.ranks[rank] if type(i) is Collective)
    return {"steps": steps, "program_collectives": collectives}


def _raise(*args: Any) -> Any:
    raise ValueError("a bug in the user's stage")


def _step(
    runtime: PipelineRuntime,
    stages: list[nn.Module],
    given: tuple[Any, Any],
    held: set[int],
    data: tuple[torch.Tensor, torch.Tensor],
) -> dict[str, Any]:
    """One step, counted, against the reference (which is not counted)."""
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    counts = Counts()
    with counting(counts):
        runtime.step(*given)
    got = {key: grad for key, grad in gradients(stages).items() if key[0] in held}
    step = runtime.steps - 1
    want_loss, want = reference_step(stages, data, MICROBATCHES, loss_fn, Options(step=step))
    worst = 0.0
    for key, grad in got.items():
        scale = float(want[key].abs().max()) or 1.0
        worst = max(worst, float((grad - want[key]).abs().max()) / scale)
    return {
        "grad_rel": worst,
        "params": len(got),
        "losses": {mb: float(v) for mb, v in runtime.losses.items()},
        "want_loss": want_loss,
        "collectives": counts.total(COLLECTIVES),
        "host_reads": counts.total(HOST_READS),
        "boundaries": {s: b.describe() for s, b in runtime.boundaries.items()},
    }
