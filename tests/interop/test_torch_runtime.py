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

from csv_mutants import OVERLAPS, merge, mutated, reduce_first  # noqa: E402
from torch_runtime_cases import TorchCase, run_cases  # noqa: E402

from pipecc.api import bundled_schedules, compile_schedule  # noqa: E402
from pipecc.interop import torch_csv  # noqa: E402
from pipecc.verify import verify  # noqa: E402

MICROBATCHES = 8
TOLERANCE = 1e-5
SCHEDULES = tuple(name for name in bundled_schedules() if name != "dualpipe")
FORMATS = ("torch-csv", "torch-csv-comms")
TORCH_FORMAT = {
    "torch-csv": "compute_only",
    "torch-csv-comms": "compute_comms",
    "torch-csv-defer": "compute_only",  # loaded with defer_pp_recv=True
}


def export(schedule: str, ranks: int, form: str) -> TorchCase:
    program = compile_schedule(schedule, ranks=ranks, microbatches=MICROBATCHES)
    text = torch_csv.dumps(program, with_comms=form != "torch-csv")
    defer = form == "torch-csv-defer"
    return TorchCase(
        f"{schedule}-P{ranks}-{form}",
        text if form != "torch-csv-defer" else torch_csv.dumps(program),
        TORCH_FORMAT[form],
        MICROBATCHES,
        program.placement.num_stages(0),
        defer,
    )


MUTANT_SCHEDULES = ("zb_h1", "zbv", "interleaved_1f1b")


def mutant(schedule: str, ranks: int) -> TorchCase:
    """The comms export with the last rank's first REDUCE_GRAD before its stage's last
    backward: verify reports it (reduce-grad), and torch trains it wrong."""
    case = export(schedule, ranks, "torch-csv-comms")
    text = mutated(case.csv_text, ranks - 1, reduce_first)
    return case._replace(name=f"{schedule}-P{ranks}-reduce-early", csv_text=text)


def overlap_case(name: str) -> TorchCase:
    """A compute-only export with some of a rank's cells merged into one OVERLAP_F_B (W;F,
    I;W;F, B;F), which torch runs one after another: written back by pipecc unchanged."""
    schedule, ranks, microbatches, rank, start, count = OVERLAPS[name]
    program = compile_schedule(schedule, ranks=ranks, microbatches=microbatches)
    merged = merge(torch_csv.dumps(program), rank, start, count)
    written = torch_csv.dumps(torch_csv.loads(merged).program)
    assert written == merged
    stages = program.placement.num_stages(0)
    return TorchCase(f"overlap-{name}", written, "compute_only", microbatches, stages)


# Other sizes, in both CSV forms: M not a multiple of P, M < P, three chunks per rank, and
# B unsplit (gpipe, 1f1b, interleaved_1f1b) next to I+W (schedule, P, M, -D)
SIZES = [
    ("1f1b", 2, 1, {}), ("zb_h1", 2, 3, {}), ("interleaved_1f1b", 2, 3, {"V": 3}),
    ("interleaved_zb", 2, 2, {"V": 3}), ("zbv", 2, 5, {}), ("gpipe", 4, 2, {}),
    ("1f1b", 4, 3, {}), ("looped_bfs", 4, 2, {"V": 3}), ("zb_h2", 4, 7, {}),
    ("dualpipev", 4, 9, {}),
]  # fmt: skip


def sized(
    schedule: str, ranks: int, microbatches: int, defines: dict[str, int], form: str
) -> TorchCase:
    program = compile_schedule(schedule, ranks=ranks, microbatches=microbatches, defines=defines)
    return TorchCase(
        f"{schedule}{defines.get('V', '')}-P{ranks}-M{microbatches}-{form}",
        torch_csv.dumps(program, with_comms=form != "torch-csv"),
        TORCH_FORMAT[form],
        microbatches,
        program.placement.num_stages(0),
    )


@functools.cache
def results(ranks: int) -> list[dict[str, dict[str, Any]]]:
    from pipecc.runtime.tools.spawn import spawn

    cases = [export(s, ranks, form) for s in SCHEDULES for form in TORCH_FORMAT]
    cases += [mutant(s, ranks) for s in MUTANT_SCHEDULES]
    cases += [overlap_case(name) for name in OVERLAPS if OVERLAPS[name][1] == ranks]
    cases += [sized(*size, form) for size in SIZES if size[1] == ranks for form in FORMATS]
    return spawn(run_cases, ranks, cases, timeout=60.0)


def _outcome(schedule: str, ranks: int, form: str) -> tuple[list[str], float]:
    per_rank = [by_case[f"{schedule}-P{ranks}-{form}"] for by_case in results(ranks)]
    errors = [r["error"] for r in per_rank if "error" in r]
    if errors:
        return errors, float("inf")
    return [], max(r["diff"] for r in per_rank) / max(r["scale"] for r in per_rank)


def test_every_bundled_schedule_but_dualpipe() -> None:
    """Torch's runtime runs one pipe: every bundled schedule but DualPipe's two."""
    assert len(SCHEDULES) == 11 and "v_half" in SCHEDULES and "v_min" in SCHEDULES


@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_trains_in_torch_runtime(schedule: str, ranks: int, form: str) -> None:
    errors, relative = _outcome(schedule, ranks, form)
    assert not errors, errors
    assert relative <= TOLERANCE, f"max_rel_grad_diff {relative:.3g}"
    per_rank = [by_case[f"{schedule}-P{ranks}-{form}"] for by_case in results(ranks)]
    losses = [r for r in per_rank if r["loss"] is not None]
    assert losses, "no rank reported the losses"
    for r in losses:
        assert r["loss"] == pytest.approx(r["want_loss"], rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_torch_defer_on_gloo_is_what_verify_predicts(schedule: str, ranks: int) -> None:
    """With defer_pp_recv=True torch trains the compute-only export correctly on gloo
    exactly when `verify --lowering torch-defer --comm rendezvous` finds no mismatch (gloo
    progresses every posted op: no deadlock there, only swapped messages)."""
    from pipecc.passes.insert_comms import strip_comms
    from pipecc.passes.torch_program import lower_as_torch
    from pipecc.semantics import CommModel
    from pipecc.verify import Options

    program = compile_schedule(schedule, ranks=ranks, microbatches=MICROBATCHES)
    lowered = lower_as_torch(strip_comms(program), defer=True)
    report = verify(lowered, Options(models=(CommModel.RENDEZVOUS,)))
    mismatched = any(v.code == "mismatch" for v in report.violations)
    errors, relative = _outcome(schedule, ranks, "torch-csv-defer")
    assert not errors, errors
    assert (relative > TOLERANCE) == mismatched, (
        f"verify: {'mismatch' if mismatched else 'ok'}; torch: max_rel_grad_diff {relative:.3g}"
    )


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("schedule", MUTANT_SCHEDULES)
def test_reduce_grad_too_early_is_reported_and_trains_wrong(schedule: str, ranks: int) -> None:
    case = mutant(schedule, ranks)
    report = verify(torch_csv.loads(case.csv_text).program)
    assert [v.code for v in report.violations] == ["reduce-grad"]
    errors, relative = _outcome(schedule, ranks, "reduce-early")
    assert not errors, errors
    assert relative > TOLERANCE


@pytest.mark.parametrize("name", sorted(OVERLAPS))
def test_sequential_overlap_trains_in_torch(name: str) -> None:
    ranks = OVERLAPS[name][1]
    per_rank = [by_case[f"overlap-{name}"] for by_case in results(ranks)]
    assert not [r["error"] for r in per_rank if "error" in r]
    relative = max(r["diff"] for r in per_rank) / max(r["scale"] for r in per_rank)
    assert relative <= TOLERANCE


@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize(("schedule", "ranks", "microbatches", "defines"), SIZES)
def test_other_sizes_train_in_torch_runtime(
    schedule: str, ranks: int, microbatches: int, defines: dict[str, int], form: str
) -> None:
    name = f"{schedule}{defines.get('V', '')}-P{ranks}-M{microbatches}-{form}"
    per_rank = [by_case[name] for by_case in results(ranks)]
    assert not [r["error"] for r in per_rank if "error" in r]
    relative = max(r["diff"] for r in per_rank) / max(r["scale"] for r in per_rank)
    assert relative <= TOLERANCE, f"max_rel_grad_diff {relative:.3g}"
    for r in (r for r in per_rank if r["loss"] is not None):
        assert r["loss"] == pytest.approx(r["want_loss"], rel=1e-6, abs=1e-7)
