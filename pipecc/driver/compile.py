"""Compile a .sched file: the front end (parse, expand, assign microbatches), then the
lowering that places the comm ops (`Lowering`: a named policy, or an alignment for a cost
model), once.

    program = compile_schedule("schedules/zb_h1.sched", ranks=4, microbatches=8)
    program = compile_schedule("dualpipe", ranks=8, microbatches=20)   # a bundled schedule
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from pipecc.diagnostics import LoweringViolation, PipeccError, ViolatedScheduleError
from pipecc.driver.files import read_text, resolve_schedule
from pipecc.driver.mesh import MeshOptions
from pipecc.frontend.ast import Param, ScheduleFile
from pipecc.frontend.expand import expand
from pipecc.frontend.parser import parse
from pipecc.ir.program import Program
from pipecc.passes.align_comms import align_comms
from pipecc.passes.assign_microbatches import assign_microbatches
from pipecc.passes.insert_comms import DEFAULT, POLICIES, insert_comms, strip_comms
from pipecc.passes.sum_shared import sum_shared, summed_stages
from pipecc.passes.torch_program import LoweringStyle, compute_only, lower_in_style
from pipecc.perf import paused_gc
from pipecc.semantics import CommModel
from pipecc.semantics.costs import CostModel
from pipecc.verify import DEFAULT_OPTIONS, Options, Report, check_order, verify


@dataclass(frozen=True, slots=True)
class Alignment:
    """`--align`: place every comm op for these costs under this comm model (docs/align.md);
    by default nccl-single, what pipecc's runtime runs on NCCL (one communicator)."""

    costs: CostModel
    model: CommModel = CommModel.NCCL_SINGLE


@dataclass(frozen=True, slots=True)
class Lowering:
    """How the comm ops are placed, an input of compilation beside the sizes: a named policy
    of `POLICIES` (None: the default, with hand-placed comm ops kept where the schedule put
    them), or an alignment for a cost model. Another policy than the default, and an
    alignment, place every comm op again, hand-placed ones too. `comms=False` places none:
    the compute order, which `verify --lowering torch` checks before torch's rules lower it.
    `shared`: groups of stages that hold one parameter (`--shared 0+7`), whose gradient sum
    the lowering places with that of duplicated stages (passes/sum_shared.py)."""

    policy: str | None = None
    align: Alignment | None = None
    style: LoweringStyle = LoweringStyle.PIPECC  # --lowering torch|torch-defer: torch's rules
    comms: bool = True
    shared: tuple[tuple[int, ...], ...] = ()
    mesh: MeshOptions | None = None  # --mesh/--fsdp: placed after the comm ops (driver/mesh.py)


DEFAULT_LOWERING = Lowering()
COMPUTE_ORDER = Lowering(comms=False)


def lower_program(program: Program, lowering: Lowering = DEFAULT_LOWERING) -> Program:
    """Place the comm ops of a compute-only program (hand-placed ones may be present), then
    the gradient sums of parameters held on several ranks."""
    if not lowering.comms:
        return compute_only(program)
    return sum_shared(_place_comms(program, lowering), shared=lowering.shared)


def _place_comms(program: Program, lowering: Lowering) -> Program:
    if lowering.style is not LoweringStyle.PIPECC:
        return lower_in_style(program, lowering.style)
    if lowering.align is not None:
        costs = lowering.align.costs.for_program(program)  # per share → per stage (§6)
        return align_comms(program, costs=costs, model=lowering.align.model)
    if lowering.policy is None or lowering.policy == DEFAULT.policy:
        return insert_comms(program)
    return insert_comms(strip_comms(program), placement=POLICIES[lowering.policy])


def place_again(program: Program, lowering: Lowering) -> Program:
    """A lowered program (a .json, a torch CSV with comms) with its comm ops placed again from
    its compute order, when the lowering asks for an alignment or another policy than the
    program's; otherwise the program as it is."""
    if not places_again(program, lowering):
        return program
    shared = tuple(sorted({*lowering.shared, *summed_stages(program)}))
    return lower_program(strip_comms(program), replace(lowering, shared=shared))


def places_again(program: Program, lowering: Lowering) -> bool:
    """`place_again` discards the comm ops of `program` and places them afresh."""
    return lowering.align is not None or lowering.policy not in (None, program.comm)


def compile_source(
    text: str,
    path: str,
    *,
    ranks: int,
    microbatches: int,
    defines: Mapping[str, int] | None = None,
    lowering: Lowering = DEFAULT_LOWERING,
) -> Program:
    """Compile .sched text: parse, expand for (P, M, -D), assign microbatches, lower. A
    compute order that cannot run, or hand-placed messages that mismatch, raise the
    verifier's report (`ViolatedScheduleError`, exit 1)."""
    tree = parse(text, path)
    order = order_tree(tree, ranks=ranks, microbatches=microbatches, defines=defines)
    try:
        with paused_gc():
            return lower_program(order, lowering)
    except LoweringViolation as err:
        raise violated(f"{path} P={ranks} M={microbatches}", order, err) from None


def compile_tree(
    tree: ScheduleFile,
    *,
    ranks: int,
    microbatches: int,
    defines: Mapping[str, int] | None = None,
    lowering: Lowering = DEFAULT_LOWERING,
) -> Program:
    """Compile a parsed .sched file for one size (a sweep parses once, compiles many)."""
    with paused_gc():
        program = order_tree(tree, ranks=ranks, microbatches=microbatches, defines=defines)
        return lower_program(program, lowering)


def order_tree(
    tree: ScheduleFile,
    *,
    ranks: int,
    microbatches: int,
    defines: Mapping[str, int] | None = None,
) -> Program:
    """A parsed .sched file expanded for one size, every op given its microbatch, before any
    lowering: the compute order, with the sends, receives and waits the schedule places by
    hand (docs/dsl.md §7). The op streams are freed on return, before lowering reuses their
    memory."""
    with paused_gc():
        streams = expand(tree, ranks=ranks, microbatches=microbatches, defines=defines)
        return assign_microbatches(streams)


def compile_schedule(
    name_or_path: str | Path,
    *,
    ranks: int,
    microbatches: int,
    defines: Mapping[str, int] | None = None,
    lowering: Lowering = DEFAULT_LOWERING,
) -> Program:
    """Compile a .sched file (or a bundled schedule by name) for P ranks and M microbatches."""
    path = resolve_schedule(str(name_or_path))
    text = read_text(path)
    return compile_source(
        text, str(path), ranks=ranks, microbatches=microbatches, defines=defines, lowering=lowering
    )


def compile_order(
    name_or_path: str | Path,
    *,
    ranks: int,
    microbatches: int,
    defines: Mapping[str, int] | None = None,
) -> Program:
    """A .sched file (or a bundled schedule by name) before lowering (`order_tree`)."""
    path = resolve_schedule(str(name_or_path))
    tree = parse(read_text(path), str(path))
    return order_tree(tree, ranks=ranks, microbatches=microbatches, defines=defines)


def schedule_parameters(path: str | Path) -> tuple[str, ...]:
    """The names of the parameters a .sched file declares (`param NAME = ...`)."""
    path = Path(path)
    tree = parse(read_text(path), str(path))
    return tuple(decl.name for decl in tree.decls if isinstance(decl, Param))


def violation_report(order: Program, options: Options = DEFAULT_OPTIONS) -> Report | None:
    """The verifier's report of a .sched file's program as far as it can be built, for an
    order whose lowering raised `LoweringViolation`: the compute order's own (the cycle of
    `unrunnable-order`, as for the same order in a .json or .csv), else the program with its
    hand-placed comm ops as placed (the two messages of `mismatch`); None when the verifier
    finds nothing (the lowering's own error then stands)."""
    found = check_order(strip_comms(order), options)
    if found is not None:
        return found
    with paused_gc():
        program = insert_comms(order, check_hand_placed=False)
    report = verify(program, options)
    return None if report.ok else report


def violated(label: str, order: Program, err: LoweringViolation) -> PipeccError:
    """The error a command raises for `err`: the verifier's violations (exit 1), or `err`
    itself when the verifier finds none."""
    report = violation_report(order)
    if report is None:
        return err
    counts = ", ".join(f"{code} {n}" for code, n in report.counts().items())
    return ViolatedScheduleError(label, report.violations, counts)
