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

from dataclasses import dataclass

from autoconf.cost.activations import checkpointed_matmuls, op_checkpoint_applies
from autoconf.cost.attention import attention_core_times
from autoconf.cost.fp8 import Fp8, fp8_gemm, quantize_times
from autoconf.cost.roofline import LayerTimes, Roofline
from autoconf.specs.frameworks import HostCost
from autoconf.specs.model import ModelSpec


def dispatch_op_counts(model: ModelSpec, tp: int, sp: bool) -> tuple[int, int]:
    """ATen operations ``autoconf.trainer.layers.Block`` dispatches in its forward and in its backward (views
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
    """Bytes and kernels that ``autoconf.trainer.layers.Block``'s eager element-wise code moves beyond the fused
    kernels :func:`block_times` prices by default (forward extra, backward extra, forward kernels,
    backward kernels), tallied op by op from the code (read + write of every operand; per-token
    vectors such as 1/rms are negligible). ``e`` is the model's element size, fp32 is 4 bytes.

    - RMSNorm (``RMSNormFn``), per element of each norm's input: forward cast to fp32 (e + 4),
      square (8), mean (4), scale by 1/rms (8), cast back (4 + e), times the weight (2e), against a
      fused kernel's 2e; backward (recompute x-hat: cast and scale, 4 + e + 8; cast the gradient,
      4 + e; g * x-hat, 12; its sum over tokens, 4; g * w, 8; (g w) * x-hat, 12; its mean, 4; x-hat
      times it, 8; the difference, 12; times 1/rms, 8; cast back, 4 + e) against 4e. Without a cast
      (fp32 models) the casts' kernels and bytes drop out.
    - Rotary embedding (``rope``) on Q and K, per rotated element: x cos (2e), the negated half
      (e), the concatenation (2e), x sin (2e), the sum (3e): 10e against 2e, and as many in the
      backward (the same products, the concatenation's split and the two gradients' sum) against
      4e; V is copied to a contiguous tensor (2e forward). Partial rotary concatenates the rotated
      part with the rest (2e per head element), and its backward zero-fills each slice's gradient to
      full width and adds the two (6e). Not under multi-head latent attention (not in autoconf.trainer.layers).
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
                modules: tuple = (), op_checkpoint: bool = False) -> LayerTimes:
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
    activation and QKV split run as ``autoconf.trainer.layers``'s eager torch operations
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
    op_sac = recompute == "selective" and op_checkpoint and moe is None and op_checkpoint_applies(model)
    mods = set(modules or ("core_attn",)) if recompute == "selective" and not op_sac else set()
    rc = fwd if recompute == "full" else att_f if "core_attn" in mods else 0.0
    if op_sac:  # torchtitan's per-op policy: every second matmul and every element-wise op again
        rc = op_checkpoint_recompute_s(model, T, tp, rf, fp8) + ew_f + qf / 2
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


def op_checkpoint_recompute_s(model: ModelSpec, T: float, tp: int, rf: Roofline, fp8: Fp8 | None) -> float:
    """The matmuls torchtitan's per-op selective checkpointing re-runs in a dense block's backward
    (``activations.checkpointed_matmuls``: the 2nd, 4th, ... in call order), each a GEMM of the
    block input's width into its output width (wo: from the attention output)."""
    h, B = model.hidden_size, model.dtype_bytes
    k_of = {"wo": model.attn_out_size / tp, "w2": model.ffn_hidden_size / tp}  # row-parallel: from a shard
    out = 0.0
    for i, (name, width) in enumerate(checkpointed_matmuls(model, tp)):
        if i % 2 == 1:
            k = k_of.get(name, h)
            out += fp8_gemm(fp8.rf, T, width, k) if fp8 is not None else rf.gemm(T, width, k, B)
    return out


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
"""As ``EDGE_OPS``, counted as ``dispatch_op_counts`` on ``autoconf.trainer.layers``'s Embedding and Head."""


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
