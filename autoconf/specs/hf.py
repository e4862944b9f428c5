"""Reading models: a preset name, a model YAML / JSON file, or a Hugging Face ``config.json``
(``from_hf_config``: the families it reads, what it refuses and why) into a ``ModelSpec``.
"""

from __future__ import annotations

import dataclasses
import json
import os

from autoconf.errors import UserError
from autoconf.specs.model import MODEL_SCHEMA, ROUTERS, ModelSpec, groups_hold_experts, preset
from autoconf.specs.schema import Bool, Int, List, Null, Num, Str, check_kind, parse_json, parse_yaml, read_text

_HF_GELU = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python", "gelu_accurate", "quick_gelu")


_HF_SILU = ("silu", "swish", "swiglu")


_HF_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


_HF_INT = Null(Int(1, 1 << 24))


# The keys read from a Hugging Face config, with their exact types. A config.json holds many more
# (architectures, rope_scaling, token ids...), so other keys pass, except near-misses of these.
HF_KEYS = {
    **{k: _HF_INT for k in ("hidden_size", "n_embd", "d_model", "num_attention_heads", "n_head",
                             "num_hidden_layers", "n_layer", "num_layers", "num_key_value_heads", "n_head_kv",
                             "num_kv_heads", "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size",
                             "vocab_size", "max_position_embeddings", "n_positions", "n_ctx", "seq_length",
                             "head_dim", "sliding_window", "num_ln_in_parallel_attn")},
    **{k: Null(Int(0, 1 << 24)) for k in ("num_local_experts", "num_experts", "n_routed_experts",
                                           "num_experts_per_tok", "experts_per_token", "n_shared_experts",
                                           "shared_expert_intermediate_size", "first_k_dense_replace",
                                           "num_nextn_predict_layers")},
    **{k: _HF_INT for k in ("moe_intermediate_size", "decoder_sparse_step", "moe_layer_freq", "q_lora_rank",
                             "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")},
    "mlp_only_layers": Null(List(Int(0, 1 << 24), max_len=1 << 16)),
    "layer_types": Null(List(Str(max_len=100), max_len=1 << 16)), "scoring_func": Null(Str(max_len=100)),
    "qkv_bias": Null(Bool()),
    **{k: Null(Str(max_len=100)) for k in ("hidden_act", "hidden_activation", "activation_function", "activation",
                                           "model_type")},
    **{k: Null(Bool()) for k in ("tie_word_embeddings", "attention_bias", "mlp_bias", "bias", "alibi",
                                 "multi_query", "parallel_attn", "new_decoder_architecture", "use_parallel_residual",
                                 "use_sliding_window", "apply_residual_connection_post_layernorm",
                                 "is_encoder_decoder")},
    **{k: Null(Num(0.0, 1.0, lo_open=True)) for k in ("rotary_pct", "partial_rotary_factor")},
    "torch_dtype": Null(Str(_HF_DTYPE)), "dtype": Null(Str(_HF_DTYPE)),
}


# model_type -> family. Llama, Mistral, Qwen2 and Gemma (and any model_type not listed here) are read
# as Llama-like: RMSNorm, rotary positions, a gated MLP, sequential pre-norm blocks.
HF_FAMILIES = {"gpt2": "gpt2", "gpt_bigcode": "gpt2", "gpt_neox": "gpt_neox",
               "falcon": "falcon", "RefinedWeb": "falcon", "RefinedWebModel": "falcon"}


_FAMILY_NAMES = {"llama": "Llama-like", "gpt2": "GPT-2", "gpt_neox": "GPT-NeoX", "falcon": "Falcon"}


HF_SUPPORTED = ("llama, mistral, qwen2, qwen3, gemma, gpt2, gpt_bigcode, gpt_neox, falcon, mixtral, qwen2_moe, "
                "qwen3_moe, deepseek_v3, gpt_oss (or another Llama-like model_type)")


# Mixture-of-experts model_types read (each with its own keys); experts in any other type are refused.
HF_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")


# model_types (substrings) with state-space (Mamba) layers beside or instead of attention: refused.
HF_STATE_SPACE = ("mamba", "jamba", "nemotron_h", "zamba", "bamba", "falcon_h1", "granitemoehybrid")


HF_LAYER_TYPES = ("full_attention", "sliding_attention")


# model_types that look Llama-like enough to load but are not: refused rather than mispriced.
HF_REFUSED = {
    "gptj": "its MLP has biases but its attention has none, and its output layer has a bias",
    "opt": "its learned positions have 2 extra rows and its MLP is ReLU",
    "bloom": "ALiBi attention biases are not modelled", "mpt": "ALiBi attention biases are not modelled",
    "gemma2": "its blocks have four norms and soft-capped logits",
    "gemma3": "its blocks have four norms and Q/K norms", "gemma3_text": "its blocks have four norms and Q/K norms",
    "phi": "its output layer has a bias",
    "stablelm": "its norms are LayerNorms, with optional Q/K norms",
    "starcoder2": "its MLP is not gated and its norms are LayerNorms",
}


def _check_hf(cfg: dict, name: str) -> None:
    import difflib

    for k, v in cfg.items():
        if not isinstance(k, str):
            raise UserError(f"model {name}: config.json key {k!r} is not a string")
        if k in HF_KEYS:
            try:
                HF_KEYS[k](v, k)
            except UserError as e:
                raise UserError(f"model {name}: {e}") from None
            continue
        close = difflib.get_close_matches(k, list(HF_KEYS), n=1, cutoff=0.88)
        if close:
            raise UserError(f"model {name}: unknown key {k!r} in config.json (did you mean {close[0]!r}?)")


def _check_fields(fields: dict, name: str) -> None:
    """Each of ``fields`` that the model schema knows (``model.MODEL_SCHEMA``: the ranges of
    ``model.LIMITS`` and the others), held to its type and range now, in the line
    ``ModelSpec.from_dict`` would give: so that a count out of range (16,777,216 layers) is
    refused before a per-layer or per-expert structure is built from it."""
    for k, v in fields.items():
        spec = MODEL_SCHEMA.required.get(k) or MODEL_SCHEMA.optional.get(k)
        if spec is not None:
            try:
                spec(v, k)
            except UserError as e:
                raise UserError(f"model {name if len(name) <= 60 else name[:57] + '...'}: {e}") from None


def from_hf_config(cfg: dict, name: str = "hf", seq_length: int | None = None) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (as a dict) without importing transformers.

    Families (``model_type``): Llama, Mistral, Qwen2 (biases on Q, K, V), Gemma (GeGLU, explicit
    ``head_dim``, tied embeddings), any other Llama-like type; GPT-2 and GPT-BigCode (multi-query);
    GPT-NeoX / Pythia (parallel residual, partial rotary ``rotary_pct``, untied); Falcon (multi-query or
    ``num_kv_heads`` with ``new_decoder_architecture``, ``parallel_attn`` with one or two norms,
    ``bias``). Mixtures of experts: Mixtral, Qwen2-MoE (one shared expert with a sigmoid gate,
    ``decoder_sparse_step`` / ``mlp_only_layers``), Qwen3-MoE (and dense Qwen3: per-head Q/K norms),
    DeepSeek-V3 (multi-head latent attention, sigmoid scores with e_score_correction_bias,
    ``first_k_dense_replace`` / ``moe_layer_freq``; the multi-token-prediction module of
    ``num_nextn_predict_layers`` is left out, as in the published 671B), GPT-OSS (biases everywhere,
    a router bias, attention sinks, ``sliding_window`` in the ``layer_types`` marked so). Absent keys
    take the defaults of the family's transformers config class.

    The training sequence is ``seq_length`` when given, else ``max_position_embeddings`` (Falcon
    without it: 2048). Except for GPT-OSS, whose windows are a field of the spec, a model with a
    ``sliding_window`` shorter than that trains at the window: the sliding-window attention is then the
    full causal attention that autoconf models and builds, and a longer ``seq_length`` is refused.
    Experts in other model types, hybrid state-space layers (Mamba, Jamba, Nemotron-H...), ALiBi and
    encoder-decoder configs are refused. The keys read are type-checked (:data:`HF_KEYS`); near-misses
    of them are refused.
    """
    if not isinstance(cfg, dict):
        raise UserError(f"model {name}: a config.json must hold a JSON object")
    _check_hf(cfg, name)

    def get(key, default=None):
        return cfg[key] if cfg.get(key) is not None else default

    def pick(*keys, default=None):
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        if default is None:
            raise UserError(f"model {name}: config.json lacks {' / '.join(keys)} (model_type "
                            f"{model_type or '(absent)'}, read as {_FAMILY_NAMES[family]})")
        return default

    def refuse(key, why, valid):
        raise UserError(f"model {name}: {key}={json.dumps(cfg.get(key))}: {why}; valid: {valid}")

    model_type = cfg.get("model_type") or ""
    family = HF_FAMILIES.get(model_type, "llama")
    _hf_refusals(model_type, get, refuse, name)

    hidden = pick("hidden_size", "n_embd") if family in ("gpt2", "falcon") else pick("hidden_size")
    heads = pick("num_attention_heads", "n_head") if family in ("gpt2", "falcon") else pick("num_attention_heads")
    layers = pick("num_hidden_layers", "n_layer") if family in ("gpt2", "falcon") else pick("num_hidden_layers")
    spec = dict(name=name, hidden_size=hidden, num_attention_heads=heads, num_layers=layers,
                vocab_size=pick("vocab_size"), dtype=_HF_DTYPE[pick("torch_dtype", "dtype", default="bfloat16")])
    _check_fields(spec, name)  # the shape's ranges first: the blocks and experts below are built per layer
    if family == "gpt2":
        fields, seq = _hf_gpt2(model_type, hidden, heads, get, pick, refuse)
    elif family == "gpt_neox":
        fields, seq = _hf_neox(heads, get, pick, refuse)
    elif family == "falcon":
        fields, seq = _hf_falcon(model_type, hidden, heads, get, pick, refuse)
    else:
        fields, seq = _hf_llama(cfg, model_type, hidden, heads, layers, get, pick, refuse,
                                lambda d: _check_fields(d, name))
    spec.update(fields)
    if model_type == "gpt_oss":  # sliding windows in alternate blocks: a field of the spec, not a bound on s
        spec.update(_hf_windows(get("sliding_window", 128), get("layer_types"), layers, refuse))
        window = None
    else:
        window = get("sliding_window") if get("use_sliding_window", True) else None
    if seq_length is not None:
        if window is not None and seq_length > window:
            raise UserError(f"model {name}: sequence length {seq_length} exceeds sliding_window={window}: "
                            f"sliding-window attention is not modelled; valid: a sequence length up to {window}")
        seq = seq_length
    elif window is not None:
        seq = min(seq, window)
    # through the model schema: the same ranges as a model file (an expert count of 1e7 is refused)
    return ModelSpec.from_dict({**spec, "seq_length": seq})


def _hf_refusals(model_type: str, get, refuse, name: str) -> None:
    """What a config may describe that autoconf does not model: refused in one line each."""
    if model_type in HF_REFUSED:
        refuse("model_type", f"{model_type} is not supported ({HF_REFUSED[model_type]})", HF_SUPPORTED)
    if get("is_encoder_decoder"):
        refuse("is_encoder_decoder", "encoder-decoder models are not modelled (decoder-only transformers)", "false")
    if any(t in model_type.lower() for t in HF_STATE_SPACE):
        refuse("model_type", "hybrid state-space (Mamba) layers are out of scope (attention blocks only)",
               HF_SUPPORTED)
    for j, t in enumerate(get("layer_types", [])):
        if t not in HF_LAYER_TYPES:
            why = ("hybrid state-space (Mamba) layers are out of scope (attention blocks only)" if "mamba" in t
                   else "only attention blocks are modelled")
            raise UserError(f"model {name}: layer_types[{j}]={json.dumps(t)}: {why}; valid: "
                            f"{', '.join(HF_LAYER_TYPES)}")
    if model_type not in HF_MOE:
        for key in ("num_local_experts", "num_experts", "n_routed_experts"):
            if get(key, 0) > 1:
                refuse(key, f"mixture-of-experts layers are not modelled for model_type {model_type or '(absent)'}",
                       f"absent, 0 or 1 (experts are read for {', '.join(HF_MOE)})")
    if get("alibi"):
        refuse("alibi", "ALiBi attention biases are not modelled", "false (rotary positions)")
    if get("apply_residual_connection_post_layernorm"):
        refuse("apply_residual_connection_post_layernorm", "post-norm residuals are not modelled", "false")


def _hf_gpt2(model_type: str, hidden: int, heads: int, get, pick, refuse) -> tuple[dict, int]:
    """GPT-2 and GPT-BigCode: (the block's fields, the sequence length)."""
    act = get("activation_function", "gelu_new")
    if act not in _HF_GELU:
        refuse("activation_function", "a GPT-2 MLP is fc2(act(fc1 x))", ", ".join(_HF_GELU))
    mqa = model_type == "gpt_bigcode" and get("multi_query", True)
    fields = dict(num_kv_heads=1 if mqa else heads, ffn_hidden_size=get("n_inner", 4 * hidden),
                  activation="gelu", tied_embeddings=get("tie_word_embeddings", True), norm="layernorm",
                  position_embedding="learned", bias=True)
    return fields, pick("n_positions", "n_ctx", "max_position_embeddings")


def _hf_neox(heads: int, get, pick, refuse) -> tuple[dict, int]:
    """GPT-NeoX / Pythia: (the block's fields, the sequence length)."""
    act = get("hidden_act", "gelu")
    if act not in _HF_GELU:
        refuse("hidden_act", "a GPT-NeoX MLP is fc2(act(fc1 x))", ", ".join(_HF_GELU))
    if get("attention_bias", True) is False:
        refuse("attention_bias", "a GPT-NeoX MLP keeps its biases; biases on the MLP alone are not modelled",
               "true")
    fields = dict(num_kv_heads=heads, ffn_hidden_size=pick("intermediate_size"), activation="gelu",
                  tied_embeddings=get("tie_word_embeddings", False), norm="layernorm", position_embedding="rope",
                  bias=True, parallel_attention=get("use_parallel_residual", True),
                  rotary_fraction=pick("rotary_pct", "partial_rotary_factor", default=0.25))
    return fields, pick("max_position_embeddings")


def _hf_falcon(model_type: str, hidden: int, heads: int, get, pick, refuse) -> tuple[dict, int]:
    """Falcon: (the block's fields, the sequence length)."""
    act = get("activation", "gelu")
    if act not in _HF_GELU:
        refuse("activation", "a Falcon MLP is fc2(act(fc1 x))", ", ".join(_HF_GELU))
    new_arch = get("new_decoder_architecture", model_type == "RefinedWeb")
    if new_arch:
        kv = pick("num_kv_heads", "n_head_kv", default=heads)
    else:
        kv = 1 if get("multi_query", True) else heads
    parallel = bool(new_arch or get("parallel_attn", True))
    norms = get("num_ln_in_parallel_attn", 2 if new_arch else 1) if parallel else 2
    if norms not in (1, 2):
        refuse("num_ln_in_parallel_attn", "a parallel block has one or two norms", "1, 2")
    fields = dict(num_kv_heads=kv, ffn_hidden_size=get("ffn_hidden_size", 4 * hidden), activation="gelu",
                  tied_embeddings=get("tie_word_embeddings", True), norm="layernorm", position_embedding="rope",
                  bias=get("bias", False), parallel_attention=parallel, shared_norm=parallel and norms == 1)
    return fields, get("max_position_embeddings", 2048)


def _hf_llama(cfg: dict, model_type: str, hidden: int, heads: int, layers: int, get, pick, refuse,
              check) -> tuple[dict, int]:
    """Llama-like types, with their mixtures of experts (:func:`_hf_moe`): (the block's fields,
    the sequence length). ``check``: holds fields to their ranges (:func:`_check_fields`), before
    the experts' blocks are laid out."""
    gemma = model_type == "gemma"
    act_key = "hidden_activation" if gemma and get("hidden_activation") else "hidden_act"
    act = get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
    activation = "swiglu" if act in _HF_SILU else "geglu" if act in _HF_GELU else None
    if activation is None:
        refuse(act_key, "the gated MLP down(act(gate x) * up x) is modelled with SiLU or GELU",
               ", ".join(_HF_SILU + _HF_GELU))
    fields = {}
    head_dim = get("head_dim")
    if head_dim is not None and not (hidden % heads == 0 and head_dim == hidden // heads):
        fields["head_dim"] = head_dim
    attn_bias = get("attention_bias", model_type == "gpt_oss")
    mlp_bias = get("mlp_bias", attn_bias if model_type == "gpt_oss" else False)
    if attn_bias != mlp_bias:
        refuse("attention_bias" if attn_bias else "mlp_bias",
               "biases on the attention or on the MLP alone are not modelled", "attention_bias and mlp_bias "
               "both false, or both true")
    qkv_bias = (model_type == "qwen2" or (model_type == "qwen2_moe" and get("qkv_bias", True))) and not attn_bias
    fields.update(num_kv_heads=pick("num_key_value_heads", default=heads), ffn_hidden_size=pick("intermediate_size"),
                  activation=activation, tied_embeddings=get("tie_word_embeddings", gemma), norm="rmsnorm",
                  position_embedding="rope", bias=attn_bias, qkv_bias=qkv_bias,
                  rotary_fraction=get("partial_rotary_factor", 1.0), qk_norm=model_type in ("qwen3", "qwen3_moe"))
    check(fields)
    if model_type in HF_MOE:
        fields.update(_hf_moe(cfg, model_type, layers, get, pick, refuse, check))
    return fields, pick("max_position_embeddings")


def _fit_moe_layers(moe: list[bool], key: str, refuse) -> dict:
    """first_dense_layers and moe_layer_freq that mark exactly the blocks ``moe`` marks."""
    idx = [i for i, m in enumerate(moe) if m]
    if not idx:
        refuse(key, "no block is a mixture of experts", "a layout with at least one mixture-of-experts block")
    first = idx[0]
    freq = idx[1] - idx[0] if len(idx) > 1 else 1
    if any(m != (i >= first and (i - first) % freq == 0) for i, m in enumerate(moe)):
        refuse(key, "the mixture-of-experts blocks are not every n-th block after the first dense ones",
               "a leading run of dense blocks, then a mixture of experts every n-th block")
    return dict(first_dense_layers=first, moe_layer_freq=freq)


def _hf_moe(cfg: dict, model_type: str, layers: int, get, pick, refuse, check) -> dict:
    """The mixture-of-experts fields of a Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 or GPT-OSS config,
    with the defaults of transformers' config classes. ``check``: holds the counts to their ranges
    (:func:`_check_fields`) before the blocks are laid out one by one."""
    if model_type in ("mixtral", "gpt_oss"):
        experts = pick("num_local_experts", default=8 if model_type == "mixtral" else 128)
        k = pick("num_experts_per_tok", "experts_per_token", default=2 if model_type == "mixtral" else 4)
        # every block; the experts' inner width is intermediate_size (ffn_hidden_size)
        return dict(num_experts=experts, experts_per_token=k, router_bias=model_type == "gpt_oss",
                    attention_sinks=model_type == "gpt_oss")
    if model_type in ("qwen2_moe", "qwen3_moe"):
        qwen2 = model_type == "qwen2_moe"
        out = dict(num_experts=pick("num_experts", default=60 if qwen2 else 128),
                   experts_per_token=pick("num_experts_per_tok", default=4 if qwen2 else 8),
                   expert_ffn_hidden_size=pick("moe_intermediate_size", default=1408 if qwen2 else 768))
        shared = get("shared_expert_intermediate_size", 5632) if qwen2 else 0
        if shared:  # one shared expert, scaled by sigmoid(x . g)
            out.update(num_shared_experts=1, shared_expert_ffn_hidden_size=shared, shared_expert_gate=True)
        check(out)
        step = get("decoder_sparse_step", 1)
        dense = set(get("mlp_only_layers", []))
        # transformers: block i is sparse when i is not in mlp_only_layers and (i + 1) % step == 0
        out.update(_fit_moe_layers([i not in dense and (i + 1) % step == 0 for i in range(layers)],
                                   "mlp_only_layers" if dense else "decoder_sparse_step", refuse))
        return out
    # deepseek_v3: multi-head latent attention; sigmoid scores with a correction bias (selection only).
    # The multi-token-prediction module (num_nextn_predict_layers) is not part of the model counted.
    scoring = get("scoring_func", "sigmoid")
    if scoring not in ROUTERS:
        refuse("scoring_func", "routers score experts with a softmax or a sigmoid", ", ".join(ROUTERS))
    shared = get("n_shared_experts", 1)
    # group-limited routing: transformers' DeepseekV3Config defaults, 8 groups, the best 4; one
    # group, or every group allowed, limits nothing
    groups, allowed = get("n_group", 8), get("topk_group", 4)
    for key, v in (("n_group", groups), ("topk_group", allowed)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            refuse(key, "group-limited routing counts groups", "a positive integer")
    if groups > 1 and allowed < groups:
        experts, k = get("n_routed_experts", 256), get("num_experts_per_tok", 8)
        if experts % groups or not groups_hold_experts(experts, k, groups, allowed):
            refuse("n_group", f"{groups} groups of the {experts} experts, the best {allowed} per token, cannot "
                   f"hold its {k} experts", "a divisor of n_routed_experts leaving topk_group groups room for them")
    else:
        groups = allowed = 0
    out = dict(num_experts=pick("n_routed_experts", default=256), experts_per_token=pick("num_experts_per_tok",
                                                                                         default=8),
               expert_ffn_hidden_size=pick("moe_intermediate_size", default=2048), num_shared_experts=shared,
               router=scoring, router_bias=True,
               router_groups=groups, router_group_topk=allowed,
               # q_lora_rank null: one query projection (DeepSeek-V2-Lite); absent: transformers' 1536
               q_lora_rank=cfg["q_lora_rank"] if "q_lora_rank" in cfg else 1536,
               kv_lora_rank=pick("kv_lora_rank", default=512), qk_rope_head_dim=pick("qk_rope_head_dim", default=64),
               qk_nope_head_dim=pick("qk_nope_head_dim", default=128), v_head_dim=pick("v_head_dim", default=128))
    check(out)
    freq, first_k = get("moe_layer_freq", 1), get("first_k_dense_replace", 3)
    # transformers: block i is sparse when i >= first_k_dense_replace and i % moe_layer_freq == 0
    out.update(_fit_moe_layers([i >= first_k and i % freq == 0 for i in range(layers)], "first_k_dense_replace",
                               refuse))
    return out


def _hf_windows(window: int, layer_types, layers: int, refuse) -> dict:
    """sliding_window and full_attention_every from a window and a list of 'sliding_attention' /
    'full_attention' blocks (None: transformers' GPT-OSS default, alternating from a windowed one)."""
    if layer_types is None:
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if len(layer_types) != layers:
        refuse("layer_types", f"{len(layer_types)} entries for {layers} blocks", f"{layers} entries")
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    if not full:
        return dict(sliding_window=window, full_attention_every=0)
    if len(full) == layers:
        return {}
    n = full[0] + 1
    if any((t == "full_attention") != ((i + 1) % n == 0) for i, t in enumerate(layer_types)):
        refuse("layer_types", "the full-attention blocks are not every n-th block", "every n-th block full "
               "(blocks n-1, 2n-1, ...), the others sliding_attention")
    return dict(sliding_window=window, full_attention_every=n)


def load_model(ref: str, seq_length: int | None = None) -> ModelSpec:
    """A preset name, a YAML model file, or a Hugging Face config.json; optional seq override."""
    if not isinstance(ref, str) or not ref:
        raise UserError(f"--model {ref!r}: give a preset name or a model file")
    if os.path.lexists(ref):  # a symlink loop or a dangling link is named as such by read_text
        spec = _load_model_file(ref, seq_length)
    elif ref.endswith((".yaml", ".yml", ".json")) or os.sep in ref:
        raise UserError(f"model file {ref!r} does not exist")
    else:
        spec = preset(ref)
    if seq_length is not None:
        spec = dataclasses.replace(spec, seq_length=seq_length)
    return spec


def _load_model_file(path: str, seq_length: int | None = None) -> ModelSpec:
    name = os.path.splitext(os.path.basename(path))[0][:200] or "custom"
    text = read_text(path, "model file")
    if path.endswith(".json"):
        data = parse_json(text, path, "model file", ("model", "hf"))
        if not isinstance(data, dict):
            raise UserError(f"model file {path!r} must hold a JSON object")
        check_kind(data, path, ("model", "hf"))
        if "num_layers" in data and "hidden_size" in data:
            return ModelSpec.from_dict({"name": name, **data})
        return from_hf_config(data, name=name, seq_length=seq_length)
    data = parse_yaml(text, path, "model file")
    if not isinstance(data, dict):
        raise UserError(f"model file {path!r} must hold a mapping of field names to values")
    check_kind(data, path, ("model",))
    return ModelSpec.from_dict({"name": name, **data})
