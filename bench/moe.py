"""Mixtures of experts: how fast the search answers, and what it picks (EP x TP x PP x DP).

    python bench/moe.py

A DeepSeek-V3-sized model on 256 H100 and a Qwen3-30B-A3B-sized model on 16 H100 (H100 SXM hosts
of 8, NVLink 450 GB/s per direction, 8 x 400 Gbit/s InfiniBand), Megatron-LM, BF16 and FP8 both
allowed (the search's default): the wall time of the whole exhaustive search (in memory), the best
configuration and the all-to-all share of its step (``ep_comm``: dispatch and combine over the
expert-parallel group). Load balance is assumed perfect (``--moe-imbalance 1.0``; forced-balance
benchmarks run so); a second row per model at 1.3 shows what imbalance costs.

The shapes are the published ones (hidden, layers, heads, experts, top-k, expert widths, shared
experts, dense first layers, vocabulary); DeepSeek-V3's multi-head latent attention is taken here
as grouped-query attention of the same head count and width (its projections differ; the routed
experts dominate the step either way). Nothing here is measured on a GPU.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autoconf.cluster import load_cluster  # noqa: E402
from autoconf.model import ModelSpec  # noqa: E402
from autoconf.search import search  # noqa: E402

H100 = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters", "h100-8x8.yaml")

DEEPSEEK_V3_SIZED = ModelSpec(
    name="deepseek-v3-sized", num_layers=61, hidden_size=7168, num_attention_heads=128, num_kv_heads=128,
    head_dim=128, ffn_hidden_size=18432, vocab_size=129280, seq_length=4096, activation="swiglu", norm="rmsnorm",
    position_embedding="rope", num_experts=256, experts_per_token=8, expert_ffn_hidden_size=2048,
    num_shared_experts=1, first_dense_layers=3, router="sigmoid")
QWEN3_30B_A3B_SIZED = ModelSpec(
    name="qwen3-30b-a3b-sized", num_layers=48, hidden_size=2048, num_attention_heads=32, num_kv_heads=4,
    head_dim=128, ffn_hidden_size=6144, vocab_size=151936, seq_length=4096, activation="swiglu", norm="rmsnorm",
    position_embedding="rope", num_experts=128, experts_per_token=8, expert_ffn_hidden_size=768)


def hosts(n: int):
    base = load_cluster(H100)
    return dataclasses.replace(base, name=f"h100-{n}x8", node_groups=(dataclasses.replace(base.node_groups[0], count=n),))


def main() -> None:
    cases = [(DEEPSEEK_V3_SIZED, 32, 1024), (QWEN3_30B_A3B_SIZED, 2, 256)]
    t = Table(title="MoE searches (H100, Megatron-LM, in-memory study, this machine)")
    for col in ("model", "total / active", "GPUs", "imbalance", "wall s", "valid", "best", "step", "MFU",
                "all-to-all share", "peak"):
        t.add_column(col)
    for model, n_hosts, gb in cases:
        cluster = hosts(n_hosts)
        for imbalance in (1.0, 1.3):
            t0 = time.perf_counter()
            r = search(model, cluster, gb, storage=None, framework="megatron", moe_imbalance=imbalance)
            wall = time.perf_counter() - t0
            e = r.top[0] if r.top else None
            t.add_row(model.name, f"{model.num_params() / 1e9:.0f}B / {model.active_params() / 1e9:.1f}B",
                      str(cluster.num_devices), f"{imbalance:g}", f"{wall:.1f}", f"{r.valid:,}",
                      e.config.short() if e else "nothing fits", f"{e.step_time_s:.2f} s" if e else "-",
                      f"{100 * e.mfu:.1f}%" if e else "-",
                      f"{100 * e.breakdown_s['ep_comm'] / e.step_time_s:.1f}%" if e else "-",
                      f"{e.peak_memory_bytes / 2**30:.1f} GiB" if e else "-")
    Console(width=240).print(t)


if __name__ == "__main__":
    main()
