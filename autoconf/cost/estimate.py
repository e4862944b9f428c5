"""estimate(config, model, cluster[, profile]) -> Estimate: step time and memory, term by term.

Pure: no torch, no I/O, no globals beyond caches of pure results. The recipe, one module each:

1. the System (``system``): devices, links and rates -- measured by the profile where it applies,
   else the catalog's datasheet -- built once for many configurations;
2. the Layout (``layout``): pipeline chunks, their layers, parameters and devices;
3. per chunk, forward/backward time per micro-batch on the slowest device of its stage plus the
   exposed tensor-parallel collectives of its layers (``tensor_parallel``), ZeRO-2/3's
   per-micro-batch traffic (``data_parallel``) and the pipeline runtime's measured cost per
   action (``chunk_time``);
4. the schedule simulated event by event with the point-to-point time of the link between
   adjacent chunks' devices, twice (with and without transfers, to separate bubble from pipeline
   communication), extrapolated past the warm-up (``schedule_time``); CPU ranks that share a
   machine's cores at processor-sharing rates (``System.cpu_sharing``);
5. data-parallel reductions queued per device as each chunk's gradients become final, and
   ZeRO-1/2's parameter gather after the step (``data_parallel``);
6. the optimizer step (memory-bound, ``chunk_time``);
7. memory per stage (``stage_memory``).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoconf.cost.bounds import lower_bound
from autoconf.cost.chunk_time import ChunkTimes, chunk_times, optimizer_step_s
from autoconf.cost.compression import embedding_sync_s, pipeline_compression
from autoconf.cost.context_parallel import cp_times
from autoconf.cost.data_parallel import post_all_gather_s, reduction_tail_s
from autoconf.cost.groups import axis_links
from autoconf.cost.layout import Layout, layout
from autoconf.cost.schedule_time import chunk_p2p_times, pipeline_floor, posted_receives, sharing, simulate_step
from autoconf.cost.stage_memory import StageMemory, stage_memory
from autoconf.cost.system import System
from autoconf.cost.tensor_parallel import tp_times
from autoconf.errors import UserError
from autoconf.space.config import ParallelConfig, validate
from autoconf.specs.frameworks import hierarchical_runs
from autoconf.specs.model import ModelSpec
from autoconf.specs.recipes import framework_spec

__all__ = ["Estimate", "StageMemory", "System", "TIME_TERMS", "MEMORY_TERMS", "estimate"]

TIME_TERMS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "bubble", "pp_comm", "dp_comm", "optimizer")
MEMORY_TERMS = ("parameters", "gradients", "optimizer", "activations", "other")


@dataclass(frozen=True)
class Estimate:
    config: ParallelConfig
    step_time_s: float
    breakdown_s: dict
    """compute, recompute, tp_comm, cp_comm, ep_comm, bubble, pp_comm, dp_comm, optimizer: they add up
    to the step."""
    memory_by_stage: tuple
    """Per pipeline stage (its most loaded device): a StageMemory."""
    peak_memory_bytes: float
    fits: bool
    tokens_per_s: float
    mfu: float
    reasons: tuple = ()
    notes: tuple = ()
    framework: str = "reference"
    """The runtime the estimate assumes (``frameworks``): its name, ``name:recipe`` where it
    follows another recipe than its default (``frameworks.RECIPES``)."""

    def to_dict(self) -> dict:
        return {"config": self.config.to_dict(), "framework": self.framework, "step_time_s": self.step_time_s,
                "breakdown_s": dict(self.breakdown_s), "peak_memory_bytes": self.peak_memory_bytes,
                "memory_by_stage": [m.to_dict() for m in self.memory_by_stage], "fits": self.fits,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "reasons": list(self.reasons),
                "notes": list(self.notes)}

    @property
    def memory_excess_bytes(self) -> float:
        """How far the worst stage is over its capacity (negative: headroom)."""
        return max(m.total - m.capacity for m in self.memory_by_stage)


def estimate(config: ParallelConfig, model: ModelSpec, cluster=None, profile=None, calibration=None,
             ctx: System | None = None, framework=None, moe_imbalance: float = 1.0) -> Estimate:
    """Estimate one configuration. Pass ``ctx`` (a System) when estimating many; ``framework``
    (a name from ``frameworks.FRAMEWORK_NAMES``; default the reference trainer) and
    ``moe_imbalance`` (``System.moe_imbalance``) without one."""
    if ctx is None:
        ctx = System(model, cluster, profile, calibration, framework=framework, moe_imbalance=moe_imbalance)
    validate(config, model)
    reason = ctx.framework.check(config) or next(
        (r for r in (ctx.policy.supports(k, config) for k in sorted(set(ctx.topology.kind_of))) if r), None)
    if reason:
        raise UserError(f"invalid configuration ({config.short()}): {reason}")
    if config.world_size > ctx.num_devices:
        raise UserError(f"dp({config.dp}) x pp({config.pp}) x tp({config.tp}) = {config.world_size} devices, "
                        f"but the cluster has {ctx.num_devices}")
    return estimate_on(config, ctx)


def estimate_on(c: ParallelConfig, ctx: System, bound: float | None = None,
              time_if_oom: bool = True) -> Estimate | None:
    """The estimate; with ``bound``, None as soon as a lower bound on the step time reaches it
    (``bounds.lower_bound`` over ``schedule_time.pipeline_floor`` and the optimizer step);
    with ``time_if_oom=False``, a configuration that does not fit gets memory only (step time inf)."""
    lay = layout(ctx, c)
    runtime = ctx.pipeline_runtime(c, lay.stage_kinds)
    ct = chunk_times(ctx, c, lay, tp_times(ctx, c, lay.stage_kinds), runtime, cp_times(ctx, c, lay.stage_kinds))
    opt = optimizer_step_s(ctx, c, lay)
    shared = sharing(ctx, lay, ct)
    floor = pipeline_floor(c, ct.forward_s, ct.backward_s, lay.num_chunks, shared)
    if bound is not None and lower_bound(ctx, floor, opt) >= bound:
        return None

    memory = stage_memory(ctx, c, lay)
    if ctx.calibration is not None:
        memory = [ctx.calibration.apply_memory(mm) for mm in memory]
    if not time_if_oom and any(mm.total > mm.capacity for mm in memory):
        return _finish(c, ctx, {k: 0.0 for k in TIME_TERMS}, memory, float("inf"))

    p2p = chunk_p2p_times(ctx, c, lay.num_chunks)
    sim, sim0 = simulate_step(lay.schedule, c, lay.virtual_stages, ct.forward_s, ct.backward_s, p2p,
                              posted_receives(ctx, c), pipeline_compression(ctx, c, lay, p2p), shared)
    # the extrapolated steady state can fall a hair below the floor no schedule can beat
    # (breadth-first with unequal chunks): the floor is exact there
    makespan = max(sim.makespan_s, floor)
    # the tied embedding's sync after the pipeline: beside the reductions still in flight, then its own
    beside, after = embedding_sync_s(ctx, c)
    dp_tail = max(reduction_tail_s(ctx, c, lay, sim, makespan, ct.backward_s), beside) + after
    post_ag = post_all_gather_s(ctx, c, lay)
    breakdown = _breakdown(c, lay, ct, sim, sim0, runtime, dp_tail, post_ag, opt)
    # keep the parts summing to the simulated step (rounding of the busiest-device attribution)
    residual = (makespan + dp_tail + post_ag + opt) - sum(breakdown.values())
    breakdown["bubble"] = max(0.0, breakdown["bubble"] + residual)
    if ctx.calibration is not None:
        breakdown = ctx.calibration.apply_breakdown(breakdown)
    return _finish(c, ctx, breakdown, memory, sum(breakdown.values()))


def _breakdown(c: ParallelConfig, lay: Layout, ct: ChunkTimes, sim, sim0, runtime_s: float,
               dp_tail_s: float, post_gather_s: float, optimizer_s: float) -> dict:
    """The terms on the busiest device: its compute, recomputation, tp and inline dp communication
    over all micro-batches; the bubble is the transfer-free makespan beyond its busy time, pipeline
    communication what the transfers (and the runtime's per-action cost) add; the data-parallel
    tail and gather after the pipeline; the optimizer step."""
    n_mb = c.num_micro_batches
    dev_busy = max(range(c.pp), key=lambda d: sim.busy_s[d])
    mine = lay.chunks_of(c, dev_busy)
    # CPU ranks sharing cores (processor sharing): the device's ops took sim.busy_s, not their
    # priced durations; its terms are scaled to what they took
    priced = sum(ct.forward_s[ci] + ct.backward_s[ci] for ci in mine) * n_mb
    busy = sim.busy_s[dev_busy]
    k = busy / priced if priced > 0.0 else 1.0
    dp_in = sum(ct.dp_inline_s[ci] for ci in mine) * n_mb * k
    # the transfer-free makespan beyond the device's busy time is bubble, what the transfers add
    # beyond both is pipeline communication (a floor excess over the simulation is bubble too)
    pp_t = max(0.0, sim.makespan_s - max(sim0.makespan_s, busy))
    pp_t += runtime_s * 2 * n_mb * len(mine) * k
    return {"compute": sum((ct.compute_forward_s[ci] + ct.compute_backward_s[ci]) for ci in mine) * n_mb * k,
            "recompute": sum(ct.recompute_s[ci] for ci in mine) * n_mb * k,
            "tp_comm": sum(ct.tp_comm_s[ci] for ci in mine) * n_mb * k,
            "cp_comm": sum(ct.cp_comm_s[ci] for ci in mine) * n_mb * k,
            "ep_comm": sum(ct.ep_comm_s[ci] for ci in mine) * n_mb * k,
            "bubble": max(0.0, sim0.makespan_s - busy),
            "pp_comm": pp_t,
            "dp_comm": dp_in + dp_tail_s + post_gather_s,
            "optimizer": optimizer_s}


def _finish(c: ParallelConfig, ctx: System, breakdown: dict, memory: list, step: float) -> Estimate:
    reasons = []
    for s, mm in enumerate(memory):
        if mm.total > mm.capacity:
            reasons.append(f"out of memory: stage {s} needs {mm.total / 2**30:.2f} GiB "
                           f"> {mm.capacity / 2**30:.2f} GiB")
    m = ctx.model
    tokens = c.global_batch * m.seq_length
    notes = []
    if c.world_size < ctx.num_devices:
        notes.append(f"uses the first {c.world_size} of {ctx.num_devices} devices")
    if c.compressed:
        notes.append("lossy communication: "
                     + " and ".join(x for x in (
                         f"the pipeline's backward sends go as rank-{c.pp_compression_rank} factors "
                         f"({c.pp_compression})" if c.pp_compression != "none" else "",
                         f"PowerSGD (rank {c.dp_compression_rank}, error feedback) reduces the gradients of "
                         f"pipeline ranks 0..{c.dp_compression_stages - 1}" if c.dp_compression_stages else "") if x)
                     + ": it changes the numerics of training (reference trainer only)")
    if c.dp_all_reduce == "hierarchical" and c.zero_stage >= 1:
        notes.append("dp_all_reduce=hierarchical with ZeRO-1: the reference trainer all-reduces hierarchically, but "
                     "this estimate prices ZeRO-1's reduction as a reduce-scatter, as for flat")
    if c.dp_all_reduce == "hierarchical":
        flat = [g for g in axis_links(ctx, c, "dp") if not hierarchical_runs(g)]
        if flat:
            notes.append("dp_all_reduce=hierarchical: a data-parallel group "
                         + ("lies on one host" if flat[0].num_hosts == 1 else
                            "has one rank per host" if flat[0].local_size == 1 else
                            "spans hosts holding different numbers of its ranks")
                         + "; the trainer runs the flat all-reduce there, and so does this estimate")
    if ctx.policy.unfused_softmax(c.micro_batch_size, c.tp, c.cp):
        batches = c.micro_batch_size * m.num_attention_heads / c.tp
        notes.append(f"{ctx.framework.name}'s fused softmax kernel does not take {batches:g} attention batches "
                     f"(micro-batch x local heads) of {m.seq_length // c.cp} keys (it needs keys 17-4096, a "
                     "multiple of 4, and batches a multiple of 4, of 8 up to 128 keys): where a block is priced "
                     "from the roofline, its softmax runs unfused in fp32")
    return Estimate(config=c, step_time_s=step, breakdown_s=breakdown, memory_by_stage=tuple(memory),
                    peak_memory_bytes=max(mm.total for mm in memory), fits=not reasons,
                    tokens_per_s=tokens / step,
                    mfu=m.model_flops_per_token() * tokens / (step * ctx.peak_flop_per_s(c.world_size)),
                    reasons=tuple(reasons), notes=tuple(notes), framework=framework_spec(ctx.framework))
