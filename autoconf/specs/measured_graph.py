"""The measured cluster as a graph: a profile's ranks and links in ``ClusterSpec.graph()``'s
schema (``topology_graph``), or laid over a cluster file's declared one (``overlay_measured_links``).
"""

from __future__ import annotations

import statistics

from autoconf.specs.profile import Profile


def topology_graph(profile: Profile):
    """The measured cluster as a networkx graph in ClusterSpec.graph()'s schema.

    Devices (int nodes = ranks; attrs node, group, device, memory_bytes, host, local_rank),
    hosts (("host", n): group, nic_count, nic_bandwidth_bytes_per_s, nic_kind="measured",
    intra_node_bandwidth_bytes_per_s), groups (("group", g): hosts of the same device kind and
    size), device--host "nic" and host--group "uplink" edges, and one device--device edge per
    measured pair (kind="measured", slower direction). Graph attrs intra_node_latency_s /
    inter_node_latency_s are medians of the measured latencies (ClusterSpec's defaults, 2 us and
    10 us, where no pair of that sort was measured). A device's NIC bandwidth is the fastest
    measured link from it to another host, else its host's fastest interface speed
    (/sys/class/net), else infinite (single host: nothing crosses it).
    """
    import networkx as nx

    by_host = ranks_by_host(profile)
    hosts = list(by_host)
    host_index = {h: i for i, h in enumerate(hosts)}
    shape = {h: (tuple(sorted(str(r.device_kind) for r in rs)), len(rs)) for h, rs in by_host.items()}
    shapes = list(dict.fromkeys(shape[h] for h in hosts))
    group_of = {h: shapes.index(shape[h]) for h in hosts}

    info: dict = {}  # rank -> its entry (the first, as Profile.rank finds it)
    for r in profile.ranks:
        info.setdefault(r.rank, r)
    pair = _undirected_links(profile)
    # one pass over the pairs: inside a host (its fabric), or across hosts (each end's NIC)
    intra, inter, within, off = [], [], {}, {}
    for (a, b), v in pair.items():
        ha, hb = info[a].host, info[b].host
        if ha == hb:
            intra.append(v)
            within.setdefault(ha, []).append(v["bandwidth_bytes_per_s"])
        else:
            inter.append(v)
            off.setdefault(a, []).append(v["bandwidth_bytes_per_s"])
            off.setdefault(b, []).append(v["bandwidth_bytes_per_s"])
    intra_lat = statistics.median(v["latency_s"] for v in intra) if intra else 2e-6
    inter_lat = statistics.median(v["latency_s"] for v in inter) if inter else 10e-6

    g = nx.Graph(name=f"profile:{profile.model.name}", intra_node_latency_s=intra_lat,
                 inter_node_latency_s=inter_lat, source="profile")
    for gi in range(len(shapes)):
        g.add_node(("group", gi))
    for a in range(len(shapes)):
        for b in range(a + 1, len(shapes)):
            g.add_edge(("group", a), ("group", b), bandwidth_bytes_per_s=float("inf"), latency_s=0.0,
                       kind="inter_group")
    iface_speed = {h.name: max((i.get("speed_bytes_per_s") or 0.0 for i in h.interfaces), default=0.0)
                   for h in profile.provenance.hosts}
    for h in hosts:
        n = host_index[h]
        ranks = [r.rank for r in by_host[h]]
        # a device's NIC: its fastest measured link off the host, else the host's fastest interface
        speed = iface_speed.get(h, 0.0)
        nics = [max(off[r]) if r in off else speed if speed > 0 else float("inf") for r in ranks]
        intra_bw = within.get(h, [])
        g.add_node(("host", n), group=group_of[h], name=h, nic_count=1, domain=n,
                   nic_bandwidth_bytes_per_s=max(nics), nic_kind="measured",
                   intra_node_bandwidth_bytes_per_s=statistics.median(intra_bw) if intra_bw else float("inf"))
        g.add_edge(("host", n), ("group", group_of[h]), bandwidth_bytes_per_s=max(nics),
                   latency_s=inter_lat / 2, kind="uplink")
        for r, nic in zip(ranks, nics):
            e = info[r]
            g.add_node(r, node=n, domain=n, group=group_of[h], device=e.device_kind or e.device_name,
                       memory_bytes=e.memory_bytes, host=h, local_rank=e.local_rank)
            g.add_edge(r, ("host", n), bandwidth_bytes_per_s=nic, latency_s=inter_lat / 2, kind="nic")
    for (a, b), v in pair.items():
        g.add_edge(a, b, kind="measured", **v)
    return g


def ranks_by_host(profile: Profile) -> dict:
    """{host name: its rank entries, in the profile's order}, hosts in the order of their first
    rank (the cluster's host order). One pass over the ranks, whatever their number."""
    out: dict = {r.host: [] for r in sorted(profile.ranks, key=lambda r: r.rank)}
    for r in profile.ranks:
        out[r.host].append(r)
    return out


def overlay_measured_links(graph, profile: Profile):
    """A copy of a cluster file's graph with the profile's measured links over the declared ones.

    The profile's hosts are matched to the cluster's in order (its i-th host, by first rank, is
    the cluster's i-th host) and its ranks to the host's devices by local rank
    (:func:`measured_device_links`). Each measured pair whose both ends map onto the cluster
    becomes a ``measured`` edge, which ``Topology.p2p`` prefers to the declared link; pairs the
    profile did not measure keep the declared figures (a profile of one node measures its
    intra-node links, and the cluster file still declares the network between nodes). Returns
    (graph, number of pairs overlaid).
    """
    devices_of: dict[int, list[int]] = {}
    for d, attrs in graph.nodes(data=True):
        if isinstance(d, int):
            devices_of.setdefault(attrs["node"], []).append(d)
    links, n = measured_device_links(devices_of, profile)
    g = graph.copy()
    for (a, b), v in links.items():
        g.add_edge(a, b, kind="measured", **v)
    g.graph["measured_pairs"] = n
    return g, n


def measured_device_links(devices_of: dict, profile: Profile) -> tuple[dict, int]:
    """The profile's measured pairs on a cluster's devices, as :func:`overlay_measured_links` lays
    them: ({(device, device): {"bandwidth_bytes_per_s", "latency_s"}}, pairs mapped).
    ``devices_of``: each host's devices (by the host's index in the cluster); the profile's i-th
    host (by first rank) is the cluster's i-th, its ranks the host's devices by local rank.
    Linear in the profile and the hosts it names (``Topology.with_measured`` takes the result
    without a graph)."""
    to_device = {}
    for hi, (h, ranks) in enumerate(ranks_by_host(profile).items()):
        devs = sorted(devices_of.get(hi, []))
        for r in ranks:
            if r.local_rank < len(devs):
                to_device[r.rank] = devs[r.local_rank]
    out, n = {}, 0
    for (a, b), v in _undirected_links(profile).items():
        if a in to_device and b in to_device and to_device[a] != to_device[b]:
            out[(to_device[a], to_device[b])] = {"bandwidth_bytes_per_s": v["bandwidth_bytes_per_s"],
                                                 "latency_s": v["latency_s"]}
            n += 1
    return out, n


def _undirected_links(profile: Profile) -> dict:
    out = {}
    for e in profile.links:
        a, b = min(e.src, e.dst), max(e.src, e.dst)
        v = out.setdefault((a, b), {"bandwidth_bytes_per_s": float("inf"), "latency_s": 0.0,
                                    "bandwidth_by_direction_bytes_per_s": {}})
        v["bandwidth_bytes_per_s"] = min(v["bandwidth_bytes_per_s"], e.bandwidth_bytes_per_s)
        v["latency_s"] = max(v["latency_s"], e.latency_s)
        v["bandwidth_by_direction_bytes_per_s"][(e.src, e.dst)] = e.bandwidth_bytes_per_s
    return out
