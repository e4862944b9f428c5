"""Time to train: how many GPUs, for how long, at what cost, and the fastest a model can be trained.

``autoconf plan`` (Lamy-Poirier, arXiv 2106.02679, section 3's question). The batch comes from a
scaling law (``scaling``): with the critical batch size of McCandlish et al. / Kaplan et al. the
steps S = S_min (1 + B_crit / B) and the tokens E = E_min (1 + B / B_crit) trade off around it;
DeepSeek LLM's compute-based B_opt(C) and a batch given by the user are the alternatives. For every
GPU count on a grid and every batch, the best configuration of the cost model's space (the same
space as ``search``: context parallelism included, in one matmul precision, without placement,
which ``place=True`` adds afterwards as ``search``'s local search) gives the step time, hence
days, GPU-hours and cost. The same sweep runs with
each method switched off in turn (layered gradient accumulation, modular placement, ZeRO stages)
and on slower networks, so the table shows what each buys where.

The per-point optimiser (:class:`PointOptimizer`) is exact for the cost model, like ``search``'s
branch and bound, and fast enough for tens of thousands of GPUs:

- one :class:`~autoconf.cost.system.System` per (model, cluster), shared by every GPU count (a GPU
  count uses the first devices of the largest cluster) and every batch: its caches of layer times
  and collective links are filled once;
- on a uniform cluster (one node kind, contiguous ranks) every group of an axis sees the same
  links, so the links of a layout are computed from one group (:func:`_prefill`, checked against
  the cost model's own enumeration in the tests) instead of all of them (O(GPUs));
- every inner choice of every outer point gets true lower bounds on its step time and memory
  without simulating its schedule (:meth:`PointOptimizer.bounds`: the pipeline floor of its
  per-layer compute, the busiest link's transfers, the queued gradient reductions, ZeRO-2/3's
  traffic, and a memory floor); points are visited in bound order and the search stops when the
  next bound reaches the incumbent of every method the point could improve;
- incumbents start from the best configurations of the neighbouring GPU count, batch and network,
  mapped to this one (warm start), so most points are pruned before any estimate.

A mixture of experts is planned over the same space with ``search``'s expert-parallel degrees per
outer point (``search.expert_parallel_choices``); its bounds take the MoE blocks, all-to-alls
included, at their least over every degree the point allows.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from .catalog import stated_accuracy
from .config import (MOE_DISPATCHERS, RECOMPUTE, ParallelConfig, check, cp_choices, ep_overlap_reason, module_key,
                     outer_space, point_config)
from .cost.estimate import Estimate, _estimate
from .cost.system import System
from .errors import UserError
from .search import (dispatcher_at, dp_hierarchical, ep_degrees, expert_parallel_choices, framework_inner,
                     recompute_module_choices, recompute_module_fallback)
from .topology import Topology

# -- methods ------------------------------------------------------------------------------------


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
METHOD_NAMES = tuple(m.name for m in METHODS)


# -- networks and synthetic clusters ------------------------------------------------------------

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
    from .cluster import cluster_from_mapping
    if device not in NODES:
        raise UserError(f"--device {device!r}; valid: {', '.join(NODES)} (or give --cluster FILE)")
    if network not in NETWORKS:
        raise UserError(f"--network {network!r}; valid: {', '.join(NETWORKS)}")
    per_node, nvlink, n_ib, ib_rate = NODES[device]
    if gpus % per_node:
        raise UserError(f"--max-gpus {gpus}: must be a multiple of {per_node} (GPUs per {device} node)")
    nics = ({"count": n_ib, "bandwidth": ib_rate, "kind": "infiniband"} if network == "ib" else
            {"count": 1, "bandwidth": "100 Gbit/s" if network == "100gbe" else "25 Gbit/s", "kind": "ethernet"})
    return cluster_from_mapping({"name": f"{device}-{gpus // per_node}x{per_node}-{network}",
                                 "node_groups": [{"count": gpus // per_node, "device": device,
                                                  "gpus_per_node": per_node, "intra_node_bandwidth": nvlink,
                                                  "nics": nics}]}, where="synthetic cluster")


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
        if g.hosts:  # names as JSON strings, which YAML reads as they are
            import json
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
    from .catalog import device_type
    cache.setdefault(("peak", world), world * device_type(topo.kind_of[0]).peak(system.model.dtype))


# -- the per-point optimiser ---------------------------------------------------------------------


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


class PointOptimizer:
    """The fastest fitting configuration for each method, at one GPU count and batch: exact for
    the cost model over ``search``'s space (``config.outer_space`` x ``search.framework_inner``,
    no placement search).

    Two cheap bounds decide most of the space without an estimate, both true bounds of what
    ``cost.estimate`` computes (the tests check them against it):

    - time: ``schedule_time.pipeline_floor`` over chunks made of their blocks' least compute per
      micro-batch (device time plus the exposed tensor-parallel collectives, or the host's issue
      time if longer; ``chunk_time``), plus the optimizer step;
    - memory: parameters and optimizer state of the busiest stage (``memory.state_bytes_per_param``)
      plus the fewest activations its schedule keeps alive at its peak (the schedule's own order,
      ``pipeline.device_orders``), the runtime context and the pipeline runtime's receive buffers.
    """

    def __init__(self, system: System, methods=METHODS, max_micro_batch: int = 64,
                 precision: tuple = ("bf16", "tensorwise"), max_cp: int | None = None):
        self.system = system
        self.max_cp = max_cp
        """Largest context-parallel degree (``config.cp_choices``; None: its default by sequence)."""
        self.precision = precision
        """(precision, FP8 recipe) of every configuration (``search.precision_choices``)."""
        self.fp8 = precision[1] if precision[0] == "fp8" else None
        self.model = system.model
        self.methods = tuple(methods)
        self.max_micro_batch = max_micro_batch
        self.kinds = sorted(set(system.topology.kind_of))
        fw = system.framework
        self.tp_overlap = fw.defaults.get("tp_comm_overlap", False) or "tp_comm_overlap" in fw.knobs
        self.ep_overlap = fw.defaults.get("ep_comm_overlap", False) or "ep_comm_overlap" in fw.knobs
        # torch.compile where the framework compiles by default or lets the user switch it on: the
        # least of both is the bound (compiled kernels are fewer and fused)
        self.compiled = tuple(sorted({bool(fw.defaults.get("torch_compile", False))}
                                     | ({False, True} if "torch_compile" in fw.knobs else set())))
        self.capacity = max(system.capacity_bytes(system.topology.kind_of.index(k)) for k in self.kinds)
        # CPU ranks sharing cores compute up to their share faster alone (processor sharing,
        # ``System.cpu_sharing``): the compute in the bounds is taken at one core per rank
        self.speedup = system.cpu_share("cpu") if "cpu" in self.kinds else 1.0
        self.oom: set = set()
        """Configurations found not to fit (memory does not depend on the network: shareable)."""

    def _prec(self, c: ParallelConfig) -> ParallelConfig:
        """``c`` in the plan's matmul precision."""
        if (c.precision, c.fp8_recipe) == self.precision:
            return c
        return dataclasses.replace(c, precision=self.precision[0], fp8_recipe=self.precision[1])

    # -- bounds ----------------------------------------------------------------------------------
    def _options(self, tp: int, cp: int = 1) -> list:
        sps = (False, True) if tp > 1 and (self.model.seq_length // cp) % tp == 0 else (False,)
        return [(sp, rc) for sp in sps for rc in RECOMPUTE]

    def _per_layer(self, mbs: int, tp: int, sp: bool, rc: str, cp: int = 1, ep: int = 0) -> tuple:
        """(forward, backward, exposed tp forward, exposed tp backward, host forward, host backward,
        activation bytes) of one block per micro-batch on a rank's s/cp tokens: least over device
        kinds and compile modes (the context-parallel exchange is left out: at least 0). ``ep`` > 0:
        a mixture of experts' MoE block with its experts over ``ep`` ranks instead (its all-to-alls
        are the caller's, ``_moe_rows``)."""
        from .cost.moe import moe_activation_bytes, moe_shape
        from .cost.tensor_parallel import tp_times

        def make():
            sys_ = self.system
            c = self._prec(ParallelConfig(dp=1, pp=1, tp=tp, micro_batch_size=mbs, num_micro_batches=1,
                                          recompute=rc, sequence_parallel=sp, cp=cp))
            moe = ep > 0
            shapes = [moe_shape(sys_, dataclasses.replace(c, ep=ep))] if moe else [None]
            # selective recomputation: the least over what it may recompute (search.recompute_module_choices)
            mods = ((),)
            if rc == "selective":  # (and what FP8 delayed scaling leaves of them: framework_inner)
                choices = recompute_module_choices(sys_.framework, self.model)
                mods = tuple(set(choices) | {recompute_module_fallback(md) for md in choices})
            cs = [dataclasses.replace(c, recompute_modules=md) for md in mods]
            # accumulates=False: no .grad accumulation pass (the least any configuration pays)
            lts = [sys_.block(k, mbs, tp, sp, rc, cp=cp, fp8=self.fp8, compiled=comp, moe=sh, accumulates=False,
                              modules=module_key(c_))
                   for k in self.kinds for comp in self.compiled for sh in shapes for c_ in cs]
            tpt = tp_times(sys_, c, [self.kinds]) if tp > 1 else None
            mask = min(sys_.mask_bytes(k) for k in self.kinds)
            if moe:
                act = min(moe_activation_bytes(sys_, c_, mask)["total"] for c_ in cs)
            else:
                act = min(sys_.layer_activations(c_, mask)["total"] for c_ in cs)
            return (min(lt.forward_s for lt in lts), min(lt.backward_s for lt in lts),
                    tpt.forward_per_layer_s if tpt else 0.0, tpt.backward_per_layer_s if tpt else 0.0,
                    min(lt.host_forward_s for lt in lts), min(lt.host_backward_s for lt in lts), act)
        return self.system.cached(("ttt-layer", mbs, tp, sp, rc, cp, self.fp8, ep), make)

    def _moe_rows(self, point, opts) -> list:
        """Per option (sequence parallel, recompute): a lower bound on every MoE block of ``point``
        as ``_per_layer``'s row, least over the expert-parallel degrees its configurations can
        run: each degree's block with its dispatch and combine all-to-alls (``moe.a2a_times``,
        exposed: added to the compute) on that degree's groups, column by column; none where the
        framework's ``ep_comm_overlap`` can run at the point (its pairs may hide them all)."""
        import numpy as np

        from .cost.moe import a2a_times
        dp, pp, tp, mbs, sched, v, layered, cp = point
        eps = ep_degrees(dp * cp, self.model.num_experts) if self.system.framework.expert_parallel else [1]
        out = []
        for sp, rc in opts:
            rows = []
            for k in eps:
                r = list(self._per_layer(mbs, tp, sp, rc, cp, ep=k))
                if k > 1:
                    c = ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=mbs, num_micro_batches=1, recompute=rc,
                                       sequence_parallel=sp, cp=cp, ep=k, schedule=sched, virtual_stages=v,
                                       moe_dispatcher=dispatcher_at(self.system, k, tp))
                    if self.ep_overlap and ep_overlap_reason(c, self.model) is None:
                        rows.append(r)  # paired passes can hide them all: the least is none exposed
                        continue
                    key = ("ttt-a2a", dp, pp, tp, cp, mbs, sp, rc, k)
                    af, ab = self.system.cached(key, lambda: a2a_times(self.system, c))
                    r[0], r[1] = r[0] + af, r[1] + ab
                rows.append(r)
            out.append(tuple(np.min(np.array(rows), axis=0)))
        return out

    def _edges(self, mbs: int, tp: int, cp: int = 1) -> tuple:
        def make():
            out = []
            for which in ("embedding", "head"):
                es = [self.system.edge(k, mbs, tp, which, cp) for k in self.kinds]
                out += [min(e.forward_s for e in es), min(e.backward_s for e in es),
                        min(e.host_forward_s for e in es), min(e.host_backward_s for e in es)]
            return tuple(out)
        return self.system.cached(("ttt-edges", mbs, tp, cp), make)

    def _chunks(self, pp: int, tp: int, v: int, mbs: int, cp: int = 1):
        """Per chunk (numpy arrays): its blocks, the embedding / head passes' (forward, backward,
        host forward, host backward) it carries, and its mixture-of-experts blocks (zeros for a
        dense model)."""
        import numpy as np

        from .placement import even_layers

        def make():
            n_chunks = pp * v
            layers = np.array(even_layers(self.model.num_layers, n_chunks), dtype=float)
            ef, eb, ehf, ehb, hf_, hb_, hhf, hhb = self._edges(mbs, tp, cp)
            edge = np.zeros((4, n_chunks))
            edge[:, 0] += (ef, eb, ehf, ehb)
            edge[:, -1] += (hf_, hb_, hhf, hhb)
            moe = np.array(self._chunk_experts(pp, tp, v)[0], dtype=float)
            return layers, edge, moe
        return self.system.cached(("ttt-chunks", pp, tp, v, mbs, cp), make)

    def _p2p(self, point, sp: bool):
        """The model's transfer time across each stage boundary (``schedule_time.p2p_times``) for one
        micro-batch's activation: a numpy vector of pp (0 without pipelining)."""
        import numpy as np

        from .cost.schedule_time import boundary_bytes, p2p_times
        dp, pp, tp, mbs, sched, v, layered, cp = point
        if pp == 1:
            return np.zeros(1)

        def make():
            c = ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=mbs, num_micro_batches=1, sequence_parallel=sp,
                               cp=cp)
            _prefill(self.system, c)
            return np.array(p2p_times(self.system, c, boundary_bytes(self.system, c)))
        return self.system.cached(("ttt-p2p", dp, pp, tp, mbs, sp, cp), make)

    def _floors(self, point, m: int, layer_rows, p2p=None, reductions=None, moe_rows=None):
        """``schedule_time.pipeline_floor`` over chunk lower bounds, for each row of per-block
        (forward, backward, tp forward, tp backward, host forward, host backward): a numpy vector.
        ``moe_rows``: the same for a mixture of experts' MoE blocks (``_moe_rows``).
        ``p2p`` (options x pp): the transfers micro-batch 0 makes on its way to device d and back
        join its prefix (forward and backward, one per boundary crossed). ``reductions`` (zeros x
        pp, one chunk per device): also a bound per (option, zero) with each device's gradient
        reduction after its last backward."""
        import numpy as np
        dp, pp, tp, mbs, sched, v, layered, cp = point
        layers, edge, moe = self._chunks(pp, tp, v, mbs, cp)
        a = np.asarray(layer_rows, dtype=float) / self.speedup  # options x 6
        am = a if moe_rows is None else np.asarray(moe_rows, dtype=float) / self.speedup
        dense = layers - moe
        edge = edge / self.speedup

        def col(i):  # options x chunks: the chunk's dense blocks and MoE blocks
            return np.outer(a[:, i], dense) + np.outer(am[:, i], moe)
        f = col(0) + edge[0]
        b = col(1) + edge[1]
        tf = col(2)
        tb = col(3)
        hf = col(4) + edge[2]
        hb = col(5) + edge[3]
        if self.tp_overlap:  # the collectives can hide under the GEMMs (tensor_parallel.overlapped)
            fwd, bwd = np.maximum(np.maximum(f, tf), hf), np.maximum(np.maximum(b, tb), hb)
        else:
            fwd, bwd = np.maximum(f + tf, hf), np.maximum(b + tb, hb)
        both = fwd + bwd  # options x chunks; chunk c on device c % pp
        busy = both.reshape(len(a), v, pp).sum(axis=1) * m
        step = both[:, :pp - 1]
        if p2p is not None and pp > 1:
            step = step + 2.0 * np.asarray(p2p)[:, :pp - 1]
        prefix = np.concatenate([np.zeros((len(a), 1)), np.cumsum(step, axis=1)], axis=1)
        floor = (prefix + busy).max(axis=1)
        if p2p is not None and pp > 1:
            # ``pipeline.simulate``: a directed link carries one transfer at a time, so the step
            # lasts at least the busiest link's transfers over all micro-batches (activations of
            # boundary c go from device c % pp to (c+1) % pp, their gradients back); 1% below it
            # for the simulation's extrapolation past the warm-up
            per = np.asarray(p2p)  # options x pp: boundary c's transfer is p2p[c % pp]
            count = np.full(pp, float(v))
            count[pp - 1] -= 1  # the last chunk has no boundary after it
            load = per * count  # per boundary class k, one direction
            if pp == 2:  # both directions of a boundary class share one link with the other class
                link = load.sum(axis=1)
            else:
                link = load.max(axis=1)
            floor = np.maximum(floor, 0.99 * m * link)
        if reductions is None:
            return floor
        # ``data_parallel.reduction_tail_s``: a device's reductions queue one after another from
        # its first chunk's last backward (less all but one layer of it). With one chunk per
        # device that backward comes after micro-batch 0's forward reached the device, its m
        # forwards and m - 1 backwards; breadth-first runs every forward of every local chunk
        # first, then the highest chunk's m backwards
        lead = fwd[:, :pp - 1]
        if p2p is not None and pp > 1:
            lead = lead + np.asarray(p2p)[:, :pp - 1]
        pre_f = np.concatenate([np.zeros((len(a), 1)), np.cumsum(lead, axis=1)], axis=1)
        top = slice((v - 1) * pp, v * pp)  # each device's highest chunk
        local_f = fwd.reshape(len(a), v, pp).sum(axis=1)
        b_top = bwd[:, top]
        start = pre_f + m * local_f + (m - 1) * b_top + b_top / layers[top]
        return floor, (start[:, None, :] + np.asarray(reductions)[None, :, :]).max(axis=2)

    def _max_ep(self, point) -> int:
        """The largest expert-parallel degree any configuration of ``point`` runs (1 for a dense
        model): the least routed-expert parameters per rank."""
        dp, pp, tp, mbs, sched, v, layered, cp = point
        m = self.model
        if not m.is_moe or not self.system.framework.expert_parallel:
            return 1
        return max(ep_degrees(dp * cp, m.num_experts))

    def _stage_params(self, pp: int, tp: int, v: int, ep: int = 1):
        """Per stage (numpy arrays): parameters of its chunks' tp shards (a mixture of experts'
        E/ep routed experts per MoE block), and its smallest chunk's blocks."""
        import numpy as np

        from .cost.layout import chunk_params
        from .placement import even_layers

        def make():
            n_chunks = pp * v
            c = ParallelConfig(dp=1, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1, virtual_stages=v,
                               ep=ep)
            layers = even_layers(self.model.num_layers, n_chunks)
            cp = chunk_params(self.system, c, layers)
            params = np.array([sum(cp[ci] for ci in range(s, n_chunks, pp)) for s in range(pp)])
            least = np.array([min(layers[ci] for ci in range(s, n_chunks, pp)) for s in range(pp)], dtype=float)
            buffers = np.array([sum((ci > 0) + (ci < n_chunks - 1) for ci in range(s, n_chunks, pp))
                                for s in range(pp)], dtype=float)
            return params, least, buffers
        return self.system.cached(("ttt-stage", pp, tp, v, ep), make)

    def _live(self, sched: str, pp: int, m: int, v: int, layered: bool):
        """Per stage, the fewest activation sets (one micro-batch through one chunk) its schedule
        keeps alive at its activation peak, as ``stage_memory`` counts them (a simulated prefix of
        the micro-batches, scaled for the schedules that keep them all): from the schedule's own
        order (``pipeline.device_orders``); closed forms where they are exact (the tests compare)."""
        import numpy as np

        from .cost import schedule_time
        if pp == 1 and layered:  # every micro-batch through every block before any backward
            return np.array([float(m)])
        if sched == "gpipe":
            return np.full(pp, float(m))
        if sched == "breadth_first":
            return np.full(pp, float(m * v))
        if sched == "1f1b":
            return np.minimum(pp - np.arange(pp), m).astype(float)
        m_sim = schedule_time.sim_size(sched, pp, m)
        return self.system.cached(("ttt-live", sched, pp, m_sim, v), lambda: np.array(live_counts(sched, pp, m_sim, v),
                                                                                       dtype=float))

    def _memory_floors(self, point, m: int, acts, zeros):
        """Lower bounds on the busiest stage's memory (see the class docstring): an array of
        (options x zeros) for the per-block activation bytes ``acts`` of each option."""
        import numpy as np

        from .catalog import device_type
        from .cost.memory import state_bytes_per_param, zero3_working_bytes
        dp, pp, tp, mbs, sched, v, layered, cp = point
        sys_, mod = self.system, self.model
        # routed experts at the largest ep: per rank at most what any ep holds, and their ZeRO
        # shards over dp x cp / ep come to the dense sharding over dp x cp of all E experts
        params, least, buffers = self._stage_params(pp, tp, v, self._max_ep(point))
        live = self._live(sched, pp, m, v, layered)
        units = live * (mod.num_layers if (pp == 1 and layered) else least)  # blocks' activation sets
        rest = np.zeros(pp) + min(device_type(k).framework_overhead_bytes for k in self.kinds)
        if pp > 1 and sys_.framework.per_micro_batch_pipeline_buffers:
            sp_div = tp if tp > 1 and mod.seq_length % tp == 0 else 1
            rest = rest + buffers * m * mbs * mod.seq_length / cp / sp_div * mod.hidden_size * mod.dtype_bytes
        fp32 = sys_.grad_bytes == 4 and mod.dtype != "fp32"
        # ZeRO shards over the gradient group: dp x cp (``data_parallel.grad_group``)
        master = sys_.framework.master_weights
        per_param = np.array([(lambda st: st.parameters + st.optimizer)(state_bytes_per_param(
            mod.dtype, self._state_zero(point, z), dp * cp, fp32, master)) for z in zeros])
        z3 = np.array([zero3_working_bytes(mod, tp) if (z == 3 and dp * cp > 1) else 0.0 for z in zeros])
        # options x zeros x stages
        tot = (np.asarray(acts, dtype=float)[:, None, None] * units[None, None, :]
               + per_param[None, :, None] * params[None, None, :] + rest[None, None, :] + z3[None, :, None])
        return tot.max(axis=2)

    def _optimizer_floor(self, point, zeros):
        import numpy as np
        dp, pp, tp, mbs, sched, v, layered, cp = point
        top = float(self._stage_params(pp, tp, v, self._max_ep(point))[0].max())
        return np.array([min(self.system.optimizer_time(k, top / (dp * cp if self._state_zero(point, z) >= 1 else 1))
                             for k in self.kinds) for z in zeros])

    def _state_zero(self, point, zero: int) -> int:
        """``System.state_zero_stage`` at an outer point and ZeRO stage."""
        dp, pp, tp, mbs, sched, v, layered, cp = point
        return self.system.state_zero_stage(ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1,
                                                           num_micro_batches=1, zero_stage=zero))

    def _reduction_floor(self, point, zeros) -> list:
        """Per ZeRO stage: the busiest device's gradient reductions back to back (the model queues
        a device's chunk reductions one after another, ``data_parallel.reduction_tail_s``, so the
        step lasts at least their sum), with the fastest all-reduce the framework offers there."""
        from .cost import comm
        from .cost.data_parallel import _reduction, gather_bytes, grad_group, reduction_collective
        from .cost.tensor_parallel import axis_links, collective_s
        dp, pp, tp, mbs, sched, v, layered, cp = point
        if dp * cp == 1:
            return [(0.0, [0.0] * pp, [0.0] * pp, [0.0] * pp) for _ in zeros]

        def make():
            from .cost.layout import chunk_params
            from .placement import even_layers
            layers = even_layers(self.model.num_layers, pp * v)
            params = chunk_params(self.system, ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1,
                                                              num_micro_batches=1, virtual_stages=v), layers)
            # a mixture of experts: its dense parameters only (the routed experts' reductions over
            # dp x cp / ep queue after them: at least 0)
            params = [p - e for p, e in zip(params, self._chunk_experts(pp, tp, v)[1])]
            # one chunk of each size and place (the first and last chunks may hold a tied embedding's
            # copy, ``data_parallel.tied_params``): the reductions are per chunk
            n_chunks = pp * v
            keys = [(p, ci in (0, n_chunks - 1)) for ci, p in enumerate(params)]
            reps = {}
            for ci, k in enumerate(keys):
                reps.setdefault(k, ci)
            lay = _ChunkParams(tuple(params))
            _prefill(self.system, ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1, cp=cp))
            hier = dp_hierarchical(self.system, dp, pp, tp)
            out = {}
            for z in (0, 1, 2, 3):
                modes = ("flat", "hierarchical") if (hier and z == 0) else ("flat",)
                best, per_dev = float("inf"), [float("inf")] * pp
                for mode in modes:
                    c = self._prec(ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1,
                                                  virtual_stages=v, zero_stage=z, dp_all_reduce=mode, cp=cp))
                    _prefill(self.system, c)
                    red = reduction_collective(z)
                    one = {k: _reduction(self.system, c, lay, red, ci, self.kinds) for k, ci in reps.items()}
                    per_chunk = [one[k] for k in keys]
                    sums = [sum(per_chunk[d::pp]) for d in range(pp)]
                    best = min(best, max(sums))
                    per_dev = [min(x, y) for x, y in zip(per_dev, sums)]
                # ZeRO-2/3 during the micro-batches (``data_parallel.per_micro_batch_s``): a chunk's
                # backward is at least its gradients' reduce-scatter (standard accumulation; in
                # buckets, at least one call's time), ZeRO-3's forward and backward at least the
                # gather of its parameters (per micro-batch, except layered accumulation at pp=1)
                rs = ag = [0.0] * (pp * v)
                if z >= 1:
                    c = self._prec(ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1,
                                                  virtual_stages=v, zero_stage=z, cp=cp))
                    one = {k: _reduction(self.system, c, lay, comm.reduce_scatter_s, ci, self.kinds)
                           for k, ci in reps.items()}
                    rs = [one[k] for k in keys]
                    n, axis = grad_group(c)
                    links = axis_links(self.system, c, axis)
                    one = {p: collective_s(self.system, links, comm.all_gather_s, n, p * gather_bytes(self.system, c))
                           for p in set(params)}
                    ag = [one[p] for p in params]
                out[z] = (best, [sum(rs[d::pp]) for d in range(pp)], [sum(ag[d::pp]) for d in range(pp)], per_dev)
            return out
        red = self.system.cached(("ttt-red", dp, pp, tp, v, cp, self.fp8), make)
        return [red[z] for z in zeros]

    def _chunk_experts(self, pp: int, tp: int, v: int) -> tuple:
        """Per chunk at ep = 1: its MoE blocks and all E experts' parameters of them on a rank
        (``layout.chunk_experts``); zeros for a dense model."""
        if not self.model.is_moe:
            return (0,) * (pp * v), (0.0,) * (pp * v)
        from .cost.layout import chunk_experts
        from .placement import Placement
        c = ParallelConfig(dp=1, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1, virtual_stages=v)
        return chunk_experts(self.system, c, Placement.of(c, self.model.num_layers).chunk_layers())

    def _micro_batch_dp_floor(self, point, m: int, red) -> float:
        """The busiest device's ZeRO-2/3 traffic over the micro-batches (see _reduction_floor)."""
        dp, pp, tp, mbs, sched, v, layered, cp = point
        z, (_, rs, ag, _) = red
        lay = layered or sched == "breadth_first"
        if dp * cp == 1 or z < 2:
            return 0.0
        per_mb = [0.0] * pp
        if not lay:
            per_mb = [r * (m - 1) / m for r in rs]
        if z == 3 and not (lay and pp == 1):
            per_mb = [x + 2 * a for x, a in zip(per_mb, ag)]
        return max(per_mb) * m

    def bounds(self, point, global_batch: int) -> dict:
        """{(sequence_parallel, recompute, zero): lower bound on the step time} for the inner
        choices whose memory floor fits (empty: nothing of the point can fit)."""
        import numpy as np
        dp, pp, tp, mbs, sched, v, layered, cp = point
        m = global_batch // (dp * mbs)
        zeros = (0, 1, 2, 3) if dp * cp > 1 else (0,)
        opts = self._options(tp, cp)
        rows = [self._per_layer(mbs, tp, sp, rc, cp) for sp, rc in opts]
        mrows = self._moe_rows(point, opts) if self.model.is_moe else None
        # a mixture of experts: every block's activations at least the lesser of a dense and an MoE block's
        acts = [min(r[6], mr[6]) for r, mr in zip(rows, mrows)] if mrows else [r[6] for r in rows]
        fits = self._memory_floors(point, m, acts, zeros) <= self.capacity
        if not fits.any():
            return {}
        keep = np.nonzero(fits.any(axis=1))[0]
        opt = self._optimizer_floor(point, zeros)
        red = self._reduction_floor(point, zeros)
        dp_mb = [self._micro_batch_dp_floor(point, m, (z, red[zi])) for zi, z in enumerate(zeros)]
        # where the queue of reductions has a known earliest start (see _floors); not pp = 1 layered
        # accumulation (its units finish one by one), nor interleaving (its chunks' last backwards
        # interleave with the cool-down)
        standard = dp * cp > 1 and ((v == 1 and (pp > 1 or not layered)) or sched == "breadth_first")
        got = self._floors(point, m, [rows[i][:6] for i in keep], [self._p2p(point, opts[i][0]) for i in keep],
                           [r[3] for r in red] if standard else None,
                           [mrows[i][:6] for i in keep] if mrows else None)
        floors, tails = got if standard else (got, None)
        out = {}
        for j, i in enumerate(keep):
            sp, rc = opts[i]
            for zi, z in enumerate(zeros):
                if fits[i, zi]:
                    lb = max(floors[j], red[zi][0], dp_mb[zi], tails[j, zi] if standard else 0.0)
                    out[(sp, rc, z)] = float(lb + opt[zi])
        return out

    # -- the search ------------------------------------------------------------------------------
    def ep_choices(self, point, global_batch: int) -> tuple:
        """The expert-parallel degrees tried at ``point``: ``search``'s (1 for a dense model)."""
        return expert_parallel_choices(self.system, point, global_batch, self.precision)

    def points(self, world: int, global_batch: int) -> list:
        fw = self.system.framework
        out = []
        # (dp, pp, tp, mbs, schedule, v, layered, cp), cp as ``search`` chooses it
        cps = cp_choices(self.model, world, self.max_cp) if fw.cp_comm else (1,)
        for p in outer_space(self.model, world, global_batch, self.max_micro_batch, cps=cps):
            base = self._prec(point_config(p, 0, "none", False, global_batch))
            if fw.check(base) or check(base, self.model):
                continue
            out.append(p)
        return out

    def run(self, world: int, global_batch: int, seeds=()) -> tuple[dict, PointStats]:
        """{method name: best fitting Estimate or None} and what it took. ``seeds``: configurations
        (of any GPU count and batch) whose neighbours here are tried first."""
        t0 = time.perf_counter()
        st = PointStats()
        inc = {m.name: float("inf") for m in self.methods}
        best: dict = {m.name: None for m in self.methods}
        tried: set = set()

        def consider(c: ParallelConfig, lb: float | None = None) -> None:
            c = self._prec(c)
            if c.recompute_modules and self.system.framework.check(c):  # (FP8 delayed: search.framework_inner)
                c = dataclasses.replace(c, recompute_modules=recompute_module_fallback(c.recompute_modules))
            if c in tried:
                return
            tried.add(c)
            if c in self.oom:
                st.out_of_memory += 1
                return
            ms = [m for m in self.methods if m.admits(c)]
            if not ms or check(c, self.model) or self.system.framework.check(c):
                return
            bound = max(inc[m.name] for m in ms)
            if lb is not None and lb >= bound:
                st.bounded_out += 1
                return
            _prefill(self.system, c)
            e = _estimate(c, self.system, bound=bound if bound < float("inf") else None, time_if_oom=False)
            st.estimates += 1
            if e is None:
                return
            if not e.fits:
                self.oom.add(c)
                return
            for m in ms:
                if e.step_time_s < inc[m.name]:
                    inc[m.name], best[m.name] = e.step_time_s, e

        for c in _neighbours(seeds, world, global_batch):
            if self.model.is_moe:  # search's expert-parallel degrees at the neighbour's point only
                eps = self.ep_choices((c.dp, c.pp, c.tp, c.micro_batch_size, c.schedule, c.virtual_stages,
                                       c.layered_grad_accum, c.cp), global_batch)
                if c.ep not in eps:
                    c = dataclasses.replace(c, ep=max((e for e in eps if e <= c.ep), default=eps[0]))
                # the System's dispatcher at the neighbour's degree, and the overlap only where it runs
                c = dataclasses.replace(c, moe_dispatcher=dispatcher_at(self.system, c.ep, c.tp))
                if c.ep_comm_overlap and ep_overlap_reason(c, self.model):
                    c = dataclasses.replace(c, ep_comm_overlap=None)
            consider(c)
        pts = self.points(world, global_batch)
        st.outer_points = len(pts)
        ranked = []
        for p in pts:
            b = self.bounds(p, global_batch)
            if b:
                ranked.append((min(b.values()), p, b))
            else:
                st.out_of_memory += 1
        ranked.sort(key=lambda x: x[0])
        for i, (lb, p, b) in enumerate(ranked):
            dp, pp, tp, mbs, sched, v, layered, cp = p
            ms = [m for m in self.methods if m.admits_outer(sched, v, layered)
                  and any(z <= m.max_zero for (_, _, z) in b)]
            if not ms:
                continue
            if lb >= max(inc.values()):
                st.bounded_out += len(ranked) - i
                break
            thr = max(inc[m.name] for m in ms)
            if lb >= thr:
                st.bounded_out += 1
                continue
            _prefill(self.system, ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1))
            hier = dp_hierarchical(self.system, dp, pp, tp) if dp > 1 else False
            inner = [(b[(c.sequence_parallel, c.recompute, c.zero_stage)], c)
                     for c in framework_inner(self.system.framework, dp, pp, tp, mbs, sched, v, layered,
                                              global_batch, hier, cp, moe_experts=self.model.num_experts,
                                              eps=self.ep_choices(p, global_batch), model=self.model,
                                              dispatcher=self.system.moe_dispatcher, precisions=(self.precision,))
                     if (c.sequence_parallel, c.recompute, c.zero_stage) in b]
            for clb, c in sorted(inner, key=lambda x: x[0]):
                consider(c, clb)
        st.seconds = time.perf_counter() - t0
        return best, st


@dataclass(frozen=True)
class _ChunkParams:
    """What ``data_parallel._reduction`` reads of a layout: each chunk's parameters (the planner's
    reduction floor takes a mixture of experts' dense parameters only: no routed experts)."""

    chunk_params: tuple
    chunk_expert_params: tuple = ()


def live_counts(schedule: str, pp: int, m: int, v: int) -> tuple:
    """Per device, the most activation sets (micro-batch x chunk) alive at once in the schedule's
    order (``pipeline.device_orders``): what ``stage_memory`` sees at the activation peak."""
    from .cost.pipeline import device_orders
    out = []
    for order in device_orders(schedule, pp, m, v):
        live = peak = 0
        for op, _mb, _c in order:
            live += -1 if op == "B" else 1
            peak = max(peak, live)
        out.append(peak)
    return tuple(out)


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


# -- the sweep ------------------------------------------------------------------------------------


def round_batch(sequences: float) -> int:
    """The nearest batch of the form 2^k or 3 x 2^k sequences (so that data-parallel degrees, which
    are powers of two on power-of-two GPU counts, divide it, and interleaving finds micro-batch
    counts divisible by pp)."""
    if sequences <= 1:
        return 1
    cands = [c for k in range(0, 40) for c in (2 ** k, 3 * 2 ** k)]
    return min(cands, key=lambda c: (abs(math.log(c / sequences)), c))


@dataclass(frozen=True)
class BatchPlan:
    """How many steps and tokens a batch needs under the batch law."""

    batch: int
    """Sequences per step."""
    steps: float
    tokens: float
    """Tokens processed (steps x batch x sequence length)."""


@dataclass
class Budget:
    """The training budget and the law that turns it into steps at each batch."""

    law: str
    tokens: float
    """Tokens processed at the law's batch (B_crit, B_opt or the given batch)."""
    tokens_rule: str
    seq_length: int
    batches: tuple
    """Batches swept (sequences)."""
    b_crit_tokens: float
    loss: float
    loss_law: str
    notes: tuple = ()
    compute_flops: float | None = None
    """DeepSeek's C = M D."""
    learning_rate: float | None = None

    def plan(self, batch: int) -> BatchPlan:
        from . import scaling
        b_tok = batch * self.seq_length
        if self.law == "kaplan":
            # D is what a run processes at B = B_crit: E_min = D / 2, S_min = D / (2 B_crit)
            e_min, s_min = scaling.minima_from_tokens_at(self.tokens, self.b_crit_tokens, self.b_crit_tokens)
            steps = scaling.steps_for(b_tok, s_min, self.b_crit_tokens)
            return BatchPlan(batch, steps, steps * b_tok)
        return BatchPlan(batch, self.tokens / b_tok, self.tokens)

    def to_dict(self) -> dict:
        from . import scaling
        laws = {"kaplan": ["kaplan-bcrit"], "deepseek": ["deepseek-batch"], "fixed": []}[self.law]
        laws.append("kaplan-loss" if self.loss_law == "kaplan" else "chinchilla-loss")
        return {"law": self.law, "tokens": self.tokens, "tokens_rule": self.tokens_rule,
                "seq_length": self.seq_length, "batches": list(self.batches), "b_crit_tokens": self.b_crit_tokens,
                "b_crit_sequences": self.b_crit_tokens / self.seq_length, "loss": self.loss,
                "loss_law": self.loss_law, "compute_flops": self.compute_flops,
                "learning_rate": self.learning_rate, "notes": list(self.notes),
                "laws": [scaling.LAWS[n].to_dict() for n in laws]}


DEFAULT_FACTORS = (0.25, 0.5, 1.0, 2.0)
BATCH_FACTORS_DEFAULT = ",".join(f"{f:g}" for f in DEFAULT_FACTORS)
"""``--batch-factors`` as the command line gives it by default."""
MAX_MICRO_BATCH = 64
"""The largest micro-batch tried by default (``--max-micro-batch``, as ``search``'s)."""


def make_budget(model, tokens: float | None = None, law: str = "kaplan", loss_law: str = "kaplan",
                global_batch: int | None = None, factors=DEFAULT_FACTORS) -> Budget:
    """The token budget (default: Chinchilla's compute-optimal 20 per parameter), the predicted
    loss, the critical batch, and the batches to sweep under ``law``."""
    from . import scaling
    if law not in scaling.BATCH_LAWS:
        raise UserError(f"--batch-law {law!r}; valid: {', '.join(scaling.BATCH_LAWS)}")
    if loss_law not in scaling.LOSS_LAWS:
        raise UserError(f"--loss-law {loss_law!r}; valid: {', '.join(scaling.LOSS_LAWS)}")
    if law == "fixed" and not global_batch:
        raise UserError("--batch-law fixed needs --global-batch N (sequences per step)")
    if law != "fixed" and global_batch:
        raise UserError(f"--global-batch is the fixed batch law's; with --batch-law {law} the law sets the batch "
                        "(give --batch-law fixed to use yours)")
    if tokens is None:
        tokens = scaling.compute_optimal_tokens(model)
        rule = (f"compute-optimal: {scaling.CHINCHILLA_TOKENS.constants['tokens_per_param']:g} tokens per "
                f"parameter (Chinchilla, Hoffmann et al. 2022, Table 3)")
    else:
        rule = "given (--tokens)"
    if tokens < model.seq_length:
        raise UserError(f"--tokens {tokens:g}: fewer than one sequence of {model.seq_length:,} tokens")
    loss = scaling.predicted_loss(model, tokens, loss_law)
    b_crit = scaling.critical_batch_tokens(loss)
    s = model.seq_length
    used = {"kaplan": scaling.KAPLAN_BCRIT, "deepseek": scaling.DEEPSEEK_BATCH,
            "fixed": scaling.KAPLAN_LOSS if loss_law == "kaplan" else scaling.CHINCHILLA_LOSS}[law]
    notes = [f"the scaling laws were fitted on particular data and tokenizers ({used.fitted_on}); "
             "for other data they give the order of magnitude, not the value"]
    if law == "kaplan" and loss_law == "chinchilla":
        notes.append("B_crit(L) was fitted to Kaplan's loss (nats on WebText2); a Chinchilla loss puts it on "
                     "another scale")
    compute = lr = None
    if law == "kaplan":
        if any(f <= 0 for f in factors):
            raise UserError(f"--batch-factors {factors}: must be positive")
        batches = tuple(sorted({round_batch(f * b_crit / s) for f in factors}))
        if batches[0] * s > tokens:
            raise UserError(f"--batch-factors {','.join(f'{f:g}' for f in factors)}: even the smallest batch, "
                            f"{batches[0] * s:,.0f} tokens ({min(factors):g} x B_crit), is more than the whole run "
                            f"({tokens:,.0f} tokens, --tokens): use smaller factors or more tokens")
        if batches[-1] * s > tokens:
            notes.append(f"batches over the whole run's {tokens:,.0f} tokens left out: "
                         + ", ".join(f"{b:,}" for b in batches if b * s > tokens))
            batches = tuple(b for b in batches if b * s <= tokens)
        notes.append("--tokens is what a run processes at B = B_crit; at batch B the same loss takes "
                     "S = S_min (1 + B_crit/B) steps and E = E_min (1 + B/B_crit) tokens, E_min = D/2, "
                     "S_min = D/(2 B_crit) (McCandlish et al. 2018)")
    elif law == "deepseek":
        compute = scaling.deepseek_flops_per_token(model) * tokens
        batches = (round_batch(scaling.deepseek_batch_tokens(compute) / s),)
        lr = scaling.deepseek_learning_rate(compute)
    else:
        batches = (int(global_batch),)
        if global_batch * s > b_crit:
            notes.append(f"the batch ({global_batch * s / 1e6:.3g}M tokens) is {global_batch * s / b_crit:.2g}x "
                         f"B_crit ({b_crit / 1e6:.3g}M): by the S/E trade-off it spends more tokens than needed")
    return Budget(law=law, tokens=float(tokens), tokens_rule=rule, seq_length=s, batches=batches,
                  b_crit_tokens=b_crit, loss=loss, loss_law=loss_law, notes=tuple(notes),
                  compute_flops=compute, learning_rate=lr)


@dataclass
class Row:
    """One (network, method, GPU count, batch): the best configuration and what the run costs."""

    network: str
    method: str
    gpus: int
    batch: int
    steps: float
    tokens: float
    estimate: Estimate
    work_days: float
    """Failure-free days: steps x step time."""
    days: float
    """Days with restarts and checkpoints (the same without --mtbf-per-gpu)."""
    gpu_hours: float
    cost: float | None
    goodput: object = None

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s

    def to_dict(self) -> dict:
        e = self.estimate
        mm = max(e.memory_by_stage, key=lambda x: x.total)
        return {"network": self.network, "method": self.method, "gpus": self.gpus, "batch": self.batch,
                "steps": self.steps, "tokens": self.tokens, "step_time_s": e.step_time_s, "work_days": self.work_days,
                "days": self.days, "gpu_hours": self.gpu_hours, "cost": self.cost, "mfu": e.mfu,
                "config": e.config.to_dict(), "config_short": e.config.short(),
                "peak_memory_bytes": e.peak_memory_bytes,
                "memory_bytes": {k: getattr(mm, k) for k in ("parameters", "gradients", "optimizer", "activations",
                                                             "other", "capacity")},
                "goodput": self.goodput.to_dict() if self.goodput else None}


def gpu_grid(max_gpus: int, per_node: int, start: int = 1) -> list:
    """Powers of two times a node, from ``start`` GPUs up to ``max_gpus``, and ``max_gpus`` itself."""
    out, g = [], per_node
    while g <= max_gpus:
        if g >= start:
            out.append(g)
        g *= 2
    if max_gpus not in out and max_gpus >= start:
        out.append(max_gpus)
    return out


@dataclass
class PlanResult:
    model: object
    device: str
    network: str
    networks: tuple
    framework: str
    budget: Budget
    rows: list
    grid: tuple
    skipped: tuple
    """GPU counts left out: even at the datasheet peak the run would exceed --max-days."""
    cluster: object
    """The main network's largest cluster (what --cluster-out writes)."""
    price: float | None
    deadline_days: float | None
    budget_cost: float | None
    mtbf_per_gpu_h: float | None
    checkpoint_s: float
    restart_s: float
    max_days: float
    stats: PointStats
    elapsed_s: float
    methods: tuple = METHODS
    notes: list = field(default_factory=list)
    model_ref: str | None = None
    """How the command line named the model (preset or file), for the printed search command."""
    cluster_path: str | None = None
    """The cluster file the printed search command reads (--cluster, or --cluster-out)."""
    precision: tuple = ("bf16", "tensorwise")
    """(matmul precision, FP8 recipe) of every plan."""
    profile_kind: str | None = None
    """The device kind of the profile whose measurements priced the devices (None: catalog)."""
    profile_path: str | None = None
    """How the command line named the profile, for the printed search command."""
    max_cp: int | None = None
    """--max-cp as given (None: the default by sequence length)."""
    placed: dict | None = None
    """With ``place``: what the placement pass did (``_place_rows``); None: not searched."""
    never_finish: tuple = ()
    """GPU counts left out because, with ``mtbf_per_gpu_h``, the job would fail faster than it
    progresses (``scaling.expected_wall_time``)."""
    max_micro_batch: int = MAX_MICRO_BATCH
    """The largest micro-batch tried (``--max-micro-batch``), for the printed search command."""
    moe_imbalance: float = 1.0
    """A mixture of experts' load imbalance the plans were priced at (``--moe-imbalance``)."""
    moe_dispatcher: str = "alltoall"
    """A mixture of experts' token dispatcher (``--moe-dispatcher``)."""

    # -- selections ----------------------------------------------------------------------------
    def select(self, network=None, method="all") -> list:
        net = network or self.network
        return [r for r in self.rows if r.network == net and r.method == method]

    def per_gpus(self, network=None, method="all") -> list:
        """The fastest row at each GPU count (over batches)."""
        best: dict = {}
        for r in self.select(network, method):
            if r.gpus not in best or r.days < best[r.gpus].days:
                best[r.gpus] = r
        return [best[g] for g in sorted(best)]

    def shortest(self, network=None, method="all") -> Row | None:
        rows = self.select(network, method)
        return min(rows, key=lambda r: (r.days, r.gpus)) if rows else None

    def saturation(self, network=None, method="all", within: float = 0.10) -> Row | None:
        """The fewest GPUs whose fastest plan is within ``within`` of the shortest time: adding
        GPUs beyond it buys less than that."""
        best = self.shortest(network, method)
        if best is None:
            return None
        return min((r for r in self.per_gpus(network, method) if r.days <= best.days * (1 + within)),
                   key=lambda r: r.gpus)

    def _cost(self, r: Row) -> float:
        return r.cost if r.cost is not None else r.gpu_hours

    def pareto(self, network=None, method="all") -> list:
        """Rows no other row beats on both days and cost (GPU-hours without a price), by days."""
        rows = sorted(self.select(network, method), key=lambda r: (r.days, self._cost(r)))
        front, cheapest = [], float("inf")
        for r in rows:
            if self._cost(r) < cheapest:
                front.append(r)
                cheapest = self._cost(r)
        return front

    def cheapest_within(self, days: float) -> Row | None:
        ok = [r for r in self.select() if r.days <= days]
        return min(ok, key=lambda r: (self._cost(r), r.days)) if ok else None

    def fastest_within_cost(self, cost: float) -> Row | None:
        ok = [r for r in self.select() if self._cost(r) <= cost]
        return min(ok, key=lambda r: (r.days, self._cost(r))) if ok else None

    def search_command(self, r: Row, cluster_path: str | None = None) -> str:
        """The ``autoconf search`` command that searches the same space at this plan's GPU count and
        batch (no placement search, as the planner) and finds its configuration."""
        import shlex
        m = self.model
        model_ref = self.model_ref or (m.name if m.name in _preset_names() else "MODEL.yaml")
        path = cluster_path or self.cluster_path or "CLUSTER.yaml"
        same = self.model_ref is None or m.seq_length == _seq_of(self.model_ref)
        seq = "" if same else f" --seq-length {m.seq_length}"
        prec = f" --precision {self.precision[0]}" + (f" --fp8-recipe {self.precision[1]}"
                                                     if self.precision[0] == "fp8" else "")
        extra = "" if self.max_cp is None else f" --max-cp {self.max_cp}"
        if self.max_micro_batch != MAX_MICRO_BATCH:
            extra += f" --max-micro-batch {self.max_micro_batch}"
        if self.moe_imbalance != 1.0:
            extra += f" --moe-imbalance {self.moe_imbalance:g}"
        if self.moe_dispatcher != "alltoall":
            extra += f" --moe-dispatcher {self.moe_dispatcher}"
        if self.profile_kind is not None:
            extra += f" --profile {shlex.quote(self.profile_path or 'PROFILE.json')}"
        return (f"autoconf search --model {shlex.quote(model_ref)} --cluster {shlex.quote(path)}{extra} "
                f"--gpus {r.gpus} --global-batch {r.batch}{seq} --framework {self.framework}{prec} "
                "--storage none" + ("" if self.placed is not None else " --no-place"))

    def to_dict(self) -> dict:
        sh = self.shortest()
        sat = self.saturation()
        out = {"model": self.model.to_dict(), "num_params": self.model.num_params(),
               "active_params": self.model.active_params(), "device": self.device,
               "network": self.network, "networks": list(self.networks), "framework": self.framework,
               "precision": self.precision[0], "fp8_recipe": self.precision[1] if self.precision[0] == "fp8" else None,
               "profile_device_kind": self.profile_kind, "max_cp": self.max_cp, "placement": self.placed,
               "budget": self.budget.to_dict(), "grid": list(self.grid), "skipped_gpus": list(self.skipped),
               "never_finish": list(self.never_finish), "max_micro_batch": self.max_micro_batch,
               "moe_imbalance": self.moe_imbalance, "moe_dispatcher": self.moe_dispatcher,
               "max_days": self.max_days,
               "price_per_gpu_hour": self.price, "deadline_days": self.deadline_days, "budget_cost": self.budget_cost,
               "mtbf_per_gpu_hours": self.mtbf_per_gpu_h, "checkpoint_s": self.checkpoint_s,
               "restart_s": self.restart_s, "methods": [m.to_dict() for m in self.methods],
               "rows": [r.to_dict() for r in self.rows],
               "shortest": sh.to_dict() if sh else None, "saturation": sat.to_dict() if sat else None,
               "pareto": [r.to_dict() for r in self.pareto()],
               "methods_table": self.methods_table(),
               "cluster": self.cluster.to_dict() if self.cluster is not None else None,
               "stats": dataclasses.asdict(self.stats), "elapsed_s": self.elapsed_s, "notes": list(self.notes)}
        if self.deadline_days is not None:
            r = self.cheapest_within(self.deadline_days)
            out["deadline_plan"] = r.to_dict() if r else None
        if self.budget_cost is not None:
            r = self.fastest_within_cost(self.budget_cost)
            out["budget_plan"] = r.to_dict() if r else None
        if sh is not None:
            out["search_command"] = self.search_command(sh)
        out["step_time_accuracy"] = stated_accuracy()
        out["shortest_days_range"] = self.days_range(sh) if sh is not None else None
        return out

    def days_range(self, row) -> dict | None:
        """The days of ``row`` read with the cost model's stated step-time error e
        (``catalog.stated_accuracy``; e = predicted / measured - 1): {"median": (low, high),
        "max": (low, high)}, the days over 1 + e and over 1 - e, for the median and the max |e|;
        None where none is stated. (Approximate where restarts are counted: their share of the
        days is not linear in the step time.)"""
        acc = stated_accuracy()
        if acc is None:
            return None
        return {k: (row.days / (1 + e), row.days / (1 - e) if e < 1 else math.inf)
                for k, e in ((k, acc[f"{k}_abs_error"]) for k in ("median", "max"))}

    def methods_table(self) -> list:
        """Per network and method: the shortest time, its GPUs and configuration, and how much
        longer it is than with every method."""
        out = []
        for net in self.networks:
            ref = self.shortest(net, "all")
            for m in self.methods:
                r = self.shortest(net, m.name)
                out.append({"network": net, "method": m.name, "label": m.label,
                            "days": r.days if r else None, "gpus": r.gpus if r else None,
                            "batch": r.batch if r else None,
                            "config_short": r.estimate.config.short() if r else None,
                            "peak_memory_bytes": r.estimate.peak_memory_bytes if r else None,
                            "vs_all": (r.days / ref.days) if (r and ref) else None})
        return out


def _preset_names():
    from .model import preset_names
    return preset_names()


def _seq_of(model_ref: str) -> int | None:
    from .model import load_model
    try:
        return load_model(model_ref).seq_length
    except UserError:
        return None


def plan(model, *, device: str | None = None, max_gpus: int | None = None, network: str = "ib",
         cluster=None, framework: str | None = None, tokens: float | None = None, batch_law: str = "kaplan",
         loss_law: str = "kaplan", global_batch: int | None = None, batch_factors=DEFAULT_FACTORS,
         price_per_gpu_hour: float | None = None, deadline_days: float | None = None,
         budget: float | None = None, compare_networks=("25gbe",), methods=METHODS,
         mtbf_per_gpu_h: float | None = None, checkpoint_s: float = 120.0, restart_s: float = 600.0,
         max_days: float = 365.0, max_micro_batch: int = MAX_MICRO_BATCH, progress=None, profile=None,
         precision: str = "bf16", fp8_recipe: str | None = None, max_cp: int | None = None,
         place: bool = False, place_budget_s: float = 30.0, moe_imbalance: float = 1.0,
         moe_dispatcher: str = "alltoall") -> PlanResult:
    """Sweep GPU counts x batches x methods x networks; see the module docstring. ``profile``: a
    profile from ``autoconf profile`` taken on the cluster's device kind (``planning_system``);
    ``precision``: the matmul precision of every plan, bf16 (the model's dtype) or fp8 with
    ``fp8_recipe`` (default: the framework's first recipe the device runs); ``max_cp``: the largest
    context-parallel degree (``config.cp_choices``; default by sequence length, as ``search``).
    ``place``: after the sweep, the fastest plan of each GPU count, method and network gets
    ``search``'s placement (the graph heuristic, then its local search over device order and
    uneven layer splits; the reference trainer only), within ``place_budget_s`` in all.
    ``moe_imbalance``: a mixture of experts' load imbalance (``System.moe_imbalance``, as ``search``);
    ``moe_dispatcher``: its token dispatcher (``System.moe_dispatcher``, as ``search``)."""
    from . import scaling
    from .frameworks import framework as framework_model
    t0 = time.perf_counter()
    fw = framework_model(framework)
    bud = make_budget(model, tokens, batch_law, loss_law, global_batch, batch_factors)
    for name, v in (("--price-per-gpu-hour", price_per_gpu_hour), ("--deadline", deadline_days),
                    ("--budget", budget), ("--mtbf-per-gpu", mtbf_per_gpu_h), ("--max-days", max_days)):
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise UserError(f"{name} {v!r}: must be a positive number")
    if checkpoint_s <= 0 or restart_s < 0:
        raise UserError("--checkpoint-time must be positive and --restart-time 0 or more")
    if cluster is not None:
        if device is not None:
            raise UserError("give --cluster FILE or --device NAME, not both")
        clusters = {"cluster": cluster}
        net_names: tuple = ("cluster",)
        device_name = ", ".join(cluster.device_kinds())
        per_node = cluster.node_groups[0].gpus_per_node
        top = cluster.num_devices if max_gpus is None else max_gpus
        if top > cluster.num_devices:
            raise UserError(f"--max-gpus {top}: the cluster has only {cluster.num_devices} devices")
    else:
        if device is None or max_gpus is None:
            raise UserError("give --device NAME and --max-gpus N (or --cluster FILE)")
        for n in (network, *compare_networks):
            if n not in NETWORKS:
                raise UserError(f"network {n!r}; valid: {', '.join(NETWORKS)}")
        net_names = (network,) + tuple(n for n in dict.fromkeys(compare_networks) if n != network)
        clusters = {n: synthetic_cluster(device, max_gpus, n) for n in net_names}
        device_name, per_node, top = device, NODES[device][0], max_gpus
    first = next(iter(clusters.values()))
    prof_kind = None
    if profile is not None:
        from .cost.system import _profile_device_kind
        from .profile import check_profile_matches
        check_profile_matches(profile, model)
        prof_kind = _profile_device_kind(profile)
        if prof_kind not in first.device_kinds():
            how = (f"--device {prof_kind} or a cluster file of it" if prof_kind in NODES
                   else "a cluster file of it")
            raise UserError(f"--profile was measured on {prof_kind or 'several device kinds'}; the cluster's devices "
                            f"are {', '.join(first.device_kinds())}: profile that device kind, or plan on it "
                            f"({how})")
    if precision not in ("bf16", "fp8"):
        raise UserError(f"--precision {precision!r}; valid: bf16, fp8")
    if fp8_recipe is not None and precision != "fp8":
        raise UserError(f"--fp8-recipe {fp8_recipe}: needs --precision fp8")
    from .search import precision_choices
    # the first System
    systems = {net_names[0]: planning_system(model, first, fw.name, profile, moe_imbalance, moe_dispatcher)}
    (prec,) = precision_choices(systems[net_names[0]], precision, fp8_recipe)
    # GPU counts worth sweeping: the run would take at most --max-days at the datasheet peak
    from .catalog import device_type
    flops = model.model_flops_per_token() * min(bud.plan(b).tokens for b in bud.batches)
    dtype = model.dtype if prec[0] == "bf16" else ("mxfp8" if prec[1] == "mxfp8" else "fp8")
    peak = max(device_type(k).peak(dtype) for k in first.device_kinds())  # a bound: the fastest kind
    start = flops / (max_days * 86400 * peak)
    grid = gpu_grid(top, per_node)
    skipped = tuple(g for g in grid if g < start)
    grid = [g for g in grid if g >= start]
    if not grid:
        raise UserError(f"even {top} GPUs at their datasheet peak would take more than --max-days {max_days:g} "
                        f"({flops / (top * peak) / 86400:,.0f} days): raise --max-gpus or --max-days")
    stats = PointStats()
    rows: list = []
    shared_oom: set = set()
    done, total = 0, len(net_names) * len(bud.batches) * len(grid)
    other_net: dict = {}  # (GPUs, batch) -> the best configurations on the networks done before
    never_finish: set = set()  # GPU counts whose job fails faster than it can progress

    def make_row(net: str, mname: str, g: int, b: int, e) -> Row | None:
        bp = bud.plan(b)
        work = bp.steps * e.step_time_s
        gp = None
        wall = work
        if mtbf_per_gpu_h:
            try:
                gp = scaling.expected_wall_time(work, mtbf_per_gpu_h * 3600 / g, checkpoint_s, restart_s)
            except UserError:
                never_finish.add(g)
                return None
            wall = gp.wall_s
        gh = wall / 3600 * g
        return Row(network=net, method=mname, gpus=g, batch=b, steps=bp.steps, tokens=bp.tokens, estimate=e,
                   work_days=work / 86400, days=wall / 86400, gpu_hours=gh,
                   cost=gh * price_per_gpu_hour if price_per_gpu_hour else None, goodput=gp)

    for net in net_names:
        if net not in systems:
            systems[net] = planning_system(model, clusters[net], framework=fw.name, profile=profile,
                                           moe_imbalance=moe_imbalance, moe_dispatcher=moe_dispatcher)
        system = systems[net]
        opt = PointOptimizer(system, methods, max_micro_batch, prec, max_cp)
        opt.oom = shared_oom
        prev_by_batch: dict = {}
        for g in grid:
            prev_g: list = []
            for b in bud.batches:
                if b % 1:
                    continue
                seeds = prev_by_batch.get(b, []) + prev_g + other_net.get((g, b), [])
                best, st = opt.run(g, b, seeds)
                stats.add(st)
                found = list(dict.fromkeys(e.config for e in best.values() if e is not None))
                other_net[(g, b)] = other_net.get((g, b), []) + found
                prev_by_batch[b] = found
                prev_g = found
                for mname, e in best.items():
                    row = make_row(net, mname, g, b, e) if e is not None else None
                    if row is not None:
                        rows.append(row)
                done += 1
                if progress:
                    progress(done, total)
    notes = []
    placed = None
    if place and fw.name != "reference":
        notes.append(f"placement not searched: framework {fw.name} runs its own rank order and even layer splits "
                     "(as in `search`)")
    elif place:
        placed = _place_rows(rows, systems, methods, make_row, place_budget_s)
        notes.append(f"placement searched on the fastest plan of each GPU count, method and network: "
                     f"{placed['improved']} of {placed['tried']} configurations improved, by up to "
                     f"{100 * placed['best_gain']:.1f}% ({placed['seconds']:.1f} s)")
    gone = sorted(never_finish)
    if not any(r.network == net_names[0] and r.method == "all" for r in rows):
        if gone:
            raise UserError(f"--mtbf-per-gpu {mtbf_per_gpu_h:g} h: even on {gone[0]:,} GPUs the job fails every "
                            f"{mtbf_per_gpu_h / gone[0]:.2g} h on average, faster than a restart and half a checkpoint "
                            "interval: it would never finish; raise --mtbf-per-gpu or lower --restart-time / "
                            "--checkpoint-time")
        raise UserError(f"no configuration of {model.name} fits in memory on {device_name} at any GPU count up to "
                        f"{top:,}: raise --max-gpus, or plan on a device with more memory")
    if gone:
        notes.append(f"{', '.join(f'{g:,}' for g in gone)} GPUs left out: with --mtbf-per-gpu {mtbf_per_gpu_h:g} h "
                     "the job fails faster than a restart and half a checkpoint interval, so it would never finish")
    if skipped:
        notes.append(f"GPU counts below {grid[0]:,} left out: even at the datasheet peak the run would take more than "
                     f"{max_days:g} days (--max-days)")
    if not fw.layered_grad_accum and "breadth_first" not in fw.schedules:
        notes.append(f"framework {fw.name} has no layered accumulation: those rows equal the ones without it")
    if model.is_moe:
        routing = ("routing perfectly balanced (--moe-imbalance 1)" if moe_imbalance == 1.0 else
                   f"the busiest expert rank {moe_imbalance:g}x its balanced share (--moe-imbalance)")
        a2a = ("exposed, or under another micro-batch's computation where ep_comm_overlap pairs the passes "
               "(Megatron-Core's combined 1F1B, DualPipe's idea)" if "ep_comm_overlap" in fw.knobs
               else "exposed (this framework does not overlap them)")
        notes.append(f"mixture of experts: {routing}, the expert-parallel all-to-alls {a2a}, the scaling laws read at "
                     "its active parameters "
                     f"({model.active_params() / 1e9:,.3g}B of {model.num_params() / 1e9:,.4g}B)")
    if prec[0] == "fp8":
        notes.append(f"FP8 matmuls ({prec[1]} scaling) in every plan: faster GEMMs and different numerics than "
                     f"{model.dtype}; the attention core and the output layer stay in {model.dtype}")
    if profile is not None:
        notes.append(f"device compute from the profile measured on {prof_kind} (per-layer times where it measured "
                     "this model, its GEMM table otherwise) and its collective efficiency; its measured links "
                     "replace the cluster's on the first hosts, in order (as `search --profile` does)")
    return PlanResult(model=model, device=device_name, network=net_names[0], networks=net_names,
                      framework=fw.name, budget=bud, rows=rows, grid=tuple(grid), skipped=skipped,
                      cluster=clusters[net_names[0]], price=price_per_gpu_hour, deadline_days=deadline_days,
                      budget_cost=budget, mtbf_per_gpu_h=mtbf_per_gpu_h, checkpoint_s=checkpoint_s,
                      restart_s=restart_s, max_days=max_days, stats=stats, elapsed_s=time.perf_counter() - t0,
                      methods=tuple(methods), notes=notes, precision=prec, profile_kind=prof_kind,
                      max_cp=max_cp, placed=placed, never_finish=tuple(gone),
                      max_micro_batch=max_micro_batch, moe_imbalance=moe_imbalance, moe_dispatcher=moe_dispatcher)


def _place_rows(rows: list, systems: dict, methods, make_row, budget_s: float) -> dict:
    """``search``'s placement (``place.Placer``: the heuristic, then its local search) on the
    fastest row of each GPU count, method and network, in place of its estimate where it is
    faster and fits; each distinct configuration once, all within ``budget_s`` (an equal share of
    what is left each)."""
    from .place import Placer
    t0 = time.perf_counter()
    targets: dict = {}  # (network, method, GPUs) -> index of the fastest row
    for i, r in enumerate(rows):
        k = (r.network, r.method, r.gpus)
        if k not in targets or r.days < rows[targets[k]].days:
            targets[k] = i
    done: dict = {}  # (network, config) -> a faster placed estimate, or None
    placers: dict = {}
    todo = sorted(targets.values())
    best_gain = 0.0
    for n, i in enumerate(todo):
        r = rows[i]
        key = (r.network, r.estimate.config)
        if key not in done:
            share = (budget_s - (time.perf_counter() - t0)) / max(1, len(todo) - n)
            pl = placers.setdefault((r.network, r.gpus), Placer(systems[r.network], r.gpus))
            e, _ = pl.improve(pl(r.estimate.config), max_evaluations=100,
                              deadline=time.perf_counter() + max(share, 0.0))
            done[key] = e if (e.fits and e.step_time_s < r.estimate.step_time_s) else None
        e = done[key]
        if e is not None:
            best_gain = max(best_gain, 1 - e.step_time_s / r.estimate.step_time_s)
            rows[i] = make_row(r.network, r.method, r.gpus, r.batch, e)
    return {"tried": len(done), "improved": sum(e is not None for e in done.values()), "best_gain": best_gain,
            "seconds": time.perf_counter() - t0}


# -- input parsing -------------------------------------------------------------------------------

_COUNT = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15}
_DURATION = {"s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0,
             "y": 365 * 86400.0}


def parse_count(text: str, what: str) -> float:
    """``2T``, ``1.4e12``, ``300B``, ``10M``: a positive number with an optional K/M/B/T/P suffix."""
    import re
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKMBGTP]?)\s*", str(text))
    if not m:
        raise UserError(f"{what} {text!r}: expected a number with an optional suffix K, M, B, T or P (e.g. 2T)")
    v = float(m.group(1)) * _COUNT[m.group(2)]
    if not (math.isfinite(v) and v > 0):
        raise UserError(f"{what} {text!r}: must be a positive finite number")
    return v


def parse_duration(text: str, what: str, default_unit: str = "d", allow_zero: bool = False) -> float:
    """``60d``, ``8w``, ``1440h``, ``2min``, ``90s``, ``1.5y``; a bare number is in ``default_unit``.
    Seconds; positive, or zero too with ``allow_zero``."""
    import re
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-z]*)\s*", str(text))
    if not m or (m.group(2) or default_unit) not in _DURATION:
        raise UserError(f"{what} {text!r}: expected a duration like 60d, 8w, 1440h, 10min or 90s "
                        f"(units: {', '.join(_DURATION)})")
    v = float(m.group(1)) * _DURATION[m.group(2) or default_unit]
    if not (math.isfinite(v) and (v > 0 or (allow_zero and v == 0))):
        want = "finite duration of 0 or more" if allow_zero else "positive finite duration"
        raise UserError(f"{what} {text!r}: must be a {want}")
    return v


def _float_list(text: str, what: str) -> tuple:
    try:
        out = tuple(float(x) for x in str(text).split(","))
    except ValueError:
        raise UserError(f"{what} {text!r}: expected numbers separated by commas, like 0.25,0.5,1,2") from None
    if not out or any(not (math.isfinite(x) and x > 0) for x in out):
        raise UserError(f"{what} {text!r}: every factor must be a positive number")
    return out


# -- output ----------------------------------------------------------------------------------------

_SCHED = {"gpipe": "gp", "1f1b": "1f1b", "interleaved": "il", "breadth_first": "bf"}


def compact(c: ParallelConfig) -> str:
    """dp/pp/tp, cp<k> (context parallel), ep<k> (expert parallel), micro-batch, schedule (gp,
    1f1b, il<v>, bf<v>; L: layered), ZeRO, recompute (sel+: selective with Megatron-LM's recompute
    modules), sp; ep<k>o: all-to-alls overlapped (``ep_comm_overlap``)."""
    s = _SCHED[c.schedule] + (str(c.virtual_stages) if c.virtual_stages > 1 else "")
    if c.layered_grad_accum and c.schedule != "breadth_first":
        s += "L"
    ep = f"ep{c.ep}" + ("o" if c.ep_comm_overlap else "")
    parts = ([f"{c.dp}/{c.pp}/{c.tp}"] + ([f"cp{c.cp}"] if c.cp > 1 else []) + ([ep] if c.ep > 1 else [])
             + [f"b{c.micro_batch_size}", s])
    if c.zero_stage:
        parts.append(f"z{c.zero_stage}")
    if c.recompute != "none":
        parts.append(("sel" + ("+" if c.recompute_modules else "")) if c.recompute == "selective" else "full")
    if c.sequence_parallel:
        parts.append("sp")
    if c.dp_all_reduce == "hierarchical":
        parts.append("hier")
    return " ".join(parts)


LEGEND = ("config: dp/pp/tp, cp context parallel, ep expert parallel (o: all-to-alls overlapped), micro-batch b, "
          "schedule (gp gpipe, 1f1b, il<v> interleaved, bf<v> breadth-first; L layered), z ZeRO stage, sel/full "
          "recompute (sel+: with recompute modules), sp sequence parallel")


def _num(x: float) -> str:
    for unit, f in (("P", 1e15), ("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= f:
            return f"{x / f:.3g}{unit}"
    return f"{x:.3g}"


def _days(d: float) -> str:
    """Days for the tables: one decimal, two significant figures below one day (a run of hours
    would read 0.0 otherwise), none from 1,000."""
    if d < 1:
        return f"{d:.2g}"
    return f"{d:,.1f}" if d < 1000 else f"{d:,.0f}"


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f}"


def write_plots(r: PlanResult, directory: str) -> list:
    """days vs GPUs per method (and network), cost vs days with the Pareto front: PNG and SVG."""
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    written = []

    def save(fig, name):
        from .outputs import write_atomic
        for ext in ("png", "svg"):
            path = os.path.join(directory, f"{name}.{ext}")
            write_atomic(path, lambda f: fig.savefig(f, format=ext, dpi=120, bbox_inches="tight"), binary=True)
            written.append(path)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    styles = ["-", "--", ":", "-."]
    for ni, net in enumerate(r.networks):
        for meth in r.methods:
            if ni > 0 and meth.name not in ("all", "baseline"):
                continue
            rows = r.per_gpus(net, meth.name)
            if rows:
                ax.plot([x.gpus for x in rows], [x.days for x in rows], styles[ni % 4], marker="o", markersize=3,
                        label=f"{meth.label} ({net})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("days to train")
    ax.set_title(f"{r.model.name} on {r.device}: {_num(r.budget.tokens)} tokens, batch law {r.budget.law}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, "days_vs_gpus")

    fig, ax = plt.subplots(figsize=(8, 5))
    rows = r.select()
    ax.scatter([x.days for x in rows], [r._cost(x) for x in rows], s=12, alpha=0.6, label="GPU count x batch")
    front = r.pareto()
    ax.plot([x.days for x in front], [r._cost(x) for x in front], "r-o", markersize=4, label="Pareto front")
    for x in front:
        ax.annotate(f"{x.gpus:,}", (x.days, r._cost(x)), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if r.deadline_days is not None:
        ax.axvline(r.deadline_days, color="grey", linestyle="--", label=f"deadline {r.deadline_days:g} d")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("days to train")
    ax.set_ylabel("cost ($)" if r.price else "GPU-hours")
    ax.set_title(f"{r.model.name}: time against cost ({r.network}, every method)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, "cost_vs_days")
    return written


# -- the command -----------------------------------------------------------------------------------

def add_plan_parser(sub):
    from .config import FP8_RECIPES
    from .frameworks import FRAMEWORK_NAMES
    p = sub.add_parser("plan", help="how many GPUs, how long, what cost: the shortest time to train a model")
    p.add_argument("--model", required=True, help="preset name (see `autoconf models`), model YAML, or HF config.json")
    p.add_argument("--seq-length", type=int, help="override the model's sequence length")
    p.add_argument("--device", help=f"GPU kind of a synthetic DGX-style cluster ({', '.join(NODES)})")
    p.add_argument("--max-gpus", type=int, help="the largest GPU count worth considering")
    p.add_argument("--network", default="ib", help="ib (InfiniBand, a NIC per GPU), 100gbe or 25gbe (one "
                   "Ethernet NIC per node) (default ib)")
    p.add_argument("--compare-networks", default="25gbe",
                   help="slower networks to run the same sweep on, comma-separated, or none (default 25gbe)")
    p.add_argument("--cluster", help="a cluster file instead of --device (GPU counts up to its size)")
    p.add_argument("--framework", default="reference", choices=FRAMEWORK_NAMES,
                   help="the runtime that will run the plan (default: reference)")
    p.add_argument("--profile", help="a profile from `autoconf profile` taken on the cluster's device kind: its "
                   "measured compute and collective efficiency price the devices, its links the first hosts (as "
                   "`search --profile`)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp8"),
                   help="matmul precision of every plan (default bf16, the model's dtype)")
    p.add_argument("--fp8-recipe", default=None, choices=FP8_RECIPES,
                   help="FP8 scaling with --precision fp8 (default: the framework's first the device runs)")
    p.add_argument("--place", action="store_true",
                   help="search's placement (device order, uneven layer splits) on the fastest plan of each GPU "
                   "count (reference trainer; up to 30 s more)")
    p.add_argument("--max-cp", type=int, default=None,
                   help="largest context-parallel degree (default: seq_length / 4096, at least 1)")
    p.add_argument("--tokens", help="tokens to train on, e.g. 2T (default: 20 per parameter, Chinchilla)")
    p.add_argument("--batch-law", default="kaplan", help="kaplan (critical batch), deepseek (B_opt(C)) or "
                   "fixed (--global-batch) (default kaplan)")
    p.add_argument("--loss-law", default="kaplan", help="kaplan or chinchilla: the loss B_crit is read at "
                   "(default kaplan, the loss B_crit was fitted to)")
    p.add_argument("--global-batch", type=int, help="sequences per step (--batch-law fixed)")
    p.add_argument("--batch-factors", default=BATCH_FACTORS_DEFAULT,
                   help="batches swept, as multiples of B_crit (kaplan; default 0.25,0.5,1,2)")
    p.add_argument("--price-per-gpu-hour", type=float, help="price of one GPU-hour (costs in that currency)")
    p.add_argument("--deadline", help="the cheapest plan finishing within it, e.g. 60d, 8w")
    p.add_argument("--budget", help="the fastest plan costing at most this, e.g. 20M (needs --price-per-gpu-hour)")
    p.add_argument("--mtbf-per-gpu", help="mean time between failures of one GPU (with its share of the node), "
                   "e.g. 50000h: restarts and checkpoints enter the days")
    p.add_argument("--checkpoint-time", default="2min", help="time to write a checkpoint (default 2min)")
    p.add_argument("--restart-time", default="10min", help="time to restart after a failure (default 10min)")
    p.add_argument("--max-days", default="365", help="leave out GPU counts that would take longer even at the "
                   "datasheet peak (default 365 days)")
    p.add_argument("--max-micro-batch", type=int, default=MAX_MICRO_BATCH)
    p.add_argument("--moe-imbalance", type=float, default=1.0,
                   help="mixture of experts: the busiest expert rank's tokens over the balanced share "
                        "(default 1.0, perfectly balanced; as `search`)")
    p.add_argument("--moe-dispatcher", default="alltoall", choices=MOE_DISPATCHERS,
                   help="mixture of experts: the token dispatcher, alltoall or deepep (as `search`)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--plot", metavar="DIR", help="write days_vs_gpus and cost_vs_days as PNG and SVG")
    p.add_argument("--cluster-out", metavar="FILE", help="write the synthetic cluster file of the main network")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def cmd_plan(args) -> int:
    import json
    import sys

    from .model import load_model
    from .outputs import check_file, fail_after, side_output, write_text
    if args.seq_length is not None and args.seq_length <= 0:
        raise UserError(f"--seq-length {args.seq_length}: must be a positive integer")
    model = load_model(args.model, seq_length=args.seq_length)
    cluster = None
    if args.cluster:
        from .cluster import load_cluster
        cluster = load_cluster(args.cluster)
    profile = None
    if args.profile:
        from .profile import load_profile
        profile = load_profile(args.profile)
    if args.max_gpus is not None and args.max_gpus <= 0:
        raise UserError(f"--max-gpus {args.max_gpus}: must be a positive integer")
    if args.global_batch is not None and args.global_batch <= 0:
        raise UserError(f"--global-batch {args.global_batch}: must be a positive integer")
    if args.max_cp is not None and args.max_cp <= 0:
        raise UserError(f"--max-cp {args.max_cp}: must be a positive integer")
    if args.max_micro_batch <= 0:
        raise UserError(f"--max-micro-batch {args.max_micro_batch}: must be a positive integer")
    compare = () if args.compare_networks.strip().lower() in ("", "none") else tuple(
        x.strip() for x in args.compare_networks.split(","))
    for n in (args.network, *compare):
        if n not in NETWORKS:
            raise UserError(f"network {n!r}; valid: {', '.join(NETWORKS)}")
    tokens = parse_count(args.tokens, "--tokens") if args.tokens else None
    price = args.price_per_gpu_hour
    if price is not None and not (math.isfinite(price) and price > 0):
        raise UserError(f"--price-per-gpu-hour {price}: must be a positive number")
    budget = parse_count(args.budget, "--budget") if args.budget else None
    if budget is not None and price is None:
        raise UserError("--budget is in money: give --price-per-gpu-hour too")
    deadline = parse_duration(args.deadline, "--deadline") / 86400 if args.deadline else None
    mtbf = parse_duration(args.mtbf_per_gpu, "--mtbf-per-gpu", "h") / 3600 if args.mtbf_per_gpu else None
    ckpt = parse_duration(args.checkpoint_time, "--checkpoint-time", "s")
    restart = parse_duration(args.restart_time, "--restart-time", "s", allow_zero=True)
    max_days = parse_duration(args.max_days, "--max-days") / 86400
    factors = _float_list(args.batch_factors, "--batch-factors")
    if args.batch_factors != BATCH_FACTORS_DEFAULT and args.batch_law != "kaplan":
        raise UserError(f"--batch-factors {args.batch_factors}: they scale the critical batch of --batch-law kaplan; "
                        f"--batch-law {args.batch_law} sets the batch itself")
    if args.plot:
        from .plots import check_plotting
        check_plotting(args.plot)
    if args.cluster_out:
        check_file(args.cluster_out, "--cluster-out")
    bar = None
    if not args.quiet and not args.json and sys.stderr.isatty():
        from rich.progress import Progress
        bar = Progress(transient=True)
        bar.add_task("plan", total=None)
        bar.start()

    def progress(done, total):
        if bar is not None:
            bar.update(bar.task_ids[0], completed=done, total=total)
    try:
        r = plan(model, device=args.device, max_gpus=args.max_gpus, network=args.network, cluster=cluster,
                 framework=args.framework, tokens=tokens, batch_law=args.batch_law, loss_law=args.loss_law,
                 global_batch=args.global_batch, batch_factors=factors, price_per_gpu_hour=price,
                 deadline_days=deadline, budget=budget, compare_networks=compare if cluster is None else (),
                 mtbf_per_gpu_h=mtbf, checkpoint_s=ckpt, restart_s=restart, max_days=max_days,
                 max_micro_batch=args.max_micro_batch, progress=progress, profile=profile,
                 precision=args.precision, fp8_recipe=args.fp8_recipe, max_cp=args.max_cp, place=args.place,
                 moe_imbalance=args.moe_imbalance, moe_dispatcher=args.moe_dispatcher)
    finally:
        if bar is not None:
            bar.stop()
    r.model_ref = args.model
    r.cluster_path = args.cluster or args.cluster_out
    r.profile_path = args.profile
    # the plots and the cluster file are written beside the plan: where one cannot be, the plan is
    # still printed, then the reason (exit 2)
    written, failed = [], []
    if args.plot:
        written, why = side_output("--plot", args.plot, lambda: write_plots(r, args.plot), [])
        failed.append(why)
    if args.cluster_out:
        failed.append(side_output("--cluster-out", args.cluster_out,
                                  lambda: write_text(args.cluster_out, cluster_yaml(r.cluster)))[1])
    if args.json:
        doc = r.to_dict()
        doc["plots"] = written
        sys.stdout.write(json.dumps(doc, indent=2, default=float) + "\n")
    else:
        from rich.console import Console
        con = Console(width=min(Console().width, 80))  # the report is laid out for 80 columns
        from .report import plan_report
        plan_report(r, con)
        if written:
            con.print(f"plots: {', '.join(written)}")
        if args.cluster_out and not failed[-1]:
            con.print(f"cluster file: {args.cluster_out} (pass it to `autoconf search --cluster`)")
    fail_after(failed)
    return 0
