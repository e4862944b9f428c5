"""Resume speed: one search run straight through vs the same search interrupted (Ctrl-C) and resumed.

    python bench/resume.py [--model llama-3-405b] [--nodes 256] [--global-batch 2048] [--interrupt-after 0.4]

Each run is `autoconf search` in a process of its own with a fresh SQLite study. The interrupted
run gets SIGINT (as Ctrl-C would send) after ``--interrupt-after`` x the uninterrupted wall time,
then the same command is run again. Prints wall times, the trials each study holds and whether
both found the same best configuration. Target: interrupted + resumed no slower than uninterrupted
(plus the start-up of the second process).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

CLUSTER = """name: a100-{n}x8
node_groups:
  - count: {n}
    device: a100-80gb
    gpus_per_node: 8
    intra_node_bandwidth: 300 GB/s
    nics: {{count: 8, bandwidth: 200 Gbit/s, kind: infiniband}}
latency: {{intra_node: 2 us, inter_node: 10 us}}
"""


def _cmd(args, cluster, db):
    return [sys.executable, "-m", "autoconf", "search", "--model", args.model, "--cluster", cluster,
            "--global-batch", str(args.global_batch), "--storage", f"sqlite:///{db}", "--study-name", "bench",
            "--json", "--quiet"]


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))


def _run(cmd):
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if p.returncode != 0:
        sys.exit(f"search failed ({p.returncode}): {p.stderr[-2000:]}")
    return time.perf_counter() - t0, json.loads(p.stdout)


def _stored(db) -> int:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return len(optuna.load_study(study_name="bench", storage=f"sqlite:///{db}").get_trials(deepcopy=False))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3-405b")
    ap.add_argument("--nodes", type=int, default=256, help="8-GPU A100 nodes (default 256: 2,048 GPUs)")
    ap.add_argument("--global-batch", type=int, default=2048)
    ap.add_argument("--interrupt-after", type=float, default=0.4,
                    help="interrupt after this fraction of the uninterrupted wall time (default 0.4)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        cluster = os.path.join(d, "cluster.yaml")
        with open(cluster, "w") as f:
            f.write(CLUSTER.format(n=args.nodes))
        straight_s, straight = _run(_cmd(args, cluster, os.path.join(d, "a.db")))
        n_straight = _stored(os.path.join(d, "a.db"))

        db = os.path.join(d, "b.db")
        t0 = time.perf_counter()
        p = subprocess.Popen(_cmd(args, cluster, db), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env=_env(), start_new_session=True)
        time.sleep(args.interrupt_after * straight_s)
        os.killpg(p.pid, signal.SIGINT)
        err = p.communicate()[1]
        first_s = time.perf_counter() - t0
        n_kept = _stored(db)
        resumed_s, resumed = _run(_cmd(args, cluster, db))
        n_resumed = _stored(db)

    same = straight["best"]["config"] == resumed["best"]["config"]
    t = Table(title=f"resume: {args.model} on {args.nodes * 8} A100s, global batch {args.global_batch} (this machine)")
    for col in ("run", "wall s", "trials in the study", "best"):
        t.add_column(col)
    t.add_row("uninterrupted", f"{straight_s:.1f}", str(n_straight), straight["best"]["config"] and _short(straight))
    t.add_row(f"interrupted at {args.interrupt_after:.0%} (exit {p.returncode})", f"{first_s:.1f}", str(n_kept), "")
    t.add_row("resumed", f"{resumed_s:.1f}", str(n_resumed), _short(resumed))
    t.add_row("interrupted + resumed", f"{first_s + resumed_s:.1f}", "",
              "same best" if same else "DIFFERENT best")
    Console(width=160).print(t)
    if err.strip():
        print("interrupt message:", err.strip().splitlines()[-1])


def _short(doc) -> str:
    from autoconf.space.config import ParallelConfig

    return ParallelConfig.from_dict(doc["best"]["config"]).short()


if __name__ == "__main__":
    main()
