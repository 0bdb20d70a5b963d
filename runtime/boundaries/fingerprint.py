"""What every rank must share before its first step: the program it runs and its stages' cut.

Each rank's `Fingerprint` is made once, when its runtime is built: stable digests (sha256 of
a canonical text) of the program's instructions (every rank's lists), its placement, comm
policy and recomputed stages, with the readable schedule, P and M; and, for each stage the
rank holds, a digest of its parameters' names, shapes and dtypes. The ranks compare them in
one gather when their runtimes are built (runtime/boundaries/discovery.py `agree_program`),
before any process group of the program's is made (the holders of a gradient sum: ranks
given different sums would wait in a `new_group` some of them never call), so a step costs
nothing more. Ranks whose programs differ (1F1B on one, ZB-H1 on the other; another M on
one; a sum on one only) or that hold one stage cut differently (a stage both pipes of
DualPipe hold, built with other layers on one rank) stop together with one error that says
"program" and what differs, instead of hanging, running silently or failing on a message
the other rank never sends.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pipecc.ir.program import Program

Json = dict[str, object]
SUMMARISED = ("schedule", "P", "M", "instructions")  # said by the summary, or unreadable


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Fingerprint:
    """One rank's program and stage cut, as digests (module docstring)."""

    summary: str  # "1f1b P=2 M=4"
    parts: tuple[tuple[str, str], ...]  # (what, its readable value or digest)
    stages: tuple[tuple[int, str], ...]  # (stage, digest of its parameters) held here

    @classmethod
    def of(cls, program: Program, rank: int, modules: Mapping[int, torch.nn.Module]) -> Fingerprint:
        placement = program.placement
        parts = (
            ("schedule", program.schedule),
            ("P", str(program.num_ranks)),
            ("M", str(program.num_microbatches)),
            ("placement", f"{placement.name} {_digest(repr(placement.slots))}"),
            ("comm policy", program.comm),
            ("backend", program.backend.value),
            ("recomputed stages", repr(program.recompute)),
            ("mesh", "none" if program.mesh is None else program.mesh.describe()),
            ("parameters", " ".join(f"{k}={v}" for k, v in program.params) or "none"),
            ("instructions", _digest(repr(program.ranks))),
        )
        summary = f"{program.schedule} P={program.num_ranks} M={program.num_microbatches}"
        held = {} if rank < 0 else {s.chunk: s.stage for s in placement.chunks(rank)}
        stages = {
            stage: _parameters(modules[chunk]) for chunk, stage in held.items() if chunk in modules
        }
        return cls(summary, parts, tuple(sorted(stages.items())))

    def as_json(self) -> Json:
        return {"summary": self.summary, "parts": dict(self.parts), "stages": dict(self.stages)}


def _parameters(module: torch.nn.Module) -> str:
    """A stage's cut: its parameters' names, shapes and dtypes."""
    lines = (
        f"{name} {list(param.shape)} {param.dtype}" for name, param in module.named_parameters()
    )
    return _digest("\n".join(lines))


def program_problem(replies: Sequence[Json], me: int) -> str | None:
    """What differs between the ranks' programs (None: nothing), as this rank says it: its
    own program first, then each other one with the ranks that run it."""
    found = [r.get("program") for r in replies]
    if any(not isinstance(f, dict) for f in found):
        return None  # a rank that sent none (not a runtime's discovery): nothing to compare
    programs = [_described(f) for f in found if isinstance(f, dict)]
    if len(set(programs)) == 1:
        return _stage_problem(found)
    differing = [
        what
        for what in _get(found[0], "parts")
        if len({str(_get(f, "parts").get(what)) for f in found}) > 1
    ]
    shown = {
        rank: _shown(f, differing) for rank, f in enumerate(found) if isinstance(f, dict)
    }  # the summary, and the readable parts that differ
    order = [me] + [r for r in range(len(found)) if r != me]
    groups: dict[str, list[int]] = {}
    for rank in order:
        groups.setdefault(programs[rank], []).append(rank)
    said = [f"{_ranks(ranks)} {shown[ranks[0]]}" for ranks in groups.values()]
    return (
        "the ranks run different programs: " + ", ".join(said)
        + f" (they differ in: {', '.join(differing)}); compile one program and give it to "
        "every rank"
    )  # fmt: skip


def _described(found: Json) -> str:
    return f"{found['summary']} {sorted(_get(found, 'parts').items())}"


def _get(found: object, key: str) -> dict[str, object]:
    value = found.get(key) if isinstance(found, dict) else None
    return value if isinstance(value, dict) else {}


def _shown(found: Json, differing: list[str]) -> str:
    parts = _get(found, "parts")
    readable = [f"{what} {parts.get(what)}" for what in differing if what not in SUMMARISED]
    extra = f" ({'; '.join(readable)})" if readable else ""
    return f"{found['summary']}{extra}"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} runs"
    return f"ranks {', '.join(map(str, ranks))} run"


def _stage_problem(found: Sequence[object]) -> str | None:
    """Ranks that hold one stage (both pipes of DualPipe, duplicated stages) cut it alike."""
    holders: dict[str, dict[str, list[int]]] = {}
    for rank, f in enumerate(found):
        for stage, digest in _get(f, "stages").items():
            holders.setdefault(stage, {}).setdefault(str(digest), []).append(rank)
    for stage, cuts in sorted(holders.items(), key=lambda item: int(item[0])):
        if len(cuts) > 1:
            said = "; ".join(f"{_ranks(r).removesuffix(' runs').removesuffix(' run')}"
                             for r in cuts.values())  # fmt: skip
            return (
                f"the ranks run one program but cut stage {stage} differently: its parameters "
                f"(names, shapes, dtypes) differ between {said}; build every stage from the "
                "same model and split"
            )
    return None
