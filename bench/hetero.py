"""Placement on a cluster whose links really differ: three picks measured on the emulated testbed.

Two emulated nodes (network namespaces, ``autoconf.runs.testbed``) of two CPU processes each; inside a
node the ranks talk over unshaped loopback, between nodes through NICs shaped to --rates. As a user
would work: profile the testbed (compute and every link, across the nodes), then

- (a) what a Megatron-style default would run: tensor parallelism inside a node, the rest data
  parallelism, the naive rank order (tp-dp-pp), micro-batch 1, no pipeline;
- (b) autoconf's pick without trials (``search --profile --cluster``: measured links over the
  cluster file's, placement searched);
- (c) its pick with ``--verify 3`` (the fastest measured of its top 3; the trials run across the
  nodes, ``autoconf testbed --driver``);

and measure each with the reference trainer across the nodes (--passes passes, alternating order,
mean). Printed: predicted and measured step time, the prediction error, the speed-up over (a).

    python bench/hetero.py                       # 2 x 2 processes, 100 mbit between nodes (~8 min)
    python bench/hetero.py --rates 1gbit,1gbit   # faster links: less to gain

Needs root, ``ip``, ``tc`` and ``unshare`` (it says why and exits 2 otherwise). Four processes on a
2-core machine share the cores: the times include that contention, which the profile measured too.
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="100mbit,100mbit", help="NIC rate of each node (default 100mbit,100mbit)")
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
    model = load_model(MODEL)
    work = tempfile.mkdtemp(prefix="autoconf-hetero-")
    t0 = time.time()
    with tbm.Testbed(rates, nproc_per_node=2) as tb:
        cluster_path, cluster, profile_path, profile = profile_testbed(tb, MODEL, work, 2)
        print(f"profiled the testbed in {time.time() - t0:.0f} s: links between nodes "
              f"{min(x.bandwidth_bytes_per_s for x in profile.links) / 1e6:.1f} MB/s at the slowest, inside "
              f"{max(x.bandwidth_bytes_per_s for x in profile.links) / 1e9:.2f} GB/s at the fastest")
        driver = dict(os.environ, **{tbm.ATTACH_ENV: tbm.describe(tb.nodes, tb.master_port, 2)})
        os.environ[tbm.ATTACH_ENV] = driver[tbm.ATTACH_ENV]  # this process's trials run across the nodes
        common = ["search", "--model", MODEL, "--cluster", cluster_path, "--profile", profile_path,
                  "--global-batch", str(args.global_batch), "--storage", "none", "--gpus", "4"]
        b = autoconf(*common, env=driver)
        c = autoconf(*common, "--verify", "3", "--steps", str(args.steps), env=driver)
        ok = [v for v in c["verified"] if v["trial"]["ok"] and not v.get("refused")]
        chosen_c = min(ok, key=lambda v: v["trial"]["step_time_s"])["config"]
        m = args.global_batch // 2
        picks = {
            "(a) Megatron-style default": ParallelConfig(dp=2, pp=1, tp=2, micro_batch_size=1, num_micro_batches=m),
            "(b) autoconf, no trials": ParallelConfig.from_dict(b["best"]["config"]),
            "(c) autoconf --verify 3": ParallelConfig.from_dict(chosen_c),
        }
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
    print(f"\n{'pick':<28} {'configuration':<52} {'predicted':>10} {'measured':>10} {'error':>7} {'speed-up':>8}")
    for k, c in picks.items():
        pred = estimate(c, model, cluster, profile).step_time_s
        meas = sum(measured[k]) / args.passes
        rows.append({"pick": k, "config": c.to_dict(), "short": c.short(), "predicted_s": pred, "measured_s": meas,
                     "passes_s": measured[k], "error": pred / meas - 1, "speedup_over_a": base / meas})
        print(f"{k:<28} {c.short():<52} {pred * 1e3:>8.1f}ms {meas * 1e3:>8.1f}ms {pred / meas - 1:>+7.1%} "
              f"{base / meas:>7.2f}x")
    print(f"\nrates {args.rates}, global batch {args.global_batch}, {args.passes} passes x {args.steps} steps; "
          f"{time.time() - t0:.0f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rates": rates, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
