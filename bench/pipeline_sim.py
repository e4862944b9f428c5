"""Time autoconf.cost.pipeline.simulate: compile (first call of a shape) and per-call simulation.

Run: python3 bench/pipeline_sim.py
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoconf.cost import pipeline  # noqa: E402

CASES = [
    ("1f1b", 8, 64, 1),
    ("gpipe", 8, 64, 1),
    ("interleaved", 8, 64, 4),
    ("breadth_first", 8, 64, 4),
    ("1f1b", 32, 512, 1),
    ("interleaved", 32, 512, 2),
    ("interleaved", 16, 512, 8),
]


def bench(schedule: str, pp: int, m: int, v: int, reps: int = 20) -> tuple[int, float, float, float]:
    nc = pp * v
    rng = random.Random(0)
    args = [([rng.uniform(1, 2) for _ in range(nc)], [rng.uniform(2, 4) for _ in range(nc)],
             [rng.uniform(0, 0.1) for _ in range(nc - 1)]) for _ in range(reps)]
    pipeline._compile.cache_clear()
    t0 = time.perf_counter()
    pipeline._compile(schedule, pp, m, v)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for f, b, p in args:  # distinct durations: every call misses the result cache
        pipeline.simulate(schedule, pp, m, v, f, b, p)
    sim_s = (time.perf_counter() - t0) / reps
    f, b, p = args[0]
    t0 = time.perf_counter()
    for _ in range(1000):
        pipeline.simulate(schedule, pp, m, v, f, b, p)
    hit_s = (time.perf_counter() - t0) / 1000
    return 2 * m * nc, compile_s, sim_s, hit_s


def main() -> None:
    print(f"{'schedule':<14}{'pp':>4}{'m':>5}{'v':>3}{'ops':>8}{'compile ms':>12}{'sim ms':>9}{'ns/op':>7}{'cached us':>11}")
    for schedule, pp, m, v in CASES:
        ops, c, s, h = bench(schedule, pp, m, v)
        print(f"{schedule:<14}{pp:>4}{m:>5}{v:>3}{ops:>8}{c * 1e3:>12.2f}{s * 1e3:>9.2f}{s / ops * 1e9:>7.0f}{h * 1e6:>11.1f}")


if __name__ == "__main__":
    main()
