"""ClusterSpec: node groups, devices, links; and the networkx graph the cost model reads.

A YAML cluster file (see ``examples/clusters/``) becomes a :class:`ClusterSpec`; ``graph()`` turns
it into a graph whose nodes are devices (ints, with ``node``/``group``/``device`` attributes) and
hosts (``("host", n)``) and whose edges carry ``bandwidth_bytes_per_s`` and ``latency_s``:

- device -- host: one NIC's bandwidth, the most a single device can push off the host. The
  intra-node fabric (NVLink/NVSwitch; shared memory on CPU) is the host's
  ``intra_node_bandwidth_bytes_per_s`` (per device, per direction) and the graph's
  ``intra_node_latency_s``: two devices of one host talk at those figures (``Topology.p2p``),
  with no device--device edge (a clique would hold N x (N - 1) / 2 edges per host: 33.5 million
  for 64 hosts of 1,024 devices);
- host -- ("group", g): all the host's NICs together;
- ("group", g) -- ("group", g'): the optional inter-group cap;
- device -- ("nvlink", k): where a node group's ``nvlink_domain`` joins several consecutive hosts
  on one NVLink fabric (a GB200 NVL72 rack: 18 hosts of 4 GPUs), the intra-node fabric between
  the devices of different hosts of domain k (k its first host); devices and hosts carry
  ``domain`` = k. Devices of one domain talk at the intra-node bandwidth and latency, as inside a
  host; between domains the NICs carry the traffic as between hosts. ``topology.Topology`` treats a
  domain as one host for every bandwidth question; the launch files still see the real hosts.

A profile adds measured device--device edges (``kind="measured"``), which ``Topology`` prefers.
The cost model reads the spec without this graph (``Topology.of_cluster``: the same answers in
O(devices)); the graph is for the profile overlay and for tools that walk links.

A node group may name its hosts (``hosts: [gpu-a1, gpu-a2]``, one per node, in rank order); the
others are ``node-K`` (K the host's index in the cluster). The launch files (``autoconf.launch.emit``)
write the names into each host's script; a name may not appear twice.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from autoconf.errors import UserError
from autoconf.specs.devices import deployed_name, device_type
from autoconf.specs.measured_graph import ranks_by_host, topology_graph
from autoconf.specs.schema import Dict, Int, List, Null, Num, Quantity, Str, check_kind, checked, load_yaml, schema_of

# -- ranges shared by the YAML schema (quantities written with units, below) and the SI one
# (ClusterSpec.to_dict's form: the dataclasses' fields) ----------------------------------------------

MAX_DEVICES = 1 << 20
"""Devices in one cluster file (the largest clusters built by 2026 hold ~100k-200k GPUs, and
``plan`` may find the shortest time past that): the cost model's topology is linear in the devices
(at this bound 0.7 s and 0.1 GB in hosts of 8, 4.3 s and 0.5 GB in hosts of 1); the networkx graph is built only for small clusters.
``plan``'s own sweeps are not bounded by it (``timetotrain.synthetic``)."""
BANDWIDTH = ("bytes_per_s", 1e3, 1e15)     # 1 kB/s .. 1 PB/s, per direction
LATENCY = ("seconds", 0.0, 1.0)            # 0 .. 1 s
MEMORY = ("bytes", float(1 << 20), float(1 << 50))  # 1 MiB .. 1 PiB per device
POWER = ("watts", 1.0, 1e5)                # a board power cap: 1 W .. 100 kW
CLOCK = ("hertz", 1e6, 1e11)               # a sustained clock: 1 MHz .. 100 GHz


def _quantity(kind, lo, hi):
    """A person writes it with a unit ("300 GB/s")."""
    return Quantity(kind, lo, hi)


def _si(kind, lo, hi):
    """A machine wrote it in SI (the field name carries the unit: ``*_bytes_per_s``)."""
    return Num(lo, hi)


HOSTS_SCHEMA = List(Str(max_len=253, nonempty=True), min_len=1, max_len=MAX_DEVICES)
"""Host names of a group's nodes (one per node, in rank order), e.g. [gpu-a1, gpu-a2]."""


@dataclass(frozen=True)
class NodeGroup:
    count: int = checked(Int(1, MAX_DEVICES))
    """Number of identical nodes (hosts)."""
    device: str = checked(Str(max_len=160))
    """Catalog name of the accelerator (or 'cpu'); as deployed where the cluster file states a
    power cap, clock or HBM bandwidth (``specs.devices.deployed_name``)."""
    gpus_per_node: int = checked(Int(1, 1024))
    intra_node_bandwidth_bytes_per_s: float = checked(_si(*BANDWIDTH))
    """Per device, per direction."""
    nic_count: int = checked(Int(1, 256), 1)
    nic_bandwidth_bytes_per_s: float = checked(_si(*BANDWIDTH), 12.5e9)
    """Per NIC, per direction."""
    nic_kind: str = checked(Str(max_len=64), "infiniband")
    memory_bytes: float | None = checked(Null(_si(*MEMORY)), None)
    """Overrides the catalog's device memory (e.g. a share of host RAM for CPU processes)."""
    hosts: tuple | None = checked(Null(HOSTS_SCHEMA), None)
    """Host names of the group's nodes, in rank order (``count`` of them); None: ``node-K``."""
    nvlink_domain: int = checked(Int(1, MAX_DEVICES), 1)
    """Consecutive hosts of the group that share one NVLink fabric (18 in a GB200 NVL72 rack);
    1: each host's fabric is its own. Divides ``count``."""
    fabric: str | None = checked(Null(Str(max_len=64, nonempty=True)), None)
    """The network the group's NICs are on: groups naming the same fabric reach each other at
    their NICs' speed, without ``inter_group_bandwidth``'s cap (a cluster listed out of order,
    its InfiniBand nodes in two groups). None: a fabric of the group's own."""

    @property
    def device_memory_bytes(self) -> float:
        return self.memory_bytes if self.memory_bytes is not None else device_type(self.device).memory_bytes


SI_GROUP_SCHEMA = schema_of(NodeGroup, "a node group")


@dataclass(frozen=True)
class ClusterSpec:
    name: str = checked(Str(max_len=200))
    node_groups: tuple = checked(List(SI_GROUP_SCHEMA, min_len=1, max_len=256))
    intra_node_latency_s: float = checked(_si(*LATENCY), 2e-6)
    inter_node_latency_s: float = checked(_si(*LATENCY), 10e-6)
    inter_group_bandwidth_bytes_per_s: float | None = checked(Null(_si(*BANDWIDTH)), None)
    """Optional cap on any path between two node groups that are not on one ``fabric``."""
    _graph_cache: dict = field(default_factory=dict, init=False, compare=False, repr=False, hash=False)

    def group_cap(self, a: int, b: int) -> float:
        """The cap on a path between node groups ``a`` and ``b`` (inf: none):
        ``inter_group_bandwidth`` unless both name one ``fabric``."""
        fa, fb = self.node_groups[a].fabric, self.node_groups[b].fabric
        if fa is not None and fa == fb:
            return float("inf")
        return self.inter_group_bandwidth_bytes_per_s or float("inf")

    @property
    def num_nodes(self) -> int:
        return sum(g.count for g in self.node_groups)

    @property
    def num_devices(self) -> int:
        return sum(g.count * g.gpus_per_node for g in self.node_groups)

    def device_kinds(self) -> list[str]:
        return sorted({g.device for g in self.node_groups})

    def nodes(self) -> list[tuple[int, NodeGroup]]:
        """(group index, group) for each host, in rank order."""
        return [(gi, g) for gi, g in enumerate(self.node_groups) for _ in range(g.count)]

    def host_names(self) -> list[str]:
        """Each host's name in rank order: the group's ``hosts`` where given, else ``node-K``
        (K the host's index in the cluster)."""
        out = []
        for grp in self.node_groups:
            k = len(out)
            out += list(grp.hosts) if grp.hosts else [f"node-{k + i}" for i in range(grp.count)]
        return out

    def domains(self) -> list[int]:
        """Each host's NVLink domain in rank order, numbered by the domain's first host (the host
        itself where its group's ``nvlink_domain`` is 1)."""
        out = []
        for grp in self.node_groups:
            k = len(out)
            out += [k + i // grp.nvlink_domain * grp.nvlink_domain for i in range(grp.count)]
        return out

    def host_attrs(self) -> list[dict]:
        """Each host's attributes in rank order, as ``graph()`` puts them on ``("host", n)``:
        group, name, NICs, intra-node fabric, domain (``Topology.of_cluster`` reads the same
        figures off the node groups, a group at a time)."""
        names, domains = self.host_names(), self.domains()
        return [dict(group=gi, name=names[n], nic_count=grp.nic_count, nic_bandwidth_bytes_per_s=grp.nic_bandwidth_bytes_per_s,
                     nic_kind=grp.nic_kind, intra_node_bandwidth_bytes_per_s=grp.intra_node_bandwidth_bytes_per_s,
                     domain=domains[n])
                for n, (gi, grp) in enumerate(self.nodes())]

    def graph(self):
        """The cluster as a networkx graph (built once per spec)."""
        if "g" not in self._graph_cache:
            self._graph_cache["g"] = _build_graph(self)
        return self._graph_cache["g"]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("_graph_cache")
        for g in d["node_groups"]:  # written only where given (files without hosts stay as they were)
            if g["hosts"] is None:
                g.pop("hosts")
            else:
                g["hosts"] = list(g["hosts"])
            if g["nvlink_domain"] == 1:
                g.pop("nvlink_domain")
            if g["fabric"] is None:
                g.pop("fabric")
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ClusterSpec":
        """From :meth:`to_dict`'s form (SI numbers), checked against ``SI_CLUSTER_SCHEMA``."""
        try:
            d = SI_CLUSTER_SCHEMA(d)
            _check_groups(d["node_groups"])
        except UserError as e:
            raise UserError(f"cluster: {e}") from None
        d["node_groups"] = tuple(NodeGroup(**{**g, "hosts": tuple(g["hosts"]) if g.get("hosts") else None})
                                 for g in d["node_groups"])
        return cls(**d)


SI_CLUSTER_SCHEMA = schema_of(ClusterSpec, "a cluster")


def _build_graph(spec: ClusterSpec):
    import networkx as nx

    g = nx.Graph(name=spec.name, intra_node_latency_s=spec.intra_node_latency_s,
                 inter_node_latency_s=spec.inter_node_latency_s)
    dev = 0
    for gi, _ in enumerate(spec.node_groups):
        g.add_node(("group", gi))
    for a in range(len(spec.node_groups)):
        for b in range(a + 1, len(spec.node_groups)):
            cap = spec.group_cap(a, b)
            g.add_edge(("group", a), ("group", b), bandwidth_bytes_per_s=cap, latency_s=0.0, kind="inter_group")
    memory = [grp.device_memory_bytes for grp in spec.node_groups]  # (a catalog look-up: once per group)
    for n, ((gi, grp), attrs) in enumerate(zip(spec.nodes(), spec.host_attrs())):
        domain = attrs["domain"]
        host = ("host", n)
        g.add_node(host, **attrs)
        g.add_edge(host, ("group", gi), bandwidth_bytes_per_s=grp.nic_count * grp.nic_bandwidth_bytes_per_s,
                   latency_s=spec.inter_node_latency_s / 2, kind="uplink")
        for i in range(dev, dev + grp.gpus_per_node):
            g.add_node(i, node=n, group=gi, device=grp.device, memory_bytes=memory[gi], domain=domain)
            g.add_edge(i, host, bandwidth_bytes_per_s=grp.nic_bandwidth_bytes_per_s,
                       latency_s=spec.inter_node_latency_s / 2, kind="nic")
            if grp.nvlink_domain > 1:  # the domain's switch fabric (one edge per device, not per pair)
                g.add_edge(i, ("nvlink", domain), bandwidth_bytes_per_s=grp.intra_node_bandwidth_bytes_per_s,
                           latency_s=spec.intra_node_latency_s / 2, kind="nvlink")
        dev += grp.gpus_per_node
    return g


# -- the YAML schema (quantities written with units) -------------------------------------------

NIC_SCHEMA = Dict(optional={"count": Int(1, 256), "bandwidth": _quantity(*BANDWIDTH), "kind": Str(max_len=64)},
                  what="nics, like {count: 8, bandwidth: 200 Gbit/s, kind: infiniband}")
GROUP_SCHEMA = Dict(
    required={"count": Int(1, MAX_DEVICES), "device": Str(max_len=64), "gpus_per_node": Int(1, 1024),
              "intra_node_bandwidth": _quantity(*BANDWIDTH)},
    optional={"nics": Null(NIC_SCHEMA), "memory": _quantity(*MEMORY), "hosts": Null(HOSTS_SCHEMA),
              "nvlink_domain": Int(1, MAX_DEVICES), "power_cap": _quantity(*POWER),
              "clock": _quantity(*CLOCK), "memory_bandwidth": _quantity(*BANDWIDTH),
              "fabric": Null(Str(max_len=64, nonempty=True))},
    what="a node group")
DEPLOYED = {"power_cap": "power_cap_w", "clock": "clock_hz", "memory_bandwidth": "memory_bandwidth_bytes_per_s"}
"""A node group's fields that state its devices as deployed (``specs.devices.deployed_name``)."""
LATENCY_SCHEMA = Dict(optional={"intra_node": _quantity(*LATENCY), "inter_node": _quantity(*LATENCY)},
                      what="latency, like {intra_node: 2 us, inter_node: 10 us}")
CLUSTER_SCHEMA = Dict(
    required={"node_groups": List(GROUP_SCHEMA, min_len=1, max_len=256)},
    optional={"name": Str(max_len=200), "inter_group_bandwidth": Null(_quantity(*BANDWIDTH)),
              "latency": Null(LATENCY_SCHEMA)},
    what="a cluster")


def _check_devices(groups) -> None:
    for g in groups:
        device_type(g["device"])  # a UserError naming the valid devices
    total = sum(g["count"] * g["gpus_per_node"] for g in groups)
    if total > MAX_DEVICES:
        raise UserError(f"{total:,} devices in all; at most {MAX_DEVICES:,}")


HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,252}")
"""A host name or address as launch scripts may carry it; always matched whole
(:func:`is_host_name`: ``re.match`` with ``$`` would let a trailing newline through)."""


def is_host_name(name) -> bool:
    """Whether ``name`` is a host name or address of letters, digits, '.', '-', '_' and ':' (at most
    253 characters, starting with a letter or digit), matched whole: no control character, no
    trailing newline, nothing a shell would read."""
    return isinstance(name, str) and HOST_RE.fullmatch(name) is not None


def _check_groups(groups) -> None:
    """What the schema cannot say of the node groups: devices in the catalog and within bounds,
    host names, NVLink domains."""
    _check_devices(groups)
    _check_hosts(groups)
    _check_domains(groups)


def _check_hosts(groups) -> None:
    """Each group's ``hosts``: one name per node, a host name or address (letters, digits, '.',
    '-', '_', ':'; they go into shell scripts), no name twice in the cluster (defaults included)."""
    seen: dict = {}
    k = 0
    for gi, g in enumerate(groups):
        hosts = g.get("hosts")
        if hosts is not None and len(hosts) != g["count"]:
            raise UserError(f"node_groups[{gi}].hosts: {len(hosts)} name(s) for count {g['count']}; "
                            "give one host name per node")
        for i in range(g["count"]):
            name = hosts[i] if hosts else f"node-{k + i}"
            if hosts and not is_host_name(name):
                raise UserError(f"node_groups[{gi}].hosts[{i}]={name!r} is not a host name or address; use "
                                "letters, digits, '.', '-', '_' and ':' (starting with a letter or digit)")
            if name in seen:
                raise UserError(f"node_groups[{gi}].hosts: host {name!r} appears twice (also {seen[name]}); "
                                "each node needs its own name")
            seen[name] = f"node_groups[{gi}]" + (f".hosts[{i}]" if hosts else f", default name of node {k + i}")
        k += g["count"]


def _check_domains(groups) -> None:
    """Each group's ``nvlink_domain``: hosts per NVLink fabric, dividing the group's ``count``;
    only for accelerators (CPU processes of two hosts share no fabric)."""
    for gi, g in enumerate(groups):
        k = g.get("nvlink_domain", 1)
        if g["count"] % k:
            raise UserError(f"node_groups[{gi}].nvlink_domain={k} does not divide count {g['count']}; give a "
                            "positive integer that divides it (hosts per NVLink fabric, e.g. 18 for GB200 NVL72; "
                            "1: each host alone)")
        if k > 1 and device_type(g["device"]).sm_count == 0:
            raise UserError(f"node_groups[{gi}].nvlink_domain={k} on device {g['device']!r}: only GPUs share an "
                            "NVLink fabric across hosts; use 1")


def cluster_from_mapping(data: object, where: str = "cluster") -> ClusterSpec:
    """Build a ClusterSpec from the YAML schema (quantities with units), checked strictly."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a mapping with 'node_groups', got {type(data).__name__}")
    if "node_groups" in data and isinstance(data["node_groups"], list) and not data["node_groups"]:
        raise UserError(f"{where}: 'node_groups' must be a non-empty list")
    try:
        d = CLUSTER_SCHEMA(data)
        _check_groups(d["node_groups"])
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    out = []
    for i, g in enumerate(d["node_groups"]):
        nics = g.get("nics") or {}
        device = deployed_name(g["device"], **{f: g[k] for k, f in DEPLOYED.items() if k in g})
        try:
            device_type(device)  # a power cap the device cannot take, a clock it has no base for
        except UserError as e:
            raise UserError(f"{where}: node_groups[{i}]: {e}") from None
        out.append(NodeGroup(
            count=g["count"], device=device, gpus_per_node=g["gpus_per_node"],
            intra_node_bandwidth_bytes_per_s=g["intra_node_bandwidth"],
            nic_count=nics.get("count", 1),
            nic_bandwidth_bytes_per_s=nics.get("bandwidth", 100e9 / 8),
            nic_kind=nics.get("kind", "infiniband"),
            memory_bytes=g.get("memory"),
            hosts=tuple(g["hosts"]) if g.get("hosts") else None,
            nvlink_domain=g.get("nvlink_domain", 1),
            fabric=g.get("fabric"),
        ))
    lat = d.get("latency") or {}
    return ClusterSpec(
        name=d.get("name", "cluster"),
        node_groups=tuple(out),
        intra_node_latency_s=lat.get("intra_node", 2e-6),
        inter_node_latency_s=lat.get("inter_node", 10e-6),
        inter_group_bandwidth_bytes_per_s=d.get("inter_group_bandwidth"),
    )


def load_cluster(path: str) -> ClusterSpec:
    import os


    if not os.path.exists(path):
        raise UserError(f"cluster file {path!r} does not exist (see examples/clusters/ for the format)")
    data = load_yaml(path, "cluster file")
    check_kind(data, path, ("cluster",))
    return cluster_from_mapping(data, where=os.path.basename(path))


def cluster_from_profile(profile) -> ClusterSpec:
    """The cluster a profile measured, as a ClusterSpec: its hosts in rank order (named as the
    profile recorded them), each host's ranks as its devices, consecutive hosts of the same device
    kind and size in one node group, and the measured links' figures (median intra-node bandwidth,
    each host's fastest link off it as its NIC). What the launch files need; the cost model reads
    the profile's own graph."""
    import statistics


    g = topology_graph(profile)
    by_host = ranks_by_host(profile)
    groups: list[dict] = []
    for i, (h, ranks) in enumerate(by_host.items()):
        ranks = sorted(ranks, key=lambda r: r.local_rank)
        kind = ranks[0].device_kind
        if kind is None or any(r.device_kind != kind for r in ranks):
            raise UserError(f"profile host {h!r} has devices outside the catalog or of several kinds "
                            f"({', '.join(sorted({str(r.device_kind or r.device_name) for r in ranks}))}): "
                            "give --cluster FILE to describe it")
        if not is_host_name(h):
            raise UserError(f"profile host name {h!r} cannot go into a launch script (letters, digits, '.', '_', "
                            "'-' and ':' only): give --cluster FILE with its hosts named")
        a = g.nodes[("host", i)]
        intra = a["intra_node_bandwidth_bytes_per_s"]
        nic = a["nic_bandwidth_bytes_per_s"]
        key = (kind, len(ranks))
        if groups and groups[-1]["key"] == key:
            groups[-1]["hosts"].append(h)
            groups[-1]["memory"] = min(groups[-1]["memory"], min(r.memory_bytes for r in ranks))
            groups[-1]["intra"].append(intra)
            groups[-1]["nic"].append(nic)
            continue
        groups.append({"key": key, "hosts": [h], "intra": [intra], "nic": [nic],
                       "memory": min(r.memory_bytes for r in ranks)})
    finite = lambda xs, default: statistics.median(x for x in xs if x != float("inf")) \
        if any(x != float("inf") for x in xs) else default  # noqa: E731
    node_groups = tuple(NodeGroup(
        count=len(gr["hosts"]), device=gr["key"][0], gpus_per_node=gr["key"][1],
        intra_node_bandwidth_bytes_per_s=finite(gr["intra"], 1e12), nic_count=1,
        nic_bandwidth_bytes_per_s=finite(gr["nic"], 12.5e9), nic_kind="measured",
        memory_bytes=gr["memory"] or None, hosts=tuple(gr["hosts"])) for gr in groups)
    return ClusterSpec(name=f"profiled-{len(by_host)}-hosts", node_groups=node_groups,
                       intra_node_latency_s=g.graph["intra_node_latency_s"],
                       inter_node_latency_s=g.graph["inter_node_latency_s"])

