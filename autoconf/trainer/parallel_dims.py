"""Ranks, coordinates and process groups for a (dp, pp, tp, cp) split in a given rank order.

``rank_order`` lists the axes from innermost (consecutive ranks) to outermost, as Megatron's
``RankGenerator(order=...)``: with "tp-dp-pp", ranks 0..tp-1 form the first tensor-parallel group.
The arithmetic is ``autoconf.space.degrees``'s, the same the cost model prices. The ranks here are
ranks of the rank order: ``run.setup`` starts the default process group with each process at the
rank its device plays (``Placement.rank_on``), so every group below is in those ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoconf.space.degrees import AXES, axis_groups, expert_groups, merged_groups, order_reason, rank_coords, rank_of


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    pp: int
    tp: int
    rank_order: str = "tp-dp-pp"
    """Axes from innermost to outermost (cp, when left out, right after tp)."""
    cp: int = 1
    """Context-parallel degree."""
    ep: int = 1
    """Expert-parallel degree (inside the dp x cp ranks)."""

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(self.rank_order.split("-"))

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def validate(self, world_size: int) -> None:
        why = order_reason(self.rank_order)
        if why:
            raise ValueError(why)
        if self.world_size != world_size:
            raise ValueError(f"dp({self.dp}) * pp({self.pp}) * tp({self.tp}) * cp({self.cp}) = {self.world_size} "
                             f"!= world_size({world_size})")

    def coords(self, rank: int) -> dict[str, int]:
        """{axis: index} of a global rank."""
        return rank_coords(rank, self.dp, self.pp, self.tp, self.rank_order, self.cp)

    def rank_of(self, coords: dict[str, int]) -> int:
        return rank_of(coords, self.dp, self.pp, self.tp, self.rank_order, self.cp)

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``: ranks that differ only in that coordinate, in a fixed order."""
        return [list(g) for g in axis_groups(self.dp, self.pp, self.tp, self.rank_order, axis, self.cp)]

    def expert_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """(expert-parallel groups, expert-data-parallel groups): ``placement.expert_groups``."""
        eg, edg = expert_groups(self.dp, self.pp, self.tp, self.rank_order, self.ep, self.cp)
        return [list(g) for g in eg], [list(g) for g in edg]

    def grad_groups(self) -> list[list[int]]:
        """The groups that reduce gradients (and shard ZeRO state) together: dp x cp ranks (every
        context-parallel rank holds the same parameters and a different part of the sequence)."""
        if self.cp == 1:
            return self.groups("dp")
        return [list(g) for g in merged_groups(self.dp, self.pp, self.tp, self.rank_order, ("cp", "dp"), self.cp)]

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline rank of each pipeline (for tied embeddings); pp > 1 only."""
        return [[g[0], g[-1]] for g in self.groups("pp")] if self.pp > 1 else []

    def fused_embedding_groups(self) -> list[list[int]]:
        """Every first- and last-stage rank of every dp x cp replica, one group per tensor-parallel
        rank (config ``fused_embedding_sync``: the tied embedding's sum over both stages and over
        the replicas in one all-reduce); pp > 1 only."""
        if self.pp == 1:
            return []
        by_tp: dict = {}
        for r in range(self.world_size):
            c = self.coords(r)
            if c["pp"] in (0, self.pp - 1):
                by_tp.setdefault(c["tp"], []).append(r)
        return [sorted(v) for _, v in sorted(by_tp.items())]


@dataclass
class Groups:
    """This rank's process groups and where it sits in them."""

    dims: ParallelDims
    rank: int
    coords: dict
    tp: object
    dp: object
    pp: object
    tp_ranks: list
    dp_ranks: list
    pp_ranks: list
    embedding: object = None
    """Group of the first and last pipeline rank (tied embeddings, pp > 1); None elsewhere."""
    embedding_ranks: list | None = None
    cp: object = None
    """This rank's context-parallel group (ring attention); a one-rank group when cp = 1."""
    cp_ranks: list | None = None
    grad: object = None
    """The group that reduces gradients and shards ZeRO state: dp x cp ranks (``ParallelDims.grad_groups``);
    the dp group itself when cp = 1."""
    grad_ranks: list | None = None
    dp_all_reduce: object = None
    """ZeRO-0/1's gradient all-reduce over this rank's gradient (dp x cp) group: a
    ``collectives.HierarchicalAllReduce``, or None for the flat one."""
    dp_all_reduce_note: str = "flat"
    """What runs: "flat", "hierarchical (H hosts x k)", or why a hierarchical one asked for stays flat."""
    ep: object = None
    """This rank's expert-parallel group (ep > 1 only; ``ParallelDims.expert_groups``)."""
    ep_ranks: list | None = None
    edp: object = None
    """This rank's expert-data-parallel group: the ranks holding the same experts (ep > 1 only)."""
    edp_ranks: list | None = None
    embedding_fused: object = None
    """This rank's fused embedding group (``ParallelDims.fused_embedding_groups``; first and last
    stage ranks with fused_embedding_sync only)."""
    embedding_fused_ranks: list | None = None

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def cp_rank(self) -> int:
        return self.coords["cp"]

    @property
    def grad_rank(self) -> int:
        """This rank's index in its gradient group (``grad_ranks``)."""
        return self.grad_ranks.index(self.rank)


def build_groups(dims: ParallelDims, rank: int, timeout, fused_embedding: bool = False) -> Groups:
    """Create every group of every axis (all ranks must call ``new_group`` in the same order) and
    keep the ones this rank belongs to; ``fused_embedding``: also the fused embedding groups (last,
    so the others keep their order)."""
    import torch.distributed as dist

    mine = {}
    for axis in AXES:
        for ranks in dims.groups(axis):
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[axis] = (g, ranks)
    emb, emb_ranks = None, None
    for ranks in dims.embedding_groups():
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            emb, emb_ranks = g, ranks
    grad, grad_ranks = mine["dp"]
    if dims.cp > 1:  # the merged dp x cp groups, after every axis group (same order on every rank)
        for ranks in dims.grad_groups():
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                grad, grad_ranks = g, ranks
    ep = {}
    if dims.ep > 1:  # after every other group (same order on every rank)
        for name, all_ranks in zip(("ep", "edp"), dims.expert_groups()):
            for ranks in all_ranks:
                g = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    ep[name], ep[name + "_ranks"] = g, list(ranks)
    if fused_embedding:
        for ranks in dims.fused_embedding_groups():
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                ep["embedding_fused"], ep["embedding_fused_ranks"] = g, list(ranks)
    return Groups(dims=dims, rank=rank, coords=dims.coords(rank), **ep,
                  tp=mine["tp"][0], dp=mine["dp"][0], pp=mine["pp"][0],
                  tp_ranks=mine["tp"][1], dp_ranks=mine["dp"][1], pp_ranks=mine["pp"][1],
                  embedding=emb, embedding_ranks=emb_ranks, cp=mine["cp"][0], cp_ranks=mine["cp"][1],
                  grad=grad, grad_ranks=list(grad_ranks))
