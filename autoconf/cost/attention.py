"""Attention's cost: the core (flash or eager, fused or unfused softmax, sliding windows), its
shape efficiency by head dimension and keys.
"""

from __future__ import annotations

import math

from autoconf.cost.roofline import Roofline
from autoconf.specs.model import ModelSpec


def windowed_blocks(model: ModelSpec) -> tuple[float, float]:
    """(share of the blocks that attend over a sliding window, a windowed block's work relative to
    full causal attention): (0, 1) without windows; a windowed block (window w < s) computes
    s x w - w^2 / 2 query-key pairs against the causal s^2 / 2."""
    if model.sliding_window is None or model.sliding_window >= model.seq_length:
        return 0.0, 1.0
    s, w = model.seq_length, model.sliding_window
    return model.num_windowed_layers / model.num_layers, (s * w - w * w / 2) / (s * s / 2)


def window_work(model: ModelSpec) -> float:
    """The attention core's work per block relative to full causal attention, averaged over the
    blocks (:func:`windowed_blocks`): 1 without sliding windows."""
    share, frac = windowed_blocks(model)
    return (1.0 - share) + share * frac


ATTENTION_KEY_TILE = 128
"""Keys per tile of the fused attention kernels (FlashAttention-2 and cuDNN's on A100 / Hopper)."""


ATTENTION_TILE_OVERHEAD = (1.1, 3.15)
"""Fixed work per query tile of fused attention (loading the queries, the final rescale and
store; in the backward also the keys' and values' gradients and the dot(dO, O) pass), in units of
one key tile's work, forward and backward. Fitted jointly over sequence lengths 512-16384
of two kernel families (cuDNN's and FlashAttention-2), head dims 64 and 128,
multi-head and grouped-query, on an H100 (bench/gpu_kernels.py: 34 points over 6 lengths): 3.2% /
2.7% rms pooled, at most 5.1% for one curve, once each curve has its own long-sequence rate."""


def attention_shape_efficiency(rf: "Roofline", eff_f: float, eff_b: float, head_dim: float, keys: float,
                               window: float | None = None) -> tuple[float, float]:
    """The fused attention kernel's fraction of peak at this shape, from its long-sequence rate at
    head dim 128 (``eff_f``, ``eff_b``, the catalog's ``attention_efficiency``):

    - tiles: each query tile of a causal pass computes the key tiles it sees, the diagonal one in
      full (half of it masked), plus a fixed overhead (``ATTENTION_TILE_OVERHEAD``). Over s keys,
      with n = s / 128 key tiles, the useful fraction is n / (n + 1 + 2 c0); under a sliding window
      of w keys each query tile sees w / 128 useful tiles and about one masked at the band's edges:
      (w / 128) / (w / 128 + 1 + c0).
    - head dim: the softmax costs one exponential per score forward and two backward (recomputed
      probabilities and their gradient) on the special-function units, against 4 d and 10 d
      tensor-core FLOPs per score; a smaller d leaves more of the time there:
      1 / eff(d) = 1 / eff(128) + peak / X * (k / (F d) - k / (F 128)), k = 1 and 2, F = 4 and 10.
      On an H100 this predicts 0.49 and 0.43 at head dim 64 from 0.63 and 0.52 (measured 0.47, 0.43).
      Head dims above 128 keep the catalog's rate (not measured).

    The tile constants were measured on an H100 only; the A100's FlashAttention-2 takes the same
    (its long-sequence rate is Dao's).
    """
    out = []
    for eff, c0, k, F in ((eff_f, ATTENTION_TILE_OVERHEAD[0], 1, 4), (eff_b, ATTENTION_TILE_OVERHEAD[1], 2, 10)):
        if rf.special_function_per_s and 0 < head_dim < 128:  # above 128: not measured, no gain taken
            ratio = rf.peak_flop_per_s / rf.special_function_per_s
            eff = 1.0 / max(1e-9, 1.0 / eff + ratio * (k / (F * head_dim) - k / (F * 128.0)))
        if window is not None and window < keys:
            n = window / ATTENTION_KEY_TILE
            eff *= n / (n + 1 + c0)
        else:
            n = keys / ATTENTION_KEY_TILE
            eff *= n / (n + 1 + 2 * c0)
        out.append(eff)
    return out[0], out[1]


def fused_softmax_available(b: int, heads: float, s_q: float, s_k: float) -> bool:
    """Whether Megatron's fused causal scale-mask-softmax kernel takes attention scores of ``b``
    sequences x ``heads`` local heads x ``s_q`` queries x ``s_k`` keys
    (``FusedScaleMaskSoftmax.is_kernel_available`` in Megatron-LM, Megatron-DeepSpeed and
    megatron-core's local attention): keys in (16, 4096], both lengths multiples of 4, and the
    attention batches (b x heads) a multiple of 4 and of the kernel's batches per block (128 threads
    of warps as wide as the keys' next power of two up to 32, each warp taking 2 rows up to 128
    keys, else 1: 8 for keys up to 128, 4 above). Elsewhere Megatron runs torch's softmax in fp32."""
    batches = b * heads
    if not (16 < s_k <= 4096 and s_q % 4 == 0 and s_k % 4 == 0 and batches == int(batches) and batches % 4 == 0):
        return False
    pow2 = 1 << max(0, math.ceil(math.log2(s_k)))
    per_block = (128 // min(pow2, 32)) * (2 if pow2 <= 128 else 1)
    return batches % per_block == 0


UNFUSED_SOFTMAX_BYTES = (33, 37)
"""Bytes per attention score that Megatron's unfused softmax moves beyond twice the model's element
size e (``attention_core_times``), forward and backward. Forward: cast to fp32 (read e, write 4),
scale (4 + 4), mask fill (4 + 4, the mask 1), softmax (4 + 4), cast back (4, write e). Backward:
the cast's (read e, write 4), the softmax's (read the gradient and the saved output, write: 12),
the mask fill's (4 + 4, the mask 1), the scale's (4 + 4), the first cast's (4, write e). Megatron-
DeepSpeed and Megatron-LM with query-key layer scaling (their old default) run all five; without
it, megatron-core skips the scale (8 bytes and one kernel less each way, not modelled)."""


FUSED_SOFTMAX_BYTES = (2, 3)
"""Multiples of e the fused kernel moves per score: read the scores, write the probabilities;
backward read the gradient and the probabilities, write the gradient."""


def attention_core_times(model: ModelSpec, b: int, tp: int, rf: Roofline, cp: int = 1,
                         ring_math: bool = False, unfused_softmax: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one block's attention core on a rank: its heads (a/tp), its
    s/cp queries against the keys they see (``block_times`` explains the context-parallel split),
    the partial outputs merged where cp > 1. ``ring_math``: with cp > 1 the ring's blocks run as
    explicit tensor operations (scores, softmax, weighted sum; the reference trainer's
    ``ring_attention``), recomputed in the backward, whatever the model's attention kind.
    ``unfused_softmax``: eager attention's softmax runs as torch's five fp32 kernels
    (:data:`UNFUSED_SOFTMAX_BYTES`; Megatron where its fused kernel does not take the shape)."""
    if ring_math and cp > 1 and model.attention == "flash":
        import dataclasses
        f, b_ = attention_core_times(dataclasses.replace(model, attention="eager", dropout=0.0), b, tp, rf, cp)
        return f, b_ + f
    s, q, B, a = model.seq_length, model.q_size, model.dtype_bytes, model.num_attention_heads
    k_w, v_w, out_w = model.k_size, model.v_size, model.attn_out_size
    s_loc = s / cp
    T = b * s_loc
    heads = a / tp
    calls = 1 if cp == 1 else cp  # ring attention: one call per key/value chunk
    if model.attention == "flash":
        # causal blocks skipped; scores over the Q/K width, the weighted sum over V's (they differ
        # under multi-head latent attention); windowed blocks see fewer keys (window_work)
        full = 2.0 * b * s * s * (q + out_w) / tp * 0.5 / cp
        io = (T * (q + k_w + v_w) / tp + T * out_w / tp) * B
        mem = io / (rf.memory_bandwidth_bytes_per_s * rf.memory_efficiency)
        # the windowed layers' share of the blocks and their work relative to a full causal layer
        # (window_work averages the two over the blocks): each kind at its own kernel efficiency
        windowed, w_frac = windowed_blocks(model)
        att_f = att_b = calls * rf.kernel_launch_s
        for share, flops, window in ((1.0 - windowed, full, None), (windowed, full * w_frac, model.sliding_window)):
            if share <= 0:
                continue
            eff_f, eff_b = rf.attention_efficiency or (rf.gemm_efficiency, rf.gemm_efficiency)
            if rf.sm_count:  # a GPU's fused kernel: its tiles and softmax at this shape
                eff_f, eff_b = attention_shape_efficiency(rf, eff_f, eff_b,
                                                          (q + out_w) / (2 * model.num_attention_heads),
                                                          s_loc if cp > 1 else s, window)
            if rf.gemm_eff is not None:  # a profile measured this device: scale by its large-GEMM rate
                eff_f, eff_b = (e * (rf.gemm_eff(8192, 8192, 8192) or rf.gemm_efficiency) / rf.gemm_efficiency
                                for e in (eff_f, eff_b))
            att_f += share * max(flops / (rf.peak_flop_per_s * eff_f), mem)
            att_b += share * max(2.5 * flops / (rf.peak_flop_per_s * eff_b), 2.5 * mem)
    else:
        # each query chunk against the key chunks it sees: at cp > 1 the rank's two of 2cp chunks
        # (i and 2cp-1-i) attend over i+1 and 2cp-i chunks, blocks wholly above the diagonal
        # skipped: (2cp+1) blocks of (s/2cp)^2 scores per head; at cp = 1 all s x s are computed
        s_kv = s if cp == 1 else s / 2 + s_loc / 4
        s_kv *= window_work(model)
        bmm = 2 * rf.gemm(s_loc, s_kv, model.head_size, B, batch=b * heads)
        probs = b * heads * s_loc * s_kv * B
        drop = 2 if model.dropout > 0 else 0
        # scale, mask, max, exp, sum, divide: ~6 vector FLOPs per score (softmax backward ~4)
        att_f = bmm + rf.elementwise(probs * (3 + drop), kernels=calls * (2 + drop // 2), flops=6 * probs / B)
        att_b = 2 * bmm + rf.elementwise(probs * (4 + drop), kernels=calls * (2 + drop // 2), flops=4 * probs / B)
        if unfused_softmax:  # torch's fp32 path instead of the one fused kernel, forward and backward
            (uf, ub), (ff, fb) = UNFUSED_SOFTMAX_BYTES, FUSED_SOFTMAX_BYTES
            scores = probs / B
            att_f += rf.elementwise(scores * (uf + 2 * B) - probs * ff, kernels=calls * 4)
            att_b += rf.elementwise(scores * (ub + 2 * B) - probs * fb, kernels=calls * 4)
    if cp > 1:  # merge each chunk's partial output: read and write the fp32 output and its lse
        merge = (cp - 1) * T * q / tp * 4 * 2
        att_f += rf.elementwise(merge, kernels=2 * (cp - 1))
        att_b += rf.elementwise(merge, kernels=2 * (cp - 1))
    return att_f, att_b
