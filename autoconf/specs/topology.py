"""Topology: fast link queries over the cluster graph (a ClusterSpec's, or a profile's measured one).

The cost model asks three things of the links: the bandwidth and latency between two devices
(point-to-point), the bandwidth a device gets off its host when ``k`` devices of that host cross
the network at once (NIC sharing), and the slowest link a collective group's ring would use.
Everything is read from the networkx graph once, into flat lists, so the search's hot path never
walks the graph.

NVLink domains: where consecutive hosts share one NVLink fabric (a GB200 NVL72 rack: 18 hosts of 4
GPUs; the cluster file's ``nvlink_domain``, the graph's ``domain`` attribute), the domain is one
*host* for every bandwidth question: ``host_of`` gives the domain (numbered by its first host),
so two devices of one domain talk at the intra-node bandwidth and latency, a collective inside it
runs at NVLink speed (``GroupLinks.num_hosts`` counts domains), and flows leaving it share all
its hosts' NICs (``host_nic_total``). The real host stays in ``node_of`` (and ``host_name`` is
keyed by it): where a device runs, not how fast it talks. Without domains both are the host.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

__all__ = ["GroupLinks", "Topology"]


@dataclass(frozen=True)
class GroupLinks:  # hashable: equal links dedupe
    """What a collective over one group of devices sees."""

    size: int
    """Devices in the group, n."""
    num_hosts: int
    """Hosts the group spans (an NVLink domain spanning hosts counts once: see the module doc)."""
    local_size: int
    """Most group members on one host (domain), k."""
    intra_bandwidth_bytes_per_s: float
    """Slowest link between members on the same host (inf if no two share a host)."""
    inter_bandwidth_bytes_per_s: float
    """Per-device bandwidth across hosts when every active device of a host sends at once (the
    hierarchical algorithm's k flows per group), after NIC sharing and caps (inf if one host)."""
    ring_inter_bandwidth_bytes_per_s: float
    """Bandwidth across hosts of a flat ring or tree: one flow per rail, as many rails as the group's
    fewest members on a host (NCCL's channels, one per NIC), after NIC sharing among the axis's
    groups and the caps between node groups."""
    intra_latency_s: float
    inter_latency_s: float


class Topology:
    def __init__(self, graph):
        devices = sorted(n for n in graph.nodes if isinstance(n, int))
        if devices != list(range(len(devices))):
            raise ValueError("device nodes must be numbered 0..N-1")
        attrs = graph.nodes
        self.num_devices = len(devices)
        self.node_of = [attrs[i]["node"] for i in devices]
        """The device's host (its index in the cluster)."""
        self.host_of = [attrs[i].get("domain", attrs[i]["node"]) for i in devices]
        """The device's host for bandwidth: its NVLink domain, numbered by the domain's first host
        (the host itself where no domain spans hosts)."""
        self.group_of = [attrs[i]["group"] for i in devices]
        self.kind_of = [attrs[i]["device"] for i in devices]
        self.memory_of = [float(attrs[i]["memory_bytes"]) for i in devices]
        self.intra_latency_s = float(graph.graph.get("intra_node_latency_s", 2e-6))
        self.inter_latency_s = float(graph.graph.get("inter_node_latency_s", 10e-6))
        self._read_hosts(lambda n: attrs.get(("host", n), {}))
        self.group_cap = {}
        for u, v, d in graph.edges(data=True):
            if d.get("kind") == "inter_group":
                self.group_cap[(u[1], v[1])] = self.group_cap[(v[1], u[1])] = float(d["bandwidth_bytes_per_s"])
        self.measured = {}
        self._group_cache: dict = {}
        self.with_measured({(u, v): d for u, v, d in graph.edges(data=True) if d.get("kind") == "measured"})

    @classmethod
    def of_cluster(cls, spec) -> "Topology":
        """The topology of a ``ClusterSpec`` read from its node groups, without building its graph:
        the same fields as ``Topology(spec.graph())`` (``tests/specs/test_size_limits.py`` compares
        them), in time and memory linear in the devices, and without importing networkx."""
        self = cls.__new__(cls)
        domains = spec.domains()
        self.node_of, self.host_of, self.group_of, self.kind_of, self.memory_of = [], [], [], [], []
        memory = [float(g.device_memory_bytes) for g in spec.node_groups]  # a catalog look-up: once per group
        for n, (gi, grp) in enumerate(spec.nodes()):
            k = grp.gpus_per_node
            self.node_of += [n] * k
            self.host_of += [domains[n]] * k
            self.group_of += [gi] * k
            self.kind_of += [grp.device] * k
            self.memory_of += [memory[gi]] * k
        self.num_devices = len(self.node_of)
        self.intra_latency_s = float(spec.intra_node_latency_s)
        self.inter_latency_s = float(spec.inter_node_latency_s)
        self._group_hosts(spec, domains)
        groups = range(len(spec.node_groups))
        self.group_cap = {(a, b): float(spec.group_cap(a, b)) for a in groups for b in groups if a != b}
        self.measured = {}
        self._group_cache = {}
        return self

    def with_measured(self, links: dict) -> "Topology":
        """This topology with measured device pairs, ``{(a, b): {"bandwidth_bytes_per_s": ..,
        "latency_s": ..}}`` (a graph's ``measured`` edges, ``measured_graph.measured_device_links``),
        which :meth:`p2p` prefers to the declared links, in both directions."""
        for (u, v), d in links.items():
            pair = (float(d["bandwidth_bytes_per_s"]), float(d["latency_s"]))
            self.measured[(u, v)] = self.measured[(v, u)] = pair
        if links:
            self._group_cache.clear()
        return self

    def _group_hosts(self, spec, domains: list) -> None:
        """:meth:`_read_hosts` for a ``ClusterSpec``, a node group at a time: every host of a
        group has its figures (``ClusterSpec.host_attrs``) and every domain its
        ``nvlink_domain`` hosts, so a domain's figures are the group's and its NICs together the
        same sum, added host by host from 0.0 as there. Dicts filled in bulk (65,536 hosts)."""
        self.host_name = dict(enumerate(spec.host_names()))
        self.host_nic_bw, self.host_nic_total, self.host_intra_bw, self.host_nic_kind = {}, {}, {}, {}
        first = 0
        for grp in spec.node_groups:
            ids = list(dict.fromkeys(domains[first:first + grp.count]))
            bw = float(grp.nic_bandwidth_bytes_per_s)
            total = 0.0
            for _ in range(grp.nvlink_domain):
                total += bw * grp.nic_count
            self.host_nic_bw.update(dict.fromkeys(ids, bw))
            self.host_nic_total.update(dict.fromkeys(ids, total))
            self.host_intra_bw.update(dict.fromkeys(ids, float(grp.intra_node_bandwidth_bytes_per_s)))
            self.host_nic_kind.update(dict.fromkeys(ids, str(grp.nic_kind)))
            first += grp.count

    def _read_hosts(self, host_attrs) -> None:
        """Per host (``host_attrs(n)``: the host's attributes, as ``ClusterSpec.host_attrs`` gives
        them) its name; per host for bandwidth (its domain) the slowest NIC and fabric figures and
        all its hosts' NICs together, in the order of the hosts."""
        self.host_nic_bw = nic_bw = {}
        self.host_nic_total = total = {}
        self.host_intra_bw = intra = {}
        self.host_nic_kind = {}
        self.host_name = {}
        """A host's name (by ``node_of``): the graph's ``hostname`` or ``name`` (a profile's host),
        else node-K."""
        inf = float("inf")
        for n, h in sorted(dict(zip(self.node_of, self.host_of)).items()):  # (a host's devices: one domain)
            a = host_attrs(n)
            self.host_name[n] = str(a.get("hostname") or a.get("name") or f"node-{n}")
            bw = float(a.get("nic_bandwidth_bytes_per_s", inf))
            fabric = float(a.get("intra_node_bandwidth_bytes_per_s", inf))
            if h not in nic_bw:  # the domain's first host
                self.host_nic_kind[h] = str(a.get("nic_kind", ""))
                nic_bw[h], total[h], intra[h] = bw, 0.0, fabric
            # a domain: its slowest NIC and fabric figures, and all its hosts' NICs together
            nic_bw[h] = min(nic_bw[h], bw)
            intra[h] = min(intra[h], fabric)
            total[h] += bw * a.get("nic_count", 1)

    # -- point to point -------------------------------------------------------------------------
    def p2p(self, i: int, j: int) -> tuple[float, float]:
        """(bandwidth_bytes_per_s, latency_s) from device i to device j, one flow alone."""
        if (i, j) in self.measured:
            return self.measured[(i, j)]
        hi, hj = self.host_of[i], self.host_of[j]
        if hi == hj:
            return self.host_intra_bw[hi], self.intra_latency_s
        bw = min(self.host_nic_bw[hi], self.host_nic_bw[hj])
        gi, gj = self.group_of[i], self.group_of[j]
        if gi != gj:
            bw = min(bw, self.group_cap.get((gi, gj), float("inf")))
        return bw, self.inter_latency_s

    def nic_share(self, host: int, flows: int) -> float:
        """Bandwidth per flow when ``flows`` flows leave ``host`` at once (NICs shared evenly)."""
        return min(self.host_nic_bw[host], self.host_nic_total[host] / max(flows, 1))

    # -- collective groups ----------------------------------------------------------------------
    def group_links(self, members: tuple, active_per_host: dict | None = None) -> GroupLinks:
        """Link summary for a collective over ``members`` (device ids, in ring order).

        ``active_per_host`` maps a host to how many of its devices take part in cross-host
        collectives of this axis at the same time (all groups of an axis run together); a host it
        leaves out (or None): only this group's members. NICs are shared evenly among them.
        """
        key = self._group_key(members, active_per_host)
        hit = self._group_cache.get(key)
        if hit is not None:
            return hit
        per_host: dict = {}
        host_of = self.host_of
        for d in members:
            per_host.setdefault(host_of[d], []).append(d)
        intra_bw, intra_lat = _ring(self, [devs for devs in per_host.values() if len(devs) > 1])
        inter_bw, inter_lat = float("inf"), 0.0
        ring_bw = float("inf")
        if len(per_host) > 1:
            heads = [devs[0] for devs in per_host.values()]
            inter_bw, inter_lat = _ring(self, [heads])
            # NCCL's rings and trees across hosts run one channel per rail: each of a host's k
            # members sends its share through its own NIC (rail-optimised fabrics keep GPU i of
            # every host on rail i), so a flat ring has as many inter-host flows as its fewest
            # members on a host, capped by the caps between node groups and shared with the other
            # groups of the axis on each host's NICs
            rails = min(len(devs) for devs in per_host.values())
            ring_bw = min(rails * inter_bw, _group_cap(self, heads))
            nic, total = self.host_nic_bw, self.host_nic_total
            for h, devs in per_host.items():  # nic_share, inline: a dp group may span thousands of hosts
                active = active_per_host.get(h, len(devs)) if active_per_host else len(devs)
                inter_bw = min(inter_bw, nic[h], total[h] / max(active, 1))
                ring_bw = min(ring_bw, len(devs) * nic[h], total[h] / max(1, active // len(devs)))
        out = GroupLinks(size=len(members), num_hosts=len(per_host),
                         local_size=max(len(v) for v in per_host.values()),
                         intra_bandwidth_bytes_per_s=intra_bw, inter_bandwidth_bytes_per_s=inter_bw,
                         ring_inter_bandwidth_bytes_per_s=ring_bw,
                         intra_latency_s=intra_lat or self.intra_latency_s,
                         inter_latency_s=inter_lat or self.inter_latency_s)
        if len(self._group_cache) < 200_000:
            self._group_cache[key] = out
        return out

    def _group_key(self, members: tuple, active_per_host: dict | None) -> tuple:
        """What :meth:`group_links` answers from, as its cache key. Without measured links: which
        members share a host (host numbers less the first member's), each member's host figures
        and node group (:meth:`device_classes`) and the active flows on its host, so that the
        thousands of groups of an axis that sit alike on alike hosts (32,768 tp pairs on 65,536
        devices) share one entry. With measured links, which are per device pair: the members."""
        hosts = tuple(map(self.host_of.__getitem__, members))
        if self.measured or not members:  # (the flows on the group's own hosts: all the answer reads)
            active = sorted((h, active_per_host[h]) for h in set(hosts) if h in active_per_host) \
                if active_per_host else None
            return members, tuple(active) if active else None
        return (tuple(map(operator.sub, hosts, itertools.repeat(hosts[0]))),
                tuple(map(self.device_classes().__getitem__, members)),
                tuple(map(active_per_host.get, hosts)) if active_per_host else None)

    def device_classes(self) -> list:
        """Per device, a number for its host's bandwidth figures (NIC, all NICs, fabric) and its
        node group. Without measured links, devices with equal numbers are alike to :meth:`p2p`,
        :meth:`nic_share` and :meth:`group_links` but for which of them share a host. Built on
        first use."""
        classes = self.__dict__.get("_classes")
        if classes is None:
            ids: dict = {}
            figures = {h: (self.host_nic_bw[h], self.host_nic_total[h], self.host_intra_bw[h]) for h in self.host_nic_bw}
            classes = self._classes = [ids.setdefault((figures[h], g), len(ids))
                                       for h, g in zip(self.host_of, self.group_of)]
        return classes


def _group_cap(topo: Topology, ring: list) -> float:
    """The least cap between node groups on a ring of devices (inf: none, or measured links)."""
    if topo.measured or not topo.group_cap:
        return float("inf")
    groups = [topo.group_of[d] for d in ring]
    return min((topo.group_cap.get((a, b), float("inf")) for a, b in zip(groups, groups[1:] + groups[:1]) if a != b),
               default=float("inf"))


def _ring(topo: Topology, rings: list) -> tuple[float, float]:
    """(slowest bandwidth, largest latency) of the links between consecutive devices of each ring
    (device lists, closed: the last back to the first); (inf, 0.0) with no link. Without measured
    links, p2p's answers from host membership directly, with no call per pair: a ring inside one
    host runs at its fabric, one across hosts at their slowest NIC (and the cap between node groups
    it crosses): every host of a ring is an end of two of its links."""
    bw, lat = float("inf"), 0.0
    if topo.measured:
        for devs in rings:
            for a, b in zip(devs, devs[1:] + devs[:1]):
                if a != b:
                    pbw, plat = topo.p2p(a, b)
                    bw, lat = min(bw, pbw), max(lat, plat)
        return bw, lat
    host_of, group_of = topo.host_of, topo.group_of
    for devs in rings:
        hosts = [host_of[d] for d in devs]
        if hosts[0] == hosts[-1]:  # (p2p: one host -- a ring is inside a host or across distinct ones)
            bw, lat = min(bw, topo.host_intra_bw[hosts[0]]), max(lat, topo.intra_latency_s)
            continue
        bw, lat = min(bw, min(topo.host_nic_bw[h] for h in hosts)), max(lat, topo.inter_latency_s)
        if topo.group_cap:
            groups = [group_of[d] for d in devs]
            for ga, gb in zip(groups, groups[1:] + groups[:1]):
                if ga != gb:
                    bw = min(bw, topo.group_cap.get((ga, gb), float("inf")))
    return bw, lat
