"""The EP all-to-alls posted on a thread of their own, in program order.

A dispatch cannot move tokens before every EP rank knows how many rows it receives: it first
exchanges the token counts (runtime/engine/moe_ops.py), a small all_to_all that blocks until
every EP rank has reached the same dispatch. Posted from the compute thread, that wait (the
other ranks' lag, not the bytes) would be exposed even where the program overlaps the
dispatch with the other microbatch's computation. So a dispatch is handed to one `Poster`
thread: the compute thread queues the job and goes on; the poster exchanges the counts,
sizes and posts the tokens' all_to_all. The other all-to-alls (combine and the backward
ones: their sizes are known, posting them returns at once) are posted by the compute thread
itself when nothing is queued before them, else queued behind: waking the thread costs
about a millisecond on a busy host, which the peers would wait for. One queue, and a direct
post only when it is empty: the EP group sees this rank's collectives in program order,
which every EP rank shares (the program's order is the proof that no collective can hang),
and the group is the all-to-alls' own (`moe_ops.a2a_group`), so no other collective
interleaves.

A `Ticket` is a job's handle: `wait` blocks until it is posted, then until its work
completes (an error raised on the poster is raised there, in the compute thread). On
CUDA the poster is where a dispatch waits for its counts on the host, so the compute thread
keeps queueing the other half's kernels meanwhile.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipecc.diagnostics import ProgramError, RankError

from .moe_block import Routed

Job = Callable[[], Any]  # posts an all-to-all; returns its work (with `wait`)


class Ticket:
    """One posted job: its work once posted, or the error it raised; `held` keeps the tensors
    it reads and writes alive until it completes; `wait` adds the seconds it blocked to
    `clock[0]`."""

    __slots__ = ("clock", "done", "error", "held", "timeout", "work")

    def __init__(self, clock: list[float], held: tuple[Any, ...], timeout: float) -> None:
        self.timeout = timeout
        self.done = threading.Event()
        self.work: Any = None
        self.error: BaseException | None = None
        self.held = held
        self.clock = clock

    def wait(self) -> None:
        start = time.perf_counter()
        if not self.done.wait(self.timeout):  # the poster is blocked: a rank did not post
            raise RankError(
                f"an all-to-all was not posted within {self.timeout:g} s: its dispatch's "
                "count exchange is waiting for an EP rank"
            )
        if self.error is not None:
            raise self.error
        if self.work is not None:
            self.work.wait()
        self.clock[0] += time.perf_counter() - start
        self.held = ()


class Queue:
    """The poster's jobs and how many of them are queued and not yet posted (`pending`,
    under `lock`); the thread holds this, not its `Poster`, so the poster can be collected."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Job, Ticket] | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.pending = 0


class Poster:
    """A thread that runs posting jobs one after another (module docstring); started at
    the first job, stopped when its owner is collected."""

    def __init__(self) -> None:
        self.queue = Queue()
        self.thread: threading.Thread | None = None

    def submit(self, job: Job, ticket: Ticket, *, direct: bool = False) -> Ticket:
        """Queue `job`; a `direct` one (it never blocks: posting it returns at once) is run
        here instead when nothing is queued before it, so program order holds and the
        thread's wake-up is not in its way (a dispatch, which waits for its counts, is not
        direct)."""
        state = self.queue
        with state.lock:
            if direct and state.pending == 0:
                _run(job, ticket)
                return ticket
            state.pending += 1
        if self.thread is None:
            self.thread = threading.Thread(target=_loop, args=(state,), daemon=True)
            self.thread.start()
            weakref.finalize(self, state.jobs.put, None)
        state.jobs.put((job, ticket))
        return ticket


def _run(job: Job, ticket: Ticket) -> None:
    try:
        ticket.work = job()
    except BaseException as err:  # handed to the compute thread at the ticket's wait
        ticket.error = err
    finally:
        ticket.done.set()


def _loop(state: Queue) -> None:
    while True:
        item = state.jobs.get()
        if item is None:
            return
        _run(*item)
        with state.lock:  # posted: a direct job may now go past the queue
            state.pending -= 1


@dataclass
class Layer:
    """One MoE layer of one (chunk, mb) in a step: what its phases and all-to-alls hand on."""

    routed: Routed | None = None  # counts and order; `keep` detached (the next phase's leaves)
    tokens: torch.Tensor | None = None  # the dispatched rows, detached
    send: list[int] = field(default_factory=list)  # rows sent to each EP rank
    recv: list[int] = field(default_factory=list)  # rows received from each EP rank
    runs: list[int] = field(default_factory=list)  # rows by (source rank, local expert)
    received: torch.Tensor | None = None
    out: torch.Tensor | None = None  # the experts' outputs, detached
    combined: torch.Tensor | None = None
    grad_combined: torch.Tensor | None = None
    grad_keep: tuple[torch.Tensor | None, ...] = ()
    grad_out: torch.Tensor | None = None
    grad_received: torch.Tensor | None = None
    grad_tokens: torch.Tensor | None = None


class Exchange:
    """This rank's all-to-alls over its EP group (None: ep = 1, each a local copy), posted by
    one `Poster`. `waited[0]`: seconds the compute thread blocked on them; `counted[0]`:
    seconds the poster spent exchanging token counts."""

    def __init__(self, group: dist.ProcessGroup | None, size: int, timeout: float) -> None:
        self.group, self.size, self.timeout = group, size, timeout
        self.poster = Poster()
        self.waited = [0.0]
        self.counted = [0.0]

    def post(self, layer: Layer, direction: str) -> Ticket:
        """Queue one all-to-all of `layer`; its result is set on `layer` once posted (the
        program reads it only after the `Wait` that lists it)."""
        if direction == "dispatch":
            source = _got(layer.tokens, "route").contiguous()
            layer.tokens = None
            return self._submit(lambda: self._dispatch(layer, source), source)
        if direction == "combine":
            source, layer.out = _got(layer.out, "experts"), None
            out, rows = _like(source, layer.send), (layer.send, layer.recv)
            layer.combined = out
        elif direction == "combine-grad":
            source, layer.grad_combined = _got(layer.grad_combined, "a backward phase"), None
            out, rows = _like(source, layer.recv), (layer.recv, layer.send)
            layer.grad_out = out
        else:
            source, layer.grad_received = _got(layer.grad_received, "the experts' backward"), None
            out, rows = _like(source, layer.send), (layer.send, layer.recv)
            layer.grad_tokens = out
        source = source.contiguous()
        return self._submit(lambda: self._move(out, source, *rows), source, out, direct=True)

    def _submit(self, job: Callable[[], Any], *held: torch.Tensor, direct: bool = False) -> Ticket:
        ticket = Ticket(self.waited, held, self.timeout)
        return self.poster.submit(on_stream(held[0].device, job), ticket, direct=direct)

    def _dispatch(self, layer: Layer, source: torch.Tensor) -> Any:
        """On the poster: the counts exchanged (blocking), then the tokens posted."""
        assert layer.routed is not None
        counts = layer.routed.counts.to(torch.int64)
        local = counts.numel() // self.size
        layer.send = counts.view(self.size, local).sum(1).tolist()
        got = counts
        if self.group is not None:
            start = time.perf_counter()
            got = torch.empty_like(counts)
            dist.all_to_all_single(got, counts, group=self.group)
            self.counted[0] += time.perf_counter() - start
        runs = got.view(self.size, local)  # rows from each source rank for each local expert
        layer.runs = runs.flatten().tolist()
        layer.recv = runs.sum(1).tolist()
        out = _like(source, layer.recv)
        layer.received = out
        return self._move(out, source, layer.recv, layer.send)

    def _move(
        self, out: torch.Tensor, source: torch.Tensor, out_rows: list[int], in_rows: list[int]
    ) -> Any:
        if self.group is None:
            out.copy_(source)
            return None
        return dist.all_to_all_single(
            out, source, out_rows, in_rows, group=self.group, async_op=True
        )


def on_stream(device: torch.device, job: Job) -> Job:
    """`job` run with the calling thread's current CUDA stream as the current stream, on
    whichever thread runs it: the tensors it sends were written on that stream, the counts
    it reads too, and NCCL's all_to_all orders itself after the current stream of the
    thread that posts it (the poster's own would be the device's default stream, not the
    step's: a dispatch could send tokens not yet computed). Off CUDA, `job` as it is."""
    if device.type != "cuda":
        return job
    stream = current_stream(device)

    def posted() -> Any:
        with torch.cuda.stream(stream):
            return job()

    return posted


def current_stream(device: torch.device) -> Any:
    """The calling thread's current stream on `device` (a test's stand-in replaces it)."""
    return torch.cuda.current_stream(device)


def a2a_group(mesh: Any) -> tuple[dist.ProcessGroup | None, int, int]:
    """The all-to-alls' own group over this rank's EP group, its size and this rank's index
    in it (None, 1, 0 without `ep`): one group per EP group of the mesh, made by every rank
    in one order (a collective of the world)."""
    if mesh is None or "ep" not in (mesh.mesh_dim_names or ()):
        return None, 1, 0
    names = list(mesh.mesh_dim_names)
    grid = mesh.mesh.movedim(names.index("ep"), -1).reshape(-1, mesh["ep"].size())
    mine = None
    for ranks in grid.tolist():
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine, mesh["ep"].size(), mesh.get_local_rank("ep")


def _like(source: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return source.new_empty((sum(rows), *source.shape[1:]))


def _got(tensor: torch.Tensor | None, what: str) -> torch.Tensor:
    if tensor is None:
        raise ProgramError(f"the MoE all-to-all needs what {what} leaves, and it has not run")
    return tensor
