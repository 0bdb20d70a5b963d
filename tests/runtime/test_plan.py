"""One static plan per shape signature (runtime/engine/bound.py), on real ranks.

Two gloo ranks, one process group for every check. For each schedule, several steps with
one signature, each with fresh data and each compared with the single-process reference
(loss and every gradient, so a receive buffer reused while still read would show): the plan
is bound once, and the receive buffers are the same tensors at every step. A second
signature is bound once too, and coming back to the first uses its plan and buffers again.
Then a stage whose output shape changes at a later step of a known signature is an error
naming the instruction, not silently sent. And, in one process, the split-backward method is
per runtime: two runtimes side by side, one over contracted (Linear) stages and one over
stages without a contract, each choose their own and train correctly in turn.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pipecc.runtime import PipelineRuntime, RuntimeConfig, infer_boundaries
from pipecc.runtime.engine.split_backward import input_backward, split_chunks
from pipecc.runtime.engine.steps import PostStep
from pipecc.runtime.engine.weight_contract import Capture, capturing
from pipecc.runtime.tools.reference import compare, gradients, reference_step
from pipecc.runtime.tools.spawn import spawn
from torch import nn

from pipecc.api import compile_schedule
from pipecc.diagnostics import PipeccError

HIDDEN, ROWS, M, STEPS = 8, 2, 4, 3
SCHEDULES = ("1f1b", "zbv", "dualpipev")
# a receive's deadline that no test means to reach: long enough for a peer behind by a
# loaded machine's scheduling (5 s was not, beside two CPU-bound processes)
TIMEOUT = 60.0


class Block(nn.Module):
    """Linear + GELU; `wrong` makes it drop a column (a shape the next stage does not take)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.wrong = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.gelu(self.linear(x))
        return out[:, :-1] if self.wrong else out


class Shifted(Block):
    """Adds a parameter reshaped to its output: autograd takes the parameter's gradient as a
    view of the output gradient it receives, so `.grad` would live in a receive buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(ROWS * HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shift.view(ROWS, HIDDEN)


class Offset(Block):
    """A Linear plus a parameter reshaped to its output, no nonlinearity between: the Linear's
    output gradient (which split backward keeps for W) is the very tensor autograd hands the
    parameter as its first `.grad` (a view), and the next microbatch's I adds into it."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(ROWS * HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.shift.view(ROWS, HIDDEN)


def _stages(count: int, kind: type[Block] = Block) -> list[nn.Module]:
    torch.manual_seed(0)
    return [kind() for _ in range(count)]


def _batch(seed: int, rows: int = ROWS * M) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, HIDDEN, generator=generator)
    return x, torch.randn(rows, HIDDEN, generator=generator)


def _buffers(runtime: PipelineRuntime) -> list[int]:
    """The id of every receive buffer of the training plan in use."""
    plan = runtime.plans.bound(training=True)
    return [
        id(tensor)
        for step in plan.steps
        if isinstance(step, PostStep) and not step.send and step.buffers is not None
        for tensor in step.buffers
    ]


def _steps(runtime: PipelineRuntime, stages: list[nn.Module], schedule: str) -> dict[str, Any]:
    """STEPS steps of one signature, each against the reference; then a second signature
    and the first again."""
    found: dict[str, Any] = {"worst": 0.0, "bindings": [], "same_buffers": [], "losses": []}
    first = None
    for step, rows in enumerate([ROWS * M] * STEPS + [2 * ROWS * M, ROWS * M]):
        for stage in stages:
            stage.zero_grad(set_to_none=True)
        data = _batch(step, rows)
        loss = runtime.step(*data)
        reference = copy.deepcopy(stages)
        want_loss, want = reference_step(reference, data, M, nn.functional.mse_loss)
        mine = {s.stage for s in runtime.program.placement.chunks(runtime.rank)}
        got = {k: v for k, v in gradients(stages).items() if k[0] in mine}
        worst, _, _ = compare(got, {k: want[k] for k in got})
        found["worst"] = max(found["worst"], worst)
        if loss is not None:
            found["losses"].append((float(loss), want_loss))
        found["bindings"].append(runtime.plans.binder.count)
        buffers = _buffers(runtime)
        first = first or buffers
        found["same_buffers"].append(buffers == first)
    return found


def _shifted(
    rank: int, world: int, schedule: str = "1f1b", kind: type[Block] = Shifted
) -> dict[str, Any]:
    """Steps of one signature whose gradients are zeroed in place between steps (so a
    gradient left in a receive buffer would be received into, and added to again)."""
    program = compile_schedule(schedule, ranks=world, microbatches=M)
    stages = _stages(program.placement.num_stages(0), kind)
    modules = {s.chunk: stages[s.stage] for s in program.placement.chunks(rank)}
    runtime = PipelineRuntime(program, modules, infer_boundaries(stages, _batch(0)[0][:ROWS]))
    worst = 0.0
    for step in range(STEPS):
        for stage in stages:
            stage.zero_grad(set_to_none=kind is Offset)  # Offset: every step hands one over
        data = _batch(step)
        runtime.step(*data)
        _, want = reference_step(copy.deepcopy(stages), data, M, nn.functional.mse_loss)
        mine = {s.stage for s in program.placement.chunks(rank)}
        got = {k: v for k, v in gradients(stages).items() if k[0] in mine}
        worst = max(worst, compare(got, {k: want[k] for k in got})[0])
    return {"worst": worst}


def _wrong_later(runtime: PipelineRuntime, stages: list[nn.Module]) -> dict[str, Any]:
    """A step of the known signature in which stage 0 returns a narrower output."""
    stages[0].wrong = True
    try:
        runtime.step(*_batch(9))
        return {"error": None}
    except PipeccError as err:
        return {"error": type(err).__name__, "message": str(err)}
    finally:
        stages[0].wrong = False


def _worker(rank: int, world: int, schedules: list[str]) -> dict[str, Any]:
    torch.set_num_threads(1)
    results: dict[str, Any] = {"shifted": _shifted(rank, world)}
    for schedule in ("zbv", "interleaved_zb"):  # a chunk's next I before its last W
        results[f"offset {schedule}"] = _shifted(rank, world, schedule, Offset)
    for schedule in schedules:
        program = compile_schedule(schedule, ranks=world, microbatches=M)
        stages = _stages(program.placement.num_stages(0))
        modules = {s.chunk: stages[s.stage] for s in program.placement.chunks(rank)}
        boundaries = functools.partial(infer_boundaries, stages)
        config = RuntimeConfig(timeout=TIMEOUT)
        runtime = PipelineRuntime(program, modules, boundaries, config=config)
        results[schedule] = _steps(runtime, stages, schedule)
        if schedule == "1f1b":  # one signature's plans kept: the first is bound again
            config = RuntimeConfig(timeout=TIMEOUT, plans_kept=1)
            kept = PipelineRuntime(program, modules, boundaries, config=config)
            results["kept one"] = _steps(kept, stages, schedule)
        if schedule == schedules[-1]:
            results["wrong"] = _wrong_later(runtime, stages)  # last: it leaves a receive open
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return spawn(_worker, 2, list(SCHEDULES), timeout=240.0)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_signature_is_bound_once_and_its_buffers_reused(
    ranks: list[dict[str, Any]], schedule: str
) -> None:
    for found in (rank[schedule] for rank in ranks):
        assert found["worst"] <= 1e-6, "every step's gradients as the reference's"
        for loss, want in found["losses"]:
            assert loss == pytest.approx(want, rel=1e-6)
        assert found["bindings"] == [1, 1, 1, 2, 2], "one binding per signature"
        assert found["same_buffers"] == [True, True, True, False, True]


def test_a_gradient_taken_from_a_receive_buffer_is_not_overwritten(
    ranks: list[dict[str, Any]],
) -> None:
    assert [rank["shifted"]["worst"] <= 1e-6 for rank in ranks] == [True, True]


@pytest.mark.parametrize("schedule", ["zbv", "interleaved_zb"])
def test_a_gradient_handed_to_a_parameter_does_not_change_a_later_w(
    ranks: list[dict[str, Any]], schedule: str
) -> None:
    """The parameter's first gradient is a view of what W still needs: the next I adds
    into it in place, so without a storage of its own W would compute from the sum."""
    assert [rank[f"offset {schedule}"]["worst"] <= 1e-6 for rank in ranks] == [True, True]


def test_a_wrong_output_shape_at_a_later_step_is_an_error(ranks: list[dict[str, Any]]) -> None:
    sender = ranks[0]["wrong"]  # rank 0 holds stage 0 in every schedule
    assert sender["error"] == "SetupError"
    assert "returned float32[2, 7], but stage 1 takes float32[2, 8]" in sender["message"]
    assert "rank 0, step 5: instruction 0 (F0.0): F0.0 (pipe 0 stage 0 mb 0)" in sender["message"]
    assert ranks[1]["wrong"]["error"] is not None, "its peer does not go on either"


# ---- the split-backward method, per runtime ----------------------------------------------


class Scaled(nn.Module):
    """No weight-gradient contract: an elementwise scale and shift by raw parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, HIDDEN))
        self.b = nn.Parameter(torch.zeros(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.w + self.b)


def test_the_split_backward_method_is_chosen_per_runtime(tmp_path: Path) -> None:
    """Two runtimes in one process, stepping in turn: the Linear one defers its weights to
    W through its own captures, the other walks the graph; both match the reference."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        program = compile_schedule("zbv", ranks=1, microbatches=M)
        linear, scaled = _stages(2), [Scaled(), Scaled()]
        runtimes = [
            PipelineRuntime(program, dict(enumerate(stages)), infer_boundaries(stages, x))
            for stages, x in ((linear, _batch(0)[0][:ROWS]), (scaled, _batch(0)[0][:ROWS]))
        ]
        split = split_chunks(program.ranks[0])
        assert split and sorted(runtimes[0].plans.binder.captures) == sorted(split), "the contract"
        assert runtimes[1].plans.binder.captures == {}, "the walk"
        for step in range(2):
            for stages, runtime in ((linear, runtimes[0]), (scaled, runtimes[1])):
                for stage in stages:
                    stage.zero_grad(set_to_none=True)
                data = _batch(step)
                runtime.step(*data)
                _, want = reference_step(copy.deepcopy(stages), data, M, nn.functional.mse_loss)
                worst, _, _ = compare(gradients(stages), want)
                assert worst <= 1e-6
    finally:
        dist.destroy_process_group()


def test_a_capture_defers_only_into_its_own_store() -> None:
    """While one chunk's I defers (another runtime's, on another thread), a backward
    through another capture's calls accumulates at once, into the right `.grad`."""
    torch.manual_seed(0)
    mine, other = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
    plain = copy.deepcopy(mine)
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    with capturing(mine, Capture(mine)):
        out = mine(x)
    busy = Capture(other)
    with capturing(other, busy):
        out_other = other(torch.randn(ROWS, HIDDEN, requires_grad=True))
    g = torch.randn_like(out)
    store: list[Any] = []
    busy.store = store  # the other capture's I is deferring meanwhile
    out.backward(g)
    busy.store = None
    assert store == [], "nothing of `mine` went to the other store"
    plain(x.detach()).backward(g)
    assert torch.equal(mine.weight.grad, plain.weight.grad)
    _, weight = input_backward(
        (out_other,), (torch.ones_like(out_other),), (), {id(p) for p in other.parameters()},
        busy,
    )  # fmt: skip
    weight.run()
    assert other.weight.grad is not None


def test_only_the_kept_signatures_hold_their_plans(ranks: list[dict[str, Any]]) -> None:
    """With `plans_kept=1` the second signature lets the first's plans (and buffers) go:
    the first is bound again when it comes back, and every step still matches."""
    for found in (rank["kept one"] for rank in ranks):
        assert found["worst"] <= 1e-6
        assert found["bindings"] == [1, 1, 1, 2, 3]
        assert found["same_buffers"] == [True, True, True, False, False]
