"""ClusterSpec: node groups, devices, links; and the networkx graph the cost model reads.

A YAML cluster file (see ``examples/clusters/``) becomes a :class:`ClusterSpec`; ``graph()`` turns
it into a graph whose nodes are devices (ints, with ``node``/``group``/``device`` attributes) and
hosts (``("host", n)``) and whose edges carry ``bandwidth_bytes_per_s`` and ``latency_s``:

- device -- device inside a host: the intra-node fabric (NVLink/NVSwitch; shared memory on CPU);
- device -- host: one NIC's bandwidth, the most a single device can push off the host;
- host -- ("group", g): all the host's NICs together;
- ("group", g) -- ("group", g'): the optional inter-group cap.

A profile replaces device--device edges with measured ones (``kind="measured"``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .catalog import device_type
from .errors import UserError
from .units import parse_quantity


@dataclass(frozen=True)
class NodeGroup:
    count: int
    """Number of identical nodes (hosts)."""
    device: str
    """Catalog name of the accelerator (or 'cpu')."""
    gpus_per_node: int
    intra_node_bandwidth_bytes_per_s: float
    """Per device, per direction."""
    nic_count: int = 1
    nic_bandwidth_bytes_per_s: float = 12.5e9
    """Per NIC, per direction."""
    nic_kind: str = "infiniband"
    memory_bytes: float | None = None
    """Overrides the catalog's device memory (e.g. a share of host RAM for CPU processes)."""

    @property
    def device_memory_bytes(self) -> float:
        return self.memory_bytes if self.memory_bytes is not None else device_type(self.device).memory_bytes


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    node_groups: tuple
    intra_node_latency_s: float = 2e-6
    inter_node_latency_s: float = 10e-6
    inter_group_bandwidth_bytes_per_s: float | None = None
    """Optional cap on any path between two node groups."""
    _graph_cache: dict = field(default_factory=dict, init=False, compare=False, repr=False, hash=False)

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

    def graph(self):
        """The cluster as a networkx graph (built once per spec)."""
        if "g" not in self._graph_cache:
            self._graph_cache["g"] = _build_graph(self)
        return self._graph_cache["g"]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("_graph_cache")
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ClusterSpec":
        d = dict(d)
        d.pop("_graph_cache", None)
        d["node_groups"] = tuple(NodeGroup(**g) for g in d["node_groups"])
        return cls(**d)


def _build_graph(spec: ClusterSpec):
    import networkx as nx

    g = nx.Graph(name=spec.name, intra_node_latency_s=spec.intra_node_latency_s,
                 inter_node_latency_s=spec.inter_node_latency_s)
    dev = 0
    for gi, _ in enumerate(spec.node_groups):
        g.add_node(("group", gi))
    for a in range(len(spec.node_groups)):
        for b in range(a + 1, len(spec.node_groups)):
            cap = spec.inter_group_bandwidth_bytes_per_s or float("inf")
            g.add_edge(("group", a), ("group", b), bandwidth_bytes_per_s=cap, latency_s=0.0, kind="inter_group")
    for n, (gi, grp) in enumerate(spec.nodes()):
        host = ("host", n)
        g.add_node(host, group=gi, nic_count=grp.nic_count, nic_bandwidth_bytes_per_s=grp.nic_bandwidth_bytes_per_s,
                   nic_kind=grp.nic_kind, intra_node_bandwidth_bytes_per_s=grp.intra_node_bandwidth_bytes_per_s)
        g.add_edge(host, ("group", gi), bandwidth_bytes_per_s=grp.nic_count * grp.nic_bandwidth_bytes_per_s,
                   latency_s=spec.inter_node_latency_s / 2, kind="uplink")
        local = list(range(dev, dev + grp.gpus_per_node))
        for i in local:
            g.add_node(i, node=n, group=gi, device=grp.device, memory_bytes=grp.device_memory_bytes)
            g.add_edge(i, host, bandwidth_bytes_per_s=grp.nic_bandwidth_bytes_per_s,
                       latency_s=spec.inter_node_latency_s / 2, kind="nic")
        for x in local:
            for y in local:
                if x < y:
                    g.add_edge(x, y, bandwidth_bytes_per_s=grp.intra_node_bandwidth_bytes_per_s,
                               latency_s=spec.intra_node_latency_s, kind="intra")
        dev += grp.gpus_per_node
    return g


_GROUP_KEYS = {"count", "device", "gpus_per_node", "intra_node_bandwidth", "nics", "memory"}
_TOP_KEYS = {"name", "node_groups", "inter_group_bandwidth", "latency"}


def cluster_from_mapping(data: object, where: str = "cluster") -> ClusterSpec:
    """Build a ClusterSpec from the YAML schema (quantities with units)."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a mapping with 'node_groups', got {type(data).__name__}")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(_TOP_KEYS))}")
    groups = data.get("node_groups")
    if not isinstance(groups, list) or not groups:
        raise UserError(f"{where}: 'node_groups' must be a non-empty list")
    out = []
    for i, g in enumerate(groups):
        w = f"{where}: node_groups[{i}]"
        if not isinstance(g, dict):
            raise UserError(f"{w} must be a mapping")
        unknown = sorted(set(g) - _GROUP_KEYS)
        if unknown:
            raise UserError(f"{w}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(_GROUP_KEYS))}")
        for k in ("count", "device", "gpus_per_node", "intra_node_bandwidth"):
            if k not in g:
                raise UserError(f"{w}: missing '{k}'")
        for k in ("count", "gpus_per_node"):
            if not isinstance(g[k], int) or isinstance(g[k], bool) or g[k] <= 0:
                raise UserError(f"{w}: {k}={g[k]!r} must be a positive integer")
        device_type(str(g["device"]))  # validates the name
        nics = g.get("nics", {}) or {}
        if not isinstance(nics, dict):
            raise UserError(f"{w}: nics must be a mapping like {{count: 8, bandwidth: 200 Gbit/s}}")
        nic_count = nics.get("count", 1)
        if not isinstance(nic_count, int) or nic_count <= 0:
            raise UserError(f"{w}: nics.count={nic_count!r} must be a positive integer")
        out.append(NodeGroup(
            count=g["count"], device=str(g["device"]), gpus_per_node=g["gpus_per_node"],
            intra_node_bandwidth_bytes_per_s=_positive(g["intra_node_bandwidth"], "bytes_per_s", f"{w}.intra_node_bandwidth"),
            nic_count=nic_count,
            nic_bandwidth_bytes_per_s=_positive(nics.get("bandwidth", "100 Gbit/s"), "bytes_per_s", f"{w}.nics.bandwidth"),
            nic_kind=str(nics.get("kind", "infiniband")),
            memory_bytes=_positive(g["memory"], "bytes", f"{w}.memory") if "memory" in g else None,
        ))
    lat = data.get("latency", {}) or {}
    if not isinstance(lat, dict):
        raise UserError(f"{where}: latency must be a mapping like {{intra_node: 2 us, inter_node: 10 us}}")
    cap = data.get("inter_group_bandwidth")
    return ClusterSpec(
        name=str(data.get("name", "cluster")),
        node_groups=tuple(out),
        intra_node_latency_s=parse_quantity(lat.get("intra_node", "2 us"), "seconds", f"{where}: latency.intra_node"),
        inter_node_latency_s=parse_quantity(lat.get("inter_node", "10 us"), "seconds", f"{where}: latency.inter_node"),
        inter_group_bandwidth_bytes_per_s=_positive(cap, "bytes_per_s", f"{where}: inter_group_bandwidth") if cap is not None else None,
    )


def _positive(value, kind, what) -> float:
    v = parse_quantity(value, kind, what)
    if v <= 0:
        raise UserError(f"{what}: {value!r} must be greater than zero")
    return v


def load_cluster(path: str) -> ClusterSpec:
    import os

    from .model import load_yaml

    if not os.path.exists(path):
        raise UserError(f"cluster file {path!r} does not exist (see examples/clusters/ for the format)")
    import os.path as osp
    return cluster_from_mapping(load_yaml(path), where=osp.basename(path))
