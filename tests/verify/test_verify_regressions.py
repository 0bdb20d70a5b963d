"""Regression cases modelled on real pipeline-parallel bugs (research/failure-modes.md).

- torch 2.13 `_PipelineScheduleRuntime(defer_pp_recv=True)` lowers ZBVZeroBubble at P=2, M=4
  so that rank 1 receives `0F2`'s activation and `3I0`'s gradient in the opposite order from
  rank 0's sends: gloo runs it and delivers wrong tensors.
- pytorch/pytorch#172668: both ranks of a pair send before they receive (deferred recvs).
- NVIDIA/Megatron-LM#5100: one phase orders a pair's exchange the same way on every rank.
- pytorch/torchtitan#774: a V schedule run with a loop placement.
- pytorch/torchtitan#775: 1F1B with fewer microbatches than ranks.
"""

from __future__ import annotations

import csv
import io
from dataclasses import replace

import pytest
from helpers import ROOT
from programs import DATA, codes, compiled, first, rendered, report

from pipecc.driver.check import verify_file
from pipecc.driver.sweep import sweep_file
from pipecc.interop import torch_csv
from pipecc.ir.ops import StageOp
from pipecc.ir.placement import loop_placement
from pipecc.semantics import CommModel
from pipecc.verify import ALL_MODELS, Options, Status


def _torch_zbv(ranks: int, microbatches: int, *, defer: bool = True) -> str:
    """torch's own lowering of ZBVZeroBubble with defer_pp_recv=True, as action CSV.

    Calls the module-level passes `_PipelineScheduleRuntime._prepare_schedule_with_comms`
    runs (unshard/reshard, reduce-grad, send/recv, deferred recvs) on the generator's output,
    as torch's own tests do, with the V stage-to-rank map the schedule class sets up.
    """
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    utils = pytest.importorskip("torch.distributed.pipelining._utils")
    from torch_oracle import bare_schedule

    gen = bare_schedule("ScheduleZBVZeroBubble", ranks, microbatches, 2)
    order = {r: gen._calculate_single_rank_operations(r) for r in range(ranks)}
    stage_to_rank = utils.generate_stage_to_rank_mapping(ranks, 2 * ranks, style="v")
    lowered = {}
    for rank, actions in order.items():
        acts = schedules._add_unshard_reshard([a for a in actions if a is not None])
        lowered[rank] = schedules._add_reduce_grad(acts, microbatches)
    lowered = schedules._add_send_recv(
        lowered, stage_to_rank=lambda s: stage_to_rank[s], num_stages=2 * ranks
    )
    if defer:
        lowered = schedules._defer_recv_ops(lowered, stage_to_rank=lambda s: stage_to_rank[s])
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(
        [str(a) for a in lowered[r]] for r in range(ranks)
    )
    return out.getvalue()


def test_torch_defer_pp_recv_zbv_mismatch_is_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "zbv_defer.csv"
    path.write_text(_torch_zbv(2, 4))
    outcome = verify_file(str(path))
    mismatch = first(outcome.report, "mismatch")
    assert "messages 3 and 4 are swapped" in mismatch.message
    assert "0SEND_F2, output of 0F2" in mismatch.message
    assert "3SEND_B0, output of 3I0" in mismatch.message
    assert "2RECV_B0" in mismatch.message and "1RECV_F2" in mismatch.message
    assert (mismatch.span.line, mismatch.span.col) == (1, 58)  # the 0SEND_F2 cell
    # torch's UNSHARD/RESHARD/REDUCE_GRAD are kept (StageOps) and placed as verify requires
    assert sum(type(i) is StageOp for r in outcome.report.program.ranks for i in r) == 12
    assert not [
        v for v in outcome.report.violations if v.code in ("unshard-reshard", "reduce-grad")
    ]
    # the deferred recvs also put a send ahead of a recv toward the same peer on both
    # ranks: a cycle through NCCL's stream order, while gloo (rendezvous) runs it
    verdicts = {
        v.model: v.status
        for v in verify_file(str(path), options=Options(models=ALL_MODELS)).report.verdicts
    }
    assert verdicts[CommModel.NCCL] is Status.DEADLOCK
    assert verdicts[CommModel.RENDEZVOUS] is Status.PASSES


def test_controls_without_deferral_and_lowered_by_pipecc(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Controls: torch's lowering without defer_pp_recv matches every pair, and the same
    compute order lowered by pipecc's default policy passes every model."""
    eager = tmp_path / "zbv_eager_recv.csv"
    eager.write_text(_torch_zbv(2, 4, defer=False))
    assert "mismatch" not in codes(verify_file(str(eager)).report)
    rows = [line.split(",") for line in _torch_zbv(2, 4).splitlines()]
    compute_only = tmp_path / "zbv_compute.csv"
    compute_only.write_text(
        "\n".join(",".join(c for c in row if "SEND" not in c and "RECV" not in c) for row in rows)
        + "\n"
    )
    outcome = verify_file(str(compute_only), options=Options(models=ALL_MODELS))
    assert outcome.report.ok, [str(v) for v in outcome.report.violations]


def test_pytorch_172668_send_send_cycle() -> None:
    program = torch_csv.loads(
        (DATA / "pytorch_172668.csv").read_text(), "pytorch_172668.csv"
    ).program
    result = report(program, models=ALL_MODELS)
    verdicts = {v.model: v.status for v in result.verdicts}
    assert verdicts == {
        CommModel.NCCL: Status.DEADLOCK,
        CommModel.NCCL_SINGLE: Status.DEADLOCK,
        CommModel.RENDEZVOUS: Status.PASSES,
        CommModel.EAGER: Status.PASSES,
    }
    text = rendered(first(result, "deadlock"))
    # the thread's witness: r0 …0SEND_F1, 2RECV_F0 / r1 …1SEND_F0, 1RECV_F1
    assert "rank 0 @3     send act stage 1 mb 1 to rank 1" in text
    assert "rank 0 @4     recv act stage 2 mb 0 from rank 1" in text
    assert "rank 1 @3     send act stage 2 mb 0 to rank 0" in text
    assert "rank 1 @4     recv act stage 1 mb 1 from rank 0" in text


def test_megatron_5100_parity_in_one_phase_only() -> None:
    path = str((DATA / "megatron_5100.sched").relative_to(ROOT))
    outcome = verify_file(path, ranks=4, microbatches=8)
    assert codes(outcome.report) == ["needs-buffering"]
    violation = outcome.report.violations[0]
    assert violation.span is not None and violation.span.line == 13  # the `i == 0` branch
    # with parity ordering in every step (the fix) it verifies under every model
    fixed = (
        (DATA / "megatron_5100.sched")
        .read_text()
        .replace("i == 0 or rank % 2 == 0", "rank % 2 == 0")
    )
    fixed_path = DATA.parent / "megatron_5100_fixed.sched"
    try:
        fixed_path.write_text(fixed)
        again = verify_file(
            str(fixed_path), ranks=4, microbatches=8, options=Options(models=ALL_MODELS)
        )
    finally:
        fixed_path.unlink()
    assert again.report.ok, [str(v) for v in again.report.violations]


def test_torchtitan_774_v_schedule_on_loop_placement() -> None:
    program = replace(compiled("zbv", 4, 8), placement=loop_placement(4, 2))
    result = report(program)
    assert set(codes(result)) == {"placement"}
    first = result.violations[0]
    assert first.message.startswith("F1.0 on rank 0 (@16) computes stage 7, but in placement")
    assert len(first.notes) == 1 and "every op fits placement 'vshape'" in first.notes[0][1]
    assert result.notes == (
        "route and data-dependency checks skipped: the ops do not fit the program's placement",
    )


def test_torchtitan_775_fewer_microbatches_than_ranks() -> None:
    """pipecc's 1F1B runs M < P; the pre-fix warm-up arithmetic is caught by the sweep at
    the first size it breaks, with the line of the negative loop count."""
    ok = sweep_file("1f1b", ranks=range(8, 9), microbatches=range(1, 8))
    assert ok.ok and ok.verified == 7
    naive = sweep_file(str(DATA / "naive_1f1b.sched"), ranks=range(2, 5), microbatches=range(1, 5))
    assert not naive.ok
    assert naive.failed is not None and naive.failed.label.endswith("P=3 M=1")
    error = naive.failed.error  # type: ignore[union-attr]
    assert error.span is not None and error.span.line == 7
    assert "negative" in error.message
