"""Compute time of each layer kind from its operations: a roofline per kernel.

Each kernel costs max(FLOPs / (peak x efficiency), bytes / (memory bandwidth x efficiency)) plus a
launch overhead (Williams et al., "Roofline", CACM 2009), so that small GEMMs (high tp, micro-batch
1) are as slow as they really are. Peak, bandwidth, efficiencies and launch cost come from the
device catalog; a profile replaces the GEMM efficiency by its measured table (``gemm_eff``), and
replaces whole-layer times by measured ones in ``system.System.block``.

Backward = two GEMMs per forward GEMM (input and weight gradients), twice the element-wise traffic;
fused (flash) attention's backward is 2.5x its forward (it recomputes the scores; Dao 2022).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..catalog import DeviceType
from ..model import ModelSpec


@dataclass(frozen=True)
class Roofline:
    peak_flop_per_s: float
    memory_bandwidth_bytes_per_s: float
    gemm_efficiency: float
    memory_efficiency: float
    kernel_launch_s: float
    gemm_eff: Callable | None = None
    """Measured efficiency as a function of (m, n, k); None: the catalog constant."""

    @classmethod
    def of(cls, dev: DeviceType, dtype: str, gemm_eff=None) -> "Roofline":
        return cls(dev.peak(dtype), dev.memory_bandwidth_bytes_per_s, dev.gemm_efficiency,
                   dev.memory_efficiency, dev.kernel_launch_s, gemm_eff)

    def gemm(self, m: float, n: float, k: float, elem_bytes: int, batch: float = 1) -> float:
        flops = 2.0 * m * n * k * batch
        nbytes = (m * k + k * n + m * n) * elem_bytes * batch
        eff = self.gemm_efficiency
        if self.gemm_eff is not None:
            measured = self.gemm_eff(m, n, k)
            if measured:
                eff = measured
        return max(flops / (self.peak_flop_per_s * eff),
                   nbytes / (self.memory_bandwidth_bytes_per_s * self.memory_efficiency)) + self.kernel_launch_s

    def elementwise(self, nbytes: float, kernels: int = 1) -> float:
        return nbytes / (self.memory_bandwidth_bytes_per_s * self.memory_efficiency) + kernels * self.kernel_launch_s


@dataclass(frozen=True)
class LayerTimes:
    forward_s: float
    backward_s: float
    """Backward including any recomputed forward."""
    recompute_s: float = 0.0
    """The part of backward_s that is recomputation (reported separately)."""


def block_times(model: ModelSpec, b: int, tp: int, sp: bool, recompute: str, rf: Roofline) -> LayerTimes:
    """One transformer block shard (of a tp-way split) for a micro-batch of b sequences."""
    s, h, f, a = model.seq_length, model.hidden_size, model.ffn_hidden_size, model.num_attention_heads
    kv, B = model.kv_size, model.dtype_bytes
    T = b * s
    T_rep = T / tp if sp else T  # tokens each rank touches in norms / dropout / residual
    # GEMMs: (m, n, k)
    gemms = [(T, (h + 2 * kv) / tp, h), (T, h, h / tp),
             (T, (2 * f if model.activation == "swiglu" else f) / tp, h), (T, h, f / tp)]
    g_fwd = sum(rf.gemm(m, n, k, B) for m, n, k in gemms)
    g_bwd = sum(rf.gemm(m, k, n, B) + rf.gemm(n, k, m, B) for m, n, k in gemms)
    # attention core
    heads = a / tp
    if model.attention == "flash":
        flops = 4.0 * b * heads * s * s * model.head_dim * 0.5  # causal blocks skipped
        io = (T * (h + 2 * kv) / tp + T * h / tp) * B
        att_f = max(flops / (rf.peak_flop_per_s * rf.gemm_efficiency),
                    io / (rf.memory_bandwidth_bytes_per_s * rf.memory_efficiency)) + rf.kernel_launch_s
        att_b = 2.5 * att_f
    else:
        bmm = 2 * rf.gemm(s, s, model.head_dim, B, batch=b * heads)
        probs = b * heads * s * s * B
        drop = 2 if model.dropout > 0 else 0
        att_f = bmm + rf.elementwise(probs * (3 + drop), kernels=2 + drop // 2)
        att_b = 2 * bmm + rf.elementwise(probs * (4 + drop), kernels=2 + drop // 2)
    # element-wise: norms (read + write), residual adds, dropouts, activation, rope
    drop_k = 2 if model.dropout > 0 else 0
    ew_bytes = (2 * 2 + 2 * 2 + drop_k * 2) * T_rep * h * B
    ew_bytes += (3 if model.activation == "swiglu" else 2) * T * f / tp * B
    if model.position_embedding == "rope":
        ew_bytes += 2 * T * (h + kv) / tp * B
    ew_kernels = 4 + drop_k + (2 if model.activation == "swiglu" else 1) + (2 if model.position_embedding == "rope" else 0)
    ew_f = rf.elementwise(ew_bytes, ew_kernels)
    ew_b = rf.elementwise(2 * ew_bytes, 2 * ew_kernels)
    fwd = g_fwd + att_f + ew_f
    rc = fwd if recompute == "full" else att_f if recompute == "selective" else 0.0
    return LayerTimes(forward_s=fwd, backward_s=g_bwd + att_b + ew_b + rc, recompute_s=rc)


def embedding_times(model: ModelSpec, b: int, tp: int, rf: Roofline) -> LayerTimes:
    """Token (vocab-parallel) and position lookup; backward scatters into a dense gradient."""
    T, h, B = b * model.seq_length, model.hidden_size, model.dtype_bytes
    fwd = rf.elementwise(3 * T * h * B, kernels=3)
    bwd = rf.elementwise(2 * T * h * B + model.vocab_size / tp * h * B, kernels=3)
    return LayerTimes(fwd, bwd)


def head_times(model: ModelSpec, b: int, tp: int, rf: Roofline) -> LayerTimes:
    """Final norm, output projection (vocab-parallel) and cross-entropy on fp32 logits."""
    T, h, B, V = b * model.seq_length, model.hidden_size, model.dtype_bytes, model.vocab_size / tp
    fwd = rf.gemm(T, V, h, B) + rf.elementwise(2 * T * h * B + 3 * T * V * 4, kernels=4)
    bwd = rf.gemm(T, h, V, B) + rf.gemm(V, h, T, B) + rf.elementwise(2 * T * h * B + 3 * T * V * 4, kernels=4)
    return LayerTimes(fwd, bwd)


def optimizer_s(num_params: float, master_copy: bool, rf: Roofline) -> float:
    """AdamW step over ``num_params`` local parameters: memory-bound.

    Traffic per parameter: read grad, read/write m and v, read/write the fp32 master (16-bit
    training: 2+4+8+8+8+2 = 32 bytes with the 16-bit copy written; fp32: 4+8+8+8 = 28 bytes).
    """
    per_param = 32 if master_copy else 28
    return rf.elementwise(num_params * per_param, kernels=4)
