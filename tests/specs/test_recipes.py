"""Framework releases and recipe presets (specs.frameworks.RECIPES): named, stated in the output,
and priced as the framework's own code runs them (Megatron-Bridge 0.3.1's recipes)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from autoconf import ParallelConfig, estimate
from autoconf.cost.layout import linear_params_per_layer
from autoconf.errors import UserError
from autoconf.launch.megatron import megatron_args
from autoconf.launch.plan import LaunchPlan
from autoconf.specs.cluster import load_cluster
from autoconf.specs.frameworks import framework
from autoconf.specs.model import preset
from autoconf.specs.recipes import RECIPES, framework_spec, recipe_text

H100 = load_cluster("examples/clusters/h100-8x8.yaml")


def test_the_default_recipe_is_the_framework_s_first_and_others_are_named():
    assert framework("megatron").recipe == "core-0.16" and framework_spec(framework("megatron")) == "megatron"
    bridge = framework("megatron:bridge-0.3")
    assert framework_spec(bridge) == "megatron:bridge-0.3" and bridge.name == "megatron"
    assert bridge.defaults["overlap_grad_reduce"] and bridge.defaults["overlap_param_gather"]
    assert bridge.fp8_param_gather and not framework("megatron").fp8_param_gather
    assert "Megatron-Bridge 0.3.1" in recipe_text(bridge)
    for name, recipes in RECIPES.items():
        for r in recipes:
            assert framework(f"{name}:{r}").recipe == r
    with pytest.raises(UserError, match="valid: megatron:core-0.16, megatron:bridge-0.3"):
        framework("megatron:bridge-9")


def test_fp8_parameters_hold_one_byte_per_linear_weight_less_twice():
    """FP8 parameters (fp8_param_gather): the linear weights at 1 byte instead of 2, and of the
    cached FP8 weight and transpose only the transpose left: 2 bytes per linear weight less."""
    m = dataclasses.replace(preset("llama-3-8b"), seq_length=4096)
    c = ParallelConfig(dp=8, pp=1, tp=2, micro_batch_size=1, num_micro_batches=4, zero_stage=1,
                       sequence_parallel=True, precision="fp8")
    core, bridge = (estimate(c, m, H100, framework=f).memory_by_stage[0] for f in ("megatron", "megatron:bridge-0.3"))
    linear = m.num_layers * linear_params_per_layer(m) / 2
    assert core.parameters - bridge.parameters == pytest.approx(linear)
    assert dict(core.other_parts)["fp8 weight copies"] - dict(bridge.other_parts)["fp8 weight copies"] == (
        pytest.approx(linear))
    assert estimate(c, m, H100, framework="megatron:bridge-0.3").framework == "megatron:bridge-0.3"


def test_a_plan_keeps_its_recipe_and_the_emitter_writes_what_was_priced():
    m = dataclasses.replace(preset("llama-3-8b"), seq_length=4096)
    c = ParallelConfig(dp=4, pp=1, tp=2, micro_batch_size=1, num_micro_batches=4, zero_stage=1,
                       sequence_parallel=True, precision="fp8")
    plan = LaunchPlan(config=c, model=m, framework="megatron:bridge-0.3")
    again = LaunchPlan.from_dict(plan.to_dict())
    assert again.framework == "megatron:bridge-0.3" and again.framework_name == "megatron"
    args = [str(a) for a in megatron_args(again)]
    assert "--fp8-param-gather" in args and "--overlap-grad-reduce" in args and "--overlap-param-gather" in args
    core = [str(a) for a in megatron_args(dataclasses.replace(plan, framework="megatron"))]
    assert "--fp8-param-gather" not in core and "--overlap-grad-reduce" not in core
    with pytest.raises(UserError, match="no recipe"):
        LaunchPlan(config=c, model=m, framework="megatron:nope")


def test_the_cli_refuses_an_unknown_recipe_in_one_line():
    p = subprocess.run([sys.executable, "-m", "autoconf", "estimate", "--model", "llama-3-8b", "--cluster",
                        "examples/clusters/h100-8x8.yaml", "--global-batch", "64", "--framework", "megatron:nope",
                        "--dp", "8", "--pp", "1", "--tp", "1"], capture_output=True, text=True)
    assert p.returncode == 2 and "no recipe 'nope'" in p.stderr and "Traceback" not in p.stderr


def test_search_prices_with_the_recipe_and_keys_its_study_by_it():
    from autoconf.study.search import search
    m = dataclasses.replace(preset("llama-3-8b"), seq_length=2048)
    cl = load_cluster("examples/clusters/h100-8x8.yaml")
    core = search(m, cl, 64, gpus=8, top=1, framework="megatron", precision="bf16")
    bridge = search(m, cl, 64, gpus=8, top=1, framework="megatron:bridge-0.3", precision="bf16")
    assert bridge.top[0].framework == "megatron:bridge-0.3" and core.top[0].framework == "megatron"
    assert bridge.study_name != core.study_name and "bridge-0.3" in bridge.study_name


def test_torchtitan_on_older_torch_runs_flashattention_2_on_hopper_only():
    """torchtitan:torch-2.6: SDPA ran FlashAttention-2 on Hopper (cuDNN's attention opt-in then);
    the attention core is priced at the catalog's flash2 rate there, the other terms alike, and
    nothing changes on an A100 (FlashAttention-2 is its default kernel already)."""
    from autoconf.cost.attention import attention_core_times
    from autoconf.cost.roofline import Roofline
    from autoconf.specs.devices import device_type
    old = framework("torchtitan:torch-2.6")
    assert old.attention_kernel == "flash2" and framework("torchtitan").attention_kernel == ""
    m = dataclasses.replace(preset("llama-3-8b"), seq_length=16384)
    h100 = device_type("h100-sxm")
    new_f, new_b = attention_core_times(m, 1, 1, Roofline.of(h100, "bf16"))
    old_f, old_b = attention_core_times(m, 1, 1, Roofline.of(h100, "bf16", attention_kernel="flash2"))
    # compute-bound at 16K keys: the time scales with the inverse of the kernel's long-sequence rate
    # (the tile and launch terms are the same for both kernels)
    fa2, cudnn = h100.attention_kernels["flash2"], h100.attention_efficiency
    assert old_f / new_f == pytest.approx(cudnn["forward"] / fa2["forward"], rel=1e-3)
    assert old_b / new_b == pytest.approx(cudnn["backward"] / fa2["backward"], rel=1e-3)
    c = ParallelConfig(dp=8, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1, zero_stage=3)
    e_new, e_old = (estimate(c, m, H100, framework=f) for f in ("torchtitan", "torchtitan:torch-2.6"))
    assert e_old.breakdown_s["compute"] > e_new.breakdown_s["compute"]
    assert e_old.breakdown_s["dp_comm"] == pytest.approx(e_new.breakdown_s["dp_comm"])
    a100 = load_cluster("examples/clusters/a100-4x8.yaml")
    assert (estimate(c, m, a100, framework="torchtitan").step_time_s
            == estimate(c, m, a100, framework="torchtitan:torch-2.6").step_time_s)
