"""A training job's guards: one program on every rank, a failure that reaches every rank at
once and is remembered, non-finite values caught, and a step a profiler's trace shows.

Every multi-process case runs in one process group of 2 ranks (guard_cases.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from guard_cases import ROWS, run_cases
from pipecc.runtime import NonFiniteError, PipelineRuntime, RuntimeConfig, StepStats
from pipecc.runtime.comm.failure import Failed, Guard, RuntimeFailed
from pipecc.runtime.tools.spawn import spawn

from pipecc.api import compile_schedule
from pipecc.diagnostics import RankError

Results = list[dict[str, dict[str, Any]]]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Results:
    folder = tmp_path_factory.mktemp("guard")
    found: Results = spawn(run_cases, 2, str(folder), timeout=120.0)
    return found


# ---- part 6: the run shows itself ------------------------------------------------------------


def test_a_profiled_step_shows_every_instruction_by_its_label(ranks: Results) -> None:
    for rank, result in enumerate(ranks):
        found = result["profiled"]
        assert found["missing"] == [], f"rank {rank}"
        assert {"F0.0", "I0.3", "W0.3"} <= set(found["labels"])
    assert "send act s1.0→r1" in ranks[0]["profiled"]["labels"]
    assert "recv act s1.0←r0" in ranks[1]["profiled"]["labels"]


def test_last_step_gives_the_steps_time_waiting_and_rows(ranks: Results) -> None:
    for result in ranks:
        stats = result["profiled"]["last_step"]
        assert isinstance(stats, StepStats)
        assert stats.step == 1 and stats.rows == 4 * ROWS
        assert stats.seconds > 0 and 0 <= stats.waiting <= stats.seconds


# ---- part 2: one program on every rank -------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("1f1b-zb_h1", ("zb_h1 P=2 M=4", "1f1b P=2 M=4", "schedule, instructions")),
        ("zbv-zb_h1", ("zbv P=2 M=4 (placement vshape ", "zb_h1 P=2 M=4 (placement loop ",
                       "schedule, placement, instructions")),
        ("m8-m4", ("1f1b P=2 M=4", "1f1b P=2 M=8", "M, instructions")),
    ],
)  # fmt: skip
def test_ranks_running_different_programs_stop_together_naming_them(
    ranks: Results, case: str, said: tuple[str, str, str]
) -> None:
    zero, one, differing = said
    for rank, result in enumerate(ranks):
        found = result[case]
        assert found["error"] == "SetupError", found
        first, second = (zero, one) if rank == 0 else (one, zero)
        message = found["message"]
        assert message.startswith(
            f"error: the pipeline cannot start: rank {rank}, set-up: the ranks run different "
            f"programs: rank {rank} runs {first}"
        ), message
        assert f", rank {1 - rank} runs {second}" in message, message
        assert message.endswith(
            f" (they differ in: {differing}); compile one program and give it to every rank"
        ), message


def test_the_whole_messages_of_a_different_m(ranks: Results) -> None:
    assert ranks[1]["m8-m4"]["message"] == (
        "error: the pipeline cannot start: rank 1, set-up: the ranks run different programs: "
        "rank 1 runs 1f1b P=2 M=8, rank 0 runs 1f1b P=2 M=4 (they differ in: M, instructions); "
        "compile one program and give it to every rank"
    )


def test_ranks_whose_programs_differ_in_their_sums_stop_before_making_a_group(
    ranks: Results,
) -> None:
    """Compared when the runtimes are built, before any process group of a sum is made
    (where ranks given different sums would wait for each other): the fingerprint's
    error on both ranks, not a hang."""
    for rank, result in enumerate(ranks):
        found = result["sums-differ"]
        assert found["error"] == "SetupError", found
        assert found["message"].startswith(
            f"error: the pipeline cannot start: rank {rank}, set-up: the ranks run different "
            "programs: "
        ), found["message"]
        assert found["message"].endswith(
            "(they differ in: instructions); compile one program and give it to every rank"
        ), found["message"]


def test_a_stage_cut_differently_on_two_ranks_stops_both(ranks: Results) -> None:
    for result in ranks:
        assert result["cut"]["error"] == "SetupError"
        assert result["cut"]["message"].endswith(
            "the ranks run one program but cut stage 0 differently: its parameters (names, "
            "shapes, dtypes) differ between rank 0; rank 1; build every stage from the same "
            "model and split"
        ), result["cut"]["message"]


# ---- part 4: non-finite values ---------------------------------------------------------------


def test_a_nan_loss_names_rank_step_stage_and_microbatch(ranks: Results) -> None:
    told = ranks[1]["nan-loss"]["step"]
    assert told["error"] == "NonFiniteError"
    assert told["message"] == (
        "error: rank 1, step 1: the loss is nan at stage 1, microbatch 2: the first non-finite "
        "loss of the step (RuntimeConfig(check_finite=True))"
    )
    assert ranks[0]["nan-loss"]["step"] == {"error": None}  # its part of the step ran
    failed = (
        "this runtime failed at step 1 on rank 1 (rank 1, step 1: the loss is nan at "
        "stage 1, microbatch 2: the first non-finite loss of the step "
        "(RuntimeConfig(check_finite=True))); restart from a checkpoint"
    )
    # the runtime failed: the next collective is refused on rank 1; rank 0, in it, is told
    assert ranks[1]["nan-loss"]["clip"]["message"] == f"error: {failed}"
    told = ranks[0]["nan-loss"]["clip"]
    assert told["error"] == "RuntimeFailed"
    assert told["message"].startswith(
        "error: the all-reduce of the gradient norm over the pipeline failed: Connection closed "
        "by peer "
    ), told["message"]
    assert told["message"].endswith(f"; {failed}"), told["message"]


def test_an_infinite_added_loss_is_named_by_its_stage(ranks: Results) -> None:
    told = ranks[0]["inf-added"]["step"]
    assert told["message"] == (
        "error: rank 0, step 1: the loss it added (add_loss) is inf at stage 0, microbatch 1: "
        "the first non-finite loss of the step (RuntimeConfig(check_finite=True))"
    )
    assert ranks[1]["inf-added"]["clip"]["error"] == "RuntimeFailed"


def test_unchecked_a_nan_loss_passes_and_the_norm_says_so_on_every_rank(ranks: Results) -> None:
    for result in ranks:
        assert result["unchecked"]["step"] == {"error": None}
        assert result["unchecked"]["clip"] == {"error": None}


def test_a_nonfinite_norm_is_the_same_everywhere_and_raises_on_request(ranks: Results) -> None:
    for rank, result in enumerate(ranks):
        found = result["clipped"]
        assert found["norm"] != found["norm"], "nan on every rank (the skip-a-step recipe)"
        assert found["raised"]["error"] == "NonFiniteError"
        here = (
            "the gradients of stage 0 on this rank hold non-finite values"
            if rank == 0
            else "no gradient on this rank is: another rank's stage holds them"
        )
        assert found["raised"]["message"] == (
            f"error: rank {rank}, step 0: the gradient norm of order 2 over the pipeline is "
            f"nan, so the gradients cannot be clipped ({here}); the norm is the same on every "
            "rank: every rank raises this"
        )
        assert found["after"] == found["after"], "a finite norm again: nothing failed"


def test_check_finite_reads_the_host_once_per_step_where_losses_are(ranks: Results) -> None:
    assert ranks[0]["reads"]["reads"] == {}  # no loss on rank 0: nothing checked
    assert ranks[1]["reads"]["reads"] == {"__bool__": 1}


# ---- part 3: a failure fails fast, and the runtime remembers --------------------------------


def test_a_failure_reaches_the_other_rank_at_once_and_every_call_then_refuses(
    ranks: Results,
) -> None:
    failing, told = ranks[1]["fails-fast"], ranks[0]["fails-fast"]
    assert failing["step"]["error"] == "InstructionError"
    origin = failing["step"]["message"].removeprefix("error: ")
    assert origin == (
        "rank 1, step 1: instruction 7 (F0.1): ValueError: the stage failed on purpose"
    )
    assert told["step"]["error"] == "RuntimeFailed"
    failed = f"this runtime failed at step 1 on rank 1 ({origin}); restart from a checkpoint"
    said = told["step"]["message"]  # what rank 0 saw (its wait failed), then where it began
    assert re.fullmatch(
        r"error: rank 0, step 1: instruction \d+ \(wait [\d ]+\): recv .* failed: Connection "
        rf"closed by peer \S+; {re.escape(failed)}",
        said,
    ), said
    message = f"error: {failed}"
    # told long before the 300 s timeout, while rank 1 lived on (a generous bound: no race)
    assert told["step"]["at"] - failing["step"]["at"] < 60.0
    for result in (failing, told):
        assert [found["error"] for found in result["later"]] == ["RuntimeFailed"] * 4
        assert {found["message"] for found in result["later"]} == {message}


def test_a_guard_remembers_only_what_is_not_passing() -> None:
    guard = Guard(0, (0,))
    agreed = RankError("raised on every rank")
    with pytest.raises(RankError), guard.guard(3):
        raise guard.passing(agreed)
    guard.check()  # nothing failed
    with pytest.raises(KeyError), guard.guard(4):
        raise KeyError("boom")
    assert guard.failed == Failed(4, 0, "KeyError: 'boom'")
    with pytest.raises(RuntimeFailed) as caught:
        guard.check()
    assert caught.value.message == (
        "this runtime failed at step 4 on rank 0 (KeyError: 'boom'); restart from a checkpoint"
    )


def test_nonfinite_error_is_exported_and_a_pipecc_error() -> None:
    assert issubclass(NonFiniteError, RankError)
    assert RuntimeConfig().check_finite is False
    assert callable(PipelineRuntime.clip_grad_norm_)


def test_the_program_fingerprint_is_stable_and_made_once(tmp_path: Path) -> None:
    from pipecc.runtime.boundaries.fingerprint import Fingerprint

    program = compile_schedule("zb_h1", ranks=2, microbatches=4)
    again = compile_schedule("zb_h1", ranks=2, microbatches=4)
    modules = {0: torch.nn.Linear(2, 2)}
    assert Fingerprint.of(program, 0, modules) == Fingerprint.of(again, 0, modules)
    other = compile_schedule("1f1b", ranks=2, microbatches=4)
    assert Fingerprint.of(program, 0, modules) != Fingerprint.of(other, 0, modules)


def test_ranks_that_run_one_program_are_named_together() -> None:
    from pipecc.runtime.boundaries.fingerprint import Fingerprint, program_problem

    zb = compile_schedule("zb_h1", ranks=4, microbatches=8)
    other = compile_schedule("1f1b", ranks=4, microbatches=8)
    replies = [
        {"program": Fingerprint.of(p, rank, {}).as_json()}
        for rank, p in enumerate((zb, other, zb, zb))
    ]
    assert program_problem(replies, 2) == (
        "the ranks run different programs: ranks 2, 0, 3 run zb_h1 P=4 M=8, rank 1 runs 1f1b "
        "P=4 M=8 (they differ in: schedule, instructions); compile one program and give it to "
        "every rank"
    )
    same = [{"program": Fingerprint.of(zb, rank, {}).as_json()} for rank in range(4)]
    assert program_problem(same, 0) is None
