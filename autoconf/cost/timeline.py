"""step_timeline(config, system) -> StepTimeline: the events of the step the estimate prices.

The same recipe as ``estimate._estimate``, kept as events instead of sums: the chunk times
(``chunk_time``), the transfers between chunks (``schedule_time.chunk_p2p_times``), the schedule's
ops and transfers from the pipeline simulation itself (``pipeline.timeline``), each chunk's
gradient reductions as they queue after its last backward (``data_parallel.reduction_spans``),
then ZeRO-1/2's (or DeepSpeed's BF16 optimizer's) parameter gather and the optimizer step. Pure:
no I/O, no plotting.

The estimate simulates a few micro-batches and extrapolates the steady state
(``schedule_time.run_schedule``); the timeline simulates all of them. Where the estimate
simulated the whole step (``simulated_micro_batches == num_micro_batches``) the two are the
same simulation, to the last bit; elsewhere they agree to the extrapolation's tolerance
(``priced_makespan_s`` is the estimate's).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ParallelConfig
from .chunk_time import chunk_times, optimizer_step_s
from .compression import embedding_sync_s, pipeline_compression
from .data_parallel import post_all_gather_s, reduction_spans
from .layout import layout
from .pipeline import Timeline, simulate, timeline
from .schedule_time import chunk_p2p_times, pipeline_floor, posted_receives, run_schedule, sharing
from .system import System
from .context_parallel import cp_times
from .tensor_parallel import tp_times

__all__ = ["StepTimeline", "step_timeline"]


@dataclass(frozen=True)
class StepTimeline:
    config: ParallelConfig
    schedule: str
    """The schedule simulated (breadth_first for pp=1 layered accumulation, one layer per chunk)."""
    virtual_stages: int
    """Chunks per pipeline device in the simulation."""
    pipeline: Timeline
    """Every forward, backward and transfer of the step (all micro-batches)."""
    forward_parts: tuple
    backward_parts: tuple
    """Per chunk: ``((part, seconds), ...)`` making up one micro-batch's forward / backward, in
    ``compute``, ``recompute`` (backward), ``tp_comm``, ``dp_comm`` (ZeRO-2/3's exposed traffic),
    ``runtime`` (the pipeline runtime's cost per action); zero parts left out."""
    dp_reductions: tuple
    """Per pipeline device: its gradient reductions as ``(start, end, chunk)``."""
    dp_tail_s: float
    """How far the reductions run past the pipeline."""
    post_gather_s: float
    """ZeRO-1/2's (or the BF16 optimizer's) parameter all-gather after the optimizer step (its exposed part)."""
    optimizer_s: float
    priced_makespan_s: float
    """The pipeline time the estimate priced (extrapolated past ``simulated_micro_batches``)."""
    simulated_micro_batches: int

    @property
    def makespan_s(self) -> float:
        return self.pipeline.makespan_s

    @property
    def step_time_s(self) -> float:
        """Pipeline, the reductions' tail, the gather and the optimizer step: the estimate's step
        time before calibration (to the extrapolation's tolerance; exactly when not extrapolated)."""
        return self.pipeline.makespan_s + self.dp_tail_s + self.post_gather_s + self.optimizer_s


def step_timeline(config: ParallelConfig, system: System) -> StepTimeline:
    """The timeline of one step of ``config`` (validated: pass what ``estimate`` accepted)."""
    c, ctx = config, system
    lay = layout(ctx, c)
    runtime = ctx.pipeline_runtime(c, lay.stage_kinds)
    ct = chunk_times(ctx, c, lay, tp_times(ctx, c, lay.stage_kinds), runtime, cp_times(ctx, c, lay.stage_kinds))
    p2p = chunk_p2p_times(ctx, c, lay.num_chunks)
    m, v = c.num_micro_batches, lay.virtual_stages
    posted = posted_receives(ctx, c)
    z = pipeline_compression(ctx, c, lay, p2p)  # compressed backward sends: shorter transfers, kernels
    sh = sharing(ctx, lay, ct)  # CPU ranks sharing cores: processor sharing
    tl = timeline(lay.schedule, c.pp, m, v, ct.forward_s, ct.backward_s, p2p, posted, z, sh)
    priced = run_schedule(lay.schedule, c.pp, m, v, ct.forward_s, ct.backward_s, p2p, posted, z, sh)
    floor = pipeline_floor(c, ct.forward_s, ct.backward_s, lay.num_chunks, sh)
    full = simulate(lay.schedule, c.pp, m, v, ct.forward_s, ct.backward_s, p2p, posted, z, sh)  # the same run, cached
    spans = reduction_spans(ctx, c, lay, full, tl.makespan_s, ct.backward_s)
    tail = max([tl.makespan_s, *(s[1] for dev in spans for s in dev)]) - tl.makespan_s
    beside, after = embedding_sync_s(ctx, c)  # as the estimate: the tied embedding's sync
    tail = max(tail, beside) + after

    def parts(*named):
        return tuple((k, s) for k, s in named if s > 0.0)

    fwd = tuple(parts(("compute", ct.compute_forward_s[i]), ("tp_comm", ct.tp_comm_forward_s[i]),
                      ("cp_comm", ct.cp_comm_forward_s[i]), ("ep_comm", ct.ep_comm_forward_s[i]),
                      ("dp_comm", ct.dp_inline_forward_s[i]),
                      ("runtime", runtime))
                for i in range(lay.num_chunks))
    bwd = tuple(parts(("recompute", ct.recompute_s[i]), ("compute", ct.compute_backward_s[i]),
                      ("tp_comm", ct.tp_comm_s[i] - ct.tp_comm_forward_s[i]),
                      ("cp_comm", ct.cp_comm_s[i] - ct.cp_comm_forward_s[i]),
                      ("ep_comm", ct.ep_comm_s[i] - ct.ep_comm_forward_s[i]),
                      ("dp_comm", ct.dp_inline_s[i] - ct.dp_inline_forward_s[i]), ("runtime", runtime))
                for i in range(lay.num_chunks))
    return StepTimeline(config=c, schedule=lay.schedule, virtual_stages=v, pipeline=tl, forward_parts=fwd,
                        backward_parts=bwd, dp_reductions=tuple(tuple(s) for s in spans), dp_tail_s=tail,
                        post_gather_s=post_all_gather_s(ctx, c, lay), optimizer_s=optimizer_step_s(ctx, c, lay),
                        priced_makespan_s=max(priced.makespan_s, floor), simulated_micro_batches=priced.m_sim)
