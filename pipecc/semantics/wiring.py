"""The static part of a replay: numbering, matching, consumed recvs, units and streams.

None of this depends on the comm model's timing rules or on durations, so one `Wiring` serves
every replay of a program (the four models of `verify --comm all`, the simulator's cost
models, the alignment pass's trials).

Instructions are numbered globally: instruction `index` of `rank` has id
`offsets[rank] + index`, and every array is a flat tuple indexed by that id, so the replay's
hot loop works on integers only.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

from pipecc.ir.keys import MessageKeys
from pipecc.ir.ops import (
    Collective,
    Compute,
    Instr,
    Kind,
    Phase,
    Recv,
    Send,
    StageOp,
    Wait,
    computations,
)
from pipecc.ir.program import Program
from pipecc.semantics.model import CommModel

# instruction codes
COMPUTE, SEND, RECV, WAIT, COLL = 0, 1, 2, 3, 4
_EMPTY: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class CommStreams:
    """The FIFO streams of one model: `units[s]` lists the units on stream s in posting
    order. Stream ids: rank * P + peer under nccl, rank under nccl-single."""

    model: CommModel
    units: tuple[Sequence[int], ...]
    of_unit: Sequence[tuple[int, ...]]  # the streams each unit sits on

    def preds(self, wiring: Wiring, u: int) -> tuple[int, ...]:
        """The units just ahead of unit u on its streams."""
        found = []
        for s in self.of_unit[u]:
            units = self.units[s]
            at = units.index(u)
            if at:
                found.append(units[at - 1])
        return tuple(sorted(set(found)))


@dataclass(frozen=True, slots=True)
class Wiring:
    """What every replay of `program` shares (module docstring).

    A *unit* is one Send/Recv, or a group (consecutive Send/Recv of one rank with the same
    non-null group id); its ops are the contiguous ids `unit_first[u]..unit_last[u]`.
    """

    program: Program
    keys: MessageKeys  # the message keys of the program's placement
    offsets: tuple[int, ...]  # P + 1 entries; rank r's ids are offsets[r]..offsets[r+1]-1
    code: Sequence[int]  # COMPUTE, SEND, RECV or WAIT
    deps: Sequence[tuple[int, ...]]  # recvs a compute consumes; comm ops a Wait lists
    message: Sequence[int]  # message key of a Send/Recv (`MessageKeys`), else -1
    peer: Sequence[int]  # peer of a Send/Recv if it is another rank, else -1
    partner: Sequence[int]  # the matched op of a Send/Recv, -1 if none
    unit: Sequence[int]  # the unit of a Send/Recv, else -1
    unit_first: Sequence[int]
    unit_last: Sequence[int]
    unit_offsets: tuple[int, ...]  # P + 1 entries: rank r's units are a contiguous range
    sends: tuple[tuple[Sequence[int], ...], ...]  # sends[src][dst]: sends of src to dst
    recvs: tuple[tuple[Sequence[int], ...], ...]  # recvs[dst][src]: recvs of dst from src
    computes: tuple[Sequence[int], ...]  # per rank: ids of its Compute/Fused instructions
    waits: tuple[Sequence[int], ...]  # per rank: ids of its Wait instructions
    unreceived: tuple[int, ...]  # computes needing a remote tensor that no recv carries
    peer_streams: tuple[Sequence[int], ...]  # units per (rank * P + peer), in posting order
    unit_peer_streams: Sequence[tuple[int, ...]]  # the (rank * P + peer) streams of a unit
    num_comm: int
    num_paired: int  # Send/Recv ops whose peer is another rank (those in `sends`/`recvs`)
    # collectives: the ids of each set of ranks' collectives, per member in rank order
    # (`(ranks, ((ids of ranks[0]), (ids of ranks[1]), ...))`, sets sorted); the collectives
    # whose ranks are not a set of valid ranks holding their own (they take part in none)
    collectives: tuple[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]], ...] = ()
    bad_collectives: tuple[int, ...] = ()
    members: Sequence[tuple[int, ...]] = ()  # per id: the matched collectives, () if none
    blocking: frozenset[int] = frozenset()  # the blocking collectives (the rank waits there)

    @property
    def num_ranks(self) -> int:
        return len(self.offsets) - 1

    def gid(self, rank: int, index: int) -> int:
        return self.offsets[rank] + index

    def locate(self, gid: int) -> tuple[int, int]:
        """(rank, index) of a global instruction id."""
        rank = bisect_right(self.offsets, gid) - 1
        return rank, gid - self.offsets[rank]

    def instr(self, gid: int) -> Instr:
        rank, index = self.locate(gid)
        return self.program.ranks[rank][index]

    def streams(self, model: CommModel) -> CommStreams:
        """The streams of nccl (one per rank and peer) or nccl-single (one per rank)."""
        if model is CommModel.NCCL_SINGLE:
            offsets = self.unit_offsets
            ranks = range(self.num_ranks)
            units = tuple(range(offsets[r], offsets[r + 1]) for r in ranks)
            of_unit: list[tuple[int, ...]] = []
            for r in ranks:
                of_unit.extend([(r,)] * (offsets[r + 1] - offsets[r]))
            return CommStreams(model, units, of_unit)
        return CommStreams(CommModel.NCCL, self.peer_streams, self.unit_peer_streams)


_F, _B, _I = Kind.F, Kind.B, Kind.I


def inputs(instr: Instr) -> tuple[Compute, ...]:
    """The computations whose received input an instruction consumes: its computations,
    but for a MoE phase its op at the op's first phase (the op's later phases take their
    input from the phase before)."""
    if type(instr) is Phase:
        return (instr.op,) if instr.is_first else ()
    return computations(instr)


def wire(program: Program) -> Wiring:
    """Number every instruction, match sends with recvs, bind consumed recvs, find units."""
    builder = _Builder(program)
    for rank, instrs in enumerate(program.ranks):
        builder.scan(rank, instrs)
    met = builder.gather()
    return Wiring(
        program=program,
        keys=builder.keys,
        offsets=tuple(builder.offsets),
        code=builder.code,
        deps=builder.deps,
        message=builder.message,
        peer=builder.peer,
        partner=builder.match(),
        unit=builder.unit,
        unit_first=builder.unit_first,
        unit_last=builder.unit_last,
        unit_offsets=tuple(builder.unit_offsets),
        sends=tuple(tuple(row) for row in builder.sends),
        recvs=tuple(tuple(row) for row in builder.recvs),
        computes=tuple(builder.computes),
        waits=tuple(builder.waits),
        unreceived=tuple(builder.unreceived),
        peer_streams=tuple(s for per_rank in builder.streams for s in per_rank),
        unit_peer_streams=builder.unit_streams,
        num_comm=builder.num_comm,
        num_paired=sum(len(ops) for rows in builder.sends for ops in rows)
        + sum(len(ops) for rows in builder.recvs for ops in rows),
        collectives=met.collectives,
        bad_collectives=met.bad,
        members=met.members,
        blocking=met.blocking,
    )


class _Met(NamedTuple):
    """The collectives of a program, matched (`Wiring`'s last four fields)."""

    collectives: tuple[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]], ...]
    bad: tuple[int, ...]
    members: Sequence[tuple[int, ...]]
    blocking: frozenset[int]


class _Builder:
    """Walks each rank once, filling the flat arrays of a Wiring."""

    def __init__(self, program: Program) -> None:
        n = program.num_instructions()
        self.num_ranks = program.num_ranks
        self.keys = MessageKeys(program.placement)
        self.table = self.keys.input_table()
        self.offsets = [0]
        self.unit_offsets = [0]
        self.code = [COMPUTE] * n
        self.deps = [_EMPTY] * n
        self.message = [-1] * n
        self.peer = [-1] * n
        self.unit = [-1] * n
        self.unit_first: list[int] = []
        self.unit_last: list[int] = []
        self.unit_streams: list[tuple[int, ...]] = []
        self.num_comm = 0
        # sends[src][dst]: ids of the sends of src to dst; recvs[dst][src]: the matching recvs
        ranks = range(self.num_ranks)
        self.sends: list[list[list[int]]] = [[[] for _ in ranks] for _ in ranks]
        self.recvs: list[list[list[int]]] = [[[] for _ in ranks] for _ in ranks]
        self.streams: list[list[list[int]]] = [[[] for _ in ranks] for _ in ranks]
        self._recvs_by_key: dict[int, list[int]] | None = None
        self.computes: list[list[int]] = []
        self.waits: list[list[int]] = []
        self.unreceived: list[int] = []
        self.by_set: dict[tuple[int, ...], dict[int, list[int]]] = {}  # collectives per set
        self.bad_collectives: list[int] = []
        self.blocking: set[int] = set()

    def scan(self, rank: int, instrs: Sequence[Instr]) -> None:  # noqa: C901
        """One pass over one rank. This is the hot loop of `wire` (about 10⁶ instructions
        at the benchmark size), so it is one function working on local names (its branches are
        the instruction kinds; splitting it costs a call per instruction)."""
        base = self.offsets[-1]
        code, message, peers, unit_of = self.code, self.message, self.peer, self.unit
        first, last, unit_streams = self.unit_first, self.unit_last, self.unit_streams
        name_key = self.keys.name_key
        sends, recvs, streams = self.sends[rank], self.recvs[rank], self.streams[rank]
        num_ranks = self.num_ranks
        computes: list[int] = []
        waits: list[int] = []
        received: dict[int, int] = {}  # message key -> its Recv on this rank
        twice = False  # a message received twice on this rank
        group = None  # the group id of the previous instruction, if a Send/Recv
        u = len(first) - 1
        for g, instr in enumerate(instrs, base):
            t = type(instr)
            if t is not Send and t is not Recv:
                group = None
                if t is Collective:
                    u += 1
                    self._collective(rank, g, u, cast(Collective, instr))
                elif t is Wait:
                    code[g] = WAIT
                    waits.append(g)
                elif t is not StageOp:  # a StageOp runs as a compute with no inputs
                    computes.append(g)
                continue
            what, peer, pipe, stage, mb, this_group, _ = cast("Send | Recv", instr)
            message[g] = key = name_key(what, pipe, stage, mb)
            if this_group is None or this_group != group:
                first.append(g)
                last.append(g)
                unit_streams.append(_EMPTY)
                u += 1
            else:
                last[-1] = g
            unit_of[g] = u
            group = this_group
            if t is Send:
                code[g] = SEND
                if 0 <= peer < num_ranks and peer != rank:
                    peers[g] = peer
                    sends[peer].append(g)
            else:
                code[g] = RECV
                twice = twice or key in received
                received[key] = g
                if 0 <= peer < num_ranks and peer != rank:
                    peers[g] = peer
                    recvs[peer].append(g)
            if peers[g] >= 0:
                stream = streams[peer]
                if not stream or stream[-1] != u:
                    stream.append(u)
                    unit_streams[u] += (rank * num_ranks + peer,)
        self.offsets.append(base + len(instrs))
        self.unit_offsets.append(len(first))
        self.num_comm += len(instrs) - len(computes) - len(waits)
        if twice:
            self._bind_computes(rank, base, instrs, computes)
        else:
            self._bind_unique(rank, base, instrs, computes, received)
        self._bind_waits(base, instrs, waits)
        self.computes.append(computes)
        self.waits.append(waits)

    def _bind_computes(
        self, rank: int, base: int, instrs: Sequence[Instr], computes: list[int]
    ) -> None:
        """The recv each compute consumes: the latest one with its message posted before
        it, else the first one after it (which it then waits for forever)."""
        code, message, deps = self.code, self.message, self.deps
        input_key = self.keys.input_key
        posted: dict[int, int] = {}  # message key -> latest Recv before the cursor
        self._recvs_by_key = None
        g = base
        for c in computes:
            while g < c:
                if code[g] == RECV:
                    posted[message[g]] = g
                g += 1
            instr = instrs[c - base]
            if type(instr) is Compute:
                key = input_key(instr, rank)
                if key >= 0:
                    found = posted[key] if key in posted else self._later(c, key)
                    if found >= 0:
                        deps[c] = (found,)
                    else:
                        self.unreceived.append(c)
            else:
                both = [
                    posted[k] if k in posted else self._later(c, k)
                    for op in inputs(instr)
                    if (k := input_key(op, rank)) >= 0
                ]
                deps[c] = tuple(sorted(d for d in both if d >= 0))  # as _bind_unique: latest last
                if len(deps[c]) < len(both):
                    self.unreceived.append(c)

    def _later(self, g: int, key: int) -> int:
        """The first Recv of message `key` after g on its rank, or -1 if there is none."""
        if self._recvs_by_key is None:
            self._recvs_by_key = {}
            for h in range(self.offsets[-2], self.offsets[-1]):
                if self.code[h] == RECV:
                    self._recvs_by_key.setdefault(self.message[h], []).append(h)
        found = self._recvs_by_key.get(key, [])
        at = bisect_right(found, g)
        return found[at] if at < len(found) else -1

    def _bind_unique(
        self,
        rank: int,
        base: int,
        instrs: Sequence[Instr],
        computes: list[int],
        received: dict[int, int],
    ) -> None:
        """`_bind_computes` when each message is received at most once on the rank: a
        compute consumes that recv, wherever it is (after it, it waits for it forever)."""
        keys = self.keys
        table = self.table
        period, pipes, stages = keys.mb_stride, keys.pipes, keys.stages
        deps, unreceived = self.deps, self.unreceived
        for g in computes:
            x = instrs[g - base]
            parts = (x,) if type(x) is Compute else inputs(x)
            found: tuple[int, ...] = ()
            for kind, _, pipe, stage, mb, _ in parts:
                if not (0 <= pipe < pipes and 0 <= stage < stages[pipe]) or mb < 0:
                    continue
                offset, src = table[
                    0 if kind is _F else 1 if kind is _B else 2 if kind is _I else 3
                ][pipe][stage]
                if offset >= 0 and src != rank:
                    d = received.get(mb * period + offset)
                    if d is None:
                        if not unreceived or unreceived[-1] != g:
                            unreceived.append(g)
                    else:
                        found += (d,)
            if found:
                deps[g] = found if len(found) == 1 else tuple(sorted(found))

    def _bind_waits(self, base: int, instrs: Sequence[Instr], waits: list[int]) -> None:
        """A Wait depends on the Send/Recv ops (and collectives) it lists; other indices are
        dropped here (the verifier reports them)."""
        if not waits:
            return
        count = len(instrs)
        code, deps = self.code, self.deps
        listed = [cast("Wait", instrs[g - base]).ops for g in waits]
        flat = [base + i for ops in listed for i in ops]
        if (
            flat
            and min(flat) >= base
            and max(flat) < base + count
            and {code[i] for i in flat} <= {SEND, RECV, COLL}
        ):
            for g, ops in zip(waits, listed, strict=True):
                deps[g] = tuple([base + i for i in ops])
            return
        for g, ops in zip(waits, listed, strict=True):
            deps[g] = tuple(
                base + i for i in ops if 0 <= i < count and code[base + i] in (SEND, RECV, COLL)
            )

    def _collective(self, rank: int, g: int, u: int, op: Collective) -> None:
        """A collective is a unit of its own, on the streams toward each other member."""
        self.code[g] = COLL
        self.unit[g] = u
        self.unit_first.append(g)
        self.unit_last.append(g)
        if not op.asynchronous:
            self.blocking.add(g)
        ranks = tuple(sorted(set(op.ranks)))
        valid = len(ranks) == len(op.ranks) and rank in ranks and ranks[-1] < self.num_ranks
        if not valid:
            self.unit_streams.append(_EMPTY)
            self.bad_collectives.append(g)
            return
        self.by_set.setdefault(ranks, {}).setdefault(rank, []).append(g)
        streams = self.streams[rank]
        for peer in ranks:
            if peer != rank:
                streams[peer].append(u)
        self.unit_streams.append(tuple(rank * self.num_ranks + p for p in ranks if p != rank))

    def gather(self) -> _Met:
        """The collectives' fields of the Wiring: the k-th collective over a set of ranks on
        each member meet (a member with fewer leaves the later ones of the others alone)."""
        if not self.by_set and not self.bad_collectives:
            return _Met((), (), (), frozenset())
        members: list[tuple[int, ...]] = [_EMPTY] * len(self.code)
        collectives = []
        for ranks in sorted(self.by_set):
            lists = tuple(tuple(self.by_set[ranks].get(r, ())) for r in ranks)
            collectives.append((ranks, lists))
            for k in range(min(len(ids) for ids in lists)):
                met = tuple(ids[k] for ids in lists)
                for g in met:
                    members[g] = met
        return _Met(
            tuple(collectives), tuple(self.bad_collectives), members, frozenset(self.blocking)
        )

    def match(self) -> list[int]:
        """The k-th send of src to dst matches the k-th recv of dst from src."""
        partner = [-1] * len(self.code)
        for src in range(self.num_ranks):
            for dst in range(self.num_ranks):
                for s, r in zip(self.sends[src][dst], self.recvs[dst][src], strict=False):
                    partner[s] = r
                    partner[r] = s
        return partner
