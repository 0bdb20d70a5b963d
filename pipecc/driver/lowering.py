"""`--lowering pipecc|torch|torch-defer`: whose rules place the comm ops of a compute order.

`pipecc` (the default) is pipecc's own comm policy. `torch` and `torch-defer` place them as
torch 2.13's `_PipelineScheduleRuntime` does when it loads a compute-only schedule (without
and with `defer_pp_recv=True`), so that verify, simulate and compile see what torch runs.
A torch lowering applies to a compute order: a torch CSV without comm cells, a compute-only
program, or a .sched file (its compute order: comm ops it places by hand are replaced, as
another --comm-policy replaces them). An input that already holds comm ops, or the flag
together with --align or --comm-policy (which place comm ops too), is input pipecc cannot
use (exit 2).
"""

from __future__ import annotations

import argparse

from pipecc.diagnostics import InputError
from pipecc.driver.load import refuse_torch_lowering
from pipecc.ir.program import Program
from pipecc.passes.torch_program import LoweringStyle, compute_only, lower_in_style

CHOICES = tuple(item.value for item in LoweringStyle)
NOTES = {
    LoweringStyle.TORCH: "sends and receives placed as torch 2.13 places them (_add_send_recv)",
    LoweringStyle.TORCH_DEFER: "sends and receives placed as torch 2.13 places them with "
    "defer_pp_recv=True (_add_send_recv, then _defer_recv_ops)",
}


def add_lowering_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lowering",
        choices=CHOICES,
        default=LoweringStyle.PIPECC.value,
        help="whose rules place the comm ops of a compute-only input: pipecc (default: "
        "pipecc's comm policy), torch (as torch 2.13's runtime lowers a compute-only "
        "schedule) or torch-defer (the same with defer_pp_recv=True); docs/interop.md",
    )


def requested_style(args: argparse.Namespace) -> LoweringStyle:
    """The command's --lowering (pipecc where it has no such flag), refusing a torch
    lowering together with --align or --comm-policy."""
    style = LoweringStyle(getattr(args, "lowering", LoweringStyle.PIPECC.value))
    if style is not LoweringStyle.PIPECC:
        for flag, given in (
            ("--align", getattr(args, "align", False)),
            ("--comm-policy", getattr(args, "comm_policy", None) is not None),
        ):
            if given:
                raise InputError(
                    f"--lowering {style.value} and {flag} both place the comm ops: give one"
                )
    return style


def compute_order(program: Program, path: str, style: LoweringStyle) -> Program:
    """The compute order a torch lowering starts from: a compute-only .json or .csv as it
    is (one with comm ops is refused), a .sched file's program without its comm ops."""
    if path.endswith((".json", ".csv")):
        refuse_torch_lowering(path, program, style)
    return compute_only(program)


def lower_torch(program: Program, style: LoweringStyle) -> tuple[Program, str]:
    """A compute order lowered with torch's rules, and a note saying so. Raises
    MalformedSchedule (a violation) where torch's lowering raises."""
    return lower_in_style(program, style), f"compute-only input: {NOTES[style]}, then checked"
