"""How far the cost model lands from real trial runs on this machine, and whether it picks the best.

For every valid configuration of a small model at world size 2 (or a deterministic spread of at
most --max-configs of them) it runs the reference trainer under torchrun (CPU, gloo, one thread
per process) and compares with ``autoconf.cost.estimate.estimate`` on the localhost-cpu cluster
example (and with a profile, if --profile is given):

    median / max relative error of step time and peak memory, Spearman rank correlation of step
    time, regret = measured time of the predicted best / best measured, without trials and with
    verify-3 (best measured among the predicted top 3).

    python bench/accuracy.py --quick                 # ~5 minutes
    python bench/accuracy.py --max-configs 24        # more configurations
    python bench/accuracy.py --world 4 --max-configs 8   # 4 processes on 2 cores: contention

Protocol, as a user would work: profile first (``autoconf profile`` on the same processes, unless
--profile names a stored one), then the trials. Every configuration runs --passes times, the
passes in alternating order (forward, reverse, ...), and its measured time is the mean of the
passes: a shared VM's speed moves by tens of percent for seconds to minutes at a time, and the
pass-to-pass difference printed at the end is that noise floor. With a profile, every trial also
times the profile's reference block after each step (the trainer's --speed-probe); the ratio to
the profile's time is the machine's drift since profiling, and one more prediction row scales the
profile prediction by it (a correction measured beside the trial, not fitted to it).

With more processes than cores the processes share cores; the cost model runs the pipeline at
processor-sharing rates (a computing rank gets cores / ranks computing on its machine at that
moment, at most one core; the profile records the machine's cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stats import spearman  # noqa: E402

from autoconf.launch.plan import LaunchPlan  # noqa: E402
from autoconf.runs.trial import run_trial, speed_vs_profile  # noqa: E402
from autoconf.space.enumeration import enumerate_space  # noqa: E402
from autoconf.specs.cluster import load_cluster  # noqa: E402
from autoconf.specs.model import ModelSpec  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench_model(quick: bool) -> ModelSpec:
    """Compute dominates start-up noise: a few layers of hidden 256 (quick) or 384, seq 128, fp32."""
    h = 256 if quick else 384
    return ModelSpec(name="bench", num_layers=4, hidden_size=h, num_attention_heads=4, num_kv_heads=4,
                     ffn_hidden_size=4 * h, vocab_size=2048, seq_length=128, dtype="fp32", bias=True)


def spread(configs: list, n: int) -> list:
    """A deterministic selection of n configurations that covers every (dp, pp, tp) split and schedule."""
    if len(configs) <= n:
        return configs
    buckets: dict = {}
    for c in configs:
        buckets.setdefault((c.dp, c.pp, c.tp, c.schedule, c.layered_grad_accum), []).append(c)
    out, i = [], 0
    while len(out) < n:
        added = False
        for key in sorted(buckets):
            b = buckets[key]
            if i < len(b):
                # stride through the bucket so ZeRO / recompute / mbs choices vary
                out.append(b[(i * 7) % len(b)] if len(b) > 7 else b[i])
                added = True
                if len(out) == n:
                    break
        if not added:
            break
        i += 1
    return out


def summarise(rows: list[dict], key: str) -> dict:
    ok = [r for r in rows if r["ok"] and r.get(key) is not None]
    if not ok:
        return {}
    t_err = [abs(r[key]["step_time_s"] - r["step_time_s"]) / r["step_time_s"] for r in ok]
    m_err = [abs(r[key]["peak_memory_bytes"] - r["peak_memory_bytes"]) / r["peak_memory_bytes"]
             for r in ok if r.get("peak_memory_bytes")]
    pred = [r[key]["step_time_s"] for r in ok]
    meas = [r["step_time_s"] for r in ok]
    best = min(meas)
    by_pred = sorted(ok, key=lambda r: r[key]["step_time_s"])
    return {"n": len(ok), "time_err_median": statistics.median(t_err), "time_err_max": max(t_err),
            "mem_err_median": statistics.median(m_err) if m_err else float("nan"),
            "mem_err_max": max(m_err) if m_err else float("nan"),
            "spearman": spearman(pred, meas), "regret": by_pred[0]["step_time_s"] / best,
            "regret_verify3": min(r["step_time_s"] for r in by_pred[:3]) / best}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller model, 8 configurations, 4 steps")
    ap.add_argument("--world", type=int, default=2, help="processes (2 cores here: 4 measures contention)")
    ap.add_argument("--max-configs", type=int, default=None, help="at most this many configurations")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=None, help="steps per trial (warm-up 2 included)")
    ap.add_argument("--cluster", default=os.path.join(ROOT, "examples/clusters/localhost-cpu.yaml"))
    ap.add_argument("--profile", default="fresh",
                    help="a profile JSON from `autoconf profile`, 'fresh' (default: profile the model now, with "
                    "the same number of processes) or 'none' (catalog prediction only)")
    ap.add_argument("--passes", type=int, default=2, help="run every configuration this many times (mean)")
    ap.add_argument("--cp-fp8", action="store_true",
                    help="only configurations that split the sequence (cp = world) or run FP8 linears")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    if args.passes < 1:
        ap.error(f"--passes {args.passes}: expected 1 or more")

    model = bench_model(args.quick)
    cluster = load_cluster(args.cluster)
    if args.world > cluster.num_devices:
        import dataclasses
        g = cluster.node_groups[0]
        cluster = dataclasses.replace(cluster, node_groups=(dataclasses.replace(g, gpus_per_node=args.world),))
    n_max = args.max_configs or (8 if args.quick else 16)
    steps = args.steps or (4 if args.quick else 6)
    valid = [c for c, reason in enumerate_space(model, args.world, args.global_batch, max_micro_batch=8)
             if reason is None]
    if args.cp_fp8:  # sequences split over every process, or the linear layers in FP8 (tensorwise)
        import dataclasses
        split = [c for c, reason in enumerate_space(model, args.world, args.global_batch, max_micro_batch=8,
                                                    cps=(args.world,)) if reason is None]
        valid = split + [dataclasses.replace(c, precision="fp8") for c in valid]
    chosen = spread(valid, n_max)
    try:
        from autoconf.cost.estimate import estimate
    except ImportError as e:
        print(f"cost model not available yet ({e}); measuring only")
        estimate = None
    load0 = os.getloadavg()[0]
    print(f"started {time.strftime('%H:%M:%S')}, load average {load0:.1f}")
    profile = None
    if args.profile == "fresh":
        args.profile = _fresh_profile(model, args.world)
    if args.profile != "none":
        from autoconf.specs.profile import load_profile
        profile = load_profile(args.profile)

    print(f"model {model.hidden_size}h x {model.num_layers}L seq {model.seq_length} fp32, world {args.world}, "
          f"global batch {args.global_batch}: {len(valid)} valid configurations, running {len(chosen)}")
    if load0 > 0.5:
        print(f"warning: load average {load0:.1f} before starting: other processes share the cores, "
              "measured times will be inflated")
    t_start = time.perf_counter()
    runs: dict = {i: [] for i in range(len(chosen))}
    for p in range(args.passes):
        order = range(len(chosen)) if p % 2 == 0 else reversed(range(len(chosen)))
        for i in order:
            res = run_trial(LaunchPlan(chosen[i], model), steps=steps, warmup=2, timeout_s=300,
                            speed_probe=profile is not None)
            runs[i].append(res)
            t = f"{res.step_time_s * 1e3:8.1f} ms" if res.ok else f"failed ({res.reason[:60]})"
            ratio = speed_vs_profile(res, profile, model) if res.ok else None
            t += f"   machine speed vs profile {ratio:.2f}x" if ratio else ""
            print(f"  pass {p + 1} {i:3d} {chosen[i].short():<52} {t}", flush=True)
    rows = []
    for i, c in enumerate(chosen):
        done = runs[i]
        ok = [r for r in done if r.ok]
        res = ok[0] if len(ok) == len(done) else next(r for r in done if not r.ok)
        times = [r.step_time_s for r in ok]
        row = {"config": c.short(), "ok": res.ok, "reason": res.reason,
               "step_time_s": statistics.mean(times) if res.ok else None, "pass_times_s": times,
               "peak_memory_bytes": res.peak_memory_bytes, "wall_s": sum(r.wall_s for r in done)}
        if estimate is not None:
            e = estimate(c, model, cluster)
            row["pred"] = {"step_time_s": e.step_time_s, "peak_memory_bytes": e.peak_memory_bytes}
            if profile is not None:
                e = estimate(c, model, cluster, profile)
                row["pred_profile"] = {"step_time_s": e.step_time_s, "peak_memory_bytes": e.peak_memory_bytes}
                ratios = [speed_vs_profile(r, profile, model) for r in ok]
                if ok and all(ratios):
                    row["speed_vs_profile"] = statistics.mean(ratios)
                    row["pred_drift"] = {"step_time_s": e.step_time_s * row["speed_vs_profile"],
                                         "peak_memory_bytes": e.peak_memory_bytes}
        row["_config"] = c
        rows.append(row)
        _print_row(i, row)
    if profile is not None and estimate is not None:
        _calibrated(rows, model, cluster, profile, estimate)
    print(f"total {time.perf_counter() - t_start:.0f} s; load average {load0:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at end (cores: {os.cpu_count()})")
    for key, label in (("pred", "catalog (localhost-cpu.yaml)"), ("pred_profile", "with profile"),
                       ("pred_drift", "with profile, scaled by the machine's measured speed drift (speed probe)"),
                       ("pred_calibrated", "with profile, calibrated on the predicted top 3 (as --verify 3 --calibrate)")):
        s = summarise(rows, key)
        if s:
            print(f"\n{label}: n={s['n']}  step time err median {s['time_err_median']:.0%} max {s['time_err_max']:.0%}"
                  f"  | peak mem err median {s['mem_err_median']:.0%} max {s['mem_err_max']:.0%}"
                  f"  | Spearman {s['spearman']:.2f}  | regret {s['regret']:.2f}, verify-3 {s['regret_verify3']:.2f}")
    diffs = [abs(r["pass_times_s"][1] - r["pass_times_s"][0]) / min(r["pass_times_s"][:2])
             for r in rows if r["ok"] and len(r["pass_times_s"]) >= 2]
    if diffs:
        print(f"\nnoise floor: the same configuration's first two passes differ by {statistics.median(diffs):.0%} "
              f"(median), {max(diffs):.0%} (max)")
    if args.world > os.cpu_count():
        print(f"\nnote: {args.world} processes on {os.cpu_count()} cores share cores; the cost model runs the "
              "pipeline at processor-sharing rates (a rank idle in a pipeline bubble leaves its core to the others)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows], f, indent=1)
    return 0


def _fresh_profile(model: ModelSpec, world: int) -> str:
    """Profile the bench model now with ``autoconf profile`` (micro-batch sizes 1-8) and return the
    file: predictions then rest on measurements of this machine taken minutes before the trials."""
    import subprocess
    import tempfile

    import yaml

    tmp = tempfile.mkdtemp(prefix="accuracy-")
    spec = os.path.join(tmp, "model.yaml")
    with open(spec, "w") as f:
        yaml.safe_dump({k: v for k, v in model.to_dict().items() if k != "name"}, f)
    out = os.path.join(tmp, "profile.json")
    cmd = [sys.executable, "-m", "autoconf", "profile", "--model", spec, "--nproc-per-node", str(world),
           "--micro-batch-sizes", "1,2,4,8", "--out", out]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"profiling failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}")
    print(f"profiled the model in {time.perf_counter() - t0:.0f} s: {out}")
    return out


def _calibrated(rows: list[dict], model, cluster, profile, estimate) -> None:
    """What `search --verify 3 --calibrate` would do: fit factors on the trials of the predicted top 3,
    then predict every configuration again with them (error measured on all, fitted on three)."""
    from autoconf.cost.calibration import fit_calibration

    ok = [r for r in rows if r["ok"] and "pred_profile" in r]
    top3 = sorted(ok, key=lambda r: r["pred_profile"]["step_time_s"])[:3]
    pairs = [(estimate(r["_config"], model, cluster, profile),
              {"ok": True, "step_time_s": r["step_time_s"], "peak_memory_bytes": r["peak_memory_bytes"]}) for r in top3]
    cal = fit_calibration(pairs)
    print("calibration factors from the top 3: " + ", ".join(f"{k} {v:.2f}" for k, v in cal.factors.items() if v != 1.0))
    for r in rows:
        if "pred_profile" in r:
            e = estimate(r["_config"], model, cluster, profile, cal)
            r["pred_calibrated"] = {"step_time_s": e.step_time_s, "peak_memory_bytes": e.peak_memory_bytes}


def _print_row(i: int, row: dict) -> None:
    meas = f"{row['step_time_s'] * 1e3:8.1f} ms" if row["ok"] else "  failed  "
    mem = f"{row['peak_memory_bytes'] / 2**20:7.1f} MiB" if row.get("peak_memory_bytes") else "      -    "
    pred = row.get("pred_profile") or row.get("pred")
    p = (f"{pred['step_time_s'] * 1e3:8.1f} ms {pred['peak_memory_bytes'] / 2**20:7.1f} MiB" if pred else "")
    p += " (profile)" if "pred_profile" in row else " (catalog)" if pred else ""
    extra = "" if row["ok"] else f"  ({row['reason'][:80]})"
    print(f"{i:3d} {row['config']:<52} measured {meas} {mem} | predicted {p}{extra}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
