"""System: the machine a configuration runs on, as the cost model sees it. Build once, estimate many.

A System holds what does not change between configurations: the model, the topology (from a
cluster file, else from the profile's measured links), the rates of each device kind and the
calibration. Rates come from the profile where it measured the device kind in question (see
:meth:`System.measured_for`), else from the device catalog's datasheet figures through the roofline
of ``compute``. Every "measured, else datasheet" choice of the cost model is made here, and only
here; the modules that compose the step time (``schedule_time``, ``tensor_parallel``,
``data_parallel``, ``stage_memory``) ask the System for rates and never look at the profile.

What the framework does with a configuration (its ZeRO layout, gradient precision, padded
vocabulary: no rate in it) is the System's :class:`~autoconf.cost.policy.Policy`,
``System.policy``.

Pure: no torch, no I/O; the only state is a cache of pure results.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from autoconf.cost import comm, measured
from autoconf.cost.activations import layer_activation_bytes
from autoconf.cost.compute import (
    BF16_OPTIMIZER_UPDATE,
    adamw_bytes_per_param,
    block_times,
    embedding_times,
    head_times,
    optimizer_s,
    with_host,
)
from autoconf.cost.fp8 import Fp8
from autoconf.cost.measured import (
    activation_bytes,
    collective_efficiency,
    fp8_gemm_efficiency,
    gemm_efficiency,
    memory_time,
    optimizer_seconds_per_param,
    pipeline_action_overhead,
    tp_comm_times,
)
from autoconf.cost.measured import block_times as measured_block
from autoconf.cost.pipeline import Sharing
from autoconf.cost.policy import Policy, check_moe_options
from autoconf.cost.roofline import LayerTimes, Roofline
from autoconf.errors import UserError
from autoconf.space.config import module_key
from autoconf.specs.devices import NEUTRAL, CollectiveTuning, device_type
from autoconf.specs.frameworks import framework as framework_model
from autoconf.specs.measured_graph import measured_device_links, topology_graph
from autoconf.specs.model import ModelSpec
from autoconf.specs.topology import Topology

_OPS = {comm.all_reduce_s: "all_reduce", comm.all_gather_s: "all_gather", comm.reduce_scatter_s: "reduce_scatter"}
"""Profile name of each collective. ``comm.reduce_scatter_s`` *is* ``comm.all_gather_s`` (the same
ring cost), so that key maps to "reduce_scatter": an all-gather looks up the measured
reduce-scatter efficiency."""


@dataclass
class System:
    """What does not change between configurations: links, devices, measured data. Build once."""

    model: ModelSpec
    cluster: object = None
    profile: object = None
    calibration: object = None
    topology: Topology = None
    framework: object = None
    """The training framework's behaviour (``frameworks.Framework``, or its name; None: the
    reference trainer)."""
    moe_imbalance: float = 1.0
    """Mixture-of-experts load imbalance: the busiest expert rank's tokens over the balanced share
    (1.0: perfectly balanced, as forced-balance benchmarks run; give a measured figure otherwise).
    ``cost.moe``."""
    moe_dispatcher: str = "alltoall"
    """The token dispatcher the configurations ``search`` and ``plan`` make carry
    (``config.ParallelConfig.moe_dispatcher``: one the framework runs); an estimate prices its
    configuration's own."""
    _cache: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.framework is None or isinstance(self.framework, str):
            self.framework = framework_model(self.framework)
        check_moe_options(self.model, self.framework, self.moe_imbalance, self.moe_dispatcher)
        self.policy = Policy(self.model, self.framework)
        """The framework's rules applied to a configuration (``cost.policy``)."""
        if self.topology is None:
            self.topology = system_topology(self.cluster, self.profile)
        self.num_devices = self.topology.num_devices
        self.profile_kind = None
        if self.profile is not None:
            kinds = {self.topology.kind_of[i] for i in range(self.num_devices)}
            self.profile_kind = profile_device_kind(self.profile) or (kinds.pop() if len(kinds) == 1 else None)
            self._gemm_eff = lambda m, n, k: gemm_efficiency(self.profile, m, n, k)

    # -- where the profile applies ------------------------------------------------------------

    def measured_for(self, kind: str | None = None) -> bool:
        """Whether the profile's measurements apply to devices of ``kind`` (the kind it was taken
        on). ``kind=None``: measurements that do not depend on the device (activation bytes,
        collective efficiency, host core counts) -- whether there is a profile at all."""
        return self.profile is not None and (kind is None or kind == self.profile_kind)

    def measured_everywhere(self, stage_kinds) -> bool:
        """Whether every pipeline stage runs on the profiled device kind alone."""
        return self.profile is not None and all(k == [self.profile_kind] for k in stage_kinds)

    def cached(self, key, fn):
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = fn()
        return hit

    # -- compute rates ------------------------------------------------------------------------

    def roofline(self, kind: str) -> Roofline:
        """The catalog roofline of ``kind``, with the profile's GEMM efficiency table where measured."""
        key = ("rf", kind)
        if key not in self._cache:
            eff, att = self._gemm_eff if self.measured_for(kind) else None, self.framework.attention_kernel
            self._cache[key] = Roofline.of(device_type(kind), self.model.dtype, eff, self._memory_time(kind), att)
        return self._cache[key]

    def gemm_roofline(self, kind: str, tf32: bool = False) -> Roofline:
        """:meth:`roofline`, or with ``tf32`` the same device at its TF32 tensor-core peak (every
        byte still fp32: the kernels' traffic is the model's dtype's). A one-line error where the
        device has no TF32 units."""
        if not tf32:
            return self.roofline(kind)

        def make():
            dev = device_type(kind)
            if "tf32" not in dev.peak_flop_per_s:
                raise UserError(f"device {kind} has no TF32 tensor cores (precision tf32); use precision bf16")
            return dataclasses.replace(self.roofline(kind), peak_flop_per_s=dev.peak("tf32"))
        return self.cached(("rf32", kind), make)

    def _memory_time(self, kind: str, dtype: str | None = None):
        """The profile's measured memory-bound kernel time on ``kind`` in ``dtype`` (default the
        model's; ``measured.memory_time``), None where it measured none. (A profile of devices
        outside the catalog records no kind: its entries are the profiled kind's.)"""
        if not self.measured_for(kind):
            return None
        return memory_time(self.profile, kind if profile_device_kind(self.profile) else None,
                           dtype or self.model.dtype)

    def cpu_share(self, kind: str) -> float:
        """How much slower a CPU rank computes because its host's cores are shared: with more
        ranks on a host than it has cores (the profile's host record; ranks run one thread each,
        as the launchers set OMP_NUM_THREADS=1), the scheduler gives each busy rank cores/ranks of
        a core. 1.0 for accelerators, without a profile, or when every rank has its own core."""
        if kind != "cpu" or not self.measured_for():
            return 1.0

        return self.cached(("cpushare",), lambda: host_cpu_share(self.profile, self.topology))

    def cpu_sharing(self, stage_devs):
        """How the CPU ranks of a configuration share their machines' cores, for the schedule
        simulation (``pipeline.Sharing``: processor sharing instead of the fixed ``cpu_share``);
        ``stage_devs[d]``: the devices of pipeline device d. None where no CPU rank shares cores.

        A device's machine is its host's in the profile (hosts with one boot id are one machine).
        A host the profile does not name is its own machine, given the cores at which its devices,
        all computing, run at the fixed share (so that a full load is priced as before)."""
        if self.cpu_share("cpu") <= 1.0:
            return None

        return self.cached(("cpusharing", tuple(map(tuple, stage_devs))),
                           lambda: cpu_ranks_sharing(self.profile, self.topology, self.cpu_share("cpu"), stage_devs))

    def block(self, kind: str, b: int, tp: int, sp: bool, recompute: str, cp: int = 1, fp8: str | None = None,
              compiled: bool = False, moe=None, accumulates: bool = True, bf16_optimizer: bool = False,
              modules: tuple = (), tf32: bool = False) -> LayerTimes:
        """One transformer block shard per micro-batch on ``kind``: the profile's measured layer
        times (``measured.block_times``; measured in the model's dtype over the whole sequence, so
        only for a dense block at cp = 1 without FP8), else the roofline per op
        (``compute.block_times``); at the CPU time-share. ``fp8``: the FP8 recipe of the linear
        layers (None: the model's dtype); ``moe``: a mixture-of-experts block's MLP
        (``compute.Moe``, from ``moe.moe_shape``). ``accumulates``: the step adds micro-batches'
        weight gradients into ``.grad`` (more than one micro-batch, gradients not reduced away
        after each backward), which a framework with ``grad_accumulation_kernel`` pays for;
        ``bf16_optimizer``: DeepSpeed's BF16 optimizer also adds every micro-batch's gradients into
        its own copies (:meth:`bf16_optimizer`). ``modules``: what selective recomputation re-runs
        (``config.RECOMPUTE_MODULES``; empty: the attention core, as profiles measure it).
        ``tf32``: an fp32 model's GEMMs on TF32 tensor cores (:meth:`gemm_roofline`)."""
        def make():
            if (self.measured_for(kind) and cp == 1 and fp8 is None and not compiled and moe is None and not modules
                    and not tf32):
                got = measured_block(self.profile, self.model, b, tp, recompute)
                if got:
                    rc = got[0] if recompute == "full" else 0.0
                    return LayerTimes(got[0], got[1], rc)
            f8 = None if fp8 is None else Fp8(self.fp8_roofline(kind, fp8), fp8, self.framework.fp8_host_ops,
                                              recast=not self.framework.fp8_saves_inputs,
                                              eager=self.framework.fp8_eager_quantize)
            return block_times(self.model, b, tp, sp, recompute, self.gemm_roofline(kind, tf32), self.policy.host_cost(kind),
                               cp=cp, fp8=f8, compiled=compiled, moe=moe, ring_math=self.framework.ring_math,
                               unfused_softmax=self.policy.unfused_softmax(b, tp, cp),
                               eager_elementwise=self.framework.eager_elementwise,
                               grad_accumulation=self.framework.grad_accumulation_kernel and accumulates,
                               grad_update=BF16_OPTIMIZER_UPDATE if bf16_optimizer else (0.0, 0), modules=modules,
                               op_checkpoint=self.framework.op_selective_checkpoint)
        return self.cached(("block", kind, b, tp, sp, recompute, cp, fp8, compiled, moe, accumulates, bf16_optimizer,
                            modules, tf32),
                           lambda: _shared(make(), self.cpu_share(kind)))

    def fp8_roofline(self, kind: str, recipe: str) -> Roofline:
        """The roofline of FP8 GEMMs on ``kind``: the catalog's FP8 peak (MXFP8's for the mxfp8
        recipe) at its FP8 GEMM efficiency; a profile's measured FP8 GEMM table where it has one.
        A one-line error where the device has no such tensor cores."""
        def make():
            profile = self.profile if self.measured_for(kind) else None
            # the scaling and casts around FP8 GEMMs run in fp32 (the model's dtype where the
            # profile has no fp32 curve)
            return fp8_roofline_of(kind, recipe, profile, self._memory_time(kind, "fp32") or self._memory_time(kind))
        return self.cached(("rf8", kind, recipe), make)

    def edge(self, kind: str, b: int, tp: int, which: str, cp: int = 1, tf32: bool = False) -> LayerTimes:
        """The embedding (``which="embedding"``) or output layer (``"head"``) shard per micro-batch,
        measured or by roofline as :meth:`block` (on the rank's s/cp tokens; the output layer in
        the model's dtype also under FP8, as the frameworks keep it by default; on TF32 tensor
        cores with ``tf32``)."""
        def make():
            if self.measured_for(kind) and cp == 1 and not tf32:
                fn = measured.embedding_times if which == "embedding" else measured.head_times
                got = fn(self.profile, self.model, b, tp)
                if got:
                    return LayerTimes(got[0], got[1])
            fn = embedding_times if which == "embedding" else head_times
            return with_host(fn(self.policy.model_at(tp, cp), b, tp, self.gemm_roofline(kind, tf32)), which,
                             self.policy.host_cost(kind))
        return self.cached((which, kind, b, tp, cp, tf32), lambda: _shared(make(), self.cpu_share(kind)))

    def layer_activations(self, c, mask: int) -> dict:
        """Activation bytes one block saves per micro-batch, by part (``activations``, after
        Korthikanti et al., arXiv 2205.05198); ``total`` replaced by the profile's measurement
        (``measured.activation_bytes``) when it has one."""
        fp8_inputs = c.precision == "fp8" and self.framework.fp8_saves_inputs
        mods = module_key(c)

        def make():
            kw = {"cp": c.cp, "fp8_inputs": fp8_inputs, "fused_glu": self.framework.fused_glu, "modules": mods,
                  "op_checkpoint": self.framework.op_selective_checkpoint}
            if self.measured_for() and not mods:  # (profiles measure the attention core's recompute)
                got = activation_bytes(self.profile, self.model, c.micro_batch_size, c.tp, c.sequence_parallel,
                                       c.recompute)
                if got:  # measured over the whole sequence in the model's dtype: scaled as the formula is
                    # (the measured block is priced as it ran, as its time is: no softmax fallback)
                    base = layer_activation_bytes(self.model, c.micro_batch_size, c.tp, c.sequence_parallel,
                                                  c.recompute, mask, **kw)
                    full = layer_activation_bytes(self.model, c.micro_batch_size, c.tp, c.sequence_parallel,
                                                  c.recompute, mask)["total"]
                    return {**base, "total": float(got) * base["total"] / full if full else float(got)}
            return layer_activation_bytes(self.model, c.micro_batch_size, c.tp, c.sequence_parallel, c.recompute,
                                          mask, **kw, fp32_softmax=self.policy.unfused_softmax(c.micro_batch_size, c.tp, c.cp))
        return self.cached(("act", c.micro_batch_size, c.tp, c.sequence_parallel, c.recompute, mask, c.cp, fp8_inputs,
                            mods), make)

    # -- memory-bound rates: optimizer step and bucket copies ---------------------------------

    def optimizer_rate(self, kind: str) -> float:
        """The profile's measured AdamW seconds per parameter on ``kind``; -1.0 when not measured."""
        if not self.measured_for(kind):
            return -1.0
        return self.cached(("optrate", kind), lambda: optimizer_seconds_per_param(self.profile, kind) or -1.0)

    def optimizer_time(self, kind: str, num_params: float) -> float:
        """AdamW step over ``num_params`` local parameters on ``kind``: measured seconds per
        parameter, else memory-bound (``compute.optimizer_s``); at the CPU time-share."""
        rate = self.optimizer_rate(kind)
        if rate > 0:
            return num_params * rate * self.cpu_share(kind)
        fw = self.framework
        return optimizer_s(num_params, self.model.dtype != "fp32" and fw.master_weights, self.roofline(kind),
                           self.model.dtype_bytes, foreach=fw.optimizer_foreach and kind != "cpu") * self.cpu_share(kind)

    def copy_time(self, kinds, nbytes: float) -> float:
        """Seconds to stream ``nbytes`` through memory (read + write counted separately) on the slowest
        of ``kinds``: the profile's AdamW step gives the measured bandwidth (its traffic per parameter
        is known, see compute.optimizer_s), else the catalog's memory bandwidth."""
        worst = 0.0
        for kind in kinds:
            rate = self.optimizer_rate(kind)
            if rate > 0:  # the profiler steps torch.optim.AdamW on the model's dtype: foreach on a GPU
                gpu = kind != "cpu"
                t = nbytes * rate / adamw_bytes_per_param(not gpu and self.model.dtype != "fp32",
                                                          self.model.dtype_bytes, foreach=gpu)
            else:
                t = self.roofline(kind).elementwise(nbytes, kernels=0)
            worst = max(worst, t * self.cpu_share(kind))
        return worst

    # -- communication and runtime measurements -----------------------------------------------

    def collective_efficiency(self, fn, n: int, cross_host: bool | None = None) -> float:
        """Measured bus-bandwidth efficiency of collective ``fn`` (a ``comm`` function) for groups
        of n ranks, at most 1.0; 1.0 without a profile measurement. ``cross_host``: from groups
        that span hosts (True) or lie in one (False) where the profile measured such groups (the
        library's overhead weighs differently on a fast intra-host link and a slow NIC)."""
        if not self.measured_for() or n < 2:
            return 1.0

        def make():
            eff = collective_efficiency(self.profile, _OPS[fn], n, cross_host)
            return min(1.0, eff) if eff and eff > 0 else 1.0
        return self.cached(("eff", _OPS[fn], n, cross_host), make)

    @property
    def gloo(self) -> bool:
        """Whether the ranks are CPU processes, whose collectives are gloo's (else NCCL's)."""
        return all(k == "cpu" for k in self.topology.kind_of)

    @property
    def collective_tuning(self) -> CollectiveTuning:
        """What the collective library adds to the links (``CollectiveTuning``): the device
        catalog's figures, the worst over the cluster's device kinds; neutral with a profile, whose
        measured collective efficiencies already hold them."""
        def make():
            if self.measured_for():
                return NEUTRAL
            tunes = [device_type(k).collective_tuning() for k in set(self.topology.kind_of)]
            return CollectiveTuning(base_latency_s=max(t.base_latency_s for t in tunes),
                                         intra_efficiency=min(t.intra_efficiency for t in tunes),
                                         inter_efficiency=min(t.inter_efficiency for t in tunes),
                                         short_ring_loss=max(t.short_ring_loss for t in tunes))
        return self.cached(("tune",), make)

    def capacity_bytes(self, device: int) -> float:
        """Usable memory of a device: its memory less the allocator's fragmentation margin
        (``Framework.memory_fragmentation``; the CUDA context is counted in ``other``). CPU
        processes allocate with malloc, which the test bed measures exactly: no margin."""
        mem = self.topology.memory_of[device]
        return mem if self.topology.kind_of[device] == "cpu" else mem * (1.0 - self.framework.memory_fragmentation)

    def measured_tp_comm(self, c, stage_kinds) -> tuple[float, float] | None:
        """Per-layer (forward, backward) tp communication from the profile, if every stage's devices
        are of the profiled kind and the profile measured this tp in place."""
        if not self.measured_everywhere(stage_kinds) or getattr(c, "cp", 1) > 1:
            return None
        return self.cached(("tpcomm", c.micro_batch_size, c.tp, c.sequence_parallel),
                           lambda: tp_comm_times(self.profile, self.model, c.micro_batch_size, c.tp,
                                                 c.sequence_parallel))

    def pipeline_runtime(self, c, stage_kinds) -> float:
        """Seconds per action the pipeline runtime (torch.distributed.pipelining) adds (pp > 1), if
        the profile measured it on the devices every stage runs on; 0 otherwise."""
        if c.pp == 1 or not self.measured_everywhere(stage_kinds):
            return 0.0
        got = self.cached(("piperuntime", c.schedule),
                          lambda: pipeline_action_overhead(self.profile, c.schedule) or 0.0)
        return got * self.cpu_share(self.profile_kind)

    def peak_flop_per_s(self, world_size: int) -> float:
        """Sum of the datasheet peaks of the first ``world_size`` devices (for MFU)."""
        def make():  # the catalog once per kind; summed device by device, in order, as ever
            kinds = self.topology.kind_of[:world_size]
            peak = {k: device_type(k).peak(self.model.dtype) for k in set(kinds)}
            return sum(peak[k] for k in kinds)
        return self.cached(("peak", world_size), make)




def fp8_roofline_of(kind: str, recipe: str, profile, memory_time) -> Roofline:
    """``System.fp8_roofline``: the catalog's FP8 (or MXFP8) peak of ``kind`` at its FP8 GEMM
    efficiency, with ``profile``'s measured FP8 GEMM table where it has one (None: no profile of
    this kind); ``memory_time``: the measured memory-bound kernel time, or None."""
    dev = device_type(kind)
    dtype = "mxfp8" if recipe == "mxfp8" else "fp8"
    if not dev.supports(dtype):
        raise UserError(f"device {kind} has no {dtype.upper()} tensor cores (fp8_recipe={recipe}); "
                        f"use precision bf16, or a device that has them")
    eff = None
    if profile is not None and fp8_gemm_efficiency(profile, recipe, 8192, 8192, 8192) is not None:
        eff = lambda m, n, k: fp8_gemm_efficiency(profile, recipe, m, n, k)  # noqa: E731
    rf = Roofline.of(dev, dtype, eff, memory_time)
    return dataclasses.replace(rf, gemm_efficiency=dev.gemm_efficiency_of(dtype))


def host_cpu_share(profile, topology) -> float:
    """``System.cpu_share`` for CPU ranks: the most ranks on one host, or on one machine (hosts
    with the profile's boot id), over the fewest cores the profile recorded; at least 1.0."""
    hosts = profile.provenance.hosts
    cores = [h.cpu_count for h in hosts if h.cpu_count]
    if not cores:
        return 1.0
    per_host = max(Counter(topology.host_of).values())
    # hosts of one machine (emulated nodes, containers: the same boot id) share its cores
    machines: dict = {}
    for h in hosts:
        if h.machine:
            machines.setdefault(h.machine, []).append(h.name)
    ranks_of = {}
    for r in profile.ranks:
        ranks_of[r.host] = ranks_of.get(r.host, 0) + 1
    per_machine = max((sum(ranks_of.get(n, 0) for n in names) for names in machines.values()), default=0)
    return max(1.0, max(per_host, per_machine) / min(cores))


def cpu_ranks_sharing(profile, topo, share: float, stage_devs):
    """``System.cpu_sharing`` once the fixed ``share`` is above 1: each machine's cores and how
    many of each pipeline device's ranks it runs (``pipeline.Sharing``); None without CPU ranks."""
    hosts = {h.name: h for h in profile.provenance.hosts}
    machine_of, cores = {}, {}
    on_host = Counter(topo.node_of)  # (one count per host, not one pass over the devices per device)
    for d in {d for devs in stage_devs for d in devs}:
        if topo.kind_of[d] != "cpu":
            continue
        name = topo.host_name[topo.node_of[d]]
        h = hosts.get(name)
        if h is not None and h.cpu_count:
            key, n = h.machine or name, float(h.cpu_count)
        else:
            key = ("host", topo.node_of[d])
            n = on_host[topo.node_of[d]] / share
        machine_of[d] = key
        cores[key] = min(cores.get(key, n), n)
    if not cores:
        return None
    keys = sorted(cores, key=str)
    per_stage = [Counter(machine_of.get(d) for d in devs) for devs in stage_devs]
    weights = tuple(tuple(n[key] for n in per_stage) for key in keys)
    shares = tuple(share if any(d in machine_of for d in devs) else 1.0 for devs in stage_devs)
    return Sharing(shares, weights, tuple(cores[k] for k in keys))


def system_topology(cluster, profile) -> Topology:
    """The topology the cost model prices: the cluster file's (its own figures, no graph to build,
    O(devices)) with what the profile measured laid over it, else the profile's measured graph. A
    one-line error with neither."""
    if cluster is not None:
        topology = Topology.of_cluster(cluster)
        if profile is not None:
            # the cluster file declares hosts and devices; what the profile measured overrides
            # (as measured_graph.overlay_measured_links lays it on the cluster's graph)
            devices_of: dict = {}
            for d, n in enumerate(topology.node_of):
                devices_of.setdefault(n, []).append(d)
            topology.with_measured(measured_device_links(devices_of, profile)[0])
        return topology
    if profile is not None:
        return Topology(topology_graph(profile))
    raise UserError("estimate needs a cluster file or a profile (--cluster or --profile)")


def _shared(t: LayerTimes, k: float) -> LayerTimes:
    return t if k == 1.0 else LayerTimes(t.forward_s * k, t.backward_s * k, t.recompute_s * k,
                                         t.host_forward_s * k, t.host_backward_s * k)


def profile_device_kind(profile) -> str | None:
    ranks = getattr(profile, "ranks", None) or []
    kinds = {r.get("device_kind") if isinstance(r, dict) else getattr(r, "device_kind", None) for r in ranks}
    kinds.discard(None)
    return kinds.pop() if len(kinds) == 1 else None
