"""Measured inputs of the cost model: what a Profile says, at the point the search asks about.

Every function is pure (no torch, no I/O) and returns None when the profile has nothing usable,
so the caller can fall back to the catalog and the formulas. The rules:

- **Layer times** (:func:`block_times`, :func:`embedding_times`, :func:`head_times`) apply only when
  the profile's model has the same layer shapes (``autoconf.specs.profile.COMPUTE_FIELDS``; the layer
  count and the name may differ). Over micro-batch size, time is affine in tokens: interpolate
  linearly between the measured sizes, extrapolate along the nearest two, or proportionally from
  a single size (and whenever the affine line would go non-positive). For a tp that was not
  measured, start from the nearest measured tp (in log2) and scale by the FLOP ratio divided by
  the GEMM-efficiency ratio of the shard's largest GEMM. A block recompute mode that was not
  measured is derived from 'none': full adds one forward to the backward, selective adds the
  attention-core share of a forward.
- **Activation bytes** are exactly proportional to the micro-batch size. Another tp, sequence
  parallelism or recompute mode is reached from the nearest measured entry (same recompute mode
  first, then same sequence parallelism, then nearest tp) by the ratio of the analytic formula
  (``autoconf.cost.activations``, after Korthikanti et al., arXiv 2205.05198) between the points.
- **Links**: the graph keeps one undirected device--device edge per measured pair, with the
  slower direction's bandwidth and latency (a transfer either way can hit the slow one); the two
  directions are kept as ``bandwidth_by_direction_bytes_per_s`` on the edge.
"""

from __future__ import annotations

import math
import statistics

from autoconf.cost import activations as A
from autoconf.cost.roofline import aligned_gemm
from autoconf.errors import UserError
from autoconf.specs.devices import device_type
from autoconf.specs.model import ModelSpec
from autoconf.specs.profile import Profile, compute_matches

__all__ = ["block_times", "embedding_times", "head_times", "activation_bytes", "gemm_efficiency",
           "collective_efficiency", "tp_comm_times", "optimizer_seconds_per_param"]


# -- layer times ------------------------------------------------------------------------------------

def block_times(profile: Profile, model: ModelSpec, micro_batch_size: int, tp: int,
                recompute: str = "none", device_kind: str | None = None) -> tuple[float, float] | None:
    """(forward_s, backward_s) of ONE transformer block shard at tp; backward includes recompute.

    ``device_kind`` picks the measurements of one catalog device kind (default: rank 0's kind).
    """
    return _layer_times(profile, model, "block", micro_batch_size, tp, recompute, device_kind)


def embedding_times(profile: Profile, model: ModelSpec, micro_batch_size: int, tp: int,
                    device_kind: str | None = None) -> tuple[float, float] | None:
    """(forward_s, backward_s) of the (vocab-parallel) input embedding shard."""
    return _layer_times(profile, model, "embedding", micro_batch_size, tp, "none", device_kind)


def head_times(profile: Profile, model: ModelSpec, micro_batch_size: int, tp: int,
               device_kind: str | None = None) -> tuple[float, float] | None:
    """(forward_s, backward_s) of the output shard: final norm, projection to the vocabulary, loss."""
    return _layer_times(profile, model, "head", micro_batch_size, tp, "none", device_kind)


def tp_comm_times(profile: Profile, model: ModelSpec, micro_batch_size: int, tp: int,
                  sequence_parallel: bool) -> tuple[float, float] | None:
    """(forward_s, backward_s) of tensor-parallel communication per block, as measured in place.

    The profile times the block with its real collectives (``Profile.tp_blocks``); the local-width
    time of the same shard is subtracted. Affine in micro-batch size like the layer times; None
    when this tp (or the sequence-parallel variant) was not measured in place.
    """
    if tp < 2 or not compute_matches(profile, model, "block"):
        return None
    rows = [e for e in profile.tp_blocks if e.tp == tp and e.sequence_parallel == sequence_parallel]
    pts = []
    for e in rows:
        base = _layer_times(profile, model, "block", e.micro_batch_size, tp, "none", e.device_kind)
        if base:
            # CPU ranks measured in place on fewer cores than ranks computed at their time-share
            k = _inplace_share(profile, tp, e.device_kind)
            pts.append((e.micro_batch_size, max(0.0, e.forward_s - k * base[0]), max(0.0, e.backward_s - k * base[1])))
    if not pts:
        return None
    # a difference of two timings is noisy: fit one least-squares line over all micro-batch sizes
    return (_least_squares_line([(m, f) for m, f, _ in pts], micro_batch_size),
            _least_squares_line([(m, b) for m, _, b in pts], micro_batch_size))


def _inplace_share(profile: Profile, nranks: int, device_kind: str | None) -> float:
    """How much slower each of ``nranks`` CPU ranks computed, measured together on one host with
    fewer cores (one thread each); 1.0 for accelerators or without a core count."""
    if device_kind != "cpu":
        return 1.0
    cores = [h.cpu_count for h in profile.provenance.hosts if h.cpu_count]
    return max(1.0, nranks / min(cores)) if cores else 1.0


def _least_squares_line(points: list[tuple[float, float]], x: float) -> float:
    """Value at x of the least-squares line through the points (the mean for one x); never < 0."""
    xs = [p[0] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(p[1] for p in points)
    var = sum((px - mx) ** 2 for px in xs)
    if var == 0:
        return max(0.0, my)
    slope = sum((px - mx) * (py - my) for px, py in points) / var
    return max(0.0, my + slope * (x - mx))


def optimizer_seconds_per_param(profile: Profile, device_kind: str | None = None) -> float | None:
    """Measured AdamW step time per parameter (median over the shards timed), or None."""
    kind = device_kind if device_kind is not None else _default_kind(profile)
    rates = [e.time_s / e.num_params for e in profile.optimizer if e.device_kind == kind and e.num_params]
    return statistics.median(rates) if rates else None


def pipeline_action_overhead(profile: Profile, schedule: str) -> float | None:
    """Measured seconds the pipeline runtime spends per action (one chunk's forward or backward of
    one micro-batch) under ``schedule``, from trivial-stage runs; another schedule's if this one
    was not measured; None if none was (profiles older than the measurement)."""
    got = getattr(profile, "pipeline_overhead", ()) or ()
    same = [e.per_action_s for e in got if e.schedule == schedule]
    vals = same or [e.per_action_s for e in got]
    return statistics.median(vals) if vals else None


def _default_kind(profile: Profile) -> str | None:
    return profile.ranks[0].device_kind if profile.ranks else None


def _layer_times(profile, model, layer, mbs, tp, recompute, device_kind):
    if mbs < 1 or tp < 1 or not compute_matches(profile, model, layer):
        return None
    kind = device_kind if device_kind is not None else _default_kind(profile)
    entries = [e for e in profile.compute if e.layer == layer and e.device_kind == kind]
    rows = [(e.tp, e.micro_batch_size, e.forward_s, e.backward_s) for e in entries if e.recompute == recompute]
    if not rows and layer == "block" and recompute != "none":
        extra = 1.0 if recompute == "full" else _attention_core_share(model)
        rows = [(e.tp, e.micro_batch_size, e.forward_s, e.backward_s + extra * e.forward_s)
                for e in entries if e.recompute == "none"]
    if not rows:
        return None
    tps = sorted({r[0] for r in rows})
    tp0 = min(tps, key=lambda t: (abs(math.log2(t / tp)), -t))
    pts = sorted((m, f, b) for t, m, f, b in rows if t == tp0)
    fwd = _affine([(m, f) for m, f, _ in pts], mbs)
    bwd = _affine([(m, b) for m, _, b in pts], mbs)
    scale = 1.0 if tp0 == tp else _tp_scale(profile, model, layer, mbs, tp0, tp)
    return fwd * scale, bwd * scale


def _affine(points: list[tuple[float, float]], x: float) -> float:
    """Value at x of the piecewise-linear curve through points (sorted by x), as described above."""
    for px, py in points:
        if px == x:
            return py
    nearest = min(points, key=lambda p: abs(p[0] - x))
    proportional = nearest[1] * x / nearest[0]
    if len(points) == 1:
        return proportional
    if points[0][0] < x < points[-1][0]:
        lo = max(p for p in points if p[0] < x)
        hi = min(p for p in points if p[0] > x)
    elif x < points[0][0]:
        lo, hi = points[0], points[1]
    else:
        lo, hi = points[-2], points[-1]
    slope = (hi[1] - lo[1]) / (hi[0] - lo[0])
    y = lo[1] + slope * (x - lo[0])
    return y if slope >= 0 and y > 0 else proportional


def _attention_core_share(model: ModelSpec) -> float:
    """Share of a block's forward FLOPs in the attention core (scores and weighted sum)."""
    return 4.0 * model.seq_length * model.q_size / model.layer_forward_flops_per_token()


def _shard_gemm(model: ModelSpec, layer: str, mbs: int, tp: int) -> tuple[int, int, int] | None:
    tokens = mbs * model.seq_length
    if layer == "block":
        return tokens, max(1, model.ffn_hidden_size // tp), model.hidden_size
    if layer == "head":
        return tokens, max(1, -(-model.vocab_size // tp)), model.hidden_size  # the trainer pads to tp
    return None


def _tp_scale(profile, model, layer, mbs, tp0, tp) -> float:
    """time(tp) / time(tp0): FLOPs scale as 1/tp, divided by the GEMM-efficiency ratio.

    The embedding is a lookup (memory-bound, output size independent of tp): scale 1.
    """
    if layer == "embedding":
        return 1.0
    ratio = tp0 / tp
    g0, g1 = _shard_gemm(model, layer, mbs, tp0), _shard_gemm(model, layer, mbs, tp)
    e0 = gemm_efficiency(profile, *g0)
    e1 = gemm_efficiency(profile, *g1)
    if e0 and e1:
        ratio *= e0 / e1
    return ratio


# -- GEMM efficiency -------------------------------------------------------------------------------------

_ELEM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def memory_time(profile: Profile, device_kind: str | None = None, dtype: str | None = None):
    """The profile's memory-bound kernel time as a function of bytes moved (its ``memory`` curve
    for the device kind and dtype), or None where it has none. Between measured sizes it is
    interpolated linearly in log(bytes) and log(seconds); above the largest it grows in
    proportion to the bytes (the DRAM / HBM stream's rate); below the smallest it stays at the
    smallest's time (a launch does not get cheaper)."""
    import math

    dtype = dtype or profile.compute_dtype
    kind = device_kind if device_kind is not None else _default_kind(profile)
    pts = sorted((e.bytes, e.time_s) for e in profile.memory
                 if e.dtype == dtype and e.device_kind == kind and e.bytes > 0 and e.time_s > 0)
    if not pts:
        return None

    def at(nbytes: float) -> float:
        if nbytes <= pts[0][0]:
            return pts[0][1]
        if nbytes >= pts[-1][0]:
            return pts[-1][1] * nbytes / pts[-1][0]
        i = next(j for j in range(1, len(pts)) if pts[j][0] >= nbytes)
        (b0, t0), (b1, t1) = pts[i - 1], pts[i]
        w = (math.log(nbytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
        return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
    return at


def gemm_efficiency(profile: Profile, m: int, n: int, k: int, dtype: str | None = None,
                    device_kind: str | None = None) -> float | None:
    """Fraction of catalog peak an (m x k) @ (k x n) GEMM reaches, from the profile's table.

    An exact shape returns its measurement; otherwise the fraction is interpolated linearly in
    log(FLOPs) between the nearest smaller and larger measured GEMMs, clamped at the ends. On a GPU
    only GEMMs of the query's 16-byte alignment take part (``cost.roofline.aligned_gemm``: an unaligned
    vocabulary projection runs several times slower than an aligned GEMM of its size); an
    unaligned query with only aligned GEMMs measured gets their rate times the catalog's
    ``unaligned_gemm_factor``. None when the table has no entry for the dtype and device (or the
    device is not in the catalog), or on a GPU only unaligned ones for an aligned query.
    """

    dtype = dtype or profile.compute_dtype
    kind = device_kind if device_kind is not None else _default_kind(profile)
    eb = _ELEM_BYTES.get(dtype.split("_")[0], 2)
    rows = [(2.0 * e.m * e.n * e.k, e.fraction_of_peak, (e.m, e.n, e.k)) for e in profile.gemm
            if e.dtype == dtype and e.device_kind == kind and e.fraction_of_peak is not None]
    try:
        dev = device_type(kind) if kind else None
    except UserError:
        dev = None
    if dev is not None and dev.sm_count:  # a GPU: interpolate among GEMMs of the query's alignment
        same = aligned_gemm(m, n, k, eb)
        alike = [r for r in rows if aligned_gemm(*r[2], eb) == same]
        if not alike and not same and rows:  # unaligned, only aligned ones measured
            eff = _interpolate(rows, m, n, k)
            return eff * dev.unaligned_gemm_factor
        rows = alike
    if not rows:
        return None
    return _interpolate(rows, m, n, k)


def _interpolate(rows: list, m: int, n: int, k: int) -> float:
    """Linear in log(FLOPs) between the nearest measured GEMMs (``rows``: (flops, fraction, shape)),
    an exact shape's own measurement, clamped at the ends."""
    for _, frac, shape in rows:
        if shape == (m, n, k):
            return frac
    x = math.log(2.0 * m * n * k)
    by_flops: dict[float, list[float]] = {}
    for f, frac, _ in rows:
        by_flops.setdefault(math.log(f), []).append(frac)
    pts = sorted((lf, statistics.median(v)) for lf, v in by_flops.items())
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    lo = max(p for p in pts if p[0] <= x)
    hi = min(p for p in pts if p[0] > x)
    if hi[0] == lo[0]:
        return lo[1]
    return lo[1] + (hi[1] - lo[1]) * (x - lo[0]) / (hi[0] - lo[0])


def fp8_gemm_efficiency(profile: Profile, recipe: str, m: int, n: int, k: int) -> float | None:
    """Fraction of the catalog's FP8 peak an FP8 GEMM with ``recipe``'s scaling reaches, from the
    profile's table (rows of dtype ``fp8_<recipe>``, as ``gemm_efficiency``); None when the
    profile has none."""
    return gemm_efficiency(profile, m, n, k, dtype=f"fp8_{recipe}")


# -- activation memory -----------------------------------------------------------------------------------

def activation_bytes(profile: Profile, model: ModelSpec, micro_batch_size: int, tp: int,
                     sequence_parallel: bool, recompute: str, layer: str = "block") -> float | None:
    """Bytes one layer shard keeps for backward for one micro-batch (measured, then scaled)."""
    if micro_batch_size < 1 or tp < 1 or not compute_matches(profile, model, layer):
        return None
    entries = [e for e in profile.activations if e.layer == layer]
    if layer != "block":
        entries = [e for e in entries if e.recompute == "none"]
        recompute = "none"
    if not entries:
        return None

    def distance(e):
        return (e.recompute != recompute, e.sequence_parallel != sequence_parallel,
                abs(math.log2(e.tp / tp)), abs(math.log2(e.micro_batch_size / micro_batch_size)))

    best = min(entries, key=distance)
    scaled = best.bytes * micro_batch_size / best.micro_batch_size
    if (best.tp, best.sequence_parallel, best.recompute) == (tp, sequence_parallel, recompute):
        return scaled
    mask = model.dtype_bytes if _default_kind(profile) == "cpu" else 1
    here = _formula_bytes(model, layer, micro_batch_size, tp, sequence_parallel, recompute, mask)
    there = _formula_bytes(model, layer, micro_batch_size, best.tp, best.sequence_parallel, best.recompute, mask)
    return scaled * here / there if there > 0 else None


def _formula_bytes(model: ModelSpec, layer: str, mbs: int, tp: int, sp: bool, recompute: str, mask: int) -> float:
    """The analytic bytes of autoconf.cost.activations (Korthikanti et al., arXiv 2205.05198,
    generalised to autoconf.trainer.layers's layers); only ratios between two points are used here."""

    if layer == "block":
        return A.layer_activation_bytes(model, mbs, tp, sp, recompute, mask)["total"]
    if layer == "head":
        return A.head_activation_bytes(model, mbs, tp, sp, mask)
    return A.embedding_activation_bytes(model, mbs, tp, sp, mask)


# -- links --------------------------------------------------------------------------------------------------


def collective_efficiency(profile: Profile, op: str, nranks: int, cross_host: bool | None = None) -> float | None:
    """Measured bus bandwidth of ``op`` over groups of ``nranks`` / what the p2p links predict.

    The prediction is a ring over the group in rank order: its bus bandwidth is the slowest
    link's beta on the ring (either direction). Taken at the largest measured size of each group,
    median over the groups of that size (``cross_host``: of those that span hosts, or lie in
    one; where that tier was measured with other sizes only, the nearest size on it: the library's
    overhead weighs differently on a fast intra-host link and a slow NIC). The cost model's ring formula
    ``steps x alpha + bytes_term / beta_min`` becomes ``steps x alpha + bytes_term / (beta_min x eff)``.
    None when no group of that size was measured or a ring link is missing.
    """
    if op not in ("all_reduce", "all_gather", "reduce_scatter"):
        raise UserError(f"collective op {op!r}; valid: all_reduce, all_gather, reduce_scatter")
    largest: dict[tuple, object] = {}
    spans = {e.ranks: len({profile.rank(r).host for r in e.ranks}) > 1 for e in profile.collectives if e.op == op}
    same_size = {g for g in spans if len(g) == nranks}
    keep = same_size
    if cross_host is not None:
        tier = {g for g, s in spans.items() if s == cross_host}
        if tier & same_size:
            keep = tier & same_size
        elif tier:  # that tier was measured with other group sizes only: the nearest size
            near = min(abs(len(g) - nranks) for g in tier)
            keep = {g for g in tier if abs(len(g) - nranks) == near}
    for e in profile.collectives:
        if e.op == op and e.ranks in keep:
            if e.ranks not in largest or e.bytes > largest[e.ranks].bytes:
                largest[e.ranks] = e
    effs = []
    for ranks, e in largest.items():
        betas = []
        for i, a in enumerate(ranks):
            b = ranks[(i + 1) % len(ranks)]
            links = [profile.link(a, b), profile.link(b, a)]
            if any(x is None for x in links):
                break
            betas.append(min(x.bandwidth_bytes_per_s for x in links))
        else:
            if betas:
                effs.append(e.busbw_bytes_per_s / min(betas))
    return statistics.median(effs) if effs else None


def peak_flop_per_s(profile: Profile, dtype: str | None = None, device_kind: str | None = None) -> float | None:
    """Catalog peak of the profiled device for the dtype (None outside the catalog)."""
    kind = device_kind if device_kind is not None else _default_kind(profile)
    if kind is None:
        return None
    return device_type(kind).peak(dtype or profile.compute_dtype)
