"""Layout: how one configuration places the model on the System's devices.

Pipeline chunks (``pp x virtual stages``; pp=1 layered accumulation is simulated layer by layer,
as a breadth-first schedule over single-layer chunks), their layers and parameters, the devices
and device kinds of each stage. Derived once per configuration; every cost term reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoconf.cost.groups import stage_devices
from autoconf.cost.system import System
from autoconf.space.config import ParallelConfig
from autoconf.space.placement import Placement


@dataclass(frozen=True)
class Layout:
    stage_devices: tuple
    """Devices of each pipeline stage (``placement``: rank r on ``device_order[r]``)."""
    stage_kinds: tuple
    """Sorted device kinds of each stage (lists)."""
    schedule: str
    """The schedule simulated (breadth_first for pp=1 layered accumulation)."""
    virtual_stages: int
    """Chunks per device in the simulation."""
    chunk_layers: tuple
    chunk_params: tuple
    """Parameters of each chunk's tp shard (its share of the experts included)."""
    layered: bool
    """Gradients of a chunk become final progressively (layered / breadth-first), not at the end."""
    overlaps: bool
    """Communication can overlap computation (no CPU stage)."""
    overlap_grad_reduce: bool
    """The data-parallel reduction overlaps the backward (the framework's knob, and overlaps)."""
    overlap_param_gather: bool
    """ZeRO-3's parameter gathers are prefetched behind compute (the knob, and overlaps)."""
    chunk_moe_layers: tuple = ()
    """Mixture-of-experts blocks of each chunk (empty: a dense model)."""
    chunk_expert_params: tuple = ()
    """Routed-expert parameters of each chunk on one rank (E/ep experts of each MoE block, over
    tp): reduced and ZeRO-sharded over the expert-data-parallel ranks, not dp x cp."""

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_layers)

    def chunks_of(self, c: ParallelConfig, dev: int) -> range:
        """The chunks pipeline device ``dev`` holds."""
        return range(dev, self.num_chunks, c.pp)


def layout(system: System, c: ParallelConfig) -> Layout:
    m, topo = system.model, system.topology
    stage_devs = system.cached(("stages", c.dp, c.pp, c.tp, c.cp, c.rank_order, c.device_order), lambda: stage_devices(c))
    stage_kinds = [sorted({topo.kind_of[d] for d in devs}) for devs in stage_devs]
    layered_pp1 = c.pp == 1 and c.layered_grad_accum
    v_sim = m.num_layers if layered_pp1 else c.virtual_stages
    n_chunks = c.pp * v_sim
    # the placement's blocks per chunk (pp=1 layered accumulation: one block per simulated chunk)
    chunk_layers = [1] * n_chunks if layered_pp1 else Placement.of(c, m.num_layers).chunk_layer_counts()
    moe_layers, expert_params = (), ()
    if m.is_moe:
        indices = [[i] for i in range(m.num_layers)] if layered_pp1 else Placement.of(c, m.num_layers).chunk_layers()
        moe_layers, expert_params = chunk_experts(system, c, indices)
    # Communication overlaps computation only where a copy engine / NIC does the work; CPU
    # processes run their collectives on the same cores as their compute, so nothing is hidden.
    overlaps = not any("cpu" in k for k in stage_kinds)
    return Layout(stage_devices=tuple(stage_devs), stage_kinds=tuple(stage_kinds),
                  schedule="breadth_first" if layered_pp1 else c.schedule, virtual_stages=v_sim,
                  chunk_layers=tuple(chunk_layers), chunk_params=tuple(chunk_params(system, c, chunk_layers)),
                  chunk_moe_layers=moe_layers, chunk_expert_params=expert_params,
                  layered=c.layered_grad_accum or c.schedule == "breadth_first", overlaps=overlaps,
                  overlap_grad_reduce=overlaps and system.framework.overlaps_grad_reduce(c),
                  overlap_param_gather=overlaps and system.framework.knob(c, "overlap_param_gather"))


def chunk_experts(system: System, c: ParallelConfig, indices) -> tuple[tuple, tuple]:
    """Per chunk (its blocks' indices): its mixture-of-experts blocks, and its routed experts'
    parameters on a rank (E/ep experts of each MoE block, split ``Framework.expert_split`` ways)."""
    m = system.model
    moe_layers = tuple(sum(m.is_moe_layer(i) for i in idx) for idx in indices)
    etp = system.framework.expert_split(c)
    return moe_layers, tuple(n * (m.num_experts // c.ep) * m.expert_params() / etp for n in moe_layers)


def chunk_params(system: System, c: ParallelConfig, chunk_layers) -> list[float]:
    """Parameters per chunk shard: its blocks, the embedding on the first chunk, the output layer
    on the last (plus a copy of the tied embedding when it sits on another chunk)."""
    m, n_chunks = system.policy.model_at(c.tp), len(chunk_layers)
    out = []
    indices = (Placement.of(c, m.num_layers).chunk_layers() if m.is_moe and sum(chunk_layers) == m.num_layers
               and len(chunk_layers) == c.num_chunks else [[i] for i in range(m.num_layers)] if m.is_moe else None)
    if indices is not None:  # per block: (its parameters without routed experts, is it MoE), once
        per_layer = system.cached(("layerparams", c.tp), lambda: [
            (m.layer_params(i) - m.is_moe_layer(i) * m.num_experts * m.expert_params(), m.is_moe_layer(i))
            for i in range(m.num_layers)])
        local_experts = (m.num_experts // c.ep) * m.expert_params()
        local_experts *= c.tp / system.framework.expert_split(c)  # (/ tp below): whole experts or a 1/etp split
    for ci, nl in enumerate(chunk_layers):
        if indices is None:
            p = nl * m.layer_params()
        else:  # a mixture of experts: its blocks differ; the rank holds E/ep of each MoE block's experts
            p = sum(per_layer[i][0] + per_layer[i][1] * local_experts for i in indices[ci])
        if ci == 0:
            p += m.embedding_params()
        if ci == n_chunks - 1:
            # a tied output layer on another stage keeps its own copy (pp > 1; the chunks of
            # layered accumulation at pp = 1 share one device and one matrix)
            p += m.output_params() + (m.vocab_size * m.hidden_size if m.tied_embeddings and c.pp > 1 else 0)
        out.append(p / c.tp)
    return out


def linear_params_per_layer(m) -> float:
    """Weights of one dense block's linear layers (attention projections, MLA's too; MLP), the
    ones FP8 runs."""
    return m.attention_matmul_params() + m.mlp_matrices * m.hidden_size * m.ffn_hidden_size


def fp8_linear_params(system: System, c: ParallelConfig, lay: "Layout", ci: int) -> float:
    """Linear-layer weights chunk ``ci`` holds on a rank (what FP8 keeps copies of): its dense
    blocks' (``linear_params_per_layer`` over tp), its MoE blocks' attention projections and
    shared experts over tp, and its routed experts on the rank (``Layout.chunk_expert_params``);
    the router stays in 16 bits."""
    m = system.model
    n_moe = lay.chunk_moe_layers[ci] if lay.chunk_moe_layers else 0
    out = (lay.chunk_layers[ci] - n_moe) * linear_params_per_layer(m) / c.tp
    if n_moe:
        out += n_moe * (m.attention_matmul_params() + m.shared_expert_params()) / c.tp + lay.chunk_expert_params[ci]
    return out
