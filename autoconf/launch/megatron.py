"""**Megatron-LM** (``megatron_args.sh``): a bash array ``MEGATRON_ARGS`` of ``pretrain_gpt.py``
arguments (names as Megatron-LM's ``arguments.py``; the model, parallel and DDP parts become
megatron-core's ``TransformerConfig`` / ``DistributedDataParallelConfig`` fields of the same
names). Any layer split is expressed: even splits by the layer counts, others by
``--pipeline-model-parallel-layout`` (one ``|``-separated entry per virtual stage, in
megatron-core's order ``vp_rank * pp + pp_rank``, which is autoconf's chunk order).
Context parallelism: ``--context-parallel-size``, ``--cp-comm-type p2p`` (the ring the plan
priced); FP8: ``--fp8-format hybrid --fp8-recipe tensorwise|delayed|mxfp8`` (Transformer Engine).
Mixture of experts (:func:`megatron_moe_args`): ``--num-experts`` (TransformerConfig.num_moe_experts),
``--moe-router-topk``, ``--moe-ffn-hidden-size``, ``--moe-shared-expert-intermediate-size``,
``--moe-layer-freq`` (an int, or megatron-core's 0/1 list when the first blocks are dense),
``--moe-router-score-function``, ``--moe-token-dispatcher-type alltoall`` (``flex
--moe-flex-dispatcher-backend deepep`` for DeepEP), ``--moe-grouped-gemm``,
``--expert-model-parallel-size``, ``--moe-expert-capacity-factor``, ``--moe-router-num-groups``
/ ``--moe-router-group-topk``, ``--overlap-moe-expert-parallel-comm``. megatron-core's wheel has no
``arguments.py``: these names are its TransformerConfig fields with dashes (Megatron-LM's
convention), --num-experts being Megatron-LM's name for ``num_moe_experts``.

No import of the framework here.
"""

from __future__ import annotations

from autoconf.launch.gaps import MEGATRON_FP8_RECIPES, MEGATRON_RANK_ORDERS, _knob, _layout, _notes, _order
from autoconf.launch.shell import array, comment_line
from autoconf.specs.frameworks import framework as framework_model


def megatron_args(plan) -> list:
    """``pretrain_gpt.py`` arguments for the plan (flat list of words)."""
    c, m = plan.config, plan.model
    a = ["--tensor-model-parallel-size", c.tp, "--pipeline-model-parallel-size", c.pp,
         "--micro-batch-size", c.micro_batch_size, "--global-batch-size", c.global_batch]
    if c.cp > 1:  # the ring (Transformer Engine's p2p), as the plan priced it
        a += ["--context-parallel-size", c.cp, "--cp-comm-type", "p2p"]
    even = c.stage_layers is None and m.num_layers % c.num_chunks == 0
    if c.pp > 1 and not even:
        a += ["--pipeline-model-parallel-layout", _layout(plan)]
    elif c.virtual_stages > 1:
        a += ["--num-layers-per-virtual-pipeline-stage", m.num_layers // c.num_chunks]
    a += MEGATRON_RANK_ORDERS.get(_order(c), [])
    if c.sequence_parallel:
        a.append("--sequence-parallel")
    if c.recompute == "selective":
        a += ["--recompute-granularity", "selective"]
        if c.recompute_modules:  # Megatron-LM's default list is the attention core alone
            a += ["--recompute-modules", *c.recompute_modules]
    elif c.recompute == "full":  # every block's input kept, the block recomputed: autoconf's "full"
        a += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", 1]
    if c.zero_stage == 1:
        a.append("--use-distributed-optimizer")
    elif c.zero_stage == 3:  # Megatron FSDP, fully sharded; it runs without the fused wgrad accumulation
        a += ["--use-distributed-optimizer", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
              "optim_grads_params", "--no-gradient-accumulation-fusion"]
    for knob in ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap"):
        if _knob(plan, "megatron", knob) and (knob != "overlap_param_gather" or c.zero_stage in (1, 3)):
            a.append("--" + knob.replace("_", "-"))  # the parameter gather exists with the distributed optimizer
    a += ["--num-layers", m.num_layers, "--hidden-size", m.hidden_size, "--num-attention-heads",
          m.num_attention_heads, "--ffn-hidden-size", m.ffn_hidden_size, "--seq-length", m.seq_length,
          "--max-position-embeddings", m.seq_length]
    if m.num_kv_heads != m.num_attention_heads:
        a += ["--group-query-attention", "--num-query-groups", m.num_kv_heads]
    if m.activation == "swiglu":
        a.append("--swiglu")
    a += ["--normalization", "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm"]
    a += ["--position-embedding-type", "rope" if m.position_embedding == "rope" else "learned_absolute"]
    if not m.tied_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    if not m.bias:
        a.append("--disable-bias-linear")
    a += ["--attention-dropout", m.dropout, "--hidden-dropout", m.dropout]
    a += ["--attention-backend", "flash" if m.attention == "flash" else "unfused"]
    if m.dtype in ("bf16", "fp16"):
        a.append(f"--{m.dtype}")
    if c.precision == "fp8" and c.fp8_recipe in MEGATRON_FP8_RECIPES:  # E4M3 forward, E5M2 gradients
        a += ["--fp8-format", "hybrid", "--fp8-recipe", c.fp8_recipe]
        if framework_model(plan.framework).fp8_param_gather:  # the recipe's FP8 parameters, as priced
            a.append("--fp8-param-gather")
    return a + megatron_moe_args(plan) + megatron_attention_args(plan)


def moe_layer_pattern(m) -> list[int]:
    """megatron-core's moe_layer_freq list: 1 for a mixture-of-experts block, 0 for a dense one."""
    return [int(m.is_moe_layer(i)) for i in range(m.num_layers)]


def megatron_moe_args(plan) -> list:
    """The mixture-of-experts arguments ([] for a dense model). megatron-core's integer
    moe_layer_freq N makes block i an MoE block when i % N == 0, so dense first blocks need its
    list form (``--moe-layer-freq`` takes a Python list expression in Megatron-LM). Tokens go
    through the dispatcher the plan priced (the all-to-all one, or the flex one on DeepEP's
    kernels), its all-to-alls under the other micro-batch's work with ``ep_comm_overlap``
    (``--overlap-moe-expert-parallel-comm``), group-limited routing as the model has it
    (``--moe-router-num-groups`` / ``--moe-router-group-topk``), and each rank's experts run as
    one grouped GEMM. Without a capacity factor megatron-core is dropless;
    with one it drops the lowest-probability tokens beyond each expert's capacity (its default
    policy) without padding to it. The experts' tensor-parallel size is the plan's ``expert_tp``
    (1: whole experts, the expert-parallel group folded over tp), else megatron-core's default, tp."""
    c, m = plan.config, plan.model
    if not m.is_moe:
        return []
    a = ["--num-experts", m.num_experts, "--moe-router-topk", m.experts_per_token, "--moe-ffn-hidden-size", m.expert_ffn]
    if m.num_shared_experts:  # megatron-core's one shared MLP of num_shared x width
        a += ["--moe-shared-expert-intermediate-size", m.num_shared_experts * m.shared_expert_ffn]
    freq = m.moe_layer_freq if m.first_dense_layers == 0 else \
        "[" + ",".join(map(str, moe_layer_pattern(m))) + "]"
    a += ["--moe-layer-freq", freq, "--moe-router-score-function", m.router]
    if c.ep > 1 and c.moe_dispatcher == "deepep":  # megatron-core's flex dispatcher on DeepEP's kernels
        a += ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"]
    else:
        a += ["--moe-token-dispatcher-type", "alltoall"]
    a.append("--moe-grouped-gemm")
    if c.ep > 1:
        a += ["--expert-model-parallel-size", c.ep]
        if c.expert_tp is not None:
            a += ["--expert-tensor-parallel-size", c.expert_tp]
    if _knob(plan, "megatron", "ep_comm_overlap"):  # combined 1F1B: all-to-alls under the other micro-batch
        a.append("--overlap-moe-expert-parallel-comm")
    if c.moe_capacity_factor is not None:
        a += ["--moe-expert-capacity-factor", f"{c.moe_capacity_factor:g}"]
    if m.group_limited:  # group-limited routing (node-limited where the groups are hosts)
        a += ["--moe-router-num-groups", m.router_groups, "--moe-router-group-topk", m.router_group_topk]
    if m.router_bias:  # DeepSeek-V3's e_score_correction_bias (megatron-core: sigmoid routers only)
        a.append("--moe-router-enable-expert-bias")
    if m.shared_expert_gate:
        a.append("--moe-shared-expert-gate")
    return a


def megatron_attention_args(plan) -> list:
    """Attention variants in megatron-core's spelling (TransformerConfig / MLATransformerConfig
    fields): multi-head latent attention (``multi_latent_attention``, ``q_lora_rank``,
    ``kv_lora_rank``, ``qk_head_dim`` (the no-rope part), ``qk_pos_emb_head_dim``, ``v_head_dim``),
    per-head Q/K norms (``qk_layernorm``; with MLA it norms the query and key/value latents, as
    DeepSeek's models do), sliding windows (``window_size`` (w, 0): w keys back, none
    ahead; ``window_attn_skip_freq`` N: every N-th block full attention)."""
    m = plan.model
    a = []
    if m.is_mla:
        a += ["--multi-latent-attention", "--kv-lora-rank", m.kv_lora_rank, "--qk-head-dim", m.qk_nope_head_dim,
              "--qk-pos-emb-head-dim", m.qk_rope_head_dim, "--v-head-dim", m.v_head_dim]
        if m.q_lora_rank:
            a += ["--q-lora-rank", m.q_lora_rank]
    if m.qk_norm or m.is_mla:  # MLA's latent norms: megatron-core norms the latents only with it
        a.append("--qk-layernorm")
    if m.sliding_window is not None:
        a += ["--window-size", f"{m.sliding_window},0"]
        if m.full_attention_every:
            a += ["--window-attn-skip-freq", m.full_attention_every]
    return a


def megatron_file(plan, header: str) -> str:
    """``megatron_args.sh``: comment lines (``header``: the plan in words), then ``MEGATRON_ARGS``."""
    args = megatron_args(plan)
    te = "Transformer Engine's"
    lines = [f"Megatron-LM pretrain_gpt.py arguments. {header}", "Sourced by node-K.sh, which runs",
             '  torchrun ... "$MEGATRON_LM/pretrain_gpt.py" "${MEGATRON_ARGS[@]}" "$@"',
             f"Give your data, tokenizer (vocabulary {plan.model.vocab_size}), optimizer, schedule and checkpoint "
             "arguments after the script: bash node-0.sh --data-path ... --tokenizer-type ... --lr ... --train-iters ..."]
    if "--tp-comm-overlap" in args:
        lines.append(f"--tp-comm-overlap runs on {te} userbuffers: install transformer-engine.")
    if {"--context-parallel-size", "--fp8-format"} & set(args):
        lines.append(f"Context parallelism and FP8 run in {te} layers: install transformer-engine.")
    if plan.model.is_moe:
        lines.append(f"--moe-grouped-gemm runs the experts in {te} grouped linear layers: install transformer-engine.")
    return "".join(comment_line(t) + "\n" for t in lines) + _notes(plan, "megatron") + array("MEGATRON_ARGS", args)
