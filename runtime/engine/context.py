"""Per-step state of the interpreter: everything one `step` creates and consumes.

Nothing here outlives a step: a fresh `StepContext` is built for each call, so two runtimes
(or two steps) never share state, and a step that ends with anything left over is a wrong
program (`leftovers`). The mailbox is a list indexed by the plan's message slots
(runtime/plan/plan.py `mailbox`), set up by the interpreter from the plan it runs; a step's
receive buffers belong to the bound plan (runtime/engine/bound.py), not to the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from pipecc.ir.keys import Message
from pipecc.ir.printer import message

from ..comm.channel import Posted
from .selective import Selected
from .split_backward import WeightGrad

if TYPE_CHECKING:
    from .steps import PostStep

Tensors = tuple[torch.Tensor, ...]


class Saved(NamedTuple):
    """What a forward leaves for the backward of one (chunk, mb).

    `inputs` are the stage's input leaves; `outputs` the tensors a backward starts from (the
    stage outputs, or the loss already scaled by 1/M on a last stage); `added` the sum of
    the losses the forward added (`add_loss`, runtime/engine/aux_loss.py), unscaled: an
    extra root of the backward, seeded with 1/M. `replay`: on a recomputed stage, the
    forward ran without a graph and `outputs` is empty; its backward first runs the forward
    again from this (runtime/engine/compute.py `replayed`). `selected`: on a stage that
    recomputes selected modules, what their replay needs (runtime/engine/selective.py).
    """

    inputs: Tensors
    outputs: Tensors
    added: torch.Tensor | None = None
    replay: Replay | None = None
    selected: Selected | None = None


class Replay(NamedTuple):
    """What a recomputed stage's forward keeps: its input value (whose tensor leaves are
    `Saved.inputs`), its bound step, and the RNG state it ran under when states are not
    derived (None when they are: the derivation gives it again)."""

    value: object
    op: Any
    rng_state: Any = None


class Pending(NamedTuple):
    """A posted send or receive, until its `wait`: one handle per tensor of its message."""

    step: PostStep
    posted: tuple[Posted, ...]
    tensors: Tensors


@dataclass
class StepContext:
    """The state of one step on one rank."""

    inputs: list[object] | None  # this rank's microbatches of the step's inputs
    targets: list[object] | None
    scale: float  # 1/M: each microbatch's share of the step's mean loss
    training: bool  # False: forward only, nothing kept for a backward
    step: int = 0  # the runtime's step counter (the RNG derivation uses it)
    mail: list[Tensors | None] = field(default_factory=list)  # by slot (the interpreter's)
    messages: tuple[Message, ...] = ()  # the message of each slot
    saved: dict[tuple[int, int], Saved] = field(default_factory=dict)
    weights: dict[tuple[int, int], WeightGrad] = field(default_factory=dict)
    pending: dict[int, Pending] = field(default_factory=dict)
    # async collectives over mesh dimensions, by instruction (runtime/comm/mesh.py): their
    # works, completed by the `wait` that lists them
    reductions: dict[int, list[Any]] = field(default_factory=dict)
    queue: list[tuple[PostStep, Tensors]] = field(default_factory=list)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    # the losses added inside each stage's forward, by microbatch then stage (detached sums)
    aux_losses: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    context: list[dict[str, object]] | None = None  # this rank's microbatches of the context
    outputs: dict[int, object] = field(default_factory=dict)
    # per chunk (by id), its parameters whose first gradient of the step has not come yet
    # (runtime/engine/compute.py `drain`)
    unowned: dict[int, tuple[torch.nn.Parameter, ...]] = field(default_factory=dict)

    def leftovers(self) -> list[str]:
        """What a complete program would have consumed by the end of the step."""
        found = []
        if self.pending or self.reductions:
            posted = sorted([*self.pending, *self.reductions])
            found.append(f"posted ops never waited: instructions {posted}")
        if self.saved:
            found.append(f"forwards without a backward: (chunk, mb) {sorted(self.saved)}")
        if self.weights:
            found.append(f"I without its W: (chunk, mb) {sorted(self.weights)}")
        left = [slot for slot, tensors in enumerate(self.mail) if tensors is not None]
        if left:
            names = sorted(message(self.messages[slot]) for slot in left)
            found.append("tensors produced but never consumed: " + "; ".join(names))
        return found
