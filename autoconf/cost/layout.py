"""Layout: how one configuration places the model on the System's devices.

Pipeline chunks (``pp x virtual stages``; pp=1 layered accumulation is simulated layer by layer,
as a breadth-first schedule over single-layer chunks), their layers and parameters, the devices
and device kinds of each stage. Derived once per configuration; every cost term reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ParallelConfig
from ..placement import Placement
from .system import System
from .tensor_parallel import stage_devices


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
    """Parameters of each chunk's tp shard."""
    layered: bool
    """Gradients of a chunk become final progressively (layered / breadth-first), not at the end."""
    overlaps: bool
    """Communication can overlap computation (no CPU stage)."""
    overlap_grad_reduce: bool
    """The data-parallel reduction overlaps the backward (the framework's knob, and overlaps)."""
    overlap_param_gather: bool
    """ZeRO-3's parameter gathers are prefetched behind compute (the knob, and overlaps)."""

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
    # Communication overlaps computation only where a copy engine / NIC does the work; CPU
    # processes run their collectives on the same cores as their compute, so nothing is hidden.
    overlaps = not any("cpu" in k for k in stage_kinds)
    return Layout(stage_devices=tuple(stage_devs), stage_kinds=tuple(stage_kinds),
                  schedule="breadth_first" if layered_pp1 else c.schedule, virtual_stages=v_sim,
                  chunk_layers=tuple(chunk_layers), chunk_params=tuple(chunk_params(system, c, chunk_layers)),
                  layered=c.layered_grad_accum or c.schedule == "breadth_first", overlaps=overlaps,
                  overlap_grad_reduce=overlaps and system.framework.knob(c, "overlap_grad_reduce"),
                  overlap_param_gather=overlaps and system.framework.knob(c, "overlap_param_gather"))


def chunk_params(system: System, c: ParallelConfig, chunk_layers) -> list[float]:
    """Parameters per chunk shard: its blocks, the embedding on the first chunk, the output layer
    on the last (plus a copy of the tied embedding when it sits on another chunk)."""
    m, n_chunks = system.model_at(c.tp), len(chunk_layers)
    out = []
    for ci, nl in enumerate(chunk_layers):
        p = nl * m.layer_params()
        if ci == 0:
            p += m.embedding_params()
        if ci == n_chunks - 1:
            # a tied output layer on another stage keeps its own copy (pp > 1; the chunks of
            # layered accumulation at pp = 1 share one device and one matrix)
            p += m.output_params() + (m.vocab_size * m.hidden_size if m.tied_embeddings and c.pp > 1 else 0)
        out.append(p / c.tp)
    return out
