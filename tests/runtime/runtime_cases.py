"""Cases the runtime tests run inside one spawned process group per world size.

Starting processes costs seconds, a step of a tiny model milliseconds, so each group runs
every case in one go (DESIGN §7) and returns a small result per case; the tests look the
results up. Each rank compares its own chunks with a single-process reference it computes
itself. Functions here run in the spawned processes: keep them importable and picklable.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from pipecc.runtime import PipelineRuntime, RuntimeConfig, TensorSpec
from pipecc.runtime.profiling.recorder import Recorder
from pipecc.runtime.tools.reference import gradients, reference_step
from torch import nn

from pipecc.diagnostics import PipeccError, ScheduleError
from pipecc.ir.ops import Fused, Kind
from pipecc.ir.program import Program

HIDDEN = 6
ROWS = 2  # rows per microbatch
TOLERANCE = 1e-6
SCHEDULES = (
    "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_h2", "zbv",
    "interleaved_zb", "dualpipe", "dualpipev", "v_half", "v_min",
)  # fmt: skip


# ---- models ----------------------------------------------------------------------------------


class Block(nn.Module):
    """Linear + GELU, the stage of most cases."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.linear(x))


class HookedBlock(Block):
    """A Block whose class defines DualPipe's overlap hook, and counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.hook_calls = 0
        self.captured_calls = 0

    @classmethod
    def overlapped_forward_backward(
        cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1
    ):  # type: ignore[no-untyped-def]
        module0.hook_calls += 1
        # under the contract's capture, the Linear has a forward of its own for the call
        module0.captured_calls += "forward" in vars(module0.linear)
        outputs0 = module0(*inputs0)
        outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else list(outputs0)
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        if loss1 is not None:
            loss1.backward()
        else:
            torch.autograd.backward(outputs1, output_grads1)
        return outputs0, loss0


class TupleBlock(nn.Module):
    """Takes and returns (activation, integer mask, skip): a tuple boundary with a tensor
    that carries no gradient and one that does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, skip: torch.Tensor) -> Any:
        h = nn.functional.gelu(self.linear(x)) * mask.to(x.dtype) + 0.5 * skip
        return h, mask, skip * 0.9 + h


def mlp_like(count: int) -> nn.Module:
    """`count` Blocks in one module (a stage of several layers)."""
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(count)))


def build(kind: str, count: int) -> list[nn.Module]:
    torch.manual_seed(0)
    cls = {"mlp": Block, "hooked": HookedBlock, "tuple": TupleBlock}[kind]
    return [cls() for _ in range(count)]


def batch(kind: str, microbatches: int, seed: int) -> tuple[Any, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    rows = ROWS * microbatches
    x = torch.randn(rows, HIDDEN, generator=generator)
    y = torch.randn(rows, HIDDEN, generator=generator)
    if kind == "tuple":
        mask = (torch.rand(rows, HIDDEN, generator=generator) > 0.3).to(torch.int64)
        return (x, mask, torch.randn(rows, HIDDEN, generator=generator)), y
    return x, y


def tuple_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    h, _, skip = output
    return nn.functional.mse_loss(h + skip, target)


# ---- cases -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One runtime configuration and what to check.

    `mode`: train (one step, compared with the reference), forward (forward only), nosync
    (duplicated stages not summed), timeout (a second step in which rank 0 stays away),
    profile (a train step with a `Recorder`, whose records come back), signatures (steps
    whose input shapes the ranks disagree on, then one a rank cannot split).
    `pipelines`: run several pipelines side by side, each in a subgroup; pipeline rank r is
    global rank `pipeline[r]`.
    """

    name: str
    program: Program
    model: str = "mlp"
    mode: str = "train"
    seed: int = 1
    boundaries: dict[int, Any] | None = None  # given instead of inferred
    drop_chunk: tuple[int, int] | None = None  # (rank, chunk) whose module is left out
    pipelines: tuple[tuple[int, ...], ...] | None = None
    timeout: float = 60.0
    keep_grads: bool = False  # return this rank's gradients
    hogs: int = 0  # CPU-bound processes rank 0 starts for the case's extent (a loaded machine)
    device: str = "cpu"  # "cuda": this rank's stages and data on its GPU
    poster_thread: bool = False  # RuntimeConfig.gloo_poster_thread (test_posting.py)
    other: tuple[int, Program] | None = None  # (rank, the program it is given instead)


def compile_case(name: str, ranks: int, microbatches: int, **defines: int) -> Program:
    from pipecc.api import compile_schedule

    return compile_schedule(name, ranks=ranks, microbatches=microbatches, defines=defines)


def microbatch_counts(name: str, ranks: int) -> tuple[int, int]:
    """The smallest M the schedule accepts at P ranks, and a larger one (M > 2P, odd when
    the schedule allows it)."""
    smallest = next(m for m in range(1, 8 * ranks) if _compiles(name, ranks, m))
    larger = next(m for m in range(2 * ranks + 1, 8 * ranks) if _compiles(name, ranks, m))
    return smallest, larger


def _compiles(name: str, ranks: int, microbatches: int) -> bool:
    try:
        compile_case(name, ranks, microbatches)
    except ScheduleError:
        return False
    return True


# ---- running cases (in the spawned ranks) ------------------------------------------------------


def run_cases(rank: int, world: int, cases: list[Case]) -> dict[str, dict[str, Any]]:
    """Run every case on this rank; per case, what the tests assert on."""
    results = {}
    for case in cases:
        start = time.perf_counter()
        with _beside_hogs(case.hogs if rank == 0 else 0) as hogs:
            try:
                result = _run_case(rank, case)
            except PipeccError as err:
                result = {"error": type(err).__name__, "message": str(err)}
            result["hogs"] = sum(hog.poll() is None for hog in hogs)  # still spinning
        result["seconds"] = time.perf_counter() - start
        results[case.name] = result
    return results


@contextmanager
def _beside_hogs(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`count` processes spinning on the CPU while the block runs; stopped after it."""
    spin = "while True: pass"
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def _group_for(case: Case) -> tuple[Any, tuple[int, ...] | None]:
    """This rank's pipeline subgroup and rank map (every rank creates every subgroup, in the
    same order, as torch requires)."""
    if case.pipelines is None:
        return None, None
    mine = None, None
    for ranks in case.pipelines:
        group = dist.new_group(sorted(ranks))
        if dist.get_rank() in ranks:
            mine = group, ranks
    return mine


@dataclass
class _Run:
    """One case set up on one rank."""

    case: Case
    me: int
    stages: list[nn.Module]
    modules: dict[int, nn.Module]
    runtime: PipelineRuntime
    inputs: Any
    targets: Any
    loss_fn: Any


def _run_case(rank: int, case: Case) -> dict[str, Any]:
    run = _setup(rank, case)
    if case.mode == "forward":
        return _forward_case(run)
    recorder = Recorder(step=0) if case.mode == "profile" else None
    loss = run.runtime.step(run.inputs, run.targets, recorder=recorder)
    if case.mode == "timeout":
        return _timeout_case(run)
    if case.mode == "signatures":
        return _signatures_case(run)
    reference = build(case.model, len(run.stages))  # on the CPU
    microbatches = case.program.num_microbatches
    data = (_to(run.inputs, torch.device("cpu")), run.targets.cpu())
    want_loss, want = reference_step(reference, data, microbatches, run.loss_fn)
    return {**_compare(run, loss, want, want_loss), "recorder": recorder}


def _setup(rank: int, case: Case) -> _Run:
    group, rank_map = _group_for(case)
    program = case.program if case.other is None or case.other[0] != rank else case.other[1]
    me = rank_map.index(dist.get_rank()) if rank_map is not None else rank
    device = _device(case)
    stages = [s.to(device) for s in build(case.model, program.placement.num_stages(0))]
    held = program.placement.chunks(me) if me < program.num_ranks else ()
    modules = {s.chunk: stages[s.stage] for s in held}
    if case.drop_chunk is not None and case.drop_chunk[0] == me:
        modules.pop(case.drop_chunk[1])
    seed = case.seed + (rank_map[0] if rank_map is not None else 0)
    inputs, targets = batch(case.model, program.num_microbatches, seed)
    if device.type != "cpu":
        inputs, targets = _to(inputs, device), targets.to(device)
    loss_fn = tuple_loss if case.model == "tuple" else nn.functional.mse_loss
    boundaries = case.boundaries  # None: found along the pipeline by the runtime
    config = RuntimeConfig(group=group, rank_map=rank_map, sync_duplicated=case.mode != "nosync",
                           timeout=case.timeout, device=device,
                           gloo_poster_thread=case.poster_thread)  # fmt: skip
    runtime = PipelineRuntime(program, modules, boundaries, loss_fn=loss_fn, config=config)
    return _Run(case, me, stages, modules, runtime, inputs, targets, loss_fn)


def _device(case: Case) -> torch.device:
    if case.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return tuple(t.to(device) for t in value)


def _timeout_case(run: _Run) -> dict[str, Any]:
    """Step 1: rank 0 stays away from the program (the shapes are known: nothing is
    exchanged before it): the others time out in a wait. Step 2: the same again.
    The ranks meet first: rank 0 stays away for `timeout + 1.5` s twice, so the others'
    first wait must begin within that time of rank 0's, which a rank behind by the previous
    cases' work (a loaded machine) would miss, finding rank 0 gone instead of late."""
    dist.barrier()
    if run.me == 0:
        run.runtime.interpreter.run = lambda plan, ctx: time.sleep(run.case.timeout + 1.5)  # type: ignore[method-assign]
        run.runtime.step(run.inputs, run.targets)
        time.sleep(run.case.timeout + 1.5)
        return {"idle": True}
    found = {}
    for step in (1, 2):
        try:
            run.runtime.step(run.inputs, run.targets)
            found[step] = {"error": None}
        except PipeccError as err:
            found[step] = {"error": type(err).__name__, "message": str(err)}
    return found


def _signatures_case(run: _Run) -> dict[str, Any]:
    """After a good step (the caller's): step 2 gives every rank a new signature, but
    another on each (three times the rows per microbatch on rank 0, twice on the last),
    step 3 every rank a batch it cannot split into M, step 4 every rank the first shapes
    again. On a bidirectional program every rank holds a stage 0."""
    last = run.me == run.case.program.num_ranks - 1
    inputs: torch.Tensor = run.inputs
    wider = torch.cat([inputs] * (2 if last else 3))
    uneven = inputs[:-1]
    found: dict[int, dict[str, Any]] = {}
    for step, given in ((2, wider), (3, uneven), (4, inputs)):
        try:
            loss = run.runtime.step(given, run.targets)
            found[step] = {"error": None, "loss": None if loss is None else float(loss)}
        except PipeccError as err:
            found[step] = {"error": type(err).__name__, "message": str(err)}
    return found


def _compare(
    run: _Run,
    loss: torch.Tensor | None,
    want: dict[tuple[int, str], torch.Tensor],
    want_loss: float,
) -> dict[str, Any]:
    """Per-parameter relative gradient error of this rank's stages, losses, hook calls."""
    got = {key: grad.cpu() for key, grad in gradients(run.stages).items()}
    held = {slot.stage for slot in run.case.program.placement.chunks(run.me)}
    worst = 0.0
    for (stage, name), ref in want.items():
        if stage in held:
            scale = float(ref.abs().max()) or 1.0
            worst = max(worst, float((got[(stage, name)] - ref).abs().max()) / scale)
    keep = run.case.mode == "nosync" or run.case.keep_grads
    return {
        "grad_rel": worst,
        "losses": {mb: float(v) for mb, v in run.runtime.losses.items()},
        "loss": None if loss is None else float(loss),
        "want_loss": want_loss,
        "hook_calls": sum(getattr(m, "hook_calls", 0) for m in run.modules.values()),
        "fused_b": _fused_backwards(run.case.program, run.me),
        "hook_captured": sum(getattr(m, "captured_calls", 0) for m in run.modules.values()),
        "fused_before_i": _fused_forwards_before_i(run.case.program, run.me),
        "grads": {k: v for k, v in got.items() if k[0] in held} if keep else None,
        "want": want if keep else None,
    }


def _fused_backwards(program: Program, rank: int) -> int:
    return sum(1 for i in program.ranks[rank] if type(i) is Fused and i.backward.kind is Kind.B)


def _fused_forwards_before_i(program: Program, rank: int) -> int:
    """The F&B whose forward's microbatch has its backward split (an `I` of that chunk)."""
    split = {
        (c.chunk, c.mb)
        for i in program.ranks[rank]
        for c in ((i.forward, i.backward) if type(i) is Fused else (i,))
        if getattr(c, "kind", None) is Kind.I
    }
    return sum(
        1
        for i in program.ranks[rank]
        if type(i) is Fused
        and i.backward.kind is Kind.B
        and (i.forward.chunk, i.forward.mb) in split
    )


def _forward_case(run: _Run) -> dict[str, Any]:
    """Forward only: the outputs on the last stage equal the whole model's."""
    outputs = run.runtime.forward(run.inputs, run.targets)
    worst = 0.0
    with torch.no_grad():
        for mb, out in outputs.items():
            x = run.inputs[mb * ROWS : (mb + 1) * ROWS]
            for stage in run.stages:
                x = stage(x)
            worst = max(worst, float((out - x).abs().max()))  # the stage output as returned
    grads = [p.grad for m in run.modules.values() for p in m.parameters() if p.grad is not None]
    return {"outputs": sorted(outputs), "out_diff": worst, "losses": dict(run.runtime.losses),
            "grads": len(grads)}  # fmt: skip


def wrong_boundaries(program: Program) -> dict[int, Any]:
    """Boundaries whose stage-1 input has one column too many."""
    spec = TensorSpec((ROWS, HIDDEN), torch.float32)
    found = {s: (spec,) for s in range(program.placement.num_stages(0) + 1)}
    found[1] = (TensorSpec((ROWS, HIDDEN + 1), torch.float32),)
    return found
