"""Runtime pieces that need no process group: shapes, plans, the cost file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pipecc.runtime import TensorSpec, infer_boundaries
from pipecc.runtime.plan import build_plan as _plan
from pipecc.runtime.plan import forward_only as _forward_only
from pipecc.runtime.profile import Recorder, render_cost_file
from pipecc.runtime.specs import meta_forward, normalise_boundaries
from torch import nn

from pipecc.api import compile_schedule
from pipecc.costs import load_cost_file
from pipecc.diagnostics import InputError
from pipecc.ir.ops import Compute, Fused, Kind, Msg, Recv, Send, Wait


class Split(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sum(-1).to(torch.int64), x * 2


def test_infer_boundaries_follows_tuples_and_dtypes() -> None:
    stages = [nn.Linear(3, 5), Split()]
    found = infer_boundaries(stages, torch.zeros(2, 3))
    assert found[0] == (TensorSpec((2, 3), torch.float32),)
    assert found[1] == (TensorSpec((2, 5), torch.float32),)
    assert found[2] == (TensorSpec((2,), torch.int64), TensorSpec((2, 5), torch.float32))
    assert not found[2][0].is_floating and found[2][1].nbytes == 40


def test_meta_forward_leaves_the_module_untouched() -> None:
    norm = nn.BatchNorm1d(4)
    assert meta_forward(norm, (TensorSpec((3, 4), torch.float32),)) == (
        TensorSpec((3, 4), torch.float32),
    )
    assert int(norm.num_batches_tracked) == 0
    assert torch.equal(norm.running_mean, torch.zeros(4))


def test_inference_failure_asks_for_explicit_boundaries() -> None:
    with pytest.raises(InputError, match="pass the boundaries explicitly"):
        infer_boundaries([nn.Linear(3, 5)], torch.zeros(2, 4))


def test_boundaries_from_pairs() -> None:
    found = normalise_boundaries({1: [((2, 3), torch.float16)], 2: TensorSpec((1,), torch.int32)})
    assert found == {1: (TensorSpec((2, 3), torch.float16),), 2: (TensorSpec((1,), torch.int32),)}
    with pytest.raises(InputError, match="boundary of stage 1"):
        normalise_boundaries({1: "2x3"})


def test_plan_commits_at_the_end_of_each_group() -> None:
    instrs = [
        Send(Msg.ACT, 1, 0, 1, 0, group=3),
        Recv(Msg.GRAD, 1, 0, 0, 0, group=3),
        Wait((0, 1)),
        Send(Msg.ACT, 1, 0, 1, 1),
        Recv(Msg.GRAD, 1, 0, 0, 1, group=4),
    ]
    assert [commit for _, _, commit in _plan(list(enumerate(instrs)))] == [
        False, True, False, True, True,
    ]  # fmt: skip


def test_forward_only_keeps_forwards_and_activations() -> None:
    program = compile_schedule("dualpipe", ranks=4, microbatches=8)
    for instrs in program.ranks:
        kept = _forward_only(instrs)
        posted = {i for i, x in kept if type(x) in (Send, Recv)}
        for _, instr in kept:
            match instr:
                case Compute():
                    assert instr.kind is Kind.F
                case Send() | Recv():
                    assert instr.what is Msg.ACT
                case Wait():
                    assert set(instr.ops) <= posted
                case Fused():
                    pytest.fail("a fused op survived")
        forwards = sum(1 for i in instrs for c in _computes(i) if c.kind is Kind.F)
        assert sum(1 for _, x in kept if type(x) is Compute) == forwards


def _computes(instr: object) -> tuple[Compute, ...]:
    if type(instr) is Compute:
        return (instr,)
    if type(instr) is Fused:
        return (instr.forward, instr.backward)
    return ()


def test_cost_file_round_trips_through_the_simulators_parser(tmp_path: Path) -> None:
    a, b = Recorder(step=0), Recorder(step=0)
    for stage, recorder in ((0, a), (1, b)):
        recorder.compute("F", stage, 0.001 * (stage + 1))
        recorder.compute("B", stage, 0.002 * (stage + 1))
        recorder.compute("FB", stage, 0.0025)
    key = ("act", 0, 1, 0)
    a.send(key, posted=10.0, nbytes=128)
    b.recv(key, wait_start=9.5, done=10.0005, nbytes=128)  # waiting before the send: clean
    path = tmp_path / "costs.toml"
    path.write_text(render_cost_file([a, b], "measured here\nsecond line"))
    assert path.read_text().startswith("# measured here\n# second line\n\n[cost]\n")
    model = load_cost_file(path)
    assert model.base.comm == pytest.approx(0.5)
    assert model.base.bytes == 128
    assert model.stage(1).F == pytest.approx(2.0) and model.stage(0).B == pytest.approx(2.0)
    assert model.stage(0).FB == pytest.approx(2.5)
