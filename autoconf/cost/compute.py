"""Compute time of each layer kind from its operations: a roofline per kernel.

Each kernel costs max(FLOPs / (peak x efficiency), bytes / (memory bandwidth x efficiency)) plus a
launch overhead (Williams et al., "Roofline", CACM 2009), so that small GEMMs (high tp, micro-batch
1) are as slow as they really are. Peak, bandwidth, efficiencies and launch cost come from the
device catalog; a profile replaces the GEMM efficiency by its measured table (``gemm_eff``), and
replaces whole-layer times by measured ones in ``system.System.block``.

Backward = two GEMMs per forward GEMM (input and weight gradients), twice the element-wise traffic;
fused (flash) attention's backward does 2.5x its forward's FLOPs (it recomputes the scores; Dao
2022), each at the device's measured flash-attention efficiency (catalog ``attention_efficiency``).

Three effects make small work slower than its FLOPs say:

- **Wave quantization.** A GEMM runs as output tiles (128 x 128 or 128 x 256 on Ampere / Hopper
  cuBLAS kernels) scheduled over the streaming multiprocessors in waves; the last wave is partly
  idle, and small GEMMs fill few SMs. The library picks the tile that finishes first. A short inner
  dimension k pays the tile's prologue and epilogue (efficiency k / (k + 64)). Scaled so that a
  large square GEMM reaches the catalog's ``gemm_efficiency``. (NVIDIA, "Matrix Multiplication
  Background User's Guide", tile and wave quantization.)
- **Vector math.** Norms, softmax and activations run on the CUDA cores, not the tensor cores: an
  element-wise kernel takes the longer of its memory traffic and its FLOPs at the vector rate
  (the catalog's fp32 peak).
- **The host.** An eager framework issues every kernel from Python; when the device work is
  shorter than the host's time to issue it, the device waits. ``LayerTimes`` carries the host's
  issue time next to the device time (``HostCost``, from the framework model); ``chunk_time``
  charges max(host, device compute) per pass (the forward; the backward with its recomputed
  forward), and the collectives on top.
"""

from __future__ import annotations

import math
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
    def of(cls, dev: DeviceType, dtype: str, gemm_eff=None, memory_time=None) -> "Roofline":
        att = dev.attention_efficiency or {}
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
class HostCost:
    """Seconds the host needs to issue one operation: from Python in the forward (and recomputed
    forward), from the autograd engine in the backward. From the framework model."""

    forward_op_s: float = 0.0
    backward_op_s: float = 0.0
    dispatch_counts: bool = False
    """Count the operations as the reference trainer's block dispatches them (``dispatch_op_counts``:
    every ATen call, the backward's several per autograd node); else ``block_op_counts``' structural
    count, one per forward op and one per autograd node."""
    checkpoint_s: float = 0.0
    """Host seconds of one checkpointed region (``torch.utils.checkpoint``: saving and restoring the
    RNG states, the saved-tensor hooks, re-entering the region in the backward), forward and
    backward together; charged once per block under selective or full recomputation."""


def dispatch_op_counts(model: ModelSpec, tp: int, sp: bool) -> tuple[int, int]:
    """ATen operations ``autoconf.nn.Block`` dispatches in its forward and in its backward (views
    and the gradient accumulation into ``.grad`` included), counted under a ``TorchDispatchMode``
    (tests/test_host_cost.py recounts them on the real module): 32 and 57 for a block with
    LayerNorm, GeLU, no biases, learned positions, no dropout and fused attention; each feature
    adds its own. Tensor parallelism adds each collective's two calls as ``block_op_counts``."""
    fwd, bwd = 32, 57
    if model.gated_mlp:
        fwd, bwd = fwd + 2, bwd + 3
    if model.norm == "rmsnorm":  # composed of pow, mean, add, rsqrt, mul, mul (LayerNorm: one kernel)
        fwd, bwd = fwd + 6 * model.norms_per_block, bwd + 8 * model.norms_per_block
        if model.dtype != "fp32":  # computed in fp32: the casts in and out
            fwd, bwd = fwd + 2 * model.norms_per_block, bwd + 5 * model.norms_per_block
    if model.bias:
        fwd, bwd = fwd + 2, bwd + 12
    elif model.qkv_bias:
        bwd += 3
    if model.position_embedding == "rope":
        fwd, bwd = fwd + 17, bwd + 14
    if model.dropout > 0:
        fwd, bwd = fwd + 8, bwd + 2
    if model.attention == "eager":
        fwd, bwd = fwd + 21, bwd + 18
    if tp > 1:
        fwd += 2 * (2 if sp else 1)
        bwd += 2 * (2 if sp else 1)
    return fwd, bwd


def block_op_counts(model: ModelSpec, tp: int, sp: bool) -> tuple[int, int]:
    """Operations one transformer block dispatches in its forward and in its backward (eager).

    Counted from the block's structure as Megatron-style code writes it, views and layout changes
    included (each is a dispatch): per norm 1 (a parallel block with a shared norm has 1, others
    2); per linear 1 (+1 bias add unless fused); q/k/v split and head reshapes 8; eager attention 8
    (scores buffer + baddbmm, scale-mask-softmax, dropout under the model-parallel RNG tracker 3,
    context bmm) or fused 2; output reshape 3; rope 6 (partial rotary: 4 more slices and 2 concats);
    activation 1 (gated SwiGLU / GeGLU 3); bias-dropout-add 1 per residual (dropout 0: 1 add); each
    TP collective 2 (the autograd function and the call), sequence parallelism adds its gathers.
    The backward runs one autograd node per differentiable forward op, except views, which
    cost nothing there.
    """
    linears = 2 + model.mlp_matrices  # qkv, o, mlp
    partial_rope = model.position_embedding == "rope" and model.rotary_dim < model.head_size
    views = 8 + 3 + (4 if partial_rope else 0)
    fwd = model.norms_per_block + linears + views + (6 if model.position_embedding == "rope" else 0)
    fwd += 2 if partial_rope else 0
    fwd += 8 if model.attention == "eager" else 2
    fwd += 3 if model.gated_mlp else 1
    fwd += 2 * (2 if model.dropout > 0 else 1)
    if tp > 1:
        fwd += 2 * (2 if sp else 1)
    bwd = fwd - views
    return fwd, bwd


def eager_elementwise_bytes(model: ModelSpec, T_rep: float, T: float, tp: int, mlp_tokens_f: float
                            ) -> tuple[float, float, int, int]:
    """Bytes and kernels that ``autoconf.nn.Block``'s eager element-wise code moves beyond the fused
    kernels :func:`block_times` prices by default (forward extra, backward extra, forward kernels,
    backward kernels), tallied op by op from the code (read + write of every operand; per-token
    vectors such as 1/rms are negligible). ``e`` is the model's element size, fp32 is 4 bytes.

    - RMSNorm (``_RMSNormFn``), per element of each norm's input: forward cast to fp32 (e + 4),
      square (8), mean (4), scale by 1/rms (8), cast back (4 + e), times the weight (2e), against a
      fused kernel's 2e; backward (recompute x-hat: cast and scale, 4 + e + 8; cast the gradient,
      4 + e; g * x-hat, 12; its sum over tokens, 4; g * w, 8; (g w) * x-hat, 12; its mean, 4; x-hat
      times it, 8; the difference, 12; times 1/rms, 8; cast back, 4 + e) against 4e. Without a cast
      (fp32 models) the casts' kernels and bytes drop out.
    - Rotary embedding (``_rope``) on Q and K, per rotated element: x cos (2e), the negated half
      (e), the concatenation (2e), x sin (2e), the sum (3e): 10e against 2e, and as many in the
      backward (the same products, the concatenation's split and the two gradients' sum) against
      4e; V is copied to a contiguous tensor (2e forward). Partial rotary concatenates the rotated
      part with the rest (2e per head element), and its backward zero-fills each slice's gradient to
      full width and adds the two (6e). Not under multi-head latent attention (not in autoconf.nn).
    - Gated MLP: the activation (2e) and the product (3e) on views of the first linear's output,
      against 3e; backward: the product's two gradients (6e), the activation's (3e), and the two
      halves' concatenation into the linear's output gradient (4e per element of each half),
      against 6e.
    - The split of the fused QKV output: its backward concatenates the three gradients
      (2e per element of Q, K and V).

    On an H100 (bench/gpu_kernels.py, ``--breakdown``) the element-wise kernels of a Llama-3-8B
    block at micro-batch 1 took 0.95 ms forward and 2.6 ms backward; the fused-kernel count alone
    priced them at 0.26 and 0.52."""
    e = model.dtype_bytes
    cast = 0 if e == 4 else 4 + e
    cast_k = 0 if e == 4 else 1
    xf = xb = 0.0
    kf = kb = 0
    if model.norm == "rmsnorm":  # 8 kernels forward and 14 backward (6 and 9 without casts)
        n = model.norms_per_block * T_rep * model.hidden_size
        xf += n * (cast + 8 + 4 + 8 + cast + 2 * e - 2 * e)
        xb += n * ((cast + 8) + cast + 12 + 4 + 8 + 12 + 4 + 8 + 12 + 8 + cast - 4 * e)
        kf += model.norms_per_block * (6 + 2 * cast_k - 1)
        kb += model.norms_per_block * (9 + 5 * cast_k - 2)
    if model.position_embedding == "rope" and not model.is_mla:
        heads_el = T * (model.q_size + model.kv_size) / tp
        rot = heads_el * model.rotary_dim / max(1, model.head_size)
        xf += rot * (10 * e - 2 * e) + T * model.kv_size / tp * 2 * e
        xb += rot * (10 * e - 4 * e)
        kf += 2 * 5 - 2 + 1
        kb += 2 * 5 - 4
        if model.rotary_dim < model.head_size:
            # partial rotary: the rotated part and the pass-through concatenated (2e per head
            # element); backward, each slice's gradient zero-filled to full width and the two added
            xf += heads_el * 2 * e
            xb += heads_el * 6 * e
            kf += 2
            kb += 2 * 3
    if model.gated_mlp:
        xf += mlp_tokens_f * (5 * e - 3 * e)
        xb += mlp_tokens_f * (13 * e - 6 * e)
    xb += T * (model.q_size + 2 * model.kv_size) / tp * 2 * e
    kb += 1
    return xf, xb, kf, kb


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
    (``autoconf.fp8``, the reference trainer): :data:`EAGER_QUANT_BYTES` per element and
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
"""Bytes ``autoconf.fp8.quantize`` moves per element of a 16-bit operand, either recipe: the fp32
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


@dataclass(frozen=True)
class Moe:
    """A mixture-of-experts block's MLP on one rank (``cost.moe.moe_shape``): ``local_experts``
    experts, each running a GEMM over ``rows`` tokens (grouped GEMM: many small GEMMs, their tiles
    scheduled together), ``shared_ffn`` inner width of the shared experts (every token), the
    router over ``num_experts``, and ``assignments`` (token, expert) pairs permuted in and out."""

    local_experts: int
    rows: float
    expert_ffn: int
    shared_ffn: int
    num_experts: int
    assignments: float
    tokens: float = 0.0
    """Tokens the rank routes (0: its T = b x s / cp; a sequence-parallel shard where the experts
    are not tensor-parallel)."""
    etp: int = 0
    """The experts' tensor-parallel split (0: tp; 1: whole experts on every tp rank)."""


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


BF16_OPTIMIZER_UPDATE = (8.0, 1)
"""DeepSpeed's ``BF16_Optimizer`` (bf16 without ZeRO under its pipeline engine; read in DeepSpeed
0.19.8, ``runtime/bf16_optimizer.py``), every micro-batch: ``clear_lp_grads`` zeroes the bf16
gradients before the backward (write 2 bytes per parameter, a foreach call), and
``update_hp_grads`` adds them into its own gradient copies after it,
``hp.add_(lp.grad.to(hp.dtype))`` per parameter. The copies take the gradient-accumulation dtype,
which is the model's (bf16) unless ``data_types.grad_accum_dtype`` says otherwise (and DeepSpeed
refuses fp32 there without ZeRO): the cast is a no-op and the add reads 2 + 2 and writes 2. So 8
bytes per parameter, one kernel per parameter tensor, on top of autograd's own ``.grad``
accumulation (the zeroed gradients are added into, not replaced)."""


def gradient_passes(params: float, elem_bytes: int, accumulation: bool, update: tuple = (0.0, 0)) -> tuple:
    """(bytes, kernels per parameter tensor) of the passes over ``params`` weights' gradients
    after every backward: autograd's ``.grad`` accumulation (read both, write one, in the
    parameters' dtype: one kernel per tensor) and a framework's own ``update`` (bytes per
    parameter, kernels per tensor: ``BF16_OPTIMIZER_UPDATE``)."""
    return (params * ((3 * elem_bytes if accumulation else 0) + update[0]),
            (1 if accumulation else 0) + update[1])


def linear_gemms(model: ModelSpec, b: int, tp: int, cp: int = 1) -> dict:
    """The dense block's linear layers as GEMM shapes (m, n, k) = (tokens, outputs, inputs) of one
    tp shard, by where they sit around Megatron's tensor-parallel split: ``attention_in`` (the
    column-parallel projections of the block input: fused QKV; MLA's low-rank projections and
    the heads' up-projections), ``attention_out`` (the row-parallel output projection),
    ``mlp_in`` (fc1, gate and up fused when gated) and ``mlp_out`` (fc2)."""
    s, h, f = model.seq_length, model.hidden_size, model.ffn_hidden_size
    T = b * s / cp
    if model.is_mla:  # low-rank Q and KV projections, then the heads' up-projections
        nope_rope, a_tp = model.qk_nope_head_dim + model.qk_rope_head_dim, model.num_attention_heads / tp
        attn = ([(T, model.q_lora_rank, h), (T, a_tp * nope_rope, model.q_lora_rank)] if model.q_lora_rank
                else [(T, a_tp * nope_rope, h)])
        attn += [(T, model.kv_lora_rank + model.qk_rope_head_dim, h),
                 (T, a_tp * (model.qk_nope_head_dim + model.v_head_dim), model.kv_lora_rank)]
    else:
        attn = [(T, (model.q_size + 2 * model.kv_size) / tp, h)]
    return {"attention_in": attn, "attention_out": [(T, h, model.attn_out_size / tp)],
            "mlp_in": [(T, (2 * f if model.gated_mlp else f) / tp, h)], "mlp_out": [(T, h, f / tp)]}


def block_times(model: ModelSpec, b: int, tp: int, sp: bool, recompute: str, rf: Roofline,
                host: HostCost | None = None, cp: int = 1, fp8: Fp8 | None = None,
                compiled: bool = False, moe: Moe | None = None, ring_math: bool = False,
                unfused_softmax: bool = False, eager_elementwise: bool = False,
                grad_accumulation: bool = False, grad_update: tuple = (0.0, 0),
                modules: tuple = ()) -> LayerTimes:
    """One transformer block shard (of a tp-way split) for a micro-batch of b sequences: device
    times, and with ``host`` the host's time to issue the operations (``block_op_counts``).

    ``cp``: the sequence is split over a context-parallel group; this rank holds s/cp tokens
    (every GEMM and element-wise kernel works on them) and its queries attend over the whole
    causal context: the load-balanced split gives each rank 1/cp of the causal attention work, run
    as one attention call per key/value chunk it sees (``context_parallel``; the exchange is
    priced there), each merged into the running output (read and write the fp32 output and
    log-sum-exp). ``fp8``: the linear layers' GEMMs in FP8 with their scaling kernels (the
    attention core stays in the model's dtype). ``compiled``: torch.compile fuses the element-wise
    chains (a residual add into the norm that reads it; FP8 casts into their producers) and
    issues the fused kernels instead of every eager operation. ``moe``: the MLP is a mixture of
    experts (``Moe``): the router's GEMM and softmax, the tokens permuted to their experts and back
    (memory-bound), the routed experts as a grouped GEMM (``local_experts`` GEMMs of ``rows``
    tokens each, the tile model applied to the whole group), the shared experts on every token; the
    all-to-alls are priced in ``cost.moe``. ``unfused_softmax``: eager attention's softmax as
    torch's fp32 kernels, four more forward operations and four more backward nodes than the fused
    kernel (``attention_core_times``). ``eager_elementwise``: the norms, rotary embedding, gated
    activation and QKV split run as ``autoconf.nn``'s eager torch operations
    (:func:`eager_elementwise_bytes`), not as fused kernels (the reference trainer; not under
    ``compiled``). ``grad_accumulation``: each backward adds the block's weight gradients into the
    ones accumulated so far with a separate kernel per parameter (eager torch's ``.grad``
    accumulation: read both, write one, in the parameters' dtype), as on every micro-batch but the
    first of a step (charged on each: 1/m of the term too much); Megatron-LM fuses it into the
    weight-gradient GEMM (its fp32 ``main_grad``). ``grad_update``: (bytes per parameter,
    kernels per parameter tensor) a framework moves after every backward as well (DeepSpeed's
    BF16 optimizer: ``BF16_OPTIMIZER_UPDATE``). Neither for mixture-of-experts blocks (not
    priced). ``modules``: with recompute="selective", what it re-runs in the backward
    (``config.RECOMPUTE_MODULES``; empty: the attention core): :func:`module_recompute_s`."""
    unfused_softmax = unfused_softmax and model.attention == "eager"
    s, h, f = model.seq_length, model.hidden_size, model.ffn_hidden_size
    q, kv, B = model.q_size, model.kv_size, model.dtype_bytes
    s_loc = s / cp
    T = b * s_loc
    T_rep = T / tp if sp else T  # tokens each rank touches in norms / dropout / residual
    # GEMMs: (m, n, k)
    lin = linear_gemms(model, b, tp, cp)
    gemms = lin["attention_in"] + lin["attention_out"] + lin["mlp_in"] + lin["mlp_out"]
    n_attn = len(lin["attention_in"]) + 1  # the attention's GEMMs come first, then the MLP's two
    grouped = []  # (m, n, k, batch): the routed experts' grouped GEMMs
    mlp_tokens_f = T * f / tp  # elements of the MLP's hidden activation (per matrix)
    moe_f = moe_b = 0.0
    if moe is not None:
        fe, et, Tm = moe.expert_ffn, moe.etp or tp, moe.tokens or T
        gemms = gemms[:n_attn] + ([(Tm, (2 * moe.shared_ffn if model.gated_mlp else moe.shared_ffn) / et, h),
                                   (Tm, h, moe.shared_ffn / et)] if moe.shared_ffn else [])
        if moe.rows > 0:
            grouped = [(moe.rows, (2 * fe if model.gated_mlp else fe) / et, h, moe.local_experts),
                       (moe.rows, h, fe / et, moe.local_experts)]
        mlp_tokens_f = (moe.rows * moe.local_experts * fe + Tm * moe.shared_ffn) / et
        # router: an h x E GEMM and its softmax / top-k in fp32; permute and unpermute: read and
        # write every assignment's hidden vector, forward, and again in the backward
        router = rf.gemm(Tm, moe.num_experts, h, B) + rf.elementwise(Tm * moe.num_experts * 4 * 3, kernels=3)
        perm = rf.elementwise(2 * 2 * moe.assignments * h * B, kernels=4)
        moe_f = router + perm
        moe_b = (2 * rf.gemm(Tm, moe.num_experts, h, B) + rf.elementwise(Tm * moe.num_experts * 4 * 3, kernels=3)
                 + perm)
    if fp8 is None:
        g_fwd = sum(rf.gemm(m, n, k, B) for m, n, k in gemms)
        g_bwd = sum(rf.gemm(m, k, n, B) + rf.gemm(n, k, m, B) for m, n, k in gemms)
        g_fwd += sum(rf.gemm(m, n, k, B, batch=nb) for m, n, k, nb in grouped)
        g_bwd += sum(rf.gemm(m, k, n, B, batch=nb) + rf.gemm(n, k, m, B, batch=nb) for m, n, k, nb in grouped)
        qf = qb = 0.0
    else:
        g_fwd = sum(fp8_gemm(fp8.rf, m, n, k) for m, n, k in gemms)
        g_bwd = sum(fp8_gemm(fp8.rf, m, k, n) + fp8_gemm(fp8.rf, n, k, m) for m, n, k in gemms)
        g_fwd += sum(nb * fp8_gemm(fp8.rf, m, n, k) for m, n, k, nb in grouped)
        g_bwd += sum(nb * (fp8_gemm(fp8.rf, m, k, n) + fp8_gemm(fp8.rf, n, k, m)) for m, n, k, nb in grouped)
        # the reference trainer's experts (fp8.eager) are not FP8 linears: only the dense GEMMs quantise
        quantised = (gemms[:n_attn] if fp8.eager and moe is not None
                     else gemms + [(m * nb, n, k) for m, n, k, nb in grouped])
        qf, qb = quantize_times(quantised, fp8, rf, compiled)
    att_f, att_b = attention_core_times(model, b, tp, rf, cp, ring_math, unfused_softmax)
    calls = 1 if cp == 1 else cp  # ring attention: one call per key/value chunk
    # element-wise: norms (read + write), residual adds, dropouts, activation, rope
    drop_k = 2 if model.dropout > 0 else 0
    norms = model.norms_per_block
    ew_bytes = (norms * 2 + 2 * 2 + drop_k * 2) * T_rep * h * B
    ew_bytes += (3 if model.gated_mlp else 2) * mlp_tokens_f * B
    if model.position_embedding == "rope":
        ew_bytes += 2 * T * (q + kv) / tp * B
    ew_kernels = (norms + 2 + drop_k + (2 if model.gated_mlp else 1)
                  + (2 if model.position_embedding == "rope" else 0))
    if compiled:
        # residual add (and dropout) fused into the norm that reads the sum: its re-read is gone
        ew_bytes -= min(norms, 2) * T_rep * h * B
        ew_kernels = norms + 1 + (1 if model.position_embedding == "rope" else 0)
    # vector FLOPs: norms ~8 per element each, GeLU (tanh form) ~20, SwiGLU's SiLU and product ~6,
    # GeGLU's GeLU and product ~21
    act_flops = {"gelu": 20, "swiglu": 6, "geglu": 21}[model.activation]
    ew_flops = norms * 8 * T_rep * h + act_flops * mlp_tokens_f
    xf = xb = 0.0
    kf = kb = 0
    if eager_elementwise and not compiled:
        xf, xb, kf, kb = eager_elementwise_bytes(model, T_rep, T, tp, mlp_tokens_f)
    if moe is None:
        tensors = 4 * (2 if model.bias else 1) + model.norms_per_block * (2 if model.norm == "layernorm" else 1)
        gb, gk = gradient_passes(model.layer_params() / tp, B, grad_accumulation, grad_update)
        xb, kb = xb + gb, kb + gk * tensors
    ew_f = rf.elementwise(ew_bytes + xf, ew_kernels + kf, flops=ew_flops)
    ew_b = rf.elementwise(2 * ew_bytes + xb, 2 * ew_kernels + kb, flops=2 * ew_flops)
    fwd = g_fwd + att_f + ew_f + qf + moe_f
    bwd = g_bwd + att_b + ew_b + qb + moe_b
    mods = set(modules or ("core_attn",)) if recompute == "selective" else set()
    rc = fwd if recompute == "full" else att_f if "core_attn" in mods else 0.0
    rc_ops = 0
    if mods - {"core_attn"}:
        extra, rc_ops = module_recompute_s(model, mods, lin, T, T_rep, tp, rf, fp8, moe)
        rc += extra
    host_f = host_b = 0.0
    if host is not None:
        ops_f, ops_b = (dispatch_op_counts if host.dispatch_counts else block_op_counts)(model, tp, sp)
        if fp8 is not None:
            linears = 2 + model.mlp_matrices
            ops_f, ops_b = ops_f + linears * fp8.host_ops[0], ops_b + linears * fp8.host_ops[1]
        if moe is not None:  # router, top-k, sort, counts, permute, the grouped GEMM calls, unpermute
            ops_f, ops_b = ops_f + 20, ops_b + 15
        if unfused_softmax:  # cast, scale, mask fill, softmax, cast back instead of one call
            ops_f, ops_b = ops_f + 4 * calls, ops_b + 4 * calls
        if cp > 1:  # per extra chunk: the exchange (send, receive, wait), the attention call, the merge
            ops_f += 6 * (cp - 1)
            ops_b += 6 * (cp - 1)
        if compiled:  # the compiled graph issues its kernels, not every eager operation
            ops_f = len(gemms) + calls + ew_kernels + (len(gemms) * 2 if fp8 is not None else 0)
            ops_b = 2 * ops_f
        host_f, host_b = ops_f * host.forward_op_s, ops_b * host.backward_op_s
        if recompute == "full":  # the recomputed forward is issued again (and, counted by dispatch,
            host_b += host_f * (2 if host.dispatch_counts else 1)  # its saved tensors unpacked)
        host_b += rc_ops * host.forward_op_s  # the recomputed modules' operations, issued again
        if "core_attn" in mods and host.dispatch_counts:  # the attention core re-run:
            core = 8 if model.attention != "eager" else 28 + (5 if model.dropout > 0 else 0)  # counted
            host_b += core * host.backward_op_s
        if recompute != "none" and not compiled:
            host_f += host.checkpoint_s / 2
            host_b += host.checkpoint_s / 2
    return LayerTimes(forward_s=fwd, backward_s=bwd + rc, recompute_s=rc, host_forward_s=host_f, host_backward_s=host_b)


def module_recompute_s(model: ModelSpec, mods: set, lin: dict, T: float, T_rep: float, tp: int, rf: Roofline,
                       fp8: Fp8 | None, moe: Moe | None) -> tuple[float, int]:
    """(seconds, host operations) of the forward work Megatron-LM's output-discarding recompute
    modules re-run in the backward, besides the attention core (``config.RECOMPUTE_MODULES``):

    - "layernorm": each separate norm (before a mixture of experts' router; MLA's input norm),
      read and written once, ~8 FLOPs per element;
    - "moe_act": the routed experts' gated activation (read the 2f-wide up projection, write f;
      f to f ungated), at the activation's vector FLOPs;
    - "mla_up_proj": MLA's up-projection GEMMs (query latent to the heads' queries, or the whole
      query projection without a low-rank query; key/value latent to their keys and values; in
      FP8 where the linears are) and the rotary embedding of the query heads' and the shared key's
      rotary parts. (Under sequence parallelism the latents' all-gather is redone too: not priced,
      the latents are a few thousand wide.)
    """
    B, h = model.dtype_bytes, model.hidden_size
    s = ops = 0.0
    if "layernorm" in mods:
        n = int(model.is_mla) + int(moe is not None)
        if n:
            s += rf.elementwise(2 * n * T_rep * h * B, kernels=n, flops=8 * n * T_rep * h)
            ops += n
    if "moe_act" in mods and moe is not None and moe.rows > 0:
        elems = moe.rows * moe.local_experts * moe.expert_ffn / (moe.etp or tp)
        act_flops = {"gelu": 20, "swiglu": 6, "geglu": 21}[model.activation]
        s += rf.elementwise((3 if model.gated_mlp else 2) * elems * B, kernels=1, flops=act_flops * elems)
        ops += 1
    if "mla_up_proj" in mods and model.is_mla:
        # with a low-rank query its up-projection, else the query's whole projection (inside the
        # same recomputed region), and the key/value up-projection
        ups = lin["attention_in"][1::2] if model.q_lora_rank else lin["attention_in"][0::2]
        s += sum(fp8_gemm(fp8.rf, m, n, k) if fp8 is not None else rf.gemm(m, n, k, B) for m, n, k in ups)
        rope = (model.num_attention_heads / tp + 1) * model.qk_rope_head_dim
        s += rf.elementwise(2 * T * rope * B, kernels=2)
        ops += len(ups) + 6  # the GEMMs, two rotary applications, the splits and concatenations
    return s, int(ops)


# Operations the embedding (lookup, position add, dropout, TP reduce) and the output layer (norm,
# projection, vocabulary-parallel cross-entropy: cast, max, subtract, exp, sum, divide, target
# gather and its reductions) dispatch in their forward and backward.
EDGE_OPS = {"embedding": (5, 4), "head": (14, 8)}


DISPATCH_EDGE_OPS = {"embedding": (3, 6), "head": (24, 22)}
"""As ``EDGE_OPS``, counted as ``dispatch_op_counts`` on ``autoconf.nn``'s Embedding and Head."""


def with_host(t: LayerTimes, which: str, host: HostCost | None) -> LayerTimes:
    """``t`` with the host's issue time of the embedding or output layer's operations."""
    if host is None:
        return t
    f, b = (DISPATCH_EDGE_OPS if host.dispatch_counts else EDGE_OPS)[which]
    return LayerTimes(t.forward_s, t.backward_s, t.recompute_s, f * host.forward_op_s, b * host.backward_op_s)


def embedding_times(model: ModelSpec, b: int, tp: int, rf: Roofline) -> LayerTimes:
    """Token (vocab-parallel) and position lookup; backward scatters into a dense gradient."""
    T, h, B = b * model.seq_length, model.hidden_size, model.dtype_bytes
    fwd = rf.elementwise(3 * T * h * B, kernels=3)
    bwd = rf.elementwise(2 * T * h * B + model.vocab_size / tp * h * B, kernels=3)
    return LayerTimes(fwd, bwd)


def head_times(model: ModelSpec, b: int, tp: int, rf: Roofline) -> LayerTimes:
    """Final norm, output projection (vocab-parallel) and cross-entropy on fp32 logits.

    The vocabulary-parallel cross-entropy (Megatron-LM's ``vocab_parallel_cross_entropy`` on
    ``logits.float()``) streams every logit several times. Forward, bytes per logit: cast to fp32
    (read 2, write 4), max (4), subtract the max in place (8), exp in place (8), sum (4), divide
    in place, the softmax kept for the backward (8): 38 for 16-bit logits. Backward: scale by the
    loss gradient in place (8), cast back (6): 14. fp32 logits skip the casts (32 and 8).
    """
    # each rank's vocabulary shard: a whole number of words (frameworks pad to a multiple of tp),
    # which decides whether the projection's GEMMs are aligned (``aligned_gemm``)
    T, h, B, V = b * model.seq_length, model.hidden_size, model.dtype_bytes, -(-model.vocab_size // tp)
    cast_f, cast_b = (6, 6) if B < 4 else (0, 0)
    fwd = rf.gemm(T, V, h, B) + rf.elementwise(2 * T * h * B + (32 + cast_f) * T * V, kernels=7,
                                               flops=4 * T * V)
    bwd = (rf.gemm(T, h, V, B) + rf.gemm(V, h, T, B)
           + rf.elementwise(2 * T * h * B + (8 + cast_b) * T * V, kernels=3))
    return LayerTimes(fwd, bwd)


def optimizer_s(num_params: float, master_copy: bool, rf: Roofline, param_bytes: int = 4,
                foreach: bool = False) -> float:
    """AdamW step over ``num_params`` local parameters: memory-bound.

    Traffic per parameter: read grad, read/write m and v, read/write the fp32 master (16-bit
    training, one fused kernel: 2+4+8+8+8+2 = 32 bytes with the 16-bit copy written); without a
    master copy the moments are in the parameters' dtype: read grad, read/write m, v and the
    parameter, 7 x its bytes (fp32: 28 bytes; bf16: 14). ``foreach``: torch's multi-tensor AdamW
    makes one pass per operation (torch/optim/adam.py ``_multi_tensor_adam``): weight decay (read
    and write the parameter, 2), lerp of m (3), scale v (2), addcmul into v (4), sqrt(v) into a
    temporary (2), divide (2) and add eps (2) in place, addcdiv into the parameter (4): 21 x its
    bytes.
    """
    return rf.elementwise(num_params * adamw_bytes_per_param(master_copy, param_bytes, foreach), kernels=4)


def adamw_bytes_per_param(master_copy: bool, param_bytes: int = 4, foreach: bool = False) -> int:
    """Bytes an AdamW step moves per parameter (``optimizer_s``)."""
    return 32 if master_copy else (21 if foreach else 7) * param_bytes
