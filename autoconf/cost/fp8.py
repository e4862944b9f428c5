"""FP8 linear layers' cost: the GEMMs at the FP8 rate and the quantisation kernels per recipe
(tensorwise, delayed, rowwise, MXFP8), fused or eager.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoconf.cost.roofline import Roofline, tile_efficiency


@dataclass(frozen=True)
class Fp8:
    """How a block's linear layers run their GEMMs in FP8 (``config.ParallelConfig.precision``).

    ``rf``: the roofline at the device's FP8 rate (MXFP8 on Blackwell) with its own efficiency.
    Every quantised operand is first scaled and cast (memory-bound kernels, :data:`QUANT_BYTES`):
    the input X and weight W of each linear in the forward, the output gradient dY in the backward
    (and X again along the other axis where the recipe needs it). ``host_ops``: the operations the
    framework issues from Python per linear for that (forward, backward).
    """

    rf: Roofline
    recipe: str = "tensorwise"
    host_ops: tuple = (0, 0)
    recast: bool = False
    """The backward casts X and W again (transposed) from the high-precision tensors it kept
    (torchao, the reference trainer), instead of using transposed FP8 copies written in the
    forward (Transformer Engine's cast-transpose)."""
    eager: bool = False
    """Every operand is quantised by eager torch operations, its amax recomputed before each GEMM
    (``autoconf.trainer.fp8``, the reference trainer): :data:`EAGER_QUANT_BYTES` per element and
    :data:`EAGER_QUANT_KERNELS` kernels, plus the layout copies cuBLASLt's TN-only FP8 kernels force,
    in place of the fused kernels of :data:`QUANT_BYTES`."""


# Bytes moved per element quantised (read the 16-bit source, write 1-byte FP8 copies), by recipe:
# (X or W in the forward, dY in the backward, X again in the backward). tensorwise (current
# scaling): an amax pass (read 2) then a fused cast + transpose (read 2, write 1 + 1: Hopper's FP8
# tensor cores take only the TN layout, so the wgrad GEMM needs the transposed copy; Transformer
# Engine's cast_transpose). delayed: the amax comes from the history, computed inside the cast
# (read 2, write 2). rowwise (torchao): amax per row then cast (read 2 + 2, write 1), and in the
# backward X and dY are cast again along the other axis. mxfp8: one pass writes both layouts with
# an E8M0 scale per 32 elements (read 2, write 2 + 2/32).
QUANT_BYTES = {"tensorwise": (6.0, 6.0, 0.0), "delayed": (4.0, 4.0, 0.0), "rowwise": (5.0, 10.0, 5.0),
               "mxfp8": (4.0625, 4.0625, 0.0)}


QUANT_KERNELS = {"tensorwise": (2, 2, 0), "delayed": (1, 1, 0), "rowwise": (2, 4, 2), "mxfp8": (1, 1, 0)}


EAGER_QUANT_BYTES = 39.0
"""Bytes ``autoconf.trainer.fp8.quantize`` moves per element of a 16-bit operand, either recipe: the fp32
copy (2 + 4), abs (4 + 4), amax (4), divide by the scale (4 + 4), clamp (4 + 4), cast to FP8
(4 + 1); tests/test_eager_elementwise.py tallies the dispatched operations. On an H100 the
reference trainer's FP8 steps of a Llama-3-8B-shaped model took 1.7-2.1x its bf16 steps
(bench/data/h100-2026-11-24/llama3-8l-fp8.json): the quantisation outweighs the faster GEMMs."""


EAGER_QUANT_KERNELS = 8
"""Kernels per quantised operand: cast, abs, amax, the scale's clamp and division, the operand's
division, clamp, cast."""


def fp8_gemm(rf: Roofline, m: float, n: float, k: float) -> float:
    """One FP8 GEMM: 1-byte operands, 16-bit output."""
    flops = 2.0 * m * n * k
    eff = rf.gemm_eff(m, n, k) if rf.gemm_eff is not None else None
    eff = eff or rf.gemm_efficiency * tile_efficiency(m, n, k, 1, rf.sm_count)
    nbytes = m * k + k * n + 2 * m * n
    return max(flops / (rf.peak_flop_per_s * eff),
               nbytes / (rf.memory_bandwidth_bytes_per_s * rf.memory_efficiency)) + rf.kernel_launch_s


def quantize_times(gemms, fp8: Fp8, rf: Roofline, compiled: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of the FP8 scaling and casting kernels of a block's linears
    (``gemms``: their (m, n, k)), memory-bound at ``rf``'s bandwidth. Compiled (torch.compile),
    the cast of an input produced by an element-wise kernel (the norms' outputs, the activation's)
    is fused into it: only the FP8 writes remain (half the forward bytes of X), and no launch."""
    if fp8.eager:
        # forward: X and W; backward: dY twice (dgrad, then transposed for wgrad), W and X again;
        # copies to the layouts _scaled_mm takes: W for dgrad, dY^T and X for wgrad (1 + 1 bytes)
        q, qk = EAGER_QUANT_BYTES, EAGER_QUANT_KERNELS
        fwd_bytes = sum((m * k + k * n) * q for m, n, k in gemms)
        bwd_bytes = sum((2 * m * n + k * n + m * k) * q + 2.0 * (k * n + m * n + m * k) for m, n, k in gemms)
        return (rf.elementwise(fwd_bytes, 2 * qk * len(gemms)),
                rf.elementwise(bwd_bytes, (4 * qk + 3) * len(gemms)))
    xb, dyb, xrb = QUANT_BYTES[fp8.recipe]
    xk, dyk, xrk = QUANT_KERNELS[fp8.recipe]
    if fp8.recast and fp8.recipe in ("tensorwise", "delayed"):
        # no transposed copy in the forward (one write less); the backward casts X and W again
        # along the other axis with the forward's scales (read 2, write 1)
        xb, xrb, xrk = xb - 1.0, 3.0, 1
    fwd_bytes = bwd_bytes = 0.0
    kf = kb = 0
    for i, (m, n, k) in enumerate(gemms):
        fused = compiled and i != 1  # qkv (norm), fc1 (norm), fc2 (activation); not the projection
        fwd_bytes += m * k * (xb / 2 if fused else xb) + k * n * xb
        kf += (0 if fused else xk) + xk
        bwd_bytes += m * n * dyb + m * k * xrb + (k * n * xrb if fp8.recast else 0.0)
        kb += dyk + xrk * (2 if fp8.recast else 1)
    return rf.elementwise(fwd_bytes, kf), rf.elementwise(bwd_bytes, kb)
