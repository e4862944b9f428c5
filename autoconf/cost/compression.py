"""Compressed 3D-parallel traffic (Optimus-CC, Song et al., ASPLOS 2023, arXiv 2301.09830): what
it sends, which sends it touches, what its kernels and buffers cost.

- **Compressed backpropagation** (``pp_compression``): the activation gradient a pipeline chunk
  sends backwards, an ``n x m`` matrix (n = tokens of the micro-batch on this rank, m = hidden
  size), goes as a rank-r product ``P Q^T``: ``(n + m) r`` values instead of ``n m``
  (:func:`low_rank_elements`). The sender runs one power iteration warm-started from its last Q
  (``P = M Q``, orthogonalise P, ``Q = M^T P``), keeps the residual ``M - P Q^T`` for the next
  micro-batch (lazy error propagation); the receiver multiplies ``P Q^T`` back.
- **Epilogue-only compression**: only the sends nothing overlaps are compressed, those a device
  makes after its last forward (:func:`compressed_sends`): under 1F1B stage s's last p - s (the
  last steady-state send and the cool-down); under GPipe and breadth-first every backward send
  (all come after the last forward); under interleaved 1F1B the cool-down's sends of every chunk.
- **Data-parallel compression** (``dp_compression_stages``): PowerSGD with error feedback (Vogels
  et al., NeurIPS 2019) as torch's ``powerSGD_hook`` runs it on each gradient bucket: a matrix
  ``n x m`` (a weight, viewed as ``shape[0] x rest``) is compressed when ``(n + m) r`` is less
  than half of ``n m``, every other tensor (biases, norms, small matrices) is all-reduced exactly
  (:func:`powersgd_split`); three all-reduces in a row per bucket (the exact part, the Ps, the Qs).

Pure: no torch.
"""

from __future__ import annotations

from autoconf.cost import comm
from autoconf.cost.groups import (
    all_reduce_algorithms,
    axis_links,
    collective_s,
    grad_group,
    reduction_collective,
    tied_params,
)
from autoconf.cost.pipeline import Compression
from autoconf.cost.powersgd import dp_compressed, low_rank_kernel_s, powersgd_buckets
from autoconf.cost.schedule_time import boundary_bytes, boundary_tokens, p2p_times
from autoconf.space.compression import effective_rank, low_rank_elements, powersgd_split, sends_per_chunk
from autoconf.space.placement import Placement

# ---------------------------------------------------------------------------------------------
# What a configuration sends, computes and keeps (needs a System: rates, links, placement).




def gradient_matrix(system, c) -> tuple[int, int]:
    """The (n, m) of the activation gradient a pipeline chunk sends back: the rank's tokens of a
    micro-batch (its sequence shard under context and sequence parallelism) x hidden size."""
    return boundary_tokens(system, c), system.model.hidden_size



def pipeline_compression(system, c, lay, p2p_exact: tuple):
    """The ``pipeline.Compression`` of this configuration (None without pp compression):
    compressed transfers on each link (P and Q: two messages), kernels per chunk."""
    if c.pp_compression == "none" or c.pp == 1:
        return None
    n, m = gradient_matrix(system, c)
    r = effective_rank(n, m, c.pp_compression_rank)
    # two messages (P, then Q): two latencies
    per_stage = [t + lat for t, lat in zip(p2p_times(system, c, low_rank_elements(n, m, r) * system.model.dtype_bytes),
                                           p2p_times(system, c, 0.0))]
    nc = lay.num_chunks
    p2p_c = tuple(per_stage[ci % c.pp] if p2p_exact[ci] else 0.0 for ci in range(nc - 1))
    kern = [low_rank_kernel_s(system, lay.stage_kinds[ci % c.pp], n, m, r) for ci in range(nc)]
    return Compression(c.pp_compression, p2p_c, tuple(k[0] for k in kern), tuple(k[1] for k in kern))



def step_bytes(system, c, lay) -> list:
    """Per pipeline rank, the bytes one step hands to the network, as the reference trainer counts
    them (its ``comm_bytes``): ``forward`` (activations sent to the next stage), ``backward``
    (gradients, or their factors, sent to the previous one), ``dp_payload`` (what its gradient
    collectives are given: the buffers of an exact reduction, PowerSGD's exact part + Ps + Qs),
    ``embedding_payload`` (the tied weight handed to its sync). The pipeline bytes are a tp rank's
    (with sequence parallelism its shard)."""
    mb = c.num_micro_batches
    act = boundary_bytes(system, c)
    n, m = gradient_matrix(system, c)
    r = effective_rank(n, m, c.pp_compression_rank)
    eb = system.model.dtype_bytes
    per_chunk = sends_per_chunk(lay.schedule, c.pp, mb, lay.virtual_stages, c.pp_compression) \
        if c.pp > 1 else (0,) * lay.num_chunks
    out = []
    for dev in range(c.pp):
        chunks = list(lay.chunks_of(c, dev))
        fwd = sum(mb * act for ci in chunks if ci < lay.num_chunks - 1)
        bwd = sum((mb - per_chunk[ci]) * act + per_chunk[ci] * low_rank_elements(n, m, r) * eb
                  for ci in chunks if ci > 0)
        dp = 0.0
        if grad_group(c)[0] > 1 and c.zero_stage < 3:
            for ci in chunks:
                if dp_compressed(c, dev):
                    for shapes in powersgd_buckets(system, c, lay, ci):
                        exact, ps, qs, _ = powersgd_split(shapes, c.dp_compression_rank)
                        dp += (exact + ps + qs) * system.policy.grad_bytes
                else:  # ZeRO-2 with standard accumulation reduces after every micro-batch
                    times = mb if c.zero_stage == 2 and not c.layered_grad_accum else 1
                    dp += times * (lay.chunk_params[ci] - tied_params(system, c, ci)) * system.policy.grad_bytes
        emb = 0.0
        if system.model.tied_embeddings and c.pp > 1 and (dev == 0 or dev == (lay.num_chunks - 1) % c.pp):
            emb = tied_bytes(system, c)
            if not c.fused_embedding_sync and grad_group(c)[0] > 1 and c.zero_stage < 3:
                dp += emb
        out.append({"forward": fwd, "backward": bwd, "dp_payload": dp, "embedding_payload": emb})
    return out


def tied_bytes(system, c) -> float:
    """Bytes of the tied embedding gradient on a tp rank (its vocabulary shard)."""
    return tied_params(system, c, 0) * system.policy.grad_bytes


def embedding_sync_s(system, c) -> tuple[float, float]:
    """The tied embedding's sync after the pipeline (pp > 1, tied embeddings), as (seconds beside
    the chunks' reductions still in flight, seconds after them); (0, 0) without one.

    Where the framework syncs the copies on their own (``Framework.tied_sync_after_pipeline``:
    the reference trainer) the all-reduce between the first and last stage runs beside the
    reductions, the copies' data-parallel reduction waits for them (the trainer lands the
    reductions in flight first); fused, one all-reduce over the first- and last-stage ranks of
    every replica, beside them. Elsewhere the copies go in the data-parallel buckets and the
    first- and last-stage ranks of each replica all-reduce them once more, on the step's critical
    path: Megatron-LM after its data-parallel reduction (``finalize_model_grads`` ->
    ``_allreduce_word_embedding_grads`` on the main gradients), DeepSpeed's pipeline engine
    before it (``ReduceTiedGrads``, one unbucketed ``all_reduce`` per tied weight): after
    (``Framework.tied_pair_all_reduce``; torch.distributed.pipelining has no such step)."""
    nbytes = tied_bytes(system, c)
    pair_only = False
    if not nbytes:
        m = system.model
        if not m.tied_embeddings or c.pp == 1 or not system.framework.tied_pair_all_reduce:
            return 0.0, 0.0
        # the rank's vocabulary shard as the framework pads it
        nbytes, pair_only = -(-system.policy.model_at(c.tp).vocab_size // c.tp) * m.hidden_size * system.policy.grad_bytes, True
    n_grad, axis = grad_group(c)
    fused = c.fused_embedding_sync and not pair_only

    def make():  # the first- and last-stage ranks of each tp rank (fused), or of each replica
        place, topo = Placement.of(c, 0), system.topology
        groups: dict = {}
        for r in range(c.world_size):
            co = place.coords(r)
            if co["pp"] in (0, c.pp - 1):
                key = (co["tp"],) if fused else (co["tp"], co["dp"], co["cp"])
                groups.setdefault(key, []).append(place.device(r))
        return list({topo.group_links(tuple(g)): None for g in groups.values()}), len(next(iter(groups.values())))
    links, size = system.cached(("emb-sync", c.dp, c.pp, c.tp, c.cp, c.rank_order, c.device_order, fused), make)
    beside = collective_s(system, links, comm.all_reduce_s, size, nbytes,
                          all_reduce_algorithms(system, c, comm.all_reduce_s))
    if pair_only:
        return 0.0, beside
    after = 0.0
    if not fused and n_grad > 1:
        red = reduction_collective(c.zero_stage)
        after = collective_s(system, axis_links(system, c, axis), red, n_grad, nbytes,
                             all_reduce_algorithms(system, c, red))
    return beside, after


def memory_parts(system, c, lay, dev: int) -> list:
    """(name, bytes) compression keeps on pipeline rank ``dev``: each sending chunk's residual, its
    warm-start Q and the factors it sent in the step (the runtime holds sent tensors until the
    step's end), a receiving chunk's factors in flight; PowerSGD's error of every gradient it
    compresses and the bucket copy the hook makes."""
    parts = []
    eb = system.model.dtype_bytes
    if c.pp_compression != "none" and c.pp > 1:
        n, m = gradient_matrix(system, c)
        r = effective_rank(n, m, c.pp_compression_rank)
        per_chunk = sends_per_chunk(lay.schedule, c.pp, c.num_micro_batches, lay.virtual_stages, c.pp_compression)
        q_bytes = max(eb, 4)  # the warm-start Q is kept in fp32 for 16-bit gradients
        keep = 0.0
        for ci in lay.chunks_of(c, dev):
            if ci > 0:  # a sender: its residual and Q, and the factors it sent this step (freed at its end)
                keep += n * m * eb + m * r * q_bytes + per_chunk[ci] * (n + m) * r * eb
            if ci < lay.num_chunks - 1:  # a receiver: one micro-batch's factors, until its backward
                keep += (n + m) * r * eb
        parts.append(("compression residuals", keep))
    if dp_compressed(c, dev):
        grads = sum(lay.chunk_params[ci] - tied_params(system, c, ci) for ci in lay.chunks_of(c, dev))
        parts.append(("powersgd error feedback", 2 * grads * system.policy.grad_bytes))
    return parts
