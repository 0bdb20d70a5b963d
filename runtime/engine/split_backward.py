"""Split backward: `I` computes input gradients only, `W` later the weight gradients.

Two methods, chosen per chunk when the runtime binds its plan (runtime/engine/bound.py): a
chunk with modules that have a weight-gradient contract (`nn.Linear`, or any class
registered) runs its forwards inside `weight_contract.capturing(module, capture)` and its `I`
with the same `capture`; then `I` is one
ordinary engine call over the whole graph in which each contracted call defers its input
and output gradient to `W`, and `W` computes those weights' gradients directly
(runtime/engine/weight_contract.py): no graph walk, no hooks on the graph, no second engine call,
and the graph is freed after `I`. Parameters outside contracted calls get their gradients
in `I`. Every other chunk uses the general method below.

The general method walks the autograd graph of one (chunk, microbatch), as torch's pipelining does;
it needs nothing from the user's modules (no custom autograd functions, unlike DualPipe's
weight-gradient store). The graph of a stage has three kinds of node:

* the *input path*: nodes from which a stage input can be reached. `I` runs the autograd
  engine from the outputs to the inputs only; the engine then computes, at each node, only
  the gradients that lead to an input (an `addmm` computes `grad @ W` and skips `x.T @ grad`).
* the *weight regions*: nodes that reach parameters but no input. They hang off the input
  path at *anchors* (input-path nodes with an edge into a weight region), or directly off an
  output (a stage whose inputs need no gradient, e.g. stage 0, is all weight region).
* everything else (constants), ignored.

`I` records, with a pre-hook on every anchor, the gradient flowing into the anchor, and keeps
the graph (`retain_graph`). `W` restarts the engine at the anchors with those gradients and
asks for the parameters only, so it runs the anchors' weight halves and the weight regions,
and never the input path again. Anchors whose weight regions share a node (a weight used
twice) are run together in one call; in such a group each anchor's incoming gradient is
pinned to the recorded value, so the part of the input path between two anchors, which the
engine may traverse again, adds nothing twice. Only that rare case repeats any work.

Between `I` and `W` the retained graph keeps the input-path intermediates alive as well
(memory, not time): the same trade-off as torch's implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from pipecc.ir.ops import Compute, Fused, Instr, Kind

from ..compat import ACCUMULATE_GRAD, leaf_of, run_backward
from .weight_contract import Capture, Deferred, accumulate, deferring

Grads = tuple[torch.Tensor | None, ...]


def _engine(
    roots: Sequence[torch.Tensor | GradientEdge],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    keep_graph: bool,
    accumulate: bool,
) -> Grads:
    """One call of the autograd engine.

    The engine is called directly (runtime/compat.py), as `torch.autograd.backward`/`grad`
    do after validating their arguments: that validation costs about 25 µs a call, and a W
    makes one call per anchor group (one per Linear layer), so it would be most of W's fixed
    cost. The runtime builds the arguments itself and they are always well formed.
    """
    return run_backward(roots, grads, inputs, keep_graph=keep_graph, accumulate=accumulate)


def full_backward(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> Grads:
    """`B`: input and weight gradients in one engine call; returns the inputs' gradients."""
    if outputs:  # none when no output needs a gradient: nothing to do
        _engine(outputs, grads, (), keep_graph=False, accumulate=True)
    return tuple(x.grad if x.requires_grad else None for x in inputs)


TO_INPUT, TO_PARAM = 1, 2  # what a node reaches (bits)


@dataclass
class _Graph:
    """The result of one walk over a (chunk, microbatch) graph: each node's children and
    what it reaches (TO_INPUT | TO_PARAM bits), and the parameter of each parameter node."""

    children: dict[Node, tuple[Node, ...]] = field(default_factory=dict)
    reach: dict[Node, int] = field(default_factory=dict)
    params: dict[Node, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Group:
    """Anchors whose weight regions touch, and the parameters those regions reach."""

    anchors: list[Node] = field(default_factory=list)
    roots: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)


@dataclass
class WeightGrad:
    """What `W` needs for one (chunk, microbatch): anchor gradients recorded by `I` (the
    general method), or the contracted calls' deferred work."""

    groups: list[_Group]
    recorded: dict[Node, Grads]
    deferred: list[Deferred] = field(default_factory=list)

    def run(self) -> None:
        """Accumulate the weight gradients into the parameters' `.grad`.

        Deferred calls run in the order `I` met them (the order B would have). Without
        pinned groups no call reaches a node another call runs, so each call frees the saved
        tensors of what it ran (the anchors' inputs) as it goes; with a pinned group the
        input path between its anchors may be run again, so the graph is kept.
        """
        for work in self.deferred:
            accumulate(work)
        self.deferred = []
        keep = any(len(group.anchors) > 1 for group in self.groups)
        for group in self.groups:
            edges: list[GradientEdge] = [edge for edge, _ in group.roots]
            grads: list[torch.Tensor] = [grad for _, grad in group.roots]
            for anchor in group.anchors:
                for slot, grad in enumerate(self.recorded.get(anchor, ())):
                    if grad is not None:
                        edges.append(GradientEdge(anchor, slot))
                        grads.append(grad)
            if edges and group.params:
                self._run_group(group, edges, grads, keep_graph=keep)
        self.groups = []
        self.recorded = {}

    def _run_group(
        self,
        group: _Group,
        edges: list[GradientEdge],
        grads: list[torch.Tensor],
        *,
        keep_graph: bool,
    ) -> None:
        handles = []
        if len(group.anchors) > 1:  # pin each anchor's gradient (module docstring)
            handles = [a.register_prehook(_pin(self.recorded[a])) for a in group.anchors]
        try:
            _engine(edges, grads, group.params, keep_graph=keep_graph, accumulate=True)
        finally:
            for handle in handles:
                handle.remove()


def _pin(grads: Grads) -> Callable[[Any], Grads]:
    def hook(_: Any) -> Grads:
        return grads

    return hook


def input_backward(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    params: AbstractSet[int] | None,
    capture: Capture | None = None,
) -> tuple[Grads, WeightGrad]:
    """`I`: the inputs' gradients now, and what `W` needs to finish the weights later.

    `params` holds the `id` of every parameter of the chunk; None takes every leaf of the
    graph that is no input as a weight, as B accumulates into every leaf (an FSDP2 stage,
    whose leaves are the unsharded parameters FSDP swapped in, not those it holds when
    resharded: runtime/plan/binding.py `weights`). With `capture` (the one its
    forward ran under) the chunk uses the contract method, else the graph walk (module
    docstring). Both methods, as `full_backward`, take `inputs` that are leaves (the
    runtime's are).
    """
    if capture is not None:
        store: list[Deferred] = []
        with deferring(capture, store):
            found = full_backward(outputs, grads, inputs)
        return found, WeightGrad([], {}, store)
    wanted = [x for x in inputs if x.requires_grad]
    graph = _walk(outputs, wanted, params)
    groups, anchors = _group(graph, outputs, grads)
    recorded: dict[Node, Grads] = {}
    handles = [a.register_prehook(_recorder(recorded, a)) for a in anchors]
    try:
        found = _input_grads(outputs, grads, wanted, graph)
    finally:
        for handle in handles:
            handle.remove()
    by_id = {id(x): g for x, g in zip(wanted, found, strict=True)}
    return tuple(by_id.get(id(x)) for x in inputs), WeightGrad(groups, recorded)


def _input_grads(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    wanted: list[torch.Tensor],
    graph: _Graph,
) -> Grads:
    live = [(o, g) for o, g in zip(outputs, grads, strict=True) if _reaches_input(o, graph)]
    if not wanted or not live:
        return tuple(None for _ in wanted)
    roots, seeds = [o for o, _ in live], [g for _, g in live]
    return _engine(roots, seeds, wanted, keep_graph=True, accumulate=False)


def _recorder(recorded: dict[Node, Grads], anchor: Node) -> Callable[[Any], None]:
    def hook(grad_outputs: Any) -> None:
        recorded[anchor] = tuple(grad_outputs)

    return hook


def _root(tensor: torch.Tensor) -> Node | None:
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    return get_gradient_edge(tensor).node if tensor.requires_grad else None


def _reaches_input(tensor: torch.Tensor, graph: _Graph) -> bool:
    root = _root(tensor)
    return root is not None and bool(graph.reach.get(root, 0) & TO_INPUT)


def _walk(
    outputs: Sequence[torch.Tensor], inputs: list[torch.Tensor], params: AbstractSet[int] | None
) -> _Graph:
    """Post-order walk from the outputs: what each node reaches (an input, a parameter)."""
    graph = _Graph()
    children_of, reach = graph.children, graph.reach
    input_ids = {id(x) for x in inputs}
    stack: list[tuple[Node, bool]] = [(r, False) for o in outputs if (r := _root(o)) is not None]
    while stack:
        node, done = stack.pop()
        if done:
            bits = 0
            for child in children_of[node]:
                bits |= reach[child]
            if type(node) is ACCUMULATE_GRAD:
                bits |= _leaf_bits(node, graph, input_ids, params)
            reach[node] = bits
        elif node not in children_of:
            children = tuple(child for child, _ in node.next_functions if child is not None)
            children_of[node] = children
            stack.append((node, True))
            stack.extend((child, False) for child in children if child not in children_of)
    return graph


def _leaf_bits(
    node: Node, graph: _Graph, input_ids: set[int], params: AbstractSet[int] | None
) -> int:
    variable = leaf_of(node)
    if id(variable) in input_ids:
        return TO_INPUT
    if params is None or id(variable) in params:
        graph.params[node] = variable
        return TO_PARAM
    return 0


def _group(
    graph: _Graph, outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
) -> tuple[list[_Group], list[Node]]:
    """The anchor groups (union of anchors whose weight regions share a node), and anchors."""
    owner: dict[Node, _Group] = {}
    groups: list[_Group] = []
    anchors: list[Node] = []
    for node, bits in graph.reach.items():
        if not bits & TO_INPUT:
            continue
        entries = [c for c in graph.children[node] if graph.reach[c] == TO_PARAM]
        if entries:
            group = _Group(anchors=[node])
            groups.append(group)
            anchors.append(node)
            for child in entries:
                _claim(child, group, graph, owner)
    for output, grad in zip(outputs, grads, strict=True):
        root = _root(output)
        if root is not None and graph.reach.get(root) == TO_PARAM:
            group = _Group(roots=[(get_gradient_edge(output), grad)])
            groups.append(group)
            _claim(root, group, graph, owner)
    return [g for g in groups if g.anchors or g.roots], anchors


def _claim(start: Node, group: _Group, graph: _Graph, owner: dict[Node, _Group]) -> None:
    """Walk one weight region from `start`, merging with any group that already owns a node."""
    stack = [start]
    while stack:
        node = stack.pop()
        other = owner.get(node)
        if other is not None:
            if other is not group:
                _absorb(group, other, owner)
            continue
        owner[node] = group
        if node in graph.params:
            group.params.append(graph.params[node])
        stack.extend(c for c in graph.children[node] if graph.reach[c] == TO_PARAM)


def _absorb(group: _Group, other: _Group, owner: dict[Node, _Group]) -> None:
    """Move everything of `other` into `group` (a weight region shared by two anchors)."""
    group.anchors.extend(other.anchors)
    group.roots.extend(other.roots)
    group.params.extend(other.params)
    other.anchors, other.roots, other.params = [], [], []
    for node, owned in list(owner.items()):
        if owned is other:
            owner[node] = group


def split_chunks(instrs: Sequence[Instr]) -> frozenset[int]:
    """The chunks whose backward is split (an I, alone or fused) somewhere in `instrs`."""
    found = set()
    for instr in instrs:
        backward = instr.backward if isinstance(instr, Fused) else instr
        if isinstance(backward, Compute) and backward.kind is Kind.I:
            found.add(backward.chunk)
    return frozenset(found)
