"""--emit with --framework: what Megatron-LM, torchtitan and DeepSpeed read, parsed back (bash, tomllib,
json) and, where the library is installed, loaded by the library itself; SLURM's sbatch.sh run
with stand-in srun / scontrol / torchrun."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
import tomllib

from autoconf.cost.estimate import estimate
from autoconf.launch.emit import emit
from autoconf.launch.plan import load as load_plan
from autoconf.space.config import ParallelConfig
from autoconf.specs.cluster import cluster_from_mapping, load_cluster
from autoconf.specs.model import ModelSpec, preset

A100 = load_cluster("examples/clusters/a100-4x8.yaml")
H100 = load_cluster("examples/clusters/h100-8x8.yaml")  # FP8 plans: A100 has no FP8 tensor cores
LLAMA = preset("llama-3-8b")
# torchtitan's llama3 debugmodel shape (6 layers, dim 256): its module names can be checked on the real model
DEBUG = ModelSpec(num_layers=6, hidden_size=256, num_attention_heads=16, num_kv_heads=16, ffn_hidden_size=768,
                  vocab_size=2048, seq_length=2048, activation="swiglu", norm="rmsnorm", position_embedding="rope",
                  name="llama3-debug")


def cfg(**kw) -> ParallelConfig:
    return ParallelConfig(**{"dp": 1, "pp": 1, "tp": 1, "micro_batch_size": 1, "num_micro_batches": 1, **kw})


def emitted(tmp_path, config, framework, model=LLAMA, cluster=None, **kw) -> dict:
    cluster = cluster or (H100 if config.precision == "fp8" else A100)
    files = emit(estimate(config, model, cluster, framework=framework), model, cluster, str(tmp_path), **kw)
    return {os.path.basename(f): f for f in files}


def bash_array(path, *names) -> list:
    """The words of bash arrays (and plain variables) defined by sourcing ``path``, as bash sees them."""
    script = 'source "$1"; shift; for n in "$@"; do eval "printf \'%s\\0\' \\"\\${$n[@]}\\""; done'
    out = subprocess.run(["bash", "-c", script, "_", str(path), *names], capture_output=True, text=True, check=True)
    return out.stdout.split("\0")[:-1]


def options(words) -> dict:
    """--flag value / --flag v1 v2 (a list) / --flag (true) -> {flag_with_underscores: value}."""
    out, i = {}, 0
    while i < len(words):
        key = words[i][2:].replace("-", "_")
        j = i + 1
        while j < len(words) and not words[j].startswith("--"):
            j += 1
        vals = words[i + 1:j]
        out[key] = True if not vals else vals[0] if len(vals) == 1 else list(vals)
        i = j
    return out


def bash_n(path):
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# -- Megatron-LM ------------------------------------------------------------------------------------

MEGATRON_CASES = {
    "interleaved": cfg(dp=2, pp=4, tp=4, micro_batch_size=1, num_micro_batches=8, schedule="interleaved",
                       virtual_stages=2, recompute="selective", sequence_parallel=True, zero_stage=1,
                       overlap_grad_reduce=True, overlap_param_gather=True),
    "uneven": cfg(dp=4, pp=4, tp=2, micro_batch_size=2, num_micro_batches=4, stage_layers=(7, 9, 9, 7),
                  recompute="full"),
    "uneven-interleaved": cfg(dp=1, pp=2, tp=8, micro_batch_size=1, num_micro_batches=4, schedule="interleaved",
                              virtual_stages=2, stage_layers=(7, 9, 9, 7), sequence_parallel=True),
    "cp-fp8": cfg(dp=2, pp=2, tp=4, cp=2, micro_batch_size=1, num_micro_batches=4, schedule="interleaved",
                  virtual_stages=2, sequence_parallel=True, zero_stage=1, precision="fp8", fp8_recipe="tensorwise"),
    # ZeRO-3 is Megatron FSDP (megatron-core's optim_grads_params sharding)
    "fsdp": cfg(dp=8, pp=1, tp=1, micro_batch_size=1, num_micro_batches=4, zero_stage=3,
                overlap_grad_reduce=True, overlap_param_gather=True),
}


@pytest.mark.parametrize("case", MEGATRON_CASES)
def test_megatron_args_parse_back_to_the_plan(tmp_path, case):
    c = MEGATRON_CASES[case]
    files = emitted(tmp_path, c, "megatron")
    assert {"config.json", "megatron_args.sh", "node-0.sh", "sbatch.sh", "PLAN.md"} <= set(files)
    bash_n(files["megatron_args.sh"])
    o = options(bash_array(files["megatron_args.sh"], "MEGATRON_ARGS"))
    assert int(o["tensor_model_parallel_size"]) == c.tp and int(o["pipeline_model_parallel_size"]) == c.pp
    assert int(o["micro_batch_size"]) == c.micro_batch_size and int(o["global_batch_size"]) == c.global_batch
    assert o.get("sequence_parallel", False) == c.sequence_parallel
    assert (o.get("use_distributed_optimizer", False) is True) == (c.zero_stage in (1, 3))
    assert (o.get("use_megatron_fsdp", False) is True) == (c.zero_stage == 3)
    assert o.get("data_parallel_sharding_strategy") == ("optim_grads_params" if c.zero_stage == 3 else None)
    assert o.get("recompute_granularity", "none") == c.recompute
    if c.recompute == "full":
        assert o["recompute_method"] == "uniform" and o["recompute_num_layers"] == "1"
    assert int(o["num_layers"]) == 32 and o["num_query_groups"] == "8" and o["group_query_attention"] is True
    assert o["swiglu"] and o["normalization"] == "RMSNorm" and o["position_embedding_type"] == "rope"
    assert o["untie_embeddings_and_output_weights"] and o["disable_bias_linear"] and o["bf16"]
    assert int(o.get("context_parallel_size", 1)) == c.cp and o.get("cp_comm_type") == ("p2p" if c.cp > 1 else None)
    assert o.get("fp8_format") == ("hybrid" if c.precision == "fp8" else None)
    assert o.get("fp8_recipe") == (c.fp8_recipe if c.precision == "fp8" else None)
    if c.pp == 1:
        assert "pipeline_model_parallel_layout" not in o
    elif c.stage_layers is None:
        assert o["num_layers_per_virtual_pipeline_stage"] == str(32 // (c.pp * c.virtual_stages))
    else:
        stages = o["pipeline_model_parallel_layout"].split("|")
        assert len(stages) == c.pp * c.virtual_stages and stages[0].startswith("E") and stages[-1].endswith("L")
    node = open(files["node-0.sh"]).read()
    assert 'source ./megatron_args.sh' in node and '/pretrain_gpt.py" "${MEGATRON_ARGS[@]}" "$@"' in node
    if c.world_size > 8:  # 8 GPUs per a100-4x8 host
        assert f"--nnodes={c.world_size // 8}" in node and "--node-rank=0" in node
    # the asynchronous tensor-parallel backward the cost model prices needs one hardware queue
    assert ("export CUDA_DEVICE_MAX_CONNECTIONS=1" in node) == (c.tp > 1)
    # Megatron's data-parallel size is world / (tp x pp x cp): the global batch splits into the plan's micro-batches
    assert int(o["global_batch_size"]) == c.world_size // (c.tp * c.pp * c.cp) * c.micro_batch_size * c.num_micro_batches


@pytest.mark.parametrize("case", MEGATRON_CASES)
def test_megatron_core_builds_its_configs_from_the_emitted_args(tmp_path, case):
    """megatron-core's own ModelParallelConfig / TransformerConfig / DistributedDataParallelConfig and
    micro-batch calculator, built from megatron_args.sh as Megatron-LM's arguments.py maps its
    arguments (same field names; --swiglu, --disable-bias-linear, --bf16, the layout and the
    virtual-stage count as arguments.py derives them): their own validation runs on our values."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    import dataclasses

    import torch
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend, LayerType

    c = MEGATRON_CASES[case]
    o = options(bash_array(emitted(tmp_path, c, "megatron")["megatron_args.sh"], "MEGATRON_ARGS"))
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    kw = {}
    for k, v in o.items():
        if k in names:
            kw[k] = v if v is True or not v.replace(".", "").isdigit() else (float(v) if "." in v else int(v))
    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}  # --fp8-format sets TransformerConfig.fp8
    assert fields["fp8"].metadata["argparse_meta"]["arg_names"] == ["--fp8-format"] and "fp8" not in o
    if "fp8_format" in o:
        kw["fp8"] = o["fp8_format"]
    kw["attention_backend"] = AttnBackend[o["attention_backend"]]
    kw["gated_linear_unit"], kw["activation_func"] = True, F.silu
    kw["add_bias_linear"] = not o.get("disable_bias_linear", False)
    kw["params_dtype"] = kw["pipeline_dtype"] = torch.bfloat16
    if "num_layers_per_virtual_pipeline_stage" in o:
        kw["virtual_pipeline_model_parallel_size"] = (kw["num_layers"] // c.pp
                                                      // int(o["num_layers_per_virtual_pipeline_stage"]))
    if "pipeline_model_parallel_layout" in o and c.virtual_stages > 1:
        kw["virtual_pipeline_model_parallel_size"] = len(o["pipeline_model_parallel_layout"].split("|")) // c.pp
    tc = TransformerConfig(**kw)
    assert tc.virtual_pipeline_model_parallel_size == (c.virtual_stages if c.virtual_stages > 1 else None)
    assert (tc.context_parallel_size, tc.cp_comm_type) == (c.cp, "p2p" if c.cp > 1 else None)
    if c.precision == "fp8":
        from megatron.core.enums import Fp8Recipe

        assert tc.fp8 == "hybrid" and Fp8Recipe(tc.fp8_recipe).value == c.fp8_recipe
    else:
        assert tc.fp8 is None
    if c.stage_layers is not None:  # the layout megatron-core parsed gives each chunk the plan's blocks
        layout = tc.pipeline_model_parallel_layout.layout
        got = [layout[i % c.pp][i // c.pp].count(LayerType.decoder) for i in range(c.num_chunks)]
        assert got == list(c.stage_layers)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=o.get("use_distributed_optimizer", False),
                                        overlap_grad_reduce=o.get("overlap_grad_reduce", False),
                                        overlap_param_gather=o.get("overlap_param_gather", False),
                                        use_megatron_fsdp=o.get("use_megatron_fsdp", False),
                                        data_parallel_sharding_strategy=o.get("data_parallel_sharding_strategy",
                                                                              "no_shard"))
    assert ddp.use_distributed_optimizer == (c.zero_stage in (1, 3))
    assert ddp.use_megatron_fsdp == (c.zero_stage == 3)
    calc = ConstantNumMicroBatchesCalculator(int(o["global_batch_size"]), int(o["micro_batch_size"]), c.dp,
                                             decrease_batch_size_if_needed=False, rank=0)
    assert calc.get() == c.num_micro_batches


def test_megatron_says_what_it_cannot_express(tmp_path):
    from autoconf.launch.gaps import gaps
    from autoconf.launch.megatron import megatron_file
    from autoconf.launch.plan import LaunchPlan

    placed = cfg(dp=2, pp=2, tp=8, micro_batch_size=1, num_micro_batches=4,
                 device_order=tuple(range(16, 32)) + tuple(range(16)), rank_order="dp-tp-pp")
    plan = LaunchPlan(placed, LLAMA, A100, framework="megatron")
    text = megatron_file(plan, "header\n")
    assert "cannot express" in text and "device_order 16,17" in text and "rank order dp-tp-pp" in text
    assert all(line.startswith("#") for line in text.split("MEGATRON_ARGS=(")[0].splitlines())
    assert gaps(LaunchPlan(cfg(dp=2, micro_batch_size=1, num_micro_batches=2), LLAMA, A100,
                           framework="megatron"), "megatron") == []
    # cp with the rank order written in full is Megatron's own; rowwise FP8 is not among its recipes
    assert gaps(LaunchPlan(cfg(dp=2, cp=2, micro_batch_size=1, num_micro_batches=2, rank_order="tp-cp-dp-pp",
                               precision="fp8", fp8_recipe="delayed"), LLAMA, framework="megatron"),
                "megatron") == []
    rowwise = LaunchPlan(cfg(dp=2, micro_batch_size=1, num_micro_batches=2, precision="fp8", fp8_recipe="rowwise"),
                         LLAMA)
    assert [g for g in gaps(rowwise, "megatron") if g.startswith("rowwise FP8")]
    assert "--fp8-recipe" not in megatron_file(rowwise, "header\n").split("MEGATRON_ARGS=(")[1]


# -- mixture of experts ------------------------------------------------------------------------------

import dataclasses as _dc  # noqa: E402

MOE = _dc.replace(LLAMA, num_experts=8, experts_per_token=2, expert_ffn_hidden_size=2048, name="llama-moe")
MOE_CASES = {  # (model, config)
    "dropless": (MOE, cfg(dp=4, tp=2, micro_batch_size=1, num_micro_batches=2, zero_stage=1, ep=4,
                          ep_comm_overlap=True)),
    "deepseek-like": (_dc.replace(MOE, num_shared_experts=2, shared_expert_ffn_hidden_size=1024, first_dense_layers=3,
                                  router="sigmoid", router_groups=4, router_group_topk=2),
                      cfg(dp=2, pp=2, tp=2, cp=2, micro_batch_size=1, num_micro_batches=4, ep=2,
                          moe_capacity_factor=1.25, rank_order="tp-cp-dp-pp")),
    "every-other": (_dc.replace(MOE, moe_layer_freq=2), cfg(dp=8, micro_batch_size=1, num_micro_batches=2)),
    # MoE parallel folding: whole experts, the expert group over tp x dp (ep 8 = tp 2 x dp 4)
    "folded": (MOE, cfg(dp=4, tp=2, micro_batch_size=1, num_micro_batches=2, zero_stage=1, ep=8, expert_tp=1,
                        sequence_parallel=True)),
    "paired-interleaved": (MOE, cfg(dp=4, pp=2, micro_batch_size=1, num_micro_batches=4, zero_stage=1, ep=4,
                                    schedule="interleaved", virtual_stages=2, recompute="selective",
                                    recompute_modules=("layernorm", "moe_act"), ep_comm_overlap=True,
                                    moe_dispatcher="deepep")),
}


def _moe_plan(case, framework):
    from autoconf.launch.plan import LaunchPlan
    from autoconf.specs.frameworks import framework as framework_model

    m, c = MOE_CASES[case]
    if framework == "torchtitan" and c.zero_stage == 1:  # torchtitan has no ZeRO-1: FSDP
        c = _dc.replace(c, zero_stage=3)
    # a plan the framework cannot run (torchtitan drops no tokens) is made for the reference trainer:
    # the framework's files then say what they cannot express
    runs = framework_model(framework).check(c) is None
    if not runs:  # what the reference trainer cannot run either: Megatron's and DeepEP's own
        c = _dc.replace(c, ep_comm_overlap=None, moe_dispatcher="alltoall")
    return m, c, LaunchPlan(c, m, A100, framework=framework if runs else "reference")


def _megatron_moe_options(tmp_path, case):
    from autoconf.launch.megatron import megatron_file

    m, c, plan = _moe_plan(case, "megatron")
    path = tmp_path / "megatron_args.sh"
    path.write_text(megatron_file(plan, "header\n"))
    bash_n(path)
    return m, c, plan, options(bash_array(path, "MEGATRON_ARGS"))


def _layer_freq(text: str):
    """--moe-layer-freq as Megatron-LM reads it: an int, or a list expression (literal here)."""
    import ast

    return ast.literal_eval(text) if "[" in text else int(text)


@pytest.mark.parametrize("case", MOE_CASES)
def test_megatron_moe_args_parse_back_to_the_plan(tmp_path, case):
    m, c, plan, o = _megatron_moe_options(tmp_path, case)
    assert (int(o["num_experts"]), int(o["moe_router_topk"]), int(o["moe_ffn_hidden_size"])) == \
        (m.num_experts, m.experts_per_token, m.expert_ffn)
    assert int(o.get("moe_shared_expert_intermediate_size", 0)) == m.num_shared_experts * m.shared_expert_ffn
    deepep = c.moe_dispatcher == "deepep"
    assert o["moe_router_score_function"] == m.router
    assert o["moe_token_dispatcher_type"] == ("flex" if deepep else "alltoall")
    assert o.get("moe_flex_dispatcher_backend") == ("deepep" if deepep else None)
    assert o["moe_grouped_gemm"] is True and int(o.get("expert_model_parallel_size", 1)) == c.ep
    assert o.get("expert_tensor_parallel_size") == (None if c.expert_tp is None else str(c.expert_tp))
    assert o.get("moe_expert_capacity_factor") == (None if c.moe_capacity_factor is None else f"{c.moe_capacity_factor:g}")
    assert o.get("overlap_moe_expert_parallel_comm", False) is bool(c.ep_comm_overlap)
    assert (int(o.get("moe_router_num_groups", 0)), int(o.get("moe_router_group_topk", 0))) == \
        (m.router_groups, m.router_group_topk)
    mods = o.get("recompute_modules")
    assert (mods if isinstance(mods, list) else [mods] if mods else []) == list(c.recompute_modules)
    freq = _layer_freq(o["moe_layer_freq"])
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(m.num_layers)]
    assert pattern == [int(m.is_moe_layer(i)) for i in range(m.num_layers)]  # megatron-core's reading of an int
    from autoconf.launch.gaps import gaps

    assert gaps(plan, "megatron") == []  # Megatron-LM expresses all of it


@pytest.mark.parametrize("case", MOE_CASES)
def test_megatron_core_accepts_the_moe_args(tmp_path, case):
    """megatron-core's TransformerConfig takes the MoE values (as Megatron-LM maps them:
    --num-experts to num_moe_experts, the others by their field names) and its own layer-spec
    builder makes MoE blocks exactly where the model has them."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.moe_layer import MoELayer

    m, c, plan, o = _megatron_moe_options(tmp_path, case)
    names = {f.name for f in _dc.fields(TransformerConfig)}
    kw = {"num_moe_experts": int(o["num_experts"]), "moe_layer_freq": _layer_freq(o["moe_layer_freq"])}
    for k, v in o.items():
        if k.startswith(("moe_", "expert_", "overlap_moe_")) and k != "moe_layer_freq":
            assert k in names, k
            kw[k] = v if v is True or not v.replace(".", "").isdigit() else (float(v) if "." in v else int(v))
    for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups",
              "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        if k in o:
            kw[k] = int(o[k])
    if "num_layers_per_virtual_pipeline_stage" in o:  # as Megatron-LM's arguments.py derives it
        per_stage = int(o["num_layers"]) // int(o["pipeline_model_parallel_size"])
        kw["virtual_pipeline_model_parallel_size"] = per_stage // int(o["num_layers_per_virtual_pipeline_stage"])
    for k in ("recompute_granularity", "recompute_method"):
        if k in o:
            kw[k] = o[k]
    if "recompute_modules" in o:
        kw["recompute_modules"] = o["recompute_modules"] if isinstance(o["recompute_modules"], list) else \
            [o["recompute_modules"]]
    tc = TransformerConfig(**kw, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                           params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, bf16=True)
    assert (tc.num_moe_experts, tc.moe_router_topk, tc.moe_ffn_hidden_size) == \
        (m.num_experts, m.experts_per_token, m.expert_ffn)
    assert tc.moe_router_score_function == m.router
    assert tc.moe_token_dispatcher_type == ("flex" if c.moe_dispatcher == "deepep" else "alltoall")
    # experts split tp ways, or as the plan sets it (1: folded)
    assert tc.expert_model_parallel_size == c.ep and tc.expert_tensor_parallel_size == (c.expert_tp or c.tp)
    assert tc.moe_expert_capacity_factor == c.moe_capacity_factor
    assert tc.overlap_moe_expert_parallel_comm is bool(c.ep_comm_overlap)  # its own checks passed
    assert (tc.moe_router_num_groups or 0, tc.moe_router_group_topk or 0) == (m.router_groups, m.router_group_topk)
    if c.recompute_modules:  # its own checks passed (moe_act needs the grouped GEMM it has)
        assert set(tc.recompute_modules) == set(c.recompute_modules)
    specs = get_gpt_decoder_layer_specs(tc, use_transformer_engine=False, normalization="RMSNorm")
    specs = getattr(specs, "layer_specs", specs)
    got = [int(s.submodules.mlp.module is MoELayer) for s in specs]
    assert got == [int(m.is_moe_layer(i)) for i in range(m.num_layers)]


def test_torchtitan_moe_files_and_gaps(tmp_path):
    from autoconf.launch.gaps import gaps
    from autoconf.launch.torchtitan import torchtitan_args_file, torchtitan_settings, torchtitan_toml

    m, c, plan = _moe_plan("every-other", "torchtitan")
    assert torchtitan_settings(plan)["parallelism"].get("expert_parallel_degree", 1) == c.ep == 1
    text = torchtitan_args_file(plan, "header\n")
    assert "MoE.Config(num_experts=8" in text and "top_k=2" in text and gaps(plan, "torchtitan") == []
    m, c, plan = _moe_plan("deepseek-like", "torchtitan")
    for version in ("0.3", "0.2"):
        par = torchtitan_settings(plan, version)["parallelism"]
        assert par["expert_parallel_degree"] == c.ep
        assert par.get("expert_tensor_parallel_degree") == (c.tp if version == "0.2" else None)
        missing = gaps(plan, "torchtitan", version)
        assert [g for g in missing if g.startswith("the capacity factor 1.25")]
        assert bool([g for g in missing if g.startswith("expert parallelism with tp=2")]) == (version == "0.3")
    # DeepEP: torchtitan 0.3's token dispatcher, named in the model note; 0.2 has none
    from autoconf.launch.plan import LaunchPlan

    dm, dc = MOE_CASES["dropless"]
    dc = _dc.replace(dc, zero_stage=3, tp=1, dp=8, ep_comm_overlap=None, moe_dispatcher="deepep")
    dplan = LaunchPlan(dc, dm, A100, framework="torchtitan")
    assert "token_dispatcher=DeepEPTokenDispatcher.Config(num_max_tokens_per_rank=" in \
        torchtitan_args_file(dplan, "header\n")
    assert not [g for g in gaps(dplan, "torchtitan", "0.3") if "DeepEP" in g]
    assert [g for g in gaps(dplan, "torchtitan", "0.2") if g.startswith("the DeepEP token dispatcher")]
    doc = tomllib.loads(torchtitan_toml(plan, "header\n"))
    assert doc["parallelism"]["expert_tensor_parallel_degree"] == c.tp
    assert "score_func = \"sigmoid\"" in torchtitan_toml(plan, "header\n")
    # DDP replicas cannot hold different experts in torchtitan: ep must fit in dp_shard x cp
    from autoconf.launch.plan import LaunchPlan

    ddp = LaunchPlan(cfg(dp=4, micro_batch_size=1, num_micro_batches=2, ep=4), MOE, A100, framework="torchtitan")
    assert [g for g in gaps(ddp, "torchtitan") if g.startswith("expert parallelism ep=4")]


@pytest.mark.parametrize("case", ["dropless", "deepseek-like"])
def test_torchtitan_config_manager_reads_the_expert_parallel_degree(tmp_path, case):
    """torchtitan's own ConfigManager reads expert_parallel_degree (0.3: the override; 0.2: the
    TOML, with expert_tensor_parallel_degree)."""
    version = _titan_version()
    from torchtitan.config import ConfigManager

    from autoconf.launch.torchtitan import torchtitan_args, torchtitan_toml

    m, c, plan = _moe_plan(case, "torchtitan")
    if version.startswith("0.3"):
        words, ac = torchtitan_args(plan)
        got = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel", *map(str, words), ac])
        assert got.parallelism.expert_parallel_degree == c.ep
    else:
        path = tmp_path / "torchtitan.toml"
        path.write_text(torchtitan_toml(plan, "header\n"))
        got = ConfigManager().parse_args(["--job.config_file", str(path)])
        assert (got.parallelism.expert_parallel_degree, got.parallelism.expert_tensor_parallel_degree) == (c.ep, c.tp)


def test_deepspeed_says_its_moe_is_model_code(tmp_path):
    from autoconf.launch.deepspeed import ds_config
    from autoconf.launch.gaps import gaps

    m, c, plan = _moe_plan("deepseek-like", "reference")  # cp=2: DeepSpeed's plans have none, its gaps say so
    missing = gaps(plan, "deepspeed")
    moe = [g for g in missing if g.startswith("the mixture-of-experts blocks")]
    assert moe and "deepspeed.moe.layer.MoE(" in moe[0] and f"ep_size={c.ep}, k=2, capacity_factor=1.25" in moe[0]
    assert [g for g in missing if g.startswith("the sigmoid router")]
    assert [g for g in missing if g.startswith("the 2 shared expert(s)")]
    doc = ds_config(plan, "header\n")
    assert not any("moe" in k.lower() for k in doc if k != "_autoconf")  # nothing in ds_config itself
    assert all(f"cannot express: {g}" in doc["_autoconf"]["notes"] for g in missing)
    m, c, plan = _moe_plan("every-other", "deepspeed")
    (moe,) = gaps(plan, "deepspeed")
    assert "drop_tokens=False" in moe and "ep_size=1" in moe and "16 of 32 blocks" in moe


def test_plan_md_states_the_moe_shape(tmp_path):
    m, c = MOE_CASES["dropless"]
    files = emitted(tmp_path, c, "megatron", model=m)
    md = open(files["PLAN.md"]).read()
    assert ("Mixture of experts: 8 experts, top-2 (softmax router), in all 32 blocks; expert parallelism ep 4 "
            "(2 experts per rank); tokens dispatched by all-to-alls, under another micro-batch's computation "
            "(combined 1F1B); dropless routing.") in md
    m2, c2 = MOE_CASES["paired-interleaved"]
    grouped = _dc.replace(m2, num_experts=16, router_groups=4, router_group_topk=2)
    md2 = open(emitted(tmp_path / "deepep", c2, "megatron", model=grouped)["PLAN.md"]).read()
    assert ("tokens dispatched by DeepEP (once per host over the NICs), under another micro-batch's computation "
            "(combined 1F1B); dropless routing, each token inside its best 2 of 4 expert groups.") in md2
    assert "Mixture of experts" not in open(emitted(tmp_path / "dense", cfg(dp=8, micro_batch_size=1,
                                                                          num_micro_batches=2), "megatron")
                                             ["PLAN.md"]).read()


# -- torchtitan ----------------------------------------------------------------------------------

TITAN_CASES = {
    "fsdp-tp": cfg(dp=4, tp=2, micro_batch_size=2, num_micro_batches=2, zero_stage=3, recompute="full",
                   sequence_parallel=True),
    "ddp": cfg(dp=8, micro_batch_size=1, num_micro_batches=4),
    "interleaved": cfg(dp=2, pp=2, micro_batch_size=1, num_micro_batches=4, schedule="interleaved",
                       virtual_stages=2, stage_layers=(1, 2, 2, 1), zero_stage=2, recompute="selective"),
    "looped-bfs": cfg(dp=1, pp=3, micro_batch_size=2, num_micro_batches=3, schedule="breadth_first",
                      virtual_stages=2, layered_grad_accum=True),
    "cp-rowwise-async-tp": cfg(dp=2, tp=2, cp=2, micro_batch_size=1, num_micro_batches=2, zero_stage=3,
                               sequence_parallel=True, tp_comm_overlap=True, torch_compile=True,
                               precision="fp8", fp8_recipe="rowwise"),
    "cp-tensorwise-fsdp": cfg(dp=2, pp=2, cp=2, micro_batch_size=1, num_micro_batches=2, zero_stage=3,
                              precision="fp8", fp8_recipe="tensorwise"),
}


def _titan(tmp_path, case):
    c = TITAN_CASES[case]
    return c, emitted(tmp_path, c, "torchtitan", model=DEBUG)


@pytest.mark.parametrize("case", TITAN_CASES)
def test_torchtitan_files_hold_the_plan(tmp_path, case):
    c, files = _titan(tmp_path, case)
    bash_n(files["torchtitan_args.sh"])
    words = bash_array(files["torchtitan_args.sh"], "TORCHTITAN_ARGS", "TORCHTITAN_AC")
    assert words[-1] == f"activation-checkpoint:{c.recompute}"
    doc = tomllib.loads(open(files["torchtitan.toml"]).read())
    par, tr = doc["parallelism"], doc["training"]
    replicate, shard = par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]
    assert replicate * shard == c.dp and (shard == 1) == (c.zero_stage == 0)
    assert par["tensor_parallel_degree"] == c.tp and par["pipeline_parallel_degree"] == c.pp
    assert tr["global_batch_size"] == c.global_batch and tr["seq_len"] == DEBUG.seq_length
    assert doc["activation_checkpoint"]["mode"] == c.recompute
    assert par.get("context_parallel_degree", 1) == c.cp
    if c.cp > 1:  # the plan's load-balanced split, keys and values all-gathered
        assert (par["context_parallel_load_balancer"], par["context_parallel_rotate_method"]) == ("headtail", "allgather")
    assert doc["compile"]["enable"] == bool(c.torch_compile or c.tp_comm_overlap)
    assert par.get("enable_async_tensor_parallel", False) == bool(c.tp_comm_overlap)
    if c.precision == "fp8":  # 0.2: the float8 converter; tensorwise with FSDP gathers the weights in FP8
        assert doc["model"]["converters"] == ["quantize.linear.float8"]
        f8 = doc["quantize"]["linear"]["float8"]
        assert f8["filter_fqns"] == ["output"] and f8.get("recipe_name") == (
            None if c.fp8_recipe == "tensorwise" else c.fp8_recipe)
        fsdp = c.fp8_recipe == "tensorwise" and c.zero_stage >= 2
        assert f8.get("enable_fsdp_float8_all_gather", False) == f8.get("precompute_float8_dynamic_scale_for_fsdp",
                                                                         False) == fsdp
    else:
        assert "model" not in doc and "quantize" not in doc
    notes = open(files["torchtitan_args.sh"]).read().split("TORCHTITAN_ARGS=(")[0]
    assert ("tensorwise FP8 scaling" in notes) == (c.precision == "fp8" and c.fp8_recipe == "tensorwise")
    assert ("Float8LinearConverter.Config(recipe_name='rowwise'" in notes) == (c.fp8_recipe == "rowwise"
                                                                               and c.precision == "fp8")
    # torchtitan's arithmetic gives back the plan's micro-batches: accumulation steps x pipeline micro-batches
    accumulation = tr["global_batch_size"] // (tr["local_batch_size"] * c.dp)
    per_forward = par.get("pipeline_parallel_microbatch_size", tr["local_batch_size"])
    assert per_forward == c.micro_batch_size
    assert accumulation * (tr["local_batch_size"] // per_forward) == c.num_micro_batches
    if c.pp > 1:
        assert par["pipeline_parallel_schedule"] == {"interleaved": "Interleaved1F1B", "1f1b": "1F1B",
                                                     "breadth_first": "LoopedBFS"}[c.schedule]
        parts = par["module_fqns_per_model_part"]
        assert len(parts) == c.num_chunks and parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
        blocks = [sum(1 for n in p if n.startswith("layers.")) for p in parts]
        assert blocks == [len(x) for x in load_plan(files["config.json"]).placement.chunk_layers()]
    node = open(files["node-1.sh"] if "node-1.sh" in files else files["node-0.sh"]).read()
    assert "-m torchtitan.train --module" in node and '"${TORCHTITAN_ARGS[@]}" "$@" "$TORCHTITAN_AC"' in node


def _titan_version():
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]')")
    from importlib.metadata import version

    return version("torchtitan")


@pytest.mark.parametrize("case", TITAN_CASES)
def test_torchtitan_03_config_manager_reads_the_overrides(tmp_path, case):
    """torchtitan 0.3's own ConfigManager (tyro) parses the emitted overrides onto its llama3
    debug-model config; every module name of every pipeline chunk exists in the real model."""
    if not _titan_version().startswith("0.3"):
        pytest.skip("torchtitan 0.3 reads command-line overrides; this one is " + _titan_version())
    import torch
    from torchtitan.config import ConfigManager

    from autoconf.launch.plan import LaunchPlan
    from autoconf.launch.torchtitan import torchtitan_converter

    c, files = _titan(tmp_path, case)
    words = bash_array(files["torchtitan_args.sh"], "TORCHTITAN_ARGS", "TORCHTITAN_AC")
    got = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel", *words])
    p, t = got.parallelism, got.training
    assert p.data_parallel_replicate_degree * p.data_parallel_shard_degree == c.dp
    assert (p.tensor_parallel_degree, p.pipeline_parallel_degree) == (c.tp, c.pp)
    assert (t.global_batch_size, t.seq_len) == (c.global_batch, DEBUG.seq_length)
    assert type(got.activation_checkpoint).__qualname__ == {"none": "NoneType", "selective": "SelectiveAC.Config",
                                                            "full": "FullAC.Config"}[c.recompute]
    assert (p.context_parallel_degree, p.context_parallel_load_balancer) == (c.cp, "headtail")
    assert got.compile.enable == bool(c.torch_compile or c.tp_comm_overlap) and "model" in got.compile.components
    assert got.compile.enable_async_tensor_parallel == bool(c.tp_comm_overlap)
    assert p.enable_sequence_parallel == (c.sequence_parallel or c.tp == 1)
    conv = torchtitan_converter(LaunchPlan(c, DEBUG, framework="torchtitan"))
    if conv is not None:  # what the config function must apply: torchtitan 0.3's own converter config takes it
        import torchtitan.components.quantization as q

        name, kw = conv
        made = getattr(q, name).Config(**kw)
        assert all(getattr(made, k) == v for k, v in kw.items())
        assert (made.recipe_name if name == "Float8LinearConverter" else "mxfp8") == c.fp8_recipe
    else:
        assert c.precision != "fp8" or c.fp8_recipe == "tensorwise"
    if c.pp > 1:
        assert p.pipeline_parallel_microbatch_size == c.micro_batch_size
        assert t.local_batch_size // p.pipeline_parallel_microbatch_size == c.num_micro_batches
        with torch.device("meta"):
            net = got.model_spec.model.build()
        names = [n for part in p.module_fqns_per_model_part for n in part]
        for n in names:
            net.get_submodule(n)  # raises if torchtitan's model has no such module
        assert len(names) == len(set(names)) == len(list(net.named_children())) - 1 + DEBUG.num_layers
    else:
        assert t.local_batch_size == c.micro_batch_size


@pytest.mark.parametrize("case", TITAN_CASES)
def test_torchtitan_02_job_config_reads_the_toml(tmp_path, case):
    """torchtitan 0.2's ConfigManager reads torchtitan.toml with --job.config_file."""
    if not _titan_version().startswith("0.2"):
        pytest.skip("torchtitan.toml is torchtitan 0.2's format; this one is " + _titan_version())
    from torchtitan.config import ConfigManager

    c, files = _titan(tmp_path, case)
    got = ConfigManager().parse_args(["--job.config_file", files["torchtitan.toml"]])
    assert got.parallelism.tensor_parallel_degree == c.tp and got.parallelism.pipeline_parallel_degree == c.pp
    assert got.activation_checkpoint.mode == c.recompute and got.training.global_batch_size == c.global_batch
    assert got.parallelism.context_parallel_degree == c.cp
    assert got.compile.enable == bool(c.torch_compile or c.tp_comm_overlap)
    if c.precision == "fp8":
        assert got.model.converters == ["quantize.linear.float8"]
        f8 = got.quantize.linear.float8
        assert f8.enable_fsdp_float8_all_gather == (c.fp8_recipe == "tensorwise" and c.zero_stage >= 2)
    if c.pp > 1:
        assert len(got.parallelism.module_fqns_per_model_part) == c.num_chunks


# -- DeepSpeed -----------------------------------------------------------------------------------

DS_CASES = {
    "zero3": cfg(dp=32, micro_batch_size=1, num_micro_batches=2, zero_stage=3, overlap_grad_reduce=True),
    "zero1-pp-tp": cfg(dp=4, pp=2, tp=4, micro_batch_size=2, num_micro_batches=4, zero_stage=1, recompute="full"),
}


@pytest.mark.parametrize("case", DS_CASES)
def test_ds_config_holds_the_plan(tmp_path, case):
    c = DS_CASES[case]
    files = emitted(tmp_path, c, "deepspeed")
    doc = json.loads(open(files["ds_config.json"]).read())
    assert doc["train_batch_size"] == c.global_batch == (doc["train_micro_batch_size_per_gpu"]
                                                         * doc["gradient_accumulation_steps"] * c.dp)
    assert doc["zero_optimization"]["stage"] == c.zero_stage and doc["bf16"] == {"enabled": True}
    assert doc["zero_optimization"]["overlap_comm"] == bool(c.overlap_grad_reduce)
    notes = " ".join(doc["_autoconf"]["notes"])
    if c.pp > 1:
        assert f"num_stages={c.pp}" in notes and doc["tensor_parallel"] == {"autotp_size": c.tp}
    node = open(files["node-0.sh"]).read()
    assert "--deepspeed_config ds_config.json" in node and "DEEPSPEED_SCRIPT" in node


def test_deepspeed_says_it_has_no_context_parallelism_or_fp8(tmp_path):
    from autoconf.launch.deepspeed import ds_config
    from autoconf.launch.gaps import gaps
    from autoconf.launch.plan import LaunchPlan

    plan = LaunchPlan(cfg(dp=4, cp=2, micro_batch_size=1, num_micro_batches=2, precision="fp8"), LLAMA)
    missing = gaps(plan, "deepspeed")
    assert [g for g in missing if g.startswith("context parallelism (cp=2)")]
    assert [g for g in missing if g.startswith("FP8 matmuls (tensorwise")]
    notes = ds_config(plan, "header\n")["_autoconf"]["notes"]
    assert all(f"cannot express: {g}" in notes for g in missing)
    assert gaps(LaunchPlan(cfg(dp=8, micro_batch_size=1, num_micro_batches=2), LLAMA), "deepspeed") == []


@pytest.mark.parametrize("case", DS_CASES)
def test_deepspeed_config_class_accepts_it(tmp_path, case):
    """DeepSpeed's own DeepSpeedConfig (no GPU needed to import it) reads ds_config.json; the
    data-parallel size reaches it through its model-parallel-unit interface, as Megatron-DeepSpeed
    passes it, and its batch arithmetic must agree."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e '.[deepspeed]')")
    c = DS_CASES[case]
    files = emitted(tmp_path, c, "deepspeed")

    got = _deepspeed_config(files["ds_config.json"], c.dp)
    assert (got["train_batch_size"], got["micro"], got["accumulation"], got["world_size"]) == \
        (c.global_batch, c.micro_batch_size, c.num_micro_batches, c.dp)
    assert got["zero_stage"] == c.zero_stage and got["bf16"] and got["overlap_comm"] == bool(c.overlap_grad_reduce)
    with pytest.raises(subprocess.CalledProcessError):  # the check is real: another dp size does not add up
        _deepspeed_config(files["ds_config.json"], c.dp * 2)


_DS_CHECK = """
import json, sys
import deepspeed.comm as dist
from deepspeed.runtime.config import DeepSpeedConfig
dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
class DataParallelUnit:
    def get_data_parallel_world_size(self):
        return int(sys.argv[2])
c = DeepSpeedConfig(sys.argv[1], mpu=DataParallelUnit())
print(json.dumps({"train_batch_size": c.train_batch_size, "micro": c.train_micro_batch_size_per_gpu,
                  "accumulation": c.gradient_accumulation_steps, "world_size": c.world_size,
                  "zero_stage": c.zero_optimization_stage, "bf16": c.bfloat16_config.enabled,
                  "overlap_comm": c.zero_config.overlap_comm}))
"""


def _deepspeed_config(path: str, dp: int) -> dict:
    """DeepSpeedConfig in a process of its own (a one-process gloo group, which DeepSpeed asks for
    the data-parallel size through the mpu)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    out = subprocess.run([sys.executable, "-c", _DS_CHECK, path, str(dp)], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- SLURM -------------------------------------------------------------------------------------------

def _fake_bin(tmp_path, names: list[str], record: str) -> dict:
    """Stand-ins on PATH: srun (one task per node, one at a time: SLURM_NODEID and SLURMD_NODENAME from
    the list ``names``), scontrol (the node list), torchrun (records its argv and environment)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    scripts = {
        "srun": 'i=0; while IFS= read -r -d "" node; do SLURM_NODEID=$i SLURMD_NODENAME="$node" '
                '"${@:4}" || exit $?; i=$((i+1)); done < "$FAKE_NODES"',
        "scontrol": 'tr "\\0" "\\n" < "$FAKE_NODES"',
        "torchrun": f'exec {sys.executable} -c "import json, os, sys; '
                    f"open(os.environ['RECORD'] + '/' + str(len(os.listdir(os.environ['RECORD']))), 'w')"
                    f".write(json.dumps({{'argv': sys.argv[1:], 'cwd': os.getcwd(), "
                    f"'env': {{k: os.environ.get(k) for k in ('MASTER_ADDR', 'CUDA_VISIBLE_DEVICES', 'AUTOCONF_PLAN')}}}}))\" \"$@\"",
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/usr/bin/env bash\n" + body + "\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    os.makedirs(record, exist_ok=True)
    nodes = bin_dir / "nodes"  # NUL-separated: a name may hold a newline
    nodes.write_text("".join(n + "\0" for n in names))
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_NODES": str(nodes), "RECORD": record,
            "SLURM_JOB_NODELIST": "ignored"}


def _records(record: str) -> list[dict]:
    return [json.loads(open(os.path.join(record, f)).read()) for f in sorted(os.listdir(record), key=int)]


def test_sbatch_runs_each_nodes_script_with_its_ranks_and_gpus(tmp_path):
    """Named hosts: SLURM may number the nodes in any order; each task finds its node script by its
    host name, so node-1's ranks and GPU order stay on host b."""
    cluster = cluster_from_mapping({"name": "two", "node_groups": [
        {"count": 2, "device": "a100-80gb", "gpus_per_node": 4, "intra_node_bandwidth": "300 GB/s",
         "nics": {"count": 1, "bandwidth": "100 Gbit/s"}, "hosts": ["gpu-a", "gpu-b"]}]})
    c = cfg(dp=2, tp=4, micro_batch_size=1, num_micro_batches=2)
    files = emitted(tmp_path / "plan", c, "reference", model=preset("gpt2"), cluster=cluster,
                    local_devices=[3, 2, 1, 0, 0, 1, 2, 3])
    sb = open(files["sbatch.sh"]).read()
    assert "#SBATCH --nodes=2" in sb and "#SBATCH --gpus-per-node=4" in sb and "#SBATCH --nodelist=gpu-a,gpu-b" in sb
    bash_n(files["sbatch.sh"])
    record = str(tmp_path / "rec")
    env = _fake_bin(tmp_path, ["gpu-b", "gpu-a"], record)  # SLURM lists b first
    r = subprocess.run(["bash", files["sbatch.sh"]], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    by_rank = {int(next(a for a in rec["argv"] if a.startswith("--node-rank="))[12:]): rec for rec in _records(record)}
    assert sorted(by_rank) == [0, 1]
    assert by_rank[0]["env"]["CUDA_VISIBLE_DEVICES"] == "3,2,1,0" and by_rank[1]["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert all(rec["env"]["MASTER_ADDR"] == "gpu-a" for rec in by_rank.values())
    assert all(rec["env"]["AUTOCONF_PLAN"] == os.path.join(str(tmp_path / "plan"), "config.json")
               for rec in by_rank.values())
    # a node the plan does not name is refused, not given a rank
    env = _fake_bin(tmp_path / "x", ["gpu-a", "gpu-z"], str(tmp_path / "rec2"))
    r = subprocess.run(["bash", files["sbatch.sh"]], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0 and "gpu-z is not a host of the plan" in r.stderr


def test_sbatch_without_host_names_takes_the_slurm_node_id(tmp_path):
    c = cfg(dp=2, pp=2, tp=8, micro_batch_size=1, num_micro_batches=4)
    files = emitted(tmp_path / "plan", c, "megatron")
    record = str(tmp_path / "rec")
    env = _fake_bin(tmp_path, ["n1", "n2", "n3", "n4"], record)
    env["MEGATRON_LM"] = "/opt/megatron"
    r = subprocess.run(["bash", files["sbatch.sh"]], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    recs = _records(record)
    assert [next(a for a in rec["argv"] if a.startswith("--node-rank=")) for rec in recs] == \
        [f"--node-rank={k}" for k in range(4)]
    assert all(rec["env"]["MASTER_ADDR"] == "n1" for rec in recs)  # the first of the allocation
    argv = recs[0]["argv"]
    assert argv[argv.index("--master-port=29500") + 1] == "/opt/megatron/pretrain_gpt.py"
    assert options(argv[argv.index("/opt/megatron/pretrain_gpt.py") + 1:])["tensor_model_parallel_size"] == "8"


# -- the command line ------------------------------------------------------------------------------

def run_cli(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.run([sys.executable, "-m", "autoconf", *args], capture_output=True, text=True, cwd=cwd, env=env)


def test_cli_emits_the_frameworks_files_and_plan_md(tmp_path):
    p = run_cli("search", "--model", "llama-3-8b", "--cluster", os.path.abspath("examples/clusters/a100-4x8.yaml"),
                "--global-batch", "64", "--framework", "megatron", "--storage", "none", "--trials", "20", "--top", "3",
                "--emit", str(tmp_path / "out"), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    names = sorted(os.path.basename(f) for f in d["emitted"])
    assert names == ["PLAN.md", "config.json", "megatron_args.sh", "node-0.sh", "node-1.sh", "node-2.sh", "node-3.sh",
                     "sbatch.sh"]
    plan = load_plan(str(tmp_path / "out" / "config.json"))
    assert plan.framework == "megatron" and plan.config.to_dict() == d["best"]["config"]
    assert plan.expected.step_time_s == pytest.approx(d["best"]["step_time_s"])
    md = (tmp_path / "out" / "PLAN.md").read_text()
    assert "## Why" in md and "## Runners-up" in md and "| 3 |" in md and "bash node-3.sh" in md
    assert "sbatch sbatch.sh" in md and "pretrain_gpt.py" in md


@pytest.mark.parametrize("args,needle", [
    (["--script", "train.py"], "needs --emit"),
    (["--emit", "out", "--script", "missing.py"], "--script 'missing.py' is not a file"),
    (["--emit", "out", "--", "--steps", "3"], "need --script"),
])
def test_cli_script_errors_are_one_line(tmp_path, args, needle):
    p = run_cli("search", "--model", "tiny", "--cluster", os.path.abspath("examples/clusters/localhost-cpu.yaml"),
                "--global-batch", "8", "--storage", "none", *args, cwd=tmp_path)
    assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "out").exists()


# -- hostile names: quoted everywhere -----------------------------------------------------------------

def test_hostile_names_neither_break_nor_inject_into_any_emitted_script(tmp_path, monkeypatch):
    """Model, cluster and host names, the script's path and its arguments full of shell syntax:
    every emitted shell file passes bash -n, sourcing and running them (node scripts and sbatch.sh,
    with stand-in srun / torchrun) creates no file, and torchrun receives every value verbatim."""
    import dataclasses

    marker = tmp_path / "pwned"
    monkeypatch.setenv("PWNED", str(marker))  # what an injected command would create
    evil = 'x $(touch "$PWNED") `touch "$PWNED"`; touch "$PWNED" "q\' \\\n#'
    model = dataclasses.replace(DEBUG, name="model " + evil)
    base = cluster_from_mapping({"name": "c", "node_groups": [
        {"count": 2, "device": "a100-80gb", "gpus_per_node": 2, "intra_node_bandwidth": "300 GB/s",
         "nics": {"count": 1, "bandwidth": "100 Gbit/s"}}]})
    hosts = ('h0;touch "$PWNED"', 'h1 $(touch "$PWNED")\nx')
    cluster = dataclasses.replace(base, name="cluster\n" + evil,
                                  node_groups=(dataclasses.replace(base.node_groups[0], hosts=hosts),))
    sdir = tmp_path / 'my dir $(touch "$PWNED")'
    sdir.mkdir()
    script = sdir / "train;'x'.py"
    script.write_text("print('hi')\n")
    args = ["--name", evil, "a b", "", "--x=$HOME", "-- --"]
    c = cfg(dp=2, pp=2, micro_batch_size=1, num_micro_batches=2)
    out = tmp_path / "out `touch $PWNED`"
    for framework in ("reference", "megatron", "torchtitan", "deepspeed"):
        d = out / framework
        emit(estimate(c, model, cluster, framework=framework), model, cluster, str(d), script=str(script),
             script_args=args)
        for f in sorted(os.listdir(d)):
            if f.endswith(".sh"):
                bash_n(d / f)
        for f, name in (("megatron_args.sh", "MEGATRON_ARGS"), ("torchtitan_args.sh", "TORCHTITAN_ARGS")):
            if (d / f).exists():
                assert bash_array(d / f, name)  # sourcing runs nothing from the comments
        json.loads((d / "config.json").read_text())
        record = str(tmp_path / f"rec-{framework}")
        env = _fake_bin(tmp_path / f"bin-{framework}", list(hosts), record)
        for k in (0, 1):
            r = subprocess.run(["bash", str(d / f"node-{k}.sh"), "extra arg"], env=env, capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
        r = subprocess.run(["bash", str(d / "sbatch.sh")], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        recs = _records(record)
        assert len(recs) == 4  # two node scripts by hand, two through sbatch.sh
        for rec in recs:
            argv = rec["argv"]
            at = argv.index(str(script))
            assert argv[at + 1:at + 1 + len(args)] == args
            assert f"--master-addr={hosts[0]}" in argv  # the default, verbatim
        assert recs[0]["argv"][-1] == recs[1]["argv"][-1] == "extra arg" and recs[2]["argv"][-1] == args[-1]
        assert not marker.exists()


def test_megatron_attention_variants_parse_back_and_megatron_core_accepts_them(tmp_path):
    """DeepSeek-V3's multi-head latent attention and expert bias, GPT-OSS's sliding windows and
    Qwen3's Q/K norms in megatron-core's spelling (MLATransformerConfig / TransformerConfig fields)."""
    big = load_cluster("examples/clusters/h100-8x8.yaml")
    ds = preset("deepseek-v3")
    c = cfg(dp=8, pp=8, tp=1, ep=8, num_micro_batches=16, zero_stage=1, recompute="full")
    o = options(bash_array(emitted(tmp_path / "ds", c, "megatron", model=ds, cluster=big)["megatron_args.sh"],
                           "MEGATRON_ARGS"))
    assert o["multi_latent_attention"] is True and int(o["kv_lora_rank"]) == ds.kv_lora_rank
    assert o["qk_layernorm"] is True  # the latents' norms
    assert int(o["q_lora_rank"]) == ds.q_lora_rank and int(o["qk_head_dim"]) == ds.qk_nope_head_dim
    assert int(o["qk_pos_emb_head_dim"]) == ds.qk_rope_head_dim and int(o["v_head_dim"]) == ds.v_head_dim
    assert o["moe_router_enable_expert_bias"] is True and o["moe_router_score_function"] == "sigmoid"
    oss = preset("gpt-oss-20b")
    o2 = options(bash_array(emitted(tmp_path / "oss", cfg(dp=8, ep=8, num_micro_batches=2), "megatron", model=oss,
                                    cluster=big)["megatron_args.sh"], "MEGATRON_ARGS"))
    assert o2["window_size"] == f"{oss.sliding_window},0" and int(o2["window_attn_skip_freq"]) == 2
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    mla = MLATransformerConfig(num_layers=4, hidden_size=ds.hidden_size, num_attention_heads=ds.num_attention_heads,
                               q_lora_rank=int(o["q_lora_rank"]), kv_lora_rank=int(o["kv_lora_rank"]),
                               qk_head_dim=int(o["qk_head_dim"]), qk_pos_emb_head_dim=int(o["qk_pos_emb_head_dim"]),
                               v_head_dim=int(o["v_head_dim"]), num_moe_experts=int(o["num_experts"]),
                               moe_router_topk=int(o["moe_router_topk"]), moe_router_score_function="sigmoid",
                               moe_router_enable_expert_bias=True)
    assert mla.multi_latent_attention


def test_compressed_plans_keep_their_fields_and_other_frameworks_say_they_cannot(tmp_path):
    from autoconf.launch.deepspeed import ds_config
    from autoconf.launch.gaps import gaps
    from autoconf.launch.megatron import megatron_file
    from autoconf.launch.plan import LaunchPlan, load

    c = cfg(dp=2, pp=2, micro_batch_size=1, num_micro_batches=4, pp_compression="epilogue", pp_compression_rank=8,
            dp_compression_stages=1, dp_compression_rank=32)
    plan = LaunchPlan(c, LLAMA, A100)
    path = plan.write(str(tmp_path / "config.json"))
    back = load(path).config
    assert (back.pp_compression, back.pp_compression_rank, back.dp_compression_stages, back.dp_compression_rank) == (
        "epilogue", 8, 1, 32)
    assert gaps(plan, "reference") == []
    for name in ("megatron", "torchtitan", "deepspeed"):
        missing = gaps(plan, name)
        assert [g for g in missing if g.startswith("compressed pipeline gradients (pp_compression epilogue, rank 8)")]
        assert [g for g in missing if g.startswith("PowerSGD on the data-parallel gradients of pipeline ranks 0..0")]
    assert "compressed pipeline gradients" in megatron_file(plan, "header\n")
    assert any("PowerSGD" in n for n in ds_config(plan, "header\n")["_autoconf"]["notes"])


def test_a_second_emit_into_the_same_directory_leaves_no_stale_launch_file(tmp_path):
    """An emit for 4 hosts with DeepSpeed, then one for 1 host with Megatron-LM into the same
    directory: the old node scripts for hosts 1-3 and ds_config.json (which would run the new
    config.json with the old layout) are gone; a file of the user's of the same name is kept."""
    out = tmp_path / "plan"
    first = emitted(out, cfg(dp=32), "deepspeed")
    assert {"node-3.sh", "ds_config.json"} <= set(first)
    one = cluster_from_mapping({"name": "one", "node_groups": [
        {"count": 1, "device": "a100-80gb", "gpus_per_node": 8, "intra_node_bandwidth": "300 GB/s",
         "nics": {"count": 1, "bandwidth": "100 Gbit/s"}}]})
    (out / "node-7.sh").write_text("#!/bin/sh\necho mine\n")  # the user's own, not autoconf's
    second = emitted(out, cfg(dp=8), "megatron", cluster=one)
    assert "node-0.sh" in second and "megatron_args.sh" in second
    left = set(os.listdir(out))
    assert not {"node-1.sh", "node-2.sh", "node-3.sh", "ds_config.json"} & left
    assert "node-7.sh" in left and set(second) <= left
