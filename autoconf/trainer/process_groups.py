"""Process groups of one rank: every group of every axis, built from the configuration's ``Degrees``.

The ranks and groups are ``autoconf.space.degrees``'s arithmetic, the same the cost model prices.
The ranks here are ranks of the rank order: ``run.setup`` starts the default process group with
each process at the rank its device plays (``Placement.rank_on``), so every group below is in those
ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoconf.space.degrees import AXES, Degrees


@dataclass
class Groups:
    """This rank's process groups and where it sits in them."""

    degrees: Degrees
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
    """The group that reduces gradients and shards ZeRO state: dp x cp ranks (``Degrees.grad_groups``);
    the dp group itself when cp = 1."""
    grad_ranks: list | None = None
    dp_all_reduce: object = None
    """ZeRO-0/1's gradient all-reduce over this rank's gradient (dp x cp) group: a
    ``collectives.HierarchicalAllReduce``, or None for the flat one."""
    dp_all_reduce_note: str = "flat"
    """What runs: "flat", "hierarchical (H hosts x k)", or why a hierarchical one asked for stays flat."""
    ep: object = None
    """This rank's expert-parallel group (ep > 1 only; ``Degrees.expert_groups``)."""
    ep_ranks: list | None = None
    edp: object = None
    """This rank's expert-data-parallel group: the ranks holding the same experts (ep > 1 only)."""
    edp_ranks: list | None = None
    embedding_fused: object = None
    """This rank's fused embedding group (``Degrees.fused_embedding_groups``; first and last
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


def _lists(groups) -> list[list[int]]:
    """Groups of ranks (tuples) as the lists every ``Groups`` field and ``new_group`` call gets."""
    return [list(g) for g in groups]


def build_groups(degrees: Degrees, rank: int, timeout, fused_embedding: bool = False) -> Groups:
    """Create every group of every axis (all ranks must call ``new_group`` in the same order) and
    keep the ones this rank belongs to; ``fused_embedding``: also the fused embedding groups (last,
    so the others keep their order)."""
    import torch.distributed as dist

    mine = {}
    for axis in AXES:
        for ranks in _lists(degrees.groups(axis)):
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[axis] = (g, ranks)
    emb, emb_ranks = None, None
    for ranks in _lists(degrees.embedding_groups()):
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            emb, emb_ranks = g, ranks
    grad, grad_ranks = mine["dp"]
    if degrees.cp > 1:  # the merged dp x cp groups, after every axis group (same order on every rank)
        for ranks in _lists(degrees.grad_groups()):
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                grad, grad_ranks = g, ranks
    ep = {}
    if degrees.ep > 1:  # after every other group (same order on every rank)
        for name, all_ranks in zip(("ep", "edp"), degrees.expert_groups()):
            for ranks in _lists(all_ranks):
                g = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    ep[name], ep[name + "_ranks"] = g, ranks
    if fused_embedding:
        for ranks in _lists(degrees.fused_embedding_groups()):
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                ep["embedding_fused"], ep["embedding_fused_ranks"] = g, ranks
    return Groups(degrees=degrees, rank=rank, coords=degrees.coords(rank), **ep,
                  tp=mine["tp"][0], dp=mine["dp"][0], pp=mine["pp"][0],
                  tp_ranks=mine["tp"][1], dp_ranks=mine["dp"][1], pp_ranks=mine["pp"][1],
                  embedding=emb, embedding_ranks=emb_ranks, cp=mine["cp"][0], cp_ranks=mine["cp"][1],
                  grad=grad, grad_ranks=list(grad_ranks))
