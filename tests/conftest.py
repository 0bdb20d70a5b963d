"""The test tiers, and what every test run sets up.

Two tiers (docs/architecture.md#tests): `make test-fast` runs every test not marked `slow`,
`make test` (what CI runs) runs everything. A test is `slow` when it starts a process (a
`subprocess`, a `multiprocessing` process: the runtime's process groups, `torchrun`, the
`pipecc` CLI in a child) or joins a torch process group in the test process itself. The
files in `SLOW_FILES` are slow as a whole, the tests in `SLOW_TESTS` one by one (a list here
rather than a decorator in each file); a test may also carry `@pytest.mark.slow` itself.

The marker is kept true by a guard, not by review: in a test not marked slow (its fixtures
included), starting a process or a process group fails the test at once, naming it
(`SpawnInFastTest`). tests/test_tiers.py checks the guard and the list.

The knobs tests read from the environment: `PIPECC_SPAWN_DEADLINE` (below),
`PIPECC_TEST_FAULT`, `PIPECC_TEST_BLOCKS`, `PIPECC_TEST_LOG`, `PIPECC_SPLIT_BUG`,
`PIPECC_MLP_HIDDEN` and `PIPECC_GPT_DROPOUT` (set by the tests for the processes they start).
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import pytest

# A process group that hangs fails its test after 15 minutes instead of holding CI until
# its own limit (runtime/tools/spawn.py; a rank that spins never meets gloo's timeout).
os.environ.setdefault("PIPECC_SPAWN_DEADLINE", "900")

# Let tests import their helper modules (tests/helpers.py, tests/torch_oracle.py).
TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

# Files every test of which starts processes or a process group (paths under tests/).
SLOW_FILES = frozenset(
    {
        "runtime/test_guard.py",
        "runtime/test_nccl_emulation.py",
        "interop/test_stage_ops_fsdp.py",
        "interop/test_stage_ops_runtime.py",
        "interop/test_torch_runtime.py",
        "runtime/test_gpu_check.py",
        "runtime/test_plan.py",
        "runtime/test_run_verified.py",
        "test_determinism.py",
        "verify/test_pytest_plugin.py",
        "runtime/test_discovery.py",
        "runtime/test_examples.py",
        "runtime/test_memory_measured.py",
        "runtime/test_mesh_dropout.py",
        "runtime/test_mesh_runtime.py",
        "runtime/test_own_stages.py",
        "runtime/test_partition_run.py",
        "runtime/test_posting.py",
        "runtime/test_profile_cli.py",
        "runtime/test_recompute.py",
        "runtime/test_recompute_tied.py",
        "runtime/test_run_cli.py",
        "runtime/test_runtime_gpt.py",
        "runtime/test_runtime_gpu.py",
        "runtime/test_runtime_schedules.py",
        "runtime/test_spawn_deadline.py",
        "runtime/test_training_features.py",
        "runtime/test_whole_reference.py",
    }
)

# Single tests that do, in files whose other tests do not (`file::function`, every
# parametrization of the function).
SLOW_TESTS = frozenset(
    {
        "commands/test_compile_cli.py::test_console_script_is_installed",
        "commands/test_compile_cli.py::test_help_explains_formats_and_exit_codes",
        "commands/test_resolution.py::test_a_sweep_verifies_each_size_as_run_resolves_it",
        "runtime/test_compat.py::test_an_op_is_posted_on_its_group_to_the_peer_in_it",
        "runtime/test_compat.py::test_fsdp_post_backward_reduces_the_unsynced_gradients",
        "runtime/test_compat.py::test_dtensor_local_shape_is_the_shards_shape",
        "runtime/test_compat.py::test_the_default_store_is_the_jobs_and_none_without_a_job",
        "verify/test_sweep_params.py::test_parallel_sweep_matches_serial",
        "runtime/test_compat.py::test_gloo_does_not_coalesce",
        "runtime/test_overhead_benchmark.py::test_the_floor_adds_the_message_latency_to_the_chain",
        "runtime/test_runtime_units.py::test_discovery_runs_a_stage_that_adds_a_loss_to_a_tuple",
        "runtime/test_runtime_units.py::test_the_runtime_refuses_a_gloo_only_program_on_nccl",
        "runtime/test_weight_contract.py::test_the_runtime_defers_linear_weights_to_w",
        "search/test_search_cli.py::test_a_written_sched_compiles_verifies_and_runs",
        "search/test_search_cli.py::test_the_pytest_plugin_verifies_a_written_sched",
        "test_layering.py::test_compiler_verifier_simulator_run_without_torch",
        "verify/test_stall_budget.py::test_pytest_plugin_applies_the_budget",
        # `--sweep` verifies its sizes over a process pool (pipecc/driver/sweep.py)
        "verify/test_verify_cli.py::test_sweep_in_parallel_matches_serial",
        "verify/test_verify_docs.py::test_documented_output_is_what_the_tool_prints",
        "verify/test_verify_several.py::test_a_name_error_in_a_sweep_is_one_unusable_size",
    }
)


class SpawnInFastTest(Exception):
    """A test not marked slow started a process or a process group."""


def pytest_configure(config: pytest.Config) -> None:
    """matplotlib lists the system's fonts (a subprocess, `fc-list`) the first time it is
    imported on a machine and caches the list; done here, before any test's guard, so a
    fresh machine's first PNG test does not count as starting a process (and the cache,
    otherwise never written, is not built again by every such test)."""
    del config
    try:
        import matplotlib.font_manager  # noqa: F401
    except ImportError:  # the dev extra's optional pictures: their tests skip
        pass


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = _relative(item.path)
        name = getattr(item, "originalname", item.name)
        if path in SLOW_FILES or f"{path}::{name}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


def _relative(path: Path) -> str:
    try:
        return path.resolve().relative_to(TESTS).as_posix()
    except ValueError:  # a file outside tests/ (the pytest plugin's .sched items)
        return ""


@contextmanager
def refusing_processes(test: str) -> Iterator[None]:
    """Within: starting a subprocess, a multiprocessing process or a torch process group
    raises `SpawnInFastTest` naming `test`."""

    def refuse(what: str) -> Callable[..., NoReturn]:
        def refused(*args: Any, **kwargs: Any) -> NoReturn:
            raise SpawnInFastTest(
                f"{test} starts {what} but is not marked slow: mark it "
                "@pytest.mark.slow, or list its file in tests/conftest.py's SLOW_FILES"
            )

        return refused

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", refuse("a subprocess"))
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse("a process"))
        dist = sys.modules.get("torch.distributed")
        if dist is not None and hasattr(dist, "init_process_group"):
            patch.setattr(dist, "init_process_group", refuse("a torch process group"))
        yield


@contextmanager
def _tier_guard(item: pytest.Item) -> Iterator[None]:
    if item.get_closest_marker("slow") is not None:
        yield
        return
    with refusing_processes(item.nodeid):
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    with _tier_guard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    with _tier_guard(item):
        return (yield)
