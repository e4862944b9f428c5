"""Groups and their links: which devices each axis's groups hold, the slowest group's
collective time, and which collective each data-parallel reduction runs.
"""

from __future__ import annotations

import itertools
from collections import Counter

from autoconf.cost import comm
from autoconf.cost.system import System
from autoconf.space.config import ParallelConfig
from autoconf.space.placement import Placement
from autoconf.specs.devices import NEUTRAL, CollectiveTuning


def axis_links(system: System, c: ParallelConfig, axis: str):
    """GroupLinks of every group along an axis (on the devices the placement gives its ranks), with
    NIC sharing among groups running together."""
    def make():
        topo = system.topology
        groups = Placement.of(c, 0).device_groups(axis)
        # the devices of each host that cross hosts at once: those of every group spanning hosts
        on_host = topo.host_of.__getitem__
        spanning = (grp for grp in groups if len(set(map(on_host, grp))) > 1)
        active = Counter(map(on_host, itertools.chain.from_iterable(spanning)))
        distinct = {}
        for grp in groups:
            # groups with the same hosts, NIC sharing and link speeds have the same links: keep one
            g = topo.group_links(grp, active or None)
            distinct[g] = g
        return list(distinct)
    # the expert axes' groups depend on the expert-parallel degree too
    ep = (c.ep,) if axis in ("ep", "edp") else ()
    return system.cached(("axis", c.dp, c.pp, c.tp, c.cp, c.rank_order, c.device_order, axis) + ep, make)


def worst(links, fn, nbytes: float, efficiency=1.0, tune: CollectiveTuning = NEUTRAL,
          algorithms=None) -> float:
    """The slowest group's time: all groups of an axis run the collective together.

    ``efficiency`` (the profile's measured bus bandwidth over what the links predict; a number, or
    a function of a group's links) stretches the bandwidth term only: steps x alpha + bytes /
    (beta x efficiency). ``tune``: the collective library's fixed cost and bus efficiency per tier
    (``CollectiveTuning``). ``algorithms`` (all-reduce only): a function of a group's links
    giving the algorithms the runtime runs on it.
    """
    eff = efficiency if callable(efficiency) else (lambda g: efficiency)
    if algorithms is None:
        return max(fn(nbytes / eff(g), g, tune) for g in links)
    return max(fn(nbytes / eff(g), g, tune, algorithms=algorithms(g)) for g in links)


def collective_s(system: System, links, fn, n: int, nbytes: float, algorithms=None) -> float:
    """Collective ``fn`` of ``nbytes`` on every group of ``links`` (n ranks each), at the efficiency
    measured on groups of that size over the same tier (inside a host or across hosts): the
    slowest group's time. ``algorithms``: as :func:`worst`."""
    return worst(links, fn, nbytes, lambda g: system.collective_efficiency(fn, n, g.num_hosts > 1),
                 system.collective_tuning, algorithms)


def stage_devices(c: ParallelConfig) -> list[list[int]]:
    """The devices of each pipeline stage (``placement``)."""
    return Placement.of(c, 0).stage_devices()


def grad_group(c: ParallelConfig) -> tuple:
    """(ranks, axis) of the groups that reduce gradients and shard ZeRO's state together: the
    data-parallel ranks, times the context-parallel ones (they hold the same parameters and
    different tokens: Megatron-LM's and torchtitan's gradient groups are dp x cp)."""
    return c.dp * c.cp, (("cp", "dp") if c.cp > 1 else "dp")


def reduction_collective(zero_stage: int):
    """The collective that reduces the step's gradients in this model: an all-reduce for ZeRO-0,
    a reduce-scatter for ZeRO-1/2/3 (the ZeRO paper's volume). The reference trainer's ZeRO-1
    all-reduces instead (and then broadcasts from the owners): the model does not follow it there."""
    return comm.all_reduce_s if zero_stage == 0 else comm.reduce_scatter_s


def all_reduce_algorithms(system: System, c: ParallelConfig, fn):
    """For an all-reduce ``fn``, a function of a dp group's links giving the algorithms the
    framework's runtime really runs there (``Framework.dp_all_reduce_algorithms``: the reference
    trainer's gloo ring, its hierarchical all-reduce where ``dp_all_reduce`` asks and the hosts
    split evenly, NCCL's ring or tree); None for the other collectives."""
    if fn is not comm.all_reduce_s:
        return None
    fw, gloo = system.framework, system.gloo
    return lambda g: fw.dp_all_reduce_algorithms(c, g, gloo)


def tied_params(system: System, c: ParallelConfig, ci: int) -> float:
    """Parameters of chunk ``ci`` that are a copy of the tied embedding (its first and last chunk,
    pp > 1) where the framework sums them over the two stages and then reduces them after the
    pipeline (``Framework.tied_sync_after_pipeline``, ``compression.embedding_sync_s``), not with
    the chunk's buckets; 0 elsewhere."""
    m = system.model
    if (not m.tied_embeddings or c.pp == 1 or ci not in (0, c.num_chunks - 1)
            or not system.framework.tied_sync_after_pipeline):
        return 0.0
    return -(-m.vocab_size // c.tp) * m.hidden_size
