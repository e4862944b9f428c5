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

from functools import lru_cache

from .pipeline import device_orders

MIN_COMPRESSION_RATE = 2
"""torch's ``PowerSGDState.min_compression_rate`` default: compress a matrix only if that at
least halves it."""


@lru_cache(maxsize=256)
def compressed_sends(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int,
                     mode: str) -> frozenset:
    """The backward sends compressed under ``mode`` ("none", "epilogue", "all"), as
    ``(micro_batch, sending_chunk)`` pairs: chunk c >= 1 sends the gradient of its input to chunk
    c - 1 after its backward of that micro-batch. "epilogue": the backward ops each device runs
    after its last forward op (in the schedule's order, ``pipeline.device_orders``)."""
    if mode == "none" or pp == 1:
        return frozenset()
    orders = device_orders(schedule, pp, num_micro_batches, virtual_stages)
    out = set()
    for order in orders:
        last_f = max(i for i, (kind, _mb, _c) in enumerate(order) if kind == "F")
        for i, (kind, mb, c) in enumerate(order):
            if kind == "B" and c > 0 and (mode == "all" or i > last_f):
                out.add((mb, c))
    return frozenset(out)


def sends_per_chunk(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int, mode: str) -> tuple:
    """Per global chunk: how many of its backward sends are compressed (chunk 0 sends none)."""
    counts = [0] * (pp * virtual_stages)
    for _mb, c in compressed_sends(schedule, pp, num_micro_batches, virtual_stages, mode):
        counts[c] += 1
    return tuple(counts)


def effective_rank(n: int, m: int, rank: int) -> int:
    """The rank a factorisation of an n x m matrix can have: at most min(n, m)."""
    return max(1, min(n, m, rank))


def low_rank_elements(n: int, m: int, rank: int) -> int:
    """Values sent for an n x m matrix as P (n x r) and Q (m x r)."""
    return (n + m) * effective_rank(n, m, rank)


def matrix_of(shape) -> tuple[int, int]:
    """How PowerSGD views a tensor: ``shape[0] x (numel / shape[0])`` (a 1-D tensor is n x 1)."""
    shape = tuple(int(d) for d in shape)
    if not shape:
        return 1, 1
    numel = 1
    for d in shape:
        numel *= d
    return shape[0], numel // max(1, shape[0])


def powersgd_split(shapes, rank: int, min_rate: int = MIN_COMPRESSION_RATE) -> tuple[int, int, int, list]:
    """How ``powerSGD_hook`` sends a bucket of tensors of these shapes: (exact elements, P
    elements, Q elements, the (n, m, r) of each compressed matrix)."""
    exact = ps = qs = 0
    mats = []
    for shape in shapes:
        n, m = matrix_of(shape)
        r = min(n, m, rank)
        if (n + m) * r * min_rate < n * m:
            ps += n * r
            qs += m * r
            mats.append((n, m, r))
        else:
            exact += n * m
    return exact, ps, qs, mats


# ---------------------------------------------------------------------------------------------
# What a configuration sends, computes and keeps (needs a System: rates, links, placement).


def _norm_shapes(model) -> list:
    h = model.hidden_size
    return [(h,), (h,)] if model.norm == "layernorm" else [(h,)]


def block_shapes(model, tp: int) -> list:
    """The parameter shapes of one dense transformer block on a tp rank, as the reference
    trainer (``nn.Block``) and Megatron shard them: fused QKV and fc1 split by rows, proj and fc2
    by columns, norms and row-parallel biases whole."""
    h, q, kv, f = model.hidden_size, model.q_size, model.kv_size, model.ffn_hidden_size
    fc1 = (2 * f if model.gated_mlp else f) // tp
    shapes = _norm_shapes(model) + [((q + 2 * kv) // tp, h)]
    if model.bias or model.qkv_bias:
        shapes.append(((q + 2 * kv) // tp,))
    shapes.append((h, q // tp))
    if not model.shared_norm:
        shapes += _norm_shapes(model)
    shapes += [(fc1, h), (h, f // tp)]
    if model.bias:
        shapes += [(h,), (fc1,), (h,)]
    return shapes


def unit_shapes(system, c, lay, ci: int, tied: bool = True) -> list:
    """Per unit (bucket) of chunk ``ci``: its parameter shapes (embedding, blocks, head).
    ``tied=False``: without the tied embedding's copies on the first and last chunk (pp > 1),
    which are reduced on their own (:func:`embedding_sync_s`)."""
    m, n = system.model, c.num_chunks
    vocab = -(-m.vocab_size // c.tp)
    split_tied = m.tied_embeddings and c.pp > 1 and not tied
    units = []
    if ci == 0:
        emb = [] if split_tied else [(vocab, m.hidden_size)]
        if m.position_embedding == "learned":
            emb.append((m.seq_length, m.hidden_size))
        units.append(emb)
    units += [block_shapes(m, c.tp)] * lay.chunk_layers[ci]
    if ci == n - 1:
        head = list(_norm_shapes(m))
        if not m.tied_embeddings or (n > 1 and not split_tied):
            head.append((vocab, m.hidden_size))
        units.append(head)
    return units


def gradient_matrix(system, c) -> tuple[int, int]:
    """The (n, m) of the activation gradient a pipeline chunk sends back: the rank's tokens of a
    micro-batch (its sequence shard under context and sequence parallelism) x hidden size."""
    from .schedule_time import boundary_tokens
    return boundary_tokens(system, c), system.model.hidden_size


def _power_iteration_s(rf, n: int, m: int, r: int, eb: int) -> float:
    """The GEMMs of one warm-started power iteration on an n x m matrix at rank r and of its
    product back: P = M Q, a QR of P (about two n x r x r GEMMs), Q = M^T P, P Q^T."""
    return rf.gemm(n, r, m, eb) + 2 * rf.gemm(n, r, r, eb) + rf.gemm(m, r, n, eb) + rf.gemm(n, m, r, eb)


def low_rank_kernel_s(system, kinds, n: int, m: int, r: int) -> tuple[float, float]:
    """(sender, receiver) seconds of compressing one n x m gradient at rank r, on the slowest of
    ``kinds``: the sender adds the carried residual (read 2, write 1), P = M Q, orthogonalises P
    (a QR of n x r: about two n x r x r GEMMs), Q = M^T P, and keeps the new residual M - P Q^T
    (a GEMM into a copy, then a subtraction); the receiver multiplies P Q^T back."""
    eb = system.model.dtype_bytes
    send = recv = 0.0
    for kind in kinds:
        rf, share = system.roofline(kind), system.cpu_share(kind)
        send = max(send, (_power_iteration_s(rf, n, m, r, eb) + rf.elementwise(6 * n * m * eb, kernels=2)) * share)
        recv = max(recv, rf.gemm(n, m, r, eb) * share)
    return send, recv


def pipeline_compression(system, c, lay, p2p_exact: tuple):
    """The ``pipeline.Compression`` of this configuration (None without pp compression):
    compressed transfers on each link (P and Q: two messages), kernels per chunk."""
    if c.pp_compression == "none" or c.pp == 1:
        return None
    from .pipeline import Compression
    from .schedule_time import p2p_times
    n, m = gradient_matrix(system, c)
    r = effective_rank(n, m, c.pp_compression_rank)
    # two messages (P, then Q): two latencies
    per_stage = [t + lat for t, lat in zip(p2p_times(system, c, low_rank_elements(n, m, r) * system.model.dtype_bytes),
                                           p2p_times(system, c, 0.0))]
    nc = lay.num_chunks
    p2p_c = tuple(per_stage[ci % c.pp] if p2p_exact[ci] else 0.0 for ci in range(nc - 1))
    kern = [low_rank_kernel_s(system, lay.stage_kinds[ci % c.pp], n, m, r) for ci in range(nc)]
    return Compression(c.pp_compression, p2p_c, tuple(k[0] for k in kern), tuple(k[1] for k in kern))


def powersgd_bucket(system, kinds, shapes, rank: int) -> tuple[int, int, int, float]:
    """One bucket through ``powerSGD_hook``: (exact, P, Q elements it all-reduces, its kernels'
    seconds on the slowest of ``kinds``): the error added and the bucket copied (read 2 write 1,
    read 1 write 1), P = M Q, a QR of each P, Q = M^T P, P Q^T back into the bucket, the new
    error (read 2 write 1); one kernel per matrix and step."""
    exact, ps, qs, mats = powersgd_split(shapes, rank)
    eb = system.model.dtype_bytes
    numel = exact + sum(n * m for n, m, _ in mats)
    t = 0.0
    for kind in kinds:
        rf, share = system.roofline(kind), system.cpu_share(kind)
        mm = sum(_power_iteration_s(rf, n, m, r, eb) for n, m, r in mats)
        t = max(t, (mm + rf.elementwise(8 * numel * eb, kernels=3)) * share)
    return exact, ps, qs, t


def exact_dp_links(system, c, axis):
    """The gradient groups' links when pipeline ranks 0..k-1 compress theirs: the NICs are shared
    among the groups still reducing exactly (a compressed group sends a few percent of the bytes),
    so those get more of each NIC than ``tensor_parallel.axis_links`` (every group active) gives."""
    from ..placement import Placement

    def make():
        topo, place = system.topology, Placement.of(c, 0)
        groups = [g for g in place.groups(axis) if not dp_compressed(c, place.coords(g[0])["pp"])]
        devs = [tuple(place.device(r) for r in g) for g in groups]
        active: dict = {}
        for grp in devs:
            if len({topo.host_of[d] for d in grp}) > 1:
                for d in grp:
                    active[topo.host_of[d]] = active.get(topo.host_of[d], 0) + 1
        return list({topo.group_links(g, {h: active[h] for h in {topo.host_of[d] for d in g} if h in active} or None): 0
                     for g in devs})
    return system.cached(("exact-dp-links", c.dp, c.pp, c.tp, c.cp, c.rank_order, c.device_order,
                          c.dp_compression_stages, axis), make)


def dp_compressed(c, dev: int) -> bool:
    """Whether pipeline rank ``dev`` compresses its data-parallel gradients."""
    return dev < c.dp_compression_stages


def powersgd_buckets(system, c, lay, ci: int) -> list:
    """The parameter shapes of each bucket chunk ``ci``'s gradients go in under PowerSGD, as the
    reference trainer forms them: one bucket per chunk (pp = 1 with layered accumulation: one per
    unit, reduced as each unit finishes), the tied embedding's copies left out (pp > 1: they are
    reduced exactly after the pipeline, :func:`embedding_sync_s`)."""
    units = unit_shapes(system, c, lay, ci, tied=False)
    if c.pp == 1 and c.layered_grad_accum:
        return units
    return [[s for u in units for s in u]]


def powersgd_reduction_s(system, c, lay, ci: int, kinds, links, n: int) -> float:
    """Chunk ``ci``'s gradient reduction under PowerSGD: per bucket three all-reduces in a row
    (the exact part, the Ps, the Qs, each waiting for the one before: the hook chains them) and
    its kernels; the buckets follow one another (the trainer keeps one in flight)."""
    from . import comm
    from .data_parallel import all_reduce_algorithms
    from .tensor_parallel import collective_s
    eb = system.grad_bytes
    algos = all_reduce_algorithms(system, c, comm.all_reduce_s)
    t = 0.0
    for shapes in powersgd_buckets(system, c, lay, ci):
        exact, ps, qs, kern = powersgd_bucket(system, kinds, shapes, c.dp_compression_rank)
        t += kern + sum(collective_s(system, links, comm.all_reduce_s, n, x * eb, algos)
                        for x in (exact, ps, qs) if x)
    return t


def step_bytes(system, c, lay) -> list:
    """Per pipeline rank, the bytes one step hands to the network, as the reference trainer counts
    them (its ``comm_bytes``): ``forward`` (activations sent to the next stage), ``backward``
    (gradients, or their factors, sent to the previous one), ``dp_payload`` (what its gradient
    collectives are given: the buffers of an exact reduction, PowerSGD's exact part + Ps + Qs),
    ``embedding_payload`` (the tied weight handed to its sync). The pipeline bytes are a tp rank's
    (with sequence parallelism its shard)."""
    from .data_parallel import grad_group, tied_params
    from .schedule_time import boundary_bytes
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
                        dp += (exact + ps + qs) * system.grad_bytes
                else:  # ZeRO-2 with standard accumulation reduces after every micro-batch
                    times = mb if c.zero_stage == 2 and not c.layered_grad_accum else 1
                    dp += times * (lay.chunk_params[ci] - tied_params(system, c, ci)) * system.grad_bytes
        emb = 0.0
        if system.model.tied_embeddings and c.pp > 1 and (dev == 0 or dev == (lay.num_chunks - 1) % c.pp):
            emb = tied_bytes(system, c)
            if not c.fused_embedding_sync and grad_group(c)[0] > 1 and c.zero_stage < 3:
                dp += emb
        out.append({"forward": fwd, "backward": bwd, "dp_payload": dp, "embedding_payload": emb})
    return out


def tied_bytes(system, c) -> float:
    """Bytes of the tied embedding gradient on a tp rank (its vocabulary shard)."""
    from .data_parallel import tied_params
    return tied_params(system, c, 0) * system.grad_bytes


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
        nbytes, pair_only = -(-system.model_at(c.tp).vocab_size // c.tp) * m.hidden_size * system.grad_bytes, True
    from . import comm
    from ..placement import Placement
    from .data_parallel import all_reduce_algorithms, grad_group, reduction_collective
    from .tensor_parallel import axis_links, collective_s
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
        from .data_parallel import tied_params
        grads = sum(lay.chunk_params[ci] - tied_params(system, c, ci) for ci in lay.chunks_of(c, dev))
        parts.append(("powersgd error feedback", 2 * grads * system.grad_bytes))
    return parts
