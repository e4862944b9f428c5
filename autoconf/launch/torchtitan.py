"""**torchtitan**: 0.3 reads no file; its configuration is a Python function of a model module
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

No import of the framework here.
"""

from __future__ import annotations

import json

from autoconf.launch.gaps import (
    TORCHTITAN_FP8_RECIPES,
    _knob,
    _moe_blocks,
    _notes,
    _shape,
    _titan_compile,
    gaps,
)
from autoconf.launch.shell import array, assign, comment_line

TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B",
                        "breadth_first": "LoopedBFS"}



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
    parameters gathered after forward. ZeRO-3 takes torchtitan's "default": resharded after
    forward without pipelining, kept gathered through the step with it (as the cost model prices
    it: ``Framework.fsdp_step_gather_under_pp``)."""
    if c.zero_stage == 0:
        return {"data_parallel_replicate_degree": c.dp, "data_parallel_shard_degree": 1}
    d = {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": c.dp}
    d["fsdp_reshard_after_forward"] = "never" if c.zero_stage == 2 else "default"
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
    """``torchtitan_args.sh``: comment lines (``header``: the plan in words), ``TORCHTITAN_ARGS``
    and ``TORCHTITAN_AC``."""
    words, ac = torchtitan_args(plan)
    conv = torchtitan_converter(plan)
    lines = [f"torchtitan 0.3 command-line overrides. {header}", "Sourced by node-K.sh, which runs",
             '  torchrun ... -m torchtitan.train --module "$TORCHTITAN_MODULE" --config "$TORCHTITAN_CONFIG" '
             '"${TORCHTITAN_ARGS[@]}" "$@" "$TORCHTITAN_AC"',
             f"TORCHTITAN_CONFIG: a config function of the module with this model's shape ({_shape(plan)}); "
             "the layer names below are torchtitan's Llama ones."]
    if plan.model.is_moe:
        lines.append(torchtitan_moe_text(plan))
    if conv:
        lines.append(f"FP8 ({plan.config.fp8_recipe}): torchtitan 0.3 takes it from the config function, not the "
                     "command line: TORCHTITAN_CONFIG's model_registry(..., converters=[...]) must hold "
                     f"torchtitan.components.quantization.{_converter_text(conv)}")
    return ("".join(comment_line(t) + "\n" for t in lines) + _notes(plan, "torchtitan")
            + array("TORCHTITAN_ARGS", words) + assign("TORCHTITAN_AC", ac) + "\n")


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):  # a TOML basic string: JSON's escapes, and DEL, which TOML refuses raw
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    return "[" + ", ".join(_toml_value(x) for x in v) + "]"


def torchtitan_toml(plan, header: str) -> str:
    """``torchtitan.toml``, torchtitan 0.2's job config: comment lines, then its sections."""
    notes = gaps(plan, "torchtitan", "0.2")
    if plan.config.tp > 1 and not plan.config.sequence_parallel:
        notes.append("tensor parallelism without sequence parallelism: torchtitan 0.2 always shards the sequence "
                     "with tp (0.3 has parallelism.enable_sequence_parallel)")
    lines = [f"torchtitan 0.2 job config (--job.config_file torchtitan.toml). {header}",
             "torchtitan 0.3 reads no TOML: use torchtitan_args.sh (the node scripts do).",
             f"[model] name / flavor: a torchtitan model with this shape ({_shape(plan)})."]
    if plan.model.is_moe:
        lines.append(torchtitan_moe_text(plan, "0.2"))
    lines += [f"cannot express: {n}" for n in notes] or ["torchtitan expresses the whole plan."]
    text = "".join(comment_line(t) + "\n" for t in lines)
    for section, keys in torchtitan_settings(plan, "0.2").items():
        text += f"\n[{section}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in keys.items())
    return text
