"""Shortest time to train, with and without each method, on InfiniBand and on Ethernet.

    python bench/time_to_train.py            # GPT-3 175B and a 1T GPT on A100 and H100 (minutes)
    python bench/time_to_train.py --timing   # the 60-s target: `autoconf plan` for the 1T model
    python bench/time_to_train.py --check-exact   # the optimiser against search() at 175B scale

For each model and device, ``autoconf plan`` (``timetotrain.planner.plan``) sweeps GPU counts
(powers of two; counts that would take over a year even at the datasheet peak left out) until more
GPUs stop paying on each network (``--max-gpus N`` bounds them instead; a shortest time at the
largest count swept is marked "edge": more GPUs might still pay), batches
around the critical batch (Kaplan's law), every configuration of the cost model's space at each
point, with each method switched off in turn, on InfiniBand (a NIC per GPU) and on one 100 or 25
Gbit/s Ethernet NIC per node. Tokens: Chinchilla's 20 per parameter. Printed per model and
device: the shortest time of each method set on each network, its GPU count, configuration and
peak memory per GPU, and the two claims of Lamy-Poirier (arXiv 2106.02679): layered gradient
accumulation with modular (looped) placement cuts the shortest training time by about 2x, and
with them a fast InfiniBand network is no longer needed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autoconf.output.plan_report import compact  # noqa: E402
from autoconf.specs.hf import load_model
from autoconf.specs.model import preset  # noqa: E402
from autoconf.timetotrain.planner import plan
from autoconf.timetotrain.synthetic import METHODS

ROOT = os.path.join(os.path.dirname(__file__), "..")
ONE_T = os.path.join(ROOT, "examples", "models", "gpt-1t.yaml")
NETS = ("ib", "100gbe", "25gbe")


def timing() -> None:
    cmd = [sys.executable, "-m", "autoconf", "plan", "--model", ONE_T, "--device", "a100-80gb",
           "--max-gpus", "65536", "--quiet"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=os.path.abspath(ROOT)))
    wall = time.perf_counter() - t0
    if p.returncode:
        sys.exit(p.stderr)
    last = [x for x in p.stdout.splitlines() if "estimates" in x]
    print(f"autoconf plan, 1T model, A100, up to 65,536 GPUs, every method, ib + 25gbe: {wall:.1f} s wall "
          f"(target 60 s){'; ' + last[-1].strip() if last else ''}")
    if os.path.exists("/proc/loadavg"):
        print("load average:", " ".join(open("/proc/loadavg").read().split()[:3]))


def check_exact() -> None:
    """The per-point optimiser against search()'s exhaustive optimum at GPT-3 scale (no warm start)."""
    from autoconf.study.search import search
    from autoconf.timetotrain.optimiser import PointOptimizer
    from autoconf.timetotrain.synthetic import planning_system, synthetic_cluster
    for dev, gpus, batch, net in (("a100-80gb", 1024, 1536, "ib"), ("a100-80gb", 1024, 1536, "25gbe"),
                                  ("h100-sxm", 2048, 3072, "100gbe")):
        m = preset("gpt3-175b")
        cl = synthetic_cluster(dev, gpus, net)
        t0 = time.perf_counter()
        best, _ = PointOptimizer(planning_system(m, cl)).run(gpus, batch)
        t1 = time.perf_counter()
        ref = search(m, cl, batch, storage=None, place=False, top=1)
        t2 = time.perf_counter()
        a, b = best["all"], ref.top[0]
        print(f"175B, {gpus} {dev}, {net}, batch {batch}: plan {a.step_time_s:.4f} s ({compact(a.config)}, "
              f"{t1 - t0:.1f} s), search {b.step_time_s:.4f} s ({compact(b.config)}, {t2 - t1:.1f} s): "
              f"{'same' if abs(a.step_time_s - b.step_time_s) <= 1e-9 * b.step_time_s else 'DIFFERENT'}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timing", action="store_true", help="only the 60-s line")
    ap.add_argument("--check-exact", action="store_true", help="only the comparison with search() at 175B scale")
    ap.add_argument("--models", default="gpt3-175b,1t")
    ap.add_argument("--devices", default="a100-80gb,h100-sxm")
    ap.add_argument("--max-gpus", type=int, default=0, help="the largest GPU count (default 0: until more stop paying)")
    ap.add_argument("--max-virtual-stages", default="all", help="chunks per device tried (default all: up to one "
                    "layer per chunk, the paper's fully modular pipeline; 8 is search's default, much faster)")
    args = ap.parse_args()
    if args.timing:
        timing()
        return
    if args.check_exact:
        check_exact()
        return
    con = Console(width=170)
    claims = []
    for mname in args.models.split(","):
        model = load_model(ONE_T) if mname == "1t" else preset(mname)
        for dev in args.devices.split(","):
            t0 = time.perf_counter()
            r = plan(model, device=dev, max_gpus=args.max_gpus or None, compare_networks=NETS[1:],
                     max_virtual=None if args.max_virtual_stages == "all" else int(args.max_virtual_stages))
            t = Table(title=f"{model.name} on {dev}: {r.budget.tokens / 1e12:.3g}T tokens, B_crit "
                            f"{r.budget.b_crit_tokens / model.seq_length:,.0f} sequences, batches "
                            f"{', '.join(map(str, r.budget.batches))}; GPU counts {r.grid[0]:,}-{r.grid[-1]:,} "
                            f"({time.perf_counter() - t0:.0f} s)")
            t.add_column("methods")
            for net in NETS:
                t.add_column(f"{net} days")
                t.add_column(f"{net}: GPUs, config, GiB")
            for meth in METHODS:
                cells = [meth.label]
                for net in NETS:
                    x = r.shortest(net, meth.name)
                    a = r.shortest(net, "all")
                    if x is None:
                        cells += ["none fits", ""]
                        continue
                    cells.append(f"{x.days:.1f}" + (f" ({x.days / a.days:.2f}x)" if meth.name != "all" else ""))
                    edge = x.gpus == max(y.gpus for y in r.select(net, meth.name))
                    cells.append(f"{x.gpus:,}{' (edge)' if edge else ''}, {compact(x.estimate.config)}, "
                                 f"{x.estimate.peak_memory_bytes / 2**30:.0f}")
                t.add_row(*cells)
            con.print(t)
            ib_all, ib_base = r.shortest("ib", "all"), r.shortest("ib", "baseline")
            for net in NETS:
                a, b = r.shortest(net, "all"), r.shortest(net, "baseline")
                if a and b:
                    claims.append((model.name, dev, net, b.days / a.days, a.days / ib_all.days, a.days / ib_base.days))
    ct = Table(title="the paper's claims under autoconf's model (shortest times)")
    for col in ("model", "device", "network", "baseline / every method (paper: ~2x)",
                "with the methods: network / InfiniBand", "with the methods on it / InfiniBand without"):
        ct.add_column(col)
    for mname, dev, net, x2, vs_ib, vs_ib_base in claims:
        ct.add_row(mname, dev, net, f"{x2:.2f}x", f"{vs_ib:.2f}x", f"{vs_ib_base:.2f}x")
    con.print(ct)


if __name__ == "__main__":
    main()
