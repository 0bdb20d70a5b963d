"""torch.distributed.pipelining's schedule generators, used as a test oracle.

The generators are methods of the schedule classes; they need only a few attributes, so the
oracle builds bare instances (no process group, no stages) and calls them for every rank.
Orders are normalised to tuples: ("F", stage, mb), and ("OVERLAP", (...), (...)) for a fused
pair, with idle slots, UNSHARD/RESHARD and REDUCE_GRAD left out.
"""

from __future__ import annotations

from typing import Any

try:
    import pytest

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
except ImportError:  # used from benchmarks/, outside pytest
    from torch.distributed.pipelining import schedules

Order = list[list[tuple[Any, ...]]]
_COMPUTE = {"F", "B", "I", "W"}


def _normalise(action: Any) -> tuple[Any, ...] | None:
    if action is None:
        return None
    kind = action.computation_type.value
    if action.sub_actions is not None:
        forward, backward = (_normalise(sub) for sub in action.sub_actions)
        return ("OVERLAP", forward, backward)
    if kind not in _COMPUTE:
        return None
    return (kind, action.stage_index, action.microbatch_index)


def bare_schedule(name: str, ranks: int, microbatches: int, chunks: int) -> Any:
    """An instance of torch's schedule class `name` with just what its generators read."""
    cls = getattr(schedules, name)
    obj = object.__new__(cls)
    obj.pp_group_size = ranks
    obj._n_microbatches = microbatches
    obj.n_local_stages = chunks
    obj._stages = [None] * chunks
    obj._num_stages = ranks * chunks
    obj.num_stages = ranks * chunks
    obj.number_of_rounds = max(1, microbatches // ranks)
    obj.microbatches_per_round = microbatches // obj.number_of_rounds
    return obj


def torch_order(name: str, ranks: int, microbatches: int, chunks: int = 1) -> Order:
    """The per-rank compute order torch's generator `name` produces."""
    if name == "ScheduleGPipe":
        obj = bare_schedule(name, ranks, microbatches, 1)
        raw = obj._get_pipeline_order()
        per_rank = [raw[rank] for rank in range(ranks)]
    else:
        obj = bare_schedule(name, ranks, microbatches, chunks)
        per_rank = []
        for rank in range(ranks):
            obj.rank = rank
            per_rank.append(obj._calculate_single_rank_operations(rank))
    return [[a for a in map(_normalise, actions) if a is not None] for actions in per_rank]


def torch_accepts(name: str, ranks: int, microbatches: int, chunks: int = 1) -> bool:
    """Whether torch's schedule class accepts these sizes (the checks its __init__ makes)."""
    rounds = max(1, microbatches // ranks)
    if name in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        return microbatches % rounds == 0
    if name == "ScheduleDualPipeV":
        return microbatches >= 2 * ranks
    return True
