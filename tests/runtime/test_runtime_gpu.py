"""The CUDA path: one rank's stages on a GPU (NCCL), fused F&B on two streams, split
backward on the GPU; NCCL between ranks when there are two GPUs or more.

Skipped without CUDA; benchmarks/gpu_check.sh runs them on a GPU host. On one GPU the
programs are compiled for P=1 (every stage on the one rank: V-shape hand-offs and fused ops,
no messages); multi-rank NCCL needs a GPU per rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
from pipecc.runtime.engine.split_backward import full_backward, input_backward
from pipecc.runtime.tools.spawn import spawn
from runtime_cases import Case, compile_case, mlp_like, run_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
GPU_TOLERANCE = 1e-5  # fp32 on the GPU: cuBLAS may sum in another order than the CPU


def _check(results: list[dict], microbatches: int) -> None:
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result.get('message')}"
        assert result["grad_rel"] <= GPU_TOLERANCE, f"rank {rank}: {result['grad_rel']}"
    losses = {mb: v for r in results for mb, v in r["losses"].items()}
    assert sorted(losses) == list(range(microbatches))
    want = results[0]["want_loss"]
    assert abs(sum(losses.values()) / microbatches - want) <= GPU_TOLERANCE * abs(want)


def test_one_gpu_rank_runs_v_shapes_and_fused_ops_on_two_streams() -> None:
    cases = [
        Case("dualpipev-P1", compile_case("dualpipev", 1, 6), device="cuda"),
        Case("zbv-P1", compile_case("zbv", 1, 4), device="cuda"),
        Case("hook-dualpipev-P1", compile_case("dualpipev", 1, 6), model="hooked", device="cuda"),
        Case("tuple-1f1b-P1", compile_case("1f1b", 1, 3), model="tuple", device="cuda"),
    ]
    results = spawn(run_cases, 1, cases, backend="nccl", timeout=120)
    for case in cases:
        _check([r[case.name] for r in results], case.program.num_microbatches)
    hooked = results[0]["hook-dualpipev-P1"]
    assert hooked["hook_calls"] == hooked["fused_b"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_between_two_gpus() -> None:
    names = ("1f1b", "zb_h1", "dualpipe", "dualpipev", "interleaved_1f1b")
    cases = [Case(f"{n}-nccl", compile_case(n, 2, 4), device="cuda") for n in names]
    results = spawn(run_cases, 2, cases, backend="nccl", timeout=120)
    for case in cases:
        _check([r[case.name] for r in results], 4)


def test_split_backward_on_the_gpu_equals_full_backward() -> None:
    device = torch.device("cuda")
    module = mlp_like(3).to(device)
    split = copy.deepcopy(module)
    x = torch.randn(4, 6, device=device, requires_grad=True)
    g = torch.randn(4, 6, device=device)
    grads = full_backward((module(x),), (g,), (x,))
    x2 = x.detach().requires_grad_(True)
    ids = {id(p) for p in split.parameters()}
    input_grads, weight = input_backward((split(x2),), (g,), (x2,), ids)
    weight.run()
    torch.testing.assert_close(grads[0], input_grads[0])
    for a, b in zip(module.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
