"""Insert instructions into one rank's list, or drop some, keeping every Wait on its ops.

A Wait lists indices into its rank's list, so any pass that inserts or removes instructions
renumbers them; this is that renumbering, once, for the passes of the mesh
(`insert_fsdp_actions`, `insert_dp_reduction`, `expand_mesh`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from pipecc.ir.ops import Instr, Wait

Inserts = Mapping[int, Sequence[Instr]]


def splice(
    instrs: Sequence[Instr],
    *,
    before: Inserts | None = None,
    after: Inserts | None = None,
    drop: Callable[[Instr], bool] | None = None,
) -> tuple[Instr, ...]:
    """`instrs` with `before[i]` inserted just before instruction i and `after[i]` just after
    it (`before[len(instrs)]`: at the end), and the instructions `drop` selects removed.

    Requires: inserted Waits are new (`Wait` objects not in `instrs`) and already list the new
    indices (`positions` finds where inserted instructions landed).
    Ensures: every Wait of `instrs` lists the new indices of the ops it listed, dropped ones
    left out, and a Wait whose every op is dropped is dropped too; an index outside the list
    (a malformed input the verifier reports) is kept as it was.
    """
    before, after = before or {}, after or {}
    dropped = {i for i, x in enumerate(instrs) if drop is not None and drop(x)}
    for i, x in enumerate(instrs):
        if type(x) is Wait and x.ops and all(o in dropped for o in x.ops):
            dropped.add(i)
    new_index: dict[int, int] = {}
    out: list[Instr] = []
    for i, instr in enumerate(instrs):
        out.extend(before.get(i, ()))
        if i not in dropped:
            new_index[i] = len(out)
            out.append(instr)
        out.extend(after.get(i, ()))
    out.extend(before.get(len(instrs), ()))
    for i, at in new_index.items():
        x = instrs[i]
        if type(x) is Wait:
            ops = tuple(new_index[o] if o in new_index else o for o in x.ops if o not in dropped)
            out[at] = Wait(ops, x.span)
    return tuple(out)


def positions(instrs: Sequence[Instr], wanted: Sequence[Instr]) -> tuple[int, ...]:
    """The indices in `instrs` of the objects `wanted` (by identity, in `wanted`'s order)."""
    at = {id(x): i for i, x in enumerate(instrs)}
    return tuple(at[id(x)] for x in wanted)
