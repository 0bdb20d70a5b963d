"""What a `pipecc run` model file adds to the resolution of the program it runs, so that the
program verified is the one its steps run: the stages it ties (placed as `--shared` places
them, docs/recipes.md) and, on a mesh with ep > 1 without `--moe`, the MoE blocks of each
of its stages (placed as `--moe` places them, docs/parallelism.md); and `--partition`'s cut.
The runtime finds both on the model file (`find_ties`, `find_layers`: the launcher's); this
module needs no torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NamedTuple

from pipecc.commands.run_report import Ties
from pipecc.diagnostics import InputError
from pipecc.ir.program import Program
from pipecc.search.layers import load_cut


class FromModel(NamedTuple):
    """The model file's part of the resolution: its ties, and its MoE layers by stage
    (empty: --moe given, no ep, or no MoE stage)."""

    ties: Ties = ()
    moe: tuple[int, ...] = ()


NOTHING = FromModel()


def from_model(
    args: argparse.Namespace,
    find_ties: Callable[..., Ties],
    find_layers: Callable[[str, int], tuple[int, ...]],
    program: Program,
    ep: int,
) -> FromModel:
    """The model file's ties, found on its stages as this run cuts them (`--partition`),
    and, with ep > 1 and no --moe, its MoE blocks by stage (said in a note)."""
    stages = program.placement.num_stages(0)
    ties = find_ties(args.model, stages, partition(args.partition, program)[0])
    if ep == 1 or args.moe is not None:
        return FromModel(ties)
    layers = find_layers(args.model, stages)
    if not any(layers):
        return FromModel(ties)
    said = ", ".join(map(str, layers))
    print(f"note: --moe from the model file: MoE layers by stage {said}", file=sys.stderr)
    return FromModel(ties, layers)


def partition(
    path: str | None, program: Program
) -> tuple[tuple[tuple[str, ...], ...] | None, dict[int, str]]:
    """--partition: each stage's layer names, one stage of the cut per program stage, and
    the stages the cut recomputes (`recompute = "full"`, as `--recompute s:full`)."""
    if path is None:
        return None, {}
    cut, names = load_cut(path)
    stages = program.placement.num_stages(0)
    if cut.stages != stages:
        raise InputError(
            f"{path}: the cut has {cut.stages} stages, but the program "
            f"({program.schedule}) has {stages}: search the cut for this program's placement"
        )
    recompute = {stage: "full" for stage in range(cut.stages) if cut.recompute[stage]}
    layers = tuple(tuple(names[n] for n in cut.span(stage)) for stage in range(cut.stages))
    return layers, recompute
