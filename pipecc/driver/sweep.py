"""Verify a .sched file at every size of a range and every value of its swept parameters
(`pipecc verify --sweep ranks=2..8 microbatches=1..40 frac=2,3`, the pytest plugin), keeping
every failing size, grouped into distinct failures (`SweepResult.distinct`).

result = sweep_file("schedules/zbv.sched", ranks=range(2, 9), microbatches=range(1, 41))
result = sweep_file("my.sched", ranks=(4, 8), microbatches=range(8, 33), params={"frac": (2, 3)})
"""

from __future__ import annotations

import itertools
import multiprocessing
import re
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from pipecc.diagnostics import InputError, LoweringViolation, RequirementError, ScheduleError
from pipecc.driver.check import DEFAULT_RESOLUTION, Outcome, Resolution, Unusable
from pipecc.driver.compile import order_tree, violation_report
from pipecc.driver.files import read_text, resolve_schedule
from pipecc.driver.load import Source, resolve_source
from pipecc.frontend.ast import Param, ScheduleFile
from pipecc.frontend.parser import parse
from pipecc.ir.program import Program
from pipecc.verify import DEFAULT_OPTIONS, Options, verify


@dataclass(frozen=True, slots=True)
class Size:
    """One point of a sweep: P, M and the values of the swept `-D` parameters the schedule
    declares, written `P=4 M=8 frac=2` (`label`) and `P4-M8-frac2` (`name`, pytest's)."""

    ranks: int
    microbatches: int
    params: tuple[tuple[str, int], ...] = ()

    @property
    def label(self) -> str:
        return " ".join([f"P={self.ranks}", f"M={self.microbatches}", *self._params("=")])

    @property
    def name(self) -> str:
        return "-".join([f"P{self.ranks}", f"M{self.microbatches}", *self._params("")])

    def _params(self, sep: str) -> list[str]:
        return [f"{key}{sep}{value}" for key, value in self.params]


@dataclass(frozen=True, slots=True)
class Skip:
    """A size the schedule's `require`s reject: (P, M, parameters) and the violated
    requirement."""

    ranks: int
    microbatches: int
    reason: str
    params: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class CompileFailure:
    """A size the schedule's requires allow but that does not compile (a schedule bug that
    shows only at some sizes, as pytorch/torchtitan#775)."""

    label: str
    error: ScheduleError


@dataclass(frozen=True, slots=True)
class Failure:
    """A failing size: what makes it the same failure as another size (`signature`: the
    violations' codes and source locations, or where the compilation stops), and the full
    report, kept for the first size of each signature only (None for the others)."""

    size: Size
    signature: str
    found: Outcome | CompileFailure | None


@dataclass(frozen=True, slots=True)
class Distinct:
    """One distinct failure of a sweep: its first size's report and every size it occurs
    at, in sweep order."""

    signature: str
    found: Outcome | CompileFailure
    sizes: tuple[Size, ...]


@dataclass(frozen=True, slots=True)
class SweepResult:
    """A sweep of one file: sizes verified clean, sizes skipped, and every failing size (a
    size that fails verification, or does not compile although its requires hold)."""

    path: str
    verified: int
    skipped: tuple[Skip, ...]
    failures: tuple[Failure, ...] = ()
    ran: tuple[tuple[Size, str], ...] = ()  # every size in sweep order: ok, skipped, failed

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failed(self) -> Outcome | CompileFailure | None:
        """The first failing size's report (None when every size passed)."""
        return self.failures[0].found if self.failures else None

    @property
    def compile_failed(self) -> bool:
        """Some size does not compile although its requires allow it (exit 2)."""
        return any(f.signature.startswith(DOES_NOT_COMPILE) for f in self.failures)

    def distinct(self) -> list[Distinct]:
        """The failures grouped by signature, in the order of their first size."""
        groups: dict[str, list[Failure]] = {}
        for failure in self.failures:
            groups.setdefault(failure.signature, []).append(failure)
        found = []
        for signature, failures in groups.items():
            first = next(f.found for f in failures if f.found is not None)
            found.append(Distinct(signature, first, tuple(f.size for f in failures)))
        return found


DOES_NOT_COMPILE = "does not compile"
OK, SKIPPED, FAILED = "ok", "skipped", "failed"  # a size's verdict in `SweepResult.ran`


def signature(found: Outcome | CompileFailure) -> str:
    """What makes two failing sizes the same failure: each violation's code and the source
    location it points at (`error[mismatch] at x.sched:3:22`), or where the compilation
    stops (its location, or its message without one)."""
    if isinstance(found, CompileFailure):
        span = found.error.span
        return f"{DOES_NOT_COMPILE}: " + (
            f"error at {span.location()}" if span else found.error.message.splitlines()[0]
        )
    parts = (
        f"error[{v.code}]" + (f" at {v.span.location()}" if v.span else "")
        for v in found.report.violations
    )
    return ", ".join(dict.fromkeys(parts))


class Schedule:
    """A .sched file parsed once, compiled at any size (a sweep compiles thousands)."""

    def __init__(self, path: str) -> None:
        resolved = resolve_schedule(path)
        self.path = path
        self.tree: ScheduleFile = parse(read_text(resolved), str(resolved))

    @property
    def params(self) -> tuple[str, ...]:
        """The parameters the file declares (`param NAME = ...`)."""
        return tuple(decl.name for decl in self.tree.decls if isinstance(decl, Param))

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
        source = Source.of(label, order, (), compiled=True)
        return resolve_source(source, resolution.backend, resolution.lowering).program


@dataclass(frozen=True, slots=True)
class Grid:
    """What a sweep runs: every P, every M and every value of each swept `-D` parameter
    (`--sweep ranks=4,8 microbatches=8..32 frac=2,3`), in that order."""

    ranks: tuple[int, ...]
    microbatches: tuple[int, ...]
    params: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def declared(self, names: Sequence[str]) -> Grid:
        """The grid of a schedule that declares `names`: the other parameters dropped."""
        params = tuple((key, values) for key, values in self.params if key in names)
        return Grid(self.ranks, self.microbatches, params)

    def sizes(self, ranks: Sequence[int] | None = None) -> Iterator[Size]:
        """Every size, P slowest, then M, then each parameter in the order given."""
        keys = [key for key, _ in self.params]
        combos = list(itertools.product(*(values for _, values in self.params)))
        for p in self.ranks if ranks is None else ranks:
            for m in self.microbatches:
                for combo in combos:
                    yield Size(p, m, tuple(zip(keys, combo, strict=True)))


_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)|(-?\d+)")
SIZE_NAMES = {"ranks": "ranks", "p": "ranks", "microbatches": "microbatches", "m": "microbatches"}


def parse_values(text: str, *, least: int | None = 1) -> tuple[int, ...]:
    """`2..8`, `4`, `2,4,8` or `1..4,8,16` -> the values, each ≥ `least` (sizes: 1; a
    parameter: None, any integer), in order."""
    found: list[int] = []
    for part in text.split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None:
            raise InputError(f"{text!r}: expected values like 2..8, 4 or 2,4,8")
        lo, hi, one = match.groups()
        values = range(int(lo), int(hi) + 1) if one is None else (int(one),)
        if not values or (least is not None and min(values) < least):
            raise InputError(
                f"{text!r}: sizes are integers ≥ 1 in ranges a..b with a ≤ b"
                if least is not None
                else f"{text!r}: ranges a..b need a ≤ b"
            )
        found.extend(v for v in values if v not in found)
    return tuple(found)


def parse_sizes(specs: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """`ranks=2..8 microbatches=1..40 frac=2,3` (P= and M= also accepted) -> {dimension:
    values}: `ranks`, `microbatches`, and each `-D` parameter by its name."""
    found: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        name = name.strip()
        key = SIZE_NAMES.get(name.lower(), name)
        if not sep or not key.isidentifier():
            raise InputError(
                f"{spec!r}: expected ranks=A..B, microbatches=A..B or a parameter NAME=A..B"
            )
        if key in found:
            raise InputError(f"{spec!r}: {key} is swept twice")
        try:
            found[key] = parse_values(value, least=1 if key in SIZE_NAMES.values() else None)
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
    params: tuple[tuple[str, int], ...] = (),
) -> Skip | Outcome:
    """Compile and verify one size (`params`: the swept parameters' values, with
    `defines`): a Skip when a `require` rejects it, else the Outcome. A size its requires
    allow but that does not compile raises the compiler's error."""
    size = Size(ranks, microbatches, params)
    label = f"{schedule.path} {size.label}"
    try:
        order = schedule.order(ranks, microbatches, {**defines, **dict(params)})
    except RequirementError as err:
        return Skip(ranks, microbatches, f"requires {err.requirement}", params)
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
    params: Mapping[str, Sequence[int]] | None = None,
) -> SweepResult:
    """Verify every size of `path` in the ranges (and every value of the swept parameters
    it declares), in order; every failing size is kept."""
    (result,) = sweep_files(
        [path],
        ranks=ranks,
        microbatches=microbatches,
        defines=defines,
        options=options,
        resolution=resolution,
        params=params,
    )
    if isinstance(result, Unusable):
        raise result.error
    return result


def sweep_files(
    paths: list[str],
    *,
    ranks: Sequence[int],
    microbatches: Sequence[int],
    defines: Mapping[str, int] | None = None,
    options: Options = DEFAULT_OPTIONS,
    jobs: int = 1,
    resolution: Resolution = DEFAULT_RESOLUTION,
    params: Mapping[str, Sequence[int]] | None = None,
) -> list[SweepResult | Unusable]:
    """`sweep_file` for several files, the sizes of each rank count being one task spread
    over `jobs` processes (a sweep of every bundled schedule over P ≤ 16, M ≤ 64 compiles
    and verifies ten thousand programs). A file that cannot be read or parsed is an
    Unusable in its place; the others are swept all the same. Each file sweeps the
    parameters it declares; one that no file declares is an error."""
    grid = Grid(
        tuple(ranks),
        tuple(microbatches),
        tuple((key, tuple(values)) for key, values in (params or {}).items()),
    )
    parsed = {path: _parse(path) for path in paths}
    _check_params(grid, [found for found in parsed.values() if isinstance(found, Schedule)])
    tasks = [
        (
            path,
            tuple(grid.declared(found.params).sizes((p,))),
            dict(defines or {}),
            options,
            resolution,
        )
        for path, found in parsed.items()
        if isinstance(found, Schedule)
        for p in grid.ranks
    ]
    if jobs <= 1 or len(tasks) < 2:
        parts = [_sweep_part(*task) for task in tasks]
    else:
        parts = _parallel(tasks, jobs)
    return [
        found
        if isinstance(found, Unusable)
        else _merge(
            path, [part for task, part in zip(tasks, parts, strict=True) if task[0] == path]
        )
        for path, found in parsed.items()
    ]


def _parse(path: str) -> Schedule | Unusable:
    """Parse errors surface here, once per file, in this process."""
    try:
        return Schedule(path)
    except InputError as err:
        return Unusable(path, path, err)


def _check_params(grid: Grid, schedules: list[Schedule]) -> None:
    """A swept parameter that no schedule declares is a mistake (a typo, a wrong file)."""
    for key, values in grid.params:
        if schedules and not any(key in found.params for found in schedules):
            shown = ", ".join(found.path for found in schedules)
            raise InputError(
                f"--sweep {key}={','.join(map(str, values))}: no schedule swept declares a "
                f"parameter '{key}' ({shown})"
            )


Task = tuple[str, tuple[Size, ...], dict[str, int], Options, Resolution]


def _parallel(tasks: list[Task], jobs: int) -> list[_Part]:
    context = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    )
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = [pool.submit(_sweep_part, *task) for task in tasks]
        return [future.result() for future in futures]


@dataclass(frozen=True, slots=True)
class _Part:
    """What one task found: sizes verified, sizes skipped, every failing size."""

    verified: int
    skipped: tuple[Skip, ...]
    failures: tuple[Failure, ...]
    ran: tuple[tuple[Size, str], ...]


def _sweep_part(
    path: str,
    todo: tuple[Size, ...],
    defines: dict[str, int],
    options: Options,
    resolution: Resolution = DEFAULT_RESOLUTION,
) -> _Part:
    schedule = Schedule(path)
    verified = 0
    skipped: list[Skip] = []
    failures: list[Failure] = []
    ran: list[tuple[Size, str]] = []
    seen: set[str] = set()  # the signatures whose report this part keeps already
    for size in todo:
        found: Skip | Outcome | CompileFailure
        try:
            found = check_size(
                schedule, size.ranks, size.microbatches, defines, options, resolution, size.params
            )
        except ScheduleError as err:
            found = CompileFailure(f"{path} {size.label}", err)
        if isinstance(found, Skip):
            skipped.append(found)
            ran.append((size, SKIPPED))
        elif isinstance(found, Outcome) and found.report.ok:
            verified += 1
            ran.append((size, OK))
        else:
            sig = signature(found)
            failures.append(Failure(size, sig, None if sig in seen else found))
            ran.append((size, FAILED))
            seen.add(sig)
    return _Part(verified, tuple(skipped), tuple(failures), tuple(ran))


def _merge(path: str, parts: list[_Part]) -> SweepResult:
    """Parts in size order; a report kept for the first size of each distinct failure."""
    verified, skipped, failures = 0, list[Skip](), list[Failure]()
    ran: list[tuple[Size, str]] = []
    seen: set[str] = set()
    for part in parts:
        verified += part.verified
        skipped += part.skipped
        ran += part.ran
        for failure in part.failures:
            if failure.found is not None and failure.signature in seen:
                failure = replace(failure, found=None)
            seen.add(failure.signature)
            failures.append(failure)
    return SweepResult(path, verified, tuple(skipped), tuple(failures), tuple(ran))
