"""Every bundled schedule, run by the runtime, equals a single-process step.

Two process groups serve the whole session: one of 2 ranks and one of 4, each running all of
its cases in one go (runtime_cases.py). For every schedule at P=2 and P=4, at the smallest M
it accepts and a larger one: every parameter's gradient within 1e-6 relative of the
reference, and the mean loss too (fp32, CPU, gloo). Then the features: the F&B hook, tuple
boundaries, forward only, duplicated stages unsynced, pipelines inside a larger world, the
first-step errors on every rank, and the receive timeout.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from pipecc.runtime.tools.spawn import spawn
from runtime_cases import (
    HIDDEN,
    ROWS,
    SCHEDULES,
    TOLERANCE,
    Case,
    compile_case,
    microbatch_counts,
    run_cases,
    wrong_boundaries,
)

from pipecc.api import bundled_schedules
from pipecc.ir.ops import Recv, Send, Wait
from pipecc.passes.sum_shared import sum_shared

Results = list[dict[str, dict[str, Any]]]  # per rank: case name -> result


@functools.cache
def schedule_cases(ranks: int) -> tuple[Case, ...]:
    cases = []
    for name in SCHEDULES:
        for microbatches in sorted(set(microbatch_counts(name, ranks))):
            program = compile_case(name, ranks, microbatches)
            cases.append(Case(f"{name}-P{ranks}-M{microbatches}", program))
    return tuple(cases)


def feature_cases_2() -> list[Case]:
    dualpipev = compile_case("dualpipev", 2, 5)
    dualpipe = compile_case("dualpipe", 2, 6)
    return [
        Case("interleaved_1f1b-V3-P2-M4", compile_case("interleaved_1f1b", 2, 4, V=3)),
        Case("hook-dualpipev", dualpipev, model="hooked", keep_grads=True),
        Case("plain-dualpipev", dualpipev, keep_grads=True),
        Case("loaded-hook-dualpipev", dualpipev, model="hooked", keep_grads=True, hogs=2),
        Case("hook-dualpipe", dualpipe, model="hooked", keep_grads=True),
        Case("plain-dualpipe", dualpipe, keep_grads=True),
        Case("tuple-zbv", compile_case("zbv", 2, 4), model="tuple"),
        Case("tuple-dualpipe", dualpipe, model="tuple"),
        Case("tuple-interleaved_zb", compile_case("interleaved_zb", 2, 4), model="tuple"),
        Case("forward-zbv", compile_case("zbv", 2, 4), mode="forward"),
        Case("forward-dualpipe", dualpipe, mode="forward"),
        Case("profile-dualpipe", dualpipe, mode="profile"),
        Case("signatures-dualpipe", dualpipe, mode="signatures"),
        Case("timeout", compile_case("1f1b", 2, 2), mode="timeout", timeout=1.0),  # the last
    ]


def feature_cases_4() -> list[Case]:
    zbv = compile_case("zbv", 4, 4)
    return [
        Case("tuple-zb_h2", compile_case("zb_h2", 4, 8), model="tuple"),
        Case("nosync-dualpipe", compile_case("dualpipe", 4, 8), mode="nosync"),
        Case("forward-interleaved_1f1b", compile_case("interleaved_1f1b", 4, 8), mode="forward"),
        Case("ppdp-1f1b", compile_case("1f1b", 2, 4), pipelines=((0, 2), (3, 1))),
        Case("ppdp-dualpipe", compile_case("dualpipe", 2, 4), pipelines=((0, 2), (3, 1))),
        Case("wrong-world", compile_case("1f1b", 2, 2)),
        Case("missing-module", zbv, drop_chunk=(1, 1)),
        Case("wrong-shapes", compile_case("1f1b", 4, 4), boundaries=wrong_boundaries(zbv)),
        Case(
            "sums-differ",
            sum_shared(compile_case("1f1b", 4, 4), shared=((0, 3),)),
            other=(3, compile_case("1f1b", 4, 4)),
        ),  # fmt: skip
        Case("after-errors-1f1b", compile_case("1f1b", 4, 4)),
    ]


def _run(ranks: int, cases: list[Case]) -> Results:
    return spawn(run_cases, ranks, cases, timeout=120.0)


@pytest.fixture(scope="session")
def group2() -> Results:
    return _run(2, [*schedule_cases(2), *feature_cases_2()])


@pytest.fixture(scope="session")
def group4() -> Results:
    return _run(4, [*schedule_cases(4), *feature_cases_4()])


def _results(request: pytest.FixtureRequest, ranks: int, name: str) -> list[dict[str, Any]]:
    group: Results = request.getfixturevalue(f"group{ranks}")
    return [per_rank[name] for per_rank in group]


def _assert_matches_reference(per_rank: list[dict[str, Any]], microbatches: int) -> None:
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank}: {result.get('message')}"
        assert result["grad_rel"] <= TOLERANCE, f"rank {rank}: gradient off by {result['grad_rel']}"
    losses = {mb: v for result in per_rank for mb, v in result["losses"].items()}
    assert sorted(losses) == list(range(microbatches)), "every microbatch's loss once"
    want = per_rank[0]["want_loss"]
    assert abs(sum(losses.values()) / microbatches - want) <= TOLERANCE * abs(want)


def _schedule_ids(ranks: int) -> list[str]:
    return [case.name for case in schedule_cases(ranks)]


@pytest.mark.parametrize("name", _schedule_ids(2))
def test_schedule_p2_equals_reference(request: pytest.FixtureRequest, name: str) -> None:
    case = next(c for c in schedule_cases(2) if c.name == name)
    _assert_matches_reference(_results(request, 2, name), case.program.num_microbatches)


@pytest.mark.parametrize("name", _schedule_ids(4))
def test_schedule_p4_equals_reference(request: pytest.FixtureRequest, name: str) -> None:
    case = next(c for c in schedule_cases(4) if c.name == name)
    _assert_matches_reference(_results(request, 4, name), case.program.num_microbatches)


def test_every_schedule_at_minimum_and_larger_m() -> None:
    assert set(SCHEDULES) == set(bundled_schedules()), "every bundled schedule is run"
    for ranks in (2, 4):
        names = {case.name.split("-")[0] for case in schedule_cases(ranks)}
        assert names == set(SCHEDULES)
        assert len(schedule_cases(ranks)) == 2 * len(SCHEDULES)


def test_interleaved_with_three_chunks(group2: Results) -> None:
    _assert_matches_reference([r["interleaved_1f1b-V3-P2-M4"] for r in group2], 4)


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_overlap_hook_is_called_and_changes_nothing(group2: Results, schedule: str) -> None:
    hooked = [r[f"hook-{schedule}"] for r in group2]
    plain = [r[f"plain-{schedule}"] for r in group2]
    _assert_matches_reference(hooked, 5 if schedule == "dualpipev" else 6)
    assert sum(r["fused_b"] for r in hooked) > 0
    if schedule == "dualpipev":  # F&B whose forward's backward is an I: 2 on each rank
        assert [r["fused_before_i"] for r in hooked] == [2, 2]
    for h, p in zip(hooked, plain, strict=True):
        assert h["hook_calls"] == h["fused_b"], "one hook call per fused F&B"
        # the hook's forward is captured where the plain one is: the same arithmetic
        assert h["hook_captured"] == h["fused_before_i"]
        assert p["hook_calls"] == 0
        assert h["losses"] == p["losses"]
        for key, grad in h["grads"].items():
            assert torch.equal(grad, p["grads"][key]), f"{key} differs with the hook"


def test_the_same_program_gives_the_same_bits_beside_cpu_bound_processes(
    group2: Results,
) -> None:
    """The runtime's arithmetic does not depend on timing: DualPipeV with the overlap hook,
    run once on the idle group and once while two processes spin on the CPU (started by
    rank 0 for that case alone), gives bit for bit the same losses and gradients."""
    idle = [r["hook-dualpipev"] for r in group2]
    loaded = [r["loaded-hook-dualpipev"] for r in group2]
    assert loaded[0]["hogs"] == 2, "both processes spun until the case ended"
    assert idle[0]["hogs"] == 0
    for quiet, busy in zip(idle, loaded, strict=True):
        assert "error" not in busy, busy.get("message")
        assert quiet["losses"] == busy["losses"]
        assert quiet["grads"].keys() == busy["grads"].keys()
        for key, grad in quiet["grads"].items():
            assert torch.equal(grad, busy["grads"][key]), f"{key} differs under load"


@pytest.mark.parametrize(
    ("ranks", "name", "microbatches"),
    [(2, "tuple-zbv", 4), (2, "tuple-dualpipe", 6), (2, "tuple-interleaved_zb", 4),
     (4, "tuple-zb_h2", 8)],
)  # fmt: skip
def test_tuple_boundaries(
    request: pytest.FixtureRequest, ranks: int, name: str, microbatches: int
) -> None:
    _assert_matches_reference(_results(request, ranks, name), microbatches)


@pytest.mark.parametrize(
    ("ranks", "name", "microbatches"),
    [(2, "forward-zbv", 4), (2, "forward-dualpipe", 6), (4, "forward-interleaved_1f1b", 8)],
)
def test_forward_only(
    request: pytest.FixtureRequest, ranks: int, name: str, microbatches: int
) -> None:
    per_rank = _results(request, ranks, name)
    outputs = sorted(mb for r in per_rank for mb in r["outputs"])
    assert outputs == list(range(microbatches))
    assert all(r["out_diff"] == 0.0 for r in per_rank)
    assert all(r["grads"] == 0 for r in per_rank), "forward only leaves no gradients"
    assert sorted(mb for r in per_rank for mb in r["losses"]) == outputs


def test_duplicated_stages_unsynced_sum_to_reference(group4: Results) -> None:
    per_rank = [r["nosync-dualpipe"] for r in group4]
    want = per_rank[0]["want"]
    for (stage, name), ref in want.items():
        copies = [r["grads"][(stage, name)] for r in per_rank if (stage, name) in r["grads"]]
        assert len(copies) == 2, "DualPipe holds each stage twice"
        assert not torch.allclose(copies[0], ref), "each copy alone is a partial gradient"
        total = copies[0] + copies[1]
        assert float((total - ref).abs().max()) <= TOLERANCE * float(ref.abs().max())


@pytest.mark.parametrize("name", ["ppdp-1f1b", "ppdp-dualpipe"])
def test_pipelines_inside_a_larger_world(group4: Results, name: str) -> None:
    per_rank = [r[name] for r in group4]
    for pipeline in ((0, 2), (3, 1)):
        _assert_matches_reference([per_rank[g] for g in pipeline], 4)


def test_program_for_another_world_size_fails_on_every_rank(group4: Results) -> None:
    for result in (r["wrong-world"] for r in group4):
        assert result["error"] == "SetupError"
        assert "compiled for 2 ranks but the pipeline group has 4" in result["message"]


def test_programs_that_differ_in_their_sums_stop_every_rank_before_a_group_is_made(
    group4: Results,
) -> None:
    """Ranks 0-2 sum stages 0 and 3 over ranks 0 and 3, rank 3's program has no sum: rank 0
    would wait in the new group of ranks 0 and 3 that rank 3 never makes, rank 3 in the first
    step. The programs are compared when the runtimes are built, before any group: every
    rank stops with the fingerprint's error."""
    for rank, result in enumerate(r["sums-differ"] for r in group4):
        assert result["error"] == "SetupError", result
        assert result["message"].startswith(
            f"error: the pipeline cannot start: rank {rank}, set-up: the ranks run different "
            "programs: "
        ), result["message"]
        assert "(they differ in: instructions)" in result["message"], result["message"]


def test_missing_stage_module_fails_on_every_rank(group4: Results) -> None:
    for result in (r["missing-module"] for r in group4):
        assert result["error"] == "SetupError"
        assert "rank 1: no stage module for chunk 1 (stage 6 of pipe 0)" in result["message"]


def test_shape_mismatch_fails_on_every_rank(group4: Results) -> None:
    for result in (r["wrong-shapes"] for r in group4):
        assert result["error"] == "SetupError"
        assert (
            "rank 0: chunk 0 (stage 0 of pipe 0) returns float32[2, 6] for input "
            "float32[2, 6], but stage 1 takes (float32[2, 7],)"
        ) in result["message"]


def test_group_still_works_after_setup_errors(group4: Results) -> None:
    _assert_matches_reference([r["after-errors-1f1b"] for r in group4], 4)


def test_recv_timeout_names_rank_step_instruction_peer_and_message(group2: Results) -> None:
    result = group2[1]["timeout"][1]
    assert result["error"] == "RecvTimeoutError"
    assert result["message"] == (
        "error: rank 1, step 1: instruction 2 (wait 0): recv act pipe 0 stage 1 mb 0 from rank 0 "
        "(instruction 0) did not complete within 1 s"
    )


def test_after_a_timeout_the_runtime_refuses_every_step(group2: Results) -> None:
    """A step whose shapes are known exchanges nothing before the program: a rank that
    stays away is found by the program's first wait (above). That fails the runtime: the
    next step raises at once, naming where it failed (runtime/comm/failure.py), instead of
    waiting out the timeout again."""
    result = group2[1]["timeout"][2]
    assert result["error"] == "RuntimeFailed", result["message"]
    assert result["message"] == (
        "error: this runtime failed at step 1 on rank 1 (rank 1, step 1: instruction 2 (wait "
        "0): recv act pipe 0 stage 1 mb 0 from rank 0 (instruction 0) did not complete within "
        "1 s); restart from a checkpoint"
    )


def test_ranks_that_disagree_on_the_shapes_or_cannot_split_stop_together(group2: Results) -> None:
    """The discovery's agreement: inputs of different new shapes on the ranks stop every
    rank with the same error naming each rank's shapes; a batch that cannot be split into M
    stops every rank given it at once, naming the step, the rows, M and what to do; then a
    good step runs again (its signature is cached)."""
    results = [r["signatures-dualpipe"] for r in group2]
    for rank, result in enumerate(results):
        disagree, uneven = result[2].get("message", ""), result[3].get("message", "")
        assert result[2]["error"] == "SetupError"
        assert "the ranks were given inputs of different shapes" in disagree
        assert "rank 0, step 1: float32[6, 6]" in disagree
        assert "rank 1, step 1: float32[4, 6]" in disagree
        assert result[3]["error"] == "InputError"
        assert uneven == (
            f"error: rank {rank}, step 1: the step's inputs have 11 rows, which do not split "
            "into M=6 microbatches of equal size: give every step a multiple of 6 rows (a "
            "DataLoader: drop_last=True and a batch size that is a multiple of 6)"
        )
        assert result[4]["error"] is None
    assert results[0][2]["message"] == results[1][2]["message"], "the same error"
    assert results[0][4]["loss"] is not None


def test_profile_records_every_post_wait_and_the_sync(group2: Results) -> None:
    """A profiled step (`pipecc run --profile`): one post time per Send/Recv, one record
    per Wait naming its ops, each message's post on both sides, and the duplicated-stage
    sum; the step itself is unchanged."""
    per_rank = [r["profile-dualpipe"] for r in group2]
    _assert_matches_reference(per_rank, 6)
    program = compile_case("dualpipe", 2, 6)
    posted = {}
    for rank, result in enumerate(per_rank):
        recorder, instrs = result["recorder"], program.ranks[rank]
        comm = [i for i in instrs if type(i) is Send or type(i) is Recv]
        waits = [i for i in instrs if type(i) is Wait]
        assert len(recorder.posts) == len(comm) and all(s > 0 for s in recorder.posts)
        assert [len(ops) for _, ops, _ in recorder.waits] == [len(w.ops) for w in waits]
        for _, ops, (start, release, end) in recorder.waits:
            assert start <= release <= end
            for send, key in ops:
                assert (send, key) in {(s, k) for _, s, k, _, _ in recorder.messages}
        for _, send, key, _, nbytes in recorder.messages:
            assert nbytes == ROWS * HIDDEN * 4
            posted.setdefault(key, []).append(send)
        assert len(recorder.syncs) == 1, "the duplicated-stage sum, once per step"
        (_, sync_start, sync_end) = recorder.syncs[0]
        assert sync_end > sync_start >= max(end for _, _, (_, _, end) in recorder.waits)
    assert all(sorted(sides) == [False, True] for sides in posted.values()), "sent and received"
