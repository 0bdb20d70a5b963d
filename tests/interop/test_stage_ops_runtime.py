"""pipecc's runtime runs torch's stage actions: no-ops on a stage that is not an FSDP module,
so a torch CSV with UNSHARD/RESHARD/REDUCE_GRAD trains exactly as it does without them
(pipecc already scales each microbatch's loss by 1/M: REDUCE_GRAD does not scale again)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "runtime"))

from csv_mutants import OVERLAPS, merge  # noqa: E402
from runtime_cases import TOLERANCE, Case, run_cases  # noqa: E402

from pipecc.api import compile_schedule  # noqa: E402
from pipecc.interop import torch_csv  # noqa: E402
from pipecc.ir.ops import Sequential, StageOp  # noqa: E402
from pipecc.ir.program import Program  # noqa: E402
from pipecc.passes.insert_comms import insert_comms  # noqa: E402


def load_input_csv(text: str) -> Program:
    """A compute-only CSV lowered with pipecc's default policy, as `pipecc run` loads it."""
    return insert_comms(torch_csv.loads(text).program)


SCHEDULES = ("zb_h1", "zbv", "interleaved_1f1b", "dualpipev")


def test_runtime_runs_csv_with_stage_ops() -> None:
    from pipecc.runtime.tools.spawn import spawn

    cases = []
    for name in SCHEDULES:
        text = torch_csv.dumps(compile_schedule(name, ranks=2, microbatches=4), with_comms=True)
        program = torch_csv.loads(text).program
        assert any(type(i) is StageOp for instrs in program.ranks for i in instrs)
        cases.append(Case(name, program))
    for name in OVERLAPS:  # torch's sequential OVERLAP_F_B, run part by part
        schedule, ranks, microbatches, rank, start, count = OVERLAPS[name]
        text = torch_csv.dumps(compile_schedule(schedule, ranks=ranks, microbatches=microbatches))
        program = load_input_csv(merge(text, rank, start, count))
        assert any(type(i) is Sequential for instrs in program.ranks for i in instrs)
        cases.append(Case(f"overlap-{name}", program))
    results = spawn(run_cases, 2, cases, timeout=60.0)
    for case in cases:
        for rank in range(2):
            result = results[rank][case.name]
            assert "error" not in result, result
            assert result["grad_rel"] <= TOLERANCE, (case.name, rank, result["grad_rel"])
