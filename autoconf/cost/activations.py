"""Activation memory: bytes kept for the backward pass, per micro-batch and per tensor-parallel rank.

Pure Python (no torch). The source of truth is Korthikanti et al., "Reducing Activation Recomputation
in Large Transformer Models" (arXiv 2205.05198), section 4, for a GPT block in 16-bit with eager
attention, dropout, GeLU MLP (f = 4h), multi-head attention and 1-byte dropout masks:

    no parallelism           s*b*h*(34 + 5*a*s/h)
    tensor parallel t        s*b*h*(10 + 24/t + 5*a*s/(h*t))
    tensor + sequence par.   s*b*h/t*(34 + 5*a*s/h)
    selective recompute      the 5*a*s/h term disappears (the attention core is recomputed)
    full recompute           2*s*b*h (2*s*b*h/t with sequence parallelism): the block's input

Generalised here, term by term, to what autoconf.trainer.layers.Block really saves (measured with
profiler.memory, tests/test_nn.py, tests/test_hf_models.py): grouped-query attention, heads of
any width (q = a x head width, h unless ``head_dim`` says otherwise), gated MLPs (SwiGLU, GeGLU),
RMSNorm, parallel attention (one or two norms), fused (flash) attention, dropout 0, any precision,
and the small per-token norm statistics. Notation: s sequence, b micro-batch, h hidden, a heads,
q = a x head dim, kv = kv heads x head dim, f ffn width, t = tp, e = bytes per activation element,
m = bytes per dropout-mask element.

What differs from the paper on CPU (and why the arguments exist): PyTorch's CPU dropout keeps its
mask at the activation's precision (m = e, the paper assumes m = 1 as on CUDA), and CPU LayerNorm
keeps mean and 1/std at the activation's precision (fp32 on CUDA) -- ``norm_stat_bytes``.
"""

from __future__ import annotations

from autoconf.specs.model import ModelSpec

RECOMPUTE = ("none", "selective", "full")
INDEX_BYTES = 8  # int64 token ids / target indices
LSE_BYTES = 4  # flash attention's logsumexp is fp32
RMS_STAT_BYTES = 4  # autoconf.trainer.layers's RMSNorm keeps 1/rms in fp32 (as fused Apex / TE kernels do)
LOSS_BYTES = 4  # the cross entropy runs in fp32 and keeps the fp32 softmax


def _norm_stat_bytes(model: ModelSpec, mask_bytes: int, norm_stat_bytes: int | None) -> float:
    """Bytes of norm statistics per token and norm: LayerNorm keeps mean and 1/std, RMSNorm 1/rms.

    By default LayerNorm statistics are fp32 (CUDA) when mask_bytes == 1, else at mask_bytes, i.e. the
    activation precision (CPU kernels keep them so).
    """
    if model.norm == "rmsnorm":
        return RMS_STAT_BYTES
    per = norm_stat_bytes if norm_stat_bytes is not None else (4 if mask_bytes == 1 else mask_bytes)
    return 2 * per


def _check(micro_batch_size: int, tp: int, recompute: str = "none") -> None:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}; valid: {', '.join(RECOMPUTE)}")
    if micro_batch_size < 1 or tp < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} and tp={tp} must be positive")


def mlp_hidden_rows(model: ModelSpec, fused_glu: bool = False) -> int:
    """f-wide tensors per token the MLP keeps for the backward: the up projection's output (the
    activation's input) and the activation's output (the down projection's input), 2; a gated MLP
    run as eager operations (autoconf.trainer.layers, torchtitan, Megatron-DeepSpeed's ``swiglu``) keeps the
    fused gate_up output (2f), act(gate) for the product's backward (f) and the product (f), 4;
    ``fused_glu``, one autograd function that saves only its 2f input (Megatron-LM's
    ``bias_swiglu_impl`` / ``bias_geglu_impl``, on unless ``--no-bias-swiglu-fusion``) and
    recomputes act(gate) in its backward, 3. (Megatron-DeepSpeed's eager ``swiglu`` keeps 4; the
    GPU development set, Megatron-DeepSpeed priced as ``megatron``, is GeLU, where both keep 2.)"""
    if not model.gated_mlp:
        return 2
    return 3 if fused_glu else 4


def _no_recompute_parts(model: ModelSpec, b: int, t: int, sp: bool, mask_bytes: int,
                        norm_stat_bytes: int | None, selective: bool, fp32_softmax: bool = False,
                        fused_glu: bool = False) -> dict[str, float]:
    """Korthikanti et al. section 4.1 (attention 11sbh + 5as^2b, MLP 19sbh, norms 4sbh), generalised."""
    e, s, h, a = model.dtype_bytes, model.seq_length, model.hidden_size, model.num_attention_heads
    q, f = model.q_size, model.ffn_hidden_size
    tok = s * b  # tokens of tensor-parallel (head- or ffn-sharded) tensors, whose width is divided by t
    rep = tok / t if sp else tok  # tokens of full-width tensors: replicated over TP, or sequence-sharded
    drop = model.dropout > 0
    eager = model.attention == "eager"
    p: dict[str, float] = {}
    # two norms: each keeps its input (the paper's 4sbh), plus small per-token statistics; in a
    # parallel block both norms read the block's input, kept once (and a shared norm is one norm)
    p["norm_inputs"] = (1 if model.parallel_attention else 2) * e * rep * h
    p["norm_statistics"] = model.norms_per_block * rep * _norm_stat_bytes(model, mask_bytes, norm_stat_bytes)
    # input of the fused qkv linear (the norm's output; under SP the saved shard, re-gathered in backward)
    p["qkv_input"] = e * rep * h
    # q, k, v as the attention core keeps them: eager expands k, v to all heads (GQA) before QK^T and AV;
    # fused attention, and selective recompute (the core's inputs), keep them at kv width
    qkv_width = (3 * q) if (eager and not selective) else (q + model.k_size + model.v_size)
    p["qkv"] = e * tok * qkv_width / t
    if model.is_mla:  # each latent's norm input, and its output (the up-projection's input)
        p["mla_latents"] = 2 * e * rep * _mla_latent_width(model)
    if not selective:
        if eager:
            # softmax output (the paper's 2as^2b; fp32 where the softmax runs in fp32); with
            # dropout, its mask and output (as^2b + 2as^2b); without, an fp32 softmax's 16-bit cast
            # is what the weighted sum keeps
            p["attention_softmax"] = (4 if fp32_softmax else e) * a * s * s * b / t
            if fp32_softmax and not drop:
                p["attention_softmax_cast"] = e * a * s * s * b / t
            if drop:
                p["attention_dropout_mask"] = mask_bytes * a * s * s * b / t
                p["attention_dropout_output"] = e * a * s * s * b / t
        else:
            # fused attention keeps its output (shared with the projection's input) and fp32 logsumexp
            p["attention_logsumexp"] = LSE_BYTES * b * a * s / t
    p["projection_input"] = e * tok * model.attn_out_size / t
    if drop:
        p["attention_dropout_mask_out"] = mask_bytes * rep * h
    if not model.shared_norm:  # a shared norm's output is the qkv input, kept once
        p["mlp_input"] = e * rep * h
    # fc1 output = gelu input (f), gelu output = fc2 input (f): the paper's 8sbh + 8sbh at f = 4h;
    # gated: ``mlp_hidden_rows``
    p["mlp_hidden"] = e * tok * mlp_hidden_rows(model, fused_glu) * f / t
    if drop:
        p["mlp_dropout_mask"] = mask_bytes * rep * h
    return p


def checkpointed_matmuls(model: ModelSpec, t: int) -> list[tuple[str, float]]:
    """A dense block's matmuls in the order it calls them, with their output width per token on
    one tp rank: torchtitan's Llama (separate wq, wk, wv; ``w2(silu(w1(x)) * w3(x))``, torchtitan
    0.3.0 ``models/common/attention.py`` and ``feed_forward.py``). A row-parallel projection's
    output (wo, w2) is the partial sum, full width before its reduce-scatter."""
    h, f = model.hidden_size, model.ffn_hidden_size
    mms = [("wq", model.q_size / t), ("wk", model.kv_size / t), ("wv", model.kv_size / t), ("wo", h), ("w1", f / t)]
    if model.gated_mlp:
        mms.append(("w3", f / t))
    return mms + [("w2", h)]


def op_checkpoint_applies(model: ModelSpec) -> bool:
    """Whether :func:`op_checkpoint_parts` describes the block (dense attention with separate
    projections; not multi-head latent attention)."""
    return not model.is_mla


def op_checkpoint_parts(model: ModelSpec, b: int, t: int, sp: bool) -> dict[str, float]:
    """Bytes a dense block keeps per micro-batch under torchtitan's per-operation selective
    checkpointing (``SelectiveAC``, 0.3.0 ``distributed/activation_checkpoint.py``): its policy
    saves the compute-intensive ops' outputs but every second matmul's (a counter per forward:
    the 1st, 3rd, ... are kept), the attention kernel's output and log-sum-exp, and the
    reduce-scatter outputs of tensor parallelism; everything else (norms, rotary, the gated
    activation, the other matmuls) is recomputed from the block's input, which the checkpoint
    keeps."""
    e, s, h, a = model.dtype_bytes, model.seq_length, model.hidden_size, model.num_attention_heads
    tok = s * b
    rep = tok / t if sp else tok
    kept = [w for i, (_, w) in enumerate(checkpointed_matmuls(model, t)) if i % 2 == 0]
    p = {"block_input": e * rep * h, "saved_matmul_outputs": e * tok * sum(kept),
         "attention_output": e * tok * model.attn_out_size / t, "attention_logsumexp": LSE_BYTES * b * a * s / t}
    if t > 1 and sp:  # the projections' reduce-scatters (wo, w2)
        p["reduce_scatter_outputs"] = 2 * e * rep * h
    return p


def _mla_latent_width(model: ModelSpec) -> int:
    """Elements per token of multi-head latent attention's normed latents: the query's (when it
    has a low-rank query) and the keys and values' (the rotary key part is not normed)."""
    return (model.q_lora_rank or 0) + model.kv_lora_rank


def layer_activation_bytes(model: ModelSpec, micro_batch_size: int, tp: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none", mask_bytes: int = 1,
                           norm_stat_bytes: int | None = None, cp: int = 1,
                           fp8_inputs: bool = False, fp32_softmax: bool = False,
                           fused_glu: bool = False, modules: tuple = (), op_checkpoint: bool = False
                           ) -> dict[str, float]:
    """Bytes one transformer block keeps for backward, per micro-batch and per TP rank.

    Korthikanti et al. (arXiv 2205.05198) eq. 1-5 and Table 2, generalised (see the module docstring).
    Returns the named parts and "total" (their sum), plus "recompute_working_bytes", which is *not* a
    part of the total: the activations one block materialises again during its backward when it is
    recomputed -- with "full", everything it would otherwise have kept (the "none" total); with
    "selective", the share of what it recomputes (the attention core, or ``modules``). A schedule's
    peak adds it once (only one block is recomputed at a time). ``mask_bytes``: bytes per
    dropout-mask element, 1 on CUDA, the activation element size on CPU. ``norm_stat_bytes``:
    bytes per LayerNorm statistic (see _norm_stat_bytes).

    ``cp``: the sequence is split over a context-parallel group: every part is per token of the
    rank's s/cp tokens, and the attention core's s x s terms (eager attention) shrink the same way
    (each rank's queries against the keys they see), so everything is divided by cp.
    ``fp8_inputs``: the linear layers keep their inputs for the backward in FP8, 1 byte per
    element (Transformer Engine): the qkv, projection, MLP and down-projection inputs.
    ``fp32_softmax``: eager attention's softmax runs in fp32 and keeps its fp32 output (Megatron's
    fallback from its fused kernel, ``cost.attention.fused_softmax_available``).
    ``fused_glu``: a gated MLP's activation is one autograd function keeping only its input
    (Megatron-LM; ``mlp_hidden_rows``).
    ``op_checkpoint``: "selective" is torchtitan's per-operation policy
    (:func:`op_checkpoint_parts`) where it applies.
    ``modules``: with "selective", what it recomputes (``config.RECOMPUTE_MODULES``; empty: the
    attention core). Megatron-LM's output-discarding recomputation frees a module's output, which
    the backward rebuilds from the inputs kept anyway: "layernorm" the input norm's output where a
    separate linear reads it (MLA's down-projections: elsewhere the norm is fused into the QKV
    linear), "mla_up_proj" MLA's heads' queries, keys and values and the latents' norm outputs
    (Transformer Engine fuses the latent norms into the up-projections: the recomputed region
    keeps only its inputs, the latents, in 16 bits); without "core_attn" the attention core keeps
    what it keeps without recomputation.
    """
    _check(micro_batch_size, tp, recompute)
    sp = bool(sequence_parallel) and tp > 1
    b, t = micro_batch_size, tp
    full = _fp8_saved(model, b, t, _no_recompute_parts(model, b, t, sp, mask_bytes, norm_stat_bytes, selective=False,
                                                       fp32_softmax=fp32_softmax, fused_glu=fused_glu), fp8_inputs)
    full_total = sum(full.values())
    if recompute == "full":
        # only the block's input is kept (checkpoint stores it); sequence-sharded under SP
        rep = model.seq_length * b / t if sp else model.seq_length * b
        parts = {"block_input": model.dtype_bytes * rep * model.hidden_size}
        working = full_total
    elif recompute == "selective" and op_checkpoint and op_checkpoint_applies(model):
        parts = op_checkpoint_parts(model, b, t, sp)
        working = max(0.0, full_total - sum(parts.values()))
    elif recompute == "selective":
        mods = set(modules or ("core_attn",))
        parts = _fp8_saved(model, b, t, _no_recompute_parts(model, b, t, sp, mask_bytes, norm_stat_bytes,
                                                             selective="core_attn" in mods, fused_glu=fused_glu,
                                                             fp32_softmax=fp32_softmax), fp8_inputs)
        if model.is_mla and "layernorm" in mods:
            parts.pop("qkv_input", None)
        if model.is_mla and "mla_up_proj" in mods:  # rebuilt from the latents, kept as they come (16-bit)
            parts.pop("qkv", None)
            rep = model.seq_length * b / t if sp else model.seq_length * b
            parts["mla_latents"] = model.dtype_bytes * rep * _mla_latent_width(model)
        working = full_total - sum(parts.values())
    else:
        parts, working = full, 0.0
    out = {k: v / cp for k, v in parts.items()}
    out["total"] = float(sum(parts.values())) / cp
    out["recompute_working_bytes"] = float(working) / cp
    return out


def _fp8_saved(model: ModelSpec, b: int, t: int, parts: dict, fp8_inputs: bool) -> dict:
    """``parts`` with the linear layers' saved inputs at 1 byte per element (``fp8_inputs``)."""
    if not fp8_inputs:
        return parts
    e = model.dtype_bytes
    out = dict(parts)
    for k in ("qkv_input", "projection_input", "mlp_input"):
        if k in out:
            out[k] = out[k] / e
    if "mla_latents" in out:  # the up-projections' inputs (half of the part) in FP8
        out["mla_latents"] -= out["mla_latents"] / 2 * (e - 1) / e
    if "mlp_hidden" in out:  # the down projection's input (f wide) is one of the kept tensors
        out["mlp_hidden"] -= (e - 1) * model.seq_length * b * model.ffn_hidden_size / t
    return out


def block_backward_temporary_bytes(model: ModelSpec, micro_batch_size: int, tp: int = 1) -> float:
    """Gradient tensors one block's backward holds on top of its activations, per TP rank.

    Autograd frees each saved activation once its node's backward is through, but the gradients
    flowing between nodes are new tensors. The largest moment is the MLP's: the gradient w.r.t.
    the down projection's input (f wide) is alive while the element-wise activation's backward
    writes the gradient w.r.t. the up projection's output (f wide, 2f fused gate_up when gated),
    and the up projection's weight gradient is a fresh tensor until it is added into ``.grad``
    (every micro-batch after the first). So e*s*b*(f_up + f)/t + e*h*f_up/t, f_up = f, or 2f for
    the gated SwiGLU / GeGLU (measured with MemTracker: bench-h256 fp32, 2.0 MiB at b = 1 against
    2.6 observed).
    """
    _check(micro_batch_size, tp)
    e, s, h, f = model.dtype_bytes, model.seq_length, model.hidden_size, model.ffn_hidden_size
    f_up = 2 * f if model.gated_mlp else f
    return float(e * s * micro_batch_size * (f_up + f) / tp + e * h * f_up / tp)


def head_activation_parts(model: ModelSpec, micro_batch_size: int, tp: int = 1, sequence_parallel: bool = False,
                          mask_bytes: int = 1, norm_stat_bytes: int | None = None) -> dict[str, float]:
    """Bytes the last stage's head keeps: final norm, output projection input, fp32 softmax of the loss.

    As autoconf.trainer.layers.Head with the vocab-parallel cross entropy (Megatron-LM's, in fp32): the norm's
    input and statistics (sequence-sharded under SP), the projection's input (its shard under SP, the
    full sequence otherwise), the fp32 softmax over this rank's vocabulary shard (4*s*b*Vp/t, Vp the
    vocabulary padded to a multiple of t), the local target index (int64) and its mask (bool). The
    logits themselves are not kept by autograd; "loss_working_bytes" (not part of the total) is their
    transient peak during the loss (logits + fp32 copy, e + 4 bytes per element) -- a pipeline
    schedule that holds the stage output until backward keeps e*s*b*Vp/t more. No dropout in the head:
    ``mask_bytes`` only picks the default norm statistic size.
    """
    _check(micro_batch_size, tp)
    sp = bool(sequence_parallel) and tp > 1
    e, s, h, b, t = model.dtype_bytes, model.seq_length, model.hidden_size, micro_batch_size, tp
    tok = s * b
    rep = tok / t if sp else tok
    vp = -(-model.vocab_size // t) * t
    p = {
        "final_norm_input": e * rep * h,
        "norm_statistics": rep * _norm_stat_bytes(model, mask_bytes, norm_stat_bytes),
        "output_input": e * rep * h,
        "loss_softmax": LOSS_BYTES * tok * vp / t,
        "loss_targets": tok * (INDEX_BYTES + 1),
    }
    out = dict(p)
    out["total"] = float(sum(p.values()))
    out["loss_working_bytes"] = float((e + LOSS_BYTES) * tok * vp / t)
    return out


def head_activation_bytes(model: ModelSpec, micro_batch_size: int, tp: int = 1, sequence_parallel: bool = False,
                          mask_bytes: int = 1, norm_stat_bytes: int | None = None) -> float:
    """Total of head_activation_parts (final norm + output projection + fp32 loss softmax)."""
    return head_activation_parts(model, micro_batch_size, tp, sequence_parallel, mask_bytes, norm_stat_bytes)["total"]


def embedding_activation_parts(model: ModelSpec, micro_batch_size: int, tp: int = 1,
                               sequence_parallel: bool = False, mask_bytes: int = 1) -> dict[str, float]:
    """Bytes the first stage's embedding keeps: the token indices of the lookup (int64, 8*s*b), and with
    tp > 1 the local indices instead plus the out-of-shard mask (bool, s*b). The embedding's output is
    the first block's input and is counted there. No dropout after the embedding in autoconf.trainer.layers.
    """
    _check(micro_batch_size, tp)
    tok = model.seq_length * micro_batch_size
    p = {"token_indices": float(INDEX_BYTES * tok)}
    if tp > 1:
        p["vocab_mask"] = float(tok)
    out = dict(p)
    out["total"] = float(sum(p.values()))
    return out


def embedding_activation_bytes(model: ModelSpec, micro_batch_size: int, tp: int = 1,
                               sequence_parallel: bool = False, mask_bytes: int = 1) -> float:
    """Total of embedding_activation_parts (token indices, and the vocab mask with tp > 1)."""
    return embedding_activation_parts(model, micro_batch_size, tp, sequence_parallel, mask_bytes)["total"]
