"""Search speed: GPT-3 175B on 1,024 A100s and a 1T model on 3,072 A100s.

    python bench/search_speed.py [--trials N]

Prints, per case: configurations in the space, valid ones, outer points, trials stored, full
estimates (schedule simulated; dominated configurations are skipped by the bound), wall time,
valid configurations decided per second and the best configuration found (the exhaustive optimum:
TPE, then every point by branch and bound). No storage (in memory), so the
time is the search itself. Target: under 30 s per case on the 2-core CI machine kind.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autoconf.specs.cluster import load_cluster  # noqa: E402
from autoconf.specs.model import ModelSpec, preset  # noqa: E402
from autoconf.study.search import search  # noqa: E402

ONE_T = ModelSpec(name="gpt-1t", num_layers=128, hidden_size=25600, num_attention_heads=160, num_kv_heads=160,
                  ffn_hidden_size=4 * 25600, vocab_size=51200, seq_length=2048, activation="gelu",
                  tied_embeddings=True, dtype="bf16", norm="layernorm", position_embedding="learned", bias=True)


def a100_nodes(n: int):
    base = load_cluster(os.path.join(os.path.dirname(__file__), "..", "examples", "clusters", "a100-4x8.yaml"))
    return dataclasses.replace(base, name=f"a100-{n}x8", node_groups=(dataclasses.replace(base.node_groups[0], count=n),))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=None, help="trial budget (default: the search's default)")
    args = ap.parse_args()
    cases = [("gpt3-175b", preset("gpt3-175b"), 128, 1536), ("gpt-1t", ONE_T, 384, 3072)]
    t = Table(title="search speed (in-memory study, this machine)")
    for col in ("model", "GPUs", "configs", "valid", "outer pts", "trials", "full estimates", "wall s", "configs/s", "best", "MFU"):
        t.add_column(col)
    for name, model, nodes, gb in cases:
        cluster = a100_nodes(nodes)
        t0 = time.perf_counter()
        r = search(model, cluster, gb, storage=None, trials=args.trials)
        wall = time.perf_counter() - t0
        best = r.top[0] if r.top else None
        t.add_row(name, str(cluster.num_devices), f"{r.space_size:,}", f"{r.valid:,}", f"{r.outer_points:,}",
                  str(r.trials_run), f"{r.estimates:,}", f"{wall:.1f}", f"{r.valid / wall:,.0f}",
                  best.config.short() if best else "none fits", f"{100 * best.mfu:.1f}%" if best else "")
    Console(width=200).print(t)


if __name__ == "__main__":
    main()
