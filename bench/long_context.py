"""Long sequences and FP8: how fast a long-context search answers, and what FP8 buys per model size.

    python bench/long_context.py [--quick]

Table 1, long-sequence searches: Llama-3-8B at 128K tokens on 64 H100 (8 hosts of 8, NVLink
inside, 8 x 400 Gbit/s InfiniBand) for each framework that has context parallelism, and at 32K;
the wall time of the whole exhaustive search (in memory), the best configuration, whether it
splits the sequence (cp), its predicted step and peak memory. Without context parallelism
(``max_cp=1``) nothing fits at 128K: that row says what the least memory-hungry configuration
would need.

Table 2, FP8 against BF16: per model, the best configuration the search finds with BF16 only and
with FP8 only (Megatron-LM, tensorwise scaling, on the same 64 H100), and the predicted speed-up
of the step. The FP8 figures rest on the catalog's FP8 peak and FP8 GEMM efficiency (0.65 of the
FP8 peak, from published cuBLASLt / Transformer Engine benchmarks), the scaling kernels and the
FP8 memory terms (``cost/compute.py``, ``cost/stage_memory.py``); nothing here is measured on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autoconf.errors import UserError  # noqa: E402
from autoconf.specs.cluster import load_cluster  # noqa: E402
from autoconf.specs.model import preset  # noqa: E402
from autoconf.study.search import search  # noqa: E402

H100 = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters", "h100-8x8.yaml")


def long_rows(cluster, quick: bool):
    cases = [("llama-3-8b", 131072, 16, "megatron", None), ("llama-3-8b", 131072, 16, "torchtitan", None),
             ("llama-3-8b", 131072, 16, "megatron", 1), ("llama-3-8b", 32768, 64, "megatron", None)]
    if quick:
        cases = cases[:1] + cases[2:3]
    for name, seq, gb, fw, max_cp in cases:
        model = dataclasses.replace(preset(name), seq_length=seq, attention="flash", dropout=0.0)
        t0 = time.perf_counter()
        r = search(model, cluster, gb, storage=None, framework=fw, max_cp=max_cp, precision="bf16")
        wall = time.perf_counter() - t0
        if r.top:
            e = r.top[0]
            yield (f"{name} {seq // 1024}K", fw, str(max_cp or "auto"), f"{wall:.1f}", f"{r.valid:,}",
                   e.config.short(), str(e.config.cp), f"{e.step_time_s:.2f} s", f"{e.peak_memory_bytes / 2**30:.1f} GiB")
        else:
            e = r.smallest_memory
            yield (f"{name} {seq // 1024}K", fw, str(max_cp or "auto"), f"{wall:.1f}", f"{r.valid:,}",
                   "nothing fits", "-", "-", f"needs {e.peak_memory_bytes / 2**30:.0f} GiB" if e else "-")


def fp8_rows(cluster, quick: bool):
    models = ["llama-3-8b", "llama-2-13b", "llama-3-70b"] + ([] if quick else ["gpt3-175b"])
    for name in models:
        model = dataclasses.replace(preset(name), attention="flash", dropout=0.0)
        gb = 128 if model.num_params() < 1e11 else 256
        best = {}
        for prec in ("bf16", "fp8"):
            try:
                r = search(model, cluster, gb, storage=None, framework="megatron", precision=prec, fp8_recipe="tensorwise"
                           if prec == "fp8" else None)
            except UserError as err:
                best[prec] = str(err)
                continue
            best[prec] = r.top[0] if r.top else None
        b, f = best["bf16"], best["fp8"]
        if not b or not f or isinstance(b, str) or isinstance(f, str):
            yield (name, str(gb), "-", "-", "-", "-", "-")
            continue
        yield (name, str(gb), b.config.short(), f"{b.step_time_s:.2f} s", f.config.short(), f"{f.step_time_s:.2f} s",
               f"{b.step_time_s / f.step_time_s:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    args = ap.parse_args()
    cluster = load_cluster(H100)
    console = Console(width=220)
    t = Table(title="long-sequence searches (64 x H100, in-memory study, this machine)")
    for col in ("model", "framework", "max cp", "wall s", "valid", "best", "cp", "step", "peak memory"):
        t.add_column(col)
    for row in long_rows(cluster, args.quick):
        t.add_row(*row)
    console.print(t)
    t = Table(title="FP8 against BF16: best configuration of each (Megatron-LM, tensorwise, 64 x H100)")
    for col in ("model", "global batch", "best bf16", "step", "best fp8", "step", "speed-up"):
        t.add_column(col)
    for row in fp8_rows(cluster, args.quick):
        t.add_row(*row)
    console.print(t)


if __name__ == "__main__":
    main()
