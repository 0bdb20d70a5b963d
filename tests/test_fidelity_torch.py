"""The bundled schedules equal torch.distributed.pipelining's generators, op for op.

For every size torch accepts on the grid P ∈ 2..8, M ∈ {P, 2P, 4P, odd counts}, the per-rank
compute order (kind, stage, microbatch, fused pairs) must be identical.
"""

from __future__ import annotations

import pytest
from helpers import compile_bundled, compute_order
from torch_oracle import torch_accepts, torch_order

from pipecc.diagnostics import ScheduleError


def _grid(odd: bool = True) -> list[tuple[int, int]]:
    sizes = []
    for ranks in range(2, 9):
        counts = {1, ranks - 1, ranks, 2 * ranks, 4 * ranks}
        if odd:
            counts |= {2 * ranks - 1, 2 * ranks + 1, 3 * ranks + 1}
        sizes.extend((ranks, m) for m in sorted(counts) if m >= 1)
    return sizes


CASES = [
    ("gpipe", "ScheduleGPipe", 1),
    ("looped_bfs", "ScheduleLoopedBFS", 2),
    ("looped_bfs", "ScheduleLoopedBFS", 3),
    ("interleaved_1f1b", "ScheduleInterleaved1F1B", 2),
    ("interleaved_1f1b", "ScheduleInterleaved1F1B", 3),
    ("interleaved_zb", "ScheduleInterleavedZeroBubble", 2),
    ("interleaved_zb", "ScheduleInterleavedZeroBubble", 3),
    ("zbv", "ScheduleZBVZeroBubble", 2),
    ("dualpipev", "ScheduleDualPipeV", 2),
]


@pytest.mark.parametrize(("schedule", "torch_name", "chunks"), CASES)
def test_matches_torch_generator(schedule: str, torch_name: str, chunks: int) -> None:
    checked = 0
    for ranks, microbatches in _grid():
        if not torch_accepts(torch_name, ranks, microbatches, chunks):
            continue
        defines = (
            {"V": chunks}
            if schedule in ("looped_bfs", "interleaved_1f1b", "interleaved_zb")
            else {}
        )
        try:
            program = compile_bundled(schedule, ranks, microbatches, **defines)
        except ScheduleError as err:
            pytest.fail(f"P={ranks} M={microbatches}: torch accepts, pipecc rejects: {err}")
        expected = torch_order(torch_name, ranks, microbatches, chunks)
        got = compute_order(program)
        for rank in range(ranks):
            assert got[rank] == expected[rank], (
                f"{schedule} P={ranks} M={microbatches} rank {rank}:\n"
                f"  pipecc {got[rank]}\n  torch  {expected[rank]}"
            )
        checked += 1
    assert checked >= 20
