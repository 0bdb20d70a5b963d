"""The instructions of a compiled program: a closed, typed vocabulary (DESIGN §2, §4).

Instructions are immutable `NamedTuple`s rather than frozen dataclasses: a large program holds
about 10⁶ of them and a named tuple is built twice as fast (see benchmarks/compile_scale.py).
They keep the properties the house style asks of IR nodes: immutable, typed fields, an enum
for every opcode, and a source span that takes no part in equality or hashing. Equality also
compares the class, so a `Send` never equals a `Recv` with the same fields.

    Instr = Compute | Fused | Sequential | Phase | Send | Recv | Wait | StageOp | Collective
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from pipecc.diagnostics import Span


class Kind(enum.Enum):
    """Compute op kinds, in torch.distributed.pipelining's letters."""

    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # noqa: E741  backward for the input only (zero-bubble split)
    W = "W"  # backward for the weights of one earlier I

    # Members are singletons: identity hashing is correct, and much faster than Enum's
    # Python-level hash in the passes' dictionaries.
    __hash__ = object.__hash__

    @property
    def is_backward(self) -> bool:
        """True for B and I: the ops that consume a gradient and produce one upstream."""
        return self is Kind.B or self is Kind.I


class Msg(enum.Enum):
    """What a message carries: an activation (forward direction) or a gradient (backward)."""

    ACT = "act"
    GRAD = "grad"

    __hash__ = object.__hash__


class Compute(NamedTuple):
    """One computation of one chunk on one microbatch."""

    kind: Kind
    chunk: int
    pipe: int
    stage: int
    mb: int
    span: Span | None = None

    def __eq__(self, other: object) -> bool:
        return type(other) is Compute and self[:5] == other[:5]

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(("Compute", *self[:5]))

    def label(self) -> str:
        """The short form used in grids and messages: `F0.3` is chunk 0, microbatch 3."""
        return f"{self.kind.value}{self.chunk}.{self.mb}"


class Fused(NamedTuple):
    """F&B or F&I: a forward of one chunk overlapped with a backward of another."""

    forward: Compute
    backward: Compute
    span: Span | None = None

    def __eq__(self, other: object) -> bool:
        return type(other) is Fused and self[:2] == other[:2]

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(("Fused", *self[:2]))

    def label(self) -> str:
        return f"{self.forward.label()}&{self.backward.label()}"


class Sequential(NamedTuple):
    """torch's OVERLAP_F_B as torch's runtime runs it: any non-empty list of computations,
    one after another in the order written, as one instruction. Read from torch CSVs; a
    .sched file's `F&B` is a `Fused` (overlapped) instead."""

    parts: tuple[Compute, ...]
    span: Span | None = None

    def __eq__(self, other: object) -> bool:
        return type(other) is Sequential and self[0] == other[0]

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(("Sequential", self[0]))

    def label(self) -> str:
        """`(B0.0;F0.2)`: the parts in the order they run."""
        return "(" + ";".join(part.label() for part in self.parts) + ")"


class PhasePart(enum.Enum):
    """Which part of a MoE stage's computation a `Phase` is (docs/parallelism.md).

    `PRE` of layer l: before layer l's dispatch (for l = 0 the stage's head and layer 0's
    attention and router; for l > 0 layer l's attention and router, after layer l-1's
    combine). `EXPERTS` of layer l: its experts, between its dispatch and its combine.
    `POST`: after the last layer's combine, the rest of the stage (its layer is K)."""

    PRE = "pre"
    EXPERTS = "experts"
    POST = "post"

    __hash__ = object.__hash__


class Phase(NamedTuple):
    """One part of a MoE stage's F, B or I: the computation between two all-to-alls.

    A MoE stage with K layers runs its forward as pre0, dispatch L0, experts0, combine L0,
    pre1, ..., experts(K-1), combine L(K-1), post; a backward walks the same phases in
    reverse. The phases of one op, all present and in that order, are that op (coverage,
    dataflow, memory); its receives are consumed by its first phase, its sends post after
    its last (`passes/expand_moe.py`)."""

    op: Compute
    layer: int
    part: PhasePart
    span: Span | None = None

    def __eq__(self, other: object) -> bool:
        return type(other) is Phase and self[:3] == other[:3]

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(("Phase", *self[:3]))

    def label(self) -> str:
        """`F0.3:pre1`, `B1.2:experts0`, `F0.3:post` (the post phase has no layer number)."""
        layer = "" if self.part is PhasePart.POST else str(self.layer)
        return f"{self.op.label()}:{self.part.value}{layer}"

    @property
    def is_first(self) -> bool:
        """The op's first phase (it consumes the op's received input): a forward's pre0,
        a backward's post."""
        if self.op.kind is Kind.F:
            return self.part is PhasePart.PRE and self.layer == 0
        return self.part is PhasePart.POST

    @property
    def is_last(self) -> bool:
        """The op's last phase (the op is done: its output may be sent): a forward's post,
        a backward's pre0."""
        if self.op.kind is Kind.F:
            return self.part is PhasePart.POST
        return self.part is PhasePart.PRE and self.layer == 0


class Send(NamedTuple):
    """Post a non-blocking send of message (what, pipe, stage, mb) to `peer`.

    `stage` is the receiving stage, on the send as on the recv, so a matched pair carries
    equal names. Consecutive ops with the same non-null `group` are posted together.
    """

    what: Msg
    peer: int
    pipe: int
    stage: int
    mb: int
    group: int | None = None
    span: Span | None = None

    def __eq__(self, other: object) -> bool:
        return type(other) is Send and self[:6] == other[:6]

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(("Send", *self[:6]))

    def label(self) -> str:
        return f"send {self.what.value} s{self.stage}.{self.mb}→r{self.peer}"


class Recv(NamedTuple):
    """Post a non-blocking receive of message (what, pipe, stage, mb) from `peer`."""

    what: Msg
    peer: int
    pipe: int
    stage: int
    mb: int
    group: int | None = None
    span: Span | None = None

    def __eq__(self, other: object) -> bool:
        return type(other) is Recv and self[:6] == other[:6]

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(("Recv", *self[:6]))

    def label(self) -> str:
        return f"recv {self.what.value} s{self.stage}.{self.mb}←r{self.peer}"


class Wait(NamedTuple):
    """Block until the listed ops (indices into this rank's list) have completed."""

    ops: tuple[int, ...]
    span: Span | None = None

    def __eq__(self, other: object) -> bool:
        return type(other) is Wait and self[0] == other[0]

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(("Wait", self[0]))

    def label(self) -> str:
        return "wait " + ",".join(str(i) for i in self.ops)


class StageAction(enum.Enum):
    """torch's per-stage actions (FSDP): fetch a stage's sharded parameters, release them,
    and reduce its gradients once after its last backward (which also scales them by 1/M)."""

    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"

    __hash__ = object.__hash__


class StageOp(NamedTuple):
    """One of torch's UNSHARD, RESHARD, REDUCE_GRAD on one stage: no microbatch, no data
    between ranks. Programs compiled from .sched files hold none; torch CSVs may."""

    kind: StageAction
    chunk: int
    pipe: int
    stage: int
    span: Span | None = None

    def __eq__(self, other: object) -> bool:
        return type(other) is StageOp and self[:4] == other[:4]

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(("StageOp", *self[:4]))

    def label(self) -> str:
        """`UNSHARD1` is chunk 1's UNSHARD."""
        return f"{self.kind.value}{self.chunk}"


class CollectiveKind(enum.Enum):
    """What a collective does over its ranks (DESIGN §4's `kind`)."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all_to_all"  # expert parallelism's dispatch and combine (over `ep`)

    __hash__ = object.__hash__


class Collective(NamedTuple):
    """A collective over `ranks` (global rank numbers, sorted, this rank among them): a
    rendezvous of all of them (DESIGN §5). `what` names what it carries ("grad-sum s0+s7":
    the summed gradients of stages 0 and 7); members issue their collectives over one set
    of ranks in the same order, kind and `what`. Blocking unless `asynchronous` (JSON
    `"async": true`): then a later Wait lists it, as it lists a send or a receive.

    In a pipeline's program on a mesh (`Program.mesh`, docs/parallelism.md), `dims` names
    mesh dimensions (`("dp_replicate",)`): the collective then runs over the listed pipeline
    ranks times every coordinate along those dimensions, the rank's own coordinates along
    the others (`ir/mesh.py`); `ranks` are global ranks otherwise. `stages` are the stages
    whose parameters or gradients it carries (what the runtime reduces, what the simulator
    costs from their bytes); `shards`: those tensors are split over this many ranks (FSDP's
    dp_shard), so it moves 1/shards of their bytes."""

    kind: CollectiveKind
    ranks: tuple[int, ...]
    what: str
    asynchronous: bool = False
    dims: tuple[str, ...] = ()
    stages: tuple[int, ...] = ()
    shards: int = 1
    span: Span | None = None

    def __eq__(self, other: object) -> bool:
        return type(other) is Collective and self[:7] == other[:7]

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(("Collective", *self[:7]))

    def label(self) -> str:
        """`all_reduce{0,7}`: the kind and the ranks."""
        return f"{self.kind.value}{{{','.join(str(r) for r in self.ranks)}}}"


Comm = Send | Recv
Instr = Compute | Fused | Sequential | Phase | Send | Recv | Wait | StageOp | Collective
COMPUTE_TYPES = (Compute, Fused, Sequential, Phase)  # the instructions that compute


def is_compute(instr: Instr) -> bool:
    """A Compute, a Fused, a Sequential or a Phase."""
    t = type(instr)
    return t is Compute or t is Fused or t is Sequential or t is Phase


def phases(op: Compute, layers: int) -> tuple[Phase, ...]:
    """The phases of a MoE stage's F, B or I with `layers` MoE layers, in the order they run:
    pre0, experts0, pre1, ..., experts(K-1), post for a forward; the reverse for a backward
    (the all-to-alls sit between them), each with the op's span. A W is not split: ()."""
    if op.kind is Kind.W or layers < 1:
        return ()
    found = [
        Phase(op, layer, part, op.span)
        for layer in range(layers)
        for part in (PhasePart.PRE, PhasePart.EXPERTS)
    ]
    found.append(Phase(op, layers, PhasePart.POST, op.span))
    return tuple(found) if op.kind is Kind.F else tuple(reversed(found))


def all_to_all_what(op: Compute, layers: int, j: int) -> str:
    """The `what` of the j-th all-to-all of `op` (after its j-th phase) on a stage of
    `layers` MoE layers: `dispatch L0 F1.3`, `combine L0 F1.3` forward; `combine-grad L1
    B1.3`, `dispatch-grad L1 B1.3` backward (an I's are a B's: the same gradients cross)."""
    if op.kind is Kind.F:
        verb = "dispatch" if j % 2 == 0 else "combine"
        return f"{verb} L{j // 2} {op.label()}"
    verb = "combine-grad" if j % 2 == 0 else "dispatch-grad"
    return f"{verb} L{layers - 1 - j // 2} B{op.chunk}.{op.mb}"


def computations(instr: Instr) -> tuple[Compute, ...]:
    """The computations an instruction completes: one, two for a fused op, none for comm;
    a Phase completes its op when it is the op's last phase (`Phase.is_last`), else none."""
    match instr:
        case Compute():
            return (instr,)
        case Fused():
            return (instr.forward, instr.backward)
        case Sequential():
            return instr.parts
        case Phase():
            return (instr.op,) if instr.is_last else ()
        case Send() | Recv() | Wait() | StageOp() | Collective():
            return ()
        case _:
            raise AssertionError(f"unknown instruction {instr!r}")


def works_on(instr: Instr) -> tuple[Compute, ...]:
    """The computations an instruction works on: `computations`, and a Phase's op at every
    phase (what needs the stage's parameters there, e.g. FSDP's unsharded ones)."""
    if type(instr) is Phase:
        return (instr.op,)
    return computations(instr)
