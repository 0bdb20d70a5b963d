"""Mesh cases run inside one spawned process group of 4 (gloo): a pipeline of 2 times 2
data-parallel replicas, `init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp",
"dp_replicate"))`, the GPT of examples/gpt.py with tied embeddings.

Each case compiles a schedule with the tie's sum and the replicas' reductions
(`--shared 0+S --mesh dp_replicate=2`), gives each replica its contiguous share of the global
batch, and compares every gradient of this rank's stages and the global loss with one process
training the whole batch; training cases take 3 AdamW steps with clipping on both sides.
Functions here run in the spawned processes: keep them importable and picklable.
"""

from __future__ import annotations

from typing import Any

import torch
from gpt_cases import ROWS, _gpt, _worst, build, config, loss_fn
from pipecc.runtime import PipelineRuntime, RuntimeConfig, infer_boundaries, shared_parameters
from pipecc.runtime.tools.reference import Options, gradients, reference_step
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from pipecc.diagnostics import PipeccError
from pipecc.ir.program import Program

REPLICAS = 2
OPTIONS = Options(seed=3)
# Adam divides by sqrt(v) + eps: a gradient that is zero but for rounding (1e-9 here) gets a
# step of either sign; the replicas add their halves in another order than one process adds
# the whole batch, so such noise differs, and an eps far above it (real gradients are
# above 1e-3) keeps it from moving the weights (gpt_cases.py uses 1e-6 for one pipeline)
EPS = 1e-4


def _share(batch: tuple[torch.Tensor, torch.Tensor], replica: int) -> tuple[Any, Any]:
    """Replica `replica`'s contiguous share of the global batch."""
    rows = batch[0].shape[0] // REPLICAS
    return batch[0][replica * rows : (replica + 1) * rows], batch[1][
        replica * rows : (replica + 1) * rows
    ]


def _global_batch(program: Program, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = ROWS * program.num_microbatches * REPLICAS
    batch: tuple[torch.Tensor, torch.Tensor] = _gpt().make_batch(
        rows, seed=step, config=config("tied")
    )
    return batch


def run_mesh_cases(rank: int, world: int, cases: list[tuple[str, Program, bool]]) -> dict[str, Any]:
    """Every case on this rank (global rank `rank` of 4); per case what the tests assert."""
    mesh = init_device_mesh(
        "cpu", (world // REPLICAS, REPLICAS), mesh_dim_names=("pp", "dp_replicate")
    )
    results: dict[str, Any] = {}
    for name, program, train in cases:
        try:
            run = _train if train else _check
            results[name] = run(rank, mesh, program)
        except PipeccError as err:
            results[name] = {"error": type(err).__name__, "message": str(err)}
    return results


def _runtime(mesh: Any, program: Program, stages: list[nn.Module]) -> PipelineRuntime:
    cfg = RuntimeConfig(shared=shared_parameters(stages), seed=OPTIONS.seed, mesh=mesh)
    runtime_rank = mesh.get_coordinate()[0]
    modules = {s.chunk: stages[s.stage] for s in program.placement.chunks(runtime_rank)}
    return PipelineRuntime(
        program, modules, lambda sample: infer_boundaries(stages, sample), loss_fn=loss_fn,
        config=cfg,
    )  # fmt: skip


def _check(rank: int, mesh: Any, program: Program) -> dict[str, Any]:
    stages = build("tied", program.placement.num_stages(0))
    reference = build("tied", program.placement.num_stages(0))
    runtime = _runtime(mesh, program, stages)
    held = {slot.stage for slot in program.placement.chunks(runtime.rank)}
    data = _global_batch(program, 0)
    runtime.step(*_share(data, mesh.get_coordinate()[1]))
    want_loss, want = reference_step(reference, data, program.num_microbatches * REPLICAS,
                                     loss_fn, OPTIONS)  # fmt: skip
    loss = float(runtime.global_loss())
    return {"grad_rel": _worst(gradients(stages), want, held), "loss": (loss, want_loss)}


def _train(rank: int, mesh: Any, program: Program) -> dict[str, Any]:
    stages = build("tied", program.placement.num_stages(0))
    single = build("tied", program.placement.num_stages(0))
    runtime = _runtime(mesh, program, stages)
    optimizer = torch.optim.AdamW(runtime.parameters(), lr=1e-2, eps=EPS)
    params = list({id(p): p for s in single for p in s.parameters()}.values())
    reference_optimizer = torch.optim.AdamW(params, lr=1e-2, eps=EPS)
    losses, norms = [], []
    for step in range(3):
        data = _global_batch(program, step)
        optimizer.zero_grad(set_to_none=True)
        runtime.step(*_share(data, mesh.get_coordinate()[1]))
        norm = runtime.clip_grad_norm_(0.5)
        optimizer.step()
        want_loss, _ = reference_step(single, data, program.num_microbatches * REPLICAS, loss_fn,
                                      OPTIONS._replace(step=step))  # fmt: skip
        want_norm = nn.utils.clip_grad_norm_(params, 0.5)
        reference_optimizer.step()
        losses.append((float(runtime.global_loss()), want_loss))
        norms.append((float(norm), float(want_norm)))
    held = {slot.stage for slot in program.placement.chunks(runtime.rank)}
    got = {(i, n): p.detach() for i, s in enumerate(stages) for n, p in s.named_parameters()}
    want = {(i, n): p.detach() for i, s in enumerate(single) for n, p in s.named_parameters()}
    worst = {k: _worst({k: got[k]}, {k: want[k]}, held) for k in want if k[0] in held}
    return {"weight_rel": _worst(got, want, held), "losses": losses, "norms": norms,
            "worst": sorted(worst.items(), key=lambda kv: -kv[1])[:3]}  # fmt: skip
