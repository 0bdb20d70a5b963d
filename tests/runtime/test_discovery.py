"""Shapes found along the pipeline on real data, and nothing outside the program in a step
whose shapes did not change.

One spawned group of 2 ranks runs every case (discovery_cases.py); the runtime is given no
boundaries. Models whose boundaries the meta device gets wrong: HF's mask helper (None on
real data, a bool mask on meta), a stage that enters autocast(bfloat16) in its own forward,
a MoE stage whose routing depends on the values. Each step's loss and every gradient of each
rank's stages are compared with the single-process reference. While each step runs, every
collective of torch.distributed and every host read of a tensor is counted: a step whose
signature is known (the current one, or one seen before) makes none but the program's own.
"""

from __future__ import annotations

from typing import Any

import discovery_cases
import pytest
from discovery_cases import CASES, TOLERANCE, run_cases
from pipecc.runtime.tools.spawn import spawn

Results = list[dict[str, Any]]  # per rank: case name -> result


@pytest.fixture(scope="module")
def ranks() -> Results:
    return spawn(run_cases, 2, None, timeout=120.0)


def _steps(ranks: Results, name: str) -> list[list[dict[str, Any]]]:
    """Per rank, the case's steps (failing with the rank's error if it had one)."""
    found = []
    for rank, per_rank in enumerate(ranks):
        result = per_rank[name]
        assert "error" not in result, f"rank {rank}: {result.get('message')}"
        found.append(result["steps"])
    return found


def _assert_matches_reference(per_rank: list[list[dict[str, Any]]]) -> None:
    microbatches = discovery_cases.MICROBATCHES
    for step in range(len(per_rank[0])):
        for rank, steps in enumerate(per_rank):
            assert steps[step]["params"] > 0
            rel = steps[step]["grad_rel"]
            assert rel <= TOLERANCE, f"rank {rank}, step {step}: gradient off by {rel}"
        losses = {mb: v for steps in per_rank for mb, v in steps[step]["losses"].items()}
        assert sorted(losses) == list(range(microbatches)), "every microbatch's loss once"
        want = per_rank[0][step]["want_loss"]
        got = sum(losses.values()) / microbatches
        assert abs(got - want) <= TOLERANCE * abs(want), f"step {step}: loss {got} != {want}"


TRAINED = [
    c.name for c in CASES if c.given is None and not (c.raising or c.static) and c.inputs == "all"
]


@pytest.mark.parametrize("name", [*TRAINED, "static-zbv"])
def test_every_step_matches_the_reference(ranks: Results, name: str) -> None:
    _assert_matches_reference(_steps(ranks, name))


def test_hfs_mask_helper_gets_the_real_runs_boundary(ranks: Results) -> None:
    """The helper returns None on real data: the boundary carries None, not the bool mask
    the meta device would have given (which failed HF Llama at step 0 on every schedule)."""
    for steps in _steps(ranks, "mask-zbv"):
        assert steps[0]["boundaries"][1] == "(float32[2, 4, 8], None)"


def test_an_autocast_region_inside_a_stage_gives_a_bf16_boundary(ranks: Results) -> None:
    for steps in _steps(ranks, "autocast-zbv"):
        assert steps[0]["boundaries"][1] == "bfloat16[2, 8]"
        assert steps[0]["boundaries"][2] == "float32[2, 8]"
    for steps in _steps(ranks, "autocast-1f1b"):
        assert steps[0]["boundaries"][1] == "bfloat16[2, 8]"


def test_data_dependent_routing_is_run_for_real(ranks: Results) -> None:
    for steps in _steps(ranks, "moe-zbv"):
        assert steps[0]["boundaries"][1] == "(float32[2, 8], int64[3])"


@pytest.mark.parametrize("name", ["mask-1f1b-warm", "mask-zbv", "moe-zbv", "static-zbv"])
def test_a_step_with_known_shapes_makes_no_collective_and_no_host_read(
    ranks: Results, name: str
) -> None:
    """The counter sees the first step's discovery (gathers, sends, `.item()`); the
    warm steps make none (without inputs too, under static_shapes on rank 1)."""
    for steps in _steps(ranks, name):
        assert steps[0]["collectives"] > 0 and steps[0]["host_reads"] > 0
        assert [s["collectives"] for s in steps[1:]] == [0] * (len(steps) - 1)
        assert [s["host_reads"] for s in steps[1:]] == [0] * (len(steps) - 1)


def test_the_programs_own_collectives_are_the_only_ones(ranks: Results) -> None:
    """DualPipe sums its duplicated stages' gradients in the program: a warm step makes
    exactly the program's collectives."""
    for rank, steps in enumerate(_steps(ranks, "mask-dualpipe")):
        want = ranks[rank]["mask-dualpipe"]["program_collectives"]
        assert want == 1
        assert [s["collectives"] for s in steps[1:]] == [want, want]
        assert [s["host_reads"] for s in steps[1:]] == [0, 0]


def test_a_changed_signature_is_learned_and_one_seen_before_is_switched_to(
    ranks: Results,
) -> None:
    """Sequence lengths 4, 6, 6, 4, 6: each new one is discovered (collectives), the
    repeated and the cached ones are not; every step trains as the reference."""
    per_rank = _steps(ranks, "seqs-zbv")
    _assert_matches_reference(per_rank)
    for steps in per_rank:
        assert [s["collectives"] > 0 for s in steps] == [True, True, False, False, False]
        assert steps[1]["boundaries"][2] == "(float32[2, 6, 8], None)"
        assert steps[3]["boundaries"][2] == "(float32[2, 4, 8], None)"


def test_a_rank_without_inputs_is_told_to_give_them_or_declare_static_shapes(
    ranks: Results,
) -> None:
    messages = [per_rank["no-inputs-zbv"]["message"] for per_rank in ranks]
    assert messages[0] == messages[1], "the same error on every rank"
    assert messages[0].startswith("error: the pipeline cannot start:\n  rank 1: was given no ")
    assert "RuntimeConfig(static_shapes=True)" in messages[0]


def test_static_shapes_that_change_stop_every_rank_given_them(ranks: Results) -> None:
    for rank, per_rank in enumerate(ranks):
        result = per_rank["static-change-zbv"]
        assert result["error"] == "SetupError"
        assert result["message"] == (
            f"error: rank {rank}, step 1: RuntimeConfig(static_shapes=True) declares that the "
            "shapes never change, but the step's inputs are float32[2, 6, 8] per microbatch, "
            "not float32[2, 4, 8]"
        )


def test_ranks_given_different_signatures_stop_with_the_same_error(ranks: Results) -> None:
    results = [per_rank["different-zbv"] for per_rank in ranks]
    assert [r["error"] for r in results] == ["SetupError", "SetupError"]
    assert (
        results[0]["message"]
        == results[1]["message"]
        == (
            "error: the pipeline cannot start: the ranks were given inputs of different shapes "
            "(one microbatch each):\n  rank 0, step 0: float32[2, 4, 8]\n"
            "  rank 1, step 0: float32[2, 6, 8]"
        )
    )


def test_a_stage_that_fails_in_the_discovery_stops_every_rank(ranks: Results) -> None:
    """Its holder raises the user's exception as the cause (its traceback kept); the other
    ranks the same message as a SetupError. Then the group still trains."""
    holder, other = ranks[1]["raising-1f1b"], ranks[0]["raising-1f1b"]
    said = (
        "rank 1, step 0: stage 1's forward on microbatch 0 failed (discovering the "
        "boundaries of a new input signature): ValueError: a bug in the user's stage"
    )
    assert (holder["error"], holder["cause"]) == ("InstructionError", "ValueError")
    assert holder["message"] == f"error: {said}"
    assert other["error"] == "SetupError"
    assert other["message"] == f"error: the pipeline cannot start: {said}"
    _assert_matches_reference(_steps(ranks, "after-errors-zbv"))


def test_a_rank_that_knows_the_signature_while_another_does_not_times_out(
    ranks: Results,
) -> None:
    """Nothing is exchanged in a step whose shapes a rank knows, so a rank given a new
    signature alone waits for the discovery until the timeout, which says why, while the
    other times out in the program. Both time out at once (1 s): the first to fail its
    runtime tells the other (runtime/comm/failure.py), which then names it instead."""
    known, new = ranks[0]["missing-1f1b"], ranks[1]["missing-1f1b"]
    discovery = "rank 1, step 1: the discovery of a new input signature did not complete within 1 s"
    program = "rank 0, step 1: instruction "
    if new["error"] == "RuntimeFailed":  # rank 0 failed first: what rank 1 saw, then that
        assert known["error"] == "RecvTimeoutError"
        assert new["message"].startswith(f"error: {discovery}"), new["message"]
        assert f"; this runtime failed at step 1 on rank 0 ({program}" in new["message"]
        return
    assert new["error"] == "RankError"
    assert new["message"].startswith(f"error: {discovery}")
    assert "Every rank must be given the step's inputs, of the same shapes" in new["message"]
    if known["error"] == "RuntimeFailed":  # rank 1 failed first
        assert known["message"].startswith("error: rank 0, step 1: instruction "), known["message"]
        assert f"; this runtime failed at step 1 on rank 1 ({discovery}" in known["message"]
    else:
        assert known["error"] == "RecvTimeoutError"
