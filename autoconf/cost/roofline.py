"""A device's roofline (peak FLOP/s, memory bandwidth, GEMM efficiency by shape and tiles) and the
per-layer times it gives (:class:`LayerTimes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from autoconf.specs.devices import DeviceType


@dataclass(frozen=True)
class Roofline:
    peak_flop_per_s: float
    memory_bandwidth_bytes_per_s: float
    gemm_efficiency: float
    memory_efficiency: float
    kernel_launch_s: float
    gemm_eff: Callable | None = None
    """Measured efficiency as a function of (m, n, k); None: the catalog's curve."""
    sm_count: int = 0
    """Streaming multiprocessors for wave quantization (0: none, e.g. CPU)."""
    vector_flop_per_s: float = 0.0
    """Non-tensor-core rate for element-wise math (0: not modelled)."""
    attention_efficiency: tuple = ()
    """(forward, backward) fraction of peak of fused attention; empty: the GEMM efficiency."""
    unaligned_gemm_factor: float = 1.0
    """Rate of a GEMM with a dimension that is not a multiple of 16 bytes, relative to an aligned
    one (``aligned_gemm``); 1.0: no penalty (CPU)."""
    special_function_per_s: float = 0.0
    """Exponentials per second (``DeviceType.special_function_per_s``); 0: not modelled."""
    memory_time: Callable | None = None
    """Measured seconds of one memory-bound kernel moving x bytes, launch included (a profile's
    ``memory`` curve, ``measured.memory_time``): caches make small kernels faster per byte than
    DRAM / HBM streams, launches make the smallest slower. None: the catalog's bandwidth at its
    efficiency plus a launch per kernel."""

    @classmethod
    def of(cls, dev: DeviceType, dtype: str, gemm_eff=None, memory_time=None, attention_kernel: str = "") -> "Roofline":
        """``dev``'s roofline for ``dtype``; its fused attention at ``attention_kernel``'s rate
        (``Framework.attention_kernel``; "": the device's default kernel)."""
        att = dev.attention_efficiency_of(attention_kernel) or {}
        return cls(dev.peak(dtype), dev.memory_bandwidth_bytes_per_s, dev.gemm_efficiency,
                   dev.memory_efficiency, dev.kernel_launch_s, gemm_eff, dev.sm_count,
                   dev.peak_flop_per_s.get("fp32", 0.0) if dev.sm_count else 0.0,
                   (att["forward"], att["backward"]) if att else (),
                   dev.unaligned_gemm_factor if dev.sm_count else 1.0, dev.special_function_per_s, memory_time)

    def gemm(self, m: float, n: float, k: float, elem_bytes: int, batch: float = 1) -> float:
        flops = 2.0 * m * n * k * batch
        nbytes = (m * k + k * n + m * n) * elem_bytes * batch
        eff = None
        if self.gemm_eff is not None:
            eff = self.gemm_eff(m, n, k)
        if not eff:
            eff = self.gemm_efficiency * tile_efficiency(m, n, k, batch, self.sm_count)
            if not aligned_gemm(m, n, k, elem_bytes):
                eff *= self.unaligned_gemm_factor
        return max(flops / (self.peak_flop_per_s * eff),
                   nbytes / (self.memory_bandwidth_bytes_per_s * self.memory_efficiency)) + self.kernel_launch_s

    def elementwise(self, nbytes: float, kernels: int = 1, flops: float = 0.0) -> float:
        """Memory-bound kernels moving ``nbytes``, or bound by ``flops`` of vector math. With a
        measured ``memory_time`` each of the ``kernels`` moves an equal share at the measured time
        for its size (launch included)."""
        if self.memory_time is not None and nbytes > 0:
            k = max(kernels, 1)
            t = k * self.memory_time(nbytes / k)
            return max(t, flops / self.vector_flop_per_s) if flops and self.vector_flop_per_s else t
        t = nbytes / (self.memory_bandwidth_bytes_per_s * self.memory_efficiency)
        if flops and self.vector_flop_per_s:
            t = max(t, flops / self.vector_flop_per_s)
        return t + kernels * self.kernel_launch_s


def aligned_gemm(m: float, n: float, k: float, elem_bytes: float) -> bool:
    """Whether every dimension of an (m x k) @ (k x n) GEMM is a multiple of 16 bytes of its
    elements (8 for 16-bit, 16 for FP8). The weights' dimensions are leading dimensions of some
    operand in the forward or a backward GEMM (the vocabulary projection's V is the output's in the
    forward and an input's in both backward GEMMs; the token count, which is not, is a multiple of
    8 in practice and is checked alike), and cuBLAS's fast tensor-core kernels load 16-byte vectors
    (Hopper: TMA, which needs 16-byte aligned strides): an unaligned one falls back to slower
    kernels. On an H100 a GPT-2 vocabulary (50257) projection ran at 94-151 TFLOP/s against
    699-819 padded to 50264 (bench/gpu_host_device.py). Dimensions that are not whole numbers
    (averages, such as a mixture of experts' rows per expert) count as aligned."""
    vec = max(1, round(16 / elem_bytes))
    return not any(float(x).is_integer() and int(x) % vec for x in (m, n, k))


# (tile rows, tile columns, relative efficiency of the tile's main loop): the cuBLAS / CUTLASS
# tensor-core tiles of Ampere and Hopper; smaller tiles re-read more operand data per FLOP.
_TILES = ((256, 128, 1.0), (128, 256, 1.0), (128, 128, 0.92), (128, 64, 0.8), (64, 64, 0.65))


_K_HALF = 64  # inner-dimension length at which prologue / epilogue cost as much as the main loop


_REFERENCE = 8192  # a "large square GEMM": the catalog's gemm_efficiency is quoted for it


def tile_efficiency(m: float, n: float, k: float, batch: float, sm_count: int) -> float:
    """Fraction of a large GEMM's rate that an (m x k) @ (k x n) GEMM (``batch`` of them) reaches,
    from tile and wave quantization over ``sm_count`` SMs and the inner dimension's length.
    1.0 for the reference 8192^3 GEMM; 1.0 when ``sm_count`` is 0 (no SMs: CPU)."""
    if sm_count <= 0:
        return 1.0
    return _raw_tile_efficiency(m, n, k, batch, sm_count) / _raw_tile_efficiency(
        _REFERENCE, _REFERENCE, _REFERENCE, 1, sm_count)


def _raw_tile_efficiency(m, n, k, batch, sm_count) -> float:
    best = 0.0
    for tm, tn, tile_eff in _TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * max(1, round(batch))
        waves = math.ceil(tiles / sm_count)
        useful = (m * n * max(1, round(batch))) / (waves * sm_count * tm * tn)
        best = max(best, useful * tile_eff)
    return best * k / (k + _K_HALF)


@dataclass(frozen=True)
class LayerTimes:
    forward_s: float
    backward_s: float
    """Backward including any recomputed forward."""
    recompute_s: float = 0.0
    """The part of backward_s that is recomputation (reported separately)."""
    host_forward_s: float = 0.0
    """Seconds the host needs to issue the forward's operations (0: not modelled)."""
    host_backward_s: float = 0.0
    """Seconds the host needs to issue the backward's (and the recomputed forward's)."""
