"""What each training framework cannot express of a launch plan (``gaps``: one line per gap,
written into its files and PLAN.md), the rank orders each runs, and helpers the emitters share.

No import of any of these libraries here.
"""

from __future__ import annotations

from autoconf.launch.shell import comment_line
from autoconf.space.degrees import full_order
from autoconf.specs.frameworks import framework as framework_model

MEGATRON_RANK_ORDERS = {"tp-cp-dp-pp": [], "tp-cp-pp-dp": ["--use-tp-pp-dp-mapping"]}
"""Megatron-LM's rank orders (megatron-core's "tp-cp-ep-dp-pp", or "tp-cp-ep-pp-dp" with
--use-tp-pp-dp-mapping), as autoconf's full orders (``degrees.full_order``)."""


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
    """The knob's value in framework ``name``: the plan's own setting, else that framework's
    default (its recipe's, where the plan was priced for ``name`` with one)."""
    return framework_model(plan.framework if plan.framework_name == name else name).knob(plan.config, knob)


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


def _notes(plan, name: str) -> str:
    """The comment lines that say what framework ``name`` cannot express of the plan."""
    missing = gaps(plan, name)
    if not missing:
        return comment_line(f"{name} expresses the whole plan.") + "\n"
    return "".join(comment_line(t) + "\n" for t in [f"{name} cannot express, so the run will differ from the plan "
                                                     "there:", *(f"  - {g}" for g in missing)])


# -- torchtitan -----------------------------------------------------------------------------------


# -- DeepSpeed ------------------------------------------------------------------------------------


def _shape(plan) -> str:
    m = plan.model
    return (f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, {m.num_kv_heads} kv heads, "
            f"ffn {m.ffn_hidden_size}, vocabulary {m.vocab_size}")
