"""Datasheet-mode accuracy on today's training stacks: 89 published runs of torchtitan,
Megatron-Bridge and NeMo AutoModel on H100, H200 and A100 (``bench/data/modern-stacks/``).

    python bench/modern_stacks.py [--json out.json]

Every row goes through ``estimate`` once, with the settings it states and, where it leaves one
open, the value assumed below for every row alike (never the value that matches a row best). The
error is predicted step time / measured step time - 1. Printed: per source and per kind (dense or
mixture of experts, BF16 or FP8) the rows, how many autoconf can express, the median |error|,
the median signed error, the max |error| and the false out-of-memory count (the estimate says
the configuration does not fit, but it ran); the 10 worst rows with their time breakdown; the rows
autoconf cannot express and why; and, for each open setting, the same rows priced with its other
plausible values (what the assumption is worth).

How a row becomes an estimate:

- model: autoconf's preset where there is one (Llama 3.1 has Llama 3's shapes), else the model's
  public Hugging Face ``config.json`` values read by ``from_hf_config`` (``HF_SHAPES``), at the
  row's sequence length;
- cluster: the catalog device on hosts of 8, as the data's README describes them (``SYSTEMS``);
- framework: torchtitan rows ``torchtitan:torch-2.6`` (its 2024 runs on the PyTorch nightlies of
  then, whose SDPA ran FlashAttention-2 on Hopper; the 2025-06 rows as ``Assume.torchtitan_2025``);
  Megatron-Bridge rows ``megatron:bridge-0.3``
  (Megatron-Bridge 0.3.1's recipe defaults, ``Assume.megatron_recipe``); NeMo AutoModel rows
  ``torchtitan``, the closest autoconf runtime (PyTorch FSDP2 over DTensor,
  ``torch.distributed.pipelining``, eager PyTorch with fused kernels);
- FSDP (torchtitan, AutoModel, and Megatron-Bridge rows marked FSDPn: Megatron FSDP) is ZeRO-3
  over dp; Megatron-Bridge otherwise runs its distributed optimizer, ZeRO-1, and its MoE recipes'
  expert_tp 1 (MoE parallel folding);
- ``num_micro_batches = gbs / (dp x mbs)``; the interleaved schedule where vp > 1 (or where a
  torchtitan row says interleaved-1F1B), else 1F1B; tp, pp, cp, ep as stated; FP8 where stated,
  with the row's recipe or the framework's default; ``compile`` and ``asyncTP`` as
  ``torch_compile`` and ``tp_comm_overlap``; every other knob at the framework's default.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autoconf.cost.estimate import TIME_TERMS, System, estimate  # noqa: E402
from autoconf.errors import UserError  # noqa: E402
from autoconf.space.config import ParallelConfig  # noqa: E402
from autoconf.specs.cluster import cluster_from_mapping  # noqa: E402
from autoconf.specs.hf import from_hf_config  # noqa: E402
from autoconf.specs.model import ModelSpec, preset  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data", "modern-stacks", "runs.csv")
SOURCES = ("TT24", "TT24B", "TTATP", "TTH200", "MB", "AM")
TT_2025 = ("TTATP", "TTH200")
"""torchtitan's own sources of 2025-06, whose PyTorch nightly is not stated (``Assume.torchtitan_2025``);
its 2024 ones run ``torchtitan:torch-2.6``."""
KINDS = ("dense BF16", "dense FP8", "MoE BF16", "MoE FP8")
FRAMEWORK = {"TT24": "torchtitan", "TT24B": "torchtitan", "TTATP": "torchtitan", "TTH200": "torchtitan",
             "MB": "megatron", "AM": "torchtitan"}

# -- models ------------------------------------------------------------------------------------------

PRESETS = {"Llama3-8B": "llama-3-8b", "Llama3.1-8B": "llama-3-8b", "Llama3-70B": "llama-3-70b",
           "Llama3.1-70B": "llama-3-70b", "Llama3.1-405B": "llama-3-405b", "Llama2-13B": "llama-2-13b",
           "Llama2-70B": "llama-2-70b", "Qwen3-30B-A3B": "qwen3-30b-a3b", "DeepSeek-V3": "deepseek-v3",
           "DeepSeek-V3-671B": "deepseek-v3", "GPT-OSS-20B": "gpt-oss-20b"}
"""Models of ``runs.csv`` that are autoconf presets (``python -m autoconf models``)."""

_NEMOTRON_H = {"model_type": "nemotron_h"}
HF_SHAPES = {
    "GPT-OSS-120B": ("openai/gpt-oss-120b", {
        "model_type": "gpt_oss", "num_hidden_layers": 36, "hidden_size": 2880, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880, "num_local_experts": 128,
        "num_experts_per_tok": 4, "vocab_size": 201088, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18, "attention_bias": True,
        "hidden_act": "silu", "tie_word_embeddings": False, "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16"}),
    "Qwen3-235B-A22B": ("Qwen/Qwen3-235B-A22B", {
        "model_type": "qwen3_moe", "num_hidden_layers": 94, "hidden_size": 4096, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "vocab_size": 151936, "hidden_act": "silu", "tie_word_embeddings": False, "use_sliding_window": False,
        "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}),
    # DeepSeek-V3's architecture (architectures: DeepseekV3ForCausalLM) with 64 heads, 384 experts,
    # one dense block first and no group-limited routing; its model_type kimi_k2 read as deepseek_v3
    "Kimi-K2": ("moonshotai/Kimi-K2-Base", {
        "model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_attention_heads": 64, "num_key_value_heads": 64,
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "scoring_func": "sigmoid",
        "vocab_size": 163840, "tie_word_embeddings": False, "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16"}),
    # Nemotron 3 (Nano, Super, Ultra): hybrid Mamba-2 / attention / mixture-of-experts models
    # (model_type nemotron_h); autoconf refuses the type, so no other value is needed
    "Nemotron3-Nano": ("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", _NEMOTRON_H),
    "Nemotron3-Nano-30B": ("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", _NEMOTRON_H),
    "Nemotron3-Super-120B": ("NVIDIA Nemotron 3 Super (the family's nemotron_h architecture)", _NEMOTRON_H),
    "Nemotron3-Ultra-550B": ("NVIDIA Nemotron 3 Ultra (the family's nemotron_h architecture)", _NEMOTRON_H),
}
"""The other models: (source, the values of its Hugging Face config.json that autoconf reads)."""

MOE_NAMES = ("Qwen3", "DeepSeek", "GPT-OSS", "Kimi", "Nemotron3")
"""Mixtures of experts by name (every model here but Llama), for rows whose model is not built."""


def model_for(name: str, seq: int) -> ModelSpec:
    """The model of a row at its sequence length; a UserError where autoconf cannot express it."""
    if name in PRESETS:
        return dataclasses.replace(preset(PRESETS[name]), seq_length=seq)
    if name in HF_SHAPES:
        return from_hf_config(HF_SHAPES[name][1], name=name, seq_length=seq)
    raise KeyError(f"model {name!r} of runs.csv has no shape here: add it to PRESETS or HF_SHAPES")


def is_moe(name: str) -> bool:
    return name.startswith(MOE_NAMES)


# -- clusters ----------------------------------------------------------------------------------------

SYSTEMS = {
    # Grand Teton: H100s power-capped at 500 W with 2.4 TB/s of HBM and 95 GiB (the data's README)
    "H100-GT": {"device": "h100-sxm", "memory": "95 GiB", "power_cap": "500 W", "memory_bandwidth": "2.4 TB/s",
                "intra_node_bandwidth": "450 GB/s",
                "nics": {"count": 8, "bandwidth": "400 Gbit/s", "kind": "roce"}},
    "DGX-H100": {"device": "h100-sxm", "intra_node_bandwidth": "450 GB/s",
                 "nics": {"count": 8, "bandwidth": "400 Gbit/s", "kind": "infiniband"}},
    "H200": {"device": "h200", "intra_node_bandwidth": "450 GB/s",
             "nics": {"count": 8, "bandwidth": "400 Gbit/s", "kind": "infiniband"}},
    # the network is not stated: a DGX A100's unless Assume.a100_nics says otherwise
    "A100": {"device": "a100-80gb", "intra_node_bandwidth": "300 GB/s"},
}
GPUS_PER_HOST = 8
_CLUSTERS: dict = {}


def cluster_for(system: str, n: int, a100_nics: tuple):
    key = (system, n, a100_nics if system == "A100" else None)
    if key not in _CLUSTERS:
        group = {"count": -(-n // GPUS_PER_HOST), "gpus_per_node": GPUS_PER_HOST, **SYSTEMS[system]}
        if system == "A100":
            group["nics"] = {"count": a100_nics[0], "bandwidth": a100_nics[1], "kind": "infiniband"}
        _CLUSTERS[key] = cluster_from_mapping({"name": f"{system.lower()}-{n}", "node_groups": [group],
                                               "latency": {"intra_node": "2 us", "inter_node": "10 us"}})
    return _CLUSTERS[key]


# -- rows --------------------------------------------------------------------------------------------

_INTS = ("n", "seq", "gbs", "dp", "tp", "pp", "cp", "ep", "vp", "mbs")


def load_rows(path: str = DATA) -> list[dict]:
    """The rows of runs.csv, typed; ``id`` is the row's 1-based index (its line is id + 1)."""
    with open(path, newline="") as f:
        raw = list(csv.DictReader(f))
    rows = []
    for i, r in enumerate(raw, 1):
        d = {"id": i, "src": r["src"], "system": r["system"], "model": r["model"], "prec": r["prec"],
             "ac": r["ac"].strip(), "opts": r["opts"].split(), "meas": float(r["meas"]),
             "tps": float(r["tps"]) if r["tps"] else None, "mem": float(r["mem"]) if r["mem"] else None}
        for k in _INTS:
            d[k] = int(r[k]) if r[k] else None
        d["kind"] = f"{'MoE' if is_moe(d['model']) else 'dense'} {d['prec']}"
        rows.append(d)
    return rows


@dataclass(frozen=True)
class Assume:
    """The values taken where a row leaves a setting open: the same for every row."""

    layer_sac_period: int = 2
    """ac=layer (torchtitan's per-layer selective checkpointing, period unstated): every k-th block
    checkpointed in full, the others not; k = 2 is torchtitan's default ``selective_ac_option``.
    autoconf recomputes all blocks or none, so k > 1 is priced as the mix of the two estimates
    (each time term and memory part weighted 1/k full, 1 - 1/k none); 1: full; 0: none."""
    op_sac: str = "selective"
    """ac=op (torchtitan's per-op selective checkpointing: matmul outputs kept, the rest
    recomputed): autoconf's selective recomputation (the attention core recomputed)."""
    unstated_ac: str = "none"
    """ac empty (none, or not stated) on a Megatron-Bridge or AutoModel row."""
    torchtitan_unstated_ac: str = "selective"
    """ac empty on a torchtitan row: the framework's own default, per-op selective checkpointing
    (its Llama 3 train configs, ``[activation_checkpoint] mode = "selective"``,
    ``selective_ac_option = "op"``; autoconf's ``selective`` under torchtitan is that policy)."""
    fp8_recipe: str = "tensorwise"
    """FP8 without a stated recipe: tensorwise (current) scaling, torchtitan's default
    (``float8.recipe_name`` unset) and Megatron-Bridge's FP8-CS on H100."""
    megatron_recipe: str = "bridge-0.3"
    """The Megatron-Bridge rows (NeMo containers 25.09 to 26.06) as ``megatron:bridge-0.3``,
    Megatron-Bridge 0.3.1's recipe defaults (gradient reduction and parameter gather overlapped,
    FP8 parameters under FP8: ``specs.frameworks.RECIPES``); core-0.16: Megatron-LM's own
    argument defaults (no overlap, BF16 parameters with FP8 copies)."""
    megatron_tp_overlap: str = "recipe"
    """tp_comm_overlap where tp > 1: "recipe", as Megatron-Bridge 0.3.1's recipes set it (on in
    its dense Llama 3 70B / 405B recipes, the recipe's default; off in its mixture-of-experts
    recipes, recipes/deepseek/deepseek_v3.py ``CommOverlapConfig(tp_comm_overlap=False)``);
    "off": off everywhere."""
    fsdp_under_pp: int = 3
    """FSDP together with pipeline parallelism: ZeRO-3 as stated, which autoconf prices as
    torchtitan runs it there (gathered once per step, reduced after the last micro-batch:
    ``Framework.fsdp_step_gather_under_pp``); 2: ZeRO-2 (parameters never resharded)."""
    interleaved_vp: int = 2
    """Stages per rank of a torchtitan interleaved-1F1B row (unstated): torchtitan's default of 2."""
    sequence_parallel: bool = True
    """tp > 1: sequence parallelism (torchtitan's TP shards the sequence between blocks;
    Megatron-Bridge's recipes turn it on with TP). asyncTP rows always have it."""
    a100_nics: tuple = (8, "200 Gbit/s")
    """The A100 hosts' network (unstated): a DGX A100's 8 x 200 Gbit/s InfiniBand."""
    missing_mbs: int = 1
    """A row without a micro-batch size (none in this data): 1."""
    torchtitan_2025: str = "torch-2.6"
    """The torchtitan rows of 2025-06 (TTATP, TTH200; their PyTorch nightly is not stated):
    ``torchtitan:torch-2.6``, SDPA running FlashAttention-2 on Hopper as in the 2024 runs; "0.3":
    cuDNN's attention, what torch 2.11's SDPA picks on an H100."""
    moe_dispatcher: str = "recipe"
    """Token dispatch with ep > 1: "recipe", what the row's framework runs by default on Hopper:
    DeepEP on the Megatron-Bridge rows (0.3.1's MoE recipes set ``moe_flex_dispatcher_backend =
    "deepep"``, recipes/qwen/qwen3_moe.py, and ``apply_flex_dispatcher_backend`` switches the
    dispatcher to ``flex`` on Ampere / Hopper, training/flex_dispatcher_backend.py) and on the
    AutoModel rows (nemo_automodel 0.7.0 ``BackendConfig.dispatcher`` defaults to "deepep" where
    DeepEP is installed, as in the NeMo container, components/models/common/utils.py);
    "alltoall": one all-to-all of every (token, expert) pair, the Megatron-Core and torchtitan
    default. DeepEP only where tp is 1 or the expert group is folded over tp."""


ASSUMED = Assume()


def recompute_of(row: dict, a: Assume) -> tuple:
    """((recompute, weight), ...): the recomputation modes the row is priced with and their weights
    (one mode; two for a per-layer period k > 1)."""
    ac = row["ac"]
    if ac == "full":
        return (("full", 1.0),)
    if ac == "none":
        return (("none", 1.0),)
    if ac in ("op", "selective"):
        return ((a.op_sac, 1.0),)
    if ac == "layer":
        k = a.layer_sac_period
        if k == 0:
            return (("none", 1.0),)
        if k == 1:
            return (("full", 1.0),)
        return (("full", 1.0 / k), ("none", 1.0 - 1.0 / k))
    if ac == "":
        return ((a.torchtitan_unstated_ac if row["src"].startswith("TT") else a.unstated_ac, 1.0),)
    raise ValueError(f"row {row['id']}: unknown ac {ac!r}")


def config_of(row: dict, a: Assume, recompute: str, fw: str | None = None) -> ParallelConfig:
    """The row's ParallelConfig under the assumptions ``a``; a UserError where the batch does not
    split into micro-batches."""
    fw, opts = fw or FRAMEWORK[row["src"]], row["opts"]
    dp, tp, pp, cp, ep = (row[k] or 1 for k in ("dp", "tp", "pp", "cp", "ep"))
    mbs = row["mbs"] or a.missing_mbs
    if row["gbs"] % (dp * mbs):
        raise UserError(f"global batch {row['gbs']} does not split into dp {dp} x micro-batch {mbs}")
    fsdp = fw.startswith("torchtitan") or any(o.startswith("FSDP") for o in opts)
    zero = (a.fsdp_under_pp if pp > 1 else 3) if fsdp else 1 if fw.startswith("megatron") else 0
    vp = row["vp"] or 1
    if "interleaved-1F1B" in opts and vp == 1:
        vp = a.interleaved_vp
    async_tp = "asyncTP" in opts
    sp = tp > 1 and (a.sequence_parallel or async_tp)
    kw = {}
    if async_tp:
        kw["tp_comm_overlap"] = True
    elif fw.startswith("megatron") and (a.megatron_tp_overlap == "off" or is_moe(row["model"])):
        kw["tp_comm_overlap"] = False
    if fw.startswith("megatron") and ep > 1 and tp > 1:
        # every Megatron-Bridge 0.3.1 MoE recipe sets expert_tensor_parallel_size = 1
        # (recipes/qwen/qwen3_moe.py, recipes/deepseek/deepseek_v3.py): MoE parallel folding
        kw["expert_tp"] = 1
    if row["src"].startswith("TT"):
        kw["torch_compile"] = "compile" in opts
    if row["prec"] == "FP8":
        recipe = next((o for o in opts if o in ("tensorwise", "rowwise")), a.fp8_recipe)
        kw.update(precision="fp8", fp8_recipe=recipe)
    dispatcher = a.moe_dispatcher
    if dispatcher == "recipe":
        dispatcher = "deepep" if row["src"] in ("MB", "AM") else "alltoall"
    if ep > 1 and dispatcher != "alltoall" and (tp == 1 or "expert_tp" in kw):
        kw["moe_dispatcher"] = dispatcher
    return ParallelConfig(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep, micro_batch_size=mbs,
                          num_micro_batches=row["gbs"] // (dp * mbs),
                          schedule="interleaved" if pp > 1 and vp > 1 else "1f1b",
                          virtual_stages=vp if pp > 1 else 1, zero_stage=zero, recompute=recompute,
                          sequence_parallel=sp, **kw)


_SYSTEMS: dict = {}


def system_for(row: dict, fw: str, a100_nics: tuple) -> tuple:
    """(model, the cost model's System) of a row: built once per model, machine and framework (a
    System holds caches of pure results only, so sharing it changes no estimate)."""
    key = (row["model"], row["seq"], row["system"], row["n"], fw, a100_nics if row["system"] == "A100" else None)
    if key not in _SYSTEMS:
        spec = model_for(row["model"], row["seq"])
        _SYSTEMS[key] = (spec, System(spec, cluster_for(row["system"], row["n"], a100_nics), framework=fw))
    return _SYSTEMS[key]


def price(row: dict, a: Assume = ASSUMED) -> dict:
    """The row priced under ``a``: {"status": "priced", predicted_s, error, fits, breakdown_s, ...}
    or {"status": "not expressible", "reason": one line}."""
    fw = FRAMEWORK[row["src"]]
    if fw == "megatron":
        fw = f"megatron:{a.megatron_recipe}"
    elif row["src"].startswith("TT"):
        fw = f"torchtitan:{a.torchtitan_2025 if row['src'] in TT_2025 else 'torch-2.6'}"
    try:
        spec, ctx = system_for(row, fw, a.a100_nics)
        parts = [(w, estimate(config_of(row, a, rc, fw), spec, ctx=ctx)) for rc, w in recompute_of(row, a)]
    except UserError as e:
        return {"status": "not expressible", "reason": _one_line(str(e)), "framework": fw}
    step = sum(w * e.step_time_s for w, e in parts)
    breakdown = {k: sum(w * e.breakdown_s[k] for w, e in parts) for k in TIME_TERMS}
    stages = len(parts[0][1].memory_by_stage)
    totals = [sum(w * e.memory_by_stage[s].total for w, e in parts) for s in range(stages)]
    capacity = [parts[0][1].memory_by_stage[s].capacity for s in range(stages)]
    world = parts[0][1].config.world_size
    out = {"status": "priced", "framework": fw, "predicted_s": step, "error": step / row["meas"] - 1,
           "fits": all(t <= c for t, c in zip(totals, capacity)), "breakdown_s": breakdown,
           "peak_memory_gib": max(totals) / 2**30, "capacity_gib": min(capacity) / 2**30,
           "configs": [e.config.to_dict() for _, e in parts], "weights": [w for w, _ in parts],
           "layout": parts[0][1].config.short() + (" (mixed with rc-none)" if len(parts) > 1 else "")}
    if world != row["n"]:
        out["note"] = f"layout uses {world} of the row's {row['n']} GPUs"
    return out


def _one_line(msg: str) -> str:
    return " ".join(msg.split())


# -- the open settings and their other plausible values ----------------------------------------------

def _tt(r):
    return FRAMEWORK[r["src"]] == "torchtitan"


VARIANTS = (
    ("ac=layer period", "2 (mix)", (("1 (full)", {"layer_sac_period": 1}), ("none", {"layer_sac_period": 0})),
     lambda r: r["ac"] == "layer"),
    ("ac=op", "selective", (("none", {"op_sac": "none"}), ("full", {"op_sac": "full"})),
     lambda r: r["ac"] == "op"),
    ("ac unstated", "none", (("selective", {"unstated_ac": "selective"}), ("full", {"unstated_ac": "full"})),
     lambda r: r["ac"] == "" and not r["src"].startswith("TT")),
    ("ac unstated (torchtitan)", "selective (its default)", (("none", {"torchtitan_unstated_ac": "none"}),
                                                             ("full", {"torchtitan_unstated_ac": "full"})),
     lambda r: r["ac"] == "" and r["src"].startswith("TT")),
    ("FP8 recipe unstated", "tensorwise",
     (("delayed (megatron) / rowwise (torchtitan)", {"fp8_recipe": "other"}),),
     lambda r: r["prec"] == "FP8" and not {"tensorwise", "rowwise"} & set(r["opts"])),
    ("Megatron recipe", "bridge-0.3", (("core-0.16", {"megatron_recipe": "core-0.16"}),),
     lambda r: FRAMEWORK[r["src"]] == "megatron"),
    ("Megatron TP overlap (tp>1)", "recipe (dense on, MoE off)", (("off", {"megatron_tp_overlap": "off"}),),
     lambda r: FRAMEWORK[r["src"]] == "megatron" and (r["tp"] or 1) > 1),
    ("FSDP under pp", "ZeRO-3", (("ZeRO-2 (no reshard)", {"fsdp_under_pp": 2}),),
     lambda r: FRAMEWORK[r["src"]] == "torchtitan" and (r["pp"] or 1) > 1),
    ("interleaved-1F1B vp", "2", (("4", {"interleaved_vp": 4}),),
     lambda r: "interleaved-1F1B" in r["opts"] and (r["vp"] or 1) == 1),
    ("sequence parallel (tp>1)", "on", (("off", {"sequence_parallel": False}),),
     lambda r: (r["tp"] or 1) > 1 and "asyncTP" not in r["opts"]),
    ("A100 network", "8 x 200 Gbit/s", (("4 x 100 Gbit/s", {"a100_nics": (4, "100 Gbit/s")}),),
     lambda r: r["system"] == "A100"),
    ("torchtitan of 2025-06", "torch-2.6 (FlashAttention-2)", (("0.3 (cuDNN attention)", {"torchtitan_2025": "0.3"}),),
     lambda r: r["src"] in TT_2025),
    ("MoE dispatcher", "recipe (DeepEP)", (("alltoall", {"moe_dispatcher": "alltoall"}),),
     lambda r: (r["ep"] or 1) > 1 and ((r["tp"] or 1) == 1 or FRAMEWORK[r["src"]] == "megatron")),
)
"""(setting, assumed value, ((alternative, Assume fields), ...), the rows it touches)."""


def _alternative(row: dict, fields: dict) -> Assume:
    if fields.get("fp8_recipe") == "other":  # the framework's other recipe for an unstated one
        fields = {"fp8_recipe": "delayed" if FRAMEWORK[row["src"]] == "megatron" else "rowwise"}
    return dataclasses.replace(ASSUMED, **fields)


def sensitivity(rows: list[dict]) -> list[dict]:
    """Each open setting's alternatives, priced on the rows it touches (everything else assumed)."""
    out = []
    for setting, assumed, alts, touches in VARIANTS:
        hit = [r for r in rows if touches(r)]
        base = [r["result"] for r in hit]
        entry = {"setting": setting, "assumed": assumed, "rows": [r["id"] for r in hit],
                 "assumed_stats": stats(base), "alternatives": []}
        for label, fields in alts:
            got = [price(r, _alternative(r, fields)) for r in hit]
            entry["alternatives"].append({"value": label, "stats": stats(got),
                                          "per_row": {r["id"]: g.get("error") for r, g in zip(hit, got)}})
        out.append(entry)
    return out


# -- summaries ---------------------------------------------------------------------------------------

def stats(results: list[dict]) -> dict:
    """rows, expressible, median |error|, median signed error, max |error|, false out-of-memory."""
    priced = [x for x in results if x["status"] == "priced"]
    errs = [x["error"] for x in priced]
    return {"rows": len(results), "expressible": len(priced),
            "median_abs_error": statistics.median(abs(e) for e in errs) if errs else None,
            "median_signed_error": statistics.median(errs) if errs else None,
            "max_abs_error": max(abs(e) for e in errs) if errs else None,
            "false_oom": sum(not x["fits"] for x in priced)}


def summarize(rows: list[dict]) -> dict:
    by = {"source": {s: stats([r["result"] for r in rows if r["src"] == s]) for s in SOURCES},
          "kind": {k: stats([r["result"] for r in rows if r["kind"] == k]) for k in KINDS},
          "all": stats([r["result"] for r in rows])}
    mem = [(r["result"]["peak_memory_gib"] / r["mem"] - 1) for r in rows
           if r["mem"] and r["result"]["status"] == "priced"]
    by["memory"] = {"rows": len(mem), "median_abs_error": statistics.median(abs(e) for e in mem) if mem else None,
                    "median_signed_error": statistics.median(mem) if mem else None}
    return by


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _apct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _stats_row(name: str, s: dict, extra: tuple = ()) -> tuple:
    return (name, *extra, str(s["rows"]), str(s["expressible"]), _apct(s["median_abs_error"]),
            _pct(s["median_signed_error"]), _apct(s["max_abs_error"]), str(s["false_oom"]))


STAT_COLS = ("rows", "expressible", "median |err|", "median err", "max |err|", "false OOM")


def _table(title: str, first: tuple) -> Table:
    t = Table(title=title)
    for c in first:
        t.add_column(c)
    for c in STAT_COLS:
        t.add_column(c, justify="right")
    return t


def report(rows: list[dict], summary: dict, sens: list[dict], con: Console) -> None:
    t = _table("per source (error = predicted / measured step time - 1)", ("source", "framework"))
    for s in SOURCES:
        t.add_row(*_stats_row(s, summary["source"][s], (FRAMEWORK[s],)))
    t.add_row(*_stats_row("all", summary["all"], ("",)))
    con.print(t)
    t = _table("per kind", ("kind",))
    for k in KINDS:
        t.add_row(*_stats_row(k, summary["kind"][k]))
    t.add_row(*_stats_row("all", summary["all"]))
    con.print(t)
    m = summary["memory"]
    con.print(f"peak memory against the {m['rows']} priced rows that state it: median |error| "
              f"{_apct(m['median_abs_error'])}, median signed {_pct(m['median_signed_error'])}")
    worst_rows(rows, con)
    not_expressible(rows, con)
    t = Table(title="open settings: the assumed value against the others, on the rows each touches")
    for c in ("setting", "rows", "value", "median |err|", "median err", "max |err|", "false OOM"):
        t.add_column(c, justify="left" if c in ("setting", "value") else "right")
    for e in sens:
        s = e["assumed_stats"]
        t.add_row(e["setting"], str(s["expressible"]), f"{e['assumed']} (assumed)", _apct(s["median_abs_error"]),
                  _pct(s["median_signed_error"]), _apct(s["max_abs_error"]), str(s["false_oom"]))
        for alt in e["alternatives"]:
            s = alt["stats"]
            t.add_row("", "", alt["value"], _apct(s["median_abs_error"]), _pct(s["median_signed_error"]),
                      _apct(s["max_abs_error"]), str(s["false_oom"]))
    con.print(t)


TERM_LABELS = {"compute": "compute", "recompute": "recomp", "tp_comm": "tp", "cp_comm": "cp", "ep_comm": "ep",
               "bubble": "bubble", "pp_comm": "pp", "dp_comm": "dp", "optimizer": "opt"}


def worst_rows(rows: list[dict], con: Console, k: int = 10) -> None:
    priced = [r for r in rows if r["result"]["status"] == "priced"]
    t = Table(title=f"the {k} worst rows (time terms in seconds, on the busiest device)")
    for c in ("row", "model", "n", "prec", "layout", "meas s", "pred s", "error", "fits",
              *TERM_LABELS.values()):
        t.add_column(c, justify="left" if c in ("row", "model", "layout") else "right")
    for r in sorted(priced, key=lambda r: (-abs(r["result"]["error"]), r["id"]))[:k]:
        x = r["result"]
        t.add_row(f"{r['src']}#{r['id']}", r["model"], str(r["n"]), r["prec"], x["layout"], f"{r['meas']:.2f}",
                  f"{x['predicted_s']:.2f}", _pct(x["error"]), "yes" if x["fits"] else "OOM",
                  *(f"{x['breakdown_s'][term]:.2f}" for term in TERM_LABELS))
    con.print(t)


def short_reason(reason: str) -> str:
    """The reason without the model's name or the configuration in front, nor the valid values after."""
    reason = re.sub(r"^(model [^:]+|invalid configuration \([^)]*\)): ", "", reason)
    return reason.split("; valid:")[0]


def not_expressible(rows: list[dict], con: Console) -> None:
    groups: dict = {}
    for r in rows:
        if r["result"]["status"] != "priced":
            groups.setdefault(short_reason(r["result"]["reason"]), []).append(r)
    t = Table(title="rows autoconf cannot express")
    for c in ("rows", "models", "reason"):
        t.add_column(c)
    for reason, rs in groups.items():
        t.add_row(", ".join(f"{r['src']}#{r['id']}" for r in rs),
                  ", ".join(dict.fromkeys(r["model"] for r in rs)), reason)
    con.print(t)


NOTES = (
    "H100-GT (Grand Teton) is the catalog's h100-sxm as deployed there: power_cap 500 W (0.88 of the 700 W GEMM "
    "rate, specs.devices.capped_clock_ratio), memory_bandwidth 2.4 TB/s, memory 95 GiB",
    "H200 hosts: NVLink 450 GB/s per GPU each way (HGX H200; the source states the network only)",
    "torchtitan's 2024 rows as torchtitan:torch-2.6 (SDPA ran FlashAttention-2 on Hopper, cuDNN's attention "
    "opt-in on the nightlies of then; torch 2.11 prefers cuDNN's there, measured)",
    "NeMo AutoModel rows run as framework torchtitan (torchtitan 0.3.0: PyTorch FSDP2 over DTensor, "
    "torch.distributed.pipelining; the closest autoconf runtime); Megatron-Bridge rows as megatron:bridge-0.3 "
    "(Megatron-Bridge 0.3.1's recipe defaults) with its distributed optimizer (ZeRO-1), Megatron FSDP where "
    "the row says FSDP, and MoE parallel folding (expert_tp 1) as its MoE recipes set it",
)
"""Settings fixed for every row of a kind that the cost model cannot take as the source states them."""


# -- main --------------------------------------------------------------------------------------------

def run(path: str = DATA, with_sensitivity: bool = True) -> dict:
    """Every row priced under the assumptions; the summary; each open setting's alternatives."""
    rows = load_rows(path)
    for r in rows:
        r["result"] = price(r)
        r["open_settings"] = {setting: assumed for setting, assumed, _, touches in VARIANTS if touches(r)}
    return {"rows": rows, "summary": summarize(rows), "sensitivity": sensitivity(rows) if with_sensitivity else []}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every row's prediction and breakdown, the summary and the "
                                   "open settings' alternatives here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    out = run()
    con = Console(width=220)
    report(out["rows"], out["summary"], out["sensitivity"], con)
    con.print("assumed where a row is silent: " + ", ".join(
        f"{f.name}={getattr(ASSUMED, f.name)}" for f in dataclasses.fields(Assume)))
    for note in NOTES:
        con.print(note)
    con.print(f"wall {time.perf_counter() - t0:.1f} s")
    if args.json:
        doc = {"assumed": dataclasses.asdict(ASSUMED), **out}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
