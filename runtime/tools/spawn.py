"""Start P local processes in one process group, run a function in each, collect results.

The parent watches its children: when one reports an error or dies (killed, crashed), it
gives the others a moment to report their own errors, then terminates them, so a dead rank
never leaves the rest hanging. Results travel back as `torch.save` bytes, so they may hold
tensors without sharing memory with a process that is about to exit. A rank's error comes
back as text: a pipecc error's message alone; an exception from the user's code (raised in a
step's instruction, or anywhere else in the worker) as the line naming the rank, the step and
the instruction, followed by the exception's full traceback.

A run may also be given a wall-clock deadline (`deadline=`, or the environment's
`PIPECC_SPAWN_DEADLINE` in seconds; none by default: a training run takes as long as it
takes). A rank that spins without ever reaching a collective is not caught by the backend's
timeout; past the deadline every rank still running is stopped and named. The test suite
sets one, so a hang fails its test instead of holding CI until its own limit.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipecc.diagnostics import PipeccError, RankError

from ..comm.failure import FAILED_AT
from ..engine.interpreter import InstructionError

Worker = Callable[[int, int, Any], Any]  # (rank, world size, payload) -> result
GRACE = 1.0  # seconds the others get to report after the first failure
# The ranks' environment: glibc malloc keeps blocks of up to 256 MB in the heap instead of
# unmapping each one when it is freed and faulting it in again at the next allocation (a
# weight-gradient block of MBs per Linear layer and microbatch otherwise costs page faults;
# torch's CPU tuning guide recommends a caching allocator for the same reason). Values
# already in the environment win.
RANK_ENV = (("MALLOC_MMAP_THRESHOLD_", str(1 << 28)), ("MALLOC_TRIM_THRESHOLD_", str(1 << 30)))
STOPPED = "stopped after another rank failed"
DEADLINE_ENV = "PIPECC_SPAWN_DEADLINE"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _bootstrap(
    rank: int, world: int, address: tuple[int, str, float], worker: Worker, payload: Any,
    results: Any,
) -> None:  # fmt: skip
    port, backend, timeout = address
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
        )
        value = worker(rank, world, payload)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put(("ok", rank, buffer.getvalue()))
        dist.destroy_process_group()
    except InstructionError as err:  # the user's code failed in a step: keep its traceback
        _report(results, rank, err.details())
    except PipeccError as err:  # pipecc's own finding: one message (input: exit 2 if all say so)
        _report(results, rank, err.message, "refused" if err.exit_code == 2 else "error")
    except BaseException as err:  # a bug or a user's exception: keep the traceback
        _report(results, rank, f"rank {rank}: {type(err).__name__}: {err}\n"
                + "".join(traceback.format_exception(err)))  # fmt: skip


def _report(results: Any, rank: int, message: str, status: str = "error") -> None:
    """Send the error ("refused": input pipecc cannot use), then leave at once: a clean
    shutdown could block on dead peers."""
    results.put((status, rank, message))
    results.close()
    results.join_thread()
    os._exit(1)


def spawn(
    worker: Worker,
    world: int,
    payload: Any,
    *,
    backend: str = "gloo",
    timeout: float = 300.0,
    deadline: float | None = None,
) -> list[Any]:
    """Run `worker(rank, world, payload)` in `world` new processes; their results by rank.

    Raises `RankError` naming every rank that failed, once all have stopped (exit 2, as
    an `InputError`, when every rank refused its input alike: a program that does not fit
    the model); `deadline` (seconds, else `PIPECC_SPAWN_DEADLINE`, else none) bounds the
    whole run.
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    address = (free_port(), backend, timeout)
    processes = [
        context.Process(target=_bootstrap, args=(r, world, address, worker, payload, results))
        for r in range(world)
    ]
    _start(processes)
    try:
        values, failures, refused = _collect(processes, results, _end(deadline))
    finally:
        _stop(processes)
    if failures:
        failure = _failure(failures)
        if refused == set(failures):
            failure.exit_code = 2
        raise failure
    return [torch.load(io.BytesIO(values[r]), weights_only=False) for r in range(world)]


# a rank told of another's failure says so (runtime/comm/failure.py)
CONSEQUENCES = ("Connection closed by peer", "Connection reset by peer", STOPPED, FAILED_AT)


def _failure(failures: dict[int, str]) -> RankError:
    """The first rank that failed on its own, with the others (mostly its victims) as notes;
    an error every rank raised alike (a setup error agreed by all) is said once."""
    ordered = sorted(failures.items(), key=lambda item: (_is_consequence(item[1]), item[0]))
    first, *rest = (text for _, text in ordered)
    return RankError(
        first, notes=tuple((None, text) for text in dict.fromkeys(rest) if text != first)
    )


def _is_consequence(text: str) -> bool:
    return any(marker in text for marker in CONSEQUENCES)


def _start(processes: list[Any]) -> None:
    """Start the ranks with RANK_ENV added to this process's environment for the moment."""
    added = {key: value for key, value in RANK_ENV if key not in os.environ}
    os.environ.update(added)
    try:
        for process in processes:
            process.start()
    finally:
        for key in added:
            del os.environ[key]


def _end(deadline: float | None) -> tuple[float, float] | None:
    """(the monotonic time the run must end by, the deadline in seconds), or None."""
    if deadline is None and os.environ.get(DEADLINE_ENV):
        deadline = float(os.environ[DEADLINE_ENV])
    return None if deadline is None else (time.monotonic() + deadline, deadline)


def _collect(
    processes: list[Any], results: Any, end: tuple[float, float] | None
) -> tuple[dict[int, bytes], dict[int, str], set[int]]:
    """Each rank's result, or its error, and the ranks whose error refused their input."""
    values: dict[int, bytes] = {}
    failures: dict[int, str] = {}
    refused: set[int] = set()
    failed_at: float | None = None
    while len(values) + len(failures) < len(processes):
        if failed_at is not None and time.monotonic() - failed_at > GRACE:
            break
        if end is not None and time.monotonic() > end[0]:
            _past_deadline(processes, values, failures, end[1])
            break
        try:
            status, rank, data = results.get(timeout=0.1)
        except queue.Empty:
            _note_deaths(processes, values, failures)
        else:
            (values if status == "ok" else failures)[rank] = data
            if status == "refused":
                refused.add(rank)
        if failures and failed_at is None:
            failed_at = time.monotonic()
    for rank in range(len(processes)):
        if rank not in values and rank not in failures:
            failures[rank] = f"rank {rank}: {STOPPED}"
    return values, failures, refused


def _past_deadline(
    processes: list[Any], values: dict[int, bytes], failures: dict[int, str], seconds: float
) -> None:
    for rank in range(len(processes)):
        if rank not in values and rank not in failures:
            failures[rank] = (
                f"rank {rank}: still running after the run's deadline of {seconds:g} s "
                f"({DEADLINE_ENV} or spawn's deadline): stopped (a hang?)"
            )


def _note_deaths(processes: list[Any], values: dict[int, bytes], failures: dict[int, str]) -> None:
    for rank, process in enumerate(processes):
        code = process.exitcode
        if code is None or rank in values or rank in failures:
            continue
        if code < 0:
            name = signal.Signals(-code).name
            failures[rank] = f"rank {rank}: the process died (killed by {name})"
        elif code != 0:
            failures[rank] = f"rank {rank}: the process exited with code {code}"


def _stop(processes: list[Any]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()
