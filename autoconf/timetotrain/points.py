"""What the per-point optimiser keeps and shares: its statistics (:class:`PointStats`) and the
neighbouring points whose best configurations warm-start a point (:func:`_neighbours`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass
class PointStats:
    outer_points: int = 0
    bounded_out: int = 0
    """Outer points and inner choices skipped on their lower bound (no estimate)."""
    out_of_memory: int = 0
    """Outer points whose memory floor exceeds the devices' memory, and configurations already
    found not to fit."""
    estimates: int = 0
    """Inner configurations estimated (memory, and the schedule where it fits and is not bounded)."""
    seconds: float = 0.0

    def add(self, other: "PointStats") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def _neighbours(seeds, world: int, global_batch: int):
    """Configurations near each seed at this GPU count and batch: the seed's degrees with the
    extra (or fewer) GPUs on dp, pp or tp, its micro-batch size (or the largest that divides), its
    expert-parallel degree where it still divides dp x cp (else their greatest common divisor)."""
    out = []
    for c in seeds:
        if c is None:
            continue
        r = world / c.world_size
        shapes = []
        for axis in ("dp", "pp", "tp"):
            d = {"dp": c.dp, "pp": c.pp, "tp": c.tp}
            x = d[axis] * r
            if x >= 1 and abs(x - round(x)) < 1e-9:
                d[axis] = int(round(x))
                shapes.append(d)
        for d in shapes:
            per_replica = global_batch // d["dp"] if global_batch % d["dp"] == 0 else 0
            if not per_replica:
                continue
            mbs = max((b for b in range(1, c.micro_batch_size + 1) if per_replica % b == 0), default=1)
            out.append(dataclasses.replace(c, dp=d["dp"], pp=d["pp"], tp=d["tp"], micro_batch_size=mbs,
                                           num_micro_batches=per_replica // mbs, stage_layers=None,
                                           device_order=None, ep=math.gcd(c.ep, d["dp"] * c.cp)))
    return out
