"""Placement: which device runs each rank, and which layers each pipeline chunk holds.

A placement is a configuration's :class:`~autoconf.space.degrees.Degrees` (its ranks and groups,
the rank order the cost model and the trainer share) with devices and layers added. Three layers
of names:

- a **rank** is a position in the rank order (``space.degrees``);
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

from autoconf.space.degrees import Degrees, folds_experts


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
class Placement(Degrees):
    """Ranks, devices and layers of one configuration (see the module docstring): its degrees and
    rank order (the fields, ranks and groups of :class:`Degrees`, ``cp``, ``ep`` and
    ``expert_fold`` given by keyword) and where they run."""

    virtual_stages: int = 1
    num_layers: int = 0
    device_order: tuple | None = None
    stage_layers: tuple | None = None

    @classmethod
    def of(cls, config, num_layers: int) -> "Placement":
        """The placement a ParallelConfig describes, for a model of ``num_layers`` blocks."""
        return cls(config.dp, config.pp, config.tp, config.rank_order, config.virtual_stages, num_layers,
                   config.device_order, config.stage_layers, cp=getattr(config, "cp", 1),
                   ep=getattr(config, "ep", 1), expert_fold=folds_experts(config))

    @property
    def num_chunks(self) -> int:
        return self.pp * self.virtual_stages

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
