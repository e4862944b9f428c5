"""Mixtures of experts: how fast the search answers, and what it picks (EP x TP x PP x DP).

    python bench/moe.py

DeepSeek-V3 (the preset) on 256 H100 and Qwen3-30B-A3B on 16 H100 (H100 SXM hosts
of 8, NVLink 450 GB/s per direction, 8 x 400 Gbit/s InfiniBand), Megatron-LM, BF16 and FP8 both
allowed (the search's default): the wall time of the whole exhaustive search (in memory), the best
configuration and the all-to-all share of its step (``ep_comm``: dispatch and combine over the
expert-parallel group). Load balance is assumed perfect (``--moe-imbalance 1.0``; forced-balance
benchmarks run so); a second row per model at 1.3 shows what imbalance costs, a third what
DeepEP's dispatch buys (``--moe-dispatcher deepep``: a token once per host over the NICs, once per
GPU over NVLink; DeepSeek-V3's node-limited routing caps its hosts at 4).

The shapes are the published configs' (``autoconf models``: DeepSeek-V3 with its multi-head latent
attention, 256 routed experts top-8, one shared, three dense first blocks, the sigmoid router;
Qwen3-30B-A3B with 128 experts top-8 and Q/K norms), at 4,096 tokens. Nothing here is measured on
a GPU.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autoconf.specs.cluster import load_cluster  # noqa: E402
from autoconf.specs.model import preset  # noqa: E402
from autoconf.study.search import search  # noqa: E402

H100 = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters", "h100-8x8.yaml")


def hosts(n: int):
    base = load_cluster(H100)
    return dataclasses.replace(base, name=f"h100-{n}x8", node_groups=(dataclasses.replace(base.node_groups[0], count=n),))


def main() -> None:
    cases = [(preset("deepseek-v3"), 32, 1024), (preset("qwen3-30b-a3b"), 2, 256)]
    t = Table(title="MoE searches (H100, Megatron-LM, in-memory study, this machine)")
    for col in ("model", "total / active", "GPUs", "imbalance", "dispatcher", "wall s", "valid", "best", "step",
                "MFU", "all-to-all share", "peak"):
        t.add_column(col)
    for model, n_hosts, gb in cases:
        cluster = hosts(n_hosts)
        for imbalance, dispatcher in ((1.0, "alltoall"), (1.3, "alltoall"), (1.0, "deepep")):
            t0 = time.perf_counter()
            r = search(model, cluster, gb, storage=None, framework="megatron", moe_imbalance=imbalance,
                       moe_dispatcher=dispatcher)
            wall = time.perf_counter() - t0
            e = r.top[0] if r.top else None
            t.add_row(model.name, f"{model.num_params() / 1e9:.0f}B / {model.active_params() / 1e9:.1f}B",
                      str(cluster.num_devices), f"{imbalance:g}", dispatcher, f"{wall:.1f}", f"{r.valid:,}",
                      e.config.short() if e else "nothing fits", f"{e.step_time_s:.2f} s" if e else "-",
                      f"{100 * e.mfu:.1f}%" if e else "-",
                      f"{100 * e.breakdown_s['ep_comm'] / e.step_time_s:.1f}%" if e else "-",
                      f"{e.peak_memory_bytes / 2**30:.1f} GiB" if e else "-")
    Console(width=240).print(t)


if __name__ == "__main__":
    main()
