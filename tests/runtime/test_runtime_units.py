"""Runtime pieces that need no process group: plans, the backend check, the cost file
(boundaries and shapes: test_boundaries.py)."""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from pipecc.runtime import TensorSpec
from pipecc.runtime.comm import channel as channel_module
from pipecc.runtime.comm.channel import Channel, Group, OpTimeout, Posted, Poster
from pipecc.runtime.plan.binding import backend_problem
from pipecc.runtime.plan.plan import build_plan as _plan
from pipecc.runtime.plan.plan import forward_only as _forward_only
from pipecc.runtime.profiling.figures import fit_latency
from pipecc.runtime.profiling.recorder import (
    Recorder,
    calibrated_comm,
    render_cost_file,
    span_times,
)
from torch import nn

from pipecc.api import compile_schedule
from pipecc.commands.run import replayed_ms
from pipecc.ir.keys import Message
from pipecc.ir.ops import Compute, Fused, Kind, Msg, Recv, Send, Wait
from pipecc.ir.program import Program
from pipecc.passes.insert_comms import EARLY_RECV, insert_comms, strip_comms
from pipecc.semantics import CommModel
from pipecc.semantics.costs import Cut, load_cost_file
from pipecc.simulate import simulate


def test_a_gloo_only_program_is_refused_on_nccl() -> None:
    def early(ranks: int) -> Program:
        default = compile_schedule("1f1b", ranks=ranks, microbatches=4)
        return insert_comms(strip_comms(default), placement=EARLY_RECV)

    assert backend_problem(early(2), nccl=False) is None
    assert backend_problem(compile_schedule("1f1b", ranks=2, microbatches=4), nccl=True) is None
    assert backend_problem(early(1), nccl=True) is None, "no receives: nothing posted early"
    assert backend_problem(early(2), nccl=True) == (
        "the program was compiled with the early-recv comm policy, which is for gloo: under "
        "NCCL its early receives block the sends queued behind them and the step deadlocks; "
        "compile it with the default policy (--comm-policy default)"
    )


def test_nccl_is_recognised_in_a_group_made_without_a_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed as dist
    from pipecc.runtime.comm.channel import uses_nccl

    configs = {"nccl": True, "cpu:gloo,cuda:nccl": True, "gloo": False}
    for config, expected in configs.items():
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None, c=config: c)
        assert uses_nccl(None, torch.device("cuda", 0)) is expected, config
        assert uses_nccl(None, torch.device("cpu")) is False, config


def test_the_runtime_refuses_a_gloo_only_program_on_nccl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed as dist
    from pipecc.runtime import PipelineRuntime, pipeline

    from pipecc.diagnostics import SetupError

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        program = insert_comms(
            strip_comms(compile_schedule("1f1b", ranks=2, microbatches=2)), placement=EARLY_RECV
        )
        program = replace(program, num_ranks=1, ranks=program.ranks[1:])  # receives, one rank
        monkeypatch.setattr(pipeline, "uses_nccl", lambda group, device: True)
        runtime = PipelineRuntime(
            program,
            [nn.Linear(3, 3)],
            {0: TensorSpec((2, 3), torch.float32), 1: TensorSpec((2, 3), torch.float32)},
        )
        with pytest.raises(SetupError, match="compiled with the early-recv comm policy"):
            runtime.step(torch.zeros(4, 3), torch.zeros(4, 3))
    finally:
        dist.destroy_process_group()


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
        # every activation message is kept, at its index, and every one of them is waited
        activations = {
            i for i, x in enumerate(instrs) if type(x) in (Send, Recv) and x.what is Msg.ACT
        }
        assert posted == activations
        waited = {op for _, x in kept if type(x) is Wait for op in x.ops}
        assert waited == activations


def _computes(instr: object) -> tuple[Compute, ...]:
    if type(instr) is Compute:
        return (instr,)
    if type(instr) is Fused:
        return (instr.forward, instr.backward)
    return ()


def test_cost_file_round_trips_through_the_simulators_parser(tmp_path: Path) -> None:
    a, b = Recorder(step=0), Recorder(step=0)  # ranks 0 and 1
    for stage, recorder in ((0, a), (1, b)):
        recorder.compute("F", stage, 0.001 * (stage + 1))
        recorder.compute("F", stage, 0.003 * (stage + 1))  # the mean: 2 and 4 ms
        recorder.compute("B", stage, 0.002 * (stage + 1))
        recorder.compute("FB", stage, 0.0025)
    for seconds in (0.0001, 0.0003):
        a.post(seconds)
    b.post(0.0002)  # post: the mean, 0.2 ms
    act, grad = Message(Msg.ACT, 0, 1, 0), Message(Msg.GRAD, 0, 0, 0)
    act2 = Message(Msg.ACT, 0, 1, 1)
    # act: rank 1 waits from 9.5; the transfer can start at 10 (both posted); released
    # at 10.0005. grad: the receive is posted last, at 20.001, and waited for at once;
    # released at 20.0018. act2: both posted at 30; rank 0 waits for its send at once and
    # is released at 30.0006; rank 1 comes to wait at 31 and finds the data there.
    b.posted(False, act, 9.0, 128)
    a.posted(True, act, 10.0, 128)
    b.wait(((False, act),), (9.5, 10.0005, 10.0006))
    b.posted(True, grad, 20.0, 128)
    a.posted(False, grad, 20.001, 128)
    a.wait(((False, grad),), (20.0011, 20.0018, 20.0019))
    a.posted(True, act2, 30.0, 128)
    b.posted(False, act2, 30.0, 128)
    a.wait(((True, act2),), (30.00001, 30.0006, 30.0007))
    b.wait(((False, act2),), (31.0, 31.0, 31.0001))
    a.sync(40.0, 40.010)
    b.sync(40.002, 40.011)  # from the last start to the last end: 9 ms
    path = tmp_path / "costs.toml"
    loop = compile_schedule("1f1b", ranks=2, microbatches=2)
    path.write_text(render_cost_file([a, b], "measured here\nsecond line", measured_on=loop))
    assert path.read_text().startswith("# measured here\n# second line\n\n[cost]\n")
    model = load_cost_file(path)
    assert model.measured == Cut(2, 2, "loop")
    assert model.base.F == pytest.approx(3.0), "per share: a loop stage is one share"
    # rank 1's late wait adds nothing; the others: 10 + c, 20.001 + c, 30 + c
    assert model.base.comm == pytest.approx((0.5 + 0.8 + 0.6) / 3, abs=1e-4)
    assert model.base.bytes == 128
    assert model.host.post == pytest.approx(0.2)
    assert model.host.wait == pytest.approx(0.1, abs=1e-4)  # after each release
    assert model.host.sync == pytest.approx(9.0, abs=1e-4)
    assert model.stage(1).F == pytest.approx(4.0) and model.stage(0).B == pytest.approx(2.0)
    assert model.stage(0).FB == pytest.approx(2.5)


def test_a_v_shape_profile_is_per_share_and_says_what_it_ran(tmp_path: Path) -> None:
    """[cost] is the mean over the stages times S/P (a V stage is half a share); the
    tables stay as measured; placement, ranks and stages name the program."""
    a, b = Recorder(step=0), Recorder(step=0)
    for stage, recorder in ((0, a), (3, a), (1, b), (2, b)):
        recorder.compute("F", stage, 0.001 * (stage + 1))  # 1, 2, 3, 4 ms: the mean 2.5
    vee = compile_schedule("zbv", ranks=2, microbatches=2)
    path = tmp_path / "v.toml"
    path.write_text(render_cost_file([a, b], "a V shape", measured_on=vee))
    model = load_cost_file(path)
    assert model.measured == Cut(2, 4, "vshape")
    assert model.base.F == pytest.approx(5.0), "per share: two V stages"
    assert [cost.F for _, cost in model.stages] == pytest.approx([1, 2, 3, 4])
    loop = model.for_program(compile_schedule("1f1b", ranks=2, microbatches=2))
    assert [loop.stage(s).F for s in (0, 1)] == pytest.approx([3, 7]), "stages 2s, 2s+1 added"


def test_comm_is_the_latency_that_reproduces_the_waits() -> None:
    """Under the rendezvous rule a wait is released at max(start, ready + comm)."""
    blocked = (9.9, 10.0, 10.0004)  # waiting before the transfer could start: 0.4 ms
    late = (20.01, 20.0, 20.01)  # came 10 ms after: the data was there, nothing to learn
    assert fit_latency([blocked, late]) == pytest.approx(0.0004, abs=1e-8)
    slow = (20.0002, 20.0, 20.0006)  # came 0.2 ms after, still waited: 0.6 ms
    assert fit_latency([blocked, slow]) == pytest.approx(0.0005, abs=1e-8)
    assert fit_latency([]) == 0.0


def test_comm_is_calibrated_so_that_the_profile_replays_its_own_steps(tmp_path: Path) -> None:
    """With the spans of its steps recorded, `comm` is the latency under which the profiled
    program replayed with the file's own durations lasts the median measured span: each
    message of 1F1B at P=2, M=2 on the critical path takes it, so the makespan grows with it."""
    program = compile_schedule("1f1b", ranks=2, microbatches=2)
    records = []
    for step, span in ((0, 0.0120), (1, 0.0140), (2, 0.0200)):  # the median: 14 ms
        for rank in (0, 1):
            record = Recorder(step=step)
            for _ in range(2):
                record.compute("F", rank, 0.001)
                record.compute("B", rank, 0.002)
            record.post(0.0001)
            record.span(100.0 * step + 0.001 * rank, 100.0 * step + span)  # rank 1 later
            records.append(record)
    path = tmp_path / "costs.toml"
    replay = functools.partial(replayed_ms, program=program, model=CommModel.RENDEZVOUS)
    path.write_text(render_cost_file(records, "calibrated", measured_on=program, replay=replay))
    waits_only = render_cost_file(records, "no replay", measured_on=program)
    assert "\ncomm =" not in waits_only, "no waits were recorded, no replay given: no comm"
    costs = load_cost_file(path).for_program(program)
    replayed = simulate(program, costs, model=CommModel.RENDEZVOUS).makespan
    assert costs.base.comm is not None and costs.base.comm > 0.5
    assert replayed == pytest.approx(14.0, abs=1e-3), "the median span, from rank 0's start"
    without = load_cost_file(path)
    assert span_times(records) == pytest.approx([0.012, 0.014, 0.02])
    assert without.host.post == pytest.approx(0.1)


def test_the_calibration_is_the_least_latency_that_reaches_the_span() -> None:
    def linear(comm: float) -> float:  # 10 ms of work and 4 messages in a row
        return 10.0 + 4 * comm

    assert calibrated_comm(linear, 12.0) == pytest.approx(0.5, abs=2e-4)
    assert calibrated_comm(linear, 9.0) == 0.0, "already that long without latency"
    assert calibrated_comm(linear, 4011.0) is None, "beyond the latencies tried"
    assert calibrated_comm(lambda comm: 10.0, 12.0) is None, "no message moves it"
    stepped = calibrated_comm(lambda comm: 10.0 + max(0.0, comm - 3.0), 11.0)
    assert stepped == pytest.approx(4.0, abs=2e-4), "found past the first doubling"


class _Group:
    """A stand-in process group that records what is posted on it."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, torch.Tensor, int, int]] = []

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> str:
        self.posted.append(("send", tensors[0], peer, tag))
        return "work"

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> str:
        self.posted.append(("recv", tensors[0], peer, tag))
        return "work"


class _Op:
    """What `comm` reads of a `dist.P2POp`."""

    def __init__(self, op: object, tensor: torch.Tensor, group: _Group) -> None:
        self.op, self.tensor, self.group = op, tensor, group
        self.peer, self.group_peer, self.tag = 5, 1, 0


class _Subclass(torch.Tensor):
    pass


def test_a_post_goes_to_the_group_with_the_peers_rank_in_it() -> None:
    """A plain tensor goes to the process group directly, with the peer's rank in the group
    (not its global rank) and a complex tensor as its real view; a tensor subclass goes
    through torch's isend/irecv (which dispatch on it) with the global rank."""
    import torch.distributed as dist
    from pipecc.runtime.comm import channel as comm

    group = _Group()
    plain, complex_ = torch.ones(3), torch.ones(3, dtype=torch.complex64)
    assert comm._single(_Op(dist.isend, plain, group)) == ["work"]  # type: ignore[arg-type]
    comm._single(_Op(dist.irecv, complex_, group))  # type: ignore[arg-type]
    (kind, tensor, peer, tag), (kind2, tensor2, peer2, _) = group.posted
    assert (kind, peer, tag, kind2, peer2) == ("send", 1, 0, "recv", 1)
    assert tensor is plain and tensor2.dtype == torch.float32 and tensor2.shape == (3, 2)
    seen: list[tuple[object, int, object]] = []

    def isend(tensor: torch.Tensor, peer: int, *, group: object, tag: int) -> str:
        seen.append((type(tensor), peer, group))
        return "work"

    sub = torch.ones(2).as_subclass(_Subclass)
    assert comm._single(_Op(isend, sub, group)) == ["work"]  # type: ignore[arg-type]
    assert seen == [(_Subclass, 5, group)] and len(group.posted) == 2


class _FailingWork:
    """A posted op whose wait fails after `delay` seconds with `text` (as gloo's does, a
    plain RuntimeError whatever the cause)."""

    def __init__(self, delay: float, text: str) -> None:
        self.delay, self.text = delay, text

    def wait(self, timeout: object = None) -> bool:
        time.sleep(self.delay)
        raise RuntimeError(self.text)


@pytest.mark.parametrize(
    ("delay", "text", "timed_out"),
    [
        (0.3, "Connection closed by peer", True),  # the deadline passed: a timeout
        (0.3, "anything at all", True),
        (0.0, "Timed out waiting 1000ms for recv operation to complete", False),  # before it
    ],
)
def test_a_wait_is_a_timeout_by_its_deadline_not_its_text(
    delay: float, text: str, timed_out: bool
) -> None:
    channel = Channel(None, (0,), timeout=0.2, nccl=False)
    posted = Posted(works=[cast(Any, _FailingWork(delay, text))])
    with pytest.raises(Exception) as caught:
        channel.complete(posted, time.monotonic() + 0.2)
    assert isinstance(caught.value, OpTimeout) is timed_out
    assert isinstance(caught.value, TimeoutError) is timed_out


def test_an_op_not_posted_by_its_deadline_is_a_timeout() -> None:
    never = Group([], coalesced=False)  # never handed to a poster thread
    with pytest.raises(OpTimeout):
        Posted(group=never, index=0).works(0.01)


def test_a_group_posted_by_the_poster_thread_gives_each_op_its_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Groups are posted in the order submitted, in the poster thread; each op takes its own
    works; an error raised while posting reaches every op of its group."""
    seen: list[tuple[str, int]] = []

    def post_now(ops: list[Any], coalesced: bool) -> list[list[Any]]:
        if ops and ops[0] == "bad":
            raise RuntimeError("gloo refused")
        seen.append((threading.current_thread().name, len(ops)))
        return [[f"work {op}"] for op in ops]

    monkeypatch.setattr(channel_module, "_post_now", post_now)
    poster = Poster()
    try:
        first = [Posted(group=g, index=i) for g in [poster.submit(["a", "b"], True)]
                 for i in range(2)]  # fmt: skip
        bad = poster.submit(["bad"], False)
        last = Posted(group=poster.submit(["c"], False), index=0)
        assert last.works(5.0) == ["work c"]
        assert [p.works(5.0) for p in reversed(first)] == [["work b"], ["work a"]]
        with pytest.raises(RuntimeError, match="gloo refused"):
            Posted(group=bad, index=0).works(5.0)
    finally:
        poster.shutdown()
    assert seen == [("pipecc-post", 2), ("pipecc-post", 1)]


class _AddsToATuple(nn.Module):
    """Returns a tuple through `add_loss`, which discovery must accept as the step does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from pipecc.runtime import add_loss

        h = self.linear(x)
        return add_loss((h, h.detach() > 0), (h * h).mean())


def test_discovery_runs_a_stage_that_adds_a_loss_to_a_tuple(tmp_path: Path) -> None:
    import torch.distributed as dist
    from pipecc.runtime import PipelineRuntime, RuntimeConfig

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        stage = _AddsToATuple()
        program = compile_schedule("1f1b", ranks=1, microbatches=1)
        loss_fn = lambda out, target: nn.functional.mse_loss(out[0], target)  # noqa: E731
        runtime = PipelineRuntime(program, [stage], loss_fn=loss_fn, config=RuntimeConfig())
        x, target = torch.randn(4, 3), torch.randn(4, 3)
        runtime.step(x, target)
        got = stage.linear.weight.grad.clone()
        stage.zero_grad()
        h = stage.linear(x)
        (nn.functional.mse_loss(h, target) + (h * h).mean()).backward()
        assert torch.allclose(got, stage.linear.weight.grad, atol=1e-6)
    finally:
        dist.destroy_process_group()
