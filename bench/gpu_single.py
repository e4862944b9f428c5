"""One GPU: the reference trainer with NCCL against the cost model, over micro-batch sizes and
recompute modes (issue: predictions that hold on real GPUs).

On a machine with one CUDA device it

1. profiles the model with ``autoconf profile`` (per-layer forward/backward times and activation
   memory for every micro-batch size and recompute mode, the GEMM table; one process, so no links),
2. runs the reference trainer (``autoconf trial``: torchrun, NCCL, dp = pp = tp = 1) for every
   (micro-batch size, recompute mode), measuring the median step time and
   ``torch.cuda.max_memory_allocated`` over a step,
3. predicts each with the cost model from the device catalog alone (datasheet mode) and with the
   profile, and prints measured against predicted. Memory is compared as the allocator sees it:
   the predicted peak less its runtime context (CUDA context, NCCL and cuBLAS workspaces, outside
   the caching allocator) against ``max_memory_allocated``.

    python bench/gpu_single.py --model gpt3-1.3b --out results/       # ~5 minutes on an H100
    python bench/gpu_single.py --model tiny --global-batch 4          # the same path on a CPU
    python bench/gpu_single.py --reprice bench/data/h100-2026-11-24/gpt3-1.3b.json \
        --profile examples/profiles/h100-sxm-gpt3-1.3b.json           # stored H100 rows, today's model

The cluster is one node with one device of the kind the profile (or ``--device``) names. The
rows are written to OUT/rows.json, the profile to OUT/profile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autoconf.cost.estimate import estimate  # noqa: E402
from autoconf.launch.plan import LaunchPlan  # noqa: E402
from autoconf.runs.trial import run_trial  # noqa: E402
from autoconf.space.config import ParallelConfig  # noqa: E402
from autoconf.specs.cluster import cluster_from_mapping  # noqa: E402
from autoconf.specs.hf import load_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def environment() -> dict:
    import torch

    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "python": platform.python_version(), "host": platform.node(), "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, sm_count=p.multi_processor_count, memory_bytes=p.total_memory,
                   cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())))
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    else:
        env["device"] = "cpu"
    return env


def profile_model(model_arg: str, seq: int | None, mbs: list[int], modes: list[str], out: str,
                  timeout_s: float) -> tuple[str | None, float]:
    cmd = [sys.executable, "-m", "autoconf", "profile", "--model", model_arg, "--nproc-per-node", "1",
           "--micro-batch-sizes", ",".join(map(str, mbs)), "--recompute", ",".join(modes), "--tp", "1",
           "--quiet", "--out", out]
    if seq:
        cmd += ["--seq-length", str(seq)]
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"profiling timed out after {timeout_s:.0f} s: {' '.join(cmd)}", flush=True)
        return None, time.perf_counter() - t0
    if res.returncode != 0:
        print(f"profiling failed ({' '.join(cmd)}):\n{res.stdout[-1500:]}\n{res.stderr[-3000:]}", flush=True)
        return None, time.perf_counter() - t0
    return out, time.perf_counter() - t0


def one_device_cluster(kind: str):
    return cluster_from_mapping({"name": f"{kind}-x1", "node_groups": [
        {"count": 1, "device": kind, "gpus_per_node": 1, "intra_node_bandwidth": "100 GB/s",
         "nics": {"count": 1, "bandwidth": "100 Gbit/s"}}]}, where="gpu_single")


def one_gpu_config(mbs: int, recompute: str, global_batch: int, precision: str = "bf16") -> ParallelConfig:
    """``precision``: bf16, or fp8-RECIPE (fp8-tensorwise, fp8-rowwise)."""
    fp8 = {"precision": "fp8", "fp8_recipe": precision.split("-", 1)[1]} if precision.startswith("fp8") else {}
    return ParallelConfig(dp=1, pp=1, tp=1, micro_batch_size=mbs, num_micro_batches=global_batch // mbs,
                          recompute=recompute, **fp8)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt3-1.3b", help="preset, model YAML or HF config.json")
    ap.add_argument("--seq-length", type=int, default=None)
    ap.add_argument("--micro-batch-sizes", default="1,2,4")
    ap.add_argument("--recompute", default="none,selective,full")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--precisions", default="bf16", help="comma list: bf16, fp8-tensorwise, fp8-rowwise")
    ap.add_argument("--steps", type=int, default=8, help="steps per trial, warm-up included")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default=None, help="catalog device kind (default: what the profile measured, "
                    "else h100-sxm)")
    ap.add_argument("--profile", default="fresh", help="'fresh' (profile now), 'none', or a profile JSON")
    ap.add_argument("--budget-s", type=float, default=480.0, help="start no trial after this many seconds")
    ap.add_argument("--out", default="gpu-single-out")
    ap.add_argument("--reprice", metavar="ROWS_JSON", default=None,
                    help="no GPU needed: predict the measured rows of an earlier run (its rows.json) with today's "
                    "cost model (with --profile FILE: also from that profile)")
    args = ap.parse_args(argv)
    bad = [p for p in args.precisions.split(",") if p not in ("bf16", "fp8-tensorwise", "fp8-rowwise")]
    if bad:
        print(f"error: --precisions {bad[0]!r} is not one of bf16, fp8-tensorwise, fp8-rowwise", file=sys.stderr)
        return 2
    if args.reprice:
        return reprice(args.reprice, None if args.profile in ("fresh", "none") else args.profile)

    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    model = load_model(args.model)
    if args.seq_length:
        import dataclasses
        model = dataclasses.replace(model, seq_length=args.seq_length)
    mbs_list = [int(x) for x in args.micro_batch_sizes.split(",")]
    modes = [m for m in args.recompute.split(",") if m]
    env = environment()
    print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)

    profile = None
    prof_path = args.profile
    if args.profile == "fresh":
        prof_path, took = profile_model(args.model, args.seq_length, mbs_list, modes,
                                        os.path.join(args.out, "profile.json"), timeout_s=args.budget_s / 2)
        print(f"profile: {prof_path or 'failed'} ({took:.0f} s)", flush=True)
    if prof_path and prof_path != "none":
        from autoconf.specs.profile import load_profile
        profile = load_profile(prof_path)
    kind = args.device or (profile.ranks[0].device_kind if profile else None) or "h100-sxm"
    cluster = one_device_cluster(kind)
    print(f"model {model.name}: {model.num_layers} layers, hidden {model.hidden_size}, seq {model.seq_length}, "
          f"{model.dtype}; cluster one {kind}", flush=True)

    rows = []
    runs = [(mbs, rc, p) for p in args.precisions.split(",") for mbs in mbs_list for rc in modes
            if args.global_batch % mbs == 0]
    for mbs, rc, prec in runs:
        c = one_gpu_config(mbs, rc, args.global_batch, prec)
        row = {"micro_batch_size": mbs, "recompute": rc, "global_batch": args.global_batch, "precision": prec}
        try:
            row["pred_catalog"] = predicted(estimate(c, model, cluster))
            if profile is not None:
                row["pred_profile"] = predicted(estimate(c, model, cluster, profile))
        except Exception as ex:  # a prediction the model refuses is a row, not the end of the run
            row["pred_error"] = f"{type(ex).__name__}: {ex}"
        if time.perf_counter() - t_start > args.budget_s:
            row.update(ok=False, reason="not run: --budget-s spent")
        else:
            res = run_trial(LaunchPlan(c, model), steps=args.steps, warmup=args.warmup, timeout_s=240)
            row.update(ok=res.ok, reason=res.reason, step_time_s=res.step_time_s,
                       peak_memory_bytes=res.peak_memory_bytes, memory_method=res.memory_method,
                       wall_s=res.wall_s, step_times_s=[r.get("step_times_s") for r in res.per_rank][:1])
        rows.append(row)
        print(line(row), flush=True)
        with open(os.path.join(args.out, "rows.json"), "w") as f:
            json.dump({"environment": env, "model": model.to_dict(), "device_kind": kind, "rows": rows}, f,
                      indent=1)
    print()
    summary(rows)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


def reprice(path: str, profile_path: str | None) -> int:
    """Today's predictions for the measured rows of an earlier run (its model, device, configurations)."""
    from autoconf.specs.model import ModelSpec

    with open(path) as f:
        doc = json.load(f)
    model = ModelSpec.from_dict(doc["model"])
    cluster = one_device_cluster(doc["device_kind"])
    profile = None
    if profile_path:
        from autoconf.specs.profile import load_profile
        profile = load_profile(profile_path)
    env = doc.get("environment", {})
    print(f"{path}: {model.name} on {env.get('device', doc['device_kind'])}, measured {env.get('date', '?')} "
          f"(torch {env.get('torch', '?')}); predicted now" + (f" (profile {profile_path})" if profile else ""))
    rows = []
    for r in doc["rows"]:
        c = one_gpu_config(r["micro_batch_size"], r["recompute"], r["global_batch"], r.get("precision", "bf16"))
        new = {k: v for k, v in r.items() if not k.startswith("pred")}
        new["pred_catalog"] = predicted(estimate(c, model, cluster))
        if profile is not None:
            new["pred_profile"] = predicted(estimate(c, model, cluster, profile))
        rows.append(new)
        print(line(new))
    print()
    summary(rows)
    return 0


def predicted(e) -> dict:
    """The prediction's step time and its allocator peak: the device peak less the runtime context
    (CUDA context, NCCL and cuBLAS workspaces), which ``torch.cuda.max_memory_allocated`` does not
    see. The device peak and every memory term are kept too."""
    st = e.memory_by_stage[0]
    context = dict(st.other_parts).get("runtime context", 0.0)
    return {"step_time_s": e.step_time_s, "peak_memory_bytes": e.peak_memory_bytes - context,
            "device_peak_bytes": e.peak_memory_bytes, "memory": st.to_dict(), "breakdown_s": e.breakdown_s}


def _ms(x):
    return f"{x * 1e3:8.1f}" if x else "       -"


def _gib(x):
    return f"{x / 2**30:6.2f}" if x else "     -"


def _err(p, m):
    return f"{(p - m) / m:+6.1%}" if p and m else "     -"


def line(r: dict) -> str:
    cat, pro = r.get("pred_catalog") or {}, r.get("pred_profile") or {}
    m, mem = r.get("step_time_s"), r.get("peak_memory_bytes")
    prec = r.get("precision", "bf16")
    s = (f"{'' if prec == 'bf16' else prec + ' '}mbs {r['micro_batch_size']:2d} {r['recompute']:<9} measured {_ms(m)} ms {_gib(mem)} GiB | "
         f"catalog {_ms(cat.get('step_time_s'))} ms {_err(cat.get('step_time_s'), m)} "
         f"{_gib(cat.get('peak_memory_bytes'))} GiB {_err(cat.get('peak_memory_bytes'), mem)} | "
         f"profile {_ms(pro.get('step_time_s'))} ms {_err(pro.get('step_time_s'), m)} "
         f"{_gib(pro.get('peak_memory_bytes'))} GiB {_err(pro.get('peak_memory_bytes'), mem)}")
    if not r.get("ok", True):
        s += f"  [{r.get('reason', '')[:120]}]"
    if r.get("pred_error"):
        s += f"  [prediction: {r['pred_error'][:120]}]"
    return s


def summary(rows: list[dict]) -> None:
    for key in ("pred_catalog", "pred_profile"):
        ok = [r for r in rows if r.get("ok") and r.get(key)]
        if not ok:
            continue
        t = [(r[key]["step_time_s"] - r["step_time_s"]) / r["step_time_s"] for r in ok]
        m = [(r[key]["peak_memory_bytes"] - r["peak_memory_bytes"]) / r["peak_memory_bytes"] for r in ok
             if r.get("peak_memory_bytes")]
        print(f"{key[5:]:<8} n={len(ok)}  step time error median |e| {statistics.median(map(abs, t)):.1%}, "
              f"signed median {statistics.median(t):+.1%}, max |e| {max(map(abs, t)):.1%}"
              + (f"  | peak memory error median |e| {statistics.median(map(abs, m)):.1%}, "
                 f"min {min(m):+.1%}, max {max(m):+.1%}" if m else ""))


if __name__ == "__main__":
    sys.exit(main())
