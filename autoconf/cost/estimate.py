"""estimate(config, model, cluster[, profile]) -> Estimate: step time and memory, term by term.

Pure: no torch, no I/O, no globals beyond caches of pure results. The recipe:

1. per pipeline chunk, forward/backward time per micro-batch on the slowest device of its stage
   (roofline per op in ``compute``, or the profile's measured layer times; CPU ranks that share
   too few cores at their time-share) plus the exposed tensor-parallel collectives of its layers
   (``comm``, on the links the tp groups span) and the pipeline runtime's measured cost per action;
2. the schedule simulated event by event (``pipeline.simulate``) with the point-to-point time of
   the link between adjacent chunks' devices, twice (with and without transfers, to separate
   bubble from pipeline communication);
3. data-parallel reductions queued per device as each chunk's gradients become final (the last
   micro-batch's backward for standard accumulation; progressively for layered / breadth-first),
   ZeRO-2/3's per-micro-batch traffic against the compute it overlaps, ZeRO-3's parameter gathers,
   each bucket's memory traffic (copy in, average, copy back);
4. the optimizer step (memory-bound);
5. memory per stage: model states (ZeRO), and the peak of activations + gradients over the
   schedule's order (gradients exist from each chunk's first backward; the loss gradient and
   ZeRO-2/3's bucket in flight on top during a backward), embedding / output layer on the stages
   that hold them, buffers and framework overhead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..catalog import device_type
from ..config import ParallelConfig, layers_per_chunk, validate
from ..errors import UserError
from ..model import ModelSpec
from ..topology import Topology, axis_groups, rank_coords
from . import comm
from .activations import embedding_activation_bytes, head_activation_bytes, layer_activation_bytes
from .compute import LayerTimes, Roofline, block_times, embedding_times, head_times, optimizer_s
from .memory import bytes_per_param, state_bytes_per_param, zero3_working_bytes
from .pipeline import peak_memory, simulate

TIME_TERMS = ("compute", "recompute", "tp_comm", "bubble", "pp_comm", "dp_comm", "optimizer")
MEMORY_TERMS = ("parameters", "gradients", "optimizer", "activations", "other")


@dataclass(frozen=True)
class Estimate:
    config: ParallelConfig
    step_time_s: float
    breakdown_s: dict
    """compute, recompute, tp_comm, bubble, pp_comm, dp_comm, optimizer: they add up to the step."""
    memory_by_stage: tuple
    """Per pipeline stage (its most loaded device): parameters, gradients, optimizer, activations,
    other, total, capacity (bytes)."""
    peak_memory_bytes: float
    fits: bool
    tokens_per_s: float
    mfu: float
    reasons: tuple = ()
    notes: tuple = ()

    def to_dict(self) -> dict:
        return {"config": self.config.to_dict(), "step_time_s": self.step_time_s,
                "breakdown_s": dict(self.breakdown_s), "peak_memory_bytes": self.peak_memory_bytes,
                "memory_by_stage": [dict(m) for m in self.memory_by_stage], "fits": self.fits,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "reasons": list(self.reasons),
                "notes": list(self.notes)}

    @property
    def memory_excess_bytes(self) -> float:
        """How far the worst stage is over its capacity (negative: headroom)."""
        return max(m["total"] - m["capacity"] for m in self.memory_by_stage)


@dataclass
class CostContext:
    """What does not change between configurations: links, devices, measured data. Build once."""

    model: ModelSpec
    cluster: object = None
    profile: object = None
    calibration: object = None
    topology: Topology = None
    _cache: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.topology is None:
            if self.cluster is not None:
                self.topology = Topology(self.cluster.graph())
            elif self.profile is not None:
                from .measured import topology_graph
                self.topology = Topology(topology_graph(self.profile))
            else:
                raise UserError("estimate needs a cluster file or a profile (--cluster or --profile)")
        self.num_devices = self.topology.num_devices
        self.profile_kind = None
        if self.profile is not None:
            from .measured import gemm_efficiency
            kinds = {self.topology.kind_of[i] for i in range(self.num_devices)}
            self.profile_kind = _profile_device_kind(self.profile) or (kinds.pop() if len(kinds) == 1 else None)
            self._gemm_eff = lambda m, n, k: gemm_efficiency(self.profile, m, n, k)

    def roofline(self, kind: str) -> Roofline:
        key = ("rf", kind)
        if key not in self._cache:
            eff = self._gemm_eff if self.profile is not None and kind == self.profile_kind else None
            self._cache[key] = Roofline.of(device_type(kind), self.model.dtype, eff)
        return self._cache[key]

    def cpu_share(self, kind: str) -> float:
        """How much slower a CPU rank computes because its host's cores are shared: with more
        ranks on a host than it has cores (the profile's host record; ranks run one thread each,
        as the launchers set OMP_NUM_THREADS=1), the scheduler gives each busy rank cores/ranks of
        a core. 1.0 for accelerators, without a profile, or when every rank has its own core."""
        if kind != "cpu" or self.profile is None:
            return 1.0

        def make():
            cores = [h.cpu_count for h in self.profile.provenance.hosts if h.cpu_count]
            if not cores:
                return 1.0
            per_host = max(self.topology.host_of.count(h) for h in set(self.topology.host_of))
            return max(1.0, per_host / min(cores))
        return self.cached(("cpushare",), make)

    def mask_bytes(self, kind: str) -> int:
        # PyTorch keeps dropout masks as bool (1 byte) on CUDA, at the activation's precision on CPU.
        return self.model.dtype_bytes if kind == "cpu" else 1

    def cached(self, key, fn):
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = fn()
        return hit


def _profile_device_kind(profile) -> str | None:
    ranks = getattr(profile, "ranks", None) or []
    kinds = {r.get("device_kind") if isinstance(r, dict) else getattr(r, "device_kind", None) for r in ranks}
    kinds.discard(None)
    return kinds.pop() if len(kinds) == 1 else None


# ---------------------------------------------------------------------------------------------
# per-layer compute (roofline or measured)


def _block(ctx: CostContext, kind: str, b: int, tp: int, sp: bool, recompute: str) -> LayerTimes:
    def make():
        if ctx.profile is not None and kind == ctx.profile_kind:
            from .measured import block_times as measured_block
            got = measured_block(ctx.profile, ctx.model, b, tp, recompute)
            if got:
                rc = got[0] if recompute == "full" else 0.0
                return LayerTimes(got[0], got[1], rc)
        return block_times(ctx.model, b, tp, sp, recompute, ctx.roofline(kind))
    return ctx.cached(("block", kind, b, tp, sp, recompute), lambda: _shared(make(), ctx.cpu_share(kind)))


def _shared(t: LayerTimes, k: float) -> LayerTimes:
    return t if k == 1.0 else LayerTimes(t.forward_s * k, t.backward_s * k, t.recompute_s * k)


def _edge(ctx: CostContext, kind: str, b: int, tp: int, which: str) -> LayerTimes:
    def make():
        if ctx.profile is not None and kind == ctx.profile_kind:
            from . import measured
            got = (measured.embedding_times if which == "embedding" else measured.head_times)(ctx.profile, ctx.model, b, tp)
            if got:
                return LayerTimes(got[0], got[1])
        fn = embedding_times if which == "embedding" else head_times
        return fn(ctx.model, b, tp, ctx.roofline(kind))
    return ctx.cached((which, kind, b, tp), lambda: _shared(make(), ctx.cpu_share(kind)))


# ---------------------------------------------------------------------------------------------
# groups and links for a layout


def _axis_links(ctx: CostContext, c: ParallelConfig, axis: str):
    """GroupLinks of every group along an axis, with NIC sharing among groups running together."""
    def make():
        topo = ctx.topology
        groups = axis_groups(c.dp, c.pp, c.tp, c.rank_order, axis)
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
    return ctx.cached(("axis", c.dp, c.pp, c.tp, c.rank_order, axis), make)


def _worst(links, fn, nbytes: float, efficiency: float = 1.0) -> float:
    """The slowest group's time: all groups of an axis run the collective together.

    ``efficiency`` (the profile's measured bus bandwidth over what the links predict) stretches
    the bandwidth term only: steps x alpha + bytes / (beta x efficiency).
    """
    return max(fn(nbytes / efficiency, g) for g in links)


_OPS = {comm.all_reduce_s: "all_reduce", comm.all_gather_s: "all_gather", comm.reduce_scatter_s: "reduce_scatter"}


def _efficiency(ctx: CostContext, fn, n: int) -> float:
    """Measured collective efficiency for groups of n ranks (1.0 without a profile measurement)."""
    if ctx.profile is None or n < 2:
        return 1.0
    from .measured import collective_efficiency

    def make():
        eff = collective_efficiency(ctx.profile, _OPS[fn], n)
        return min(1.0, eff) if eff and eff > 0 else 1.0
    return ctx.cached(("eff", _OPS[fn], n), make)


def _stage_devices(c: ParallelConfig) -> list[list[int]]:
    out = [[] for _ in range(c.pp)]
    for r in range(c.world_size):
        out[rank_coords(r, c.dp, c.pp, c.tp, c.rank_order)["pp"]].append(r)
    return out


def _p2p_times(ctx: CostContext, c: ParallelConfig, nbytes: float) -> list[float]:
    """Transfer time between consecutive pipeline stages (slowest replica pair), per stage pair."""
    def make():
        topo = ctx.topology
        by_stage: dict = {}
        for r in range(c.world_size):
            co = rank_coords(r, c.dp, c.pp, c.tp, c.rank_order)
            by_stage[(co["pp"], co["dp"], co["tp"])] = r
        links = []
        for s in range(c.pp):
            nxt = (s + 1) % c.pp
            worst = (0.0, 0.0)
            for d in range(c.dp):
                for t in range(c.tp):
                    bw, lat = topo.p2p(by_stage[(s, d, t)], by_stage[(nxt, d, t)])
                    worst = max(worst, (1.0 / bw, lat))
            links.append(worst)
        return links
    links = ctx.cached(("p2p", c.dp, c.pp, c.tp, c.rank_order), make)
    return [lat + nbytes * inv_bw for inv_bw, lat in links]


# ---------------------------------------------------------------------------------------------


def estimate(config: ParallelConfig, model: ModelSpec, cluster=None, profile=None, calibration=None,
             ctx: CostContext | None = None) -> Estimate:
    """Estimate one configuration. Pass ``ctx`` (a CostContext) when estimating many."""
    if ctx is None:
        ctx = CostContext(model, cluster, profile, calibration)
    validate(config, model)
    if config.world_size > ctx.num_devices:
        raise UserError(f"dp({config.dp}) x pp({config.pp}) x tp({config.tp}) = {config.world_size} devices, "
                        f"but the cluster has {ctx.num_devices}")
    return _estimate(config, ctx)


def _estimate(c: ParallelConfig, ctx: CostContext, bound: float | None = None,
              time_if_oom: bool = True) -> Estimate | None:
    """The estimate; with ``bound``, None as soon as a lower bound on the step time reaches it;
    with ``time_if_oom=False``, a configuration that does not fit gets memory only (step time inf)."""
    m = ctx.model
    topo = ctx.topology
    b, tp, sp, B = c.micro_batch_size, c.tp, c.sequence_parallel, m.dtype_bytes
    n_mb = c.num_micro_batches
    stage_devs = ctx.cached(("stages", c.dp, c.pp, c.tp, c.rank_order), lambda: _stage_devices(c))
    stage_kinds = [sorted({topo.kind_of[d] for d in devs}) for devs in stage_devs]

    # pipeline chunks: pp=1 layered accumulation is simulated layer by layer
    layered_pp1 = c.pp == 1 and c.layered_grad_accum
    v_sim = m.num_layers if layered_pp1 else c.virtual_stages
    sched = "breadth_first" if layered_pp1 else c.schedule
    n_chunks = c.pp * v_sim
    chunk_layers = layers_per_chunk(m.num_layers, n_chunks)
    layered = c.layered_grad_accum or c.schedule == "breadth_first"

    # tensor-parallel collectives per layer (Megatron: 2 in forward, 2 in backward; SP: AG + RS)
    act_bytes_full = b * m.seq_length * m.hidden_size * B
    tp_links = _axis_links(ctx, c, "tp") if tp > 1 else None
    if tp > 1:
        one = (_worst(tp_links, comm.all_gather_s, act_bytes_full, _efficiency(ctx, comm.all_gather_s, tp))
               + _worst(tp_links, comm.reduce_scatter_s, act_bytes_full, _efficiency(ctx, comm.reduce_scatter_s, tp))
               if sp else _worst(tp_links, comm.all_reduce_s, act_bytes_full, _efficiency(ctx, comm.all_reduce_s, tp)))
        tp_fwd_layer = tp_bwd_layer = 2 * one
        measured_tp = _measured_tp_comm(ctx, c, stage_kinds)
        if measured_tp is not None:  # the profile timed the block with its real collectives
            tp_fwd_layer, tp_bwd_layer = measured_tp
            one = tp_fwd_layer / 2
        tp_bwd_layer += tp_fwd_layer if c.recompute == "full" else 0.0
        tp_edge = one  # embedding forward reduce / head backward reduce
    else:
        tp_fwd_layer = tp_bwd_layer = tp_edge = 0.0

    # Communication overlaps computation only where a copy engine / NIC does the work; CPU
    # processes run their collectives on the same cores as their compute, so nothing is hidden.
    overlaps = not any("cpu" in k for k in stage_kinds)

    # data-parallel links and per-chunk gradient / parameter bytes
    dp_links = _axis_links(ctx, c, "dp") if c.dp > 1 else None
    _, g_bytes, _ = bytes_per_param(m.dtype)
    chunk_params = []
    for ci, nl in enumerate(chunk_layers):
        p = nl * m.layer_params()
        if ci == 0:
            p += m.embedding_params()
        if ci == n_chunks - 1:
            p += m.output_params() + (m.vocab_size * m.hidden_size if m.tied_embeddings and n_chunks > 1 else 0)
        chunk_params.append(p / tp)

    # the pipeline runtime's own work per action (torch.distributed.pipelining), measured
    runtime = _pipeline_runtime(ctx, c, stage_kinds)
    fwd, bwd = [], []
    comp_f, comp_b, rc_part, tp_part, dp_inline = [], [], [], [], []
    for ci, nl in enumerate(chunk_layers):
        stage = ci % c.pp
        best = None
        for kind in stage_kinds[stage]:
            lt = _block(ctx, kind, b, tp, sp, c.recompute)
            f, bw_, rc = nl * lt.forward_s, nl * lt.backward_s, nl * lt.recompute_s
            if ci == 0:
                e = _edge(ctx, kind, b, tp, "embedding")
                f, bw_ = f + e.forward_s, bw_ + e.backward_s
            if ci == n_chunks - 1:
                h = _edge(ctx, kind, b, tp, "head")
                f, bw_ = f + h.forward_s, bw_ + h.backward_s
            if best is None or f + bw_ > best[0] + best[1]:
                best = (f, bw_, rc)
        f, bw_, rc = best
        tpf = nl * tp_fwd_layer + (tp_edge if ci == 0 else 0.0)
        tpb = nl * tp_bwd_layer + (tp_edge if ci == n_chunks - 1 else 0.0)
        # ZeRO-2/3 traffic that runs every micro-batch, overlapped with that chunk's compute
        extra_f = extra_b = 0.0
        if c.dp > 1 and c.zero_stage >= 2 and not layered:
            rs = _worst(dp_links, comm.reduce_scatter_s, chunk_params[ci] * g_bytes, _efficiency(ctx, comm.reduce_scatter_s, c.dp))
            rs += _copy_time(ctx, stage_kinds[stage], _bucket_traffic(c) * chunk_params[ci] * g_bytes)
            extra_b += (max(0.0, rs - bw_) if overlaps else rs) * (n_mb - 1) / n_mb
        if c.dp > 1 and c.zero_stage == 3:
            # parameters are gathered once per pass over the chunk: every micro-batch (standard) or
            # once per step (layered: all micro-batches go through a chunk together). Prefetching
            # hides a gather behind the compute of the pass; the first layer's gather of each pass
            # over the device's chunks is exposed.
            eff_ag = _efficiency(ctx, comm.all_gather_s, c.dp)
            ag = _worst(dp_links, comm.all_gather_s, chunk_params[ci] * B, eff_ag)
            ag_layer = _worst(dp_links, comm.all_gather_s, m.layer_params() / tp * B, eff_ag)
            passes = 1 if layered else n_mb
            per_pass = n_mb / passes
            if overlaps:
                extra_f += (max(0.0, ag - f * per_pass) + (ag_layer if ci < c.pp else 0.0)) * passes / n_mb
                extra_b += (max(0.0, ag - bw_ * per_pass) + (ag_layer if ci >= n_chunks - c.pp else 0.0)) * passes / n_mb
            else:
                extra_f += ag * passes / n_mb
                extra_b += ag * passes / n_mb
        comp_f.append(f)
        comp_b.append(bw_ - rc)
        rc_part.append(rc)
        tp_part.append(tpf + tpb)
        dp_inline.append(extra_f + extra_b)
        fwd.append(f + tpf + extra_f + runtime)
        bwd.append(bw_ + tpb + extra_b + runtime)

    # optimizer: measured seconds per parameter from the profile, else the memory-bound roofline
    opt = 0.0
    for dev in range(c.pp):
        local = sum(chunk_params[ci] for ci in range(dev, n_chunks, c.pp)) / (c.dp if c.zero_stage >= 1 else 1)
        opt = max(opt, max(_optimizer_time(ctx, k, local) for k in stage_kinds[dev]))

    pipeline_floor = _pipeline_floor(c, fwd, bwd, n_chunks)
    if bound is not None and _bounded(ctx, pipeline_floor, opt) >= bound:
        return None

    memory = _memory(c, ctx, stage_devs, stage_kinds, chunk_layers, chunk_params, sched, v_sim, n_chunks)
    if ctx.calibration is not None:
        memory = [ctx.calibration.apply_memory(mm) for mm in memory]
    oom = [s for s, mm in enumerate(memory) if mm["total"] > mm["capacity"]]
    if oom and not time_if_oom:
        return _finish(c, ctx, {k: 0.0 for k in TIME_TERMS}, memory, float("inf"))

    # pipeline transfers: the activation of one micro-batch (sharded along the sequence with SP)
    p2p_bytes = act_bytes_full / (tp if sp else 1)
    if c.pp > 1:
        per_stage = _p2p_times(ctx, c, p2p_bytes)
        p2p = tuple(per_stage[ci % c.pp] for ci in range(n_chunks - 1))
    else:
        p2p = tuple(0.0 for _ in range(n_chunks - 1))
    fwd_t, bwd_t = tuple(fwd), tuple(bwd)
    sim = _run_schedule(sched, c.pp, n_mb, v_sim, fwd_t, bwd_t, p2p)
    sim0 = sim if not any(p2p) else _run_schedule(sched, c.pp, n_mb, v_sim, fwd_t, bwd_t, tuple(0.0 for _ in p2p))
    # the extrapolated steady state can fall a hair below the floor no schedule can beat
    # (breadth-first with unequal chunks): the floor is exact there
    makespan = max(sim.makespan_s, pipeline_floor)

    # data-parallel reductions queued per device as gradients become final
    dp_tail = 0.0
    post_ag = 0.0
    if c.dp > 1:
        if c.zero_stage <= 1:
            red = comm.all_reduce_s if c.zero_stage == 0 else comm.reduce_scatter_s
        else:
            red = comm.reduce_scatter_s
        end_all = makespan
        for dev in range(c.pp):
            chunks = sorted(range(dev, n_chunks, c.pp), key=lambda ci: sim.last_backward_end_s[ci])
            t_free = 0.0
            eff = _efficiency(ctx, red, c.dp)
            for ci in chunks:
                t = _worst(dp_links, red, chunk_params[ci] * g_bytes, eff) \
                    + _copy_time(ctx, stage_kinds[dev], _bucket_traffic(c) * chunk_params[ci] * g_bytes)
                if overlaps:
                    start = max(t_free, sim.last_backward_end_s[ci] - bwd_t[ci] * (1 - 1 / max(chunk_layers[ci], 1)))
                    # the last bucket (one layer, at most 25 MiB) can only go once its gradient exists
                    last_bucket = min(25 * 2**20, m.layer_params() / tp * g_bytes)
                    t_free = max(start + t, sim.last_backward_end_s[ci] + _worst(dp_links, red, last_bucket, eff))
                else:  # no overlap: every reduction adds its whole time to the step
                    t_free = max(t_free, makespan) + t
            end_all = max(end_all, t_free)
        dp_tail = end_all - makespan
        if c.zero_stage in (1, 2):
            # updated parameter shards are gathered back after the optimizer step
            # (each owner's shard is flattened, sent and copied back into the parameters)
            post_ag = 0.0
            for dev in range(c.pp):
                nbytes = sum(chunk_params[ci] for ci in range(dev, n_chunks, c.pp)) * B
                post_ag = max(post_ag, _worst(dp_links, comm.all_gather_s, nbytes, _efficiency(ctx, comm.all_gather_s, c.dp))
                              + _copy_time(ctx, stage_kinds[dev], (4 - 2 / c.dp) * nbytes))

    # breakdown on the busiest device
    dev_busy = max(range(c.pp), key=lambda d: sim.busy_s[d])
    mine = range(dev_busy, n_chunks, c.pp)
    compute = sum((comp_f[ci] + comp_b[ci]) for ci in mine) * n_mb
    recompute_t = sum(rc_part[ci] for ci in mine) * n_mb
    tp_t = sum(tp_part[ci] for ci in mine) * n_mb
    dp_in = sum(dp_inline[ci] for ci in mine) * n_mb
    busy = sim.busy_s[dev_busy]
    bubble = max(0.0, sim0.makespan_s - busy)
    pp_t = max(0.0, sim.makespan_s - sim0.makespan_s)  # a floor excess over the simulation is bubble
    pp_t += runtime * 2 * n_mb * len(mine)
    breakdown = {"compute": compute, "recompute": recompute_t, "tp_comm": tp_t, "bubble": bubble,
                 "pp_comm": pp_t, "dp_comm": dp_in + dp_tail + post_ag, "optimizer": opt}
    # keep the parts summing to the simulated step (rounding of the busiest-device attribution)
    residual = (makespan + dp_tail + post_ag + opt) - sum(breakdown.values())
    breakdown["bubble"] = max(0.0, breakdown["bubble"] + residual)

    if ctx.calibration is not None:
        breakdown = ctx.calibration.apply_breakdown(breakdown)
    return _finish(c, ctx, breakdown, memory, sum(breakdown.values()))


def _finish(c: ParallelConfig, ctx: CostContext, breakdown: dict, memory: list, step: float) -> Estimate:
    m, topo = ctx.model, ctx.topology
    reasons = []
    for s, mm in enumerate(memory):
        if mm["total"] > mm["capacity"]:
            reasons.append(f"out of memory: stage {s} needs {mm['total'] / 2**30:.2f} GiB "
                           f"> {mm['capacity'] / 2**30:.2f} GiB")
    tokens = c.global_batch * m.seq_length
    peak_sum = ctx.cached(("peak", c.world_size),
                          lambda: sum(device_type(topo.kind_of[d]).peak(m.dtype) for d in range(c.world_size)))
    notes = []
    if c.world_size < ctx.num_devices:
        notes.append(f"uses the first {c.world_size} of {ctx.num_devices} devices")
    return Estimate(config=c, step_time_s=step, breakdown_s=breakdown, memory_by_stage=tuple(memory),
                    peak_memory_bytes=max(mm["total"] for mm in memory), fits=not reasons,
                    tokens_per_s=tokens / step, mfu=m.model_flops_per_token() * tokens / (step * peak_sum),
                    reasons=tuple(reasons), notes=tuple(notes))


@dataclass(frozen=True)
class _Schedule:
    makespan_s: float
    busy_s: tuple
    last_backward_end_s: tuple
    m_sim: int


def _sim_size(schedule: str, pp: int, m: int) -> int:
    """Micro-batches to simulate first: all of them when few, else a multiple of pp past the warm-up."""
    cap = max(2 * pp, 8)
    if m <= cap + pp:
        return m
    return -(-cap // pp) * pp  # a multiple of pp (interleaved needs it)


def _run_schedule(schedule, pp, m, v, fwd, bwd, p2p) -> _Schedule:
    """The schedule's makespan for m micro-batches without simulating thousands of them.

    Past the warm-up every schedule repeats one period per micro-batch, so the makespan is affine
    in m. The slope is measured between two simulations pp micro-batches apart, and the simulated
    size is doubled until two successive slopes agree within 0.1% (unequal stages take longer to
    settle) or the whole step is simulated.
    """
    m_sim = _sim_size(schedule, pp, m)
    r = simulate(schedule, pp, m_sim, v, fwd, bwd, p2p)
    if m_sim == m:
        return _Schedule(r.makespan_s, r.busy_s, r.last_backward_end_s, m)
    slope = (r.makespan_s - simulate(schedule, pp, m_sim - pp, v, fwd, bwd, p2p).makespan_s) / pp
    while True:
        m_next = 2 * m_sim if 2 * m_sim < m else m  # stays a multiple of pp until it is m
        r_next = simulate(schedule, pp, m_next, v, fwd, bwd, p2p)
        if m_next == m:
            return _Schedule(r_next.makespan_s, r_next.busy_s, r_next.last_backward_end_s, m)
        slope_next = (r_next.makespan_s - simulate(schedule, pp, m_next - pp, v, fwd, bwd, p2p).makespan_s) / pp
        m_sim, r = m_next, r_next
        if abs(slope_next - slope) <= 1e-3 * max(slope_next, 1e-30):
            slope = slope_next
            break
        slope = slope_next
    extra = (m - m_sim) * slope
    scale = m / m_sim
    return _Schedule(r.makespan_s + extra, tuple(b * scale for b in r.busy_s),
                     tuple(t + extra for t in r.last_backward_end_s), m_sim)


def _memory(c, ctx, stage_devs, stage_kinds, chunk_layers, chunk_params, sched, v_sim, n_chunks) -> list[dict]:
    m = ctx.model
    topo = ctx.topology
    st = state_bytes_per_param(m.dtype, c.zero_stage, c.dp)
    kinds = sorted({k for ks in stage_kinds for k in ks})
    mask = max(ctx.mask_bytes(k) for k in kinds)
    act_layer = _layer_act(ctx, c, mask)
    per_chunk = []
    for ci in range(n_chunks):
        per_mb = chunk_layers[ci] * act_layer["total"]
        if ci == 0:
            per_mb += embedding_activation_bytes(m, c.micro_batch_size, c.tp, c.sequence_parallel, mask)
        if ci == n_chunks - 1:
            per_mb += head_activation_bytes(m, c.micro_batch_size, c.tp, c.sequence_parallel, mask)
        per_chunk.append(per_mb)
    # liveness is structural (independent of durations): simulate the steady-state size and scale
    # the schedules that keep every micro-batch alive (gpipe, breadth-first, layered)
    m_sim = _sim_size(sched, c.pp, c.num_micro_batches)
    grows = sched in ("gpipe", "breadth_first")
    # the last chunk's backward starts from the loss gradient of one micro-batch's logits (fp32,
    # vocabulary-parallel), alive next to its saved activations
    ce_grad = c.micro_batch_size * m.seq_length * (-(-m.vocab_size // c.tp)) * 4.0
    # ZeRO-2/3 reduce (and drop) each layer's full gradient during the backward of every
    # micro-batch: one layer's worth is in flight next to the activations
    in_flight = 0.0
    if c.dp > 1 and c.zero_stage >= 2 and not c.layered_grad_accum:
        in_flight = min(25 * 2**20, m.layer_params() / c.tp * bytes_per_param(m.dtype)[1])
    # gradients are set to None after each step: they coexist with the activations only from
    # each chunk's first backward on (so GPipe / layered peak with almost none)
    peaks = peak_memory(sched, c.pp, m_sim, v_sim, tuple(per_chunk), tuple(p * st.gradients for p in chunk_params),
                        c.num_micro_batches / m_sim if grows else 1.0,
                        tuple(in_flight + (ce_grad if ci == n_chunks - 1 else 0.0) for ci in range(n_chunks)))
    out = []
    for s in range(c.pp):
        chunks = list(range(s, n_chunks, c.pp))
        params = sum(chunk_params[ci] for ci in chunks)
        acts, grads = peaks[s]
        if c.recompute == "full":
            acts += act_layer.get("recompute_working_bytes", 0.0)
        other = max(device_type(k).framework_overhead_bytes for k in stage_kinds[s])
        if c.zero_stage == 3 and c.dp > 1:
            other += zero3_working_bytes(m, c.tp)
        tokens = c.micro_batch_size * m.seq_length
        if c.pp > 1:
            # torch.distributed.pipelining's PipelineStage allocates, for every micro-batch, a
            # buffer for the activation it receives (all chunks but the first) and one for the
            # gradient it receives (all but the last), up front (stage._setup_forward_recv_info /
            # _setup_backward_recv_info): a replica's whole batch of boundary activations, twice.
            # (The trainer passes return_outputs=False, so the last stage's outputs are not kept.)
            act = tokens * m.hidden_size * m.dtype_bytes / (c.tp if c.sequence_parallel else 1)
            buffers = sum((ci > 0) + (ci < n_chunks - 1) for ci in chunks)
            other += buffers * c.num_micro_batches * act
        if c.dp > 1:
            # gradient reduction copies one bucket (at most 25 MiB, as DDP) after the backward has
            # freed the activations: it raises the peak only where it exceeds them
            bucket = min(25 * 2**20, max(chunk_params[ci] for ci in chunks) * bytes_per_param(m.dtype)[1])
            other += max(0.0, bucket - acts)
        mm = {"parameters": params * st.parameters, "gradients": grads,
              "optimizer": params * st.optimizer, "activations": acts, "other": other}
        mm["total"] = sum(mm.values())
        mm["capacity"] = min(topo.memory_of[d] for d in stage_devs[s])
        out.append(mm)
    return out


def _pipeline_floor(c: ParallelConfig, fwd, bwd, n_chunks: int) -> float:
    """A pipeline makespan no schedule can beat.

    Device d cannot start before micro-batch 0's forward has crossed chunks 0..d-1, and after its
    last backward the gradient still has to cross them back; in between it does all its own work:
    makespan >= max_d (sum_{c<d} (f_c + b_c) + m x busy_d). For equal stages this is the 1F1B
    makespan (m + p - 1)(f + b) and the interleaved one, (m v + p - 1)(f + b) / v.
    """
    lower, prefix = 0.0, 0.0
    for d in range(c.pp):
        busy = sum(fwd[ci] + bwd[ci] for ci in range(d, n_chunks, c.pp)) * c.num_micro_batches
        lower = max(lower, prefix + busy)
        prefix += fwd[d] + bwd[d]
    return lower


def _bounded(ctx: CostContext, floor: float, opt: float) -> float:
    """Lower bound on the step time (to skip dominated configurations in the search)."""
    cal = ctx.calibration
    if cal is not None:  # calibration scales the terms the floor is made of
        floor_terms = ("compute", "recompute", "tp_comm", "dp_comm", "bubble", "pp_comm")
        return floor * min(cal.factor(k) for k in floor_terms) + opt * cal.factor("optimizer")
    return floor + opt


def _bucket_traffic(c: ParallelConfig) -> float:
    """Memory traffic of one gradient-bucket reduction, in multiples of the bucket's bytes.

    ZeRO-0/1 (as DDP without gradient views): copy the gradients into the flat bucket (read +
    write), average in place, copy back: 6. ZeRO-2: copy in, then the owner adds its 1/dp share
    into its accumulator: 2 + 3/dp. ZeRO-3 (FSDP2): reduce-scatter copy-in, then the shard is
    averaged: 2 + 2/dp.
    """
    if c.zero_stage <= 1:
        return 6.0
    return 2.0 + (3.0 if c.zero_stage == 2 else 2.0) / c.dp


def _copy_time(ctx: CostContext, kinds, nbytes: float) -> float:
    """Seconds to stream ``nbytes`` through memory (read + write counted separately) on the slowest
    of ``kinds``: the profile's AdamW step gives the measured bandwidth (its traffic per parameter
    is known, see compute.optimizer_s), else the catalog's memory bandwidth."""
    worst = 0.0
    for kind in kinds:
        rate = _optimizer_rate(ctx, kind)
        if rate > 0:
            t = nbytes * rate / (32 if ctx.model.dtype != "fp32" else 28)
        else:
            t = ctx.roofline(kind).elementwise(nbytes, kernels=0)
        worst = max(worst, t * ctx.cpu_share(kind))
    return worst


def _optimizer_rate(ctx: CostContext, kind: str) -> float:
    """The profile's measured AdamW seconds per parameter on ``kind``; -1.0 when not measured."""
    if ctx.profile is None or kind != ctx.profile_kind:
        return -1.0
    from .measured import optimizer_seconds_per_param
    return ctx.cached(("optrate", kind), lambda: optimizer_seconds_per_param(ctx.profile, kind) or -1.0)


def _optimizer_time(ctx: CostContext, kind: str, num_params: float) -> float:
    rate = _optimizer_rate(ctx, kind)
    if rate > 0:
        return num_params * rate * ctx.cpu_share(kind)
    return optimizer_s(num_params, ctx.model.dtype != "fp32", ctx.roofline(kind)) * ctx.cpu_share(kind)


def _pipeline_runtime(ctx: CostContext, c: ParallelConfig, stage_kinds) -> float:
    """Seconds per action the pipeline runtime adds (pp > 1), if the profile measured it on the
    devices every stage runs on; 0 otherwise."""
    if c.pp == 1 or ctx.profile is None or any(k != [ctx.profile_kind] for k in stage_kinds):
        return 0.0
    from .measured import pipeline_action_overhead
    got = ctx.cached(("piperuntime", c.schedule), lambda: pipeline_action_overhead(ctx.profile, c.schedule) or 0.0)
    return got * ctx.cpu_share(ctx.profile_kind)


def _measured_tp_comm(ctx, c, stage_kinds):
    """Per-layer (forward, backward) tp communication from the profile, if every stage's devices
    are of the profiled kind and the profile measured this tp in place."""
    if ctx.profile is None or any(k != [ctx.profile_kind] for k in stage_kinds):
        return None
    from .measured import tp_comm_times
    return ctx.cached(("tpcomm", c.micro_batch_size, c.tp, c.sequence_parallel),
                      lambda: tp_comm_times(ctx.profile, ctx.model, c.micro_batch_size, c.tp, c.sequence_parallel))


def _layer_act(ctx, c, mask) -> dict:
    def make():
        if ctx.profile is not None:
            from .measured import activation_bytes
            got = activation_bytes(ctx.profile, ctx.model, c.micro_batch_size, c.tp, c.sequence_parallel, c.recompute)
            if got:
                base = layer_activation_bytes(ctx.model, c.micro_batch_size, c.tp, c.sequence_parallel, c.recompute, mask)
                return {**base, "total": float(got)}
        return layer_activation_bytes(ctx.model, c.micro_batch_size, c.tp, c.sequence_parallel, c.recompute, mask)
    return ctx.cached(("act", c.micro_batch_size, c.tp, c.sequence_parallel, c.recompute, mask), make)
