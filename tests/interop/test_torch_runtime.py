"""Every export torch can run trains correctly in torch's own `_PipelineScheduleRuntime`.

For each bundled schedule torch can express (every one but dualpipe, whose two pipes torch
cannot hold), both CSV forms (`torch-csv`, lowered by torch on load; `torch-csv-comms`,
loaded as written), at P=2 and P=4 with M=8: one step on gloo, the loss equal to a
single-process reference's and max_rel_grad_diff (DESIGN §7: the largest |a - b| over all
parameters over the largest |b|) at most 1e-5. torch scales gradients by 1/M only in its
REDUCE_GRAD action, so a comms export without one trains with every gradient M times too
large. Two process groups (2 and 4 ranks) run all their cases in one go.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

pytest.importorskip("torch.distributed.pipelining")

from torch_runtime_cases import TorchCase, run_cases  # noqa: E402

from pipecc.api import bundled_schedules, compile_schedule  # noqa: E402
from pipecc.interop import torch_csv  # noqa: E402

MICROBATCHES = 8
TOLERANCE = 1e-5
SCHEDULES = tuple(name for name in bundled_schedules() if name != "dualpipe")
FORMATS = ("torch-csv", "torch-csv-comms")
TORCH_FORMAT = {"torch-csv": "compute_only", "torch-csv-comms": "compute_comms"}


def export(schedule: str, ranks: int, form: str) -> TorchCase:
    program = compile_schedule(schedule, ranks=ranks, microbatches=MICROBATCHES)
    text = torch_csv.dumps(program, with_comms=form == "torch-csv-comms")
    return TorchCase(
        f"{schedule}-P{ranks}-{form}",
        text,
        TORCH_FORMAT[form],
        MICROBATCHES,
        program.placement.num_stages(0),
    )


@functools.cache
def results(ranks: int) -> list[dict[str, dict[str, Any]]]:
    from pipecc.runtime.spawn import spawn

    cases = [export(s, ranks, form) for s in SCHEDULES for form in FORMATS]
    return spawn(run_cases, ranks, cases, timeout=60.0)


def test_nine_schedules() -> None:
    assert len(SCHEDULES) == 9


@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_trains_in_torch_runtime(schedule: str, ranks: int, form: str) -> None:
    name = f"{schedule}-P{ranks}-{form}"
    per_rank = [by_case[name] for by_case in results(ranks)]
    errors = [r["error"] for r in per_rank if "error" in r]
    assert not errors, errors
    diff = max(r["diff"] for r in per_rank)
    scale = max(r["scale"] for r in per_rank)
    assert diff / scale <= TOLERANCE, f"max_rel_grad_diff {diff / scale:.3g} (ratio to ref)"
    losses = [r for r in per_rank if r["loss"] is not None]
    assert losses, "no rank reported the losses"
    for r in losses:
        assert r["loss"] == pytest.approx(r["want_loss"], rel=1e-6, abs=1e-7)
