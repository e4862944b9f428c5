"""Wall time of `autoconf profile` on 2 CPU processes (gloo), for the tiny model and a ~100M one.

    python bench/profile_cost.py            # tiny --quick, tiny, gpt2 (seq 256) --quick
    python bench/profile_cost.py --full     # also gpt2 (seq 256) with the default settings

Prints one row per run: end-to-end wall time (torchrun start included), the profiler's own time
(from the profile's notes), and what was measured. Target: tiny under 60 s. Two processes share
this machine's cores, so the compute phase runs on rank 0 alone (see profiler/run.py). Wall time
depends on what else runs on the machine: the CPU column (user + system seconds of every process
of the run, torchrun included) does not, and the load average is printed with the table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RUNS = [
    ("tiny", None, ["--quick"]),
    ("tiny", None, []),
    ("gpt2", 256, ["--quick"]),
]
FULL = [("gpt2", 256, [])]


def _child_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def profile_once(model: str, seq: int | None, extra: list[str], nproc: int) -> dict:
    from autoconf.specs.profile import load_profile

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "p.json")
        cmd = [sys.executable, "-m", "autoconf", "profile", "--model", model, "--nproc-per-node", str(nproc),
               "--out", out] + (["--seq-length", str(seq)] if seq else []) + extra
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        t0, c0 = time.perf_counter(), _child_cpu_s()
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall, cpu = time.perf_counter() - t0, _child_cpu_s() - c0
        if res.returncode:
            return {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit {res.returncode}"}
        p = load_profile(out)
    inner = next((n.split()[2].rstrip(";") for n in p.provenance.notes if n.startswith("profiling took")), "?")
    return {"wall_s": wall, "cpu_s": cpu, "inner_s": float(inner) if inner != "?" else None, "params": p.model.num_params(),
            "layers": len(p.compute), "acts": len(p.activations), "gemms": len(p.gemm), "links": len(p.links),
            "colls": len(p.collectives), "profile": p}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="also profile gpt2 (seq 256) with default settings")
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"autoconf profile cost, {args.nproc} CPU processes (gloo, OMP_NUM_THREADS=1)")
    for c in ("model", "params", "seq", "flags", "wall", "CPU (all procs)", "profiler", "timings", "act. entries", "GEMMs", "links",
              "collectives"):
        t.add_column(c, justify="left" if c in ("model", "flags") else "right")
    rows = []
    for model, seq, extra in RUNS + (FULL if args.full else []):
        r = profile_once(model, seq, extra, args.nproc)
        rows.append((model, seq, extra, r))
        if "error" in r:
            t.add_row(model, "-", str(seq or "-"), " ".join(extra) or "(default)", "failed", "", r["error"], *[""] * 5)
            continue
        t.add_row(model, f"{r['params'] / 1e6:.1f} M", str(seq or r["profile"].model.seq_length),
                  " ".join(extra) or "(default)", f"{r['wall_s']:.1f} s", f"{r['cpu_s']:.1f} s", f"{r['inner_s']:.1f} s", str(r["layers"]),
                  str(r["acts"]), str(r["gemms"]), str(r["links"]), str(r["colls"]))
    Console(width=160).print(t)
    print("load average after the runs: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    for model, seq, extra, r in rows:
        if "profile" in r:
            p = r["profile"]
            best = max(p.gemm, key=lambda g: g.flop_per_s) if p.gemm else None
            link = min(p.links, key=lambda x: x.bandwidth_bytes_per_s) if p.links else None
            msg = f"{model} {' '.join(extra)}:"
            if best:
                msg += (f" best GEMM {best.m}x{best.n}x{best.k} {best.dtype} {best.flop_per_s / 1e9:.0f} GFLOP/s "
                        f"({best.fraction_of_peak:.2f} of catalog peak);")
            if link:
                msg += f" slowest link {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s, {link.latency_s * 1e6:.0f} us"
            print(msg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
