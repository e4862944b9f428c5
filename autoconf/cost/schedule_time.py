"""The pipeline schedule's makespan: simulated, extrapolated past the warm-up, bounded below.

``pipeline.simulate`` plays a schedule event by event; a step has up to thousands of
micro-batches, so :func:`run_schedule` simulates a few and extrapolates the steady state.
:func:`pipeline_floor` is a makespan no schedule can beat (the search prunes with it), and
:func:`p2p_times` the point-to-point transfer of an activation between adjacent stages (Hockney's
alpha-beta: latency + bytes / bandwidth, on the slowest replica's link).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from autoconf.cost.pipeline import simulate
from autoconf.cost.system import System
from autoconf.space.config import ParallelConfig
from autoconf.space.placement import Placement


@dataclass(frozen=True)
class Schedule:
    makespan_s: float
    busy_s: tuple
    last_backward_end_s: tuple
    m_sim: int


def sim_size(schedule: str, pp: int, m: int) -> int:
    """Micro-batches to simulate first: all of them when few, else a multiple of pp past the warm-up."""
    cap = max(2 * pp, 8)
    if m <= cap + pp:
        return m
    return -(-cap // pp) * pp  # a multiple of pp (interleaved needs it)


def run_schedule(schedule, pp, m, v, fwd, bwd, p2p, posted: bool = False, compression=None,
                 sharing=None) -> Schedule:
    """The schedule's makespan for m micro-batches without simulating thousands of them.

    Past the warm-up every schedule repeats one period per micro-batch, so the makespan is affine
    in m. The slope is measured between two simulations pp micro-batches apart, and the simulated
    size is doubled until two successive slopes agree within 0.1% (unequal stages take longer to
    settle) or the whole step is simulated. ``posted``: transfers wait for the receive to be posted
    (``pipeline.simulate``; :func:`posted_receives`). ``compression``: a ``pipeline.Compression``
    (epilogue-only compression touches the simulated step's last sends: the extrapolated steady
    state is the uncompressed one, as in the real step). ``sharing``: CPU ranks sharing cores
    (``pipeline.Sharing``, from ``System.cpu_sharing``).
    """
    m_sim = sim_size(schedule, pp, m)
    r = simulate(schedule, pp, m_sim, v, fwd, bwd, p2p, posted, compression, sharing)
    if m_sim == m:
        return Schedule(r.makespan_s, r.busy_s, r.last_backward_end_s, m)
    slope = (r.makespan_s - simulate(schedule, pp, m_sim - pp, v, fwd, bwd, p2p, posted, compression, sharing).makespan_s) / pp
    while True:
        m_next = 2 * m_sim if 2 * m_sim < m else m  # stays a multiple of pp until it is m
        r_next = simulate(schedule, pp, m_next, v, fwd, bwd, p2p, posted, compression, sharing)
        if m_next == m:
            return Schedule(r_next.makespan_s, r_next.busy_s, r_next.last_backward_end_s, m)
        slope_next = (r_next.makespan_s - simulate(schedule, pp, m_next - pp, v, fwd, bwd, p2p, posted, compression, sharing).makespan_s) / pp
        m_sim, r = m_next, r_next
        if abs(slope_next - slope) <= 1e-3 * max(slope_next, 1e-30):
            slope = slope_next
            break
        slope = slope_next
    extra = (m - m_sim) * slope
    scale = m / m_sim
    return Schedule(r.makespan_s + extra, tuple(b * scale for b in r.busy_s),
                    tuple(t + extra for t in r.last_backward_end_s), m_sim)


def pipeline_floor(c: ParallelConfig, fwd, bwd, n_chunks: int, sharing=None) -> float:
    """A pipeline makespan no schedule can beat.

    Device d cannot start before micro-batch 0's forward has crossed chunks 0..d-1, and after its
    last backward the gradient still has to cross them back; in between it does all its own work:
    makespan >= max_d (sum_{c<d} (f_c + b_c) + m x busy_d). For equal stages this is the 1F1B
    makespan (m + p - 1)(f + b) and the interleaved one, (m v + p - 1)(f + b) / v.

    With ``sharing`` (CPU ranks sharing cores, ``pipeline.Sharing``) a device may compute up to
    its share faster than its durations say, alone on its cores: the bound is then the larger of
    that floor at one core per rank and each machine's work over its cores.
    """
    lower, prefix = 0.0, 0.0
    busy = [sum(fwd[ci] + bwd[ci] for ci in range(d, n_chunks, c.pp)) * c.num_micro_batches for d in range(c.pp)]
    for d in range(c.pp):
        lower = max(lower, prefix + busy[d])
        prefix += fwd[d] + bwd[d]
    if sharing is None:
        return lower
    lower /= max(sharing.share)
    # a machine computes at most its cores' work at once (the fixed parts are not compute)
    ff = sharing.fixed_forward or (0.0,) * n_chunks
    fb = sharing.fixed_backward or (0.0,) * n_chunks
    work = [b - sum(ff[ci] + fb[ci] for ci in range(d, n_chunks, c.pp)) * c.num_micro_batches
            for d, b in enumerate(busy)]
    for row, cores in zip(sharing.weights, sharing.cores):
        lower = max(lower, sum(w * max(0.0, x) / s for w, x, s in zip(row, work, sharing.share)) / cores)
    return lower


def sharing(system: System, lay, ct):
    """How the configuration's CPU ranks share their machines' cores (``System.cpu_sharing``),
    with each chunk's communication (its tp, cp and ep collectives and inline data-parallel
    traffic, not priced at the core share) as the fixed part of its ops; None where no CPU rank
    shares cores."""
    sh = system.cpu_sharing(lay.stage_devices)
    if sh is None:
        return None
    n = lay.num_chunks
    fwd = tuple(ct.tp_comm_forward_s[i] + ct.cp_comm_forward_s[i] + ct.ep_comm_forward_s[i] + ct.dp_inline_forward_s[i]
                for i in range(n))
    bwd = tuple(ct.tp_comm_s[i] + ct.cp_comm_s[i] + ct.ep_comm_s[i] + ct.dp_inline_s[i] - fwd[i] for i in range(n))
    return dataclasses.replace(sh, fixed_forward=fwd, fixed_backward=bwd)


def p2p_times(system: System, c: ParallelConfig, nbytes: float) -> list[float]:
    """Transfer time between consecutive pipeline stages (slowest replica pair, on the devices the
    placement gives them; the replicas' transfers share each host's NICs, as they run together), per stage pair,
    with the collective library's fixed cost per call and its bus efficiency on the tier crossed
    (``System.collective_tuning``)."""
    tune = system.collective_tuning

    def make():
        topo = system.topology
        # each replica's pipeline: its devices by stage (a pp group), read off the rank order
        # rather than decoding every rank's coordinates
        chains = Placement.of(c, 0).device_groups("pp")
        on_host = topo.host_of.__getitem__
        links = []
        for s in range(c.pp):
            nxt = (s + 1) % c.pp
            pairs = [(g[s], g[nxt]) for g in chains]
            hosts = [(on_host(a), on_host(b)) for a, b in pairs]
            # every replica's pipeline crosses this boundary at the same time: the flows leaving
            # (entering) a host share its NICs
            out_of = Counter(ha for ha, hb in hosts if ha != hb)
            into = Counter(hb for ha, hb in hosts if ha != hb)
            if not topo.measured:  # one pair of each kind: its link and flows are its hosts' (p2p, nic_share)
                alike = topo.device_classes()
                pairs = list({(alike[a], alike[b], ha == hb, out_of[ha], into[hb]): (a, b)
                              for (a, b), (ha, hb) in zip(pairs, hosts)}.values())
            worst = (0.0, 0.0)
            for a, b in pairs:
                bw, lat = topo.p2p(a, b)
                ha, hb = topo.host_of[a], topo.host_of[b]
                if ha != hb:
                    bw = min(bw, topo.nic_share(ha, out_of[ha]), topo.nic_share(hb, into[hb]))
                eff = tune.inter_efficiency if ha != hb else tune.intra(2)
                worst = max(worst, (1.0 / (bw * eff), lat + tune.base_latency_s))
            links.append(worst)
        return links
    links = system.cached(("p2p", c.dp, c.pp, c.tp, c.cp, c.rank_order, c.device_order), make)
    return [lat + nbytes * inv_bw for inv_bw, lat in links]


def boundary_bytes(system: System, c: ParallelConfig) -> float:
    """Bytes of the tensor crossing a layer boundary, per micro-batch and TP rank: the activation a
    pipeline stage sends on, and the gradient w.r.t. a block's (or the head's) input.

    The tensor crossing a layer boundary is [b, s, h] at the activation precision (its sequence
    shard [b, s/t, h] under sequence parallelism); its gradient has the same shape and dtype (the
    block input Korthikanti et al. count as 2sbh in 16 bit, arXiv 2205.05198 sec. 4).
    """
    m = system.model
    return boundary_tokens(system, c) * m.hidden_size * m.dtype_bytes


def boundary_tokens(system: System, c: ParallelConfig) -> int:
    """Tokens of a micro-batch on one rank at a layer boundary: its sequence shard under context
    parallelism, and under sequence parallelism its tp shard of that."""
    return c.micro_batch_size * system.model.seq_length // c.cp // (c.tp if c.sequence_parallel else 1)


def chunk_p2p_times(system: System, c: ParallelConfig, n_chunks: int) -> tuple:
    """Transfer time after each chunk but the last: one micro-batch's activation (sharded along
    the sequence with sequence parallelism) over the link to the next stage."""
    if c.pp == 1:
        return tuple(0.0 for _ in range(n_chunks - 1))
    per_stage = p2p_times(system, c, boundary_bytes(system, c))
    return tuple(per_stage[ci % c.pp] for ci in range(n_chunks - 1))


def posted_receives(system: System, c: ParallelConfig) -> bool:
    """Whether a pipeline transfer waits for its receiver to post the receive, that is for the
    receiver's previous op to end. CPU processes (gloo) compute synchronously, so a stage posts the
    receive for its next op only when its previous op has ended, and gloo's TCP pairs move the
    data only to a posted receive. On GPUs the host runs ahead, but NCCL's point-to-point kernels
    run on the process group's own stream, which ``ProcessGroupNCCL`` makes wait for the work
    already on the compute stream when the call is issued; the frameworks issue a receive after
    the op before it (Megatron-LM's ``send_forward_recv_backward`` and friends, DeepSpeed's
    blocking ``p2p.recv`` at its schedule slot, torch.distributed.pipelining's receives before the
    op that needs them), so the transfer starts when both ops before it have ended. Not where
    the framework posts its receives ahead (``Framework.early_receive_schedules``: Megatron-LM's
    interleaved schedule with its default ``overlap_p2p_comm``)."""
    return system.gloo or c.schedule not in system.framework.early_receive_schedules


def simulate_step(schedule: str, c: ParallelConfig, v: int, fwd: tuple, bwd: tuple, p2p: tuple,
                  posted: bool = False, compression=None, sharing=None):
    """(with transfers, without transfers): the schedule run twice to separate the bubble from the
    pipeline communication (which includes what compressing it costs: the transfer-free run has
    no compression kernels)."""
    n_mb = c.num_micro_batches
    sim = run_schedule(schedule, c.pp, n_mb, v, fwd, bwd, p2p, posted, compression, sharing)
    sim0 = sim if not any(p2p) and compression is None else run_schedule(
        schedule, c.pp, n_mb, v, fwd, bwd, tuple(0.0 for _ in p2p), sharing=sharing)
    return sim, sim0
