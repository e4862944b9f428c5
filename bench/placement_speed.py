"""Placement search speed and gain on a declared 1,024-GPU cluster with two NIC kinds.

    python bench/placement_speed.py [--cluster examples/clusters/mixed-1024.yaml]

For each case the whole search runs twice, in memory: once with the default order (rank r on
device r, layers split evenly: ``--no-place``), once with the placement search (graph heuristics
for every evaluated configuration, then the local search on the best five). Prints the wall time
of each, how much of it the local search took, the best step time of each and the speedup, and
for the placed best where each stage runs. The cluster file lists the slower Ethernet A100 nodes
first, as a user might: the default order then gives them the first stages.

Target: a few tens of seconds per placed search on the 2-core CI machine kind.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autoconf.specs.cluster import load_cluster  # noqa: E402
from autoconf.specs.model import preset  # noqa: E402
from autoconf.specs.units import fmt_seconds  # noqa: E402
from autoconf.study.search import search  # noqa: E402

CASES = [("gpt3-175b", 1536), ("llama-2-70b", 1024)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", default=os.path.join(os.path.dirname(__file__), "..", "examples", "clusters",
                                                      "mixed-1024.yaml"))
    args = ap.parse_args()
    cluster = load_cluster(args.cluster)
    con = Console(width=220)
    t = Table(title=f"placement search on {cluster.name} ({cluster.num_devices:,} GPUs; in-memory study, this machine)")
    for col in ("model", "batch", "search s (default)", "search s (placed)", "of which local search",
                "best, default order", "best, placed", "speedup", "placed best"):
        t.add_column(col)
    details = []
    for name, gb in CASES:
        model = preset(name)
        t0 = time.perf_counter()
        plain = search(model, cluster, gb, storage=None, place=False)
        t_plain = time.perf_counter() - t0
        t0 = time.perf_counter()
        placed = search(model, cluster, gb, storage=None, place=True)
        t_placed = time.perf_counter() - t0
        a, b = plain.top[0], placed.top[0]
        t.add_row(name, str(gb), f"{t_plain:.1f}", f"{t_placed:.1f}", f"{placed.placement_s:.1f}",
                  f"{fmt_seconds(a.step_time_s)} ({a.config.short()})", fmt_seconds(b.step_time_s),
                  f"{a.step_time_s / b.step_time_s:.2f}x", b.config.short())
        details.append((name, placed))
    con.print(t)
    for name, r in details:
        o = r.placement[0]
        s = Table(title=f"{name}: stages of the placed best (same configuration in the default order: "
                        f"{fmt_seconds(o['default_step_time_s'])}; graph heuristics {fmt_seconds(o['heuristic_step_time_s'])}; "
                        f"local search {fmt_seconds(o['placed_step_time_s'])} in {o['evaluations']} estimates)")
        for col in ("stage", "hosts", "GPUs", "layers"):
            s.add_column(col)
        for st in o["stages"]:
            hosts = st["hosts"]
            s.add_row(str(st["stage"]), f"{hosts[0]} .. {hosts[-1]} ({len(hosts)})" if len(hosts) > 2 else ", ".join(hosts),
                      ", ".join(f"{n} x {k}" for k, n in st["kinds"].items()), str(st["layers"]))
        con.print(s)


if __name__ == "__main__":
    main()
