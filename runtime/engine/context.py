"""Per-step state of the interpreter: everything one `step` creates and consumes.

Nothing here outlives a step: a fresh `StepContext` is built for each call, so two runtimes
(or two steps) never share state, and a step that ends with anything left over is a wrong
program (`leftovers`). The `Mailbox` is a list indexed by the plan's message slots
(runtime/plan/plan.py `mailbox`), made for the plan the step runs; a step's receive buffers
belong to the bound plan (runtime/engine/bound.py), and its posted sends and receives to the
transfers (runtime/engine/transfers.py `PostState`), not to the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from pipecc.diagnostics import ProgramError
from pipecc.ir.keys import Message
from pipecc.ir.printer import message

from .selective import Selected
from .split_backward import WeightGrad

Tensors = tuple[torch.Tensor, ...]


class Mailbox(list[Tensors | None]):
    """The tensors of each message slot of a plan between the instruction that leaves them
    (a forward, a backward, a completed receive) and the one that takes them."""

    __slots__ = ("messages",)

    def __init__(self, messages: tuple[Message, ...] = ()) -> None:
        super().__init__([None] * len(messages))
        self.messages = messages  # the message of each slot

    def take(self, slot: int) -> Tensors:
        """Take a message's tensors out of the mailbox; absent is a wrong program."""
        found = self[slot]
        if found is None:
            raise ProgramError(
                f"{message(self.messages[slot])} is not here: it was neither "
                "produced on this rank nor received by a completed wait before this instruction"
            )
        self[slot] = None
        return found

    def leftovers(self) -> list[str]:
        """The messages still in the mailbox, by name."""
        return sorted(message(self.messages[slot]) for slot, t in enumerate(self) if t is not None)


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


@dataclass
class StepContext:
    """The state of one step on one rank."""

    inputs: list[object] | None  # this rank's microbatches of the step's inputs
    targets: list[object] | None
    scale: float  # 1/M: each microbatch's share of the step's mean loss
    training: bool  # False: forward only, nothing kept for a backward
    step: int = 0  # the runtime's step counter (the RNG derivation uses it)
    mail: Mailbox = field(default_factory=Mailbox)  # by slot, made for the plan it runs
    saved: dict[tuple[int, int], Saved] = field(default_factory=dict)
    weights: dict[tuple[int, int], WeightGrad] = field(default_factory=dict)
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
        if self.saved:
            found.append(f"forwards without a backward: (chunk, mb) {sorted(self.saved)}")
        if self.weights:
            found.append(f"I without its W: (chunk, mb) {sorted(self.weights)}")
        left = self.mail.leftovers()
        if left:
            found.append("tensors produced but never consumed: " + "; ".join(left))
        return found
