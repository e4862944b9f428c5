"""Mixture-of-experts layers: expert parallelism, the token all-to-alls, expert states and memory.

An MoE block's MLP is a router (an h x E matrix scoring the experts), the tokens' top-k routed
experts and the shared experts every token goes through (``model``). With expert parallelism the E
routed experts of each MoE block are split over the ep ranks of an expert-parallel group, which
lies inside the dp x cp ranks holding the same layers (``config.ParallelConfig.ep``, as Megatron-LM
folds it). Per MoE block and micro-batch, on each rank (T = b x s / cp tokens, k = top-k):

- **dispatch / combine**: two all-to-alls over the EP group (``Megatron's alltoall token
  dispatcher``, torchtitan's): each rank sends every (token, expert) pair whose expert lives on
  another rank, T x k x (ep - 1)/ep hidden vectors under uniform routing, and receives as many; the
  backward sends the gradients back the same way (two more). On the links the group spans (NVLink
  inside a host or an NVLink domain, the NICs across), at the collective library's efficiency.
  Exposed, unless Megatron-Core's ``--overlap-moe-expert-parallel-comm`` (``ep_comm_overlap``) runs
  them under another micro-batch's computation (``paired_layer_s``: its combined 1F1B; DeepSeek's
  DualPipe pairs micro-batches the same way). No framework does by default. With DeepEP's kernels
  (``moe_dispatcher``: deepep) a token crosses the NICs once per other host holding one of its
  experts and NVLink once per other GPU there (``deepep_bytes``), group-limited routing capping
  the hosts (``routing_spread``);
- **expert work**: each rank's E/ep experts take T x k assignments together (each expert
  T x k x ep / E rows: a grouped GEMM of many small GEMMs), times the **load imbalance** of the
  busiest rank (``System.moe_imbalance``: 1.0 is perfect balance, as forced-balance benchmarks
  run; a measured or user-given factor otherwise), capped by the capacity factor when tokens are
  dropped (``moe_capacity_factor``: no expert takes more than cf x its balanced share);
- **states**: expert weights are split over ep (and over tp where the framework splits experts:
  Megatron's expert tensor-parallel size defaults to tp; torchtitan under expert parallelism and
  the reference trainer keep whole experts on every tp rank, which then routes its own tokens:
  ``Framework.expert_split``), and their gradients reduced, and ZeRO-sharded, over the dp x cp / ep ranks
  holding the same experts (``expert_dp``);
- **activations**: the permuted tokens (k per token, both directions), the experts' hidden
  activations for their T x k rows and the router's fp32 probabilities (``moe_activation_bytes``).
"""

from __future__ import annotations

import dataclasses
import functools

from autoconf.cost import comm
from autoconf.cost.activations import mlp_hidden_rows
from autoconf.cost.compute import Moe
from autoconf.cost.groups import axis_links, collective_s
from autoconf.cost.roofline import LayerTimes
from autoconf.cost.system import System
from autoconf.space.config import ParallelConfig, module_key, recomputed_modules


def load_factor(system: System, c: ParallelConfig) -> float:
    """The busiest expert rank's assignments over the balanced share: the load imbalance, capped
    by the capacity factor where tokens are dropped."""
    f = max(1.0, system.moe_imbalance)
    return min(f, c.moe_capacity_factor) if c.moe_capacity_factor is not None else f


def routed_tokens(system: System, c: ParallelConfig) -> float:
    """Tokens one rank routes per micro-batch: its b x s / cp, or its sequence-parallel shard of
    them where every tp rank holds whole experts."""
    T = c.micro_batch_size * system.model.seq_length / c.cp
    return T / c.tp if (c.sequence_parallel and system.framework.expert_split(c) == 1) else T


def moe_shape(system: System, c: ParallelConfig) -> Moe:
    """The MoE MLP one rank runs per micro-batch (``compute.Moe``)."""
    m = system.model
    T = routed_tokens(system, c)
    local = m.num_experts // c.ep
    assignments = T * m.experts_per_token * load_factor(system, c)
    return Moe(local_experts=local, rows=assignments / local, expert_ffn=m.expert_ffn,
               shared_ffn=m.num_shared_experts * m.shared_expert_ffn if m.num_shared_experts else 0,
               num_experts=m.num_experts, assignments=assignments, tokens=T, etp=system.framework.expert_split(c))


def a2a_bytes(system: System, c: ParallelConfig) -> float:
    """Bytes one rank sends in one all-to-all (dispatch or combine) of one MoE block and
    micro-batch: its T x k (token, expert) pairs whose expert lives on another of the ep ranks,
    hidden vectors at the activation's precision, uniform routing (times the load factor: the
    busiest rank receives that much more)."""
    m = system.model
    if c.ep == 1:
        return 0.0
    T = a2a_tokens(system, c)
    return T * m.experts_per_token * (c.ep - 1) / c.ep * m.hidden_size * m.dtype_bytes * load_factor(system, c)


def a2a_tokens(system: System, c: ParallelConfig) -> float:
    """Tokens one rank sends into the expert-parallel all-to-all per micro-batch: its
    sequence-parallel shard under tp (the MoE layer's input is sequence-sharded), also where the
    experts are tensor-parallel: Megatron-LM dispatches each rank's own shard over the EP group
    and all-gathers the received tokens inside the expert-TP group after it
    (``MoEAlltoAllTokenDispatcher.dispatch_postprocess``, megatron-core 0.16.1
    ``transformer/moe/token_dispatcher.py``; :func:`expert_tp_gather_s`)."""
    T = c.micro_batch_size * system.model.seq_length / c.cp
    return T / c.tp if c.sequence_parallel and c.tp > 1 else T


def expert_tp_gather_s(system: System, c: ParallelConfig) -> float:
    """Megatron-LM's all-gather of the dispatched tokens inside the expert-tensor-parallel group
    (and, in the combine, the reduce-scatter of their outputs): each of the etp ranks contributes
    the ``k x a2a_tokens`` rows it received; 0 where experts are whole on every rank."""
    et = system.framework.expert_split(c)
    if et == 1 or c.ep == 1:
        return 0.0
    m = system.model
    rows = et * a2a_tokens(system, c) * m.experts_per_token * load_factor(system, c)
    return collective_s(system, axis_links(system, c, "tp"), comm.all_gather_s, et,
                        rows * m.hidden_size * m.dtype_bytes)


@functools.lru_cache(maxsize=512)
def routing_spread(experts: int, k: int, groups: int, group_topk: int, ranks: int, hosts: int) -> tuple:
    """(hosts, ranks) one token's k experts lie on, on average: the router simulated on seeded
    uniform scores (balanced routing) for a few thousand tokens, the experts in order over
    ``ranks`` ranks, the ranks in order over ``hosts`` hosts. Group-limited routing as the router
    runs it (``autoconf.trainer.moe.route``): the ``group_topk`` groups with the highest sums of their top
    k / group_topk scores, then the top k inside them. Deterministic (seed 0)."""
    import numpy as np

    tokens = max(256, min(4096, (1 << 22) // experts))
    s = np.random.default_rng(0).random((tokens, experts))
    if groups > 1 and group_topk < groups:
        per = s.reshape(tokens, groups, experts // groups)
        score = np.sort(per, axis=-1)[:, :, per.shape[-1] - k // group_topk:].sum(axis=-1)
        best = np.argpartition(-score, group_topk - 1, axis=1)[:, :group_topk]
        allowed = np.zeros((tokens, groups), dtype=bool)
        allowed[np.arange(tokens)[:, None], best] = True
        s = np.where(np.repeat(allowed, experts // groups, axis=1), s, -1.0)
    chosen = np.argpartition(-s, k - 1, axis=1)[:, :k]
    rank = chosen * ranks // experts
    host = np.minimum(rank * hosts // ranks, hosts - 1)
    rows = np.arange(tokens)[:, None]
    hit_r, hit_h = np.zeros((tokens, ranks), dtype=bool), np.zeros((tokens, hosts), dtype=bool)
    hit_r[rows, rank] = True
    hit_h[rows, host] = True
    return float(hit_h.sum(axis=1).mean()), float(hit_r.sum(axis=1).mean())


def deepep_spread(model, g) -> tuple[float, float]:
    """(hosts, GPUs) of the EP group ``g`` that one token's k experts lie on (``routing_spread``;
    group-limited routing, ``router_groups`` / ``router_group_topk``, confines a token to its best
    groups: with a group per host, DeepSeek-V3's node-limited routing, to at most 4 of 8 hosts)."""
    G, M = model.router_groups, model.router_group_topk
    return routing_spread(model.num_experts, model.experts_per_token, G, M, g.size, g.num_hosts)


def deepep_bytes(system: System, c: ParallelConfig, g) -> tuple[float, float]:
    """(NIC bytes, NVLink bytes) one rank sends in one DeepEP dispatch (or combine) of one MoE
    block and micro-batch over EP group ``g``: each of its T tokens once to every other host
    holding one of its experts (over RDMA, to the GPU of the same local index there), then, on
    each host, from that GPU to every other GPU holding one of its experts (NVLink); the combine
    the reverse, each host's partial sum crossing the NICs once (``deepep_spread``; 16-bit
    tokens, as Megatron-LM's flex dispatcher sends them; times the load factor)."""
    m = system.model
    T = routed_tokens(system, c)
    hosts, ranks = deepep_spread(m, g)
    L = max(1, g.local_size)
    unit = T * m.hidden_size * m.dtype_bytes * load_factor(system, c)
    return unit * hosts * (g.num_hosts - 1) / g.num_hosts, unit * ranks * (L - 1) / L


def deepep_s(system: System, c: ParallelConfig, g) -> float:
    """One DeepEP dispatch (or combine) over ``g``: the NIC and NVLink shares pipelined (chunks
    forwarded as they arrive), so the slower of the two, at the collective library's efficiency,
    plus a message latency per peer host and per peer GPU."""
    tune = system.collective_tuning
    nic, nvl = deepep_bytes(system, c, g)
    L = max(1, g.local_size)
    t_nic = nic / (g.inter_bandwidth_bytes_per_s * tune.inter_efficiency) if nic else 0.0
    t_nvl = nvl / (g.intra_bandwidth_bytes_per_s * tune.intra(L)) if nvl else 0.0
    lat = (g.num_hosts - 1) * g.inter_latency_s + (L - 1) * g.intra_latency_s
    return tune.base_latency_s + max(t_nic, t_nvl) + lat


def a2a_times(system: System, c: ParallelConfig) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE block's all-to-alls per micro-batch (dispatch and
    combine; the backward's two carry the gradients), on the slowest EP group; exposed. Full
    recomputation runs the forward's again in the backward. ``c.moe_dispatcher``: an all-to-all
    of every (token, expert) pair (``a2a_bytes``), or DeepEP's (``deepep_s``)."""
    if c.ep == 1:
        return 0.0, 0.0
    tune = system.collective_tuning
    if c.moe_dispatcher == "deepep":
        one = max(deepep_s(system, c, g) for g in axis_links(system, c, "ep"))
    else:
        nbytes = a2a_bytes(system, c)
        one = (max(comm.all_to_all_s(nbytes, g, tune) for g in axis_links(system, c, "ep"))
               + expert_tp_gather_s(system, c))
    fwd = 2 * one
    return fwd, 2 * one + (fwd if c.recompute == "full" else 0.0)


def paired_fraction(system: System, c: ParallelConfig, rank: int) -> float:
    """Of pipeline rank ``rank``'s forward passes, the fraction Megatron-Core's combined 1F1B runs
    together with a backward (``ep_comm_overlap``; 0 without it). Without pipelining, every
    micro-batch's forward but the first runs beside the previous one's backward: (m - 1) / m. With
    the interleaved schedule, the steady 1F1B steps: all m x v chunk forwards but the warm-up,
    which is the interleaved schedule's, 2 (pp - 1 - rank) + (v - 1) pp, plus the one extra
    forward the combined schedule runs first so that every pair is independent
    (``get_pp_rank_microbatches``; micro-batch groups of pp, Megatron's default)."""
    if c.ep == 1 or not system.framework.knob(c, "ep_comm_overlap"):
        return 0.0
    m = c.num_micro_batches
    if c.pp == 1:
        return (m - 1) / m
    total = m * c.virtual_stages
    warmup = min(total, 2 * (c.pp - 1 - rank) + (c.virtual_stages - 1) * c.pp + 1)
    return (total - warmup) / total


def paired_layer_s(attn_f: float, mlp_f: float, attn_b: float, mlp_b: float, a2a: float) -> float:
    """Seconds of one MoE layer's forward (of one micro-batch) and backward (of another) run
    together on two CUDA streams, as Megatron-Core's ``TransformerLayerSchedulePlan.run`` issues
    them::

        comm:    combine_bwd | dispatch_fwd -> dispatch_bwd  | combine_fwd
        compute: attn_fwd    | mlp_bwd -> mlp_dw -> mlp_fwd  | attn_bwd

    ``attn_*``: the layer's work outside the routed experts (attention, norms, router, shared
    experts, permutation); ``mlp_*``: the routed experts; ``a2a``: one all-to-all. Each node
    starts when its stream is free and its input exists: mlp_bwd after combine_bwd, dispatch_fwd
    after attn_fwd, dispatch_bwd after mlp_bwd, mlp_fwd after dispatch_fwd, combine_fwd after
    mlp_fwd, attn_bwd after dispatch_bwd. mlp_bwd is the experts' whole backward: mlp_dw only
    splits the weight gradient out under ``--delay-wgrad-compute`` (a no-op otherwise,
    ``TransformerLayerNode.backward_dw``), which autoconf does not emit. Without overlap the same
    work takes attn_f + mlp_f + attn_b + mlp_b + 4 a2a."""
    cb = a2a                                   # comm: combine_bwd from 0
    af = attn_f                                # compute: attn_fwd from 0
    mb = max(af, cb) + mlp_b                   # compute: mlp_bwd (data and weight gradients)
    df = max(cb, af) + a2a                     # comm: dispatch_fwd
    db = max(df, mb) + a2a                     # comm: dispatch_bwd
    mf = max(mb, df) + mlp_f                   # compute: mlp_fwd
    cf = max(db, mf) + a2a                     # comm: combine_fwd
    ab = max(mf, db) + attn_b                  # compute: attn_bwd
    return max(cf, ab)


def paired_exposed_s(system: System, c: ParallelConfig, kind: str, one: float) -> float:
    """All-to-all seconds one MoE layer's paired forward and backward (``paired_layer_s``) leave
    exposed on ``kind``, one all-to-all taking ``one``: the pair's time less the computation of
    both."""
    whole, attn = block_for(system, kind, c, moe=True), block_for(system, kind, c, moe=True, routed=False)
    af, ab = attn.forward_s, attn.backward_s
    mf, mb = whole.forward_s - af, whole.backward_s - ab
    return max(0.0, paired_layer_s(af, mf, ab, mb, one) - (af + mf + ab + mb))


def a2a_exposed_s(system: System, c: ParallelConfig, kinds, rank: int, alone: tuple | None = None) -> tuple:
    """(forward, backward) all-to-all seconds one MoE block of pipeline rank ``rank`` exposes per
    micro-batch, on average over the schedule: ``alone`` (``a2a_times``, computed when None) for
    the passes that run alone, half a pair's exposed time each (``paired_exposed_s``, the slowest
    of ``kinds``) for the ``paired_fraction`` that Megatron's combined 1F1B runs together."""
    f, b = alone if alone is not None else a2a_times(system, c)
    p = paired_fraction(system, c, rank)
    if p == 0.0:
        return f, b
    half = max(paired_exposed_s(system, c, k, f / 2) for k in kinds) / 2  # f: dispatch + combine
    return (1 - p) * f + p * half, (1 - p) * b + p * half


def moe_activation_bytes(system: System, c: ParallelConfig, mask: int) -> dict:
    """Bytes one MoE block keeps for the backward per micro-batch and rank, in place of a dense
    block's (``System.layer_activations``): the dense formula's MLP hidden activations replaced by
    the experts' (T x k x load rows of the expert width, and the shared experts' T rows), plus the
    dispatched tokens (T x k x h), the experts' outputs as the combine keeps them
    (``Framework.moe_output_weighted``: an fp32 copy, or nothing) and the router's fp32
    probabilities (T x E); everything else (attention, norms) as a dense block.
    Where FP8 keeps the linear layers' inputs in FP8 (``Framework.fp8_saves_inputs``), the experts'
    down-projection inputs and the dispatched tokens (the grouped up projection's input) take
    1 byte, as the dense block's do (``activations._fp8_saved``). Megatron-LM's recompute modules
    (``config.recomputed_modules``) free "moe_act", the routed experts' activation outputs (the
    down projection then keeps the original, not an FP8 copy, and it is freed), and "layernorm",
    the output of the norm before the router (a separate norm in a mixture-of-experts block)."""
    m = system.model
    dense = system.layer_activations(c, mask)
    if c.recompute == "full":
        return dense  # only the block's input is kept; the working set is recomputed
    e, tp = m.dtype_bytes, c.tp
    T = c.micro_batch_size * m.seq_length / c.cp
    hidden_per_row = mlp_hidden_rows(m, system.framework.fused_glu)
    # FP8 that keeps the linear layers' inputs in FP8 (1 byte): the down projections' (one f-wide
    # tensor of the rows) and the experts' up projection's (the dispatched tokens)
    fp8_in = c.precision == "fp8" and system.framework.fp8_saves_inputs
    low = (e - 1) if fp8_in else 0
    dense_mlp = T * (e * hidden_per_row - low) * m.ffn_hidden_size / tp
    sh = moe_shape(system, c)
    expert_mlp = (e * hidden_per_row - low) * (sh.assignments * m.expert_ffn + sh.tokens * sh.shared_ffn) / sh.etp
    # the dispatched tokens (the grouped up projection's input), the fp32 copy of the experts'
    # outputs a combine weighting them keeps (Framework.moe_output_weighted; else the router's
    # fp32 score per assignment, kept by the weighted activation), the router's fp32 probabilities
    weighted = system.framework.moe_output_weighted
    extra = ((e - low + (4.0 if weighted else 0.0)) * sh.assignments * m.hidden_size
             + (0.0 if weighted else 4.0 * sh.assignments) + 4.0 * sh.tokens * m.num_experts)
    out = dict(dense)
    out["mlp_hidden"] = out.get("mlp_hidden", 0.0) - dense_mlp + expert_mlp
    out["moe_permuted_and_router"] = extra
    mods, freed = recomputed_modules(c), 0.0
    if "moe_act" in mods:  # the routed experts' activation output (their down projection's input)
        act_out = (e - low) * sh.assignments * m.expert_ffn / sh.etp
        out["mlp_hidden"] -= act_out
        freed += act_out
    if "layernorm" in mods:  # the norm before the router and experts: its output rebuilt
        freed += out.pop("mlp_input", 0.0)
    out["total"] = dense["total"] - dense_mlp + expert_mlp + extra - freed
    return out


def block_for(system: System, kind: str, c, moe: bool = False, routed: bool = True) -> LayerTimes:
    """``System.block`` for configuration ``c`` (its micro-batch, tp, cp, precision, compile);
    ``moe``: a mixture-of-experts block (its experts over ``c.ep``, ``cost.moe``);
    ``routed=False``: that block without its routed experts' work (what
    ``moe.paired_exposed_s`` overlaps with their all-to-alls)."""
    shape = None
    if moe:
        shape = moe_shape(system, c)
        if not routed:
            shape = dataclasses.replace(shape, rows=0.0)
    return system.block(kind, c.micro_batch_size, c.tp, c.sequence_parallel, c.recompute, c.cp,
                        c.fp8_recipe if c.precision == "fp8" else None,
                        system.framework.knob(c, "torch_compile"), shape, system.policy.accumulates(c),
                        system.policy.bf16_optimizer(c),
                        module_key(c), tf32=c.precision == "tf32")
