"""Placement: which device runs each rank, and which layers each pipeline chunk holds.

The one rank-order implementation of the project: the cost model (``cost.layout``,
``cost.tensor_parallel``, ``cost.schedule_time``) and the trainer (``trainer.parallel_dims``,
``trainer.run``) both read it, so the groups the model prices are the groups the trainer builds.

Three layers of names:

- a **rank** is a position in the rank order. ``rank_order`` lists the axes from innermost
  (consecutive ranks) to outermost, as Megatron's ``RankGenerator(order=...)``: with "tp-dp-pp",
  ranks 0..tp-1 form the first tensor-parallel group and rank r has the coordinates
  :func:`rank_coords` gives;
- a **device** is an index into the cluster's devices (hosts in the cluster file's order, each
  host's devices in order), the numbering of ``Topology``;
- ``device_order[r]`` is the device rank r runs on (``None``: rank r on device r, the default).

A launch starts one process per device; the process on device d (torchrun's ``RANK`` = d, the
launch puts it there) plays rank ``rank_on(d)`` of the rank order. On CPU processes, where every
"device" is a process like any other, a device order therefore only permutes which process plays
which coordinate; on a cluster it decides which host runs which stage and group.

Layers: ``stage_layers[c]`` is the number of transformer blocks of pipeline chunk c (pp x v chunks;
chunk c on pipeline rank c % pp, the looped placement of ``torch.distributed.pipelining``);
``None`` splits them as evenly as possible, earlier chunks taking the remainder (the default).
"""

from __future__ import annotations

from dataclasses import dataclass

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


def even_layers(num_layers: int, num_chunks: int) -> list[int]:
    """Split layers as evenly as possible over chunks; earlier chunks take the remainder."""
    base, extra = divmod(num_layers, num_chunks)
    return [base + (1 if i < extra else 0) for i in range(num_chunks)]


def check_placement(device_order, stage_layers, world: int, num_chunks: int, num_layers: int) -> str | None:
    """Why a device order / layer split is invalid for this shape (one line), or None."""
    if device_order is not None:
        d = device_order
        if not isinstance(d, (tuple, list)) or len(d) != world:
            n = len(d) if isinstance(d, (tuple, list)) else type(d).__name__
            return f"device_order has {n} entries; expected a permutation of 0..{world - 1} (one device per rank)"
        if any(isinstance(x, bool) or not isinstance(x, int) for x in d) or sorted(d) != list(range(world)):
            bad = next((x for x in d if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < world),
                       None)
            what = f"{bad!r} is not a device of 0..{world - 1}" if bad is not None else "a device appears twice"
            return f"device_order: {what}; expected a permutation of 0..{world - 1}"
    if stage_layers is not None:
        s = stage_layers
        if not isinstance(s, (tuple, list)) or len(s) != num_chunks:
            n = len(s) if isinstance(s, (tuple, list)) else type(s).__name__
            return f"stage_layers has {n} entries; expected one per pipeline chunk (pp x virtual_stages = {num_chunks})"
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in s):
            bad = next(x for x in s if isinstance(x, bool) or not isinstance(x, int) or x < 1)
            return f"stage_layers: {bad!r} is not a layer count; every chunk needs at least 1 layer"
        if sum(s) != num_layers:
            return f"stage_layers {'/'.join(map(str, s))} sum to {sum(s)}; expected num_layers={num_layers}"
    return None


@dataclass(frozen=True)
class Placement:
    """Ranks, devices and layers of one configuration (see the module docstring)."""

    dp: int
    pp: int
    tp: int
    rank_order: str = "tp-dp-pp"
    virtual_stages: int = 1
    num_layers: int = 0
    device_order: tuple | None = None
    stage_layers: tuple | None = None
    cp: int = 1
    ep: int = 1
    expert_fold: bool = False
    """The expert-parallel group is folded over tp too (``config.folds_experts``)."""

    @classmethod
    def of(cls, config, num_layers: int) -> "Placement":
        """The placement a ParallelConfig describes, for a model of ``num_layers`` blocks."""
        return cls(config.dp, config.pp, config.tp, config.rank_order, config.virtual_stages, num_layers,
                   config.device_order, config.stage_layers, getattr(config, "cp", 1), getattr(config, "ep", 1),
                   folds_experts(config))

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    @property
    def num_chunks(self) -> int:
        return self.pp * self.virtual_stages

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    # -- ranks ----------------------------------------------------------------------------------
    def coords(self, rank: int) -> dict:
        return rank_coords(rank, self.dp, self.pp, self.tp, self.rank_order, self.cp)

    def rank_of(self, coords: dict) -> int:
        return rank_of(coords, self.dp, self.pp, self.tp, self.rank_order, self.cp)

    def groups(self, axis) -> list[tuple]:
        """Ranks of every group along ``axis`` (:func:`axis_groups`), or along several axes at
        once when ``axis`` is a tuple (:func:`merged_groups`); "ep" / "edp": the expert-parallel
        and expert-data-parallel groups (:func:`expert_groups`)."""
        if axis in ("ep", "edp"):
            eg, edg = expert_groups(self.dp, self.pp, self.tp, self.rank_order, self.ep, self.cp, self.expert_fold)
            return eg if axis == "ep" else edg
        if isinstance(axis, tuple):
            if len(axis) == 1:
                axis = axis[0]
            else:
                return merged_groups(self.dp, self.pp, self.tp, self.rank_order, axis, self.cp)
        return axis_groups(self.dp, self.pp, self.tp, self.rank_order, axis, self.cp)

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

    # -- devices --------------------------------------------------------------------------------
    def device(self, rank: int) -> int:
        """The device rank ``rank`` runs on."""
        return rank if self.device_order is None else self.device_order[rank]

    def devices(self) -> list[int]:
        """Device of every rank."""
        return list(range(self.world_size)) if self.device_order is None else list(self.device_order)

    def rank_on(self, device: int) -> int:
        """The rank the process on ``device`` plays (the inverse of :meth:`device`)."""
        if self.device_order is None:
            return device
        return self.device_order.index(device)

    def device_groups(self, axis: str) -> list[tuple]:
        """Devices of every group along ``axis``, in the order of :meth:`groups`."""
        if self.device_order is None:
            return self.groups(axis)
        d = self.device_order
        return [tuple(d[r] for r in g) for g in self.groups(axis)]

    def stage_devices(self) -> list[list[int]]:
        """The devices of each pipeline stage (in rank order)."""
        return [[self.device(r) for r in ranks] for ranks in self.stage_ranks()]

    # -- layers ---------------------------------------------------------------------------------
    def chunk_layer_counts(self) -> list[int]:
        """Blocks per pipeline chunk."""
        if self.stage_layers is not None:
            return list(self.stage_layers)
        return even_layers(self.num_layers, self.num_chunks)

    def chunk_layers(self) -> list[list[int]]:
        """Global block indices of each pipeline chunk (consecutive, in chunk order)."""
        out, start = [], 0
        for n in self.chunk_layer_counts():
            out.append(list(range(start, start + n)))
            start += n
        return out

    def chunks_of_stage(self, stage: int) -> list[int]:
        """The chunks pipeline rank ``stage`` holds (looped placement: chunk c on stage c % pp)."""
        return list(range(stage, self.num_chunks, self.pp))

    def stage_layer_counts(self) -> list[int]:
        """Blocks per pipeline stage (all its chunks)."""
        counts = self.chunk_layer_counts()
        return [sum(counts[c] for c in self.chunks_of_stage(s)) for s in range(self.pp)]
