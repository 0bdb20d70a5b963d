"""Memory in bytes, predicted and measured (`pipecc run --memory`): on a loop (1F1B, ZB-H1,
ZB-H2), a V shape (ZB-V) and DualPipe, each rank's predicted peak (the rule of
pipecc/analysis/memory.py over the byte profile) is within the target of the measured one
(median 2%, worst 5%); ZB-H2's deferred W keeps more than 1F1B, predicted and measured; the
live-storage count is exact on a known step; W frees what I kept. One process group of two
ranks runs every program (tests/runtime/memory_cases.py)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
from memory_cases import run_memory_cases
from pipecc.runtime.engine.split_backward import input_backward
from pipecc.runtime.engine.weight_contract import capturing
from pipecc.runtime.profiling.memory import LiveStorages, byte_keys, storages
from pipecc.runtime.tools.spawn import spawn

from pipecc.analysis.memory import measured_sizes, predict_run
from pipecc.driver.compile import Lowering
from pipecc.driver.load import Request, RunBackend, resolve
from pipecc.ir.program import Program

ROOT = Path(__file__).resolve().parents[2]
PIPECC = str(Path(sys.executable).parent / "pipecc")
CASES = (("1f1b", 4), ("zb_h1", 4), ("zb_h2", 4), ("zbv", 4), ("dualpipe", 4))
# recomputed in full, and the second block of each stage selectively: (name, schedule, M, spec)
RECOMPUTED = (("1f1b-full", "1f1b", 4, "full"), ("zbv-full", "zbv", 4, "full"),
              ("zb_h1-sel", "zb_h1", 4, "name=1"))  # fmt: skip


def _program(name: str, microbatches: int) -> Program:
    """What `pipecc run` runs on gloo at P=2."""
    request = Request(name, 2, microbatches, {}, RunBackend.GLOO, Lowering())
    return resolve(request).program


@pytest.fixture(scope="module")
def runs() -> dict[str, list[tuple[float, float]]]:
    """(predicted, measured) per rank, per schedule."""
    named = [(name, name, m, None) for name, m in CASES] + list(RECOMPUTED)
    programs = [_program(schedule, m) for _, schedule, m, _ in named]
    pairs = [(program, spec) for program, (*_, spec) in zip(programs, named, strict=True)]
    results: list[list[dict[str, Any]]] = spawn(run_memory_cases, 2, pairs, timeout=300)
    found = {}
    for case, (name, *_) in enumerate(named):
        per_rank = [results[rank][case] for rank in range(2)]
        sizes = byte_keys([r["bytes"] for r in per_rank])
        predicted = predict_run(programs[case], measured_sizes(sizes))
        found[name] = [
            (peak.peak, float(r["measured"]))
            for (peak, _), r in zip(predicted, per_rank, strict=True)
        ]
    return found


def test_predicted_within_target_on_a_loop_a_v_shape_and_dualpipe(
    runs: dict[str, list[tuple[float, float]]],
) -> None:
    errors = {name: [abs(p - m) / m for p, m in ranks] for name, ranks in runs.items()}
    every = [e for found in errors.values() for e in found]
    over = {name: found for name, found in errors.items() if max(found) > 0.05}
    assert not over, f"off by more than 5%: {over} (all: {errors})"  # names the case whole
    assert statistics.median(every) <= 0.02, errors


def test_recomputed_stages_predicted_as_measured(
    runs: dict[str, list[tuple[float, float]]],
) -> None:
    """A recomputed stage keeps its forward's output only as the message until its send
    completes (`out_bytes`), not until its backward: counted so, rank 0 of 1F1B and ZB-V is
    predicted within 0.5% (with the output in `act_bytes`, 1F1B's rank 0 was 2.2% above:
    its two microbatches in flight each counted an output it had sent); recomputing
    selected modules is predicted as well as without."""
    for name in ("1f1b-full", "zbv-full", "zb_h1-sel"):
        predicted, measured = runs[name][0]
        assert abs(predicted - measured) <= 0.005 * measured, (name, runs[name])
    for name in ("1f1b-full", "zbv-full"):
        assert runs[name][0][1] < runs[name.split("-")[0]][0][1]  # it does keep less
    assert runs["zb_h1"][0][1] > runs["zb_h1-sel"][0][1] > 0


def test_a_v_shape_local_hand_off_is_counted_once(
    runs: dict[str, list[tuple[float, float]]],
) -> None:
    """ZB-V's rank 1 hands stage 1's output to stage 2 on the same rank: one storage, the
    producer's activation; counted in the consumer's act_bytes too, rank 1 was predicted
    1.3% high (with and without recomputation). Now within 0.1% on both ranks."""
    for name in ("zbv", "zbv-full"):
        for predicted, measured in runs[name]:
            assert abs(predicted - measured) <= 0.001 * measured, (name, runs[name])


def test_deferred_w_keeps_more_than_1f1b_predicted_and_measured(
    runs: dict[str, list[tuple[float, float]]],
) -> None:
    # rank 0: ZB-H2 runs 2P-1 forwards before its first backward, and its W's wait
    (zb_p, zb_m), (one_p, one_m) = runs["zb_h2"][0], runs["1f1b"][0]
    assert zb_p > one_p and zb_m > one_m, (runs["zb_h2"], runs["1f1b"])
    assert zb_m - one_m == pytest.approx(zb_p - one_p, rel=0.25)


def test_live_storages_count_every_storage_exactly() -> None:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    x = torch.randn(16, 64)  # made before: never counted
    live = LiveStorages()
    live.seed(module.parameters())
    params = 2 * (64 * 64 + 64) * 4
    assert live.live == params
    with live:
        y = module(x)
        # saved: the first Linear's output (GELU's input) and GELU's output; and y
        assert live.live == params + 3 * 16 * 64 * 4
        y.sum().backward()
    live.sweep()
    # the gradients and y (its sum is gone); every activation freed
    assert live.live == 2 * params + 16 * 64 * 4
    del y
    live.sweep()
    assert live.live == 2 * params
    assert live.peak > 2 * params


def test_w_frees_what_i_kept_and_leaves_no_graph_on_grad() -> None:
    """Accumulating a Linear's weight gradient into an existing .grad (the second microbatch
    on) must not record a graph: it kept every microbatch's input alive until zero_grad."""
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    params = frozenset(id(p) for p in module.parameters())
    for _ in range(3):
        x = torch.randn(4, 8).requires_grad_(True)
        with capturing(module):
            y = module(x)
        _, weight = input_backward((y,), (torch.ones_like(y),), (x,), params)
        (ref,) = storages((x,)).values()
        del x, y
        weight.run()
        del weight
        assert ref[1].expired(), "W left the microbatch's input alive"
        assert not any(p.grad.requires_grad for p in module.parameters())


def test_run_memory_json_profile_and_memory_budget(tmp_path: Path) -> None:
    costs = tmp_path / "costs.toml"
    result = subprocess.run(
        [PIPECC, "run", "zb_h1", "--nproc", "2", "-M", "4", "--model", "examples/mlp.py",
         "--memory", "--profile", str(costs), "--steps", "2", "--allow-noisy-profile",
         "--optimizer", "sgd", "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
        env=dict(os.environ, PIPECC_MLP_HIDDEN="128"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rows = report["memory"]
    assert [row["rank"] for row in rows] == [0, 1]
    for row in rows:
        assert abs(row["predicted_bytes"] - row["measured_bytes"]) <= 0.05 * row["measured_bytes"]
        assert row["optimizer_bytes"] == 0  # sgd without momentum keeps nothing
    assert report["batch_bytes"] == 2 * (8 * 4) * 128 * 4  # inputs and targets, 32 rows
    tables = tomllib.loads(costs.read_text())["cost"]["stage"]
    for stage in ("0", "1"):
        assert {"act_bytes", "act_bytes_w", "param_bytes", "grad_bytes", "bytes"} <= set(
            tables[stage]
        )
    budget = max(row["predicted_bytes"] for row in rows)

    def verify(size: str) -> int:
        return subprocess.run(
            [PIPECC, "verify", "zb_h1", "-P", "2", "-M", "4", "--backend", "gloo",
             "--cost-file", str(costs), "--memory-budget", size],
            capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
        ).returncode  # fmt: skip

    assert verify(str(int(budget))) == 0
    assert verify(str(int(budget) - 1)) == 1


def test_a_deferred_w_does_not_keep_the_gradient_handed_on() -> None:
    """The Linear contract's saved input (here LayerNorm's output) reaches the stage's input
    leaf through autograd's node for it, so a deferred W keeps the leaf alive; the gradient
    handed on to the previous stage must not stay alive with it, on the leaf's `.grad`,
    once the mailbox lets go of it (it did: one boundary-sized tensor per deferred W that
    the memory rule, rightly, frees at the send's wait)."""
    from types import SimpleNamespace

    from pipecc.runtime.engine.compute import StageOps

    torch.manual_seed(0)
    stage = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 16))
    params = frozenset(id(p) for p in stage.parameters())
    x = torch.randn(4, 16).requires_grad_(True)
    with capturing(stage) as capture:
        y = stage(x)
    (grad,), weight = input_backward((y,), (torch.ones_like(y),), (x,), params, capture)
    ctx = SimpleNamespace(mail=[None])
    StageOps.hand_back(None, ctx, SimpleNamespace(stage=1, dst=0), (x,), (grad,))  # type: ignore[arg-type]
    (ref,) = storages((grad,)).values()
    del grad, x, y
    ctx.mail[0] = None  # the send completed
    assert ref[1].expired(), "the gradient handed on outlived its send"
    weight.run()
