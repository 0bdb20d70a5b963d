"""`pipecc verify X --backend B [flags]` proves what `pipecc run X [flags]` runs on B: for every
kind of input (a .sched file without and with hand-placed comm ops, a bundled name, a .json
with comm ops and a compute-only one, a torch CSV with and without comm cells), every way of
placing the comm ops (none given, --comm-policy, --align, --lowering torch where it applies)
and both backends, the program `run` would execute (its resolution, called with the backend:
no process starts) is byte for byte the JSON `compile --backend B` writes and the program
`verify --backend B` checks. The rule that decides it (docs/runtime.md) is checked beside."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import ROOT, compile_bundled, run_cli

import pipecc.driver.check
from pipecc.cli import build_parser
from pipecc.commands import run as run_command
from pipecc.driver.check import Resolution
from pipecc.driver.load import RunBackend
from pipecc.driver.sweep import Schedule
from pipecc.interop import json_program, torch_csv
from pipecc.ir.ops import Compute, Instr, Kind, Msg, Send, is_compute
from pipecc.ir.program import Program
from pipecc.passes.torch_program import compute_only
from pipecc.verify import Options, Report, verify

MODEL = str(ROOT / "examples" / "mlp.py")
# ZB-H1 with each gradient sent after the W that follows its I (docs/dsl.md §7.1): some comm
# ops placed by hand, where the default policy would not put them, the rest by the policy
HAND_PLACED = """\
schedule zb_h1_send_late
placement loop
require M >= P
phase warmup   { repeat P - rank { F } }
phase fill     { repeat rank { I F } }
phase steady   { repeat M - P { if rank > 0 { I W send grad F } else { I W F } } }
phase cooldown { repeat P - rank { if rank > 0 { I W send grad } else { I W } } }
phase drain    { repeat rank { W } }
"""
P, M = 2, 4
SIZES = ("-P", str(P), "-M", str(M))


def _write(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


# input kind -> (its path in a folder, whether it holds comm ops, whether it is a .sched)
INPUTS: dict[str, Callable[[Path], str]] = {
    "sched": lambda tmp: str(ROOT / "schedules" / "zb_h1.sched"),
    "sched-hand-placed": lambda tmp: _write(tmp, "send_late.sched", HAND_PLACED),
    "bundled": lambda tmp: "1f1b",
    "json": lambda tmp: _write(tmp, "zbv.json", json_program.dumps(compile_bundled("zbv", P, M))),
    "json-compute-only": lambda tmp: _write(
        tmp, "zbv_order.json", json_program.dumps(compute_only(compile_bundled("zbv", P, M)))
    ),
    "csv": lambda tmp: _write(tmp, "zb_h1.csv", torch_csv.dumps(compile_bundled("zb_h1", P, M))),
    "csv-comms": lambda tmp: _write(
        tmp, "zb_h1_comms.csv", torch_csv.dumps(compile_bundled("zb_h1", P, M), with_comms=True)
    ),
}
WITH_COMMS = {"sched-hand-placed", "json", "csv-comms"}
FLAGS = {
    "none": (),
    "default": ("--comm-policy", "default"),
    "early-recv": ("--comm-policy", "early-recv"),
    "align": ("--align", "--cost", "F=1,B=2,I=1,W=1,comm=0.25"),
    "torch": ("--lowering", "torch"),
}


def _sizes(kind: str) -> tuple[str, ...]:
    return SIZES if kind.startswith(("sched", "bundled")) else ()


def _illegal(kind: str, flag: str) -> bool:
    """torch's lowering lowers a compute order: a .json or .csv with comm ops is refused."""
    return flag == "torch" and kind in WITH_COMMS and kind != "sched-hand-placed"


def run_program(path: str, args: tuple[str, ...], backend: RunBackend) -> Program:
    """The program `pipecc run PATH ARGS` executes on `backend` (no process starts)."""
    parsed = build_parser().parse_args(["run", path, "--model", MODEL, "--unverified", *args])
    return run_command.program_to_run(parsed, lambda ranks: backend.value).resolved.program


def verified_program(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *argv: str
) -> Program:
    """The one program `pipecc verify ARGV` checks."""
    seen: list[Program] = []

    def recording(program: Program, options: Options) -> Report:
        seen.append(program)
        return verify(program, options)

    monkeypatch.setattr(pipecc.driver.check, "verify", recording)
    code, out, err = run_cli(capsys, "verify", *argv)
    assert code in (0, 1), out + err
    assert len(seen) == 1, "verified once"
    return seen[0]


CASES = [
    (kind, flag, backend)
    for kind in INPUTS
    for flag in FLAGS
    for backend in RunBackend
    if not _illegal(kind, flag)
]


@pytest.mark.parametrize(
    ("kind", "flag", "backend"), CASES, ids=[f"{k}-{f}-{b.value}" for k, f, b in CASES]
)
def test_run_executes_what_compile_writes_and_verify_checks(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    flag: str,
    backend: RunBackend,
) -> None:
    path = INPUTS[kind](tmp_path)
    args = (*_sizes(kind), *FLAGS[flag])
    ran = json_program.dumps(run_program(path, args, backend))
    capsys.readouterr()
    out = tmp_path / "compiled.json"
    code, _, err = run_cli(
        capsys, "compile", path, *args, "--backend", backend.value, "-o", str(out)
    )
    assert code == 0, err
    assert out.read_text() == ran, "compile --backend writes what run executes"
    checked = verified_program(capsys, monkeypatch, path, *args, "--backend", backend.value)
    assert json_program.dumps(checked) == ran, "verify --backend checks what run executes"
    _check_rule(kind, flag, backend, json_program.loads(ran), err)


def _check_rule(kind: str, flag: str, backend: RunBackend, ran: Program, err: str) -> None:
    """The rule of docs/runtime.md: the backend's policy for a compute-only input, the input's
    own comm ops kept otherwise, every op placed afresh (and said) with a flag."""
    hand, model = _sends_after_w(ran), backend.comm_model.value
    if flag == "none":
        assert "replaced" not in err
        if kind == "sched-hand-placed":
            assert (ran.comm, hand) == ("default", 3), "kept; the rest placed by the default"
        elif kind in WITH_COMMS:
            assert ran.comm in ("default", "torch-csv"), "as in the input"
        else:
            assert ran.comm == backend.policy, "a compute-only input gets the backend's policy"
        return
    assert hand == 0, "every comm op placed afresh"
    expected = {"align": "aligned", "torch": "torch"}.get(flag, flag)
    assert ran.comm.startswith(expected), ran.comm
    if kind in WITH_COMMS:
        said = " ".join(FLAGS[flag][:2]) if flag != "align" else f"--align under {model}"
        assert re.search(f"note: {said} replaced the \\d+ ", err), err


def _sends_after_w(program: Program) -> int:
    """The gradient sends whose rank's last compute op before them is a W: where the
    hand-placed schedule puts them, and no policy does."""
    found = 0
    for instrs in program.ranks:
        last: Instr | None = None
        for instr in instrs:
            if is_compute(instr):
                last = instr
            elif type(instr) is Send and instr.what is Msg.GRAD:
                found += type(last) is Compute and last.kind is Kind.W
    return found


@pytest.mark.parametrize("backend", list(RunBackend))
def test_comm_defaults_to_the_backends_model(
    capsys: pytest.CaptureFixture[str], backend: RunBackend
) -> None:
    """Without --comm, verify uses the backend's comm model (nccl-single on nccl, what the
    runtime posts there), simulate too except on nccl, where it predicts under per-peer
    nccl; --comm still wins."""
    model = backend.comm_model.value
    code, out, err = run_cli(capsys, "verify", "zb_h1", *SIZES, "--backend", backend.value)
    assert code == 0, out + err
    assert out.splitlines()[0].endswith(f"; {model} passes)"), out
    code, out, err = run_cli(capsys, "simulate", "zb_h1", *SIZES, "--backend", backend.value)
    assert code == 0, err
    predicted = "nccl" if backend is RunBackend.NCCL else model
    assert f"  comm {predicted}  " in out.splitlines()[0], out
    code, out, _ = run_cli(capsys, "verify", "zb_h1", *SIZES, "--backend", backend.value,
                           "--comm", "eager")  # fmt: skip
    assert out.splitlines()[0].endswith("; eager passes)"), out


@pytest.mark.parametrize("backend", list(RunBackend))
@pytest.mark.parametrize(
    "name", ["zb_h1", "dualpipe", "examples/schedules/zb_h1_send_before_w.sched"]
)
def test_a_sweep_verifies_each_size_as_run_resolves_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, backend: RunBackend
) -> None:
    """`verify --sweep --backend B` checks, at every size, the program `compile --backend B`
    writes (and `pipecc run` runs on B): the backend's policy for a compute-only schedule,
    hand-placed comm ops kept."""
    schedule = Schedule(str(ROOT / name) if name.endswith(".sched") else name)
    for p, m in ((4, 8), (4, 16)):
        out = tmp_path / f"{p}_{m}.json"
        code, _, err = run_cli(capsys, "compile", schedule.path, "-P", str(p), "-M", str(m),
                               "--backend", backend.value, "-o", str(out))  # fmt: skip
        assert code == 0, err
        swept = schedule.compile(p, m, {}, Resolution(backend))
        assert json_program.dumps(swept) == out.read_text(), (p, m)
    # early-recv, gloo's policy for a compute-only schedule, deadlocks under nccl by design
    if name == "zb_h1":
        flags = ("--sweep", "ranks=2..3", "microbatches=4", "--backend", backend.value)
        code, _, _ = run_cli(capsys, "verify", name, *flags, "--comm", "nccl")
        assert code == (1 if backend is RunBackend.GLOO else 0)
        code, _, _ = run_cli(capsys, "verify", name, *flags)  # the backend's own model
        assert code == 0


@pytest.mark.parametrize("backend", list(RunBackend))
def test_shared_adds_the_sums_and_keeps_the_backends_placement(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, backend: RunBackend
) -> None:
    """`--shared` is no placement: the program is the one the backend gets, plus one
    all_reduce at the end of each holder (it used to swap gloo's early-recv for the default)."""
    out = {}
    for name, extra in (("plain", ()), ("tied", ("--shared", "0+1"))):
        out[name] = tmp_path / f"{name}.json"
        code, _, err = run_cli(capsys, "compile", "1f1b", "-P", "2", "-M", "4", *extra,
                               "--backend", backend.value, "-o", str(out[name]))  # fmt: skip
        assert code == 0, err
    plain, tied = (json_program.loads(out[name].read_text()) for name in ("plain", "tied"))
    assert tied.comm == plain.comm == backend.policy
    assert [instrs[:-1] for instrs in tied.ranks] == list(plain.ranks)
    assert all(type(instrs[-1]).__name__ == "Collective" for instrs in tied.ranks)
