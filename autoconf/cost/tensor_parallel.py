"""Groups and links of a layout, and the tensor-parallel collectives per layer.

Megatron-LM's tensor parallelism (Shoeybi et al., arXiv 1909.08053) all-reduces the block's
activation twice in the forward (after attention and after the MLP) and twice in the backward;
with sequence parallelism (Korthikanti et al., arXiv 2205.05198) each all-reduce becomes an
all-gather plus a reduce-scatter of the same bytes. The collectives run on the links the tp groups
really span (``comm``), every group at once: the slowest group sets the time.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ParallelConfig
from ..placement import Placement
from . import comm
from .system import System


def axis_links(system: System, c: ParallelConfig, axis: str):
    """GroupLinks of every group along an axis (on the devices the placement gives its ranks), with
    NIC sharing among groups running together."""
    def make():
        topo = system.topology
        groups = Placement.of(c, 0).device_groups(axis)
        active: dict = {}
        for grp in groups:
            hosts = {topo.host_of[d] for d in grp}
            if len(hosts) > 1:
                for d in grp:
                    active[topo.host_of[d]] = active.get(topo.host_of[d], 0) + 1
        distinct = {}
        for grp in groups:
            # groups with the same hosts, NIC sharing and link speeds have the same links: keep one
            g = topo.group_links(grp, {h: active[h] for h in {topo.host_of[d] for d in grp} if h in active} or None)
            distinct[g] = g
        return list(distinct)
    return system.cached(("axis", c.dp, c.pp, c.tp, c.cp, c.rank_order, c.device_order, axis), make)


def worst(links, fn, nbytes: float, efficiency=1.0, tune: comm.CollectiveTuning = comm.NEUTRAL,
          algorithms=None) -> float:
    """The slowest group's time: all groups of an axis run the collective together.

    ``efficiency`` (the profile's measured bus bandwidth over what the links predict; a number, or
    a function of a group's links) stretches the bandwidth term only: steps x alpha + bytes /
    (beta x efficiency). ``tune``: the collective library's fixed cost and bus efficiency per tier
    (``comm.CollectiveTuning``). ``algorithms`` (all-reduce only): a function of a group's links
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


@dataclass(frozen=True)
class TpTimes:
    """Exposed tensor-parallel communication per micro-batch."""

    forward_per_layer_s: float = 0.0
    backward_per_layer_s: float = 0.0
    """Including the forward's collectives again under full recomputation."""
    edge_s: float = 0.0
    """One collective of the embedding forward / the output layer's backward."""


def tp_times(system: System, c: ParallelConfig, stage_kinds) -> TpTimes:
    """Megatron's 2 collectives per block in the forward and 2 in the backward (all-reduce, or
    all-gather + reduce-scatter with sequence parallelism) of one micro-batch's activation; the
    profile's in-place measurement replaces them when it has one (``System.measured_tp_comm``)."""
    if c.tp == 1:
        return TpTimes()
    m, tp = system.model, c.tp
    nbytes = c.micro_batch_size * (m.seq_length // c.cp) * m.hidden_size * m.dtype_bytes
    links = axis_links(system, c, "tp")
    if c.sequence_parallel:
        one = (collective_s(system, links, comm.all_gather_s, tp, nbytes)
               + collective_s(system, links, comm.reduce_scatter_s, tp, nbytes))
    else:
        flat = system.framework.flat_all_reduce_algorithms(system.gloo)  # tp's all-reduce is always the library's
        one = collective_s(system, links, comm.all_reduce_s, tp, nbytes, lambda g: flat)
    fwd = bwd = 2 * one
    measured = system.measured_tp_comm(c, stage_kinds)
    if measured is not None:  # the profile timed the block with its real collectives
        fwd, bwd = measured
        one = fwd / 2
    bwd += fwd if c.recompute == "full" else 0.0
    return TpTimes(fwd, bwd, one)
