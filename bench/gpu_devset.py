"""Datasheet-mode accuracy on real GPUs: measured Megatron step times and NCCL all-reduce curves.

Data (``bench/data/vtrain-a100/``, public, MIT licence beside it): 1,260 measured training
iterations of GPT models (hidden 1024 / 2048, 12-24 layers, 16 heads, sequence 1024) on one
8 x A100-SXM4 node with NVSwitch, every (tp, pp, dp) layout on 2, 4 and 8 GPUs, run with
Megatron-DeepSpeed (1F1B, fp16, vocabulary 50,257 padded by Megatron, learned positions, GeLU,
tied embeddings); and nccl-tests all-reduce times on the same node, 2-8 GPUs, 1 MiB - 1 GiB.

The model is judged as a user would run it: ``estimate`` with ``--framework megatron`` on the
catalog's ``a100-80gb`` with nothing fitted to these rows. Printed:

- per (shape, GPUs, global batch) group: rows, median / max |error|, median signed error,
  Spearman rank correlation, regret (measured time of the predicted best over the measured best);
  overall, also the groups whose regret is within 1.03 once the model's top K are measured and
  the fastest kept, as ``search --verify K`` does (K = 2, 3, 4);
- the 10 worst rows with their breakdown;
- how the measured rows are built (each layout's time is exactly fixed + m x one per-micro-batch
  figure, the same at every dp), the model's error on the per-micro-batch and the fixed part per
  (tp, pp), the measured time per layer at micro-batch 1 per hidden size and tp, the layouts whose
  per-micro-batch time falls as the micro-batch grows, and in how many of the groups that miss the
  regret target the model holds both configurations more than 5% host-bound;
- predicted against measured all-reduce times per message size and group size.

    python bench/gpu_devset.py [--recompute none|full] [--json out.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from stats import spearman  # noqa: E402

from autoconf.cost.estimate import estimate  # noqa: E402
from autoconf.space.config import ParallelConfig  # noqa: E402
from autoconf.specs.cluster import cluster_from_mapping  # noqa: E402
from autoconf.specs.model import ModelSpec  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data", "vtrain-a100")

NODE = {"name": "dgx-a100", "node_groups": [{
    "count": 1, "device": "a100-80gb", "gpus_per_node": 8,
    "intra_node_bandwidth": "300 GB/s",  # NVLink 3 through NVSwitch, per GPU per direction
    "nics": {"count": 8, "bandwidth": "200 Gbit/s", "kind": "infiniband"}}],
    "latency": {"intra_node": "2 us", "inter_node": "10 us"}}


def gpt(hidden: int, heads: int, layers: int, seq: int) -> ModelSpec:
    """The GPT of Megatron-DeepSpeed's examples: GPT-2 BPE vocabulary, learned positions, GeLU
    MLP of 4h, biases, tied embeddings, dropout 0.1, fp16 mixed precision, fused (unflashed)
    softmax attention."""
    return ModelSpec(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_kv_heads=heads,
                     ffn_hidden_size=4 * hidden, vocab_size=50257, seq_length=seq, activation="gelu",
                     tied_embeddings=True, dtype="fp16", norm="layernorm", position_embedding="learned",
                     bias=True, dropout=0.1, attention="eager", name=f"gpt-h{hidden}-l{layers}")


def load_rows() -> list[dict]:
    with open(os.path.join(DATA, "single_node.csv")) as f:
        rows = list(csv.DictReader(f))
    out = []
    for r in rows:
        d = {k: int(v) for k, v in r.items() if k != "iteration_time_ms"}
        d["measured_s"] = float(r["iteration_time_ms"]) / 1e3
        out.append(d)
    return out


def predict(rows: list[dict], recompute: str, framework: str) -> None:
    cluster = cluster_from_mapping(NODE)
    for r in rows:
        model = gpt(r["hidden_size"], r["attention_heads"], r["num_layers"], r["seq_length"])
        m = r["global_batch"] // (r["dp"] * r["micro_batch"])
        c = ParallelConfig(dp=r["dp"], pp=r["pp"], tp=r["tp"], micro_batch_size=r["micro_batch"],
                           num_micro_batches=m, schedule="1f1b", recompute=recompute)
        kw = {"framework": framework} if framework else {}
        e = estimate(c, model, cluster, **kw)
        r["predicted_s"] = e.step_time_s
        r["fits"] = e.fits
        r["breakdown"] = e.breakdown_s
        r["error"] = e.step_time_s / r["measured_s"] - 1


def report(rows: list[dict]) -> dict:
    groups = defaultdict(list)
    for r in rows:
        groups[(r["hidden_size"], r["num_layers"], r["gpus"], r["global_batch"])].append(r)
    print(f"{'h':>5} {'L':>3} {'gpus':>4} {'gbs':>4} {'rows':>4} {'med|e|':>7} {'max|e|':>7} {'med e':>7} "
          f"{'spear':>6} {'regret':>6}")
    spears, regrets, spears5 = [], [], []
    for key in sorted(groups):
        g = groups[key]
        errs = [r["error"] for r in g]
        sp = spearman([r["predicted_s"] for r in g], [r["measured_s"] for r in g]) if len(g) > 2 else float("nan")
        best_pred = min(g, key=lambda r: r["predicted_s"])
        regret = best_pred["measured_s"] / min(r["measured_s"] for r in g)
        if not math.isnan(sp):
            spears.append(sp)
            if len(g) >= 5:
                spears5.append(sp)
        regrets.append(regret)
        print(f"{key[0]:>5} {key[1]:>3} {key[2]:>4} {key[3]:>4} {len(g):>4} "
              f"{statistics.median(abs(e) for e in errs):>7.1%} {max(abs(e) for e in errs):>7.1%} "
              f"{statistics.median(errs):>+7.1%} {sp:>6.3f} {regret:>6.3f}")
    errs = [r["error"] for r in rows]
    summary = {"rows": len(rows), "median_abs_error": statistics.median(abs(e) for e in errs),
               "max_abs_error": max(abs(e) for e in errs), "median_signed_error": statistics.median(errs),
               "groups": len(groups), "min_spearman": min(spears), "median_spearman": statistics.median(spears),
               "groups_spearman_ge_0.9": sum(s >= 0.9 for s in spears),
               "groups_of_5_or_more": len(spears5), "of_them_spearman_ge_0.9": sum(s >= 0.9 for s in spears5),
               "max_regret": max(regrets), "median_regret": statistics.median(regrets),
               "groups_regret_le_1.03": sum(r <= 1.03 for r in regrets),
               "false_oom": sum(not r["fits"] for r in rows)}
    for k in (2, 3, 4):  # what `search --verify K` returns: the measured best of the model's top K
        summary[f"groups_regret_le_1.03_verify_{k}"] = sum(
            min(r["measured_s"] for r in sorted(g, key=lambda r: r["predicted_s"])[:k])
            <= 1.03 * min(r["measured_s"] for r in g) for g in groups.values())
    print()
    print("overall: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    print("\n10 worst rows:")
    for r in sorted(rows, key=lambda r: -abs(r["error"]))[:10]:
        parts = " ".join(f"{k}={v * 1e3:.1f}" for k, v in r["breakdown"].items() if v > 0)
        print(f"  h{r['hidden_size']} L{r['num_layers']} gbs{r['global_batch']} mbs{r['micro_batch']} "
              f"dp{r['dp']} tp{r['tp']} pp{r['pp']}: measured {r['measured_s'] * 1e3:.1f} ms, "
              f"predicted {r['predicted_s'] * 1e3:.1f} ms ({r['error']:+.1%}) [{parts} ms]")
    return summary


def _line(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """Least-squares (intercept, slope) of time against m, and the largest relative residual."""
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    icpt = my - slope * mx
    return icpt, slope, max(abs(p[1] - icpt - slope * p[0]) / p[1] for p in points)


def structure(rows: list[dict], host_free: dict) -> dict:
    """How the measured rows are built, and where the model's error sits.

    Every row's time is fitted as ``fixed + m x per_micro_batch`` over the rows of one
    (hidden, layers, tp, pp, micro-batch) layout that differ in global batch and dp (m micro-batches
    per step). Printed: how exactly the measured rows follow that line and whether the slope depends
    on dp; per (tp, pp), the model's error on the per-micro-batch slope and on the fixed part (one
    fit per layout and dp); the measured time per layer and micro-batch at micro-batch 1, pp 1 (the
    embedding and head included) by hidden size and tp; the layouts whose per-micro-batch time
    falls as the micro-batch grows; and, for the groups whose regret exceeds 1.03, in how many the
    model has both the measured best and its own pick more than 5% host-bound, i.e. predicted more
    than 5% faster with no host cost (``host_free``: the same rows predicted so)."""
    series = defaultdict(list)
    for r in rows:
        m = r["global_batch"] // (r["dp"] * r["micro_batch"])
        series[(r["hidden_size"], r["num_layers"], r["tp"], r["pp"], r["micro_batch"])].append((r["dp"], m, r))
    resid, slope_spread, slope_err, icpt_err = 0.0, 0.0, defaultdict(list), defaultdict(list)
    fitted = {}
    for key, pts in series.items():
        by_dp = defaultdict(list)
        for dp, m, r in pts:
            by_dp[dp].append((m, r))
        slopes = []
        for dp, ms in by_dp.items():
            if len({m for m, _ in ms}) < 2:
                continue
            a, b, res = _line([(m, r["measured_s"]) for m, r in ms])
            pa, pb, _ = _line([(m, r["predicted_s"]) for m, r in ms])
            resid = max(resid, res)
            slopes.append(b)
            fitted[key] = b
            slope_err[(key[2], key[3])].append(pb / b - 1)
            icpt_err[(key[2], key[3])].append(pa - a)
        if len(slopes) > 1:
            slope_spread = max(slope_spread, (max(slopes) - min(slopes)) / min(slopes))
    print("\nstructure of the measured rows: time = fixed + m x per-micro-batch, fitted per layout over its "
          "global batches")
    print(f"  largest residual of that line: {resid:.1e} of the row's time; largest difference of the "
          f"per-micro-batch time between dp degrees: {slope_spread:.1e}")
    print("  (the per-micro-batch time of a layout is one figure shared by every group that layout is in)")
    print(f"\n{'tp':>3} {'pp':>3} {'fits':>7} {'per-mb error: median':>21} {'range':>13} "
          f"{'fixed part error (ms): median':>30}")
    out = {"line_residual": resid, "slope_spread_over_dp": slope_spread, "per_tp_pp": {}}
    for k in sorted(slope_err):
        e, f = slope_err[k], icpt_err[k]
        print(f"{k[0]:>3} {k[1]:>3} {len(e):>7} {statistics.median(e):>+21.1%} "
              f"{min(e):>+6.0%}..{max(e):>+5.0%} {statistics.median(f) * 1e3:>+30.1f}")
        out["per_tp_pp"][f"tp{k[0]}_pp{k[1]}"] = {"fits": len(e), "median_slope_error": statistics.median(e),
                                                   "median_fixed_error_s": statistics.median(f)}
    # host floor: per layer per micro-batch at micro-batch 1 without pipelining
    floor = defaultdict(list)
    for (h, L, tp, pp, mb), b in fitted.items():
        if pp == 1 and mb == 1:
            floor[(h, tp)].append(b / L)
    print("\nmeasured time per layer and micro-batch at micro-batch 1, pp 1 (ms; embedding and head included):")
    print("  " + "  ".join(f"h{h} tp{tp}: {statistics.median(v) * 1e3:.2f}" for (h, tp), v in sorted(floor.items())))
    # non-monotonic series: more tokens per micro-batch, less time per micro-batch
    drops = []
    for (h, L, tp, pp, mb), b in fitted.items():
        for bigger in (2 * mb, 4 * mb):
            nb = fitted.get((h, L, tp, pp, bigger))
            if nb is not None and nb < b:
                drops.append((b / nb - 1, (h, L, tp, pp, mb, bigger)))
    drops.sort(reverse=True)
    falling = len({d[1][:5] for d in drops})
    print(f"\nlayouts whose per-micro-batch time falls as the micro-batch grows: {falling} of {len(fitted)} "
          f"({len(drops)} pairs of micro-batch sizes)"
          + (f"; largest {drops[0][0]:.0%} (h{drops[0][1][0]} L{drops[0][1][1]} tp{drops[0][1][2]} "
             f"pp{drops[0][1][3]}, micro-batch {drops[0][1][4]} -> {drops[0][1][5]})" if drops else ""))
    out["falls_with_micro_batch"] = falling
    # regret failures decided at the host floor
    groups = defaultdict(list)
    for r in rows:
        groups[(r["hidden_size"], r["num_layers"], r["gpus"], r["global_batch"])].append(r)
    failing, at_floor = 0, 0
    for g in groups.values():
        best, pick = min(g, key=lambda r: r["measured_s"]), min(g, key=lambda r: r["predicted_s"])
        if pick["measured_s"] / best["measured_s"] <= 1.03:
            continue
        failing += 1
        share = [1 - host_free[_row_key(r)] / r["predicted_s"] for r in (best, pick)]
        at_floor += min(share) > 0.05
    print(f"groups with regret > 1.03: {failing}; in {at_floor} of them the model has both the measured best and "
          f"its pick more than 5% host-bound (predicted more than 5% faster with no host cost)")
    out["regret_failures"], out["regret_failures_host_bound"] = failing, at_floor
    return out


def _row_key(r: dict) -> tuple:
    return tuple(r[k] for k in ("hidden_size", "num_layers", "gpus", "global_batch", "micro_batch", "tp", "dp", "pp"))


def host_free_times(rows: list[dict], recompute: str, framework: str) -> dict:
    """Each row predicted as if the host issued every operation in no time."""
    import dataclasses

    from autoconf.specs.frameworks import HostCost
    from autoconf.specs.frameworks import framework as framework_model
    fw = dataclasses.replace(framework_model(framework), host=HostCost(0.0, 0.0))
    saved = [(r["predicted_s"], r["fits"], r["breakdown"], r["error"]) for r in rows]
    predict(rows, recompute, fw)
    out = {_row_key(r): r["predicted_s"] for r in rows}
    for r, (p, f, b, e) in zip(rows, saved):
        r["predicted_s"], r["fits"], r["breakdown"], r["error"] = p, f, b, e
    return out


def all_reduce_check() -> dict:
    """Predicted against measured nccl-tests all-reduce (out-of-place) on n GPUs of the node."""
    from autoconf.cost import comm
    from autoconf.specs.topology import Topology
    cluster = cluster_from_mapping(NODE)
    topo = Topology(cluster.graph())
    print("\nall-reduce (fp32, nccl-tests, out-of-place): predicted / measured time")
    sizes_shown = [2**20, 2**22, 2**24, 2**26, 2**28, 2**30]
    print(f"{'n':>2} " + " ".join(f"{_mib(s):>12}" for s in sizes_shown) + f" {'med|e|':>7} {'max|e|':>7}")
    worst, all_errs = 0.0, []
    for n in range(2, 9):
        with open(os.path.join(DATA, f"allreduce_{n}gpu.csv")) as f:
            meas = {int(r["size(B)"]): float(r["time(ns)"]) * 1e-9 for r in csv.DictReader(f)}
        g = topo.group_links(tuple(range(n)))
        errs, cells = [], []
        for size, t in sorted(meas.items()):
            p = comm.all_reduce_s(size, g, **_ar_kwargs())
            errs.append(p / t - 1)
            if size in sizes_shown:
                cells.append(f"{p * 1e6:5.0f}/{t * 1e6:5.0f}us")
        all_errs += errs
        worst = max(worst, max(abs(e) for e in errs))
        print(f"{n:>2} " + " ".join(f"{c:>12}" for c in cells)
              + f" {statistics.median(abs(e) for e in errs):>7.1%} {max(abs(e) for e in errs):>7.1%}")
    out = {"median_abs_error": statistics.median(abs(e) for e in all_errs), "max_abs_error": worst,
           "within_10pct": sum(abs(e) <= 0.10 for e in all_errs) / len(all_errs)}
    print("all-reduce overall: " + ", ".join(f"{k} {v:.3f}" for k, v in out.items()))
    return out


def _ar_kwargs() -> dict:
    from autoconf.specs.devices import device_type
    return {"tune": device_type("a100-80gb").collective_tuning()}


def _mib(s: int) -> str:
    return f"{s // 2**20} MiB" if s < 2**30 else f"{s // 2**30} GiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recompute", default="full", choices=("none", "selective", "full"))
    ap.add_argument("--framework", default="megatron")
    ap.add_argument("--json", help="write the summary and every row here")
    ap.add_argument("--write-accuracy", action="store_true",
                    help="record the step-time accuracy in autoconf/data/accuracy.json, which autoconf plan "
                         "states beside its days (only with --framework megatron --recompute full)")
    args = ap.parse_args()
    rows = load_rows()
    predict(rows, args.recompute, args.framework if args.framework != "none" else None)
    summary = report(rows)
    fw = args.framework if args.framework != "none" else None
    summary["structure"] = structure(rows, host_free_times(rows, args.recompute, fw))
    summary["all_reduce"] = all_reduce_check()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)
    if args.write_accuracy:
        if (args.framework, args.recompute) != ("megatron", "full"):
            print("--write-accuracy records the bench as stated: --framework megatron --recompute full", file=sys.stderr)
            return 2
        write_accuracy(summary)
    return 0


ACCURACY = os.path.join(os.path.dirname(__file__), "..", "autoconf", "data", "accuracy.json")


def write_accuracy(summary: dict) -> None:
    """The step-time accuracy autoconf states (``autoconf.specs.devices.stated_accuracy``): this bench's
    summary, with what it was measured on."""
    import datetime
    doc = {"step_time": {
        "what": "datasheet-mode step time (catalog device, no profile) against measured training iterations",
        "measured_on": f"{summary['rows']:,} Megatron-DeepSpeed iterations of GPT models (hidden 1024-2048, "
                       "12-24 layers) on one node of 8 x A100-SXM4, every tp x pp x dp layout (vTrain repository)",
        "framework": "megatron", "bench": "python bench/gpu_devset.py --write-accuracy",
        "date": datetime.date.today().isoformat(), "rows": summary["rows"],
        "median_abs_error": round(summary["median_abs_error"], 4),
        "max_abs_error": round(summary["max_abs_error"], 4),
        "median_signed_error": round(summary["median_signed_error"], 4)}}
    tmp = ACCURACY + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, ACCURACY)
    print(f"\nwrote {os.path.normpath(ACCURACY)}")


if __name__ == "__main__":
    sys.exit(main())
