"""Every private torch API of runtime/compat.py, one test each: when a torch release changes
one, its test fails here by name, before any step of a runtime does."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from pipecc.runtime import compat
from torch.autograd.graph import get_gradient_edge


@dataclass
class Pair:
    a: torch.Tensor
    b: int


def test_pytree_flattens_rebuilds_serialises_and_registers() -> None:
    value = {"x": (torch.ones(2), 3), "y": [None, torch.zeros(1)]}
    leaves, tree = compat.pytree.tree_flatten(value)
    assert [type(leaf).__name__ for leaf in leaves] == ["Tensor", "int", "NoneType", "Tensor"]
    assert compat.pytree.tree_leaves(value) == leaves
    again = compat.pytree.treespec_loads(compat.pytree.treespec_dumps(tree))
    assert again == tree
    assert compat.pytree.tree_unflatten(leaves, again)["x"][1] == 3
    compat.pytree.register_pytree_node(
        Pair, lambda p: ([p.a, p.b], None), lambda leaves, _: Pair(*leaves)
    )
    assert len(compat.pytree.tree_leaves(Pair(torch.ones(1), 2))) == 2
    mapped = compat.pytree.tree_map_only(torch.Tensor, lambda t: t + 1, value)
    assert torch.equal(mapped["x"][0], torch.full((2,), 2.0))


def test_run_backward_returns_or_accumulates_gradients() -> None:
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    y = x * w
    g = torch.ones(3)
    (got,) = compat.run_backward((y,), (g,), (x,), keep_graph=True, accumulate=False)
    assert torch.equal(got, w.detach()) and x.grad is None and w.grad is None
    compat.run_backward((get_gradient_edge(y),), (g,), (), keep_graph=False, accumulate=True)
    assert torch.equal(x.grad, w.detach()) and torch.equal(w.grad, x.detach())


def test_accumulate_grad_nodes_and_their_leaves() -> None:
    x = torch.randn(2, requires_grad=True)
    node = (x * 2).grad_fn
    assert node is not None
    leaf_node = node.next_functions[0][0]
    assert type(leaf_node) is compat.ACCUMULATE_GRAD
    assert compat.leaf_of(leaf_node) is x


def test_grad_hooks_on_a_parameter_are_seen() -> None:
    plain, hooked, accumulated = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    hooked.register_hook(lambda g: g)
    accumulated.register_post_accumulate_grad_hook(lambda p: None)
    assert [compat.grad_hooked(p) for p in (plain, hooked, accumulated)] == [False, True, True]


def test_a_views_base_is_the_tensor_it_views() -> None:
    base = torch.zeros(4, 2)
    assert compat.base_of(base.view(8)) is base
    assert compat.base_of(base.view(8).view(2, 4)) is base, "a view of a view: the root"
    assert compat.base_of(base) is None and compat.base_of(base.clone()) is None


@pytest.fixture
def gloo(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("gloo")
def test_gloo_does_not_coalesce() -> None:
    assert compat.group_coalesces(None, torch.device("cpu")) is False
    assert compat.group_coalesces(None, torch.device("meta")) is False, "no backend for it"


def test_an_op_is_posted_on_its_group_to_the_peer_in_it() -> None:
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2)
    try:
        sent, received = torch.arange(4.0), torch.zeros(4)
        send = dist.P2POp(dist.isend, sent, 1)
        recv = dist.P2POp(dist.irecv, received, 1)
        assert send.group_peer == 1 and send.tag == 0
        for op, tensor in ((send, sent), (recv, received)):
            work = compat.post_p2p(op, tensor)
            assert work is not None
            work.wait()
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("gloo")
def test_fsdp_post_backward_reduces_the_unsynced_gradients() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(module, mesh=init_device_mesh("cpu", (1,)))
    module.set_requires_gradient_sync(False)
    module(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is None for p in module.parameters()), "held unreduced by FSDP"
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    compat.fsdp_post_backward(module)
    assert {type(p.grad).__name__ for p in module.parameters()} == {"DTensor"}


def test_storage_shared_counts_the_tensors_of_a_storage() -> None:
    own = torch.randn(4, 3)
    assert not compat.storage_shared(own)
    view = own[0]
    assert compat.storage_shared(own) and compat.storage_shared(view)
    del view
    assert not compat.storage_shared(own)
    # what autograd hands a parameter: a view of the output gradient it was given
    param = torch.nn.Parameter(torch.randn(3))
    x = torch.randn(1, 3, requires_grad=True)
    seed = torch.randn(1, 3)
    torch.autograd.backward(x + param.unsqueeze(0), seed)
    assert param.grad is not None and param.grad.data_ptr() == seed.data_ptr()
    assert compat.storage_shared(param.grad)
    del seed
    x.grad = None
    assert not compat.storage_shared(param.grad)


def test_the_default_store_is_the_jobs_and_none_without_a_job(tmp_path: Path) -> None:
    assert compat.default_store() is None
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        found = compat.default_store()
        assert found is not None
        found.set("pipecc/test", "1")
        assert found.get("pipecc/test") == b"1"
        assert found.compare_set("pipecc/new", "", "first") == b"first"
        assert found.compare_set("pipecc/new", "", "second") == b"first"
    finally:
        dist.destroy_process_group()


def test_profiler_enabled_only_while_a_profiler_records() -> None:
    assert compat.profiler_enabled() is False
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert compat.profiler_enabled() is True
    assert compat.profiler_enabled() is False


def test_version_of_counts_in_place_ops() -> None:
    t = torch.zeros(3)
    before = compat.version_of(t)
    t.add_(1)
    t[0] = 5
    assert compat.version_of(t) == before + 2
    assert compat.version_of(t.clone()) == 0


@pytest.mark.usefixtures("gloo")
def test_dtensor_local_shape_is_the_shards_shape() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    placed = distribute_tensor(torch.randn(4, 6), init_device_mesh("cpu", (1,)), [Shard(1)])
    assert compat.dtensor_local_shape(placed) == (4, 6) == tuple(placed.to_local().shape)


def test_a_modules_registries_hold_what_was_registered() -> None:
    inner = torch.nn.Linear(2, 2)
    module = torch.nn.Module()
    module.a = inner
    module.b = inner  # one child under two names
    module.register_module("c", None)
    module.register_buffer("running", torch.zeros(2))
    module.w = torch.nn.Parameter(torch.ones(1))
    assert list(compat.child_table(module).items()) == [("a", inner), ("b", inner), ("c", None)]
    assert [n for n, _ in module.named_children()] == ["a"], "what the public API shows"
    assert list(compat.parameter_table(module)) == ["w"]
    assert list(compat.buffer_table(module)) == ["running"]
    del compat.child_table(module)["b"]
    compat.buffer_table(module)["running"] = None
    assert not hasattr(module, "b") and module.running is None


def test_detached_parameters_record_no_edge_and_come_back() -> None:
    layer = torch.nn.Linear(3, 2)
    params = dict(layer.named_parameters())
    x = torch.randn(4, 3, requires_grad=True)
    with compat.detached_parameters(layer, params):
        out = layer(x)
        assert all(not p.requires_grad for p in layer.parameters())
    out.sum().backward()
    assert x.grad is not None and layer.weight.grad is None and layer.bias.grad is None
    assert dict(layer.named_parameters()) == params, "the parameters themselves are back"


def test_dispatch_mode_sees_ops_and_a_weak_ref_expires() -> None:
    seen: list[str] = []

    class Names(compat.DispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Names():
        t = torch.ones(2) + 1
    assert any("add" in name for name in seen)
    ref = compat.storage_weak_ref(t.untyped_storage())
    assert not ref.expired()
    del t
    assert ref.expired()


def test_fsdp_param_groups_are_found_under_either_name() -> None:
    """torch 2.13 keeps a list (`_fsdp_param_groups`); torch 2.11 one group or None
    (`_fsdp_param_group`): the runtime's post-backward takes both."""
    from types import SimpleNamespace

    assert compat._param_groups(SimpleNamespace(_fsdp_param_groups=("a", "b"))) == ["a", "b"]
    assert compat._param_groups(SimpleNamespace(_fsdp_param_group="a")) == ["a"]
    assert compat._param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
