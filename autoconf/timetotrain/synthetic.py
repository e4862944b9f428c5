"""The clusters ``plan`` sweeps (a device kind, a GPU count, a network) and the methods it
switches off in turn (``METHODS``); one ``System`` per (model, cluster) with its links
prefilled from one group per axis on uniform clusters.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from autoconf.cost.system import System
from autoconf.errors import UserError
from autoconf.space.config import ParallelConfig
from autoconf.specs.cluster import cluster_from_mapping
from autoconf.specs.devices import device_type
from autoconf.specs.topology import Topology


@dataclass(frozen=True)
class Method:
    """A restriction of the configuration space: one or more methods switched off."""

    name: str
    label: str
    layered: bool = True
    """Layered gradient accumulation allowed (gpipe-layered, breadth-first, pp=1 layered)."""
    modular: bool = True
    """Modular (looped) placement allowed: more than one chunk per device (interleaved,
    breadth-first)."""
    max_zero: int = 3

    def admits_outer(self, sched: str, v: int, layered: bool) -> bool:
        lay = layered or sched == "breadth_first"
        return (self.layered or not lay) and (self.modular or v == 1)

    def admits(self, c: ParallelConfig) -> bool:
        return self.admits_outer(c.schedule, c.virtual_stages, c.layered_grad_accum) and c.zero_stage <= self.max_zero

    def to_dict(self) -> dict:
        return {"name": self.name, "label": self.label, "layered": self.layered, "modular": self.modular,
                "max_zero": self.max_zero}


METHODS = (
    Method("all", "every method"),
    Method("no-layered", "no layered accumulation", layered=False),
    Method("no-modular", "no modular placement", modular=False),
    Method("baseline", "neither (contiguous, standard)", layered=False, modular=False),
    Method("zero<=1", "ZeRO 0-1 only", max_zero=1),
    Method("no-zero", "no ZeRO", max_zero=0),
)


NODES = {
    # device: (GPUs per node, NVLink per GPU per direction, InfiniBand NICs per node, rate each)
    "a100-40gb": (8, "300 GB/s", 8, "200 Gbit/s"),
    "a100-80gb": (8, "300 GB/s", 8, "200 Gbit/s"),
    "h100-sxm": (8, "450 GB/s", 8, "400 Gbit/s"),
    "h200": (8, "450 GB/s", 8, "400 Gbit/s"),
}
"""DGX-style nodes: 8 GPUs on NVSwitch, one InfiniBand NIC per GPU. DGX A100: NVLink3 (600 GB/s
bidirectional per GPU), 8 x HDR 200 Gbit/s; DGX H100 / H200: NVLink4 (900 GB/s), 8 x NDR 400
Gbit/s (NVIDIA DGX A100 / H100 user guides)."""


NETWORKS = {
    "ib": "InfiniBand, one NIC per GPU (8 x 200 Gbit/s on A100 nodes, 8 x 400 Gbit/s on H100/H200)",
    "100gbe": "one 100 Gbit/s Ethernet NIC per node",
    "25gbe": "one 25 Gbit/s Ethernet NIC per node",
}
"""The inter-node network kinds ``plan`` compares. Ethernet is one NIC per node (a commodity
cluster: 8 GPUs share it), at the same latency as InfiniBand so that the comparison isolates the
bandwidth (16x and 64x less than 8 x 200 Gbit/s on A100 nodes)."""












def synthetic_cluster(device: str, gpus: int, network: str = "ib"):
    """A cluster of ``gpus`` GPUs of ``device`` in DGX-style nodes on ``network`` (a ClusterSpec
    built through the cluster file schema, so it is what ``--cluster`` would read)."""
    if device not in NODES:
        raise UserError(f"--device {device!r}; valid: {', '.join(NODES)} (or give --cluster FILE)")
    if network not in NETWORKS:
        raise UserError(f"--network {network!r}; valid: {', '.join(NETWORKS)}")
    per_node, nvlink, n_ib, ib_rate = NODES[device]
    if gpus % per_node:
        raise UserError(f"--max-gpus {gpus}: must be a multiple of {per_node} (GPUs per {device} node)")
    nics = ({"count": n_ib, "bandwidth": ib_rate, "kind": "infiniband"} if network == "ib" else
            {"count": 1, "bandwidth": "100 Gbit/s" if network == "100gbe" else "25 Gbit/s", "kind": "ethernet"})
    # one node through the file schema, then as many as asked: a cluster file is bounded
    # (``cluster.MAX_DEVICES``), a sweep is not (its uniform topology is linear in the devices)
    one = cluster_from_mapping({"name": f"{device}-{gpus // per_node}x{per_node}-{network}",
                                "node_groups": [{"count": 1, "device": device, "gpus_per_node": per_node,
                                                 "intra_node_bandwidth": nvlink, "nics": nics}]},
                               where="synthetic cluster")
    return dataclasses.replace(one, node_groups=(dataclasses.replace(one.node_groups[0], count=gpus // per_node),))


def cluster_yaml(cluster) -> str:
    """The cluster as a cluster file (units written out), for ``--cluster-out``."""
    lines = [f"name: {cluster.name}", "node_groups:"]
    for g in cluster.node_groups:
        lines += [f"  - count: {g.count}", f"    device: {g.device}", f"    gpus_per_node: {g.gpus_per_node}",
                  f"    intra_node_bandwidth: {g.intra_node_bandwidth_bytes_per_s / 1e9:g} GB/s",
                  f"    nics: {{count: {g.nic_count}, bandwidth: {g.nic_bandwidth_bytes_per_s * 8 / 1e9:g} Gbit/s, "
                  f"kind: {g.nic_kind}}}"]
        if g.memory_bytes is not None:
            lines.append(f"    memory: {g.memory_bytes / 2**30:g} GiB")
        if g.nvlink_domain > 1:
            lines.append(f"    nvlink_domain: {g.nvlink_domain}")
        if g.fabric is not None:
            lines.append(f"    fabric: {json.dumps(g.fabric)}")
        if g.hosts:  # names as JSON strings, which YAML reads as they are
            lines.append(f"    hosts: [{', '.join(json.dumps(h) for h in g.hosts)}]")
    lines.append(f"latency: {{intra_node: {cluster.intra_node_latency_s * 1e6:g} us, "
                 f"inter_node: {cluster.inter_node_latency_s * 1e6:g} us}}")
    if cluster.inter_group_bandwidth_bytes_per_s:
        lines.append(f"inter_group_bandwidth: {cluster.inter_group_bandwidth_bytes_per_s / 1e9:g} GB/s")
    return "\n".join(lines) + "\n"


class _UniformTopology(Topology):
    """``Topology`` of a cluster with one node group, built from the spec without the networkx
    graph (the same attributes ``Topology(cluster.graph())`` reads; checked equal in the tests)."""

    def __init__(self, spec):
        (g,) = spec.node_groups
        dom = g.nvlink_domain  # hosts per NVLink domain: the domain is the host for bandwidth
        n, per = spec.num_devices, g.gpus_per_node * dom
        self.num_devices = n
        self.node_of = [d // g.gpus_per_node for d in range(n)]
        self.host_of = [d // per * dom for d in range(n)]
        self.group_of = [0] * n
        self.kind_of = [g.device] * n
        self.memory_of = [float(g.device_memory_bytes)] * n
        self.intra_latency_s = float(spec.intra_node_latency_s)
        self.inter_latency_s = float(spec.inter_node_latency_s)
        names = spec.host_names()
        hosts = range(0, g.count, dom)
        self.host_nic_kind = {h: str(g.nic_kind) for h in hosts}
        self.host_name = {h: names[h] for h in range(g.count)}
        self.host_nic_bw = {h: float(g.nic_bandwidth_bytes_per_s) for h in hosts}
        self.host_nic_total = {h: float(g.nic_bandwidth_bytes_per_s) * g.nic_count * dom for h in hosts}
        self.host_intra_bw = {h: float(g.intra_node_bandwidth_bytes_per_s) for h in hosts}
        self.group_cap = {}
        self.measured = {}
        self._group_cache = {}
        self.per_node = per
        """Devices per host for bandwidth (per NVLink domain where domains span hosts)."""


def planning_system(model, cluster, framework=None, profile=None, moe_imbalance: float = 1.0,
                    moe_dispatcher: str = "alltoall") -> System:
    """The System the planner estimates with: the uniform fast path for one node group without a
    profile. With ``profile`` it is ``search``'s own (``System(model, cluster, profile)``): the
    profile's device measurements (per-layer compute, GEMM table, collective efficiency) price the
    cluster's devices of the profiled kind, and its measured links overlay the cluster's first
    hosts in order (a profile of one node: the first node's links), so that the printed search
    command finds the same times. ``moe_imbalance``: a mixture of experts' load imbalance
    (``System.moe_imbalance``); ``moe_dispatcher``: its token dispatcher (``System.moe_dispatcher``)."""
    if profile is None and len(cluster.node_groups) == 1:
        return System(model, cluster, topology=_UniformTopology(cluster), framework=framework,
                      moe_imbalance=moe_imbalance, moe_dispatcher=moe_dispatcher)
    return System(model, cluster, profile, framework=framework, moe_imbalance=moe_imbalance,
                  moe_dispatcher=moe_dispatcher)


def _aligned(stride: int, n: int, per: int) -> bool:
    """Whether every group of ``n`` ranks ``stride`` apart sits on hosts of ``per`` devices the
    same way (all groups of the axis then see the same links)."""
    return n == 1 or stride % per == 0 or (per % stride == 0 and ((stride * n) % per == 0 or per % (stride * n) == 0))


def _prefill(system: System, c: ParallelConfig) -> None:
    """Fill the System's caches of a layout's groups, stage devices, pipeline links and peak
    FLOP/s from one representative group each, where all groups are alike: a uniform topology,
    the default rank order (tp-dp-pp), no device order, no context parallelism, and every axis
    aligned on the hosts. Else nothing (the cost model enumerates every group itself)."""
    topo = system.topology
    if (not isinstance(topo, _UniformTopology) or c.rank_order != "tp-dp-pp" or c.device_order is not None
            or c.cp > 1):
        return
    dp, pp, tp, per = c.dp, c.pp, c.tp, topo.per_node
    world = dp * pp * tp
    if world % per or not (_aligned(1, tp, per) and _aligned(tp, dp, per) and _aligned(tp * dp, pp, per)):
        return
    key = (dp, pp, tp, c.cp, c.rank_order, c.device_order)  # the cost model's own cache keys
    cache = system._cache
    if ("stages",) + key in cache:
        return
    # one device per stage stands for all of them: the layout reads their kinds and capacities
    cache[("stages",) + key] = [[s * tp * dp] for s in range(pp)]
    for axis, stride, n in (("tp", 1, tp), ("dp", tp, dp)):
        grp = tuple(i * stride for i in range(n))
        hosts = {topo.host_of[d] for d in grp}
        # every group of the axis spans hosts or none does; then each host has all its devices
        # in such groups (the count ``axis_links`` makes)
        active = {h: per for h in hosts} if len(hosts) > 1 else None
        cache[("axis",) + key + (axis,)] = [topo.group_links(grp, active)]
    tune = system.collective_tuning
    links = []
    block = tp * dp  # devices of one stage
    for s in range(pp):
        a, b = s * block, ((s + 1) % pp) * block
        bw, lat = topo.p2p(a, b)
        ha, hb = topo.host_of[a], topo.host_of[b]
        if ha != hb:  # every device of the stage on this host sends across at once
            k = min(per, block)
            bw = min(bw, topo.nic_share(ha, k), topo.nic_share(hb, k))
        eff = tune.inter_efficiency if ha != hb else tune.intra(2)
        links.append((1.0 / (bw * eff), lat + tune.base_latency_s))
    cache[("p2p",) + key] = links
    cache.setdefault(("peak", world), world * device_type(topo.kind_of[0]).peak(system.model.dtype))






