"""Compressed 3D-parallel traffic (Optimus-CC): what it costs in loss, what it gains on slow links.

    python bench/compression.py quality [--steps 300 --seeds 3]   # CPU processes, ~20 min on 2 cores
    python bench/compression.py speed [--rates 100mbit,100mbit]     # the shaped-link testbed (root)

**quality**: a small GPT trained with the reference trainer (torchrun, gloo, one thread per process)
on real text already on this machine, the Python standard library's own sources read as bytes
(tokens 0..255; a few MB, no download). For pp 2 and pp 4 (dp 2, 1F1B, 8 micro-batches) and each
seed, the same run without compression, with epilogue-only compression and with every backward send
compressed (rank --rank), and, at pp 2, with PowerSGD on the data-parallel gradients of every stage
too. Printed per mode: the final loss (mean of the last 10% of steps, each step a fresh batch of
windows, so a held-out estimate), its difference from the uncompressed run of the same seed (mean
over seeds, and the largest), next to the seed-to-seed spread of the uncompressed runs (their
standard deviation).

**speed**: two emulated nodes (``autoconf.runs.testbed``) of two processes each, NICs shaped to
--rates. The testbed is profiled (``autoconf profile`` across the nodes), then for pp 2 across the
nodes (dp 2 inside each; 1F1B and GPipe) and dp 2 across the nodes (pp 2 inside each) every compression mode is run
with the reference trainer and estimated with the profile: measured and predicted step time, the
gain over the uncompressed run of each, and the bytes each rank counted against the model's
(``cost.compression.step_bytes``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autoconf.launch.plan import LaunchPlan  # noqa: E402
from autoconf.runs.trial import run_trial  # noqa: E402
from autoconf.space.config import ParallelConfig, check  # noqa: E402
from autoconf.specs.model import ModelSpec  # noqa: E402

QUALITY_MODEL = ModelSpec(num_layers=8, hidden_size=128, num_attention_heads=4, num_kv_heads=4, ffn_hidden_size=512,
                          vocab_size=256, seq_length=128, activation="gelu", tied_embeddings=False, dtype="fp32",
                          name="bytes-gpt-h128")
"""A byte-level GPT (0.8 M parameters in its blocks) small enough for hundreds of CPU steps."""

SPEED_MODEL = ModelSpec(num_layers=2, hidden_size=256, num_attention_heads=4, num_kv_heads=4, ffn_hidden_size=1024,
                        vocab_size=256, seq_length=256, activation="gelu", tied_embeddings=False, dtype="fp32",
                        name="bytes-gpt-h256-l2")
"""Shallow: one layer per stage, so a stage's compute per token (72 h^2 flops) is small against
what it sends (h values). A CPU core computes ~100x slower than a GPU, so a CPU testbed link
weighs against compute like a ~100x faster link on GPUs: the transfers matter here at 100 Mbit/s
as they do on GPU clusters at 10 Gbit/s (the regime Optimus-CC is for)."""


def corpus(path: str, limit_bytes: int) -> int:
    """Concatenate the standard library's .py sources (sorted, deterministic) up to ``limit_bytes``."""
    lib = sysconfig.get_paths()["stdlib"]
    n = 0
    with open(path, "wb") as out:
        for dirpath, dirnames, files in os.walk(lib):
            dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib"))
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                try:
                    with open(os.path.join(dirpath, f), "rb") as src:
                        data = src.read()
                except OSError:
                    continue
                out.write(data)
                n += len(data)
                if n >= limit_bytes:
                    return n
    return n


def quality_modes(pp: int, rank: int, dp_rank: int) -> dict:
    modes = {"none": {}, "epilogue": {"pp_compression": "epilogue", "pp_compression_rank": rank},
             "all": {"pp_compression": "all", "pp_compression_rank": rank}}
    if pp == 2:
        modes["all + dp"] = {"pp_compression": "all", "pp_compression_rank": rank, "dp_compression_stages": pp,
                             "dp_compression_rank": dp_rank}
    return modes


def run_quality(args) -> dict:
    work = tempfile.mkdtemp(prefix="autoconf-compression-")
    data = os.path.join(work, "stdlib.txt")
    size = corpus(data, args.corpus_mb << 20)
    model = QUALITY_MODEL
    print(f"corpus: {size / 2**20:.1f} MB of the standard library's sources ({sysconfig.get_paths()['stdlib']}); "
          f"model {model.name}: {model.num_layers} layers, hidden {model.hidden_size}, seq {model.seq_length}, "
          f"byte tokens; {args.steps} steps, seeds {args.seeds}")
    rows = {}
    t0 = time.time()
    for pp in args.pp:
        base = ParallelConfig(dp=2, pp=pp, tp=1, micro_batch_size=args.micro_batch_size, num_micro_batches=8,
                              schedule="1f1b")
        for mode, kw in quality_modes(pp, args.rank, args.dp_rank).items():
            c = ParallelConfig(**{**base.to_dict(), **kw})
            why = check(c, model)
            if why:
                raise SystemExit(f"{c.short()}: {why}")
            for seed in range(args.seeds):
                r = run_trial(LaunchPlan(c, model, seed=seed), steps=args.steps, warmup=1, timeout_s=3600,
                              data_file=data)
                if not r.ok:
                    raise SystemExit(f"{c.short()} seed {seed} failed: {r.reason}")
                tail = max(1, args.steps // 10)
                rows.setdefault((pp, mode), []).append(statistics.fmean(r.losses[-tail:]))
                print(f"  pp{pp} {mode:<9} seed {seed}: final loss {rows[(pp, mode)][-1]:.4f} "
                      f"({r.step_time_s * 1e3:.0f} ms/step; {time.time() - t0:.0f} s so far)", flush=True)
    print(f"\n{'pp':>3} {'mode':<10} {'final loss (per seed)':<28} {'diff vs none: mean':>19} {'max':>8} "
          f"{'seed spread (sd, none)':>23}")
    out = []
    for pp in args.pp:
        ref = rows[(pp, "none")]
        spread = statistics.stdev(ref) if len(ref) > 1 else float("nan")
        for mode in quality_modes(pp, args.rank, args.dp_rank):
            vals = rows[(pp, mode)]
            diffs = [a - b for a, b in zip(vals, ref)]
            print(f"{pp:>3} {mode:<10} {' '.join(f'{v:.4f}' for v in vals):<28} {statistics.fmean(diffs):>+19.4f} "
                  f"{max(diffs, key=abs):>+8.4f} {spread:>23.4f}")
            out.append({"pp": pp, "mode": mode, "final_losses": vals, "diff_mean": statistics.fmean(diffs),
                        "diff_max": max(diffs, key=abs), "seed_sd_none": spread})
    print(f"\n{time.time() - t0:.0f} s in all; final loss = mean training loss of the last {max(1, args.steps // 10)} "
          "steps (fresh windows every step)")
    return {"corpus_bytes": size, "steps": args.steps, "seeds": args.seeds, "rank": args.rank,
            "dp_rank": args.dp_rank, "rows": out}


def speed_cases(rank: int, dp_rank: int, nproc: int = 2) -> list:
    """(name, base config, modes): pp across the nodes (1F1B: a gradient goes back while the next
    activation comes forward, so only the cool-down's sends are alone on the link; GPipe: all
    backward sends follow the forwards), then dp across them. ``nproc`` processes per node: with
    2, dp 2 inside each node for the pipeline cases and pp 2 for the data-parallel one; with 1,
    dp 1 pp 2 and dp 2 pp 1."""
    inner = 2 if nproc == 2 else 1
    pp_x = ParallelConfig(dp=inner, pp=2, tp=1, micro_batch_size=2, num_micro_batches=8, rank_order="tp-dp-pp")
    dp_x = ParallelConfig(dp=2, pp=inner, tp=1, micro_batch_size=2, num_micro_batches=8, rank_order="tp-pp-dp")
    pp_modes = {"none": {}, "epilogue": {"pp_compression": "epilogue", "pp_compression_rank": rank},
                "all": {"pp_compression": "all", "pp_compression_rank": rank}}
    dp_modes = {"none": {}, "dp stage 0": {"dp_compression_stages": 1, "dp_compression_rank": dp_rank},
                "dp all stages": {"dp_compression_stages": 2, "dp_compression_rank": dp_rank}}
    if inner == 1:
        dp_modes = {"none": {}, "dp all stages": {"dp_compression_stages": 1, "dp_compression_rank": dp_rank}}
    gpipe = ParallelConfig(**{**pp_x.to_dict(), "schedule": "gpipe"})
    gpipe_modes = {k: v for k, v in pp_modes.items() if k != "epilogue"}  # every send follows the last forward
    return [("pp x nodes, 1F1B", pp_x, pp_modes), ("pp x nodes, GPipe", gpipe, gpipe_modes),
            ("dp x nodes", dp_x, dp_modes)]


def run_speed(args) -> dict:
    from hetero import profile_testbed  # the testbed's cluster file and profile, as bench/hetero.py makes them

    from autoconf.cost.compression import step_bytes
    from autoconf.cost.estimate import estimate
    from autoconf.cost.layout import layout
    from autoconf.cost.system import System
    from autoconf.runs import testbed as tbm

    reason = tbm.unavailable_reason()
    if reason:
        print(f"bench/compression.py speed: no testbed here: {reason}", file=sys.stderr)
        raise SystemExit(2)
    rates = [r.strip() for r in args.rates.split(",")]
    model = SPEED_MODEL
    work = tempfile.mkdtemp(prefix="autoconf-compression-speed-")
    model_path = os.path.join(work, "model.json")
    with open(model_path, "w") as f:
        json.dump(model.to_dict(), f)
    t0 = time.time()
    out = []
    nproc = args.nproc_per_node
    with tbm.Testbed(rates, nproc_per_node=nproc) as tb:
        _, cluster, _, profile = profile_testbed(tb, model_path, work, nproc)
        print(f"profiled the testbed ({args.rates}, {nproc} per node) in {time.time() - t0:.0f} s")
        os.environ[tbm.ATTACH_ENV] = tbm.describe(tb.nodes, tb.master_port, nproc)  # trials run across the nodes
        ctx = System(model, cluster, profile)
        for name, base, modes in speed_cases(args.rank, args.dp_rank, nproc):
            configs = {mode: ParallelConfig(**{**base.to_dict(), **kw}) for mode, kw in modes.items()}
            measured = {mode: [] for mode in configs}
            counted = {}
            for p in range(args.passes):
                order = list(configs) if p % 2 == 0 else list(reversed(configs))
                for mode in order:
                    r = run_trial(LaunchPlan(configs[mode], model, cluster), steps=args.steps, warmup=2,
                                  timeout_s=1200)
                    if not r.ok:
                        raise SystemExit(f"{name} {mode} ({configs[mode].short()}) failed: {r.reason}")
                    measured[mode].append(r.step_time_s)
                    counted[mode] = r.per_rank
            plain_meas = statistics.fmean(measured["none"])
            plain_pred = estimate(configs["none"], model, cluster, profile).step_time_s
            for mode, c in configs.items():
                meas = statistics.fmean(measured[mode])
                pred = estimate(c, model, cluster, profile).step_time_s
                want = step_bytes(ctx, c, layout(ctx, c))
                worst = 0.0
                for rr in counted[mode]:
                    got, exp = rr["comm_bytes"], want[rr["coords"]["pp"]]
                    tot = sum(v["forward"] + v["backward"] for v in got["pp_send"].values()) + got["dp_payload"]
                    tot_exp = exp["forward"] + exp["backward"] + exp["dp_payload"]
                    worst = max(worst, abs(tot / tot_exp - 1) if tot_exp else float(tot != 0))
                gain_m, gain_p = plain_meas / meas - 1, plain_pred / pred - 1
                out.append({"case": name, "mode": mode, "config": c.to_dict(), "measured_s": meas,
                            "passes_s": measured[mode], "predicted_s": pred, "measured_gain": gain_m,
                            "predicted_gain": gain_p, "bytes_error": worst})
                print(f"  {name:<16} {mode:<14} measured {meas * 1e3:8.1f} ms  predicted {pred * 1e3:8.1f} ms "
                      f"({pred / meas - 1:+.1%})  gain measured {gain_m:+.1%} predicted {gain_p:+.1%}  "
                      f"bytes model vs counted {worst:.1%}", flush=True)
    print(f"\n{'case':<16} {'mode':<14} {'measured':>10} {'predicted':>10} {'error':>7} {'gain meas.':>10} "
          f"{'gain pred.':>10} {'gain diff':>9} {'bytes':>6}")
    for o in out:
        print(f"{o['case']:<16} {o['mode']:<14} {o['measured_s'] * 1e3:>8.1f}ms {o['predicted_s'] * 1e3:>8.1f}ms "
              f"{o['predicted_s'] / o['measured_s'] - 1:>+7.1%} {o['measured_gain']:>+10.1%} {o['predicted_gain']:>+10.1%} "
              f"{o['predicted_gain'] - o['measured_gain']:>+9.1%} {o['bytes_error']:>6.1%}")
    print(f"\nrates {args.rates}, {nproc} processes per node, model {model.name}, {args.passes} passes x "
          f"{args.steps} steps (mean); "
          f"{time.time() - t0:.0f} s in all. gain = uncompressed step / compressed step - 1")
    return {"rates": rates, "rows": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("quality", "speed"))
    ap.add_argument("--steps", type=int, default=None, help="quality: 300; speed: 8")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--pp", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16, help="pipeline-gradient rank (default 16)")
    ap.add_argument("--dp-rank", type=int, default=8, help="PowerSGD rank (default 8: the blocks are 128 or 512 wide)")
    ap.add_argument("--corpus-mb", type=int, default=4)
    ap.add_argument("--rates", default="100mbit,100mbit")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--nproc-per-node", type=int, choices=(1, 2), default=2,
                    help="speed: processes per emulated node (1: no two ranks share a core on 2 cores)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.what == "quality":
        args.steps = args.steps or 300
        doc = run_quality(args)
    else:
        args.steps = args.steps or 8
        doc = run_speed(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
