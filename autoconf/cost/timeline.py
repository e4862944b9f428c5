"""step_timeline(config, system) -> StepTimeline: the events of the step the estimate prices.

The same recipe as ``estimate.estimate_on``, kept as events instead of sums: the chunk times
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
from typing import Sequence

from autoconf.cost.chunk_time import chunk_times, optimizer_step_s
from autoconf.cost.compression import embedding_sync_s, pipeline_compression
from autoconf.cost.context_parallel import cp_times
from autoconf.cost.data_parallel import post_all_gather_s, reduction_spans
from autoconf.cost.layout import layout
from autoconf.cost.pipeline import (
    Compression,
    Sharing,
    _checked,
    _compiled,
    _durations,
    _floats,
    _pass,
    _sharing,
    simulate,
)
from autoconf.cost.schedule_time import chunk_p2p_times, pipeline_floor, posted_receives, run_schedule, sharing
from autoconf.cost.system import System
from autoconf.cost.tensor_parallel import tp_times
from autoconf.space.config import ParallelConfig
from autoconf.space.schedules import check_shape


@dataclass(frozen=True)
class Op:
    """One forward or backward of one micro-batch through one chunk, as the simulation ran it."""

    device: int
    kind: str
    """``"F"`` or ``"B"``."""
    micro_batch: int
    chunk: int
    """Global chunk index (model order); ``chunk // pp`` is its virtual stage on the device."""
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Transfer:
    """A point-to-point send between adjacent chunks: on its link from ``start_s`` (the data is
    ready and the link free) to ``end_s``, delaying the op that needs it but occupying neither
    device."""

    src_device: int
    dst_device: int
    kind: str
    """``"activation"`` (forward) or ``"gradient"`` (backward)."""
    micro_batch: int
    chunk: int
    """The receiving op's chunk."""
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Timeline:
    """Every op and transfer of one simulated step, from the simulation ``simulate`` runs."""

    makespan_s: float
    ops: tuple[Op, ...]
    """In a topological order of the dependencies (per device: its execution order)."""
    transfers: tuple[Transfer, ...]
    """The transfers that take time (p2p_s > 0)."""


def timeline(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int,
             forward_s: Sequence[float], backward_s: Sequence[float], p2p_s: Sequence[float],
             posted: bool = False, compression: Compression | None = None,
             sharing: Sharing | None = None) -> Timeline:
    """The events of the step ``simulate`` prices: the same compiled schedule and the same pass
    (``_run``, or ``_run_shared`` under processor sharing); each op's start is read back from what
    it waited for (its device's previous op, its input's arrival), so the events are exactly the
    simulated ones."""
    check_shape(schedule, pp, num_micro_batches, virtual_stages)
    m, nc = num_micro_batches, pp * virtual_stages
    fwd, bwd = _floats("forward_s", forward_s, nc), _floats("backward_s", backward_s, nc)
    z = _checked(compression, nc)
    dur, P = _durations(fwd, bwd, _floats("p2p_s", p2p_s, nc - 1), z)
    comp = _compiled(schedule, pp, m, virtual_stages, z)
    E, sends, _busy, _starts = _pass(comp, dur, P, posted, _sharing(sharing, pp, nc))
    sends = iter(sends)
    n_f = nc * m
    ops, transfers = [], []
    for k, ((pv, dp, pi, _di, _li), code) in enumerate(zip(comp.ops, comp.codes)):
        is_b = code >= n_f
        c, mb = (code % n_f) // m, code % m
        if pi and P[pi]:
            sent = next(sends)
            arrive = sent + P[pi]
            transfers.append(Transfer((c + 1 if is_b else c - 1) % pp, c % pp, "gradient" if is_b else "activation",
                                      mb, c, sent, arrive))
        else:
            arrive = E[dp]
        ops.append(Op(c % pp, "B" if is_b else "F", mb, c, max(E[pv], arrive), E[k + 1]))
    return Timeline(max(E[k] for k in comp.dev_last), tuple(ops), tuple(transfers))

__all__ = ["Op", "StepTimeline", "Timeline", "Transfer", "step_timeline", "timeline"]


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








