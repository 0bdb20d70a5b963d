"""The posting paths the gloo suite does not take by itself: the poster thread, and the
coalesced branch (`batch_isend_irecv` on a backend that coalesces, as NCCL does).

One process group of 2 ranks runs a few schedules (plain and tuple boundaries, the
duplicated-stage sum of DualPipe) first with `gloo_poster_thread`, then over gloo groups
made to coalesce (posting_cases.py), each against the single-process reference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pipecc.runtime import RuntimeConfig
from pipecc.runtime.comm import channel as comm
from pipecc.runtime.tools.environment import DIRECTIONS, POST_THREAD, GlooPosting, gloo_posting
from pipecc.runtime.tools.launcher import RunJob, run_job
from pipecc.runtime.tools.spawn import spawn
from posting_cases import run_posting
from runtime_cases import Case, compile_case
from test_runtime_schedules import _assert_matches_reference

from pipecc.diagnostics import InputError

CASES = (
    Case("1f1b-P2-M4", compile_case("1f1b", 2, 4)),
    Case("interleaved_1f1b-P2-M4", compile_case("interleaved_1f1b", 2, 4)),
    Case("zbv-P2-M4", compile_case("zbv", 2, 4)),
    Case("dualpipev-P2-M5", compile_case("dualpipev", 2, 5)),
    Case("dualpipe-P2-M6", compile_case("dualpipe", 2, 6)),
    Case("tuple-zbv-P2-M4", compile_case("zbv", 2, 4), model="tuple"),
)


@pytest.fixture(scope="module")
def posting() -> list[dict[str, Any]]:
    return spawn(run_posting, 2, list(CASES), timeout=120.0)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_schedules_through_the_poster_thread_equal_the_reference(
    posting: list[dict[str, Any]], case: Case
) -> None:
    per_rank = [r["threaded"][case.name] for r in posting]
    _assert_matches_reference(per_rank, case.program.num_microbatches)
    assert [r["threaded_posters"] for r in posting] == [{"pipecc-post"}] * 2, "by the thread"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_schedules_over_coalescing_groups_equal_the_reference(
    posting: list[dict[str, Any]], case: Case
) -> None:
    _assert_matches_reference(
        [r["coalesced"][case.name] for r in posting], case.program.num_microbatches
    )


def test_the_runs_took_the_paths_they_test(posting: list[dict[str, Any]]) -> None:
    """Positive controls: the coalescing runs posted groups through `batch_isend_irecv`'s
    coalescing branch (several ops in a group), in place (the default)."""
    for result in posting:
        groups = result["coalesced_groups"]
        assert groups and max(groups) >= 2, groups
        assert result["coalesced_posters"] == {"MainThread"}


def test_a_coalesced_group_transfers_every_tensor_under_one_shared_work(
    posting: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(posting):
        peer = 1 - rank
        exchange = result["exchange"]
        assert result["exchange_groups"] == [exchange["ops"]] == [4], "one group of 4 ops"
        assert exchange["shared"], "every op handed the group's one work"
        values, ints = exchange["received"]
        assert torch.equal(values, torch.arange(6.0).reshape(2, 3) + 10 * peer)
        assert torch.equal(ints, torch.tensor([peer, 7, 8]))


def test_each_direction_has_its_own_gloo_group(posting: list[dict[str, Any]]) -> None:
    """On gloo, messages to a lower rank go over a second group of the pipeline's ranks
    (two ranks sending each other at once over one socket stall now and then: the module
    docstring of runtime/comm/channel.py); each direction keeps its messages' order; a
    second runtime of the same pipeline reuses the group; `direction_groups=False`
    (`gloo_direction_groups`) keeps one group."""
    for rank, result in enumerate(posting):
        found = result["directions"]
        assert found["distinct"] and found["reused"] and found["single"], found
        assert found["weak"], "a destroyed world is not kept alive to its teardown (an abort)"
        assert found["send_down"] is (rank == 1), "rank 1 sends down, rank 0 up"
        assert found["recv_down"] is (rank == 0), "rank 0 receives what came down"
        peer = 1 - rank
        assert found["received"] == [100.0 * peer + i for i in range(12)], "in order"


def test_the_gloo_posting_fields() -> None:
    """`gloo_poster_thread` starts a poster thread on gloo only; `gloo_direction_groups`
    (default on) is what makes the second group (test_each_direction_has_its_own_gloo_group)."""

    def poster(nccl: bool, thread: bool) -> object:
        return comm.Channel(None, [0], timeout=1.0, nccl=nccl, poster_thread=thread)._poster

    config = RuntimeConfig()
    assert (config.gloo_poster_thread, config.gloo_direction_groups) == (False, True)
    assert poster(False, False) is None, "gloo posts in the calling thread by default"
    assert poster(False, True) is not None
    assert poster(True, True) is None, "NCCL posts in the calling thread"
    assert comm.Channel(None, [0], timeout=1.0, nccl=True).coalesced, "NCCL: every post batched"


def test_pipecc_run_maps_the_environment_onto_the_fields() -> None:
    assert gloo_posting({}) == GlooPosting(poster_thread=False, direction_groups=True)
    on = {POST_THREAD: "1", DIRECTIONS: "0"}
    assert gloo_posting(on) == GlooPosting(poster_thread=True, direction_groups=False)
    with pytest.raises(InputError) as err:
        gloo_posting({POST_THREAD: "off"})
    assert str(err.value) == (
        "error: PIPECC_POST_THREAD='off': expected 0 (post in the calling thread) or 1"
    )
    with pytest.raises(InputError) as err:
        gloo_posting({DIRECTIONS: "2"})
    assert str(err.value) == (
        "error: PIPECC_GLOO_DIRECTIONS='2': expected 0 (one group both ways) or 1"
    )


def test_run_job_reads_the_environment_before_any_rank_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(POST_THREAD, "yes")
    job = RunJob(compile_case("1f1b", 2, 2), "examples/mlp.py", batch_size=4)
    with pytest.raises(InputError, match=r"PIPECC_POST_THREAD='yes': expected 0"):
        run_job(job)
