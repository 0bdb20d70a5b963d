"""Which stages recompute their forward in their backward (activation checkpointing).

A spec is "full" or "none" for every stage, a mapping {stage: "full" | "none"}, or the
command line's "0:full,1:none" (stages left out: none). Selective recomputation (by
module type or name) is refused with a clear message: only whole stages are recomputed.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipecc.diagnostics import InputError

MODES = ("full", "none")
Spec = str | Mapping[int, str] | None


def parse_spec(text: str) -> Spec:
    """The command line's spec: "full", "none", or "stage:mode" pairs split by commas."""
    text = text.strip()
    if ":" not in text:
        _mode(text, "--recompute")
        return text
    found: dict[int, str] = {}
    for part in text.split(","):
        stage, _, mode = part.partition(":")
        if not stage.strip().isdigit():
            raise InputError(f"--recompute: {part!r} is not stage:mode (e.g. 0:full,1:none)")
        found[int(stage)] = _mode(mode.strip(), "--recompute")
    return found


def recomputed(spec: Spec, stages: int) -> frozenset[int]:
    """The stages that recompute in full, of a program with `stages` stages."""
    if spec is None:
        return frozenset()
    if isinstance(spec, str):
        return frozenset(range(stages)) if _mode(spec, "recompute") == "full" else frozenset()
    chosen = set()
    for stage, mode in spec.items():
        if not isinstance(stage, int) or not 0 <= stage < stages:
            raise InputError(f"recompute: stage {stage!r} is not one of 0..{stages - 1}")
        if _mode(mode, f"recompute of stage {stage}") == "full":
            chosen.add(stage)
    return frozenset(chosen)


def _mode(mode: object, where: str) -> str:
    if mode in MODES:
        assert isinstance(mode, str)
        return mode
    raise InputError(
        f"{where}: {mode!r} is not a recomputation mode; the runtime recomputes whole "
        "stages: 'full' or 'none' (selective recomputation by module is not supported)"
    )
