"""pytest plugin: `pytest --pipecc schedules/` verifies every .sched file at every size.

Each (file, P, M) is one test item, `dualpipe.sched::P4-M8` (with the values of the swept
parameters the file declares, `vhalf.sched::P4-M8-frac2`); a size a `require` rejects is
skipped with the requirement as the reason; a failing size shows the verifier's full
report. A file that cannot be read or parsed is one failing item, `typo.sched::parse`, and
no size items; a compile error that several sizes share (a misspelt name) fails at the
first of them, and the others are skipped with a reason naming it. Sizes come from
`--pipecc-sizes` (the syntax of `pipecc verify --sweep`, default `ranks=2..8
microbatches=1..16`; `frac=2,3` sweeps a parameter), the model from `--pipecc-comm`
(default nccl, or `all`);
`--pipecc-stall-budget 0 --pipecc-cost F=1,B=2,comm=0.1` also fails placement-bound waits.

The plugin is registered through the `pytest11` entry point, so it loads wherever pipecc is
installed; without `--pipecc` it collects nothing and changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn, cast

import pytest

from pipecc.diagnostics import InputError, PipeccError
from pipecc.driver.sweep import Grid, Schedule, Size, Skip, check_size, parse_sizes
from pipecc.semantics import CommModel
from pipecc.semantics.costs import parse_cost_flag
from pipecc.verify import ALL_MODELS, Options, StallBudget
from pipecc.verify.report import text

DEFAULT_SIZES = "ranks=2..8 microbatches=1..16"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pipecc", "pipeline schedule verification (pipecc)")
    group.addoption(
        "--pipecc",
        action="store_true",
        default=False,
        help="collect .sched files as tests: verify each at every size",
    )
    group.addoption(
        "--pipecc-sizes",
        default=DEFAULT_SIZES,
        metavar="SPEC",
        help=f"sizes to verify (default: {DEFAULT_SIZES!r})",
    )
    group.addoption(
        "--pipecc-comm",
        default="nccl",
        choices=[*(m.value for m in CommModel), "all"],
        help="comm model to verify under (default: nccl)",
    )
    group.addoption(
        "--pipecc-stall-budget",
        default=None,
        metavar="T|P%",
        help="also fail on placement-bound waits longer than this "
        "(needs --pipecc-cost; docs/align.md)",
    )
    group.addoption(
        "--pipecc-cost",
        default=None,
        metavar="K=V,...",
        help="costs for --pipecc-stall-budget, as pipecc's --cost",
    )


def pytest_collect_file(parent: pytest.Collector, file_path: Path) -> pytest.Collector | None:
    if file_path.suffix == ".sched" and parent.config.getoption("pipecc"):
        return ScheduleFile.from_parent(parent, path=file_path)
    return None


def _sizes(spec: str) -> Grid:
    """`ranks=2..8 microbatches=1..16 frac=2,3` -> the ranks, microbatch counts and
    parameter values to verify."""
    try:
        found = parse_sizes(spec.split())
    except InputError as err:
        raise pytest.UsageError(f"--pipecc-sizes: {err.message}") from None
    if not {"ranks", "microbatches"} <= set(found):
        raise pytest.UsageError("--pipecc-sizes needs ranks=A..B and microbatches=A..B")
    ranks, microbatches = found.pop("ranks"), found.pop("microbatches")
    return Grid(ranks, microbatches, tuple(found.items()))


def _stall_options(config: pytest.Config) -> dict[str, Any]:
    budget, cost = config.getoption("pipecc_stall_budget"), config.getoption("pipecc_cost")
    if budget is None:
        return {}
    if cost is None:
        raise pytest.UsageError("--pipecc-stall-budget needs --pipecc-cost K=V,...")
    try:
        return {"costs": parse_cost_flag(cost), "stall_budget": StallBudget.parse(budget)}
    except PipeccError as err:
        raise pytest.UsageError(err.message) from None


class ScheduleFile(pytest.File):
    """One .sched file, parsed once: one item per size, or one failing item if it cannot be
    read or parsed. Remembers the compile errors its sizes raised, to report each once."""

    schedule: Schedule
    first_errors: dict[tuple[str | None, str], str]

    def collect(self) -> Iterator[pytest.Item]:
        grid = _sizes(self.config.getoption("pipecc_sizes"))
        comm = self.config.getoption("pipecc_comm")
        models = ALL_MODELS if comm == "all" else (CommModel(comm),)
        options = Options(models=models, **_stall_options(self.config))
        try:
            self.schedule = Schedule(str(self.path))
        except InputError as err:
            yield UnusableItem.from_parent(self, name="parse", error=err)
            return
        self.first_errors = {}
        for size in grid.declared(self.schedule.params).sizes():
            yield SizeItem.from_parent(self, name=size.name, size=size, options=options)


class SizeItem(pytest.Item):
    """Compile one .sched file at (P, M) and verify it."""

    def __init__(self, *, size: Size, options: Options, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.size = size
        self.options = options

    def runtest(self) -> None:
        file = cast("ScheduleFile", self.parent)
        try:
            size = self.size
            found = check_size(
                file.schedule, size.ranks, size.microbatches, {}, self.options, params=size.params
            )
        except InputError as err:
            self._skip_if_reported(file, err)
            raise
        if isinstance(found, Skip):
            self._skip(found.reason)
        if not found.report.ok:
            raise VerificationFailed(text(found.report, found.label))

    def _skip_if_reported(self, file: ScheduleFile, err: InputError) -> None:
        """A compile error that an earlier size of this file raised, at the same place with
        the same message, is skipped here: it fails once, where it first appeared."""
        where = err.span.location() if err.span is not None else None
        first = file.first_errors.setdefault((where, err.message), self.name)
        if first != self.name:
            at = f"{where}: " if where else ""
            said = err.message.splitlines()[0] if err.message else ""
            self._skip(f"the same error as {self.path.name}::{first} ({at}{said})")

    def _skip(self, reason: str) -> NoReturn:
        # reported at the .sched file rather than at this line of the plugin
        raise pytest.skip.Exception(f"{self.size.label}: {reason}", _use_item_location=True)

    def repr_failure(
        self, excinfo: pytest.ExceptionInfo[BaseException], style: str | None = None
    ) -> str:
        if isinstance(excinfo.value, VerificationFailed | PipeccError):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"{self.path.name} {self.size.label}"


class UnusableItem(pytest.Item):
    """A .sched file that cannot be read or parsed: one failure, with the error in full."""

    def __init__(self, *, error: InputError, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.error = error

    def runtest(self) -> None:
        raise self.error

    def repr_failure(
        self, excinfo: pytest.ExceptionInfo[BaseException], style: str | None = None
    ) -> str:
        return str(excinfo.value)

    def reportinfo(self) -> tuple[Path, int, str]:
        line = self.error.span.line - 1 if self.error.span is not None else 0
        return self.path, line, f"{self.path.name}: cannot be read or parsed"


class VerificationFailed(Exception):
    """A size whose program the verifier rejects (the message is the full report)."""
