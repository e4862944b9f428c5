"""Size limits: what is out of range is refused before anything is built from it.

Before (issue "Hardening, second round"): a Hugging Face config of 16,777,216 layers was refused
after 9-15 s and 0.5-0.8 GB (a per-layer list came before the range check).
"""

import json
import tracemalloc

import pytest

from autoconf.errors import UserError
from autoconf.specs.hf import from_hf_config, load_model
from autoconf.specs.model import LIMITS

HF_MAX = 1 << 24
"""The largest integer a config.json key may hold (``hf.HF_KEYS``): 16,777,216."""

BASE = dict(hidden_size=4096, num_attention_heads=32, num_hidden_layers=32, vocab_size=32000,
            intermediate_size=11008, max_position_embeddings=4096)


def refused_cheaply(fn, match: str) -> None:
    """``fn`` raises a one-line UserError matching ``match`` while holding under 8 MB of Python
    memory (reading a file, imports on first use; the per-layer lists of 16,777,216 blocks took
    755 MB under tracemalloc)."""
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match=match) as err:
            fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "\n" not in str(err.value)
    assert peak < 8 << 20, f"{peak:,} bytes held before the refusal"


# -- models ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["llama", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral",
                                        "gpt2", "falcon", "gpt_neox"])
def test_hf_layers_out_of_range_are_refused_before_the_blocks_are_laid_out(model_type):
    cfg = dict(BASE, model_type=model_type, num_hidden_layers=HF_MAX)
    lo, hi = LIMITS["num_layers"]
    refused_cheaply(lambda: from_hf_config(cfg),
                    rf"^model hf: num_layers={HF_MAX} is out of range; expected an integer in \[{lo}, {hi}\]$")


@pytest.mark.parametrize("key,field", [("hidden_size", "hidden_size"), ("num_attention_heads", "num_attention_heads"),
                                       ("intermediate_size", "ffn_hidden_size"),
                                       ("num_key_value_heads", "num_kv_heads")])
def test_hf_shape_out_of_range_is_refused_first(key, field):
    # a qwen2_moe config lays its blocks out one by one: the shape's ranges come before that (the
    # vocabulary's range is the config's own, 1 .. 2^24)
    cfg = dict(BASE, model_type="qwen2_moe", num_hidden_layers=4096, **{key: HF_MAX})
    refused_cheaply(lambda: from_hf_config(cfg), rf"model hf: {field}={HF_MAX} is out of range")


@pytest.mark.parametrize("model_type,key", [("qwen2_moe", "num_experts"), ("qwen3_moe", "num_experts"),
                                            ("deepseek_v3", "n_routed_experts"), ("mixtral", "num_local_experts")])
def test_hf_experts_out_of_range_are_refused_before_the_layout(model_type, key):
    # mlp_only_layers that fit no layout: the expert count's range is what is reported
    cfg = dict(BASE, model_type=model_type, num_hidden_layers=4096, **{key: HF_MAX},
               mlp_only_layers=[1, 2, 5], n_group=1)
    refused_cheaply(lambda: from_hf_config(cfg), rf"model hf: num_experts={HF_MAX} is out of range")


def test_hf_model_file_with_too_many_layers_is_refused_at_once(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(BASE, model_type="deepseek_v3", num_hidden_layers=HF_MAX)))
    refused_cheaply(lambda: load_model(str(path)), rf"model config: num_layers={HF_MAX} is out of range")


def test_hf_models_in_range_still_load():
    for model_type in ("qwen2_moe", "deepseek_v3", "gpt_oss"):
        m = from_hf_config(dict(BASE, model_type=model_type, num_hidden_layers=4096))
        assert m.num_layers == 4096 and m.is_moe
