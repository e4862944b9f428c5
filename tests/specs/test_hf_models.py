"""Hugging Face config.json of the common families: parameter counts against the published figures, the
shapes read from each family, refusals, the CLI path, and the trainer's model (autoconf.trainer.layers) building,
saving and computing what ModelSpec prices for every shape feature those families need."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from autoconf.cost.activations import layer_activation_bytes
from autoconf.cost.compute import block_times
from autoconf.cost.roofline import Roofline
from autoconf.errors import UserError
from autoconf.space.config import ParallelConfig, check
from autoconf.specs.hf import from_hf_config, load_model
from autoconf.specs.model import ModelSpec, preset, preset_names

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HF_DIR = os.path.join(ROOT, "tests", "data", "hf")

# Parameter counts of the Hugging Face models (transformers' num_parameters(), tied weights once), each
# cross-checked by instantiating the config with transformers 5.23 on the meta device. All match the
# model cards' figures exactly, except falcon-40b: the hub shows "41.8B", which counts the tied output
# layer a second time (41,303,293,952 + 65024 x 8192 = 41,835,970,560); the model holds 41,303,293,952.
# The mixtures of experts (their rounded published figures are tested in tests/test_moe_model.py) are
# counted the same way, except DeepSeek-V3: its router's e_score_correction_bias (256 a block, 58 blocks)
# is a buffer in transformers but a tensor of the checkpoint, counted here (671,026,404,352 parameters
# + 14,848); its multi-token-prediction module (num_nextn_predict_layers) is not part of the model.
PUBLISHED = {
    "Llama-2-7b-hf": 6_738_415_616,
    "Meta-Llama-3-8B": 8_030_261_248,
    "Llama-3.1-8B": 8_030_261_248,
    "Mistral-7B-v0.1": 7_241_732_096,
    "Qwen2-7B": 7_615_616_512,
    "Qwen2-0.5B": 494_032_768,
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "pythia-1.4b": 1_414_647_808,
    "gpt-neox-20b": 20_554_567_680,
    "falcon-7b": 6_921_720_704,
    "falcon-40b": 41_303_293_952,
    "gemma-2b": 2_506_172_416,
    "gemma-7b": 8_537_680_896,
    "Mixtral-8x7B-v0.1": 46_702_792_704,
    "Qwen1.5-MoE-A2.7B": 14_315_784_192,
    "Qwen3-30B-A3B": 30_532_122_624,
    "DeepSeek-V3": 671_026_419_200,
    "gpt-oss-20b": 20_914_757_184,
    "gpt-oss-120b": 116_829_156_672,
}

# What each family's file must read as (the fields that set the shapes; others at their defaults).
EXPECTED = {
    "Llama-2-7b-hf": dict(activation="swiglu", num_kv_heads=32, norm="rmsnorm", position_embedding="rope",
                          tied_embeddings=False, bias=False, dtype="fp16", seq_length=4096),
    "Meta-Llama-3-8B": dict(activation="swiglu", num_kv_heads=8, tied_embeddings=False, seq_length=8192),
    # a long max_position_embeddings (rope_scaling extends rope; it changes no shape)
    "Llama-3.1-8B": dict(activation="swiglu", num_kv_heads=8, tied_embeddings=False, seq_length=131072),
    "Mistral-7B-v0.1": dict(activation="swiglu", num_kv_heads=8, seq_length=4096),  # its sliding window
    "Qwen2-7B": dict(activation="swiglu", num_kv_heads=4, qkv_bias=True, bias=False, tied_embeddings=False),
    "Qwen2-0.5B": dict(num_kv_heads=2, qkv_bias=True, tied_embeddings=True),
    "gpt2": dict(activation="gelu", norm="layernorm", position_embedding="learned", bias=True, tied_embeddings=True,
                 ffn_hidden_size=3072, seq_length=1024),
    "gpt2-medium": dict(num_layers=24, hidden_size=1024, num_attention_heads=16),
    "pythia-1.4b": dict(activation="gelu", norm="layernorm", position_embedding="rope", bias=True,
                        tied_embeddings=False, parallel_attention=True, shared_norm=False, rotary_fraction=0.25),
    "gpt-neox-20b": dict(parallel_attention=True, rotary_fraction=0.25, num_kv_heads=64),
    "falcon-7b": dict(num_kv_heads=1, parallel_attention=True, shared_norm=True, bias=False, tied_embeddings=True,
                      norm="layernorm", position_embedding="rope", seq_length=2048),
    "falcon-40b": dict(num_kv_heads=8, parallel_attention=True, shared_norm=False, bias=False, tied_embeddings=True),
    "gemma-2b": dict(activation="geglu", num_kv_heads=1, head_dim=None, tied_embeddings=True, norm="rmsnorm"),
    "gemma-7b": dict(activation="geglu", num_kv_heads=16, head_dim=256, tied_embeddings=True),
    "Mixtral-8x7B-v0.1": dict(num_experts=8, experts_per_token=2, num_kv_heads=8, seq_length=32768),
    "Qwen1.5-MoE-A2.7B": dict(num_experts=60, experts_per_token=4, expert_ffn_hidden_size=1408,
                              num_shared_experts=1, shared_expert_ffn_hidden_size=5632, shared_expert_gate=True,
                              qkv_bias=True),
    "Qwen3-30B-A3B": dict(num_experts=128, experts_per_token=8, expert_ffn_hidden_size=768, head_dim=128,
                          qk_norm=True),
    "DeepSeek-V3": dict(num_experts=256, experts_per_token=8, num_shared_experts=1, first_dense_layers=3,
                        router="sigmoid", router_bias=True, q_lora_rank=1536, kv_lora_rank=512),
    "gpt-oss-20b": dict(num_experts=32, experts_per_token=4, bias=True, router_bias=True, sliding_window=128,
                        full_attention_every=2, attention_sinks=True, head_dim=64),
    "gpt-oss-120b": dict(num_experts=128, experts_per_token=4, num_layers=36, sliding_window=128),
}


def hf(name: str) -> str:
    return os.path.join(HF_DIR, name + ".json")


def read(name: str) -> dict:
    with open(hf(name)) as f:
        return json.load(f)


def test_every_file_is_listed():
    files = {f[:-5] for f in os.listdir(HF_DIR) if f.endswith(".json")}
    assert files == set(PUBLISHED) == set(EXPECTED)
    families = {read(n)["model_type"] for n in files}
    assert families == {"llama", "mistral", "qwen2", "gpt2", "gpt_neox", "falcon", "gemma", "mixtral", "qwen2_moe",
                        "qwen3_moe", "deepseek_v3", "gpt_oss"}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_count_matches_published(name):
    m = load_model(hf(name))
    assert m.name == name
    assert m.num_params() == PUBLISHED[name]
    for field, value in EXPECTED[name].items():
        assert getattr(m, field) == value, field


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_round_trip(name):
    m = load_model(hf(name))
    d = m.to_dict()
    assert ModelSpec.from_dict(json.loads(json.dumps(d))) == m


def test_shapes_of_the_special_heads():
    g7 = load_model(hf("gemma-7b"))
    assert (g7.head_size, g7.q_size, g7.kv_size) == (256, 4096, 4096)  # 16 heads of 256 on a 3072 stream
    assert g7.hidden_size == 3072
    g2 = load_model(hf("gemma-2b"))
    assert (g2.head_size, g2.q_size, g2.kv_size) == (256, 2048, 256)  # multi-query
    f7 = load_model(hf("falcon-7b"))
    assert (f7.head_size, f7.kv_size, f7.norms_per_block) == (64, 64, 1)
    neox = load_model(hf("gpt-neox-20b"))
    assert (neox.head_size, neox.rotary_dim) == (96, 24)
    assert load_model(hf("pythia-1.4b")).rotary_dim == 32


def test_flops_count_the_wider_heads():
    """Attention FLOPs follow q = heads x head_dim: Gemma-7B's core is 4*s*4096 per token, not 4*s*3072."""
    g7 = load_model(hf("gemma-7b"))
    h, q, kv, f, s = 3072, 4096, 4096, 24576, g7.seq_length
    assert g7.layer_forward_flops_per_token() == 2 * (h * (q + 2 * kv) + q * h + 3 * h * f) + 4 * s * q
    assert g7.model_flops_per_token() == 3 * (28 * g7.layer_forward_flops_per_token() + 2 * 256000 * h)


# -- old documents and presets are unchanged ------------------------------------------------------------

def test_presets_write_no_new_fields():
    for n in preset_names():
        if preset(n).is_moe:  # the mixture-of-experts presets came with these fields (test_moe_model.py)
            continue
        d = preset(n).to_dict()
        assert not {"head_dim", "qkv_bias", "parallel_attention", "shared_norm", "rotary_fraction"} & set(d), n
        assert ModelSpec.from_dict(d) == preset(n)


def test_yaml_with_the_new_fields(tmp_path):
    p = tmp_path / "falconish.yaml"
    p.write_text("num_layers: 2\nhidden_size: 96\nnum_attention_heads: 4\nnum_kv_heads: 2\nffn_hidden_size: 128\n"
                 "vocab_size: 100\nseq_length: 16\nactivation: geglu\nnorm: rmsnorm\nposition_embedding: rope\n"
                 "head_dim: 32\nqkv_bias: true\nparallel_attention: true\nshared_norm: true\nrotary_fraction: 0.5\n")
    m = load_model(str(p))
    assert (m.q_size, m.kv_size, m.rotary_dim, m.norms_per_block) == (128, 64, 16, 1)
    assert m.to_dict()["head_dim"] == 32 and ModelSpec.from_dict(m.to_dict()) == m


@pytest.mark.parametrize("kw,needle", [
    (dict(shared_norm=True), "shared_norm=true needs parallel_attention"),
    (dict(rotary_fraction=0.5), "needs position_embedding 'rope'"),
    (dict(position_embedding="rope", rotary_fraction=0.1), "rotary_fraction=0.1 rotates 1 of the 16"),
    (dict(position_embedding="rope", rotary_fraction=0.0), r"rotary_fraction=0.0 must be a number in \(0, 1\]"),
    (dict(head_dim=0), "head_dim=0 must be null or an integer"),
    (dict(hidden_size=66), r"hidden_size\(66\) is not divisible by num_attention_heads\(4\) \(set head_dim"),
    (dict(activation="reglu"), "activation='reglu'; valid: gelu, swiglu, geglu"),
    (dict(qkv_bias=1), "qkv_bias=1 must be true or false"),
])
def test_bad_new_fields(kw, needle):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=4, ffn_hidden_size=8,
                vocab_size=10, seq_length=8)
    with pytest.raises(UserError, match=needle) as e:
        ModelSpec(**{**base, **kw})
    assert "\n" not in str(e.value)


def test_head_dim_lifts_the_divisibility_rule():
    m = ModelSpec(num_layers=1, hidden_size=66, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=8,
                  vocab_size=10, seq_length=8, head_dim=16)
    assert (m.q_size, m.kv_size) == (64, 32)


# -- the reading rules and refusals -------------------------------------------------------------------------

def test_sliding_window_sets_and_bounds_the_sequence():
    cfg = read("Mistral-7B-v0.1")
    assert from_hf_config(cfg).seq_length == 4096  # max_position_embeddings 32768, window 4096
    assert load_model(hf("Mistral-7B-v0.1"), seq_length=2048).seq_length == 2048
    with pytest.raises(UserError, match="sequence length 8192 exceeds sliding_window=4096.*up to 4096"):
        load_model(hf("Mistral-7B-v0.1"), seq_length=8192)
    assert from_hf_config({**cfg, "sliding_window": None}).seq_length == 32768  # Mistral v0.2 and later
    # Qwen2 keeps sliding_window in its config but does not use it
    assert load_model(hf("Qwen2-7B"), seq_length=200_000).seq_length == 200_000
    assert from_hf_config({**read("Qwen2-7B"), "use_sliding_window": True, "sliding_window": 4096}).seq_length == 4096


def test_unknown_llama_like_type_loads():
    cfg = {**read("Meta-Llama-3-8B"), "model_type": "my_llama", "architectures": ["MyLlamaForCausalLM"]}
    assert from_hf_config(cfg).num_params() == PUBLISHED["Meta-Llama-3-8B"]
    cfg = {k: v for k, v in read("Meta-Llama-3-8B").items() if k != "model_type"}
    assert from_hf_config(cfg).num_params() == PUBLISHED["Meta-Llama-3-8B"]


def test_family_defaults_when_keys_are_absent():
    # transformers' config-class defaults: GPT-NeoX untied with rotary_pct 0.25 and parallel residual,
    # Falcon multi-query, parallel, tied, 2048 positions, Gemma tied
    neox = {k: v for k, v in read("pythia-1.4b").items()
            if k not in ("tie_word_embeddings", "rotary_pct", "use_parallel_residual")}
    assert from_hf_config(neox).num_params() == PUBLISHED["pythia-1.4b"]
    falcon = {k: v for k, v in read("falcon-7b").items() if k not in ("multi_query", "parallel_attn", "bias")}
    assert from_hf_config(falcon).num_params() == PUBLISHED["falcon-7b"]
    gemma = {k: v for k, v in read("gemma-2b").items() if k not in ("hidden_act",)}
    m = from_hf_config(gemma)
    assert m.num_params() == PUBLISHED["gemma-2b"] and m.activation == "geglu"
    # a sequential GPT-NeoX and a non-multi-query Falcon are read as such
    seq = from_hf_config({**read("pythia-1.4b"), "use_parallel_residual": False})
    assert not seq.parallel_attention and seq.num_params() == PUBLISHED["pythia-1.4b"]
    mha = from_hf_config({**read("falcon-7b"), "multi_query": False, "parallel_attn": False})
    assert (mha.num_kv_heads, mha.parallel_attention, mha.norms_per_block) == (71, False, 2)
    # the original RefinedWeb configs of Falcon
    rw = {k: v for k, v in read("falcon-40b").items() if k not in ("new_decoder_architecture", "num_kv_heads",
                                                                     "num_attention_heads", "num_hidden_layers")}
    rw.update(model_type="RefinedWeb", n_head_kv=8, n_head=128, n_layer=60)
    assert from_hf_config(rw).num_params() == PUBLISHED["falcon-40b"]


def test_gpt_bigcode_multi_query():
    """GPT-BigCode (StarCoder, SantaCoder) is GPT-2 with one K/V head; counts from transformers (meta device)."""
    cfg = {"model_type": "gpt_bigcode", "n_embd": 256, "n_head": 8, "n_layer": 3, "n_positions": 512,
           "vocab_size": 1000, "multi_query": True, "activation_function": "gelu_pytorch_tanh", "n_inner": None}
    m = from_hf_config(cfg)
    assert (m.num_kv_heads, m.position_embedding, m.bias, m.tied_embeddings) == (1, "learned", True, True)
    assert m.num_params() == 2_411_456
    assert from_hf_config({**cfg, "multi_query": False}).num_params() == 2_756_864


@pytest.mark.parametrize("base,change,needle", [
    ("Mistral-7B-v0.1", {"model_type": "phimoe", "num_local_experts": 8},
     r"num_local_experts=8: mixture-of-experts layers are not modelled"),
    ("Qwen2-7B", {"num_experts": 60}, "num_experts=60: mixture-of-experts"),
    ("falcon-7b", {"alibi": True}, "alibi=true: ALiBi attention biases are not modelled; valid: false"),
    ("gpt2", {"model_type": "gptj"}, r'model_type="gptj": gptj is not supported .*valid: llama, mistral'),
    ("gpt2", {"model_type": "bloom"}, "ALiBi"),
    ("gemma-7b", {"model_type": "gemma2"}, "four norms"),
    ("Meta-Llama-3-8B", {"hidden_act": "relu"}, r'hidden_act="relu": the gated MLP .*valid: silu'),
    ("gpt2", {"activation_function": "relu"}, r'activation_function="relu": a GPT-2 MLP'),
    ("Meta-Llama-3-8B", {"attention_bias": True}, "attention_bias=true: biases on the attention or on the MLP alone"),
    ("Meta-Llama-3-8B", {"mlp_bias": True}, "mlp_bias=true"),
    ("gpt2", {"is_encoder_decoder": True}, "is_encoder_decoder=true"),
    ("falcon-7b", {"apply_residual_connection_post_layernorm": True}, "post-norm residuals"),
    ("falcon-40b", {"num_ln_in_parallel_attn": 3}, "num_ln_in_parallel_attn=3: .*valid: 1, 2"),
    ("pythia-1.4b", {"rotary_pct": 1.5}, r"rotary_pct=1.5 is out of range"),
    ("pythia-1.4b", {"rotary_pct": 0.01}, "rotary_fraction=0.01 rotates 1 of the 128"),
    ("gemma-7b", {"head_dim": "256"}, "head_dim"),
    ("Meta-Llama-3-8B", {"num_kv_head": 8}, "did you mean 'num_kv_heads'"),
    ("gemma-7b", {"intermediate_size": None}, r"lacks intermediate_size \(model_type gemma, read as Llama-like\)"),
])
def test_refusals_are_one_line_and_name_the_key(base, change, needle):
    with pytest.raises(UserError, match=needle) as e:
        from_hf_config({**read(base), **change}, name=base)
    assert "\n" not in str(e.value)


def test_llama_with_all_biases():
    cfg = {**read("Llama-2-7b-hf"), "attention_bias": True, "mlp_bias": True}
    m = from_hf_config(cfg)
    h, f = 4096, 11008
    assert m.bias and m.num_params() == PUBLISHED["Llama-2-7b-hf"] + 32 * (3 * h + h + 2 * f + h)


# -- the tensor-parallel divisibility checks ----------------------------------------------------------------

@pytest.mark.parametrize("name,tp,reason", [
    ("falcon-7b", 2, "tp(2) does not divide num_attention_heads(71)"),
    ("falcon-40b", 8, None),
    ("falcon-40b", 16, "tp(16) does not divide num_kv_heads(8)"),
    ("gemma-7b", 8, None),  # q is 16 heads of 256: 2 heads a rank
    ("gemma-2b", 2, "tp(2) does not divide num_kv_heads(1)"),
    ("Qwen2-7B", 4, None),
    ("Qwen2-7B", 8, "tp(8) does not divide num_attention_heads(28)"),
])
def test_tp_divisibility(name, tp, reason):
    assert check(ParallelConfig(dp=1, pp=1, tp=tp, micro_batch_size=1, num_micro_batches=1), load_model(hf(name))) == reason


# -- the CLI path -----------------------------------------------------------------------------------------------

def _cli(*args):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "autoconf", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


@pytest.mark.parametrize("name,extra", [
    ("falcon-7b", ["--dp", "8", "--zero", "3"]),
    ("gemma-7b", ["--dp", "4", "--tp", "8", "--sequence-parallel", "--recompute", "selective"]),
    ("pythia-1.4b", ["--dp", "4", "--pp", "2", "--tp", "4", "--micro-batch-size", "2"]),
    ("Qwen2-0.5B", ["--dp", "32", "--seq-length", "4096"]),
])
def test_cli_estimate(name, extra):
    r = _cli("estimate", "--model", hf(name), "--cluster", "examples/clusters/a100-4x8.yaml", "--global-batch", "64",
             "--json", *extra)
    assert r.returncode == 0, r.stderr
    est = json.loads(r.stdout)
    m = load_model(hf(name), seq_length=4096 if "--seq-length" in extra else None)
    c = est["config"]
    assert est["step_time_s"] > 0 and 0 < est["mfu"] < 1
    if c["pp"] == 1 and c["tp"] == 1 and c["zero_stage"] == 0:  # every parameter on every device, in bf16
        assert est["memory_by_stage"][0]["parameters"] == 2 * m.num_params()


def test_cli_refuses_a_sequence_past_the_window():
    r = _cli("estimate", "--model", hf("Mistral-7B-v0.1"), "--cluster", "examples/clusters/a100-4x8.yaml",
             "--global-batch", "64", "--dp", "8", "--seq-length", "8192")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "sliding_window=4096" in r.stderr


def test_cli_refuses_tp_that_splits_a_head():
    r = _cli("estimate", "--model", hf("falcon-7b"), "--cluster", "examples/clusters/a100-4x8.yaml",
             "--global-batch", "64", "--dp", "4", "--tp", "2")
    assert r.returncode == 2 and "num_attention_heads(71)" in r.stderr


# -- the trainer's model builds what ModelSpec prices -----------------------------------------------------------

def tiny(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=96,
                vocab_size=101, seq_length=32, norm="rmsnorm", position_embedding="rope", dtype="fp32")
    return ModelSpec(**{**base, **kw})


FEATURES = {  # a tiny model of each shape feature the families need
    "geglu": tiny(activation="geglu"),
    "head_dim": tiny(activation="swiglu", head_dim=24),  # q = 96 on a 64-wide stream, kv = 48
    "qkv_bias": tiny(activation="swiglu", qkv_bias=True, tied_embeddings=True),
    "neox": tiny(activation="gelu", norm="layernorm", bias=True, parallel_attention=True, rotary_fraction=0.25,
                 num_kv_heads=4),
    "falcon7b": tiny(activation="gelu", norm="layernorm", parallel_attention=True, shared_norm=True, num_kv_heads=1,
                     tied_embeddings=True),
    "falcon40b": tiny(activation="gelu", norm="layernorm", parallel_attention=True, bias=True),
    "gemma7b": tiny(activation="geglu", head_dim=32, num_kv_heads=4, tied_embeddings=True),
    "everything": tiny(activation="geglu", head_dim=20, qkv_bias=True, parallel_attention=True, shared_norm=True,
                       rotary_fraction=0.5, dropout=0.1, attention="eager"),
}


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_nn_param_count_is_the_spec(name):
    torch = pytest.importorskip("torch")
    from autoconf.trainer.layers import GPT

    m = FEATURES[name]
    model = GPT(m)
    assert sum(p.numel() for p in model.parameters()) == m.num_params()
    blk = model.blocks["0"]
    assert sum(p.numel() for p in blk.parameters()) == m.layer_params()
    assert blk.qkv.weight.shape == (m.q_size + 2 * m.kv_size, m.hidden_size)
    assert blk.proj.weight.shape == (m.hidden_size, m.q_size)
    assert (blk.norm2 is None) == m.shared_norm
    assert model(torch.randint(0, 101, (2, 32))).shape == (2, 32, 101)


# (feature, b, dtype, recompute, attention, dropout, tp, sp)
SAVED_CASES = [(n, 2, "bf16", "none", "flash", 0.0, 1, False) for n in sorted(FEATURES)] + [
    ("neox", 2, "bf16", "none", "eager", 0.1, 1, False),
    ("neox", 2, "fp32", "selective", "eager", 0.1, 2, True),
    ("falcon7b", 2, "bf16", "none", "eager", 0.1, 1, False),
    ("falcon7b", 1, "bf16", "full", "flash", 0.0, 1, False),
    ("falcon40b", 2, "bf16", "none", "flash", 0.0, 2, True),
    ("falcon40b", 2, "bf16", "selective", "eager", 0.1, 2, False),
    ("gemma7b", 2, "bf16", "none", "eager", 0.0, 1, False),
    ("gemma7b", 2, "fp32", "none", "flash", 0.0, 4, True),
    ("head_dim", 1, "bf16", "none", "eager", 0.1, 2, True),
    ("qkv_bias", 2, "bf16", "selective", "flash", 0.1, 2, True),
    ("everything", 2, "bf16", "none", "eager", 0.1, 2, True),
    ("everything", 2, "fp32", "full", "eager", 0.1, 2, True),
]


@pytest.mark.parametrize("case", SAVED_CASES, ids=lambda c: "-".join(map(str, c)))
def test_nn_saved_bytes_match_formula(case):
    """autoconf.trainer.layers's block keeps for backward exactly what cost/activations.py prices (term by term)."""
    torch = pytest.importorskip("torch")
    from autoconf.trainer.layers import Block
    from profiler.memory import saved_activation_bytes

    name, b, dtype, rc, att, p, tp, sp = case
    m = dataclasses.replace(FEATURES[name], dtype=dtype, attention=att, dropout=p)
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    block = Block(m, tp_size=tp, sequence_parallel=sp, recompute=rc, dtype=dt)
    x = torch.randn(b, m.seq_length // tp if sp else m.seq_length, m.hidden_size, dtype=dt, requires_grad=True)
    got = saved_activation_bytes(block, x)
    assert got == layer_activation_bytes(m, b, tp, sp, rc, mask_bytes=dt.itemsize)["total"]


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_nn_flops_match_the_spec(name):
    """Matrix FLOPs counted on the torch module (eager attention: every score computed) are the spec's
    forward FLOPs per token, 3x that with the backward; and cost/compute.py prices the same FLOPs."""
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    from autoconf.trainer.layers import GPT, Block

    m = dataclasses.replace(FEATURES[name], attention="eager", dropout=0.0)
    tokens = 2 * m.seq_length
    block = Block(m)
    x = torch.randn(2, m.seq_length, m.hidden_size, requires_grad=True)
    with FlopCounterMode(display=False) as fwd:
        y = block(x)
    assert fwd.get_total_flops() == tokens * m.layer_forward_flops_per_token()
    with FlopCounterMode(display=False) as bwd:
        y.sum().backward()
    assert bwd.get_total_flops() == 2 * tokens * m.layer_forward_flops_per_token()
    model = GPT(m)
    tok = torch.randint(0, m.vocab_size, (2, m.seq_length))
    with FlopCounterMode(display=False) as whole:
        model(tok, tok).backward()
    assert whole.get_total_flops() == tokens * m.model_flops_per_token()
    # the roofline with every GEMM at peak and free memory traffic: time = FLOPs / peak
    rf = Roofline(1e12, 1e30, 1.0, 1.0, 0.0, gemm_eff=lambda *a: 1.0)
    t = block_times(m, 2, 1, False, "none", rf)
    assert t.forward_s == pytest.approx(tokens * m.layer_forward_flops_per_token() / 1e12, rel=1e-9)
    assert t.backward_s == pytest.approx(2 * t.forward_s, rel=1e-9)


def test_profiler_gemm_shapes_use_q():
    pytest.importorskip("torch")
    from profiler.compute import gemm_shapes

    m = dataclasses.replace(load_model(hf("gemma-7b")), seq_length=16)
    shapes = gemm_shapes(m, [1], [2], quick=True, cuda=False)
    assert (16, (4096 + 2 * 4096) // 2, 3072) in shapes  # fused qkv
    assert (16, 3072, 4096 // 2) in shapes  # output projection
    assert (16, 24576, 3072) in shapes  # fused gate_up shard (2f / tp)


def test_profile_of_a_sequential_block_does_not_apply_to_a_parallel_one():
    from autoconf.specs.profile import COMPUTE_FIELDS

    for field in ("head_dim", "qkv_bias", "parallel_attention", "shared_norm", "rotary_fraction"):
        assert field in COMPUTE_FIELDS["block"]


# -- tensor parallelism over 2 gloo ranks: the new shapes give the single-process loss and gradients -------

TP_FEATURES = ["falcon40b", "gemma7b", "neox"]
TP_EXTRA = tiny(activation="geglu", head_dim=20, qkv_bias=True, parallel_attention=True, shared_norm=True,
                rotary_fraction=0.5, tied_embeddings=True)


def test_tensor_parallel_gloo_matches_single_process():
    pytest.importorskip("torch")
    from tests.trainer.test_nn import run_tp_workers  # the same two-rank TP check, on the new shape features

    results = run_tp_workers([(n, FEATURES[n]) for n in TP_FEATURES] + [("extra", TP_EXTRA)], timeout=180)
    for _, worst in results:
        assert len(worst) == 16
        assert max(worst.values()) < 1e-5, worst


def test_long_context_config_searches_with_context_parallelism():
    from autoconf.cost.estimate import estimate
    from autoconf.specs.cluster import load_cluster
    m = load_model(hf("Llama-3.1-8B"))
    h100 = load_cluster(os.path.join(ROOT, "examples", "clusters", "h100-8x8.yaml"))
    c = ParallelConfig(dp=1, pp=1, tp=8, cp=8, micro_batch_size=1, num_micro_batches=4, sequence_parallel=True)
    assert check(c, m) is None
    e = estimate(c, m, h100, framework="megatron")
    assert e.fits and e.breakdown_s["cp_comm"] >= 0.0


def test_a_hugging_face_config_gets_the_model_files_ranges(tmp_path):
    """A config.json is held to the same ranges as a model file: ten million experts are refused
    with the key's name, not priced."""
    doc = json.loads(open(os.path.join(HF_DIR, "Mixtral-8x7B-v0.1.json")).read())
    doc["num_local_experts"] = 10_000_000
    p = tmp_path / "config.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(UserError, match="num_experts"):
        load_model(str(p))
