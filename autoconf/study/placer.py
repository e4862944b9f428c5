"""Placement search: which devices run each pipeline stage and group, and how many layers each stage gets.

``autoconf search`` asks a :class:`Placer` for every configuration it evaluates, and lets it
improve the best few. Two steps, both priced by the cost model (``cost.estimate``):

1. **Graph heuristics** (:meth:`Placer.place`, cheap enough for every evaluated configuration).
   The link graph is analysed once with networkx:

   - *tensor-parallel domains*: inside each host, the maximal cliques (``nx.find_cliques``) of
     its fastest links; a host's devices are listed clique by clique, so consecutive ranks of a
     tensor-parallel group share the fastest fabric;
   - *islands*: the maximum spanning tree of the host graph (``nx.maximum_spanning_tree``, edge
     weight the bandwidth between two hosts), cut level by level from its slowest edges
     (single-linkage clustering): hosts joined by fast links form an island, and the slowest
     links of the cluster separate the top-level islands. Devices are listed island by island.
     The rank order's outer axis, the pipeline, then takes consecutive blocks of that list: stage
     boundaries fall on the slowest cuts, and a stage that fits in an island keeps its
     data-parallel groups on one NIC kind (as Holmes does, arXiv 2312.03549);
   - the order never depends on the cluster file's: islands and hosts are sorted by what they
     are (device speed, size, link speed, NIC kind and speed), and only devices that are
     interchangeable are ordered by their number.

   Layers per stage (per chunk with virtual stages): proportional to the speed of the stage's
   slowest device, i.e. the split that minimises the busiest stage's work -- its blocks at the
   measured (profile) or datasheet (roofline) layer time of that device, plus the embedding on
   the first and the output layer on the last stage (``System.block`` / ``System.edge``).
   Where every stage is equally fast the even split stays (``stage_layers=None``), and where
   the order is the cluster file's the default order stays (``device_order=None``): on a
   homogeneous cluster the heuristic changes nothing.

2. **Local search** (:meth:`Placer.improve`, for the best configurations): hill climbing on the
   cost model's step time, moves tried in a fixed order over positions (never over device
   numbers, so the result does not depend on the file's order either):

   - swap the devices of two pipeline stages (stages at the ends of runs of equally built
     stages), and swap one tensor-parallel group's devices between two differently built stages
     (each with the current layer split, and with the split re-derived for the new stages);
   - shift one layer between adjacent chunks (runtimes that can run uneven stages: the
     reference trainer).

   A move is kept when the configuration still fits and its step time drops; the bound of the
   search (``cost.estimate.estimate_on(bound=...)``) skips moves whose least possible work is
   already slower.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from dataclasses import dataclass

from autoconf.cost.estimate import estimate_on
from autoconf.cost.moe import block_for
from autoconf.cost.tensor_parallel import tp_times
from autoconf.space.config import ParallelConfig, module_key
from autoconf.space.placement import Placement, even_layers
from autoconf.specs.devices import device_type

_FULL_GRAPH_HOSTS = 256
"""Up to this many hosts the host graph is complete; beyond, hosts of one node group (whose links
to each other are all alike) are chained and the groups joined through their first hosts."""


@dataclass(frozen=True)
class StageInfo:
    """Where one pipeline stage runs."""

    stage: int
    hosts: tuple
    """Host names (in rank order of first appearance)."""
    devices: tuple
    """Device numbers (the cluster's numbering)."""
    kinds: tuple
    """(device kind, count) pairs."""
    layers: int
    """Transformer blocks on the stage (all its chunks)."""
    chunk_layers: tuple

    def to_dict(self) -> dict:
        return {"stage": self.stage, "hosts": list(self.hosts), "devices": list(self.devices),
                "kinds": {k: n for k, n in self.kinds}, "layers": self.layers,
                "chunk_layers": list(self.chunk_layers)}


def describe(system, config: ParallelConfig) -> list[StageInfo]:
    """Each pipeline stage's hosts, devices, device kinds and layers under ``config``'s placement."""
    topo = system.topology
    place = Placement.of(config, system.model.num_layers)
    counts = place.chunk_layer_counts()
    out = []
    for s, devs in enumerate(place.stage_devices()):
        hosts = list(dict.fromkeys(topo.host_name[topo.node_of[d]] for d in devs))
        kinds: dict = {}
        for d in devs:
            kinds[topo.kind_of[d]] = kinds.get(topo.kind_of[d], 0) + 1
        chunks = place.chunks_of_stage(s)
        out.append(StageInfo(stage=s, hosts=tuple(hosts), devices=tuple(devs), kinds=tuple(sorted(kinds.items())),
                             layers=sum(counts[c] for c in chunks), chunk_layers=tuple(counts[c] for c in chunks)))
    return out


class Placer:
    """Placements for the configurations of one search (one System, ``world`` devices)."""

    def __init__(self, system, world: int, layers: bool = True):
        self.system = system
        self.world = world
        self.layers = layers
        """Whether stages may get uneven layer counts (the runtime can run them)."""
        self._analysis = None
        self._orders: dict = {}
        self._splits: dict = {}
        self._kinds: dict = {}

    # -- the link graph, analysed once --------------------------------------------------------

    @property
    def analysis(self) -> dict:
        if self._analysis is None:
            self._analysis = _analyse(self.system, self.world)
        return self._analysis

    @property
    def sequence(self) -> list[int]:
        """Devices in canonical order: island by island, host by host, clique by clique."""
        return self.analysis["sequence"]

    # -- the heuristic ------------------------------------------------------------------------

    def place(self, c: ParallelConfig) -> ParallelConfig:
        """``c`` with the heuristic placement (fields left None where it is the default)."""
        if c.world_size != self.world or c.device_order is not None or c.stage_layers is not None:
            return c
        order = self.device_order(c, self.sequence)
        return dataclasses.replace(c, device_order=order, stage_layers=self.stage_layers(c, order))

    __call__ = place

    def device_order(self, c: ParallelConfig, sequence) -> tuple | None:
        """Rank r on the device at canonical position tp + tp x (cp + cp x (dp + dp x pp)) of its
        coordinates: tensor-parallel groups consecutive, then context-parallel (they exchange keys
        and values every layer), then data-parallel, pipeline stages outermost,
        whatever the configuration's rank order. None where that is the identity."""
        key = (c.dp, c.pp, c.tp, c.cp, c.rank_order, tuple(sequence) if sequence is not self.sequence else None)
        hit = self._orders.get(key, False)
        if hit is not False:
            return hit
        place = Placement(c.dp, c.pp, c.tp, c.rank_order, cp=c.cp)
        order = []
        for r in range(c.world_size):
            co = place.coords(r)
            order.append(sequence[co["tp"] + c.tp * (co["cp"] + c.cp * (co["dp"] + c.dp * co["pp"]))])
        out = None if order == list(range(c.world_size)) else tuple(order)
        if len(self._orders) < 4096:
            self._orders[key] = out
        return out

    def stage_layers(self, c: ParallelConfig, device_order) -> tuple | None:
        """Layers per chunk in proportion to the speed of each stage's slowest device (the split
        minimising the busiest stage's work, embedding and output layer included); None where
        every stage is equally fast or the split is the even one."""
        if not self.layers or c.pp == 1:
            return None
        m = self.system.model
        key = (c.pp, c.virtual_stages, c.tp, c.micro_batch_size, c.sequence_parallel, c.recompute, c.dp,
               c.rank_order, device_order, c.cp, c.precision, c.fp8_recipe, c.torch_compile, module_key(c),
               self.system.policy.accumulates(c), self.system.policy.bf16_optimizer(c))
        hit = self._splits.get(key, False)
        if hit is not False:
            return hit
        kinds = self._stage_kinds(c, device_order)
        tpt = tp_times(self.system, dataclasses.replace(c, device_order=device_order, stage_layers=None), kinds)
        tp_layer = tpt.forward_per_layer_s + tpt.backward_per_layer_s  # the worst group's, on every stage
        per_layer = [max(self._layer_s(k, c) for k in ks) + tp_layer for ks in kinds]
        out = None
        if len(set(per_layer)) > 1:
            last = (c.num_chunks - 1) % c.pp
            fixed = [0.0] * c.pp
            fixed[0] += max(self._edge_s(k, c, "embedding") for k in kinds[0])
            fixed[last] += max(self._edge_s(k, c, "head") for k in kinds[last])
            totals = _min_max_split(m.num_layers, per_layer, fixed, c.virtual_stages)
            chunks = [0] * c.num_chunks
            for s, n in enumerate(totals):
                for k, nk in enumerate(even_layers(n, c.virtual_stages)):
                    chunks[s + k * c.pp] = nk
            if chunks != even_layers(m.num_layers, c.num_chunks):
                out = tuple(chunks)
        if len(self._splits) < 65536:
            self._splits[key] = out
        return out

    def _stage_kinds(self, c: ParallelConfig, device_order) -> list:
        key = (c.dp, c.pp, c.tp, c.cp, c.rank_order, device_order)
        hit = self._kinds.get(key)
        if hit is None:
            kind_of = self.system.topology.kind_of
            place = Placement(c.dp, c.pp, c.tp, c.rank_order, device_order=device_order, cp=c.cp)
            hit = [sorted({kind_of[d] for d in devs}) for devs in place.stage_devices()]
            if len(self._kinds) < 4096:
                self._kinds[key] = hit
        return hit

    def _layer_s(self, kind: str, c: ParallelConfig) -> float:
        lt = block_for(self.system, kind, c)
        return max(lt.forward_s + lt.backward_s, lt.host_forward_s + lt.host_backward_s)

    def _edge_s(self, kind: str, c: ParallelConfig, which: str) -> float:
        lt = self.system.edge(kind, c.micro_batch_size, c.tp, which, c.cp, tf32=c.precision == "tf32")
        return max(lt.forward_s + lt.backward_s, lt.host_forward_s + lt.host_backward_s)

    # -- the local search ---------------------------------------------------------------------

    def improve(self, c: ParallelConfig, max_evaluations: int = 200, deadline: float | None = None):
        """Hill-climb from ``c``'s placement on the cost model's step time.
        Returns (best estimate, estimates evaluated)."""

        ctx = self.system
        seq = self._sequence_of(c)
        best = estimate_on(c, ctx)
        best_t = best.step_time_s if best.fits else float("inf")
        evals = 1

        def trial(cand):
            nonlocal evals
            evals += 1
            e = estimate_on(cand, ctx, bound=best_t if best_t < float("inf") else None, time_if_oom=False)
            return e if e is not None and e.fits else None

        def out_of_budget():
            return evals >= max_evaluations or (deadline is not None and time.perf_counter() > deadline)

        while not out_of_budget():
            moved = False
            # devices: the best swap of stages, or of tensor-parallel groups between stages, with
            # the current layer split and with the heuristic's split for the new stages
            found, found_seq = None, None
            for cand, new_seq in self.device_candidates(best.config, seq):
                if out_of_budget():
                    break
                e = trial(cand)
                if e is not None and e.step_time_s < (found or best).step_time_s:
                    found, found_seq = e, new_seq
            if found is not None:
                best, best_t, seq, moved = found, found.step_time_s, found_seq, True
            # layers: the best single shift between adjacent chunks, repeated
            while self.layers and best.config.pp > 1 and not out_of_budget():
                found = None
                for cand in self.layer_shifts(best.config):
                    if out_of_budget():
                        break
                    e = trial(cand)
                    if e is not None and e.step_time_s < (found or best).step_time_s:
                        found = e
                if found is None:
                    break
                best, best_t, moved = found, found.step_time_s, True
            if not moved:
                break
        return best, evals

    def device_candidates(self, c: ParallelConfig, seq: list[int]):
        """(configuration, its sequence) for each device move from ``c`` (:meth:`_device_moves`),
        with the current layer split and with the heuristic's split for the new stages."""
        for new_seq in self._device_moves(c, seq):
            order = self.device_order(c, new_seq)
            for split in dict.fromkeys([c.stage_layers, self.stage_layers(c, order)]):
                yield dataclasses.replace(c, device_order=order, stage_layers=split), new_seq

    def layer_shifts(self, c: ParallelConfig):
        """``c`` with one layer shifted between two adjacent chunks, each way it can be."""
        counts = Placement.of(c, self.system.model.num_layers).chunk_layer_counts()
        for i in range(len(counts) - 1):
            for src, dst in ((i, i + 1), (i + 1, i)):
                if counts[src] <= 1:
                    continue
                new = list(counts)
                new[src] -= 1
                new[dst] += 1
                yield dataclasses.replace(c, stage_layers=_layers_or_none(new, c, self.system))

    def _sequence_of(self, c: ParallelConfig) -> list[int]:
        """The canonical-position sequence a placed configuration uses (inverse of device_order)."""
        place = Placement(c.dp, c.pp, c.tp, c.rank_order, cp=c.cp)
        seq = [0] * c.world_size
        for r in range(c.world_size):
            co = place.coords(r)
            pos = co["tp"] + c.tp * (co["cp"] + c.cp * (co["dp"] + c.dp * co["pp"]))
            seq[pos] = r if c.device_order is None else c.device_order[r]
        return seq

    def _device_moves(self, c: ParallelConfig, seq: list[int]):
        """Candidate sequences: stages swapped, or one tensor-parallel group swapped between two
        stages, among stages at the ends of runs of equally built stages (in position order)."""
        if c.pp == 1:
            return
        host_class = self.analysis["host_class"]
        host_of = self.system.topology.host_of
        block, unit = c.dp * c.cp * c.tp, c.cp * c.tp

        def unit_class(s, k):
            start = s * block + k * unit
            return tuple(sorted({host_class[host_of[d]] for d in seq[start:start + unit]}))

        units = [[unit_class(s, k) for k in range(c.dp)] for s in range(c.pp)]
        types = [tuple(sorted(u)) for u in units]
        ends = [s for s in range(c.pp) if s in (0, c.pp - 1) or types[s] != types[s - 1] or types[s] != types[s + 1]]
        for i, s in enumerate(ends):
            for t in ends[i + 1:]:
                if types[s] == types[t]:
                    continue
                new = list(seq)
                new[s * block:(s + 1) * block], new[t * block:(t + 1) * block] = \
                    seq[t * block:(t + 1) * block], seq[s * block:(s + 1) * block]
                yield new
                if c.dp == 1:
                    continue
                for x in sorted(set(units[s])):
                    for y in sorted(set(units[t])):
                        if x == y:
                            continue
                        ks = max(k for k in range(c.dp) if units[s][k] == x)
                        kt = min(k for k in range(c.dp) if units[t][k] == y)
                        a, b = s * block + ks * unit, t * block + kt * unit
                        new = list(seq)
                        new[a:a + unit], new[b:b + unit] = seq[b:b + unit], seq[a:a + unit]
                        yield new

    # -- a report -----------------------------------------------------------------------------

    def outcome(self, placed, heuristic_s: float, evaluations: int) -> dict:
        """What placement did for one configuration: its step time in the default order with the
        even split (``default_fits``: whether that fits in memory; ``gain``: how many times slower
        it is, None when it does not fit), after the heuristic and after the local search; and
        where its stages run."""
        c = placed.config
        default = estimate_on(dataclasses.replace(c, device_order=None, stage_layers=None), self.system)
        return {"default_step_time_s": default.step_time_s, "default_fits": default.fits,
                "heuristic_step_time_s": heuristic_s, "placed_step_time_s": placed.step_time_s,
                "evaluations": evaluations,
                "gain": default.step_time_s / placed.step_time_s if default.fits else None,
                "stages": [s.to_dict() for s in describe(self.system, c)]}


def _layers_or_none(counts, c: ParallelConfig, ctx) -> tuple | None:
    return None if counts == even_layers(ctx.model.num_layers, c.num_chunks) else tuple(counts)


def _min_max_split(num_layers: int, per_layer, fixed, minimum: int) -> list[int]:
    """Integers n_s >= minimum summing to num_layers that minimise max_s (n_s x per_layer[s] +
    fixed[s]): each layer goes to the stage whose time grows least with it (optimal for this
    separable min-max; ties to the earlier stage)."""
    n = [minimum] * len(per_layer)
    heap = [((minimum + 1) * t + f, s) for s, (t, f) in enumerate(zip(per_layer, fixed))]
    heapq.heapify(heap)
    for _ in range(num_layers - minimum * len(per_layer)):
        _, s = heapq.heappop(heap)
        n[s] += 1
        heapq.heappush(heap, ((n[s] + 1) * per_layer[s] + fixed[s], s))
    return n


# -- the link graph ---------------------------------------------------------------------------

def _analyse(system, world: int) -> dict:
    """Canonical device sequence and host classes of the first ``world`` devices (see the module
    docstring)."""
    import networkx as nx

    topo = system.topology
    dtype = system.model.dtype
    hosts: dict = {}
    for d in range(world):
        hosts.setdefault(topo.host_of[d], []).append(d)

    def speed(kind):
        try:
            return device_type(kind).peak(dtype)
        except Exception:  # noqa: BLE001 - a profile's device outside the catalog: no ordering by speed
            return 0.0

    sig = {}
    for h, devs in hosts.items():
        sig[h] = (-min(speed(topo.kind_of[d]) for d in devs), -len(devs),
                  tuple(sorted((topo.kind_of[d], topo.memory_of[d]) for d in devs)),
                  -topo.host_intra_bw[h], -topo.host_nic_bw[h], -topo.host_nic_total[h], topo.host_nic_kind[h])
    classes = sorted(set(sig.values()))
    host_class = {h: classes.index(s) for h, s in sig.items()}

    # tensor-parallel domains: cliques of each host's fastest links
    local_order = {h: _clique_order(topo, devs) for h, devs in hosts.items()}

    # islands: the host graph's maximum spanning tree, cut level by level (single linkage)
    g = nx.Graph()
    hs = sorted(hosts)
    g.add_nodes_from(hs)

    def bw(a, b):
        v = topo.p2p(hosts[a][0], hosts[b][0])[0]
        return min(v, 1e30)

    if len(hs) <= _FULL_GRAPH_HOSTS:
        for i, a in enumerate(hs):
            for b in hs[i + 1:]:
                g.add_edge(a, b, bw=bw(a, b))
    else:
        by_group: dict = {}
        for h in hs:
            by_group.setdefault(topo.group_of[hosts[h][0]], []).append(h)
        for members in by_group.values():
            for a, b in zip(members, members[1:]):
                g.add_edge(a, b, bw=bw(a, b))
        heads = [m[0] for m in by_group.values()]
        for i, a in enumerate(heads):
            for b in heads[i + 1:]:
                g.add_edge(a, b, bw=bw(a, b))
    tree = nx.maximum_spanning_tree(g, weight="bw")
    root = _hierarchy(hs, [(d["bw"], a, b) for a, b, d in tree.edges(data=True)])

    def summary(node):
        members = _leaves(node)
        devs = [d for h in members for d in hosts[h]]
        return (min(sig[h][0] for h in members), -len(devs), -node[0], tuple(sorted(sig[h] for h in members)),
                min(members))

    def order(node) -> list:
        if node[1] is None:  # a host
            return [node[2]]
        return [h for child in sorted(node[1], key=summary) for h in order(child)]

    sequence = [d for h in order(root) for d in local_order[h]]
    return {"sequence": sequence, "host_class": host_class, "hosts": hosts}


def _clique_order(topo, devs: list[int]) -> list[int]:
    """A host's devices, clique by clique of its fastest links (largest cliques first)."""
    if len(devs) <= 2 or len(devs) > 64:
        return list(devs)
    import networkx as nx

    bws = {(a, b): topo.p2p(a, b)[0] for i, a in enumerate(devs) for b in devs[i + 1:]}
    fastest = max(bws.values())
    g = nx.Graph()
    g.add_nodes_from(devs)
    g.add_edges_from(pair for pair, v in bws.items() if v >= 0.5 * fastest)
    left, out = set(devs), []
    while left:
        cliques = [sorted(q) for q in nx.find_cliques(g.subgraph(left))]
        pick = min(cliques, key=lambda q: (-len(q), q))
        out += pick
        left -= set(pick)
    return out


def _hierarchy(hosts: list, edges: list):
    """The single-linkage tree of hosts from maximum-spanning-tree edges (bw, a, b): nodes are
    (merge bandwidth, children, host); a leaf is (inf, None, host). Edges of one bandwidth merge
    together, so the tree does not depend on how ties were broken in the spanning tree."""
    import networkx as nx

    comp = {h: (float("inf"), None, h) for h in hosts}
    owner = {h: h for h in hosts}  # host -> representative host of its current component

    def find(h):
        while owner[h] != h:
            owner[h] = owner[owner[h]]
            h = owner[h]
        return h

    for level in sorted({e[0] for e in edges}, reverse=True):
        g = nx.Graph()
        for w, a, b in edges:
            if w == level:
                g.add_edge(find(a), find(b))
        for members in nx.connected_components(g):
            reps = sorted(members)
            node = (level, [comp[r] for r in reps], None)
            for r in reps[1:]:
                owner[r] = reps[0]
            comp[reps[0]] = node
    roots = {find(h) for h in hosts}
    if len(roots) == 1:
        return comp[roots.pop()]
    return (0.0, [comp[r] for r in sorted(roots)], None)


def _leaves(node) -> list:
    if node[1] is None:
        return [node[2]]
    return [h for child in node[1] for h in _leaves(child)]
