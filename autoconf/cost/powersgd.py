"""PowerSGD on data-parallel gradients (Vogels et al., NeurIPS 2019), as torch's
``powerSGD_hook`` runs it: the buckets, the low-rank kernels, the three all-reduces per bucket.
"""

from __future__ import annotations

from autoconf.cost import comm
from autoconf.cost.groups import all_reduce_algorithms, collective_s
from autoconf.space.compression import block_shapes, norm_shapes, powersgd_split
from autoconf.space.placement import Placement


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
        head = list(norm_shapes(m))
        if not m.tied_embeddings or (n > 1 and not split_tied):
            head.append((vocab, m.hidden_size))
        units.append(head)
    return units


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
    so those get more of each NIC than ``cost.groups.axis_links`` (every group active) gives."""

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
    eb = system.policy.grad_bytes
    algos = all_reduce_algorithms(system, c, comm.all_reduce_s)
    t = 0.0
    for shapes in powersgd_buckets(system, c, lay, ci):
        exact, ps, qs, kern = powersgd_bucket(system, kinds, shapes, c.dp_compression_rank)
        t += kern + sum(collective_s(system, links, comm.all_reduce_s, n, x * eb, algos)
                        for x in (exact, ps, qs) if x)
    return t
