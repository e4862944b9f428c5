"""Big clusters: one estimate on a cluster of 65,536 devices, shape by shape.

    python bench/big_cluster.py [--shapes 64x1024,8192x8,...] [--timeout S] [--code DIR] [--no-cli]

Each row is a fresh subprocess (so that its memory is its own): it builds the ``ClusterSpec``
from a mapping, as a cluster file gives it, then calls the public ``autoconf.estimate`` (System,
Topology and the estimate) twice, each on a fresh spec: once timed (``wall s``: the first call,
so the cost model's imports are in it), once under ``tracemalloc`` (``traced peak``: the most
Python memory the estimate held). ``maxrss`` is the
subprocess's peak resident set (``ru_maxrss``: the interpreter and its imports included, about
40 MB of it). The ``cli`` rows run ``autoconf estimate --cluster FILE ... --json`` on the same
shape in a subprocess (start, reading the YAML file, the estimate, the JSON): its wall time and
its own ``ru_maxrss``, which it reports as it exits.

Targets (issue "Hardening, second round"): under 5 s and under 1 GB for one estimate, any shape.
Before that change a 64 x 1,024 cluster took 200 s and 8.8 GB (``ClusterSpec.graph()`` built a
device clique per host, 33.5 million edges, and the cost model read it). ``--code DIR`` runs the
rows against another checkout (e.g. the commit before, with ``--timeout`` to cap it).

Machine: the numbers in bench/RESULTS.md give the machine and its load; the development machine
is a 2-core VM (Intel Xeon, 24 GiB), shared with other jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.environ.get("BIG_CLUSTER_CODE", ROOT))  # a row's checkout (--code), else this one

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

H100 = {"device": "h100-sxm", "intra_node_bandwidth": "450 GB/s", "nics": {"count": 8, "bandwidth": "400 Gbit/s"}}
A100 = {"device": "a100-80gb", "intra_node_bandwidth": "300 GB/s", "nics": {"count": 8, "bandwidth": "200 Gbit/s"}}
GB200 = {"device": "gb200", "intra_node_bandwidth": "900 GB/s", "nics": {"count": 4, "bandwidth": "400 Gbit/s"}}

SHAPES = {  # name -> the cluster mapping: 65,536 devices each
    "64x1024": [{"count": 64, "gpus_per_node": 1024, **H100}],
    "8192x8": [{"count": 8192, "gpus_per_node": 8, **H100}],
    "512x128": [{"count": 512, "gpus_per_node": 128, **H100}],
    "65536x1": [{"count": 65536, "gpus_per_node": 1, **H100}],
    "16384x4-nvl64": [{"count": 16384, "gpus_per_node": 4, "nvlink_domain": 16, **GB200}],
    "64x1024-nvl": [{"count": 64, "gpus_per_node": 1024, "nvlink_domain": 64, **H100}],
    "2 kinds 4096x8": [{"count": 4096, "gpus_per_node": 8, **H100}, {"count": 4096, "gpus_per_node": 8, **A100}],
    "256 groups 32x8": [{"count": 32, "gpus_per_node": 8, **(H100 if g % 2 else A100)} for g in range(256)],
}

WORKLOADS = {  # name -> (model preset, estimate flags): every one uses all 65,536 devices
    "dense": ("llama-3-405b", {"tp": 8, "pp": 16, "dp": 512, "micro_batch_size": 1, "global_batch": 8192,
                               "zero": 1, "sequence_parallel": True, "recompute": "full"}),
    "moe cp": ("deepseek-v3", {"tp": 2, "pp": 16, "cp": 2, "dp": 1024, "ep": 64, "micro_batch_size": 1,
                               "global_batch": 16384, "zero": 1, "recompute": "full"}),
}


def cluster_mapping(shape: str) -> dict:
    return {"name": f"big-{shape}", "node_groups": SHAPES[shape],
            "inter_group_bandwidth": "100 GB/s" if len(SHAPES[shape]) > 1 else None}


def child(shape: str, workload: str) -> None:
    """One row: build the cluster, estimate twice (timed; traced), print the numbers as JSON."""
    import tracemalloc

    import autoconf
    from autoconf.space.config import ParallelConfig
    from autoconf.specs.cluster import cluster_from_mapping
    from autoconf.specs.model import preset

    t0 = time.perf_counter()
    cluster = cluster_from_mapping(cluster_mapping(shape))
    load_s = time.perf_counter() - t0
    name, flags = WORKLOADS[workload]
    model, f = preset(name), dict(flags)
    per_replica = f["dp"] * f["micro_batch_size"]
    config = ParallelConfig(dp=f["dp"], pp=f["pp"], tp=f["tp"], cp=f.get("cp", 1), ep=f.get("ep", 1),
                            micro_batch_size=f["micro_batch_size"], num_micro_batches=f["global_batch"] // per_replica,
                            zero_stage=f["zero"], recompute=f["recompute"],
                            sequence_parallel=f.get("sequence_parallel", False))
    t0 = time.perf_counter()
    e = autoconf.estimate(config, model, cluster)
    wall = time.perf_counter() - t0
    cluster = cluster_from_mapping(cluster_mapping(shape))  # a fresh spec: nothing it cached is reused
    tracemalloc.start()
    autoconf.estimate(config, model, cluster)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(json.dumps({"load_s": load_s, "wall_s": wall, "traced_peak": peak, "step_s": e.step_time_s,
                      "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def cli_args(workload: str, cluster_file: str) -> list[str]:
    name, f = WORKLOADS[workload]
    args = ["estimate", "--model", name, "--cluster", cluster_file]
    for k, v in f.items():
        if v is True:
            args.append("--" + k.replace("_", "-"))
        else:
            args += ["--" + k.replace("_", "-"), str(v)]
    return args


def cli_child(argv: list[str]) -> None:
    """``autoconf`` with ``argv``, then its peak RSS on stderr's last line."""
    from autoconf.cli import main as cli_main

    try:
        rc = cli_main(argv)
    finally:
        sys.stdout.flush()
        print(f"maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}", file=sys.stderr)
    sys.exit(rc)


def run(argv: list[str], env: dict, timeout: float):
    """(seconds, stdout, the child's peak RSS in bytes or None, error or None) of one subprocess."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - t0, "", None, f"killed after {timeout:g} s"
    wall = time.perf_counter() - t0
    lines = p.stderr.strip().splitlines()
    rss = int(lines.pop().split()[1]) if lines and lines[-1].startswith("maxrss ") else None
    err = None if p.returncode == 0 else (lines or [f"exit {p.returncode}"])[-1]
    return wall, p.stdout, rss, err


def mb(n) -> str:
    return "" if n is None else f"{n / 2**20:,.0f} MB"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of: " + ", ".join(WORKLOADS))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per row before it is killed")
    ap.add_argument("--code", default=ROOT, help="the checkout whose autoconf the rows import (default: this one)")
    ap.add_argument("--no-cli", action="store_true", help="skip the `autoconf estimate` rows")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--cli-child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.cli_child:
        cli_child(args.cli_child)
    import yaml

    env = {**os.environ, "BIG_CLUSTER_CODE": os.path.abspath(args.code)}
    t = Table(title=f"one estimate on 65,536 devices (autoconf from {os.path.abspath(args.code)}; "
                    f"load average {os.getloadavg()[0]:.1f})")
    for col in ("shape", "hosts", "workload", "how", "wall s", "traced peak", "maxrss", "step s", "note"):
        t.add_column(col, justify="right" if col in ("hosts", "wall s", "traced peak", "maxrss", "step s") else "left")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            hosts = sum(g["count"] for g in SHAPES[shape])
            path = os.path.join(tmp, "cluster.yaml")
            with open(path, "w") as fh:
                yaml.safe_dump({k: v for k, v in cluster_mapping(shape).items() if v is not None}, fh)
            for workload in args.workloads.split(","):
                wall, out, rss, err = run([sys.executable, __file__, "--child", shape, workload], env, args.timeout)
                if err is None:
                    r = json.loads(out.strip().splitlines()[-1])
                    t.add_row(shape, f"{hosts:,}", workload, "autoconf.estimate", f"{r['wall_s']:.2f}",
                              mb(r["traced_peak"]), mb(r["maxrss"]), f"{r['step_s']:.3f}",
                              f"cluster built in {r['load_s']:.2f} s")
                else:
                    t.add_row(shape, f"{hosts:,}", workload, "autoconf.estimate", f"> {wall:.0f}", "", mb(rss), "", err)
                if args.no_cli:
                    continue
                cmd = [sys.executable, __file__, "--cli-child", *cli_args(workload, path), "--json"]
                wall, out, rss, err = run(cmd, env, args.timeout)
                step = f"{json.loads(out)['step_time_s']:.3f}" if err is None else ""
                t.add_row(shape, f"{hosts:,}", workload, "cli", f"{wall:.2f}" if err is None else f"> {wall:.0f}",
                          "", mb(rss), step, err or "whole process: start, YAML, estimate, JSON")
    Console(width=200).print(t)


if __name__ == "__main__":
    main()
