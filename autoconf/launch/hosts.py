"""Hosts of a launch: which hosts a world uses, each node's rank range and device visibility,
and the roles (ranks, stages, blocks) each host's processes play.
"""

from __future__ import annotations

from autoconf.errors import UserError
from autoconf.space.placement import Placement


def hosts_used(cluster, world: int) -> list[int]:
    """Devices per host for the first ``world`` devices (hosts in cluster order)."""
    out, left = [], world
    for _, grp in cluster.nodes():
        if left <= 0:
            break
        n = min(grp.gpus_per_node, left)
        out.append(n)
        left -= n
    return out


def node_plan(cluster, world: int) -> list[dict]:
    """The hosts used, in rank order: name, devices used (nproc), first global rank, device kind."""
    names = cluster.host_names()
    out, first = [], 0
    for (_, grp), name, n in zip(cluster.nodes(), names, hosts_used(cluster, world)):
        out.append({"host": name, "nproc": n, "first_rank": first, "device": grp.device,
                    "gpus_per_node": grp.gpus_per_node})
        first += n
    return out


def visible_devices(plan: list[dict], local_devices: list[int] | None = None) -> list[str | None]:
    """Per host the CUDA_VISIBLE_DEVICES value (None for CPU hosts): the devices of its ranks in
    rank order, from ``local_devices`` (rank -> device index on its host; identity when None)."""
    world = sum(p["nproc"] for p in plan)
    if local_devices is not None:
        if len(local_devices) != world or not all(isinstance(d, int) and not isinstance(d, bool)
                                                  for d in local_devices):
            raise UserError(f"local_devices: expected {world} device indices (one per rank), got "
                            f"{local_devices!r:.80}")
    out = []
    for p in plan:
        first, n = p["first_rank"], p["nproc"]
        devs = list(range(n)) if local_devices is None else list(local_devices[first:first + n])
        if local_devices is not None and (len(set(devs)) != n or not all(0 <= d < p["gpus_per_node"] for d in devs)):
            raise UserError(f"local_devices for host {p['host']!r} (ranks {first}..{first + n - 1}): {devs} must be "
                            f"distinct device indices in 0..{p['gpus_per_node'] - 1}")
        out.append(None if p["device"] == "cpu" else ",".join(str(d) for d in devs))
    return out


def host_roles(config, num_layers: int, first: int, n: int) -> str:
    """What the processes ``first..first+n-1`` (torchrun's global ranks = devices) play in the
    plan: the ranks of its order (``placement``), their pipeline stages and transformer blocks."""
    pl = Placement.of(config, num_layers)
    ranks = [pl.rank_on(d) for d in range(first, first + n)]
    stages = sorted({pl.coords(r)["pp"] for r in ranks})
    chunks = pl.chunk_layers()
    blocks = []
    for st in stages:
        for ci in pl.chunks_of_stage(st):
            if chunks[ci]:
                blocks.append(f"{chunks[ci][0]}-{chunks[ci][-1]}")
    moved = "" if ranks == list(range(first, first + n)) else f", playing plan ranks {','.join(map(str, ranks))}"
    return (f"{moved}; pipeline stage{'s' if len(stages) > 1 else ''} {','.join(map(str, stages))}, "
            f"blocks {','.join(blocks)}")
