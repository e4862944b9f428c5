"""Degrees: a configuration's parallel degrees, its rank order, and the ranks and groups they make.

The one rank-order implementation of the project: the cost model (through ``space.placement``,
``cost.layout``, ``cost.tensor_parallel``, ``cost.schedule_time``) and the trainer
(``trainer.process_groups``, ``trainer.run``) both read it, so the groups the model prices are the
groups the trainer builds.

A **rank** is a position in the rank order. ``rank_order`` lists the axes from innermost
(consecutive ranks) to outermost, as Megatron's ``RankGenerator(order=...)``: with "tp-dp-pp",
ranks 0..tp-1 form the first tensor-parallel group and rank r has the coordinates
:func:`rank_coords` gives. Which device runs each rank and which layers each pipeline chunk holds
is ``space.placement``'s (its ``Placement`` is a :class:`Degrees` with those fields added).
"""

from __future__ import annotations

from dataclasses import dataclass, field

AXES = ("tp", "cp", "dp", "pp")
"""Every axis: tensor, context (sequence split of attention), data and pipeline parallelism."""


def full_order(order: str) -> list[str]:
    """The axes of a rank order, innermost first, with ``cp`` where an order written without it
    puts it: right after tp (Megatron-LM's "tp-cp-ep-dp-pp")."""
    axes = order.split("-")
    if "cp" not in axes and "tp" in axes:
        axes.insert(axes.index("tp") + 1, "cp")
    return axes


def order_reason(order) -> str | None:
    """Why ``order`` is not a rank order, or None: every axis once (cp may be left out)."""
    if not isinstance(order, str) or sorted(full_order(order)) != sorted(AXES):
        return f"rank_order={order!r} must order tp, dp, pp (and cp), innermost first, e.g. 'tp-dp-pp' or 'tp-cp-dp-pp'"
    return None


def rank_coords(rank: int, dp: int, pp: int, tp: int, order: str, cp: int = 1) -> dict:
    """{axis: index} of a rank; ``order`` lists axes from innermost to outermost (e.g. 'tp-dp-pp')."""
    sizes = {"dp": dp, "pp": pp, "tp": tp, "cp": cp}
    out = {}
    for axis in full_order(order):
        rank, out[axis] = divmod(rank, sizes[axis])
    return out


def rank_of(coords: dict, dp: int, pp: int, tp: int, order: str, cp: int = 1) -> int:
    """The rank with these coordinates (the inverse of :func:`rank_coords`; a missing cp is 0)."""
    sizes = {"dp": dp, "pp": pp, "tp": tp, "cp": cp}
    rank, stride = 0, 1
    for axis in full_order(order):
        rank += coords.get(axis, 0) * stride
        stride *= sizes[axis]
    return rank


def axis_groups(dp: int, pp: int, tp: int, order: str, axis: str, cp: int = 1) -> list[tuple]:
    """Ranks of every group along ``axis``: ranks that differ only in that coordinate, each group
    ordered by its coordinate on the axis, groups ordered by their first rank."""
    sizes = {"dp": dp, "pp": pp, "tp": tp, "cp": cp}
    stride = 1
    for a in full_order(order):
        if a == axis:
            break
        stride *= sizes[a]
    n = sizes[axis]
    # the first rank of each group: coordinate 0 on the axis, i.e. the first ``stride`` ranks of
    # every block of stride x n
    firsts = [b + j for b in range(0, dp * pp * tp * cp, stride * n) for j in range(stride)]
    return [tuple(range(r, r + n * stride, stride)) for r in firsts]


def merged_groups(dp: int, pp: int, tp: int, order: str, axes: tuple, cp: int = 1) -> list[tuple]:
    """Ranks of every group spanning several axes (e.g. ("cp", "dp"): the ranks that reduce
    gradients together when the sequence is split): ranks that differ only in those coordinates,
    ordered by rank."""
    sizes, strides = {"dp": dp, "pp": pp, "tp": tp, "cp": cp}, {}
    stride = 1
    for a in full_order(order):
        strides[a] = stride
        stride *= sizes[a]
    # a group: its first rank (every merged coordinate 0) plus the offsets of the merged
    # coordinates, in rank order; groups ordered by their first rank (arithmetic, not a pass that
    # decodes every rank's coordinates: a world of 65,536 ranks)
    offsets, firsts = [0], [0]
    for a in AXES:
        if a in axes:
            offsets = [o + i * strides[a] for o in offsets for i in range(sizes[a])]
        else:
            firsts = [f + i * strides[a] for f in firsts for i in range(sizes[a])]
    offsets.sort()
    return [tuple(f + o for o in offsets) for f in sorted(firsts)]


def folds_experts(c) -> bool:
    """Whether the expert-parallel group is folded over tp too (``ParallelConfig.expert_tp`` 1
    with tp > 1: Megatron-Core's MoE parallel folding)."""
    return getattr(c, "expert_tp", None) == 1 and c.tp > 1 and getattr(c, "ep", 1) > 1


def expert_groups(dp: int, pp: int, tp: int, order: str, ep: int, cp: int = 1,
                  fold: bool = False) -> tuple[list[tuple], list[tuple]]:
    """(expert-parallel groups, expert-data-parallel groups) of ranks. The expert-parallel group
    lies inside the dp x cp ranks that hold the same layers and tensor shard (Megatron-LM folds it
    there), or with ``fold`` inside the tp x cp x dp ranks of a stage (Megatron-Core's MoE
    parallel folding, expert tensor-parallel size 1: its expert rank generator orders them
    ep-innermost over the same ranks): each such group, in rank order, is cut into consecutive
    runs of ep ranks; the ranks at the same position of every run hold the same experts and
    reduce their gradients together."""
    ep_groups, edp_groups = [], []
    for g in merged_groups(dp, pp, tp, order, ("tp", "cp", "dp") if fold else ("cp", "dp"), cp):
        runs = [g[i:i + ep] for i in range(0, len(g), ep)]
        ep_groups += [tuple(r) for r in runs]
        edp_groups += [tuple(r[j] for r in runs) for j in range(ep)]
    return sorted(ep_groups), sorted(edp_groups)


@dataclass(frozen=True)
class Degrees:
    """The parallel degrees and rank order of one configuration, and its ranks and groups (see the
    module docstring). Every group is a tuple of ranks; groups of one kind come in a fixed order,
    the same on every rank."""

    dp: int
    pp: int
    tp: int
    rank_order: str = "tp-dp-pp"
    """Axes from innermost to outermost (cp, when left out, right after tp)."""
    cp: int = field(default=1, kw_only=True)
    """Context-parallel degree."""
    ep: int = field(default=1, kw_only=True)
    """Expert-parallel degree (inside the dp x cp ranks; with ``expert_fold``, the tp x cp x dp ones)."""
    expert_fold: bool = field(default=False, kw_only=True)
    """The expert-parallel group is folded over tp too (:func:`folds_experts`)."""

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(self.rank_order.split("-"))

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def validate(self, world_size: int) -> None:
        """ValueError unless the rank order is one (:func:`order_reason`) and the degrees multiply
        to ``world_size``."""
        why = order_reason(self.rank_order)
        if why:
            raise ValueError(why)
        if self.world_size != world_size:
            raise ValueError(f"dp({self.dp}) * pp({self.pp}) * tp({self.tp}) * cp({self.cp}) = {self.world_size} "
                             f"!= world_size({world_size})")

    def coords(self, rank: int) -> dict:
        """{axis: index} of a rank (:func:`rank_coords`)."""
        return rank_coords(rank, self.dp, self.pp, self.tp, self.rank_order, self.cp)

    def rank_of(self, coords: dict) -> int:
        """The rank with these coordinates (:func:`rank_of`)."""
        return rank_of(coords, self.dp, self.pp, self.tp, self.rank_order, self.cp)

    def groups(self, axis) -> list[tuple]:
        """Ranks of every group along ``axis`` (:func:`axis_groups`), or along several axes at
        once when ``axis`` is a tuple (:func:`merged_groups`); "ep" / "edp": the expert-parallel
        and expert-data-parallel groups (:meth:`expert_groups`)."""
        if axis in ("ep", "edp"):
            eg, edg = self.expert_groups()
            return eg if axis == "ep" else edg
        if isinstance(axis, tuple):
            if len(axis) == 1:
                axis = axis[0]
            else:
                return merged_groups(self.dp, self.pp, self.tp, self.rank_order, axis, self.cp)
        return axis_groups(self.dp, self.pp, self.tp, self.rank_order, axis, self.cp)

    def expert_groups(self) -> tuple[list[tuple], list[tuple]]:
        """(expert-parallel groups, expert-data-parallel groups): :func:`expert_groups`."""
        return expert_groups(self.dp, self.pp, self.tp, self.rank_order, self.ep, self.cp, self.expert_fold)

    def grad_groups(self) -> list[tuple]:
        """The groups that reduce gradients (and shard ZeRO state) together: dp x cp ranks (every
        context-parallel rank holds the same parameters and a different part of the sequence)."""
        if self.cp == 1:
            return self.groups("dp")
        return self.groups(("cp", "dp"))

    def embedding_groups(self) -> list[tuple]:
        """First and last pipeline rank of each pipeline (for tied embeddings); pp > 1 only."""
        return [(g[0], g[-1]) for g in self.groups("pp")] if self.pp > 1 else []

    def fused_embedding_groups(self) -> list[tuple]:
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
        return [tuple(sorted(v)) for _, v in sorted(by_tp.items())]

    def stage_ranks(self) -> list[list[int]]:
        """The ranks of each pipeline stage, in rank order."""
        stride = 1
        for a in full_order(self.rank_order):
            if a == "pp":
                break
            stride *= self.size(a)
        out = [[] for _ in range(self.pp)]
        for r in range(self.world_size):
            out[(r // stride) % self.pp].append(r)
        return out
