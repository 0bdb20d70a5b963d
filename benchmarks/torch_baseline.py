"""torch.distributed.pipelining as a baseline for the benchmarks (imports torch lazily).

`torch_lowered` runs torch's schedule generator for every rank and then the lowering its
`_PipelineScheduleRuntime` runs (`_add_unshard_reshard`, `_add_reduce_grad`,
`_add_send_recv`); `torch_simulate` runs `_simulate_comms_compute` on that result. Both build
bare schedule instances (tests/torch_oracle.py), so no process group is needed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

# pipecc schedule -> (torch class, chunks per rank, stage-to-rank style)
TORCH_NAMES = {
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
}


def torch_lowered(name: str, ranks: int, microbatches: int) -> tuple[float, Any, Any, int]:
    """(seconds, lowered per-rank actions, stage_to_rank, number of stages) for pipecc's
    schedule `name` built by torch."""
    from torch.distributed.pipelining import schedules  # noqa: PLC0415  (optional, heavy)
    from torch.distributed.pipelining._utils import (  # noqa: PLC0415
        generate_stage_to_rank_mapping,
    )
    from torch_oracle import bare_schedule  # noqa: PLC0415

    torch_name, chunks, style = TORCH_NAMES[name]
    start = time.perf_counter()
    obj = bare_schedule(torch_name, ranks, microbatches, chunks)
    order = {}
    for rank in range(ranks):
        obj.rank = rank
        order[rank] = obj._calculate_single_rank_operations(rank)
    mapping = generate_stage_to_rank_mapping(ranks, ranks * chunks, style=style)
    lowered = {
        rank: schedules._add_reduce_grad(schedules._add_unshard_reshard(actions), microbatches)
        for rank, actions in order.items()
    }
    lowered = schedules._add_send_recv(
        lowered, stage_to_rank=lambda s: mapping[s], num_stages=ranks * chunks
    )
    return time.perf_counter() - start, lowered, mapping, ranks * chunks


# schedules torch_simulate cannot replay, with the reason the benchmarks print
TORCH_CANNOT = {"dualpipev": "torch's _simulate_comms_compute cannot replay OVERLAP_F_B"}


def torch_simulate(lowered: Any, mapping: Any, num_stages: int) -> tuple[float, int]:
    """(seconds, simulated steps) of torch's `_simulate_comms_compute` (unit steps, eager
    sends); UNSHARD/RESHARD/REDUCE_GRAD actions, which it rejects, are dropped first."""
    from torch.distributed.pipelining import schedules  # noqa: PLC0415

    keep = {"F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}
    plain = {
        rank: [a for a in actions if a is not None and a.computation_type.value in keep]
        for rank, actions in lowered.items()
    }
    start = time.perf_counter()
    simulated = schedules._simulate_comms_compute(plain, lambda s: mapping[s], num_stages)
    steps = max(len(actions) for actions in simulated.values())
    return time.perf_counter() - start, steps
