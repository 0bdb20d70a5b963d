"""I + W under `capturing(module)` equals a full backward, bit for bit.

Every case builds a module, runs one copy plainly (forward, one engine call: B) and one with
its forward captured and its backward split (I, then W), and compares every parameter's
gradient and every input's gradient with `torch.equal`. The cases cover the class of
modules a transformer stage is made of: Linear stacks (2-d and 3-d inputs, with and without
bias, in-place activations), Linear mixed with LayerNorm, embeddings and attention (SDPA and
`nn.MultiheadAttention`, whose weights are not `nn.Linear` calls), shared and tied weights
(a Linear called twice, two Linears sharing a weight, an embedding tied to the LM head, a
raw `F.linear` on a Linear's weight), frozen weights, inputs that need no gradient, bf16
parameters and bf16 autocast.
"""

from __future__ import annotations

import contextlib
import copy
import runpy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pipecc.runtime import PipelineRuntime, infer_boundaries
from pipecc.runtime.engine import split_backward, weight_contract
from pipecc.runtime.engine.split_backward import full_backward, input_backward
from pipecc.runtime.engine.steps import ComputeStep, FusedStep, Step
from pipecc.runtime.engine.weight_contract import capturing, register_weight_grad
from pipecc.runtime.tools.reference import gradients, reference_step
from test_split_backward import CountOps
from torch import nn
from torch.nn import functional as F

from pipecc.api import compile_schedule
from pipecc.ir.ops import Compute, Kind

H = 16


class Block(nn.Module):
    """A pre-LN GPT block: causal SDPA attention through Linear projections, GELU MLP."""

    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.up, self.down = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(H, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, H))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Embed(nn.Module):
    """A first stage: token and position embeddings (int input), then a block."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.block = nn.Embedding(32, H), nn.Embedding(8, H), Block()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.block(self.tok(ids) + self.pos(torch.arange(ids.shape[1])))


class TiedLM(nn.Module):
    """Embedding tied to the LM head (GPT-2), both in one stage, a block between."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.block, self.ln = nn.Embedding(32, H), Block(), nn.LayerNorm(H)
        self.head = nn.Linear(H, 32, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.block(self.tok(ids))))


class Reused(nn.Module):
    """A Linear called twice, a second Linear sharing its weight, a raw `F.linear` on it,
    a frozen weight with a trainable bias, an extra scale parameter, two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.frozen = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)
        self.b.weight = self.a.weight
        self.frozen.weight.requires_grad_(False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, H))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.gelu(self.a(x))
        h = self.a(h) * self.scale + F.linear(y, self.a.weight)
        return self.frozen(self.b(h)), h.sum(-1)


class Attention(nn.Module):
    """`nn.MultiheadAttention` (its projections are raw parameters) between Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.attn, self.out = (
            nn.Linear(H, H),
            nn.MultiheadAttention(H, 2),
            nn.Linear(H, H),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(self.attn(h, h, h, need_weights=False)[0])


def mlp(bias: bool = True, inplace: bool = False) -> nn.Module:
    act: Callable[[], nn.Module] = (lambda: nn.ReLU(inplace=True)) if inplace else nn.GELU
    return nn.Sequential(*(m for _ in range(3) for m in (nn.Linear(H, H, bias=bias), act())))


def run(
    module: nn.Module, inputs: list[torch.Tensor], split: bool, seed: int = 1
) -> dict[str, Any]:
    """Forward, then B (plain) or I + W (captured); every gradient, and the ops of I and W."""
    leaves = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    ids = {id(p) for p in module.parameters()}
    capture = None
    if split:
        with capturing(module) as capture:
            out = module(*leaves)
    else:
        out = module(*leaves)
    outputs = out if isinstance(out, tuple) else (out,)
    torch.manual_seed(seed)
    grads = [torch.randn_like(o) for o in outputs]
    counted = [CountOps(), CountOps()]
    with counted[0]:
        if split:
            found, weight = input_backward(outputs, grads, leaves, ids, capture)
        else:
            found = full_backward(outputs, grads, leaves)
    if split:
        with counted[1]:
            weight.run()
    return {
        "inputs": found,
        "params": {n: p.grad for n, p in module.named_parameters()},
        "I": counted[0].ops,
        "W": counted[1].ops,
    }


def assert_same(module: nn.Module, inputs: list[torch.Tensor]) -> dict[str, Any]:
    """B on one copy, I + W on another: every gradient bit-identical; returns the split run."""
    full = run(copy.deepcopy(module), inputs, split=False)
    split = run(copy.deepcopy(module), inputs, split=True)
    assert full["params"].keys() == split["params"].keys()
    for name, want in full["params"].items():
        got = split["params"][name]
        assert (want is None) == (got is None), name
        if want is not None:
            assert want.dtype == got.dtype and torch.equal(want, got), name
    for want, got in zip(full["inputs"], split["inputs"], strict=True):
        assert (want is None) == (got is None)
        if want is not None:
            assert torch.equal(want, got)
    return split


def floats(*shape: int, grad: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


CASES: dict[str, Callable[[], tuple[nn.Module, list[torch.Tensor]]]] = {
    "mlp 2-d": lambda: (mlp(), [floats(4, H)]),
    "mlp 3-d": lambda: (mlp(), [floats(2, 3, H)]),
    "mlp no bias": lambda: (mlp(bias=False), [floats(2, 3, H)]),
    "mlp in-place relu": lambda: (mlp(inplace=True), [floats(2, 3, H)]),
    "mlp input without grad": lambda: (mlp(), [floats(4, H, grad=False)]),
    "gpt block": lambda: (Block(), [floats(2, 8, H)]),
    "embeddings + block": lambda: (Embed(), [torch.randint(0, 32, (2, 8))]),
    "tied embedding and head": lambda: (TiedLM(), [torch.randint(0, 32, (2, 8))]),
    "shared, reused, raw, frozen": lambda: (Reused(), [floats(4, H), floats(4, H)]),
    "shared, input y without grad": lambda: (Reused(), [floats(4, H), floats(4, H, grad=False)]),
    "multihead attention": lambda: (Attention(), [floats(5, 2, H)]),
    "gpt block bf16": lambda: (Block().to(torch.bfloat16), [floats(2, 8, H, dtype=torch.bfloat16)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_i_plus_w_equals_b_exactly(case: str) -> None:
    torch.manual_seed(0)
    module, inputs = CASES[case]()
    assert_same(module, inputs)


def test_gpt_block_under_bf16_autocast() -> None:
    torch.manual_seed(0)
    module, x = Block(), floats(2, 8, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        split = assert_same(module, [x])
    assert all(g.dtype == torch.float32 for g in split["params"].values())


def test_w_does_the_weight_matmuls_and_i_the_rest() -> None:
    """On a middle stage of Linears, I runs one matmul per Linear (the input gradient) and no
    bias sum, W one matmul per Linear and the bias sums, and no autograd node at all."""
    torch.manual_seed(0)
    split = assert_same(mlp(), [floats(4, H)])
    assert split["I"]["mm"] == 3 and split["I"]["sum"] == 0
    assert split["W"]["mm"] == 3 and split["W"]["sum"] == 3
    assert split["W"]["gelu_backward"] == 0
    block = assert_same(Block(), [floats(2, 8, H)])
    assert block["W"]["mm"] == 4, "qkv, proj, up, down"
    assert block["W"]["native_layer_norm_backward"] == 0, "LayerNorm's gradients come in I"


def test_interleaved_microbatches_and_any_backward() -> None:
    """Three microbatches: I of each, W in reverse order; a fourth captured forward gets a
    plain B and a fifth a user's `.backward()`; all sum to the plain gradients."""
    torch.manual_seed(0)
    plain, captured = Block(), Block()
    captured.load_state_dict(plain.state_dict())
    ids = {id(p) for p in captured.parameters()}
    pending = []
    for seed in range(5):
        torch.manual_seed(seed)
        x, g = floats(2, 8, H), torch.randn(2, 8, H)
        full_backward((plain(x),), (g,), (x,))
        leaf = x.detach().requires_grad_(True)
        with capturing(captured) as capture:
            out = captured(leaf)
        if seed < 3:
            pending.append(input_backward((out,), (g,), (leaf,), ids, capture)[1])
        elif seed == 3:
            full_backward((out,), (g,), (leaf,))
        else:
            out.backward(g)
    for weight in reversed(pending):
        weight.run()
    for (name, a), b in zip(plain.named_parameters(), captured.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)  # summed in another order


def test_outside_capturing_modules_are_untouched() -> None:
    """After a capture nothing is left: autograd.grad on the weights works as before."""
    module = mlp()
    with capturing(module):
        assert all("forward" in m.__dict__ for m in module if isinstance(m, nn.Linear))
        module(floats(4, H))
    out = module(floats(4, H)).sum()
    grads = torch.autograd.grad(out, list(module.parameters()))
    assert all(g is not None for g in grads)
    assert all("forward" not in m.__dict__ for m in module.modules())
    copied = copy.deepcopy(module)  # a copy made inside a capture computes with its own weights
    with capturing(module):
        inside = copy.deepcopy(module)
    with torch.no_grad():
        copied[0].weight.add_(1.0)
        inside[0].weight.add_(1.0)
    x = floats(4, H)
    assert torch.equal(copied(x), inside(x))


class Scaled(nn.Linear):
    """A subclass with its own forward: it must not inherit Linear's contract."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, 2 * self.weight, self.bias)


class Diagonal(nn.Module):
    """A user module registering a contract: y = x * d."""

    def __init__(self, contract_ok: bool = True) -> None:
        super().__init__()
        self.d = nn.Parameter(torch.linspace(1, 2, H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.d


def _diagonal_grads(
    module: nn.Module, x: torch.Tensor, g: torch.Tensor, names: Any
) -> dict[str, torch.Tensor]:
    return {"d": (x * g).reshape(-1, H).sum(0)}


def test_subclass_with_own_forward_and_registered_contract() -> None:
    torch.manual_seed(0)
    register_weight_grad(Diagonal, _diagonal_grads)
    module = nn.Sequential(Scaled(H, H), nn.GELU(), Diagonal(), nn.Linear(H, H))
    split = assert_same(module, [floats(4, H)])
    assert split["W"]["mm"] == 1, "only the plain Linear is deferred, not Scaled"
    assert split["W"]["mul"] == 1, "Diagonal's contract runs in W"


def test_a_contract_that_returns_a_wrong_shape_is_named() -> None:
    class Bad(Diagonal):
        pass

    register_weight_grad(Bad, lambda m, x, g, n: {"d": g})
    module = nn.Sequential(nn.Linear(H, H), Bad())
    x = floats(4, H)
    with capturing(module) as capture:
        out = module(x)
    _, weight = input_backward(
        (out,), (torch.ones_like(out),), (x,), {id(p) for p in module.parameters()}, capture
    )
    with pytest.raises(
        RuntimeError, match=r"contract of Bad returned shape \(4, 16\) for parameter 'd'"
    ):
        weight.run()


@pytest.mark.parametrize("schedule", ["zbv", "interleaved_zb", "dualpipev"])
def test_the_runtime_defers_linear_weights_to_w(
    schedule: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rank holding both stages of a GPT (examples/gpt.py, untied): every W instruction
    computes the weight gradients of the stage's Linears itself (deferred by its I), the
    microbatches with a full B leave them to autograd (their forwards are not captured), and
    the step's gradients equal the single-process reference's."""
    gpt_file = runpy.run_path(str(Path(__file__).parents[2] / "examples" / "gpt.py"))
    config = gpt_file["GPTConfig"](vocab=32, dim=16, heads=2, seq=8, layers=2, dropout=0.0)
    stages = gpt_file["build_stages"](2, config)
    reference = copy.deepcopy(stages)
    batch = gpt_file["make_batch"](8, 0, config)
    done: list[str] = []
    monkeypatch.setattr(
        weight_contract, "accumulate", lambda work: done.append(_key(work)) or _accumulate(work)
    )
    monkeypatch.setattr(split_backward, "accumulate", weight_contract.accumulate)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        program = compile_schedule(schedule, ranks=1, microbatches=4)
        runtime = PipelineRuntime(
            program,
            {0: stages[0], 1: stages[1]},
            infer_boundaries(stages, batch[0][:2]),
            loss_fn=gpt_file["loss_fn"],
        )
        runtime.step(*batch)
    finally:
        dist.destroy_process_group()
    _, want = reference_step(reference, batch, 4, gpt_file["loss_fn"])
    got = gradients(stages)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-7, msg=str(key))
    captured = {
        half.key: half.capture is not None
        for step in runtime.plans.bound(training=True).steps
        for half in _halves(step)
        if half.kind is Kind.F
    }
    split = {
        (i.chunk, i.mb) for i in program.ranks[0] if isinstance(i, Compute) and i.kind is Kind.I
    }
    assert captured == {key: key in split for key in captured}, "captured exactly before an I"
    inputs = [i.chunk for i in program.ranks[0] if isinstance(i, Compute) and i.kind is Kind.I]
    linears = {c: sum(isinstance(m, nn.Linear) for m in stages[c].modules()) for c in inputs}
    # a microbatch whose backward is a full B runs uncaptured (autograd's own weight grads)
    assert len(done) == sum(linears[c] for c in inputs), "every contracted call of every I"


_accumulate = weight_contract.accumulate


def _halves(step: Step) -> tuple[ComputeStep, ...]:
    """A bound step's compute ops: itself, or a fused step's two halves."""
    if isinstance(step, FusedStep):
        return (step.forward, step.backward)
    return (step,) if isinstance(step, ComputeStep) else ()


def _key(work: Any) -> str:
    return type(work.module).__name__


def test_hooked_parameters_keep_their_autograd_edges() -> None:
    """A parameter whose gradient a hook waits for (`register_hook`, a post-accumulate hook
    as DDP's) is not contracted: its hooks fire, with the right gradient."""
    torch.manual_seed(0)
    module, x = mlp(), floats(4, H)
    full = run(copy.deepcopy(module), [x], split=False)  # (a deep copy drops tensor hooks)
    seen: dict[str, torch.Tensor] = {}
    module[0].weight.register_hook(lambda g: seen.setdefault("0.weight", g.clone()))

    def accumulated(param: torch.Tensor) -> None:
        assert param.grad is not None
        seen["2.weight"] = param.grad.clone()

    module[2].weight.register_post_accumulate_grad_hook(accumulated)
    split = run(module, [x], split=True)
    for name, want in full["params"].items():
        assert torch.equal(want, split["params"][name]), name
    assert seen.keys() == {"0.weight", "2.weight"}
    for name, got in seen.items():
        assert torch.equal(got, full["params"][name]), name
    assert split["W"]["mm"] == 1, "only the third Linear is deferred"


def test_a_failed_forward_restores_the_parameters() -> None:
    module = nn.Linear(3, 3)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"), capturing(module):
        module(floats(2, 4))
    assert type(module._parameters["weight"]) is nn.Parameter


class Detaching(Diagonal):
    """A module whose registered contract is wrong for it: its output has no graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.d).detach()


def test_a_contracted_call_whose_output_has_no_graph_is_an_error() -> None:
    """The weight gradients would be lost: the call fails and says why; a user's pre-hook
    that detaches the input, by contrast, just makes the call an ordinary one."""
    register_weight_grad(Detaching, _diagonal_grads)
    module = Detaching()
    with pytest.raises(RuntimeError, match="Detaching has a weight-gradient contract, but its"):
        with capturing(module):
            module(floats(4, H))
    assert type(module._parameters["d"]) is nn.Parameter
    torch.manual_seed(0)
    linear = nn.Sequential(nn.Linear(H, H), nn.Linear(H, H))
    linear[1].register_forward_pre_hook(lambda m, args: (args[0].detach(),))
    assert_same(linear, [floats(4, H)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w_adds_into_existing_gradients_inside_the_matmul(dtype: torch.dtype) -> None:
    """From the second microbatch on, W adds gᵀ·x into `.grad` with `addmm_` (no gradient
    block of its own, no separate add); the sums equal B's up to rounding."""
    torch.manual_seed(0)
    module = mlp().to(dtype)
    plain, captured = copy.deepcopy(module), copy.deepcopy(module)
    ids = {id(p) for p in captured.parameters()}
    counted = CountOps()
    for seed in range(2):
        torch.manual_seed(seed)
        x, g = floats(4, H, dtype=dtype), torch.randn(4, H, dtype=dtype)
        full_backward((plain(x),), (g,), (x,))
        leaf = x.detach().requires_grad_(True)
        with capturing(captured) as capture:
            out = captured(leaf)
        _, weight = input_backward((out,), (g,), (leaf,), ids, capture)
        with counted if seed == 1 else contextlib.nullcontext():
            weight.run()
    assert counted.ops["addmm_"] == 3 and counted.ops["mm"] == 0
    assert counted.ops["add_"] == 3, "the bias gradients only"
    for name, param in captured.named_parameters():  # x needs a gradient: nothing recorded
        assert param.grad is not None and param.grad.grad_fn is None, name
        assert not param.grad.requires_grad, name
    tolerance = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {}
    for (name, a), b in zip(plain.named_parameters(), captured.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name, **tolerance)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_contract_on_the_gpu(dtype: torch.dtype) -> None:
    """On CUDA the engine runs the pre-hooks on its device thread: the store is not
    thread-local, and I + W on a GPT block equals B there too (two microbatches; within
    rounding, as SDPA's CUDA backward is not deterministic)."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    plain = Block().to(device, dtype)
    captured = copy.deepcopy(plain)
    ids = {id(p) for p in captured.parameters()}
    for seed in range(2):
        torch.manual_seed(seed)
        x = torch.randn(2, 8, H, device=device, dtype=dtype)
        g = torch.randn_like(x)
        leaf = x.detach().requires_grad_(True)
        want = full_backward((plain(x.requires_grad_(True)),), (g,), (x,))
        with capturing(captured) as capture:
            out = captured(leaf)
        got, weight = input_backward((out,), (g,), (leaf,), ids, capture)
        assert weight.deferred, "the Linears deferred their weight work"
        weight.run()
        tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(want[0], got[0], **tolerance)  # SDPA's CUDA backward
    for (name, a), b in zip(plain.named_parameters(), captured.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name, **tolerance)
