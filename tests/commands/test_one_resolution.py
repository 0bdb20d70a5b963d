"""One resolution: `compile`, `verify`, `simulate` and `run` get the identical program for
the same input and flags.

Every command reads its input and places its comm ops through `driver/load.resolve_source`
(docs/architecture.md, "One way from a file to a program"), so `pipecc verify X [flags]`
proves what `pipecc run X [flags]` runs. This grid holds them to it: each input kind (a
.sched file, a compute-only torch CSV, a compiled .json with its comm ops) times each flag
they share (`--lowering torch`, `--mesh`, `--align`, `--comm-policy`, and both together with
`--mesh`), on both backends, through each command's own entry point with its real parser.
An input a flag cannot apply to is refused by all four alike (exit 2). Before, `verify
--lowering torch --mesh dp_replicate=2` checked the program without the mesh (48
instructions on 2 ranks) while `compile` wrote it with the mesh (104 on 4).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from pipecc.api import compile_schedule
from pipecc.cli import build_parser
from pipecc.commands import run as run_command
from pipecc.commands.common import backend_of, comm_model, load_input, lowering
from pipecc.commands.verify import verified
from pipecc.diagnostics import InputError
from pipecc.driver.check import Resolution
from pipecc.interop import json_program, torch_csv
from pipecc.ir.program import Program
from pipecc.verify import Options

P, M = 2, 4
COSTS = "F=1,B=2,I=1,W=1,comm=0.1"
FLAGS = {
    "default": [],
    "lowering torch": ["--lowering", "torch"],
    "mesh": ["--mesh", "dp_replicate=2"],
    "lowering torch + mesh": ["--lowering", "torch", "--mesh", "dp_replicate=2"],
    "align": ["--align", "--cost", COSTS],
    "align + mesh": ["--align", "--cost", COSTS, "--mesh", "dp_replicate=2"],
    "comm-policy": ["--comm-policy", "early-recv"],
}
Getter = Callable[[str, list[str], str], Program]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("inputs")
    program = compile_schedule("zb_h1", ranks=P, microbatches=M)
    csv, json = folder / "zb_h1.csv", folder / "zb_h1.json"
    csv.write_text(torch_csv.dumps(program))  # compute-only: torch's actions, no comm cells
    json.write_text(json_program.dumps(program))
    return {"sched": "zb_h1", "csv": str(csv), "json": str(json)}


def _args(command: str, path: str, flags: list[str], sizes: list[str]) -> argparse.Namespace:
    return build_parser().parse_args([command, path, *sizes, *flags])


def _sizes(path: str, ranks_flag: str = "-P") -> list[str]:
    return [ranks_flag, str(P), "-M", str(M)] if not path.endswith((".json", ".csv")) else []


def _compile(path: str, flags: list[str], backend: str) -> Program:
    args = _args("compile", path, [*flags, "--backend", backend], _sizes(path))
    return load_input(args.file, args)


def _simulate(path: str, flags: list[str], backend: str) -> Program:
    args = _args("simulate", path, [*flags, "--backend", backend], _sizes(path))
    return load_input(args.file, args)


def _verify(path: str, flags: list[str], backend: str) -> Program:
    args = _args("verify", path, [*flags, "--backend", backend], _sizes(path))
    resolution = Resolution(backend_of(args), lowering(args, backend_of(args)))
    options = Options(models=(comm_model(args),))
    _, resolved = verified(args.files[0], args, options, resolution)
    assert resolved is not None  # (a program may fail the check: it is still the one checked)
    return resolved.program


def _run(path: str, flags: list[str], backend: str) -> Program:
    sizes = _sizes(path, "--nproc")
    if "--mesh" in flags:  # with --mesh, --nproc is the world: pp × dp_replicate
        sizes = ["--nproc", str(2 * P), *sizes[2:]]
    args = _args("run", path, [*flags, "--model", "examples/mlp.py", "--unverified"], sizes)
    return run_command.program_to_run(args, lambda _: backend).resolved.program


COMMANDS: dict[str, Getter] = {
    "compile": _compile,
    "simulate": _simulate,
    "verify": _verify,
    "run": _run,
}


def _outcome(get: Getter, path: str, flags: list[str], backend: str) -> Program | str | None:
    """The command's program, its refusal of the input, or None: it has no such flag."""
    try:
        return get(path, flags, backend)
    except InputError as err:
        return f"InputError: {err.message}"
    except SystemExit:  # argparse: the command takes none of these flags
        return None


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("kind", ["sched", "csv", "json"])
@pytest.mark.parametrize("flags", sorted(FLAGS))
def test_every_command_gets_the_same_program(
    inputs: dict[str, str], kind: str, flags: str, backend: str
) -> None:
    path = inputs[kind]
    found = {name: _outcome(get, path, FLAGS[flags], backend) for name, get in COMMANDS.items()}
    got = {name: program for name, program in found.items() if program is not None}
    assert {"compile", "verify", "run"} <= set(got), "the flags compile, verify and run share"
    first = got["compile"]
    assert all(found == first for found in got.values()), {
        name: found if isinstance(found, str) else f"{found.num_instructions()} instructions"
        for name, found in got.items()
    }


def test_the_torch_lowering_keeps_the_mesh(inputs: dict[str, str]) -> None:
    """The case the one resolution fixed: verify dropped --mesh under --lowering torch."""
    program = _verify(inputs["sched"], FLAGS["lowering torch + mesh"], "nccl")
    assert program.mesh is not None and program.mesh.dp_replicate == 2
    assert program.comm == "torch"
    assert program == _compile(inputs["sched"], FLAGS["lowering torch + mesh"], "nccl")


def test_an_input_a_flag_cannot_apply_to_is_refused_alike(inputs: dict[str, str]) -> None:
    """torch's lowering lowers a compute order: a .json with its comm ops is bad input."""
    found = {
        name: _outcome(get, inputs["json"], FLAGS["lowering torch"], "nccl")
        for name, get in COMMANDS.items()
    }
    assert all(isinstance(f, str) and "lowers a compute-only schedule" in f for f in found.values())


def test_the_grid_would_see_a_command_that_resolves_apart(inputs: dict[str, str]) -> None:
    """A command that dropped a flag (as verify dropped --mesh) makes the grid fail."""
    path, flags = inputs["sched"], FLAGS["mesh"]
    assert _verify(path, flags, "nccl") == _compile(path, flags, "nccl")
    without = [f for f in flags if f not in ("--mesh", "dp_replicate=2")]
    assert _verify(path, without, "nccl") != _compile(path, flags, "nccl")
