"""The EP all-to-alls' poster (runtime/engine/moe_post.py): program order on the group
whichever thread posts, no process group needed (the jobs are stand-ins)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from pipecc.runtime.engine import moe_post
from pipecc.runtime.engine.moe_post import Poster, Ticket


def _ticket() -> Ticket:
    return Ticket([0.0], (), timeout=10.0)


def test_a_direct_post_with_nothing_queued_runs_on_the_calling_thread() -> None:
    ran: list[str] = []
    poster = Poster()
    ticket = poster.submit(lambda: ran.append(threading.current_thread().name), _ticket(),
                           direct=True)  # fmt: skip
    assert ticket.done.is_set() and ran == [threading.current_thread().name]
    assert poster.thread is None, "no thread started for it"


def test_a_direct_post_waits_behind_a_queued_dispatch_so_program_order_holds() -> None:
    """A dispatch blocked in its count exchange is queued; a combine posted after it must
    reach the group after it, not beside it: it is queued too, and runs once the dispatch
    is posted."""
    order: list[str] = []
    release = threading.Event()

    def dispatch() -> None:
        release.wait(10.0)  # the count exchange, waiting for the peers
        order.append("dispatch")

    poster = Poster()
    first = poster.submit(dispatch, _ticket())
    second = poster.submit(lambda: order.append("combine"), _ticket(), direct=True)
    assert not second.done.is_set() and order == [], "queued behind the dispatch"
    release.set()
    first.wait()
    second.wait()
    assert order == ["dispatch", "combine"]
    third = poster.submit(lambda: order.append("combine-grad"), _ticket(), direct=True)
    assert third.done.is_set() and order[-1] == "combine-grad", "the queue is empty again"


def test_an_error_of_a_direct_post_is_raised_at_its_wait() -> None:
    def fails() -> None:
        raise RuntimeError("the group is gone")

    ticket = Poster().submit(fails, _ticket(), direct=True)
    with pytest.raises(RuntimeError, match="the group is gone"):
        ticket.wait()


def test_a_job_posted_on_the_poster_runs_on_the_stream_current_where_it_was_queued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA the tokens a dispatch sends were written on the compute thread's current
    stream; the poster thread's own current stream is the device's default, so the job
    carries the stream it was queued under (a stand-in stream and context here)."""
    entered: list[tuple[object, str]] = []

    @contextlib.contextmanager
    def stream(value: object) -> Iterator[None]:
        entered.append((value, threading.current_thread().name))
        yield

    monkeypatch.setattr(moe_post, "current_stream", lambda device: f"the step's stream on {device}")
    monkeypatch.setattr(moe_post.torch.cuda, "stream", stream)
    work = SimpleNamespace(wait=lambda: None)  # what all_to_all_single(async_op=True) gives
    job = moe_post.on_stream(torch.device("cuda", 0), lambda: work)
    poster = Poster()
    ticket = poster.submit(job, _ticket())
    ticket.wait()
    assert ticket.work is work
    assert entered == [("the step's stream on cuda:0", poster.thread.name)]
    plain = lambda: None  # noqa: E731
    assert moe_post.on_stream(torch.device("cpu"), plain) is plain, "off CUDA: as it is"
