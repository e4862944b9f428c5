"""Placement on a cluster whose links really differ: the picks measured on the emulated testbed.

Emulated nodes (network namespaces, ``autoconf.runs.testbed``) of CPU processes; inside a node the
ranks talk over unshaped loopback, between nodes through NICs shaped to --rates. With --fabrics
and --between the nodes carry two kinds of NIC, as in Holmes's clusters: nodes of one fabric
talk at their NICs' rate, nodes of different fabrics at --between. As a user would work: profile
the testbed (compute and every link, across the nodes), then

- (a) what a Megatron-style default would run: tensor parallelism inside a node, the rest data
  parallelism, the naive rank order (tp-dp-pp), micro-batch 1, no pipeline;
- (b) autoconf's pick without trials (``search --profile --cluster``: measured links over the
  cluster file's, placement searched: which devices run each stage and group);
- (c) its pick with ``--verify 3`` (the fastest measured of its top 3; the trials run across the
  nodes, ``autoconf testbed --driver``), unless --no-verify;
- (d) the best placement-blind plan: the same search with ``--no-place`` (rank r on device r, in
  the order the nodes are listed; the rank orders tp-dp-pp, dp-tp-pp, ... still searched);

and measure each with the reference trainer across the nodes (--passes passes, alternating order,
mean). Printed: predicted and measured step time, the prediction error, the speed-up over (a).

    python bench/hetero.py                       # 2 x 2 processes, 100 mbit between nodes (~8 min)
    python bench/hetero.py --rates 1gbit,1gbit   # faster links: less to gain
    python bench/hetero.py --rates 1gbit --nodes 4 --nproc-per-node 1 --fabrics ib,eth,ib,eth \
        --between 50mbit --no-verify              # Holmes: two NIC kinds listed alternately

Needs root, ``ip``, ``tc`` and ``unshare`` (it says why and exits 2 otherwise). More processes
than this machine's 2 cores share them: the times include that contention, which the profile
measured too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autoconf.cost.estimate import estimate  # noqa: E402
from autoconf.launch.plan import LaunchPlan  # noqa: E402
from autoconf.runs import testbed as tbm  # noqa: E402
from autoconf.runs import testbed_plan  # noqa: E402
from autoconf.runs.trial import run_trial  # noqa: E402
from autoconf.space.config import ParallelConfig  # noqa: E402
from autoconf.specs.cluster import load_cluster  # noqa: E402
from autoconf.specs.hf import load_model  # noqa: E402
from autoconf.specs.profile import load_profile  # noqa: E402

MODEL = os.path.join(ROOT, "examples", "models", "bench-h256.yaml")


def autoconf(*args, env=None, timeout=1800) -> dict:
    p = subprocess.run([sys.executable, "-m", "autoconf", *args, "--json"], capture_output=True, text=True,
                       env=env, timeout=timeout, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"autoconf {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout)


def profile_testbed(tb, model_path: str, work: str, nproc_per_node: int, timeout: float = 1800):
    """The testbed's cluster file and ``autoconf profile --quick`` across its nodes (as a user would
    profile it): (cluster path, ClusterSpec, profile path, Profile)."""
    cluster_path = os.path.join(work, "testbed.yaml")
    with open(cluster_path, "w") as f:
        f.write(testbed_plan.cluster_yaml(tb.nodes, nproc_per_node))
    profile_path = os.path.join(work, "profile.json")
    with open(os.devnull, "w") as devnull:
        codes = tb.launch([sys.executable, "-m", "autoconf", "profile", "--model", model_path, "--quick",
                           "--out", profile_path], cwd=ROOT, timeout=timeout, output=devnull)
    if any(codes):
        raise SystemExit(f"profile across the testbed failed: exit codes {codes}")
    return cluster_path, load_cluster(cluster_path), profile_path, load_profile(profile_path)


def layout_text(c: ParallelConfig) -> str:
    """The configuration's short form with its placement: the device of each rank, if not r."""
    order = c.device_order
    if order is None or list(order) == list(range(len(order))):
        return c.short()
    return f"{c.short()} devices {','.join(map(str, order))}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="100mbit,100mbit", help="NIC rate of each node, or one for all "
                    "(default 100mbit,100mbit)")
    ap.add_argument("--nodes", type=int, default=None, help="nodes (default: one per --rates entry)")
    ap.add_argument("--nproc-per-node", type=int, default=2)
    ap.add_argument("--fabrics", default=None, help="each node's fabric, e.g. ib,eth,ib,eth (with --between)")
    ap.add_argument("--between", default=None, help="the rate between nodes of different fabrics")
    ap.add_argument("--no-verify", action="store_true", help="leave out pick (c)")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    reason = tbm.unavailable_reason()
    if reason:
        print(f"bench/hetero.py: no testbed here: {reason}", file=sys.stderr)
        return 2
    rates = [r.strip() for r in args.rates.split(",")]
    rates = rates * args.nodes if args.nodes and len(rates) == 1 else rates
    fabrics = [f.strip() for f in args.fabrics.split(",")] if args.fabrics else None
    nproc, world = args.nproc_per_node, len(rates) * args.nproc_per_node
    model = load_model(MODEL)
    work = tempfile.mkdtemp(prefix="autoconf-hetero-")
    t0 = time.time()
    with tbm.Testbed(rates, nproc_per_node=nproc, fabrics=fabrics, between=args.between) as tb:
        cluster_path, cluster, profile_path, profile = profile_testbed(tb, MODEL, work, nproc)
        print(f"profiled the testbed in {time.time() - t0:.0f} s: links between nodes "
              f"{min(x.bandwidth_bytes_per_s for x in profile.links) / 1e6:.1f} MB/s at the slowest, "
              f"{max(x.bandwidth_bytes_per_s for x in profile.links) / 1e6:.1f} MB/s at the fastest")
        driver = dict(os.environ, **{tbm.ATTACH_ENV: tbm.describe(tb.nodes, tb.master_port, nproc)})
        os.environ[tbm.ATTACH_ENV] = driver[tbm.ATTACH_ENV]  # this process's trials run across the nodes
        common = ["search", "--model", MODEL, "--cluster", cluster_path, "--profile", profile_path,
                  "--global-batch", str(args.global_batch), "--storage", "none", "--gpus", str(world)]
        b = autoconf(*common, env=driver)
        d = autoconf(*common, "--no-place", env=driver)
        m = args.global_batch // (world // nproc)
        picks = {
            "(a) Megatron-style default": ParallelConfig(dp=world // nproc, pp=1, tp=nproc, micro_batch_size=1,
                                                         num_micro_batches=m),
            "(b) autoconf, no trials": ParallelConfig.from_dict(b["best"]["config"]),
        }
        if not args.no_verify:
            c = autoconf(*common, "--verify", "3", "--steps", str(args.steps), env=driver)
            ok = [v for v in c["verified"] if v["trial"]["ok"] and not v.get("refused")]
            picks["(c) autoconf --verify 3"] = ParallelConfig.from_dict(
                min(ok, key=lambda v: v["trial"]["step_time_s"])["config"])
        picks["(d) best placement-blind"] = ParallelConfig.from_dict(d["best"]["config"])
        measured = {k: [] for k in picks}
        for p in range(args.passes):
            order = list(picks) if p % 2 == 0 else list(reversed(picks))
            for k in order:
                r = run_trial(LaunchPlan(picks[k], model, cluster), steps=args.steps, timeout_s=600)
                if not r.ok:
                    raise SystemExit(f"{k} {picks[k].short()} failed on the testbed: {r.reason}")
                measured[k].append(r.step_time_s)
    rows = []
    base = sum(measured["(a) Megatron-style default"]) / args.passes
    print(f"\n{'pick':<28} {'configuration':<64} {'predicted':>10} {'measured':>10} {'error':>7} {'speed-up':>8}")
    for k, c in picks.items():
        pred = estimate(c, model, cluster, profile).step_time_s
        meas = sum(measured[k]) / args.passes
        rows.append({"pick": k, "config": c.to_dict(), "short": c.short(), "predicted_s": pred, "measured_s": meas,
                     "passes_s": measured[k], "error": pred / meas - 1, "speedup_over_a": base / meas})
        print(f"{k:<28} {layout_text(c):<64} {pred * 1e3:>8.1f}ms {meas * 1e3:>8.1f}ms {pred / meas - 1:>+7.1%} "
              f"{base / meas:>7.2f}x")
    print(f"\nrates {args.rates}" + (f", fabrics {args.fabrics}, {args.between} between" if fabrics else "")
          + f", global batch {args.global_batch}, {args.passes} passes x {args.steps} steps; "
          f"{time.time() - t0:.0f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rates": rates, "fabrics": fabrics, "between": args.between, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
