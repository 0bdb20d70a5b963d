"""The replay rules of DESIGN §5, timed (the package docstring states them exactly).

Every time is a max-plus expression of earlier times, because matching is fixed by posting
order. So the engine needs no global priority queue: it advances one rank until it blocks,
and a completion wakes the rank blocked on it. Any processing order computes the same
times, and the same blocked state when the program deadlocks.
"""

from __future__ import annotations

from typing import cast

from pipecc.ir.program import Program
from pipecc.semantics.durations import collective_costs, instruction_costs
from pipecc.semantics.model import ZERO_TIMING, CommModel, Timing
from pipecc.semantics.result import Block, Replay, Stuck
from pipecc.semantics.wiring import COLL, RECV, SEND, Wiring, wire


def replay(
    program: Program,
    *,
    model: CommModel = CommModel.NCCL,
    timing: Timing = ZERO_TIMING,
    wiring: Wiring | None = None,
) -> Replay:
    """Replay `program` under `model` with `timing`.

    Pass `wiring=wire(program)` to share the static analysis between several replays of one
    program.
    """
    if wiring is None:
        wiring = wire(program)
    elif wiring.program is not program:
        raise ValueError("the wiring belongs to another program")
    run = _make_run(wiring, model, timing)
    run.run()
    return Replay(
        wiring=wiring,
        model=model,
        start=run.start,
        end=run.end,
        done=run.done,
        unit_act=run.unit_act,
        unit_post=run.unit_post,
        latency=run.lat,
        cursors=tuple(run.cursor),
        stuck=_stuck(run),
    )


def _make_run(wiring: Wiring, model: CommModel, timing: Timing) -> _Run:
    if model.has_streams:
        return _StreamRun(wiring, model, timing)
    if model is CommModel.RENDEZVOUS:
        return _RendezvousRun(wiring, model, timing)
    return _EagerRun(wiring, model, timing)


class _Run:
    """The mutable state of one replay, indexed by global instruction id. Subclasses give
    the completion rule of their comm model in `_post`."""

    def __init__(self, wiring: Wiring, model: CommModel, timing: Timing) -> None:
        n = len(wiring.code)
        self.w = wiring
        self.model = model
        self.partner = wiring.partner
        self.start: list[float | None] = [None] * n
        self.end: list[float | None] = [None] * n
        self.done: list[float | None] = [None] * n
        self.waiter = [-1] * n  # the rank blocked on this op, if any
        self.ready: list[int] = list(range(wiring.num_ranks - 1, -1, -1))  # ranks to advance
        self.cursor = list(wiring.offsets[:-1])
        self.clock = [0.0] * wiring.num_ranks
        self.dur, self.lat = instruction_costs(wiring, timing)
        if wiring.members and timing is not ZERO_TIMING:
            self.lat = collective_costs(wiring, timing, list(self.lat))
        self.unit_act: list[float | None] = []
        self.unit_post: list[float | None] = [None] * len(wiring.unit_first)

    def run(self) -> None:
        ready = self.ready
        while ready:
            self._advance(ready.pop())

    def _advance(self, rank: int) -> None:
        """Run `rank` from its cursor until it blocks or ends (the hot loop)."""
        w = self.w
        code, deps, done, dur = w.code, w.deps, self.done, self.dur
        start, end = self.start, self.end
        unit_of, unit_first, unit_last = w.unit, w.unit_first, w.unit_last
        unit_post = self.unit_post
        post = self._post
        g, t = self.cursor[rank], self.clock[rank]
        stop = w.offsets[rank + 1]
        while g < stop:
            c = code[g]
            if c == SEND or c == RECV:
                start[g] = t
                t += dur[g]  # the host time of the post
                end[g] = t
                u = unit_of[g]
                if unit_last[u] == g:  # a group is posted with its last op
                    unit_post[u] = t
                    for o in range(unit_first[u], g + 1):
                        post(o, t, rank)
                g += 1
                continue
            if c == COLL:
                after = self._collective(g, t, rank)
                if after is None:
                    return
                t = after
                g += 1
                continue
            s = t
            for d in deps[g]:
                x = done[d]
                if x is None:
                    self.waiter[d] = rank
                    self.cursor[rank], self.clock[rank] = g, t
                    return
                if x > s:
                    s = x
            start[g] = s
            t = s + dur[g]  # a compute op's duration, a Wait's host time after its release
            end[g] = t
            g += 1
        self.cursor[rank], self.clock[rank] = g, t

    def _post(self, g: int, t: float, rank: int) -> None:
        raise NotImplementedError

    def _collective(self, g: int, t: float, rank: int) -> float | None:
        """Collective g at time t: posted when the rank first reaches it (its unit is
        posted then); a blocking one then holds the rank until it completes. Returns the
        rank's clock after it, or None when the rank blocks here."""
        if self.start[g] is None:
            self.start[g] = t
            t += self.dur[g]  # the host time of the post
            self.end[g] = t
            self.unit_post[self.w.unit[g]] = t
            self._post_collective(g)
        if g in self.w.blocking:
            x = self.done[g]
            if x is None:
                self.waiter[g] = rank
                self.cursor[rank], self.clock[rank] = g, t
                return None
            if x > t:
                t = x
            self.end[g] = t  # a blocking collective ends when it completes
        return t

    def _post_collective(self, g: int) -> None:
        """eager and rendezvous: the collectives complete together once all are posted."""
        members = self.w.members[g]
        posts = [self.unit_post[self.w.unit[m]] for m in members]
        if not members or any(p is None for p in posts):
            return
        at = max(cast("list[float]", posts)) + self.lat[members[0]]  # one duration for all
        for m in members:
            self._complete(m, at)

    def _complete(self, g: int, at: float) -> None:
        self.done[g] = at
        w = self.waiter[g]
        if w >= 0:
            self.waiter[g] = -1
            self.ready.append(w)


class _EagerRun(_Run):
    """A send completes when posted; its recv at max(recv post, send post + latency)."""

    def _post(self, g: int, t: float, rank: int) -> None:
        p = self.partner[g]
        if self.w.code[g] == SEND:
            self._complete(g, t)
            other = self.unit_post[self.w.unit[p]] if p >= 0 else None
            if other is not None:
                arrival = t + self.lat[g]
                self._complete(p, other if other > arrival else arrival)
        elif p >= 0:
            other = self.unit_post[self.w.unit[p]]
            if other is not None:
                arrival = other + self.lat[g]
                self._complete(g, t if t > arrival else arrival)


class _RendezvousRun(_Run):
    """A matched pair transfers from the later of the two posts."""

    def _post(self, g: int, t: float, rank: int) -> None:
        p = self.partner[g]
        if p >= 0:
            other = self.unit_post[self.w.unit[p]]
            if other is not None:
                at = (t if t >= other else other) + self.lat[g]
                self._complete(g, at)
                self._complete(p, at)


class _StreamRun(_Run):
    """nccl and nccl-single: units queue on FIFO streams; a unit is active once posted and
    at the head of all its streams; a pair transfers once both units are active."""

    def __init__(self, wiring: Wiring, model: CommModel, timing: Timing) -> None:
        super().__init__(wiring, model, timing)
        count = len(wiring.unit_first)
        streams = wiring.streams(model)
        self.units_on = streams.units
        self.streams_of = streams.of_unit
        self.head = [0] * len(self.units_on)  # position of each stream's head unit
        self.unit_act = [None] * count
        self.unit_ready = [0.0] * count  # the latest completion of a unit ahead of it
        self.unit_left = [
            b - a + 1 for a, b in zip(wiring.unit_first, wiring.unit_last, strict=True)
        ]
        self.unit_end = [0.0] * count
        self.members = wiring.members or [()] * len(wiring.code)
        # the arrays the hot loops use, unpacked in one step at each call
        self.hot = (
            wiring.code,
            wiring.deps,
            self.start,
            self.end,
            self.done,
            self.dur,
            wiring.unit,
            wiring.unit_last,
            self.unit_post,
            self.units_on,
            self.head,
            self.streams_of,
        )
        self.hot_done = (self.units_on, self.head, self.unit_ready, self.streams_of, self.unit_post)
        self.hot_activate = (
            wiring.unit,
            self.unit_act,
            self.partner,
            self.lat,
            wiring.unit_first,
            wiring.unit_last,
            self.unit_post,
            self.unit_ready,
            self.done,
            self.waiter,
            self.ready,
            self.unit_end,
            self.unit_left,
        )

    def _advance(self, rank: int) -> None:  # noqa: C901  (one loop; a call per op is slower)
        """The base class's hot loop with the post of a unit inlined (the benchmark posts
        about 5·10⁵ ops; a method call per post costs a tenth of the replay)."""
        (
            code,
            deps,
            start,
            end,
            done,
            dur,
            unit_of,
            unit_last,
            unit_post,
            units_on,
            head,
            streams_of,
        ) = self.hot
        g, t = self.cursor[rank], self.clock[rank]
        stop = self.w.offsets[rank + 1]
        while g < stop:
            c = code[g]
            if c == SEND or c == RECV:
                start[g] = t
                t += dur[g]  # the host time of the post
                end[g] = t
                u = unit_of[g]
                if unit_last[u] == g:  # a group is posted with its last op
                    unit_post[u] = t
                    for stream in streams_of[u]:
                        if units_on[stream][head[stream]] != u:
                            break
                    else:
                        self._activate(u)
                g += 1
                continue
            if c == COLL:
                after = self._collective(g, t, rank)
                if after is None:
                    return
                t = after
                g += 1
                continue
            s = t
            for d in deps[g]:
                x = done[d]
                if x is None:
                    self.waiter[d] = rank
                    self.cursor[rank], self.clock[rank] = g, t
                    return
                if x > s:
                    s = x
            start[g] = s
            t = s + dur[g]
            end[g] = t
            g += 1
        self.cursor[rank], self.clock[rank] = g, t

    def _post_collective(self, g: int) -> None:
        """A posted collective's unit is active once it is at the head of all its streams."""
        u = self.w.unit[g]
        units_on, head = self.units_on, self.head
        if all(units_on[s][head[s]] == u for s in self.streams_of[u]):
            self._activate(u)

    def _activate(self, first: int) -> None:
        """Activate unit `first`, then every unit that becomes active in consequence: a
        send and its recv transfer once both their units are active."""
        active = [first]
        (
            unit_of,
            unit_act,
            partner,
            lat,
            unit_first,
            unit_last,
            unit_post,
            unit_ready,
            done,
            waiter,
            ready,
            unit_end,
            unit_left,
        ) = self.hot_activate
        while active:
            u = active.pop()
            post, ahead = unit_post[u], unit_ready[u]
            assert post is not None  # a unit is activated once its last op is posted
            a = unit_act[u] = post if post >= ahead else ahead
            for o in range(unit_first[u], unit_last[u] + 1):
                p = partner[o]
                if p < 0:
                    if self.members[o]:  # a collective: meets once every member is active
                        self._meet(o, active)
                    continue
                b = unit_act[unit_of[p]]
                if b is None:
                    continue
                at = (a if a >= b else b) + lat[o]
                for q in (o, p):
                    done[q] = at
                    blocked = waiter[q]
                    if blocked >= 0:
                        waiter[q] = -1
                        ready.append(blocked)
                    v = unit_of[q]
                    if at > unit_end[v]:
                        unit_end[v] = at
                    unit_left[v] -= 1
                    if not unit_left[v]:
                        self._unit_done(v, active)

    def _meet(self, g: int, active: list[int]) -> None:
        """Collective g's unit is active: when every member's is, all complete together,
        the collective's duration after the last of them became active."""
        unit_of, unit_act = self.w.unit, self.unit_act
        members = self.members[g]
        acts = [unit_act[unit_of[m]] for m in members]
        if any(a is None for a in acts):
            return
        at = max(cast("list[float]", acts)) + self.lat[members[0]]  # one duration for all
        for m in members:
            self.done[m] = at
            blocked = self.waiter[m]
            if blocked >= 0:
                self.waiter[m] = -1
                self.ready.append(blocked)
            v = unit_of[m]
            if at > self.unit_end[v]:
                self.unit_end[v] = at
            self.unit_left[v] -= 1
            if not self.unit_left[v]:
                self._unit_done(v, active)

    def _unit_done(self, u: int, active: list[int]) -> None:
        """Unit u completed: the next unit on each of its streams moves to the head; one
        that is posted and at the head of all its streams becomes active."""
        end = self.unit_end[u]
        units_on, head, ready, streams_of, unit_post = self.hot_done
        for s in streams_of[u]:
            position = head[s] = head[s] + 1
            queue = units_on[s]
            if position < len(queue):
                v = queue[position]
                if end > ready[v]:
                    ready[v] = end
                if unit_post[v] is None:
                    continue
                for x in streams_of[v]:
                    if units_on[x][head[x]] != v:
                        break
                else:
                    active.append(v)

    def blocker(self, u: int) -> int:
        """For a posted unit that is not active: an incomplete op of a unit ahead of it."""
        for s in self.streams_of[u]:
            h = self.units_on[s][self.head[s]]
            if h != u:
                ops = range(self.w.unit_first[h], self.w.unit_last[h] + 1)
                return next(o for o in ops if self.done[o] is None)
        raise AssertionError(f"unit {u} is at the head of all its streams")


def _stuck(run: _Run) -> tuple[Stuck, ...]:
    """The blocked state (empty when the replay finished): one edge for every stuck
    instruction and incomplete op reachable from a blocked rank or an incomplete op."""
    w = run.w
    ends = w.offsets[1:]
    if all(g == e for g, e in zip(run.cursor, ends, strict=True)) and (
        len(run.done) - run.done.count(None) == w.num_comm
    ):
        return ()
    todo = [g for g, e in zip(run.cursor, ends, strict=True) if g < e]
    todo += [
        g
        for g, c in enumerate(w.code)
        if (c == SEND or c == RECV or c == COLL)
        and run.start[g] is not None
        and run.done[g] is None
    ]
    edges: dict[int, Stuck] = {}
    while todo:
        g = todo.pop()
        if g in edges:
            continue
        why, on = _why(run, g)
        edges[g] = Stuck(*w.locate(g), why, None if on < 0 else w.locate(on))
        if on >= 0:
            todo.append(on)
    return tuple(edges[g] for g in sorted(edges))


def _why(run: _Run, g: int) -> tuple[Block, int]:
    """Why instruction g cannot run or complete, and the instruction it depends on."""
    w = run.w
    if run.start[g] is None:
        rank, _ = w.locate(g)
        if run.cursor[rank] == g and w.code[g] not in (SEND, RECV):  # the rank's blocked op
            return Block.WAITS_FOR, next(d for d in w.deps[g] if run.done[d] is None)
        return Block.NOT_POSTED, run.cursor[rank]
    if w.code[g] == COLL:
        return _why_collective(run, g)
    p = w.partner[g]
    if p < 0:
        return Block.NO_PARTNER, -1
    if isinstance(run, _StreamRun) and run.unit_act[w.unit[g]] is None:
        return Block.STREAM, run.blocker(w.unit[g])
    return Block.PARTNER, p


def _why_collective(run: _Run, g: int) -> tuple[Block, int]:
    """Why posted collective g has not completed: no match on some member, a unit ahead of
    it on a stream (nccl), or a member that has not reached (or activated) its own."""
    w = run.w
    members = w.members[g] if w.members else ()
    if not members:
        return Block.NO_PARTNER, -1
    if isinstance(run, _StreamRun) and run.unit_act[w.unit[g]] is None:
        return Block.STREAM, run.blocker(w.unit[g])
    for m in members:
        late = run.unit_act[w.unit[m]] if isinstance(run, _StreamRun) else run.start[m]
        if m != g and late is None:
            return Block.MEMBERS, m
    raise AssertionError(f"collective {g} has every member ready but did not complete")
