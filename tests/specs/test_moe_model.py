"""Mixture-of-experts and attention-variant shapes in ModelSpec: the Hugging Face readers of Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and GPT-OSS against the published parameter counts, multi-head latent
attention, Q/K norms, sliding windows and attention sinks, the presets, validation, and that dense
models and old documents are unchanged."""

import dataclasses
import json
import os

import pytest

from autoconf.errors import UserError
from autoconf.specs.hf import from_hf_config, load_model
from autoconf.specs.model import LATER_FIELDS, ModelSpec, preset, preset_names

HF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "hf")


def hf(name: str) -> ModelSpec:
    return load_model(os.path.join(HF_DIR, name + ".json"))


def read(name: str) -> dict:
    with open(os.path.join(HF_DIR, name + ".json")) as f:
        return json.load(f)


def rounded(x: float, figure: float, unit: float) -> bool:
    """x rounds to the published figure given to the nearest unit."""
    return abs(x - figure) <= unit / 2


def truncated(x: float, figure: float, unit: float) -> bool:
    """x truncates to the published figure (figures written down rather than rounded)."""
    return figure <= x < figure + unit


B = 1e9

# -- published figures --------------------------------------------------------------------------------------
# total: num_params(); active: active_params() (embedding and output layer both counted) unless noted.


def test_mixtral_8x7b():
    # Mistral AI, "Mixtral of experts" (Jiang et al. 2024) and its blog: 46.7B total, 12.9B active
    m = hf("Mixtral-8x7B-v0.1")
    assert rounded(m.num_params(), 46.7 * B, 0.1 * B)
    assert rounded(m.active_params(), 12.9 * B, 0.1 * B)


def test_qwen15_moe_a27b():
    # Qwen blog "Qwen1.5-MoE: Matching 7B Model Performance with 1/3 Activated Parameters": 14.3B total,
    # 2.7B activated
    m = hf("Qwen1.5-MoE-A2.7B")
    assert rounded(m.num_params(), 14.3 * B, 0.1 * B)
    assert rounded(m.active_params(), 2.7 * B, 0.1 * B)


def test_qwen3_30b_a3b():
    # Qwen3-30B-A3B model card: 30.5B total, 29.9B non-embedding, 3.3B activated. The card's activated
    # figure is written down, not rounded: 3.353B (with the embedding and the output layer).
    m = hf("Qwen3-30B-A3B")
    assert rounded(m.num_params(), 30.5 * B, 0.1 * B)
    assert rounded(m.num_params() - 2 * m.vocab_size * m.hidden_size, 29.9 * B, 0.1 * B)
    assert truncated(m.active_params(), 3.3 * B, 0.1 * B)


def test_deepseek_v3_routes_node_limited():
    # DeepSeek-V3 technical report, sec. 2.1.2: "each token will be sent to at most M = 4 nodes", by
    # the sum of the highest K_r / M affinity scores of the experts on each node; its config's
    # n_group = 8, topk_group = 4
    m = hf("DeepSeek-V3")
    assert (m.router_groups, m.router_group_topk) == (8, 4)


def test_deepseek_v3():
    # DeepSeek-V3 technical report (arXiv 2412.19437): 671B total, 37B activated per token. The
    # Hugging Face page's 685B adds the 14B multi-token-prediction module, which is not counted here.
    # 37.55B with the input embedding (truncated to 37B), 36.63B without it (rounded to 37B).
    m = hf("DeepSeek-V3")
    assert rounded(m.num_params(), 671 * B, 1 * B)
    assert truncated(m.active_params(), 37 * B, 1 * B)
    assert rounded(m.active_params() - m.vocab_size * m.hidden_size, 37 * B, 1 * B)


@pytest.mark.parametrize("name,total,active,total_card,active_card", [
    ("gpt-oss-20b", 20.91, 3.61, 21, 3.6),
    ("gpt-oss-120b", 116.83, 5.13, 117, 5.1),
])
def test_gpt_oss(name, total, active, total_card, active_card):
    # OpenAI gpt-oss model card (2025), Table 1: total 20.91B / 116.83B, active 3.61B / 5.13B; the
    # Hugging Face model cards round them to 21B / 117B and 3.6B / 5.1B. Its active count leaves out
    # the input embedding (a lookup), and keeps the unembedding.
    m = hf(name)
    act = m.active_params() - m.vocab_size * m.hidden_size
    assert rounded(m.num_params(), total * B, 0.01 * B) and rounded(m.num_params(), total_card * B, 1 * B)
    assert rounded(act, active * B, 0.01 * B) and rounded(act, active_card * B, 0.1 * B)


# -- what each reader makes of the config ---------------------------------------------------------------------

def test_shapes_read():
    mx = hf("Mixtral-8x7B-v0.1")
    assert (mx.num_experts, mx.experts_per_token, mx.expert_ffn, mx.num_moe_layers) == (8, 2, 14336, 32)
    assert (mx.router, mx.router_bias, mx.num_shared_experts, mx.sliding_window) == ("softmax", False, 0, None)
    q15 = hf("Qwen1.5-MoE-A2.7B")
    assert (q15.num_experts, q15.experts_per_token, q15.expert_ffn, q15.shared_expert_ffn) == (60, 4, 1408, 5632)
    assert (q15.num_shared_experts, q15.shared_expert_gate, q15.qkv_bias, q15.bias) == (1, True, True, False)
    q3 = hf("Qwen3-30B-A3B")
    assert (q3.num_experts, q3.experts_per_token, q3.expert_ffn, q3.qk_norm) == (128, 8, 768, True)
    assert (q3.head_size, q3.q_size, q3.kv_size, q3.qkv_bias) == (128, 4096, 512, False)
    ds = hf("DeepSeek-V3")
    assert (ds.num_experts, ds.experts_per_token, ds.expert_ffn, ds.num_shared_experts) == (256, 8, 2048, 1)
    assert (ds.first_dense_layers, ds.num_moe_layers, ds.router, ds.router_bias) == (3, 58, "sigmoid", True)
    assert (ds.q_lora_rank, ds.kv_lora_rank, ds.qk_rope_head_dim, ds.qk_nope_head_dim, ds.v_head_dim) == \
        (1536, 512, 64, 128, 128)
    assert (ds.head_size, ds.q_size, ds.k_size, ds.v_size, ds.attn_out_size, ds.rotary_dim) == \
        (192, 128 * 192, 128 * 192, 128 * 128, 128 * 128, 64)
    oss = hf("gpt-oss-20b")
    assert (oss.num_experts, oss.experts_per_token, oss.expert_ffn, oss.bias, oss.router_bias) == \
        (32, 4, 2880, True, True)
    assert (oss.sliding_window, oss.full_attention_every, oss.attention_sinks, oss.head_size) == (128, 2, True, 64)
    assert [oss.is_windowed_layer(i) for i in range(4)] == [True, False, True, False]
    assert oss.num_windowed_layers == 12
    # the training sequence is max_position_embeddings (the window bounds no sequence here)
    assert oss.seq_length == 131072 and load_model(os.path.join(HF_DIR, "gpt-oss-20b.json"), 8192).seq_length == 8192


def test_layer_counts_by_kind():
    """Each parameter kind against the tensors transformers 5.23 builds for the configs (meta device)."""
    ds = hf("DeepSeek-V3")
    h, a = 7168, 128
    assert ds.attention_params() == (h * 1536 + 1536 + 1536 * a * 192 + h * (512 + 64) + 512 + 512 * a * 256
                                     + a * 128 * h)
    assert 61 * ds.attention_params() == (671612928 + 93696 + 2302672896 + 251854848 + 31232 + 1023410176
                                          + 7163871232)
    assert ds.router_params() == h * 256 + 256  # e_score_correction_bias: a buffer in transformers
    q15 = hf("Qwen1.5-MoE-A2.7B")
    assert q15.shared_expert_params() == 3 * 2048 * 5632 + 2048  # with the sigmoid gate
    q3 = hf("Qwen3-30B-A3B")
    assert q3.attention_params() == 2048 * (4096 + 2 * 512) + 4096 * 2048 + 2 * 128  # q_norm, k_norm
    oss = hf("gpt-oss-20b")
    assert oss.attention_params() == 2880 * (4096 + 1024) + 4096 * 2880 + (4096 + 1024) + 2880 + 64  # sinks
    assert oss.expert_params() == 3 * 2880 * 2880 + 2 * 2880 + 2880 and oss.router_params() == 2880 * 32 + 32


def test_moe_layer_layouts():
    q = read("Qwen1.5-MoE-A2.7B")
    # transformers: sparse when (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers
    m = from_hf_config({**q, "decoder_sparse_step": 2})
    assert [m.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, True]
    m = from_hf_config({**q, "mlp_only_layers": [0, 1]})
    assert (m.first_dense_layers, m.moe_layer_freq, m.num_moe_layers) == (2, 1, 22)
    with pytest.raises(UserError, match=r"mlp_only_layers=\[3\]: the mixture-of-experts blocks are not every"):
        from_hf_config({**q, "mlp_only_layers": [3]})
    # DeepSeek: sparse when i >= first_k_dense_replace and i % moe_layer_freq == 0
    m = from_hf_config({**read("DeepSeek-V3"), "moe_layer_freq": 2})
    assert [i for i in range(10) if m.is_moe_layer(i)] == [4, 6, 8]
    # DeepSeek-V2-Lite style: no query compression
    m = from_hf_config({**read("DeepSeek-V3"), "q_lora_rank": None})
    assert m.q_lora_rank is None and m.attention_matmul_params() == \
        7168 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168


# -- FLOPs -----------------------------------------------------------------------------------------------------

def test_mla_flops():
    ds = dataclasses.replace(hf("DeepSeek-V3"), seq_length=4096)
    s, a = 4096, 128
    core = 2 * s * a * 192 + 2 * s * a * 128  # scores over nope + rope, values over v_head_dim
    assert ds.attention_core_flops() == core
    mlp = 3 * 7168 * 18432
    assert ds.layer_forward_flops_per_token() == 2 * (ds.attention_matmul_params() + mlp) + core
    experts = 3 * 7168 * 2048 * (8 + 1)
    assert ds.moe_layer_forward_flops_per_token() == 2 * (ds.attention_matmul_params() + experts + 7168 * 256) + core
    assert ds.model_flops_per_token() == 3 * (3 * ds.layer_forward_flops_per_token()
                                              + 58 * ds.moe_layer_forward_flops_per_token() + 2 * 129280 * 7168)


def test_sliding_window_flops():
    oss = dataclasses.replace(hf("gpt-oss-20b"), seq_length=8192)
    q = oss.q_size
    full, windowed = oss.moe_layer_forward_flops_per_token(1), oss.moe_layer_forward_flops_per_token(0)
    assert full == oss.moe_layer_forward_flops_per_token()  # None: a full-attention block
    assert full - windowed == 4 * (8192 - 128) * q
    assert oss.model_flops_per_token() == 3 * (12 * full + 12 * windowed + 2 * 201088 * 2880)
    short = dataclasses.replace(oss, seq_length=64)  # a window longer than the sequence changes nothing
    assert short.moe_layer_forward_flops_per_token(0) == short.moe_layer_forward_flops_per_token(1)
    every = dataclasses.replace(oss, full_attention_every=0)
    assert every.num_windowed_layers == 24


def test_shared_expert_gate_flops():
    q15 = hf("Qwen1.5-MoE-A2.7B")
    h, s, q = 2048, q15.seq_length, q15.q_size
    assert q15.moe_layer_forward_flops_per_token() == \
        2 * (h * 3 * q + q * h + 3 * h * (4 * 1408 + 5632) + h * 60 + h) + 4 * s * q


def test_dense_models_are_unchanged():
    """The formulas for dense shapes are the ones before these fields (bit for bit)."""
    for n in preset_names():
        m = preset(n)
        if m.is_moe:
            continue
        h, f, q, kv, s = m.hidden_size, m.ffn_hidden_size, m.q_size, m.kv_size, m.seq_length
        assert m.layer_forward_flops_per_token() == \
            2.0 * (h * (q + 2 * kv) + q * h + m.mlp_matrices * h * f) + 4.0 * s * q
        assert m.model_flops_per_token() == 3.0 * (m.num_layers * m.layer_forward_flops_per_token()
                                                   + 2.0 * m.vocab_size * h)
        assert (m.k_size, m.v_size, m.attn_out_size, m.attention_matmul_params()) == \
            (kv, kv, q, h * (q + 2 * kv) + q * h)


# -- presets -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,file", [("mixtral-8x7b", "Mixtral-8x7B-v0.1"), ("qwen3-30b-a3b", "Qwen3-30B-A3B"),
                                       ("deepseek-v3", "DeepSeek-V3"), ("gpt-oss-20b", "gpt-oss-20b")])
def test_presets_are_the_configs(name, file):
    p = preset(name)
    assert p.seq_length == 4096
    assert p == dataclasses.replace(hf(file), seq_length=4096, name=name)
    assert ModelSpec.from_dict(json.loads(json.dumps(p.to_dict()))) == p


# -- documents: round trip, defaults left out, validation ----------------------------------------------------

def test_old_documents_are_unchanged():
    new = {"router_bias", "shared_expert_gate", "qk_norm", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
           "qk_nope_head_dim", "v_head_dim", "sliding_window", "full_attention_every", "attention_sinks"}
    assert new <= set(LATER_FIELDS)
    for n in preset_names():
        if not preset(n).is_moe:
            assert not new & set(preset(n).to_dict()), n
    d = hf("gpt-oss-20b").to_dict()
    assert {"router_bias", "sliding_window", "full_attention_every", "attention_sinks"} <= set(d)
    assert ModelSpec.from_dict(d) == hf("gpt-oss-20b")


def test_yaml_with_the_new_fields(tmp_path):
    p = tmp_path / "mla.yaml"
    p.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nnum_kv_heads: 4\nffn_hidden_size: 128\n"
                 "vocab_size: 100\nseq_length: 16\nactivation: swiglu\nnorm: rmsnorm\nposition_embedding: rope\n"
                 "q_lora_rank: 24\nkv_lora_rank: 16\nqk_rope_head_dim: 8\nqk_nope_head_dim: 16\nv_head_dim: 12\n"
                 "sliding_window: 8\nfull_attention_every: 2\n")
    m = load_model(str(p))
    assert (m.head_size, m.q_size, m.v_size, m.rotary_dim) == (24, 96, 48, 8)
    assert m.attention_params() == 64 * 24 + 24 + 24 * 96 + 64 * 24 + 16 + 16 * 4 * 28 + 48 * 64
    assert ModelSpec.from_dict(m.to_dict()) == m


BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=4, ffn_hidden_size=8,
            vocab_size=10, seq_length=8, norm="rmsnorm", position_embedding="rope")
MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)


@pytest.mark.parametrize("kw,needle", [
    (dict(router_bias=True), "router_bias=true needs a router"),
    (dict(num_experts=4, experts_per_token=1, shared_expert_gate=True), "shared_expert_gate=true gates shared"),
    (dict(qk_norm=1), "qk_norm=1 must be true or false"),
    (dict(attention_sinks="yes"), "attention_sinks='yes' must be true or false"),
    (dict(kv_lora_rank=0), r"kv_lora_rank=0 must be null or an integer in \[1, "),
    (dict(q_lora_rank=8), "q_lora_rank=8 describes multi-head latent attention: set kv_lora_rank"),
    (dict(v_head_dim=8), "v_head_dim=8 describes multi-head latent attention"),
    (dict(MLA, v_head_dim=None), "v_head_dim=null; multi-head latent attention"),
    (dict(MLA, num_kv_heads=2), r"num_kv_heads=2 with multi-head latent attention .*valid: num_attention_heads"),
    (dict(MLA, head_dim=16), "head_dim=16 with multi-head latent attention"),
    (dict(MLA, qkv_bias=True), "qkv_bias=True with multi-head latent attention"),
    (dict(MLA, qk_rope_head_dim=7), "rotates 7 of the 23 dimensions"),
    (dict(MLA, position_embedding="learned"), "position_embedding='learned' with multi-head latent"),
    (dict(sliding_window=0), r"sliding_window=0 must be null or an integer in \[1, "),
    (dict(full_attention_every=2), "full_attention_every=2 picks .*set sliding_window too"),
    (dict(sliding_window=4, full_attention_every=-1), "full_attention_every=-1 must be a non-negative integer"),
    (dict(router_groups=2, router_group_topk=1), "router_groups and router_group_topk group a router's experts"),
    (dict(num_experts=8, experts_per_token=2, router_groups=3, router_group_topk=1), "router_groups=3 must divide"),
    (dict(num_experts=8, experts_per_token=2, router_groups=4, router_group_topk=3),
     r"router_group_topk=3 must be in 1\.\.2"),
    (dict(num_experts=8, experts_per_token=2, router_groups=4), r"router_group_topk=0 must be in 1\.\.2"),
    (dict(num_experts=8, experts_per_token=2, router_groups=-1), "router_groups=-1 must be a non-negative integer"),
    (dict(num_experts=8, experts_per_token=4, router_groups=4, router_group_topk=1),
     "router_groups=4 of 2 experts: a group is scored by its top 4"),
])
def test_bad_new_fields(kw, needle):
    with pytest.raises(UserError, match=needle) as e:
        ModelSpec(**{**BASE, **kw})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("doc,needle", [
    (dict(kv_lora_rank="16"), "kv_lora_rank"),
    (dict(sliding_window=True), "sliding_window"),
    (dict(full_attention_every=1.5), "full_attention_every"),
    (dict(qk_norm="true"), "qk_norm"),
    (dict(router_bias=None), "router_bias"),
])
def test_schema_refuses_bad_types(doc, needle):
    with pytest.raises(UserError, match=needle) as e:
        ModelSpec.from_dict({**BASE, **doc})
    assert "\n" not in str(e.value)


# -- refusals of the readers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("base,change,needle", [
    ("Mixtral-8x7B-v0.1", {"model_type": "jamba"}, r'model_type="jamba": hybrid state-space .*out of scope'),
    ("Mixtral-8x7B-v0.1", {"model_type": "nemotron_h"}, r'model_type="nemotron_h": hybrid state-space'),
    ("Mixtral-8x7B-v0.1", {"model_type": "falcon_mamba"}, "hybrid state-space"),
    ("Qwen3-30B-A3B", {"layer_types": ["full_attention", "mamba"] * 24},
     r'layer_types\[1\]="mamba": hybrid state-space .*out of scope'),
    ("Qwen3-30B-A3B", {"layer_types": ["linear_attention"] * 48}, r'layer_types\[0\]="linear_attention": only'),
    ("Mixtral-8x7B-v0.1", {"model_type": "phimoe"}, "num_local_experts=8: mixture-of-experts layers are not "
                                                     "modelled for model_type phimoe"),
    ("DeepSeek-V3", {"scoring_func": "tanh"}, 'scoring_func="tanh": .*valid: softmax, sigmoid'),
    ("gpt-oss-20b", {"layer_types": ["sliding_attention"] * 2 + ["full_attention"] * 22},
     "layer_types=.*not every n-th block"),
    ("gpt-oss-20b", {"layer_types": ["full_attention"] * 3}, "layer_types=.*3 entries for 24 blocks"),
    ("Qwen3-30B-A3B", {"num_experts_per_tok": 200}, "experts_per_token=200 must be in 1..num_experts"),
])
def test_refusals_are_one_line_and_name_the_key(base, change, needle):
    with pytest.raises(UserError, match=needle) as e:
        from_hf_config({**read(base), **change}, name=base)
    assert "\n" not in str(e.value)


def test_gpt_oss_window_defaults():
    cfg = {k: v for k, v in read("gpt-oss-20b").items() if k not in ("layer_types", "sliding_window")}
    m = from_hf_config(cfg)
    assert (m.sliding_window, m.full_attention_every, m.num_params()) == (128, 2, hf("gpt-oss-20b").num_params())
    every = from_hf_config({**read("gpt-oss-20b"), "layer_types": ["sliding_attention"] * 24})
    assert every.full_attention_every == 0 and every.num_windowed_layers == 24
    none = from_hf_config({**read("gpt-oss-20b"), "layer_types": ["full_attention"] * 24})
    assert none.sliding_window is None


def test_qwen3_dense_counts_its_qk_norms():
    cfg = {**read("Qwen3-30B-A3B"), "model_type": "qwen3"}
    for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers"):
        cfg.pop(k)
    m = from_hf_config(cfg)
    assert not m.is_moe and m.qk_norm and m.attention_params() == 2048 * 5120 + 4096 * 2048 + 256


def test_hf_group_limited_routing_read_and_refused():
    """n_group / topk_group: one group, or every group allowed, limits nothing (no groups); a
    layout that cannot hold a token's experts is refused naming the config's own key."""
    ds = read("DeepSeek-V3")
    m = from_hf_config({**ds, "n_group": 1, "topk_group": 1})
    assert (m.router_groups, m.router_group_topk, m.group_limited) == (0, 0, False)
    m = from_hf_config({**ds, "n_group": 8, "topk_group": 8})
    assert (m.router_groups, m.router_group_topk) == (0, 0)
    assert from_hf_config({**ds, "n_group": 16, "topk_group": 4}).router_groups == 16
    for change, needle in (({"n_group": 7}, "n_group=7: 7 groups of the 256 experts"),
                           ({"n_group": 128, "topk_group": 2}, "n_group=128"),
                           ({"topk_group": 0}, "topk_group=0: group-limited routing counts groups")):
        with pytest.raises(UserError, match=needle) as e:
            from_hf_config({**ds, **change})
        assert "\n" not in str(e.value)
