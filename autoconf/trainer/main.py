"""The reference trainer: ``torchrun ... -m autoconf.trainer --config config.json --out DIR``.

It builds the project's GPT (autoconf.trainer.layers) for this rank's share of a ParallelConfig, trains a few
steps on synthetic tokens (the same global batch for any split) with AdamW, and writes
``DIR/rank_<K>.json`` (step times, peak memory, losses) and, on rank 0, ``DIR/summary.json``.

It never hangs: every collective has the process-group timeout (``--step-timeout``) and a watchdog
ends a step that runs longer. A rank that fails writes ``{"ok": false, "reason": ...}`` and exits
non-zero. Clean shutdown is ``barrier(); os._exit(0)`` once results are written (a plain
``destroy_process_group`` after DDP aborts about one run in ten on gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import traceback


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m autoconf.trainer")
    p.add_argument("--config", required=True, help="trainer config JSON")
    p.add_argument("--out", required=True, help="directory for rank_<K>.json and summary.json")
    p.add_argument("--steps", type=int, default=6, help="steps to run, warm-up included")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps")
    p.add_argument("--speed-probe", action="store_true",
                   help="after every step, each rank in turn times one block's forward+backward at micro-batch "
                   "size 1 (the profile's reference measurement): how fast this machine runs right now")
    p.add_argument("--data-file", default=None, metavar="PATH",
                   help="train on this file's bytes as tokens (vocab >= 256): each step's global batch is windows "
                   "of seq_length + 1 bytes at offsets drawn from (seed, step), whatever the split")
    p.add_argument("--step-timeout", type=float, default=300.0,
                   help="seconds allowed for rendezvous, each step and each collective")
    return p.parse_args(argv)


def _write(out_dir: str, rank: int, result: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, f".rank_{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, f"rank_{rank}.json"))


def _failure_reason(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".splitlines()[0][:400]
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "out of memory" in text.lower():
        return f"out of memory ({text})"
    return text


class Watchdog:
    """Ends the process with a failed result if a step runs past the timeout."""

    def __init__(self, out_dir: str, rank: int, timeout_s: float):
        self.out_dir, self.rank, self.timeout_s = out_dir, rank, timeout_s
        self.timer = None

    def start(self, what: str) -> None:
        self.stop()
        self.timer = threading.Timer(self.timeout_s, self._fire, args=(what,))
        self.timer.daemon = True
        self.timer.start()

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _fire(self, what: str) -> None:
        _write(self.out_dir, self.rank, {"rank": self.rank, "ok": False,
                                         "reason": f"{what} exceeded the step timeout of {self.timeout_s:g} s"})
        os._exit(3)


def main(argv=None) -> None:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    watchdog = Watchdog(args.out, rank, args.step_timeout)
    try:
        from autoconf.trainer.run import train

        result = train(args, rank, watchdog)
    except BaseException as e:  # noqa: BLE001 - every failure becomes a result
        watchdog.stop()
        _write(args.out, rank, {"rank": rank, "ok": False, "reason": _failure_reason(e),
                                "traceback": traceback.format_exc()[-4000:]})
        sys.stdout.flush()
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    watchdog.stop()
    _write(args.out, rank, result)
    _finish(args.out, rank, result, watchdog)


def _finish(out_dir: str, rank: int, result: dict, watchdog: Watchdog) -> None:
    """Gather every rank's result on rank 0 for the summary, then the shutdown that never crashed."""
    import torch.distributed as dist

    watchdog.start("shutdown")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    if rank == 0:
        times = [r["step_time_s"] for r in everyone if r.get("step_time_s") is not None]
        peaks = [r["peak_memory_bytes"] for r in everyone if r.get("peak_memory_bytes") is not None]
        summary = {"ok": all(r.get("ok") for r in everyone), "config": result.get("config"),
                   "model": result.get("model"), "world_size": len(everyone),
                   "step_time_s": max(times) if times else None,
                   "peak_memory_bytes": max(peaks) if peaks else None,
                   "losses": result.get("losses"), "memory_method": result.get("memory_method"),
                   "per_rank_step_time_s": times, "per_rank_peak_memory_bytes": peaks}
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


