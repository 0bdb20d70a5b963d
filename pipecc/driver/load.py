"""A Program from any input: a .sched file (compiled for the sizes), a compiled program
(.json) or a torch.distributed.pipelining action CSV (.csv), chosen by extension, resolved
for the backend it will run on.

`resolve` is the one decision every command makes the same way (`pipecc run` on its real
backend, `compile`, `verify` and `simulate` on `--backend`), so that `pipecc verify X
--backend B [flags]` proves what `pipecc run X [flags]` runs on B:

- an explicit `--comm-policy`, `--align` or `--lowering torch*` places every comm op
  afresh, the input's own included, and a note says how many it replaced;
- otherwise a compute-only input (a .sched file that places no comm op by hand, a
  compute-only .json or .csv) gets the backend's policy (`RunBackend.policy`: early-recv on
  gloo, the default on nccl);
- a .sched file's hand-placed sends, receives and waits are kept (the default policy places
  the messages it leaves out), and a .json or .csv with comm ops runs as it is.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from pipecc.diagnostics import InputError, LoweringViolation, RefusedProgramError
from pipecc.driver.compile import (
    DEFAULT_LOWERING,
    Lowering,
    compile_order,
    lower_program,
    violated,
)
from pipecc.driver.files import read_program, read_text
from pipecc.driver.mesh import place_mesh, place_moe
from pipecc.interop import torch_csv
from pipecc.ir.ops import Recv, Send, Wait
from pipecc.ir.program import Backend, Program
from pipecc.passes.insert_comms import DEFAULT, EARLY_RECV, strip_comms
from pipecc.passes.sum_shared import sum_shared
from pipecc.passes.torch_program import LoweringStyle
from pipecc.semantics import CommModel
from pipecc.verify import check_input, check_order


class RunBackend(enum.Enum):
    """The torch.distributed backend a program runs on (`pipecc run`: gloo on CPU, nccl with
    a GPU per rank), and what the resolution takes from it."""

    GLOO = "gloo"
    NCCL = "nccl"

    @property
    def comm_model(self) -> CommModel:
        """How its sends and receives complete (DESIGN §5): gloo progresses every posted op on
        its own (rendezvous); on nccl the runtime posts every op of a rank through
        `batch_isend_irecv` on the group's one communicator, so they run in order on one
        stream (nccl-single; runtime/comm/channel.py)."""
        return CommModel.RENDEZVOUS if self is RunBackend.GLOO else CommModel.NCCL_SINGLE

    @property
    def policy(self) -> str:
        """The comm policy a compute-only input gets here: early receives on gloo (faster
        there, docs/performance.md), the default, safe under every model, on nccl."""
        return EARLY_RECV.policy if self is RunBackend.GLOO else DEFAULT.policy


DEFAULT_BACKEND = RunBackend.NCCL


def comm_ops(program: Program) -> int:
    """The number of sends, receives and waits in `program` (0: it is compute-only, its
    comm ops still to be placed; the one test of that, made once per input: `Source`)."""
    return sum(type(x) in (Send, Recv, Wait) for instrs in program.ranks for x in instrs)


class Loaded(NamedTuple):
    """A loaded program and the notes its reader left (ignored CSV cells, JSON fields this
    version does not know)."""

    program: Program
    notes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Source:
    """An input as read, before any comm op is placed: a .sched file's compute order with
    the comm ops it places by hand (`compiled`), or a .json or .csv as its reader made it."""

    label: str  # the input, with P and M for a .sched file
    program: Program
    notes: tuple[str, ...]  # what the reader ignored (CSV cells, unknown JSON fields)
    compiled: bool
    placed: int  # its sends, receives and waits (0: compute-only), counted once: `of`

    @classmethod
    def of(cls, label: str, program: Program, notes: tuple[str, ...], *, compiled: bool) -> Source:
        """A source, its comm ops counted once."""
        return cls(label, program, notes, compiled, comm_ops(program))

    @property
    def compute_only(self) -> bool:
        """No send, receive or wait: the comm ops are still to be placed."""
        return self.placed == 0

    @property
    def needs_placement(self) -> bool:
        """A compute-only program of several ranks (a torch CSV without comm actions): its
        sends, receives and waits are placed before anything runs it (DESIGN §1, §5)."""
        return self.compute_only and self.program.num_ranks > 1


@dataclass(frozen=True, slots=True)
class Request:
    """What decides the program: the input and its sizes, the backend it runs on, and the
    command's --comm-policy/--align/--lowering (`DEFAULT_LOWERING`: none of them given)."""

    path: str
    ranks: int | None = None
    microbatches: int | None = None
    defines: Mapping[str, int] = field(default_factory=dict)
    backend: RunBackend = DEFAULT_BACKEND
    lowering: Lowering = DEFAULT_LOWERING


class Choice(enum.Enum):
    """Where the placement of the resolved program's comm ops came from."""

    BACKEND = "backend"  # a compute-only input, placed by the backend's policy
    HAND = "hand-placed"  # a .sched file's own comm ops, kept
    PROGRAM = "program"  # a .json or .csv with comm ops, as it is
    FLAG = "flag"  # --comm-policy, --align or --lowering


@dataclass(frozen=True, slots=True)
class Resolved:
    """The exact program a command runs, and how it was resolved."""

    program: Program
    label: str
    how: str  # "hand-placed comm ops kept", "comm ops placed by early-recv (gloo's default)"
    choice: Choice
    notes: tuple[str, ...]  # the reader's, and the replacement of the input's comm ops
    placed_for: str | None = None  # a note: the program was placed for another backend

    @property
    def description(self) -> str:
        """One line: which program, and how its comm ops were placed."""
        return f"{self.label}, {self.how}"


def read_source(
    path: str,
    *,
    ranks: int | None = None,
    microbatches: int | None = None,
    defines: Mapping[str, int] | None = None,
) -> Source:
    """Read an input by extension; a .sched file is expanded for the sizes, not lowered."""
    if path.endswith(".csv"):
        program, notes = _read_csv(path)
        return Source.of(path, program, notes, compiled=False)
    if path.endswith(".json"):
        program, notes = read_program(path)
        return Source.of(path, program, notes, compiled=False)
    p, m = _sizes(path, ranks, microbatches)
    order = compile_order(path, ranks=p, microbatches=m, defines=defines)
    return Source.of(f"{path} P={p} M={m}", order, (), compiled=True)


def resolve(request: Request, *, checked: bool = True) -> Resolved:
    """The program `request` runs (module docstring). With `checked`, a .json or .csv is
    first put through the verifier's input checks and refused (`RefusedProgramError`, exit
    2) when it fails them; without, the caller verifies what it gets and checks a
    compute-only one's order before (`driver.check.verify_source`, for `pipecc verify` and
    `pipecc run`). The compute order of one whose comm ops a flag places afresh is always
    checked first."""
    source = read_source(
        request.path,
        ranks=request.ranks,
        microbatches=request.microbatches,
        defines=request.defines,
    )
    try:
        return resolve_source(source, request.backend, request.lowering, checked=checked)
    except LoweringViolation as err:  # the verifier's report instead (exit 1)
        raise violated(source.label, source.program, err) from None


def resolve_source(
    source: Source, backend: RunBackend, lowering: Lowering, *, checked: bool = True
) -> Resolved:
    """`resolve` for an input already read. `lowering.shared` (`--shared`) is no placement:
    the program resolved without it gets the gradient sums of those stages (`sum_shared`,
    idempotent, so a .json that holds them already is unchanged). `lowering.mesh` (`--mesh`,
    `--fsdp`) neither: the program resolved without it gets FSDP's stage actions and the
    data-parallel reductions (`place_mesh`), before those sums, and then (`--moe`, carried
    in the mesh options) its MoE stages' phases and all-to-alls (`place_moe`)."""
    if lowering.shared:
        found = resolve_source(source, backend, replace(lowering, shared=()), checked=checked)
        return replace(found, program=sum_shared(found.program, shared=lowering.shared))
    if lowering.mesh is not None:  # FSDP's actions and the DP reductions (driver/mesh.py)
        found = resolve_source(source, backend, replace(lowering, mesh=None), checked=checked)
        placed = place_mesh(found.program, lowering.mesh)
        # the --moe step: MoE stages split into phases and all-to-alls over ep
        return replace(found, program=place_moe(placed, lowering.mesh))
    program = source.program
    if lowering != DEFAULT_LOWERING:
        resolved = _replaced(source, lowering, checked=checked)
    elif source.compiled and not source.compute_only:
        resolved = _hand_placed(source)
    elif source.compiled or source.needs_placement:
        if checked and not source.compiled:
            refuse_invalid(source.label, program, compute_only=True)
        lowered = lower_program(program, Lowering(policy=backend.policy))
        how = f"comm ops placed by {backend.policy} ({backend.value}'s default)"
        resolved = Resolved(lowered, source.label, how, Choice.BACKEND, source.notes)
    else:
        if checked:
            refuse_invalid(source.label, program, compute_only=source.compute_only)
        how = f"comm ops as in the input ({program.comm})"
        resolved = Resolved(program, source.label, how, Choice.PROGRAM, source.notes)
    return replace(resolved, placed_for=placed_for_note(resolved, backend))


def _hand_placed(source: Source) -> Resolved:
    """A .sched file's hand-placed comm ops, kept; the default policy places the rest."""
    hand = source.placed
    program = lower_program(source.program)
    more = comm_ops(program) - hand
    rest = f", {more} more placed by the default policy" if more else ""
    how = f"{hand} hand-placed comm ops kept{rest}"
    return Resolved(program, source.label, how, Choice.HAND, source.notes)


def _replaced(source: Source, lowering: Lowering, *, checked: bool) -> Resolved:
    """An explicit --comm-policy, --align or --lowering: every comm op placed afresh from the
    compute order, and a note naming how many of the input's it replaced. The order of a
    .json or .csv is checked first, except unchecked under torch's rules (`verify` reports
    where torch's own lowering fails: driver/check.py)."""
    program, flag = source.program, _flag(lowering)
    torch_rules = lowering.style is not LoweringStyle.PIPECC
    if torch_rules:
        refuse_torch_lowering(source, lowering.style)
    if not source.compiled and (checked or not torch_rules):
        refuse_invalid(source.label, strip_comms(program), compute_only=True)
    placed = source.placed
    lowered = lower_program(strip_comms(program), lowering)
    notes = (*source.notes, *_torch_note(lowering.style))
    how = f"comm ops placed by {flag}"
    if placed:
        what = "hand-placed sends, receives and waits" if source.compiled else "comm ops"
        notes = (*notes, f"{flag} replaced the {placed} {what} of {source.label}")
        how = f"{how}, replacing the input's {placed}"
    return Resolved(lowered, source.label, how, Choice.FLAG, notes)


TORCH_NOTES = {
    LoweringStyle.TORCH: "sends and receives placed as torch 2.13 places them (_add_send_recv)",
    LoweringStyle.TORCH_DEFER: "sends and receives placed as torch 2.13 places them with "
    "defer_pp_recv=True (_add_send_recv, then _defer_recv_ops)",
}


def _torch_note(style: LoweringStyle) -> tuple[str, ...]:
    """The note of an order lowered by torch's rules (--lowering torch|torch-defer)."""
    if style is LoweringStyle.PIPECC:
        return ()
    return (f"compute-only input: {TORCH_NOTES[style]}, then checked",)


def _flag(lowering: Lowering) -> str:
    """The flag that asked for `lowering`, as the user wrote it."""
    if not lowering.comms:
        return "the compute order (no comm ops)"
    if lowering.style is not LoweringStyle.PIPECC:
        return f"--lowering {lowering.style.value}"
    if lowering.align is not None:
        return f"--align under {lowering.align.model.value}"
    return f"--comm-policy {lowering.policy}"


def placed_for(program: Program) -> RunBackend | None:
    """The backend whose own policy placed `program` (early-recv: gloo, whose posted ops
    progress on their own; the default: nccl), or None when no backend's policy did (an
    alignment, torch's rules, a CSV's own comm cells)."""
    for backend in RunBackend:
        if program.comm == backend.policy:
            return backend
    return None


def placed_for_note(resolved: Resolved, backend: RunBackend) -> str | None:
    """A note when the program was placed for another backend than the one it runs on: one
    that needs independent progress (`Backend.INDEPENDENT_PROGRESS`) on nccl, or one kept
    from the input with another backend's policy."""
    program = resolved.program
    target = placed_for(program)
    if target is None or target is backend:
        return None
    if program.backend is Backend.INDEPENDENT_PROGRESS:
        return (
            f"{resolved.label} is placed by the {program.comm} comm policy, for gloo: it needs "
            f"every posted op to progress on its own, and {backend.value}'s ordered streams "
            "deadlock on it by design (--comm-policy default places it for nccl)"
        )
    if resolved.choice is not Choice.PROGRAM:
        return None
    return (
        f"{resolved.label} is placed by the {program.comm} comm policy, {target.value}'s; a "
        f"compute-only input gets {backend.policy} on {backend.value} (--comm-policy "
        f"{backend.policy} places it for {backend.value})"
    )


def load(
    path: str,
    *,
    ranks: int | None = None,
    microbatches: int | None = None,
    defines: Mapping[str, int] | None = None,
    lowering: Lowering | None = DEFAULT_LOWERING,
) -> Loaded:
    """A Program from any input, resolved for nccl (`resolve`), checked; `lowering=None`
    returns a .json or .csv as it was read, unchecked (`pipecc verify` reports its defects
    itself), and a .sched file as the default lowering compiles it."""
    if lowering is None and path.endswith((".json", ".csv")):
        source = read_source(path)
        return Loaded(source.program, source.notes)
    request = Request(
        path,
        ranks,
        microbatches,
        defines or {},
        lowering=DEFAULT_LOWERING if lowering is None else lowering,
    )
    resolved = resolve(request)
    return Loaded(resolved.program, resolved.notes)


def refuse_invalid(label: str, program: Program, *, compute_only: bool) -> None:
    """Raise `RefusedProgramError` when `program` fails the verifier's input checks: those of
    a compute order (`check_order`) for a compute-only program, else `check_input`."""
    check = check_order if compute_only else check_input
    report = check(program)
    if report is None:
        return
    found = ", ".join(f"{code} {n}" for code, n in report.counts().items())
    raise RefusedProgramError(label, report.violations, found)


def refuse_torch_lowering(source: Source, style: LoweringStyle) -> None:
    """--lowering torch* lowers a compute order: a .json or .csv with comm ops is bad input
    (a .sched file's hand-placed ones are replaced, as another --comm-policy replaces them)."""
    if style is not LoweringStyle.PIPECC and not source.compiled and not source.compute_only:
        raise InputError(
            f"{source.label}: --lowering {style.value} lowers a compute-only schedule, and this "
            "input already has its sends and receives (torch runs them as written: check it "
            "without --lowering)"
        )


def _read_csv(path: str) -> tuple[Program, tuple[str, ...]]:
    loaded = torch_csv.loads(read_text(Path(path)), path)
    return loaded.program, loaded.notes


def _sizes(path: str, ranks: int | None, microbatches: int | None) -> tuple[int, int]:
    """-P and -M, which a .sched file needs."""
    if ranks is None or microbatches is None:
        missing = " and ".join(
            flag
            for flag, v in (("-P/--ranks", ranks), ("-M/--microbatches", microbatches))
            if v is None
        )
        raise InputError(f"{path}: a .sched file needs {missing}")
    return ranks, microbatches
