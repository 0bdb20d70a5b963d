"""Verify a .sched file at every size of a range (`pipecc verify --sweep`, the pytest plugin).

result = sweep_file("schedules/zbv.sched", ranks=range(2, 9), microbatches=range(1, 41))
"""

from __future__ import annotations

import multiprocessing
import re
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from pipecc.diagnostics import InputError, LoweringViolation, RequirementError, ScheduleError
from pipecc.driver.check import DEFAULT_RESOLUTION, Outcome, Resolution, Unusable
from pipecc.driver.compile import order_tree, violation_report
from pipecc.driver.files import read_text, resolve_schedule
from pipecc.driver.load import Source, resolve_source
from pipecc.frontend.ast import ScheduleFile
from pipecc.frontend.parser import parse
from pipecc.ir.program import Program
from pipecc.verify import DEFAULT_OPTIONS, Options, verify


@dataclass(frozen=True, slots=True)
class Skip:
    """A size the schedule's `require`s reject: (P, M) and the violated requirement."""

    ranks: int
    microbatches: int
    reason: str


@dataclass(frozen=True, slots=True)
class CompileFailure:
    """A size the schedule's requires allow but that does not compile (a schedule bug that
    shows only at some sizes, as pytorch/torchtitan#775)."""

    label: str
    error: ScheduleError


@dataclass(frozen=True, slots=True)
class SweepResult:
    """A sweep of one file: sizes verified clean, sizes skipped, and the first failure (a
    size that fails verification, or does not compile although its requires hold)."""

    path: str
    verified: int
    skipped: tuple[Skip, ...]
    failed: Outcome | CompileFailure | None

    @property
    def ok(self) -> bool:
        return self.failed is None


class Schedule:
    """A .sched file parsed once, compiled at any size (a sweep compiles thousands)."""

    def __init__(self, path: str) -> None:
        resolved = resolve_schedule(path)
        self.path = path
        self.tree: ScheduleFile = parse(read_text(resolved), str(resolved))

    def compile(
        self,
        ranks: int,
        microbatches: int,
        defines: Mapping[str, int],
        resolution: Resolution = DEFAULT_RESOLUTION,
    ) -> Program:
        """The program of one size, resolved as `pipecc run` resolves it on the backend
        (`pipecc.driver.load.resolve_source`: the default nccl resolution compiles it as
        `pipecc compile` does)."""
        order = self.order(ranks, microbatches, defines)
        return self.lower(order, resolution)

    def order(self, ranks: int, microbatches: int, defines: Mapping[str, int]) -> Program:
        """The compute order of one size, with its hand-placed comm ops (`order_tree`)."""
        return order_tree(self.tree, ranks=ranks, microbatches=microbatches, defines=defines)

    def lower(self, order: Program, resolution: Resolution = DEFAULT_RESOLUTION) -> Program:
        """`order` resolved for the backend (`compile`)."""
        label = f"{self.path} P={order.num_ranks} M={order.num_microbatches}"
        source = Source(label, order, (), compiled=True)
        return resolve_source(source, resolution.backend, resolution.lowering).program


def sizes(ranks: Sequence[int], microbatches: Sequence[int]) -> Iterator[tuple[int, int]]:
    for p in ranks:
        for m in microbatches:
            yield p, m


_RANGE = re.compile(r"(\d+)\.\.(\d+)|(\d+)")
SIZE_NAMES = {"ranks": "ranks", "p": "ranks", "microbatches": "microbatches", "m": "microbatches"}


def parse_values(text: str) -> tuple[int, ...]:
    """`2..8`, `4`, `2,4,8` or `1..4,8,16` -> the sizes, each ≥ 1, in order."""
    found: list[int] = []
    for part in text.split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None:
            raise InputError(f"{text!r}: expected sizes like 2..8, 4 or 2,4,8")
        lo, hi, one = match.groups()
        values = range(int(lo), int(hi) + 1) if one is None else (int(one),)
        if not values or min(values) < 1:
            raise InputError(f"{text!r}: sizes are integers ≥ 1 in ranges a..b with a ≤ b")
        found.extend(v for v in values if v not in found)
    return tuple(found)


def parse_sizes(specs: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """`ranks=2..8 microbatches=1..40` (P= and M= also accepted) -> {dimension: sizes}."""
    found: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        key = SIZE_NAMES.get(name.strip().lower())
        if not sep or key is None:
            raise InputError(f"{spec!r}: expected ranks=A..B or microbatches=A..B")
        try:
            found[key] = parse_values(value)
        except InputError as err:
            raise InputError(f"{name}={err.message}") from None
    return found


def check_size(
    schedule: Schedule,
    ranks: int,
    microbatches: int,
    defines: Mapping[str, int],
    options: Options,
    resolution: Resolution = DEFAULT_RESOLUTION,
) -> Skip | Outcome:
    """Compile and verify one size: a Skip when a `require` rejects it, else the Outcome.
    A size its requires allow but that does not compile raises the compiler's error."""
    label = f"{schedule.path} P={ranks} M={microbatches}"
    try:
        order = schedule.order(ranks, microbatches, defines)
    except RequirementError as err:
        return Skip(ranks, microbatches, f"requires {err.requirement}")
    try:
        program = schedule.lower(order, resolution)
    except LoweringViolation:  # the verifier's report of it, as `pipecc verify` gives
        found = violation_report(order, options)
        if found is None:
            raise
        return Outcome(label, found)
    return Outcome(label, verify(program, options))


def sweep_file(
    path: str,
    *,
    ranks: Sequence[int],
    microbatches: Sequence[int],
    defines: Mapping[str, int] | None = None,
    options: Options = DEFAULT_OPTIONS,
    resolution: Resolution = DEFAULT_RESOLUTION,
) -> SweepResult:
    """Verify every size of `path` in the ranges, in order; stop at the first failing size."""
    todo = tuple(sizes(ranks, microbatches))
    found = _sweep_part(path, todo, dict(defines or {}), options, resolution)
    return _merge(path, [found])


def sweep_files(
    paths: list[str],
    *,
    ranks: Sequence[int],
    microbatches: Sequence[int],
    defines: Mapping[str, int] | None = None,
    options: Options = DEFAULT_OPTIONS,
    jobs: int = 1,
    resolution: Resolution = DEFAULT_RESOLUTION,
) -> list[SweepResult | Unusable]:
    """`sweep_file` for several files, the sizes of each rank count being one task spread
    over `jobs` processes (a sweep of every bundled schedule over P ≤ 16, M ≤ 64 compiles
    and verifies ten thousand programs). A file that cannot be read or parsed is an
    Unusable in its place; the others are swept all the same."""
    unusable = {path: found for path in paths if (found := _parse_error(path)) is not None}
    tasks = [
        (path, tuple(sizes((p,), microbatches)), dict(defines or {}), options, resolution)
        for path in paths
        if path not in unusable
        for p in ranks
    ]
    if jobs <= 1 or len(tasks) < 2:
        parts = [_sweep_part(*task) for task in tasks]
    else:
        parts = _parallel(tasks, jobs)
    return [
        unusable.get(path)
        or _merge(path, [part for task, part in zip(tasks, parts, strict=True) if task[0] == path])
        for path in paths
    ]


def _parse_error(path: str) -> Unusable | None:
    """Parse errors surface here, once per file, in this process."""
    try:
        Schedule(path)
    except InputError as err:
        return Unusable(path, path, err)
    return None


Task = tuple[str, tuple[tuple[int, int], ...], dict[str, int], Options, Resolution]


def _parallel(tasks: list[Task], jobs: int) -> list[_Part]:
    context = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    )
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = [pool.submit(_sweep_part, *task) for task in tasks]
        return [future.result() for future in futures]


@dataclass(frozen=True, slots=True)
class _Part:
    """What one task found: sizes verified, sizes skipped, the first failure."""

    verified: int
    skipped: tuple[Skip, ...]
    failed: Outcome | CompileFailure | None


def _sweep_part(
    path: str,
    todo: tuple[tuple[int, int], ...],
    defines: dict[str, int],
    options: Options,
    resolution: Resolution = DEFAULT_RESOLUTION,
) -> _Part:
    schedule = Schedule(path)
    verified = 0
    skipped: list[Skip] = []
    for p, m in todo:
        try:
            found = check_size(schedule, p, m, defines, options, resolution)
        except ScheduleError as err:
            failure = CompileFailure(f"{path} P={p} M={m}", err)
            return _Part(verified, tuple(skipped), failure)
        if isinstance(found, Skip):
            skipped.append(found)
        elif not found.report.ok:
            return _Part(verified, tuple(skipped), found)
        else:
            verified += 1
    return _Part(verified, tuple(skipped), None)


def _merge(path: str, parts: list[_Part]) -> SweepResult:
    """Parts in size order: everything up to and including the first failure."""
    verified, skipped = 0, list[Skip]()
    for part in parts:
        verified += part.verified
        skipped += part.skipped
        if part.failed is not None:
            return SweepResult(path, verified, tuple(skipped), part.failed)
    return SweepResult(path, verified, tuple(skipped), None)
