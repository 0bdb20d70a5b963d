"""Place the shared-parameter gradient sum in the program: one all_reduce per set of holders.

A parameter lives on several ranks when its stage is held twice (DualPipe's bidirectional
placement: stage s on ranks s and P-1-s, always) or when several stages hold one parameter
and lie on different ranks (a tied embedding: `--shared 0+7`, as cost files say `shared`).
Each copy's gradient holds only its own uses, so the step's gradient is their sum over the
ranks holding a copy: the runtime performs it where this pass puts it, as an all_reduce over
the holders (DESIGN §5: every exchange of a step is an instruction the verifier checks).

Stages that share a parameter, directly or through a chain of shared groups, form one group;
its holders are the ranks holding any of its stages. Groups with the same holders are summed
by one collective, whose `what` names their stages (`grad-sum s0+s7`).

Requires: a lowered program (its comm ops placed); `shared` names stages of its placement.
Sums it already holds (from this pass) are removed and placed again with the new ones.
Ensures: every rank holding a copy of a shared parameter ends with one blocking all_reduce
per set of holders it belongs to, after its last instruction (so after the last backward or
W of those stages, and after its last wait: the collective waits for no point-to-point op),
the sets in one global order (sorted) on every rank, so no cycle can pass through them under
any comm model. A program without a parameter held on two ranks is returned unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipecc.diagnostics import InputError
from pipecc.ir.ops import Collective, CollectiveKind, Instr
from pipecc.ir.placement import Placement
from pipecc.ir.program import Program

WHAT = "grad-sum"  # the `what` of a gradient sum: "grad-sum s0+s7"

Groups = tuple[tuple[int, ...], ...]


def sum_shared(prog: Program, *, shared: Groups = ()) -> Program:
    """Append the gradient sums of `prog`'s shared parameters (module docstring). Sums the
    program holds already are placed again with them (the pass is idempotent)."""
    held = summed_stages(prog)
    sums = gradient_sums(prog.placement, tuple(sorted({*shared, *held})))
    if not sums and not held:
        return prog
    ranks = tuple(
        tuple(i for i in instrs if not _stages_of(i)) + tuple(op for op in sums if rank in op.ranks)
        for rank, instrs in enumerate(prog.ranks)
    )
    return replace(prog, ranks=ranks)


def gradient_sums(placement: Placement, shared: Groups = ()) -> tuple[Collective, ...]:
    """The all_reduce of each set of holder ranks, in the global order (sorted by ranks)."""
    _check_stages(placement, shared)
    holders = _holders(placement)
    by_ranks: dict[tuple[int, ...], set[int]] = {}
    for stages in _join(placement, shared):
        ranks = tuple(sorted({r for s in stages for r in holders[s]}))
        if len(ranks) > 1:
            by_ranks.setdefault(ranks, set()).update(stages)
    return tuple(
        Collective(CollectiveKind.ALL_REDUCE, ranks, _what(stages))
        for ranks, stages in sorted(by_ranks.items())
    )


def summed_stages(prog: Program) -> Groups:
    """The groups of stages whose gradients `prog`'s sums add (to place them again when a
    program's comm ops are placed afresh)."""
    found = []
    for instrs in prog.ranks:
        for instr in instrs:
            stages = _stages_of(instr)
            if len(stages) > 1:
                found.append(stages)
    return tuple(sorted(set(found)))


def _what(stages: set[int]) -> str:
    return f"{WHAT} " + "+".join(f"s{s}" for s in sorted(stages))


def _stages_of(instr: Instr) -> tuple[int, ...]:
    """The stages a gradient sum written by this pass names, else ()."""
    if type(instr) is not Collective or not instr.what.startswith(f"{WHAT} "):
        return ()
    names = instr.what[len(WHAT) + 1 :].split("+")
    if not all(n[:1] == "s" and n[1:].isdigit() for n in names):
        return ()
    return tuple(sorted(int(n[1:]) for n in names))


def _holders(placement: Placement) -> dict[int, set[int]]:
    """Each stage number (the same in every pipe) and the ranks holding it."""
    found: dict[int, set[int]] = {}
    for slot in placement.slots:
        found.setdefault(slot.stage, set()).add(slot.rank)
    return found


def _check_stages(placement: Placement, shared: Groups) -> None:
    last = max(placement.num_stages(p) for p in range(placement.num_pipes)) - 1
    for group in shared:
        for stage in group:
            if stage > last:
                named = "+".join(str(s) for s in group)
                raise InputError(
                    f"--shared {named}: stage {stage} is not a stage of the program "
                    f"(its stages are 0..{last})"
                )


def _join(placement: Placement, shared: Sequence[Sequence[int]]) -> list[set[int]]:
    """Every stage in one group with the stages it shares a parameter with (transitively);
    a stage that shares nothing is a group of its own."""
    parent = {slot.stage: slot.stage for slot in placement.slots}
    for group in shared:
        for stage in group[1:]:
            a, b = _root(parent, group[0]), _root(parent, stage)
            parent[max(a, b)] = min(a, b)
    found: dict[int, set[int]] = {}
    for stage in sorted(parent):
        found.setdefault(_root(parent, stage), set()).add(stage)
    return list(found.values())


def _root(parent: dict[int, int], stage: int) -> int:
    """The representative of `stage`'s group (union-find)."""
    while parent[stage] != stage:
        stage = parent[stage]
    return stage
