"""The runtime's CUDA set-up, checked on the CPU with stand-ins for what needs a GPU: the
device `cuda` resolves to (the RNG seeding too), a parameterless stage on an NCCL group,
groups warmed when they are made (the holders' sums, the mesh's reductions), and the
selective replay on its region's stream."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pipecc.runtime import declared
from pipecc.runtime.comm import mesh, shared
from pipecc.runtime.engine import selective
from pipecc.runtime.engine.rng import ForwardRng

from pipecc.api import compile_schedule
from pipecc.ir.ops import Collective, CollectiveKind


@pytest.fixture
def current_gpu(monkeypatch: pytest.MonkeyPatch) -> int:
    """This process's current CUDA device is 3 (a rank of a node, after `set_device`)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    return 3


def test_cuda_without_an_index_seeds_the_current_devices_generator(current_gpu: int) -> None:
    assert ForwardRng(torch.device("cuda"), 0, enabled=True).index == current_gpu
    assert ForwardRng(torch.device("cuda", 1), 0, enabled=True).index == 1
    assert ForwardRng(torch.device("cpu"), 0, enabled=True).cuda is False


def test_the_runtime_device_resolves_cuda_and_parameterless_stages_on_nccl(
    current_gpu: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = {"config": "cpu:gloo,cuda:nccl"}
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: backend["config"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    no_params = {0: torch.nn.ReLU()}
    linear = {0: torch.nn.ReLU(), 1: torch.nn.Linear(2, 2)}
    device = declared.runtime_device
    assert device(torch.device("cuda"), linear, None) == torch.device("cuda", current_gpu)
    assert device(torch.device("cuda", 0), no_params, None) == torch.device("cuda", 0)
    assert device(torch.device("cpu"), no_params, None) == torch.device("cpu")
    assert device(None, linear, None) == torch.device("cpu"), "the parameters' device"
    assert device(None, no_params, None) == torch.device("cuda", current_gpu)
    backend["config"] = "cpu:gloo"
    assert device(None, no_params, None) == torch.device("cpu")


class Calls:
    """Stand-ins for `new_group` and `all_reduce` that log what they were called with."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, object]] = []
        monkeypatch.setattr(dist, "new_group", self.new_group)
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)

    def new_group(self, ranks: list[int], **_: object) -> str:
        self.log.append(("new_group", tuple(ranks)))
        return f"group{tuple(ranks)}"

    def all_reduce(self, tensor: torch.Tensor, group: object = None, **_: object) -> None:
        assert tensor.numel() == 1 and tensor.device == torch.device("cpu")
        self.log.append(("all_reduce", group))


def test_the_holders_groups_are_warmed_as_they_are_made(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = Calls(monkeypatch)
    program = compile_schedule("dualpipe", ranks=4, microbatches=8)
    sums = shared.GradientSums(
        program, 1, {}, shared.ParamGrads(), device=torch.device("cpu")
    )  # rank 1 holds stage 1 with rank 2
    sums.create_groups(program, (10, 11, 12, 13), None, 30.0)
    assert calls.log == [("new_group", (11, 12)), ("all_reduce", "group(11, 12)")]
    assert sums.groups == {(1, 2): "group(11, 12)"}


class Sub:
    def __init__(self, name: str, log: list[tuple[str, object]]) -> None:
        self.name, self.log = name, log

    def get_group(self) -> str:
        self.log.append(("get_group", self.name))
        return self.name

    def size(self) -> int:
        return 2

    def _flatten(self) -> Sub:
        return Sub(self.name + "_flat", self.log)


class Mesh:
    """A stand-in DeviceMesh with dimensions pp, dp_replicate, dp_shard."""

    mesh_dim_names = ("pp", "dp_replicate", "dp_shard")

    def __init__(self, log: list[tuple[str, object]]) -> None:
        self.log = log

    def __getitem__(self, dims: str | tuple[str, ...]) -> Sub:
        return Sub("+".join(dims) if isinstance(dims, tuple) else dims, self.log)


def test_the_mesh_reductions_groups_are_made_and_warmed_at_set_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = Calls(monkeypatch)

    def reduce(stage: int, dims: tuple[str, ...]) -> Collective:
        return Collective(CollectiveKind.ALL_REDUCE, (0,), f"dp-grad s{stage}", dims=dims,
                          stages=(stage,))  # fmt: skip

    ops = [reduce(1, ("dp_shard",)), reduce(0, ("dp_replicate", "dp_shard")),
           reduce(2, ("dp_shard",))]  # fmt: skip
    program: Any = SimpleNamespace(ranks=[ops], placement=SimpleNamespace(chunks=lambda r: []))
    parallel = mesh.DataParallel(program, 0, {}, Mesh(calls.log), device=torch.device("cpu"))
    assert calls.log == [
        ("get_group", "dp_replicate+dp_shard_flat"),
        ("all_reduce", "dp_replicate+dp_shard_flat"),
        ("get_group", "dp_shard"),
        ("all_reduce", "dp_shard"),
    ]
    assert set(parallel.groups) == {("dp_shard",), ("dp_replicate", "dp_shard")}
    calls.log.clear()
    assert parallel.post(0, ops[0]) == [] and calls.log == [], "made before the step"


class Stream:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: Stream) -> None:
        self.log.append(f"{self.name} waits {other.name}")


def test_the_selective_replay_runs_on_its_regions_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    main, side = Stream("main", log), Stream("side", log)
    now = {"stream": main}

    @contextlib.contextmanager
    def use(stream: Stream) -> Iterator[None]:
        before, now["stream"] = now["stream"], stream
        log.append(f"on {stream.name}")
        yield
        now["stream"] = before

    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: now["stream"])
    monkeypatch.setattr(torch.cuda, "stream", use)
    with selective.on_stream(side, 0):
        log.append(f"replay on {now['stream'].name}")
    assert log == ["side waits main", "on side", "replay on side", "main waits side"]
    log.clear()
    for stream, index in ((main, 0), (None, 0), (side, None)):
        with selective.on_stream(stream, index):
            log.append("replay")
    assert log == ["replay"] * 3, "its stream is the current one, or no CUDA: as it is"
