"""How a runtime fits into the job: its process group, rank map and options."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipecc.diagnostics import InputError

LossFn = Callable[[Any, Any], torch.Tensor]


def mse_loss(output: Any, target: Any) -> torch.Tensor:
    """The default loss: mean squared error (of floating targets)."""
    if isinstance(target, torch.Tensor) and not target.dtype.is_floating_point:
        raise InputError(
            f"the targets are {str(target.dtype).removeprefix('torch.')}, but no loss_fn was "
            "given and the default, mean squared error, needs floating targets: pass "
            "loss_fn (in a model file: define loss_fn(output, target))"
        )
    return torch.nn.functional.mse_loss(output, target)


@dataclass(frozen=True)
class RuntimeConfig:
    """How the runtime fits into the job (docs/runtime.md has the table).

    `group`: the pipeline's process group (default: the whole world). `rank_map[r]`: the
    global rank of pipeline rank r (default: the group's ranks in order). `shared`: groups of
    (stage, parameter name) that are one parameter (tied weights; `shared_parameters(stages)`
    finds them). `sync_duplicated`: sum the gradients of every parameter held by several
    ranks (duplicated stages, shared parameters), at the program's gradient-sum collectives
    (and after the program for one that holds none: outside the verified program).
    `sums_in_program`: refuse, when the runtime is built, a program that does not place
    every such sum across ranks, even one that places none (`pipecc run` sets it: no step
    exchanges anything the verifier did not see; runtime/comm/shared.py). `timeout`: seconds a
    `wait` may block (gloo; NCCL relies on the process group's own timeout). `check_shapes`:
    compare the boundaries given to the runtime, if any, with those found on real data.
    `seed`, `derive_rng`: each forward of (stage, microbatch) runs under an RNG state
    derived from (seed, step, stage, microbatch). `autocast`: run forwards under
    `torch.autocast` with this dtype.
    `fp32_grads`: accumulate the gradients of low-precision parameters in fp32.
    `static_shapes`: the inputs' shapes never change after the first step, so a rank may
    be given no inputs (it keeps the first step's signature); a change is an error.
    `mesh`: a `DeviceMesh` the runtime lives on; the pipeline's group and rank map then come
    from its `pp_dim` dimension (`group` and `rank_map` are not given), and the program's
    collectives over mesh dimensions run over its groups (runtime/comm/mesh.py).
    `plans_kept`: how many signatures keep their bound plans (and so their receive buffers)
    at once; the least recently used beyond it is let go and bound again, locally, if its
    shapes come back (variable-length batches would otherwise hold a set of buffers for
    every length ever seen).
    `recompute`: "full" (every stage), "none", or {stage: "full" | "none"}: a recomputed
    stage's forward keeps only its input and runs again, with its graph, before its
    backward (runtime/engine/recompute.py).
    `check_finite`: every loss of a step (the main loss, each `add_loss`) and the gradient
    norm of `clip_grad_norm_` must be finite, else `NonFiniteError` names the rank, the
    step, the stage and the microbatch (one host read per step; runtime/engine/watch.py).
    `gloo_poster_thread`: on gloo, post every send and receive from one poster thread, in
    program order, instead of the calling thread (`pipecc run`: `PIPECC_POST_THREAD=1`).
    `gloo_direction_groups`: on gloo, a pipeline's messages to a lower rank go over a second
    gloo group of its ranks, so each socket carries data one way (`pipecc run`:
    `PIPECC_GLOO_DIRECTIONS=0` turns it off). Neither applies on NCCL, where every post goes
    through `batch_isend_irecv` on the group's communicator (runtime/comm/channel.py).
    """

    group: dist.ProcessGroup | None = None
    rank_map: Sequence[int] | None = None
    shared: Sequence[Sequence[tuple[int, str]]] = ()
    sync_duplicated: bool = True
    sums_in_program: bool = False
    timeout: float = 300.0
    device: torch.device | None = None
    check_shapes: bool = True
    seed: int = 0
    derive_rng: bool = True
    autocast: torch.dtype | None = None
    fp32_grads: bool = False
    static_shapes: bool = False
    mesh: Any = None  # a torch DeviceMesh (docs/parallelism.md)
    pp_dim: str = "pp"
    plans_kept: int = 4
    recompute: str | Mapping[int, str] | None = None
    check_finite: bool = False
    gloo_poster_thread: bool = False
    gloo_direction_groups: bool = True
