"""Placement methods at equal evaluation budgets, and the placed plan against placement-blind plans
of other listings of the same cluster.

    python bench/placement_methods.py [--cluster examples/clusters/mixed-1024.yaml ...]
        [--case llama-2-70b:1024 ...] [--top 3] [--budgets 100,200,400] [--seeds 0,1,2] [--shuffles 2]

For each cluster and case: the placed search (``place=True``) gives the best ``--top``
configurations; each is taken back to the default order (rank r on device r, even layers) and
placed again by

- the graph heuristic alone (``Placer.place``),
- the heuristic, then the hill climb (``Placer.improve``),
- the heuristic, then simulated annealing (``study.anneal.anneal``, one run per seed),

each local search with the same evaluation budget (and no deadline), reporting the predicted
step time and the wall seconds. Then the placement-blind search (``place=False``) runs on several
listings of the cluster: the file's order, the node groups reversed, the hosts interleaved kind
by kind, and ``--shuffles`` seeded shuffles of the hosts. A listing of the hosts is the device
order that lists them so (rank r on the r-th listed device; splitting the node groups instead
would add inter-group caps that the cluster does not have), so those searches run with a placer
that only applies that order. The placed plan must be no slower than the best of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import autoconf.study.search as search_module  # noqa: E402
from autoconf.cost.estimate import estimate_on  # noqa: E402
from autoconf.cost.system import System  # noqa: E402
from autoconf.specs.cluster import load_cluster  # noqa: E402
from autoconf.specs.model import preset  # noqa: E402
from autoconf.study.anneal import anneal  # noqa: E402
from autoconf.study.placer import Placer  # noqa: E402

HERE = os.path.dirname(__file__)
CLUSTERS = [os.path.join(HERE, "..", "examples", "clusters", f) for f in ("mixed-1024.yaml", "two-kinds.yaml")]
CASES = {"mixed-1024": ["llama-2-70b:1024"], "two-kinds": ["gpt3-2.7b:48", "llama-2-7b:48"]}


class _Listed(Placer):
    """A placement-blind search on a relisted cluster: every configuration in one fixed device
    order (rank r on device ``listing[r]``), layers even, no local search."""

    listing: tuple = ()

    def place(self, c):
        order = None if list(self.listing) == list(range(self.world)) else tuple(self.listing)
        return dataclasses.replace(c, device_order=order, stage_layers=None) if c.world_size == self.world else c

    __call__ = place

    def improve(self, c, max_evaluations=200, deadline=None):
        return estimate_on(c, self.system), 1


def listings(cluster, shuffles: int) -> list:
    """(name, device listing) for each listing of the cluster's hosts tried."""
    hosts, d = [], 0
    for _, g in cluster.nodes():
        hosts.append((g.device, list(range(d, d + g.gpus_per_node))))
        d += g.gpus_per_node
    by_kind: dict = {}
    for kind, devs in hosts:
        by_kind.setdefault(kind, []).append(devs)
    runs = list(by_kind.values())
    out = [("file order", None), ("node groups reversed", [x for _, devs in reversed(hosts) for x in devs])]
    out.append(("hosts interleaved by kind", [x for i in range(max(map(len, runs))) for r in runs if i < len(r)
                                              for x in r[i]]))
    for s in range(shuffles):
        perm = list(hosts)
        random.Random(s).shuffle(perm)
        out.append((f"hosts shuffled (seed {s})", [x for _, devs in perm for x in devs]))
    return out


def blind_best(model, cluster, gb, listing):
    """The best placement-blind plan with the cluster's devices listed in ``listing``'s order."""
    if listing is None:
        return search_module.search(model, cluster, gb, storage=None, place=False).top[0]
    cls = type("Listed", (_Listed,), {"listing": tuple(listing)})
    saved = search_module.Placer
    search_module.Placer = cls  # the search builds its placer itself: it builds this one
    try:
        return search_module.search(model, cluster, gb, storage=None, place=True).top[0]
    finally:
        search_module.Placer = saved


def compare(model, cluster, gb, top: int, budgets, seeds, con):
    t0 = time.perf_counter()
    placed = search_module.search(model, cluster, gb, storage=None, place=True, top=top)
    t_search = time.perf_counter() - t0
    ctx = System(model, cluster)
    t = Table(title=f"{model.name} on {cluster.name}, global batch {gb}: predicted step time (s) / wall s")
    for col in ("configuration", "budget", "default order", "heuristic", "hill climb",
                *(f"anneal seed {s}" for s in seeds), "anneal best"):
        t.add_column(col)
    wins = {"hill": 0, "anneal": 0, "tie": 0}
    for e in placed.top:
        c = dataclasses.replace(e.config, device_order=None, stage_layers=None)
        default = estimate_on(c, ctx)
        placer = Placer(ctx, c.world_size)
        t0 = time.perf_counter()
        start = placer.place(c)
        heur = estimate_on(start, ctx)
        t_heur = time.perf_counter() - t0
        for n in budgets:
            t0 = time.perf_counter()
            hill, _ = placer.improve(start, max_evaluations=n)
            t_hill = time.perf_counter() - t0
            runs = []
            for s in seeds:
                t0 = time.perf_counter()
                a, _ = anneal(placer, start, max_evaluations=n, seed=s)
                runs.append((a.step_time_s, time.perf_counter() - t0))
            best_a = min(x for x, _ in runs)
            key = "tie" if abs(best_a - hill.step_time_s) <= 1e-9 * hill.step_time_s else \
                ("anneal" if best_a < hill.step_time_s else "hill")
            wins[key] += 1
            t.add_row(c.short(), str(n), f"{default.step_time_s:.3f}" if default.fits else "OOM",
                      f"{heur.step_time_s:.3f} / {t_heur:.2f}", f"{hill.step_time_s:.3f} / {t_hill:.2f}",
                      *(f"{x:.3f} / {w:.2f}" for x, w in runs), f"{best_a:.3f}")
    con.print(t)
    con.print(f"best of the seeds vs the hill climb, over configurations x budgets: {wins}")
    return placed.top, t_search


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", nargs="*", default=CLUSTERS)
    ap.add_argument("--case", nargs="*", default=None, help="model:global_batch (default: per cluster)")
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--budgets", default="100,200,400")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--shuffles", type=int, default=2)
    args = ap.parse_args()
    budgets = [int(x) for x in args.budgets.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    con = Console(width=220)
    for path in args.cluster:
        cluster = load_cluster(path)
        for case in args.case or CASES.get(cluster.name, ["llama-2-7b:48"]):
            name, gb = case.split(":")
            model, gb = preset(name), int(gb)
            top, t_search = compare(model, cluster, gb, args.top, budgets, seeds, con)
            g = Table(title=f"{model.name} on {cluster.name}: the placed plan against placement-blind listings")
            for col in ("listing", "best blind step time (s)", "configuration", "placed / blind", "search s"):
                g.add_column(col)
            g.add_row("placed search", f"{top[0].step_time_s:.3f}", top[0].config.short(), "1.000",
                      f"{t_search:.1f}")
            worst = 0.0
            for what, listing in listings(cluster, args.shuffles):
                t0 = time.perf_counter()
                b = blind_best(model, cluster, gb, listing)
                ratio = top[0].step_time_s / b.step_time_s
                worst = max(worst, ratio)
                g.add_row(what, f"{b.step_time_s:.3f}", dataclasses.replace(b.config, device_order=None).short(),
                          f"{ratio:.3f}", f"{time.perf_counter() - t0:.1f}")
            con.print(g)
            con.print("placed plan never slower than a blind listing: " + ("yes" if worst <= 1 + 1e-9 else
                                                                          f"NO (placed / blind up to {worst:.3f})"))


if __name__ == "__main__":
    main()
