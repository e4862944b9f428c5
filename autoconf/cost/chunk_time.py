"""Time of each pipeline chunk per micro-batch, and the optimizer step.

A chunk's forward / backward runs at the speed of the slowest device kind of its stage (the
System's measured or roofline layer times), plus the exposed tensor-parallel collectives of its
layers (``tensor_parallel``), ZeRO's per-micro-batch data-parallel traffic (``data_parallel``) and
the pipeline runtime's measured cost per action. These are the durations the schedule simulation
plays.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoconf.cost.compute import BF16_OPTIMIZER_UPDATE, gradient_passes
from autoconf.cost.context_parallel import CpTimes
from autoconf.cost.data_parallel import per_micro_batch_s
from autoconf.cost.layout import Layout
from autoconf.cost.moe import a2a_exposed_s, a2a_times, block_for
from autoconf.cost.system import System
from autoconf.cost.tensor_parallel import TpTimes
from autoconf.space.config import ParallelConfig, expert_dp


@dataclass(frozen=True)
class ChunkTimes:
    """Per chunk, seconds per micro-batch."""

    forward_s: tuple
    backward_s: tuple
    """What the schedule simulation plays: compute + communication + runtime."""
    compute_forward_s: tuple
    compute_backward_s: tuple
    """Without recomputation."""
    recompute_s: tuple
    tp_comm_s: tuple
    cp_comm_s: tuple
    """Context parallelism's exposed key/value exchange (``context_parallel``)."""
    ep_comm_s: tuple
    """Expert parallelism's dispatch and combine all-to-alls (``moe``)."""
    ep_comm_forward_s: tuple
    dp_inline_s: tuple
    """ZeRO-2/3 traffic exposed during the micro-batch."""
    tp_comm_forward_s: tuple
    cp_comm_forward_s: tuple
    dp_inline_forward_s: tuple
    """The forward's share of ``tp_comm_s``, ``cp_comm_s`` and ``dp_inline_s`` (the rest is the
    backward's)."""


def issue_bound_s(segments) -> float:
    """Seconds from an idle device until the last of ``segments`` ends: (device seconds, host
    seconds) per segment in the order the host issues them, each segment's operations spread
    evenly over it. The device runs an operation once it is issued and the one before it is
    done, so the pass ends at max(all host time, max over k of the host time before segment k +
    the device time from k on)."""
    host = sum(h for _, h in segments)
    best, before, left = host, 0.0, sum(d for d, _ in segments)
    for d, h in segments:
        best = max(best, before + left)
        before, left = before + h, left - d
    return best


def edge_gradient_s(system: System, kind: str, c: ParallelConfig, which: str) -> float:
    """Seconds per micro-batch of the gradient passes ``System.block`` charges a block
    (``compute.gradient_passes``), for the embedding's (``which="embedding"``) or output
    layer's (``"head"``) weights on a rank: the vocabulary is split over tp, the position
    table and the final norm are not; a tied output layer on another stage has its own copy,
    at pp 1 it shares the embedding's. One tensor each. Not where ``System.edge`` takes a
    measured profile's times (its layers are timed as they run)."""
    acc = system.framework.grad_accumulation_kernel and system.policy.accumulates(c)
    upd = system.policy.bf16_optimizer(c)
    if (system.measured_for(kind) and c.cp == 1) or not (acc or upd):
        return 0.0
    m = system.policy.model_at(c.tp)
    vocab = m.vocab_size * m.hidden_size
    if which == "embedding":
        params = vocab / c.tp + m.embedding_params() - vocab
    else:
        params = m.norm_params() + (vocab / c.tp if not m.tied_embeddings or c.pp > 1 else 0.0)
    nbytes, kernels = gradient_passes(params, system.model.dtype_bytes, acc,
                                      BF16_OPTIMIZER_UPDATE if upd else (0.0, 0))
    return system.roofline(kind).elementwise(nbytes, kernels) * system.cpu_share(kind)


def chunk_compute(system: System, c: ParallelConfig, lay: Layout, ci: int) -> tuple:
    """(forward, backward incl. recompute, recompute, host forward, host backward, edges) of chunk
    ``ci``'s layers on the slowest device kind of its stage: its blocks, the embedding on the
    first chunk, the output layer on the last; device times, then the host's issue times; then
    the embedding's and the output layer's own (forward, host forward, backward, host backward),
    None where the chunk has none (what ``issue_bound_s`` orders)."""
    b, tp, nl = c.micro_batch_size, c.tp, lay.chunk_layers[ci]
    n_moe = lay.chunk_moe_layers[ci] if lay.chunk_moe_layers else 0
    best = None
    for kind in lay.stage_kinds[ci % c.pp]:
        lt = block_for(system, kind, c)
        n = nl - n_moe
        f, bw_, rc = n * lt.forward_s, n * lt.backward_s, n * lt.recompute_s
        hf, hb = n * lt.host_forward_s, n * lt.host_backward_s
        if n_moe:
            mt = block_for(system, kind, c, moe=True)
            f, bw_, rc = f + n_moe * mt.forward_s, bw_ + n_moe * mt.backward_s, rc + n_moe * mt.recompute_s
            hf, hb = hf + n_moe * mt.host_forward_s, hb + n_moe * mt.host_backward_s
        edges = []
        for which, here in (("embedding", ci == 0), ("head", ci == lay.num_chunks - 1)):
            e = system.edge(kind, b, tp, which, c.cp, tf32=c.precision == "tf32") if here else None
            if e is not None:
                eb = e.backward_s + edge_gradient_s(system, kind, c, which)  # its weights' gradient passes
                f, bw_, hf, hb = f + e.forward_s, bw_ + eb, hf + e.host_forward_s, hb + e.host_backward_s
                e = (e.forward_s, e.host_forward_s, eb, e.host_backward_s)
            edges.append(e)
        if best is None or max(f + bw_, hf + hb) > max(best[0] + best[1], best[3] + best[4]):
            best = (f, bw_, rc, hf, hb, tuple(edges))
    return best


def synced_passes(synced: tuple, fwd: tuple, bwd: tuple, edges: tuple) -> tuple:
    """(forward, backward) seconds of a chunk's micro-batch as the host and device share them:
    ``fwd``, ``bwd``: (device, host) of the whole pass; ``edges``: ``chunk_compute``'s;
    ``synced``: whether the forward, and the backward, end at a host-device synchronisation
    (``Framework.synced_passes``).

    A pass takes the longer of its host and device times. One that ends synchronised takes
    ``issue_bound_s`` over its segments in issue order (forward: embedding, layers, output layer;
    backward in reverse): device work late in it, the output layer's forward, is not hidden by
    the host's lead over the layers before it, since nothing after the pass is issued until the
    device is done. Each pass is priced on its own: letting the host run ahead across passes
    fitted the GPU development set worse (``bench/gpu_devset.py``)."""
    emb, head = edges
    f, b = max(fwd), max(bwd)
    if synced[0]:
        mid_f = (fwd[0] - sum(e[0] for e in edges if e), fwd[1] - sum(e[1] for e in edges if e))
        f = issue_bound_s(([emb[:2]] if emb else []) + [mid_f] + ([head[:2]] if head else []))
    if synced[1]:
        mid_b = (bwd[0] - sum(e[2] for e in edges if e), bwd[1] - sum(e[3] for e in edges if e))
        b = issue_bound_s(([head[2:]] if head else []) + [mid_b] + ([emb[2:]] if emb else []))
    return f, b


def chunk_times(system: System, c: ParallelConfig, lay: Layout, tpt: TpTimes, runtime_s: float,
                cpt: CpTimes = CpTimes()) -> ChunkTimes:
    """Every chunk's times per micro-batch; ``runtime_s``: the pipeline runtime's cost per action;
    ``cpt``: context parallelism's exposed exchange per layer; a mixture of experts' all-to-alls
    per MoE block (``moe.a2a_exposed_s``: what the rank's paired passes leave exposed where
    ``ep_comm_overlap`` pairs them, else ``moe.a2a_times``)."""
    moe = bool(lay.chunk_moe_layers) and any(lay.chunk_moe_layers)
    alone = a2a_times(system, c) if moe else (0.0, 0.0)
    a2a = {r: a2a_exposed_s(system, c, lay.stage_kinds[r], r, alone) for r in range(c.pp)} if moe else {}
    cols = {k: [] for k in ChunkTimes.__dataclass_fields__}
    for ci, nl in enumerate(lay.chunk_layers):
        f, bw_, rc, host_f, host_b, edges = chunk_compute(system, c, lay, ci)
        tpf = nl * tpt.forward_per_layer_s + (tpt.edge_s if ci == 0 else 0.0)
        tpb = nl * tpt.backward_per_layer_s + (tpt.edge_s if ci == lay.num_chunks - 1 else 0.0)
        # (what the framework hides under the GEMMs is already out: ``tensor_parallel.overlapped``)
        cpf, cpb = nl * cpt.forward_per_layer_s, nl * cpt.backward_per_layer_s
        n_moe = lay.chunk_moe_layers[ci] if lay.chunk_moe_layers else 0
        epf, epb = (n_moe * a2a[ci % c.pp][0], n_moe * a2a[ci % c.pp][1]) if n_moe else (0.0, 0.0)
        extra_f, extra_b = per_micro_batch_s(system, c, lay, ci, f, bw_)
        # the host issues a pass (forward; backward with its recomputation) ahead of the device:
        # the device waits where issuing the pass takes longer than computing it. The TP
        # collectives are kernels on the same stream, queued like the others, so they run inside
        # that wait: a host-bound pass takes the host's time, a device-bound one its compute plus
        # its exposed collectives. (On the GPU development set, bench/gpu_devset.py, a micro-batch
        # takes the same time at tp 1 and tp 2 while host-bound, collectives or not.) Where the
        # framework synchronises, the order inside the pass matters too (``synced_passes``).
        dev_f, dev_b = f + tpf + cpf + epf, bw_ + tpb + cpb + epb
        synced = system.framework.synced_passes(c.pp, c.schedule, c.layered_grad_accum, ci % c.pp == 0,
                                                ci == lay.num_chunks - 1)
        pf, pb = synced_passes(synced, (dev_f, host_f), (dev_b, host_b), edges)
        ex_f = max(0.0, pf - dev_f) if synced[0] else max(0.0, host_f - dev_f)
        ex_b = max(0.0, pb - dev_b) if synced[1] else max(0.0, host_b - dev_b)
        f, bw_ = f + ex_f, bw_ + ex_b
        cols["compute_forward_s"].append(f)
        cols["compute_backward_s"].append(bw_ - rc)
        cols["recompute_s"].append(rc)
        cols["tp_comm_s"].append(tpf + tpb)
        cols["cp_comm_s"].append(cpf + cpb)
        cols["cp_comm_forward_s"].append(cpf)
        cols["ep_comm_s"].append(epf + epb)
        cols["ep_comm_forward_s"].append(epf)
        cols["dp_inline_s"].append(extra_f + extra_b)
        cols["tp_comm_forward_s"].append(tpf)
        cols["dp_inline_forward_s"].append(extra_f)
        cols["forward_s"].append(f + tpf + cpf + epf + extra_f + runtime_s)
        cols["backward_s"].append(bw_ + tpb + cpb + epb + extra_b + runtime_s)
    return ChunkTimes(**{k: tuple(v) for k, v in cols.items()})


def optimizer_step_s(system: System, c: ParallelConfig, lay: Layout) -> float:
    """The optimizer step on the slowest device: AdamW over its local parameters (sharded over dp
    from ZeRO-1 on, and under DeepSpeed's BF16 optimizer), at the System's measured or memory-bound
    rate (``compute.optimizer_s``), after the framework's global gradient-norm pass
    (``Framework.grad_norm_traffic``) over the gradients it holds: the shard where ZeRO shards them,
    every gradient of the stage under DeepSpeed's BF16 optimizer and without ZeRO."""
    opt = 0.0
    norm_traffic = system.framework.grad_norm_traffic * system.policy.grad_bytes
    bf16_opt = norm_traffic and system.policy.bf16_optimizer(c)
    for dev in range(c.pp):
        params = sum(lay.chunk_params[ci] for ci in lay.chunks_of(c, dev))
        experts = sum(lay.chunk_expert_params[ci] for ci in lay.chunks_of(c, dev)) if lay.chunk_expert_params else 0.0
        if system.policy.state_zero_stage(c) >= 1:  # the experts are sharded over the ranks holding the same experts
            local = (params - experts) / (c.dp * c.cp) + experts / max(1, expert_dp(c))
        else:
            local = params
        t = max(system.optimizer_time(k, local) for k in lay.stage_kinds[dev])
        if norm_traffic:
            t += system.copy_time(lay.stage_kinds[dev], norm_traffic * (params if bf16_opt else local))
        opt = max(opt, t)
    return opt
