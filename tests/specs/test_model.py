import json

import pytest

from autoconf.errors import UserError
from autoconf.specs.hf import from_hf_config, load_model
from autoconf.specs.model import ModelSpec, preset, preset_names

PUBLISHED = {  # parameter counts as published (model cards / papers)
    "gpt2": 124.4e6, "gpt2-medium": 354.8e6, "gpt2-large": 774.0e6, "gpt2-xl": 1557.6e6,
    "gpt3-175b": 174.6e9, "llama-2-7b": 6.74e9, "llama-2-13b": 13.02e9, "llama-2-70b": 68.98e9,
    "llama-3-8b": 8.03e9, "llama-3-70b": 70.55e9, "llama-3-405b": 405.85e9, "mistral-7b": 7.24e9,
}


@pytest.mark.parametrize("name,count", sorted(PUBLISHED.items()))
def test_param_counts_match_published(name, count):
    assert preset(name).num_params() == pytest.approx(count, rel=2e-3)


def test_required_presets_exist():
    need = {"tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b",
            "gpt3-13b", "gpt3-175b", "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b",
            "llama-3-405b", "mistral-7b"}
    assert need <= set(preset_names())


def test_flops_match_narayanan_for_gpt():
    m = preset("gpt3-175b")
    l, h, s, V = m.num_layers, m.hidden_size, m.seq_length, m.vocab_size
    assert m.model_flops_per_token() * s == pytest.approx(72 * s * l * h * h * (1 + s / (6 * h) + V / (12 * h * l)))


def test_unknown_preset_names_valid_ones():
    with pytest.raises(UserError, match="llama-3-8b"):
        preset("llama-9")


def test_yaml_model(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nnum_kv_heads: 2\nffn_hidden_size: 128\n"
                 "vocab_size: 100\nseq_length: 16\nactivation: swiglu\ntied_embeddings: true\ndtype: bf16\n")
    m = load_model(str(p))
    assert m.name == "m" and m.kv_size == 32 and m.tied_embeddings


@pytest.mark.parametrize("text,needle", [("num_layers: [\n", "not valid YAML"),
                                         ("num_layers: 2\nbogus: 1\n", "bogus"),
                                         ("num_layers: 2\n", "missing")])
def test_bad_yaml_model(tmp_path, text, needle):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(UserError, match=needle):
        load_model(str(p))


def test_hf_config_llama3(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
           "max_position_embeddings": 8192, "hidden_act": "silu", "tie_word_embeddings": False,
           "torch_dtype": "bfloat16"}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    m = load_model(str(p))
    assert m.num_params() == preset("llama-3-8b").num_params()


def test_hf_config_gpt2():
    m = from_hf_config({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
                        "n_positions": 1024, "activation_function": "gelu_new"})
    assert m.num_params() == preset("gpt2").num_params()


def test_invalid_shapes():
    with pytest.raises(UserError, match="num_attention_heads"):
        ModelSpec(num_layers=2, hidden_size=65, num_attention_heads=4, num_kv_heads=4, ffn_hidden_size=8,
                  vocab_size=10, seq_length=8)
