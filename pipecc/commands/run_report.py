"""What `pipecc run` prints and checks after the run: the measured and predicted memory, the
`--check` verdict, and the summary lines (the run itself: commands/run.py)."""

from __future__ import annotations

import argparse
from typing import Any

from pipecc.analysis.memory import format_bytes, measured_sizes, predict_run
from pipecc.ir.ops import Collective
from pipecc.ir.program import Program

Ties = tuple[tuple[int, ...], ...]  # groups of stages that hold one parameter (--shared)


def tie_notes(model: str, tied: Ties) -> tuple[str, ...]:
    """The note of the model file's ties (runtime/tools/ties.py), whose gradient sums the
    program places as `--shared` places them: instructions the verifier checks."""
    if not tied:
        return ()
    given = "/".join("+".join(map(str, stages)) for stages in tied)
    return (
        f"{model}: stages {given} hold one parameter (tied weights): resolved as with --shared "
        f"{given}, so the program holds the gradient sum of each one held on two or more ranks",
    )


def gradient_sums(program: Program) -> list[dict[str, Any]]:
    """The gradient sums of the verified program (`--json`'s `gradient_sums`): each
    collective over ranks of the pipeline once, its `what` and its ranks, in program order."""
    found: dict[tuple[str, tuple[int, ...]], None] = {}
    for instrs in program.ranks:
        for op in instrs:
            if isinstance(op, Collective) and not op.dims:
                found[(op.what, tuple(sorted(set(op.ranks))))] = None
    return [{"what": what, "ranks": list(ranks)} for what, ranks in found]


def memory_fields(fields: dict[str, Any], program: Program, *, memory: bool) -> None:
    """With --memory: `memory`, per rank the predicted and the measured peak (these names
    are a contract) with the prediction's breakdown and the optimizer state left out of
    both; `batch_bytes` stays apart. The byte keys measured per stage go in `memory_sizes`
    (also with --profile alone); without --memory the measured fields are dropped."""
    sizes = fields.get("memory_sizes")
    measured = fields.pop("measured_bytes", None)
    if not memory or sizes is None or measured is None:
        fields.pop("batch_bytes", None)
        return
    predicted = predict_run(program, measured_sizes(sizes))
    fields["memory"] = [
        {
            "rank": rank,
            "predicted_bytes": peak.peak,
            "measured_bytes": got,
            "predicted_at": peak.at,
            "predicted_breakdown": peak.breakdown.to_json(),
            "optimizer_bytes": optim,
        }
        for rank, ((peak, optim), got) in enumerate(zip(predicted, measured, strict=True))
    ]


def _memory_lines(fields: dict[str, Any]) -> list[str]:
    """Predicted beside measured, per rank (with --memory)."""
    rows = fields.get("memory")
    if not rows:
        return []
    lines = ["memory per rank: predicted  measured  (predicted - measured) / measured"]
    for row in rows:
        predicted, measured = row["predicted_bytes"], row["measured_bytes"]
        error = (predicted - measured) / measured if measured else 0.0
        optim = format_bytes(row["optimizer_bytes"])
        lines.append(
            f"  rank {row['rank']}: {format_bytes(predicted):>10} {format_bytes(measured):>10}"
            f"  {error:+.2%}   (optimizer state, in neither: {optim})"
        )
    lines.append(
        f"batch (inputs and targets of a step, in neither): {format_bytes(fields['batch_bytes'])}"
    )
    return lines


def check_failure(fields: dict[str, Any], tolerance: float) -> str | None:
    found = _numbers_failure(fields, tolerance)
    if fields["check_failures"]:  # --reference whole: the split itself is wrong
        split = "the pipelined model is not the whole model:\n  " + "\n  ".join(
            fields["check_failures"]
        )
        return split if found is None else f"{split}\n{found}"
    return found


def _numbers_failure(fields: dict[str, Any], tolerance: float) -> str | None:
    rel = fields["max_rel_grad_diff"]
    if rel > tolerance:
        worst = "".join(
            f"\n  stage {d['stage']} '{d['name']}' on rank {d['rank']}: max abs diff "
            f"{d['max_abs']:.3g}, rel {d['max_rel']:.3g}"
            for d in fields["worst_params"]
        )
        return f"max_rel_grad_diff {rel:.3g} > tolerance {tolerance:g}; worst parameters:{worst}"
    loss, ref = fields["loss"], fields["reference_loss"]
    if abs(loss - ref) > tolerance * max(abs(ref), 1e-30):
        return f"loss {loss!r} differs from the reference {ref!r} (tolerance {tolerance:g})"
    added, ref_added = fields["aux_loss"], fields["reference_aux_loss"]
    if ref_added is not None and abs(added - ref_added) > tolerance * max(abs(ref_added), 1e-30):
        return (
            f"added loss {added!r} differs from the whole model's {ref_added!r} "
            f"(tolerance {tolerance:g})"
        )
    return None


def _reference_name(fields: dict[str, Any]) -> str:
    return " against the whole model" if fields["reference"] == "whole" else ""


def print_summary(
    fields: dict[str, Any], args: argparse.Namespace, failure: str | None, *, written: bool
) -> None:
    mesh = f"  mesh {fields['mesh']}" if fields.get("mesh") else ""
    print(
        f"{fields['schedule']}  P={fields['ranks']} M={fields['microbatches']}{mesh}  "
        f"batch {fields['batch_size']} rows  backend {fields['backend']}  comm {fields['comm']}"
    )
    line = f"loss {fields['loss']:.6g}"
    if fields["reference_loss"] is not None:
        line += f" (reference {fields['reference_loss']:.6g})"
    print(line)
    if fields["aux_loss_by_stage"]:
        stages = ", ".join(f"stage {s} {v:.6g}" for s, v in fields["aux_loss_by_stage"].items())
        line = f"added loss {fields['aux_loss']:.6g} ({stages})"
        if fields["reference_aux_loss"] is not None:
            line += f" (whole model {fields['reference_aux_loss']:.6g})"
        print(line)
    if args.check:
        verdict = "ok" if failure is None else "FAILED"
        print(
            f"gradients{_reference_name(fields)}: max abs diff "
            f"{fields['max_abs_grad_diff']:.3g}, max rel diff "
            f"{fields['max_rel_grad_diff']:.3g} (tolerance {fields['tolerance']:g}): {verdict}"
        )
    print(
        f"step {fields['step_ms']:.3f} ms (median of {fields['steps']} step(s) after "
        f"{fields['warmup']} warm-up)"
    )
    for line in _memory_lines(fields):
        print(line)
    if args.profile is None:
        return
    spread = fields["profile_spread"]
    if spread is None:
        print("profile spread: not measured (one timed step)")
    else:
        print(
            f"profile spread {spread:.3g} at {fields['profile_spread_at']} (interquartile range "
            f"of its compute time per step / median; bound {fields['profile_spread_bound']:g})"
        )
    for line in moe_profile_lines(fields.get("profile_moe") or {}):
        print(line)
    if written:
        print(f"wrote {args.profile}")


# the columns of the MoE profile table, in order (runtime/profiling/moe_costs.py)
MOE_COLUMNS = (
    *(f"{kind}_{part}" for kind in "FBI" for part in ("pre", "experts", "post")),
    "a2a",
    "a2a_exposed",
    "moe_experts",
)


def moe_profile_lines(stages: dict[Any, dict[str, float]]) -> list[str]:
    """With --profile, a MoE program's measured phases per stage: the mean of each (op kind,
    part) and `a2a` (one all-to-all), `a2a_exposed` (the compute thread's wait per
    all-to-all) in ms, and `moe_experts` (the experts' part of the phased ops)."""
    if not stages:
        return []
    columns = [c for c in MOE_COLUMNS if any(c in values for values in stages.values())]
    lines = [
        "MoE phases measured (ms, mean per phase; a2a: one all-to-all; a2a_exposed: the "
        "compute thread's wait per all-to-all):",
        "stage " + " ".join(f"{c:>9}" for c in columns),
    ]
    for stage, values in stages.items():
        cells = (
            f"{values[c]:>{max(9, len(c))}.4g}" if c in values else f"{'-':>{max(9, len(c))}}"
            for c in columns
        )
        lines.append(f"{stage!s:>5} " + " ".join(cells))
    return lines
