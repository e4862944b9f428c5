"""What each training framework's own launcher reads, for a launch plan, and what it cannot express.

- **Megatron-LM** (``megatron_args.sh``): a bash array ``MEGATRON_ARGS`` of ``pretrain_gpt.py``
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
- **torchtitan**: 0.3 reads no file; its configuration is a Python function of a model module
  (``--module llama3 --config llama3_8b``) plus command-line overrides, which
  ``torchtitan_args.sh`` holds (``TORCHTITAN_ARGS``, ``TORCHTITAN_AC``). 0.2 read a TOML file
  (``--job.config_file``): ``torchtitan.toml`` has the same settings in that form. Layers per
  stage are given exactly as ``module_fqns_per_model_part`` (the Llama module names of that version).
  Context parallelism: ``parallelism.context_parallel_degree`` (head-tail load balancing; 0.2 also
  ``context_parallel_rotate_method = "allgather"``); ``compile.enable`` always set to the plan's
  value. FP8: 0.2 by ``[model] converters`` and ``[quantize.linear.float8]`` / ``[quantize.linear.mx]``
  (tensorwise with FSDP gathers the weights in FP8); 0.3 takes quantisation from the config function
  only (its ``model_spec`` is not a command-line setting), so ``torchtitan_args.sh`` names the
  converter that function must apply (:func:`torchtitan_converter`). Mixture of experts:
  ``parallelism.expert_parallel_degree`` (0.2 also ``expert_tensor_parallel_degree`` = tp, the
  plan's experts split tp ways); the MoE blocks themselves (experts, top-k, router, shared
  experts, dense first blocks) come from the config function / model flavor, which the files
  name (:func:`torchtitan_moe_text`). torchtitan routes dropless (no capacity factor); 0.3's
  experts are not tensor-parallel under EP (its ep group takes the tp ranks first).
- **DeepSpeed** (``ds_config.json``): batch sizes, ZeRO stage, precision, ``overlap_comm``,
  AutoTP's degree; ``"_autoconf"`` holds the notes (DeepSpeed ignores keys it does not know).
  Its mixture of experts is a layer of the model code (``deepspeed.moe.layer.MoE(..., ep_size,
  k)``), nothing in ds_config.json: a gap line says what that layer must be given.

No import of any of these libraries here.
"""

from __future__ import annotations

import json

from .frameworks import framework as framework_model
from .launch import comment, quote
from .placement import full_order

TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B",
                        "breadth_first": "LoopedBFS"}
MEGATRON_RANK_ORDERS = {"tp-cp-dp-pp": [], "tp-cp-pp-dp": ["--use-tp-pp-dp-mapping"]}
"""Megatron-LM's rank orders (megatron-core's "tp-cp-ep-dp-pp", or "tp-cp-ep-pp-dp" with
--use-tp-pp-dp-mapping), as autoconf's full orders (``placement.full_order``)."""
TORCHTITAN_RANK_ORDER = "tp-cp-dp-pp"
"""torchtitan's device mesh: pp, dp (replicate, shard), cp, tp (tp innermost)."""


def _order(c) -> str:
    return "-".join(full_order(c.rank_order))


def gaps(plan, name: str, version: str = "0.3") -> list[str]:
    """The parts of ``plan`` framework ``name`` cannot express (one line each); [] for the
    reference trainer, which runs every plan. ``version``: torchtitan's (0.3, which the node
    scripts run, or 0.2, ``torchtitan.toml``)."""
    if name == "reference":
        return []
    c, out = plan.config, []
    if c.device_order is not None and list(c.device_order) != list(range(c.world_size)):
        out.append(f"the per-GPU placement (device_order {','.join(map(str, c.device_order))}): {name} gives "
                   "rank r to the process on device r (launch order), so the plan's device order is not applied "
                   "and its predicted step time assumed it")
    if name == "megatron" and _order(c) not in MEGATRON_RANK_ORDERS:
        out.append(f"rank order {c.rank_order}: Megatron-LM orders ranks tp-cp-dp-pp (or tp-cp-pp-dp)")
    if name == "torchtitan" and _order(c) != TORCHTITAN_RANK_ORDER:
        out.append(f"rank order {c.rank_order}: torchtitan's device mesh is pp, dp, cp, tp (tp innermost)")
    if name == "deepspeed" and c.stage_layers is not None and c.pp > 1:
        out.append(f"the layer split {'/'.join(map(str, c.stage_layers))}: DeepSpeed's PipelineModule partitions "
                   "by 'uniform', 'parameters' or layer type, not by given counts")
    if c.layered_grad_accum and c.schedule != "breadth_first":
        out.append(f"layered gradient accumulation: {name} runs micro-batch by micro-batch")
    if c.dp_all_reduce != "flat":
        out.append(f"the hierarchical data-parallel all-reduce: {name} runs NCCL's own")
    if c.schedule not in framework_model(name).schedules and c.pp > 1:
        out.append(f"the {c.schedule} schedule: {name} has {', '.join(framework_model(name).schedules)}")
    fp8 = c.precision == "fp8"
    if name == "megatron" and fp8 and c.fp8_recipe not in MEGATRON_FP8_RECIPES:
        out.append(f"{c.fp8_recipe} FP8 scaling: Megatron-LM's --fp8-recipe has "
                   f"{', '.join(MEGATRON_FP8_RECIPES)} (and blockwise); the run needs another recipe")
    if name == "torchtitan" and fp8 and c.fp8_recipe not in TORCHTITAN_FP8_RECIPES[version]:
        out.append(f"{c.fp8_recipe} FP8 scaling"
                   + (" (and the FP8 all-gather of FSDP weights the plan assumed)"
                      if c.fp8_recipe == "tensorwise" and c.zero_stage >= 2 else "")
                   + f": torchtitan {version} has {', '.join(TORCHTITAN_FP8_RECIPES[version])}"
                   + (" (its Float8LinearConverter's recipe_name is rowwise or rowwise_with_gw_hp); torchtitan 0.2 "
                      "runs tensorwise (torchtitan.toml)" if version == "0.3" and c.fp8_recipe == "tensorwise" else ""))
    if (name == "torchtitan" and version == "0.2" and fp8 and c.fp8_recipe == "mxfp8" and c.tp > 1
            and _titan_compile(plan)):
        out.append("MXFP8 with tensor parallelism under torch.compile: torchtitan 0.2's MX converter refuses "
                   "the combination (TP not yet supported with torch.compile for mxfp8)")
    if name == "torchtitan" and c.torch_compile is False and _knob(plan, name, "tp_comm_overlap"):
        out.append("torch_compile off with tp_comm_overlap: torchtitan's asynchronous TP runs only compiled, "
                   "so the files switch compile on")
    if name in ("megatron", "deepspeed") and c.torch_compile:
        out.append(f"torch.compile: {name} runs the model eagerly")
    if plan.model.is_moe:
        out += _moe_gaps(plan, name, version)
    out += _compression_gaps(c, name)
    if name == "deepspeed":
        if c.cp > 1:
            out.append(f"context parallelism (cp={c.cp}): ds_config.json has none (DeepSpeed's Ulysses sequence "
                       "parallelism is another scheme, set up in the model's code), so each rank would hold whole "
                       "sequences")
        if fp8:
            out.append(f"FP8 matmuls ({c.fp8_recipe} scaling): ds_config.json has no FP8 training; the linear "
                       "layers run in the model's dtype unless the model itself uses Transformer Engine / torchao")
        if c.sequence_parallel:
            out.append("sequence parallelism: DeepSpeed's AutoTP shards the linear layers only")
        if c.recompute == "selective":
            out.append("selective recomputation: DeepSpeed recomputes what the model wraps in "
                       "deepspeed.checkpointing.checkpoint (whole blocks); recompute the attention core there")
    return out


def _compression_gaps(c, name: str) -> list[str]:
    """Optimus-CC's compressed traffic: only the reference trainer runs it."""
    out = []
    if c.pp_compression != "none":
        out.append(f"compressed pipeline gradients (pp_compression {c.pp_compression}, rank {c.pp_compression_rank}): "
                   f"{name} sends every activation gradient exactly, so the pipeline transfers take their full "
                   "time (the plan's step time assumed them compressed)")
    if c.dp_compression_stages:
        alt = {"deepspeed": " (DeepSpeed's 1-bit Adam / 0/1 Adam compress through the optimizer instead: "
                            "another algorithm, not priced here)",
               "torchtitan": " (torch's powerSGD_hook needs a DDP module; torchtitan's data parallelism is "
                             "FSDP2 or replicate without a comm-hook setting)"}.get(name, "")
        out.append(f"PowerSGD on the data-parallel gradients of pipeline ranks 0..{c.dp_compression_stages - 1} "
                   f"(rank {c.dp_compression_rank}): {name} reduces them exactly{alt}")
    if c.fused_embedding_sync:
        out.append(f"the fused embedding sync: {name} sums the tied embedding over the first and last stage, then "
                   "over the replicas")
    return out


def _moe_gaps(plan, name: str, version: str) -> list[str]:
    """What framework ``name`` cannot express of the plan's mixture of experts."""
    c, m, out = plan.config, plan.model, []
    cf = c.moe_capacity_factor
    if name == "megatron" and m.bias and c.tp > 1:
        out.append("expert biases with tp > 1: megatron-core's MoE has biases only with expert_tensor_parallel_size "
                   "1, and the plan splits the experts tp ways")
    if name == "torchtitan":
        if c.ep > 1 and c.moe_dispatcher == "deepep" and version != "0.3":
            out.append("the DeepEP token dispatcher: torchtitan 0.2 dispatches with all-to-alls only (0.3 has "
                       "DeepEPTokenDispatcher)")
        if m.group_limited and m.experts_per_token // m.router_group_topk != 2:
            out.append(f"group-limited routing scores a group by its top {m.experts_per_token // m.router_group_topk} "
                       "experts (Megatron-LM, the reference trainer); torchtitan's router always by its top 2")
        if cf is not None:
            out.append(f"the capacity factor {cf:g}: torchtitan's token-choice router is dropless (every token "
                       "reaches its top-k experts), so no token is dropped and expert loads are the router's")
        shard = c.dp if c.zero_stage >= 1 else 1  # data_parallel_shard_degree (_titan_dp)
        if c.ep > 1 and version == "0.3" and c.tp > 1:
            out.append(f"expert parallelism with tp={c.tp}: torchtitan 0.3's experts are not tensor-parallel under "
                       "EP and its expert-parallel group takes the tp ranks first (efsdp = dp_shard x cp x tp / ep); "
                       "the plan's lies inside dp x cp with each expert split tp ways (torchtitan 0.2: "
                       "expert_tensor_parallel_degree = tp)")
        elif c.ep > 1 and (shard * c.cp) % c.ep:
            out.append(f"expert parallelism ep={c.ep} over dp x cp with zero_stage {c.zero_stage}: torchtitan's "
                       f"expert-parallel ranks lie inside data_parallel_shard_degree x cp ({shard} x {c.cp}); "
                       "replicated (DDP) data-parallel ranks cannot hold different experts")
    if name == "deepspeed":
        moe = (f"deepspeed.moe.layer.MoE(hidden_size={m.hidden_size}, expert=<an MLP of width {m.expert_ffn}>, "
               f"num_experts={m.num_experts}, ep_size={c.ep}, k={m.experts_per_token}, "
               + (f"capacity_factor={cf:g}" if cf is not None else "drop_tokens=False")
               + (", enable_expert_tensor_parallelism=True" if c.tp > 1 else "") + ")")
        out.append(f"the mixture-of-experts blocks ({_moe_blocks(m)}): ds_config.json has no MoE section; DeepSpeed's "
                   f"MoE is a layer of the model code, so build each MoE block's MLP as {moe} and give the optimizer "
                   "deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer")
        if m.router == "sigmoid":
            out.append("the sigmoid router: DeepSpeed's TopKGate scores experts with a softmax")
        if m.num_shared_experts:
            out.append(f"the {m.num_shared_experts} shared expert(s): DeepSpeed's MoE has none (its use_residual is "
                       "PR-MoE's residual MLP mixed by a learned coefficient); add them in the model code")
    return out


def _moe_blocks(m) -> str:
    """Which blocks are mixtures of experts, in words."""
    if m.num_moe_layers == m.num_layers:
        return f"all {m.num_layers} blocks"
    return f"{m.num_moe_layers} of {m.num_layers} blocks: {_moe_pattern_words(m)}"


def _moe_pattern_words(m) -> str:
    parts = []
    if m.first_dense_layers:
        parts.append(f"blocks 0..{m.first_dense_layers - 1} dense")
    parts.append(f"every {'' if m.moe_layer_freq == 1 else _ordinal(m.moe_layer_freq) + ' '}block from "
                 f"{m.first_dense_layers} on a mixture of experts")
    return ", ".join(parts)


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 < 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _knob(plan, name: str, knob: str) -> bool:
    """The knob's value in framework ``name``: the plan's own setting, else that framework's default."""
    return framework_model(name).knob(plan.config, knob)


def _titan_compile(plan) -> bool:
    """Whether the torchtitan run compiles: the plan's torch_compile, or asynchronous TP (which
    torchtitan runs only compiled: ``CompileConfig`` refuses it without ``compile.enable``)."""
    return _knob(plan, "torchtitan", "torch_compile") or _knob(plan, "torchtitan", "tp_comm_overlap")


MEGATRON_FP8_RECIPES = ("tensorwise", "delayed", "mxfp8")
"""megatron-core's TransformerConfig.fp8_recipe values autoconf prices (it also has blockwise, custom)."""
TORCHTITAN_FP8_RECIPES = {"0.3": ("rowwise", "mxfp8"), "0.2": ("tensorwise", "rowwise", "mxfp8")}
"""The FP8 recipes of each torchtitan version: 0.3's Float8LinearConverter takes recipe_name rowwise
(or rowwise_with_gw_hp) only; 0.2's Float8Linear tensorwise (recipe_name unset) or rowwise; both
have MXFP8 (its own converter)."""


def _layout(plan) -> str:
    """Megatron's --pipeline-model-parallel-layout for the plan's chunks (E: embedding, t: a
    block, L: the loss; one entry per chunk in chunk order)."""
    counts = plan.placement.chunk_layer_counts()
    parts = []
    for i, n in enumerate(counts):
        s = ("E" if i == 0 else "") + (f"t*{n}" if n > 1 else "t") + ("L" if i == len(counts) - 1 else "")
        parts.append(s)
    return "|".join(parts)


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
    for knob in ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap"):
        if _knob(plan, "megatron", knob) and (knob != "overlap_param_gather" or c.zero_stage == 1):
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
    policy) without padding to it. The experts' tensor-parallel size is megatron-core's default,
    tp, as the plan splits them."""
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


def _array(name: str, words: list) -> str:
    """A bash array assignment, one option (with its values) per line, every word quoted."""
    lines, cur = [], []
    for w in words:
        if isinstance(w, str) and w.startswith("--") and cur:
            lines.append(cur)
            cur = []
        cur.append(w)
    if cur:
        lines.append(cur)
    return f"{name}=(\n" + "".join("  " + " ".join(quote(w) for w in ln) + "\n" for ln in lines) + ")\n"


def _notes(plan, name: str) -> str:
    missing = gaps(plan, name)
    if not missing:
        return f"# {name} expresses the whole plan.\n"
    return (f"# {name} cannot express, so the run will differ from the plan there:\n"
            + "".join(f"#   - {comment(g)}\n" for g in missing))


def megatron_file(plan, header: str) -> str:
    return (f"# Megatron-LM pretrain_gpt.py arguments. {header}"
            "# Sourced by node-K.sh, which runs\n"
            '#   torchrun ... "$MEGATRON_LM/pretrain_gpt.py" "${MEGATRON_ARGS[@]}" "$@"\n'
            "# Give your data, tokenizer (vocabulary "
            f"{plan.model.vocab_size}), optimizer, schedule and checkpoint arguments after the script: "
            "bash node-0.sh --data-path ... --tokenizer-type ... --lr ... --train-iters ...\n"
            + ("# --tp-comm-overlap runs on Transformer Engine's userbuffers: install transformer-engine.\n"
               if "--tp-comm-overlap" in megatron_args(plan) else "")
            + ("# Context parallelism and FP8 run in Transformer Engine's layers: install transformer-engine.\n"
               if {"--context-parallel-size", "--fp8-format"} & set(megatron_args(plan)) else "")
            + ("# --moe-grouped-gemm runs the experts in Transformer Engine's grouped linear layers: install "
               "transformer-engine.\n" if plan.model.is_moe else "")
            + _notes(plan, "megatron") + _array("MEGATRON_ARGS", megatron_args(plan)))


# -- torchtitan -----------------------------------------------------------------------------------

def _fqns(plan, last: tuple) -> list:
    """Module names of each pipeline chunk (torchtitan's Llama: tok_embeddings, layers.N, norm + output head)."""
    out = []
    chunks = plan.placement.chunk_layers()
    for i, blocks in enumerate(chunks):
        names = (["tok_embeddings"] if i == 0 else []) + [f"layers.{b}" for b in blocks]
        out.append(names + (list(last) if i == len(chunks) - 1 else []))
    return out


def _titan_dp(c) -> dict:
    """Replicate / shard degrees: ZeRO-0 is DDP, ZeRO-3 FSDP, ZeRO-2 FSDP that keeps the
    parameters gathered after forward."""
    if c.zero_stage == 0:
        return {"data_parallel_replicate_degree": c.dp, "data_parallel_shard_degree": 1}
    d = {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": c.dp}
    d["fsdp_reshard_after_forward"] = "never" if c.zero_stage == 2 else "always"
    return d


def torchtitan_settings(plan, version: str = "0.3") -> dict:
    """{section: {key: value}} of torchtitan's configuration (0.3's field names; "0.2": its TOML's)."""
    c, m = plan.config, plan.model
    par = {**_titan_dp(c), "tensor_parallel_degree": c.tp, "pipeline_parallel_degree": c.pp}
    if version == "0.3" and c.tp > 1:
        par["enable_sequence_parallel"] = c.sequence_parallel
    if c.cp > 1:  # head-tail: rank i holds chunks i and 2cp-1-i, the plan's split; keys and values all-gathered
        par.update(context_parallel_degree=c.cp, context_parallel_load_balancer="headtail")
        if version != "0.3":  # 0.3 has no rotate method setting (torch's default, allgather)
            par["context_parallel_rotate_method"] = "allgather"
    if c.ep > 1:  # 0.2's experts are tensor-parallel only with etp = tp (its default etp is 1)
        par["expert_parallel_degree"] = c.ep
        if version != "0.3":
            par["expert_tensor_parallel_degree"] = c.tp
    training = {"seq_len": m.seq_length, "global_batch_size": c.global_batch}
    if c.pp > 1:  # the per-replica batch, split into the pipeline's micro-batches
        training["local_batch_size"] = c.micro_batch_size * c.num_micro_batches
        if version == "0.3":  # 0.3 refuses pipelining with CUDA graphs (its default)
            training["disable_cuda_graphs"] = True
        par.update(pipeline_parallel_schedule=TORCHTITAN_SCHEDULES[c.schedule],
                   pipeline_parallel_microbatch_size=c.micro_batch_size,
                   module_fqns_per_model_part=_fqns(plan, ("norm", "lm_head") if version == "0.3" else ("norm", "output")))
    else:  # one micro-batch per forward, accumulated num_micro_batches times
        training["local_batch_size"] = c.micro_batch_size
    training["mixed_precision_param"] = "float32" if m.dtype == "fp32" else "bfloat16"
    out = {"training": training, "parallelism": par, "compile": {"enable": _titan_compile(plan)}}
    if _knob(plan, "torchtitan", "tp_comm_overlap"):
        if version == "0.3":
            out["compile"]["enable_async_tensor_parallel"] = True
        else:
            par["enable_async_tensor_parallel"] = True
    if version != "0.3":
        out["activation_checkpoint"] = {"mode": c.recompute}
        out.update(_titan02_fp8(c))
    return out


def _titan02_fp8(c) -> dict:
    """torchtitan 0.2's FP8 sections: the converter and its options (the output layer left in the
    model's dtype, as the plan prices it). Tensorwise is Float8Linear without a recipe_name (0.2
    refuses recipe_name with the FP8 all-gather), whose FSDP weights are gathered in FP8."""
    if c.precision != "fp8" or c.fp8_recipe not in TORCHTITAN_FP8_RECIPES["0.2"]:
        return {}
    if c.fp8_recipe == "mxfp8":
        return {"model": {"converters": ["quantize.linear.mx"]}, "quantize.linear.mx": {"filter_fqns": ["output"]}}
    f8 = {"filter_fqns": ["output"]}
    if c.fp8_recipe == "tensorwise":
        fsdp = c.zero_stage >= 2
        f8.update(enable_fsdp_float8_all_gather=fsdp, precompute_float8_dynamic_scale_for_fsdp=fsdp)
    else:
        f8["recipe_name"] = c.fp8_recipe
    return {"model": {"converters": ["quantize.linear.float8"]}, "quantize.linear.float8": f8}


def torchtitan_converter(plan) -> tuple[str, dict] | None:
    """The converter torchtitan 0.3's config function must apply for the plan's FP8 (a class of
    ``torchtitan.components.quantization`` and its ``Config`` fields), or None: 0.3 reads
    quantisation from the model spec the config function builds, not from the command line. The
    output layer (lm_head) stays in the model's dtype."""
    c = plan.config
    if c.precision != "fp8" or c.fp8_recipe not in TORCHTITAN_FP8_RECIPES["0.3"]:
        return None
    if c.fp8_recipe == "mxfp8":
        return "MXFP8LinearConverter", {"fqns": ["layers"], "model_compile_enabled": _titan_compile(plan)}
    return "Float8LinearConverter", {"recipe_name": c.fp8_recipe, "filter_fqns": ["lm_head"],
                                     "model_compile_enabled": _titan_compile(plan)}


def torchtitan_moe_text(plan, version: str = "0.3") -> str:
    """What the config function (0.3) or model flavor (0.2) must build for the plan's mixture of
    experts ("" for a dense model): torchtitan reads the MoE shape from the model's own config,
    not from the command line or the TOML."""
    m = plan.model
    if not m.is_moe:
        return ""
    shared = (f"{m.num_shared_experts} shared expert(s) of width {m.shared_expert_ffn}" if m.num_shared_experts
              else "no shared experts")
    what = (f"{m.num_experts} experts of width {m.expert_ffn}, top-{m.experts_per_token}, {m.router} router, {shared}; "
            f"{_moe_blocks(m)}")
    if version == "0.3":
        return (f"mixture of experts ({what}): TORCHTITAN_CONFIG's blocks must hold torchtitan.models.common.moe."
                f"MoE.Config(num_experts={m.num_experts}, router=TokenChoiceTopKRouter.Config(top_k="
                f"{m.experts_per_token}, score_func={m.router!r}"
                + (f", num_expert_groups={m.router_groups}, num_limited_groups={m.router_group_topk}"
                   if m.group_limited else "")
                + ", ...), routed experts' GroupedExperts.Config(hidden_dim="
                f"{m.expert_ffn})"
                + (f" with token_dispatcher=DeepEPTokenDispatcher.Config(num_max_tokens_per_rank="
                   f"{plan.config.micro_batch_size * m.seq_length // plan.config.cp}, hidden_dim={m.hidden_size}) "
                   "(DeepEP installed)" if plan.config.ep > 1 and plan.config.moe_dispatcher == "deepep" else "")
                + ", shared_experts="
                + (f"FeedForward.Config(hidden_dim={m.num_shared_experts * m.shared_expert_ffn})" if m.num_shared_experts
                   else "None")
                + "); torchtitan's MoE modules: qwen3 (softmax, no shared experts, every block), deepseek_v3 "
                  "(n_dense_layers, num_shared_experts, router_score_func; MLA attention)")
    return (f"mixture of experts ({what}): [model] name / flavor must be a torchtitan MoE model whose MoEArgs has "
            f"num_experts = {m.num_experts}, top_k = {m.experts_per_token}, score_func = {json.dumps(m.router)}, "
            f"num_shared_experts = {m.num_shared_experts}, moe_inter_dim = {m.expert_ffn} "
            f"(deepseek_v3: n_dense_layers = {m.first_dense_layers}; llama4: interleave_moe_layer_step)")


def _converter_text(conv) -> str:
    name, kw = conv
    return f"{name}.Config({', '.join(f'{k}={v!r}' for k, v in kw.items())})"


def torchtitan_args(plan) -> tuple[list, str]:
    """(overrides, activation-checkpoint subcommand) for torchtitan 0.3's command line."""
    words = []
    for section, keys in torchtitan_settings(plan, "0.3").items():
        for key, v in keys.items():
            flag = f"--{section}.{key}".replace("_", "-")
            if isinstance(v, list):  # module_fqns_per_model_part: one comma-joined word per chunk
                words += [flag, *[",".join(x) for x in v]]
            elif isinstance(v, bool):  # tyro's boolean flags: --x / --no-x
                words.append(flag if v else f"--{section}.no-{key}".replace("_", "-"))
            else:
                words += [flag, v]
    return words, f"activation-checkpoint:{plan.config.recompute}"


def torchtitan_args_file(plan, header: str) -> str:
    words, ac = torchtitan_args(plan)
    return (f"# torchtitan 0.3 command-line overrides. {header}"
            "# Sourced by node-K.sh, which runs\n"
            '#   torchrun ... -m torchtitan.train --module "$TORCHTITAN_MODULE" --config "$TORCHTITAN_CONFIG" '
            '"${TORCHTITAN_ARGS[@]}" "$@" "$TORCHTITAN_AC"\n'
            f"# TORCHTITAN_CONFIG: a config function of the module with this model's shape ({comment(_shape(plan))}); "
            "the layer names below are torchtitan's Llama ones.\n"
            + (f"# {comment(torchtitan_moe_text(plan))}\n" if plan.model.is_moe else "")
            + (f"# FP8 ({plan.config.fp8_recipe}): torchtitan 0.3 takes it from the config function, not the command "
               "line: TORCHTITAN_CONFIG's model_registry(..., converters=[...]) must hold "
               f"torchtitan.components.quantization.{_converter_text(torchtitan_converter(plan))}\n"
               if torchtitan_converter(plan) else "")
            + _notes(plan, "torchtitan") + _array("TORCHTITAN_ARGS", words)
            + f"TORCHTITAN_AC={quote(ac)}\n")


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a TOML basic string
    return "[" + ", ".join(_toml_value(x) for x in v) + "]"


def torchtitan_toml(plan, header: str) -> str:
    notes = gaps(plan, "torchtitan", "0.2")
    if plan.config.tp > 1 and not plan.config.sequence_parallel:
        notes.append("tensor parallelism without sequence parallelism: torchtitan 0.2 always shards the sequence "
                     "with tp (0.3 has parallelism.enable_sequence_parallel)")
    text = (f"# torchtitan 0.2 job config (--job.config_file torchtitan.toml). {header}"
            "# torchtitan 0.3 reads no TOML: use torchtitan_args.sh (the node scripts do).\n"
            f"# [model] name / flavor: a torchtitan model with this shape ({comment(_shape(plan))}).\n"
            + (f"# {comment(torchtitan_moe_text(plan, '0.2'))}\n" if plan.model.is_moe else "")
            + ("".join(f"# cannot express: {comment(n)}\n" for n in notes) if notes else
               "# torchtitan expresses the whole plan.\n"))
    for section, keys in torchtitan_settings(plan, "0.2").items():
        text += f"\n[{section}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in keys.items())
    return text


def _shape(plan) -> str:
    m = plan.model
    return (f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, {m.num_kv_heads} kv heads, "
            f"ffn {m.ffn_hidden_size}, vocabulary {m.vocab_size}")


# -- DeepSpeed ------------------------------------------------------------------------------------

def ds_config(plan, header: str) -> dict:
    c, m = plan.config, plan.model
    doc = {"train_batch_size": c.global_batch, "train_micro_batch_size_per_gpu": c.micro_batch_size,
           "gradient_accumulation_steps": c.num_micro_batches,
           "zero_optimization": {"stage": c.zero_stage, "overlap_comm": _knob(plan, "deepspeed", "overlap_grad_reduce")}}
    if m.dtype == "bf16":
        doc["bf16"] = {"enabled": True}
    elif m.dtype == "fp16":
        doc["fp16"] = {"enabled": True}
    if c.tp > 1:
        doc["tensor_parallel"] = {"autotp_size": c.tp}
    if c.recompute != "none":
        doc["activation_checkpointing"] = {"partition_activations": c.tp > 1, "contiguous_memory_optimization": False,
                                           "cpu_checkpointing": False}
    notes = [header.strip()]
    if c.pp > 1:
        notes.append(f"pipeline: build the model as deepspeed.pipe.PipelineModule(layers, num_stages={c.pp}, "
                     "partition_method='uniform'"
                     + (", activation_checkpoint_interval=1" if c.recompute == "full" else "") + ")")
    if c.recompute == "full" and c.pp == 1:
        notes.append("recompute: wrap each transformer block in deepspeed.checkpointing.checkpoint")
    notes += [f"cannot express: {g}" for g in gaps(plan, "deepspeed")]
    doc["_autoconf"] = {"notes": notes}
    return doc
