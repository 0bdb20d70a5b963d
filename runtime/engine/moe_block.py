"""The MoE building block and the contract of a MoE stage (docs/parallelism.md, "Expert
parallelism").

A stage whose program splits it into phases (`Phase`, `Program.moe`) is a *MoE stage*: the
runtime does not call its `forward`, it walks its parts (runtime/engine/moe_ops.py):

    stage.moe_head(value, **context) -> h        before layer 0 (an identity is fine)
    stage.moe_blocks[l]                          its K MoE blocks, in order
    stage.moe_tail(h) -> output                  after layer K-1's combine

and each block (this module's `MoEBlock`, or a user's own, torchtitan-style: router, experts,
token dispatcher) gives

    block.route(h) -> Routed                     pre: the dense sublayer (attention), the
                                                 router's top-k, the tokens sorted by expert
    block.experts_forward(tokens, counts) -> out experts: the tokens this EP rank received,
                                                 by source rank then local expert; `counts`
                                                 the rows of each such run
    block.combine(out, routed) -> h              the experts' outputs back in token order,
                                                 weighted by the gates, plus the residual
    block.shard_experts(rank, size)              keep experts [rank·E/size, (rank+1)·E/size)
    block.num_experts                            E

The runtime moves `routed.tokens` to the experts' EP ranks between `route` and
`experts_forward` (dispatch) and the outputs back before `combine` (combine). Every tensor of
`routed.keep` that needs a gradient crosses from `route` to `combine` as a detached leaf, like
a stage boundary, so each phase's backward is one autograd call; `routed.order` and
`routed.counts` carry no gradient. `forward` (the plain module: the single-process reference,
shape discovery) runs route, its experts and combine in one; with a share of the experts it
counts the others' outputs as zero (right shapes; only the phases compute the real values).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from .aux_loss import add_loss


class Routed(NamedTuple):
    """What a block's `route` hands to dispatch and, later, to `combine`."""

    tokens: torch.Tensor  # (rows, dim): one row per (token, chosen expert), sorted by expert
    counts: torch.Tensor  # (E,) int64: the rows of each expert, in expert order
    keep: tuple[torch.Tensor, ...]  # what `combine` needs (the residual, the gate weights)
    order: torch.Tensor  # the sort: row i of `tokens` is (token, choice) slot order[i]


class Block(Protocol):
    """One MoE layer as the runtime drives it (module docstring)."""

    num_experts: int

    def route(self, h: torch.Tensor) -> Routed: ...

    def experts_forward(self, tokens: torch.Tensor, counts: Sequence[int]) -> torch.Tensor: ...

    def combine(self, out: torch.Tensor, routed: Routed) -> torch.Tensor: ...

    def shard_experts(self, rank: int, size: int) -> None: ...


def blocks_of(module: nn.Module) -> Sequence[Block] | None:
    """A MoE stage's blocks (None: the module is no MoE stage)."""
    found = getattr(module, "moe_blocks", None)
    return None if found is None else list(found)


def shard(modules: Sequence[nn.Module], rank: int, size: int) -> None:
    """Keep EP rank `rank`'s share of every MoE block's experts (before any optimizer)."""
    for module in modules:
        for block in blocks_of(module) or ():
            block.shard_experts(rank, size)


def keep_experts(modules: Sequence[nn.Module], mesh: Any) -> None:
    """Keep this process's share of the experts of every MoE stage in `modules`: EP rank e
    of the mesh's `ep` dimension keeps experts [e·E/ep, (e+1)·E/ep) of each block (nothing
    changes on a mesh without `ep`). Call it before FSDP2's `fully_shard`, so that FSDP
    shards, gathers and reduces only the experts this rank holds; the runtime keeps them
    itself when it is built, which is too late for a stage FSDP already manages (refused)."""
    if mesh is not None and "ep" in (mesh.mesh_dim_names or ()):
        shard(modules, mesh.get_local_rank("ep"), mesh["ep"].size())


def keep_own(held: Sequence[tuple[int, nn.Module, bool]], rank: int, size: int) -> list[str]:
    """Keep EP rank `rank`'s experts in each (stage, module, FSDP-managed) the program runs
    in phases; what cannot run: experts that do not split over `size`, or a stage FSDP2
    manages that still held other ranks' experts (FSDP would gather and reduce them every
    step: `keep_experts` goes before `fully_shard`)."""
    found = []
    for stage, module, fsdp in held:
        before = sum(1 for _ in module.parameters())
        try:
            shard([module], rank, size)
        except ValueError as err:  # experts that do not split over ep
            return [str(err)]
        if fsdp and sum(1 for _ in module.parameters()) != before:
            found.append(
                f"stage {stage} is under FSDP2 (fully_shard) with the experts of every EP "
                f"rank: keep EP rank {rank}'s experts first, pipecc.runtime.keep_experts("
                "modules, mesh), then fully_shard (FSDP would gather and reduce the others "
                "every step)"
            )
    return found


def expert_params(modules: Sequence[nn.Module]) -> frozenset[int]:
    """The ids of the expert parameters of every MoE block (not reduced over `ep`)."""
    found: set[int] = set()
    for module in modules:
        for block in blocks_of(module) or ():
            experts = getattr(block, "experts", None)
            if isinstance(experts, nn.Module):
                found.update(id(p) for p in experts.parameters())
    return frozenset(found)


def runs(tokens: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    """`tokens` cut into consecutive runs of `counts` rows (zero-row runs included)."""
    found, start = [], 0
    for count in counts:
        found.append(tokens[start : start + count])
        start += count
    return found


class Expert(nn.Module):
    """A feed-forward expert: dim -> hidden -> dim."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(nn.functional.gelu(self.up(x)))
        return out


class MoEBlock(nn.Module):
    """A transformer block's MoE half with its dense half in front: h + mixer(norm(h)),
    then top-k routing over `experts` experts; the Switch balancing loss
    `balance · E · sum_e f_e · P_e` is added with `add_loss` (runtime/engine/aux_loss.py).

    `mixer` is the dense sublayer (attention in a transformer; any module h -> h); `bias` a
    fixed offset of the router's logits (steering tokens away from experts); the experts
    live in a ModuleDict keyed by their global index, so a parameter keeps its name
    (`experts.5.up.weight`) on whichever EP rank holds it."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        experts: int,
        top: int,
        *,
        mixer: nn.Module | None = None,
        balance: float = 0.0,
        bias: Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        self.dim, self.top, self.num_experts, self.balance = dim, top, experts, balance
        self.mixer = mixer
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        # a fixed offset of the router's logits (None: none): a test steers tokens with it
        self.offset: torch.Tensor | None
        self.register_buffer("offset", None if bias is None else torch.tensor(list(bias)))
        self.experts = nn.ModuleDict({str(e): Expert(dim, hidden) for e in range(experts)})
        self.first, self.local = 0, experts  # this EP rank's experts [first, first + local)

    def shard_experts(self, rank: int, size: int) -> None:
        if self.num_experts % size:
            raise ValueError(f"{self.num_experts} experts do not split over ep={size}")
        self.local = self.num_experts // size
        self.first = rank * self.local
        for key in list(self.experts.keys()):
            if not self.first <= int(key) < self.first + self.local:
                del self.experts[key]

    def route(self, h: torch.Tensor) -> Routed:
        if self.mixer is not None:
            h = h + self.mixer(h)
        x = self.norm(h).reshape(-1, self.dim)
        logits = self.router(x)
        probs = (logits if self.offset is None else logits + self.offset).softmax(-1)
        weights, chosen = probs.topk(self.top, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        if self.balance:
            routed = nn.functional.one_hot(chosen, self.num_experts).float().mean((0, 1))
            h = add_loss(h, self.balance * self.num_experts * (routed * probs.mean(0)).sum())
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        tokens = x[order // self.top]
        counts = torch.bincount(flat, minlength=self.num_experts)
        return Routed(tokens, counts, (h, weights), order)

    def experts_forward(self, tokens: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Runs of rows by source rank, then local expert (`counts`: each run's rows)."""
        parts = runs(tokens, counts)
        outs = [
            self.experts[str(self.first + i % self.local)](part) for i, part in enumerate(parts)
        ]
        return torch.cat(outs) if outs else tokens

    def combine(self, out: torch.Tensor, routed: Routed) -> torch.Tensor:
        h, weights = routed.keep
        back = out[routed.order.argsort()]  # slot order: token-major, then choice
        mixed = (back.view(-1, self.top, self.dim) * weights.unsqueeze(-1)).sum(1)
        return h + mixed.view_as(h)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        routed = self.route(h)
        parts = runs(routed.tokens, routed.counts.tolist())
        outs = [
            self.experts[str(e)](part) if str(e) in self.experts else torch.zeros_like(part)
            for e, part in enumerate(parts)
        ]
        return self.combine(torch.cat(outs), routed)


class MoEStage(nn.Module):
    """A MoE stage: head -> MoE blocks -> tail (either end may be None)."""

    def __init__(
        self, head: nn.Module | None, blocks: Sequence[nn.Module], tail: nn.Module | None
    ) -> None:
        super().__init__()
        self.head = head
        self.moe_blocks = nn.ModuleList(blocks)
        self.tail = tail

    def moe_head(self, value: Any, **context: object) -> torch.Tensor:
        out: torch.Tensor = self.head(value) if self.head is not None else value
        return out

    def moe_tail(self, h: torch.Tensor) -> Any:
        return self.tail(h) if self.tail is not None else h

    def forward(self, value: Any) -> Any:
        h = self.moe_head(value)
        for block in self.moe_blocks:
            h = block(h)
        return self.moe_tail(h)
