"""Boundaries found along the pipeline, on real data, each rank running only its own stages.

When a step brings an input signature that no step had before, every rank of the pipeline
runs this pass together, before the program (runtime/pipeline.py):

1. **Agreement** (`agree_signature`): one gather of a short text per rank over the pipeline
   group: the signature this rank computed from its inputs (none under `static_shapes`
   without inputs) and its set-up problems (a module missing, a batch that cannot be
   split). Problems, or ranks whose signatures differ, raise the same `SetupError` on
   every rank; a rank that does not come (it saw a signature it knows) times the others
   out with a `RankError` that says so.
2. **Along the pipeline** (`along_pipeline`): stage by stage in pipe 0's order (DualPipe's
   pipe 1 has the same stages, so the same boundaries), the rank holding stage s in pipe 0
   runs its real module on the real value it holds (stage 0: the step's microbatch 0;
   otherwise what the previous stage's holder sent it) under the same derived RNG state and
   autocast as the real forward, with no side effect (runtime/boundaries/specs.py
   `run_stage`: buffers copied, RNG restored, graph dropped, which outputs require a
   gradient observed). The output's description goes to every rank in one gather (so every
   rank learns every boundary, and a stage that fails stops every rank alike), the tensors
   point to point to the holder of s+1 (kept locally when that is the same rank).

So the boundaries are those of the real forward, whatever branch the model takes on real
data (a mask helper that returns None, an autocast region inside a stage, data-dependent
routing), and the shape check of a new signature holds by construction. It costs one
forward of each stage on one microbatch and 2 + 2·S small gathers, once per signature.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from pipecc.diagnostics import InputError, RankError, SetupError
from pipecc.ir.program import Program

from ..comm.agreement import ExchangeTimeout, finish, gather_texts
from ..config import RuntimeConfig
from .context import describe_signature
from .fingerprint import Fingerprint, program_problem
from .placed import local, mesh_problem
from .signatures import Signature, signature_from_text
from .specs import OutputNotTree, StageRun, as_received, run_stage
from .trees import Boundary

__all__ = ["pipeline_boundaries"]


class StageFailed(RankError):
    """A stage's forward failed on this rank during the discovery pass; its cause is the
    user's exception (the other ranks raise a `SetupError` with the same message)."""


@dataclass(frozen=True)
class Exchange:
    """Who takes part in a discovery and how they are reached."""

    group: dist.ProcessGroup | None
    rank_map: tuple[int, ...]  # pipeline rank -> global rank
    rank: int  # this rank, in the pipeline
    device: torch.device
    timeout: float | None  # seconds the agreement may wait for a rank (gloo); None: no limit
    mesh: Any = None  # the runtime's device mesh, over which DTensor boundaries are rebuilt

    def texts(self, text: str) -> list[str]:
        """Every rank's `text`, by pipeline rank (the group orders them by its own ranks,
        which a rank map may permute), within the exchange's timeout (gloo)."""
        found = gather_texts(
            text, self.group, len(self.rank_map), self.device, timeout=self.timeout
        )
        return [found[self._group_rank(g)] for g in self.rank_map]

    def _group_rank(self, global_rank: int) -> int:
        if self.group is None:
            return global_rank
        return dist.get_group_rank(self.group, global_rank)


@dataclass(frozen=True)
class PipeStages:
    """Pipe 0's stages: which rank holds each, and this rank's modules of them."""

    holders: tuple[int, ...]  # stage -> pipeline rank
    mine: Mapping[int, torch.nn.Module]  # stage -> module, the stages this rank holds

    @classmethod
    def of(cls, program: Program, rank: int, modules: Mapping[int, torch.nn.Module]) -> PipeStages:
        placement = program.placement
        holders = {}
        for holder in range(program.num_ranks):
            for slot in placement.chunks(holder):
                if slot.pipe == 0:
                    holders[slot.stage] = holder
        mine = {
            slot.stage: modules[slot.chunk]
            for slot in placement.chunks(rank)
            if slot.pipe == 0 and slot.chunk in modules
        }
        return cls(tuple(holders[s] for s in range(len(holders))), mine)


@dataclass(frozen=True)
class Forward:
    """How a discovery forward runs: as the real forward of microbatch 0 does."""

    autocast: torch.dtype | None
    seed: Callable[[int], int | None]  # stage -> the derived seed of (step, stage, mb 0)
    where: str  # "rank r, step t", for errors


def agree_program(exchange: Exchange, program: Fingerprint) -> None:
    """Every rank's program and stage cut compared in one gather, when the runtime is built
    and before it makes any process group of the program's (a gradient sum's holders): ranks
    given different programs stop together with the same `SetupError` instead of waiting
    in a group only some of them create (runtime/boundaries/fingerprint.py)."""
    me, world = dist.get_rank(), dist.get_world_size(exchange.group)
    if me not in exchange.rank_map or len(set(exchange.rank_map)) != world:
        return  # not one of the pipeline's ranks: its runtime says so at its first step
    exchange = replace(exchange, rank=exchange.rank_map.index(me))
    where = f"rank {exchange.rank}, set-up"
    try:
        texts = exchange.texts(json.dumps({"program": program.as_json()}))
    except ExchangeTimeout as err:
        raise RankError(
            f"{where}: the comparison of the ranks' programs did not complete within "
            f"{exchange.timeout:g} s ({err}): a rank of the pipeline did not build its runtime"
        ) from err
    different = program_problem([json.loads(text) for text in texts], exchange.rank)
    if different is not None:
        raise SetupError(f"the pipeline cannot start: {where}: {different}")


def agree_signature(
    exchange: Exchange,
    signature: Signature | None,
    problems: list[str],
    forward: Forward,
) -> Signature:
    """The step's signature, the same on every rank, or the same `SetupError` on every rank
    (module docs, step 1). The ranks' programs were compared when their runtimes were built
    (`agree_program`)."""
    mine = {
        "signature": None if signature is None else signature.text(),
        "problems": [f"rank {exchange.rank}: {text}" for text in problems],
        "where": forward.where,
    }
    try:
        texts = exchange.texts(json.dumps(mine))
    except ExchangeTimeout as err:
        raise RankError(
            f"{forward.where}: the discovery of a new input signature did not complete "
            f"within {exchange.timeout:g} s ({err}): a rank did not join it. Every rank must "
            "be given the step's inputs, of the same shapes: a rank whose inputs have a "
            "signature it knows, or that has none under static_shapes, runs the step "
            "without a discovery"
        ) from err
    replies = [json.loads(text) for text in texts]
    lines = [line for reply in replies for line in reply["problems"]]
    if lines:
        raise SetupError("the pipeline cannot start:\n  " + "\n  ".join(lines))
    return _common(replies)


def _common(replies: list[dict[str, object]]) -> Signature:
    seen = {rank: r["signature"] for rank, r in enumerate(replies) if r["signature"] is not None}
    if not seen:
        raise SetupError("the pipeline cannot start: no rank was given the step's inputs")
    if len(set(seen.values())) > 1:
        lines = [
            f"{replies[rank]['where']}: {describe_signature(str(text))}"
            for rank, text in seen.items()
        ]
        raise SetupError(
            "the pipeline cannot start: the ranks were given inputs of different shapes "
            "(one microbatch each):\n  " + "\n  ".join(lines)
        )
    return signature_from_text(str(next(iter(seen.values()))))


def along_pipeline(
    exchange: Exchange,
    stages: PipeStages,
    first: object | None,
    signature: Signature,
    forward: Forward,
) -> dict[int, Boundary]:
    """Every stage's input boundary (module docs, step 2). `first`: the step's microbatch 0
    on the rank holding stage 0 of pipe 0 (None elsewhere). Every rank calls it alike."""
    found = {0: signature.boundary}
    value = first
    for stage, holder in enumerate(stages.holders):
        run: StageRun | Exception | None = None
        if holder == exchange.rank:
            run = _run(stages.mine[stage], value, exchange.device, forward, stage)
        last = stage == len(stages.holders) - 1
        reply = json.loads(exchange.texts(_reply(run, stage, forward, last=last))[holder])
        if "error" in reply:
            _fail(str(reply["error"]), run)
        if "end" in reply:  # the model's output is no pytree: only loss_fn reads it
            break
        boundary = Boundary.from_text(str(reply["boundary"]))
        _rebuildable(boundary, exchange.mesh, stage, forward)  # on every rank alike
        found[stage + 1] = boundary
        if stage + 1 < len(stages.holders):
            tensors = run.tensors if isinstance(run, StageRun) else ()
            value = _hand_on(exchange, (holder, stages.holders[stage + 1]), tensors, boundary)
    return found


def _rebuildable(boundary: Boundary, mesh: Any, stage: int, forward: Forward) -> None:
    """Every rank stops alike before the first step when a DTensor leaf of stage `stage`'s
    output cannot be rebuilt over the runtime's mesh (runtime/boundaries/placed.py)."""
    for at, spec in enumerate(boundary.tensors):
        problem = None if spec.placed is None else mesh_problem(spec.placed, mesh)
        if problem is not None:
            raise SetupError(
                f"the pipeline cannot start: {forward.where}: tensor {at} of stage "
                f"{stage}'s output {problem}"
            )


def _run(
    module: torch.nn.Module, value: object, device: torch.device, forward: Forward, stage: int
) -> StageRun | Exception:
    try:
        return run_stage(module, value, device, autocast=forward.autocast, seed=forward.seed(stage))
    except Exception as err:  # reported to every rank, then raised (`_fail`)
        return err


def _reply(run: StageRun | Exception | None, stage: int, forward: Forward, *, last: bool) -> str:
    """The holder's reply for one stage: its output boundary, the end (the last stage's
    output is no pytree of tensors), or the failure; "" on the other ranks."""
    if run is None:
        return ""
    if isinstance(run, StageRun):
        return json.dumps({"boundary": run.boundary.text()})
    if last and isinstance(run, OutputNotTree):
        return json.dumps({"end": True})
    text = run.message if isinstance(run, InputError) else f"{type(run).__name__}: {run}"
    return json.dumps(
        {
            "error": f"{forward.where}: stage {stage}'s forward on microbatch 0 failed "
            f"(discovering the boundaries of a new input signature): {text}"
        }
    )


def _fail(message: str, run: StageRun | Exception | None) -> None:
    """Every rank stops: the stage's holder with the user's exception as the cause."""
    if isinstance(run, Exception):
        raise StageFailed(message) from run
    raise SetupError(f"the pipeline cannot start: {message}")


def _hand_on(
    exchange: Exchange,
    ranks: tuple[int, int],
    tensors: tuple[torch.Tensor, ...],
    boundary: Boundary,
) -> object | None:
    """Stage s+1's input on its holder: kept when the holder of s is the same rank, else
    sent point to point (nothing on the other ranks)."""
    source, target = ranks
    me = exchange.rank
    if me == source == target:
        return as_received(boundary, tensors, exchange.mesh)
    if me == source:
        for tensor in tensors:  # a DTensor's local shard (runtime/boundaries/placed.py)
            sent = local(tensor).contiguous()
            work = dist.isend(sent, exchange.rank_map[target], group=exchange.group)
            finish(work, exchange.timeout)
    if me != target:
        return None
    received = tuple(
        torch.empty(spec.shape, dtype=spec.dtype, device=exchange.device)
        for spec in boundary.tensors
    )
    for tensor in received:
        work = dist.irecv(tensor, exchange.rank_map[source], group=exchange.group)
        finish(work, exchange.timeout)
    return as_received(boundary, received, exchange.mesh)


def pipeline_boundaries(
    program: Program, modules: Mapping[int, torch.nn.Module], config: RuntimeConfig | None = None
) -> None:
    """The runtime's own discovery (module docs), which `boundaries=None` selects: kept so
    that code written for earlier versions, `PipelineRuntime(program, modules,
    pipeline_boundaries(program, modules, config))`, runs unchanged."""
    del program, modules, config
    return None
