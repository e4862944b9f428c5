"""The pipeline runtime's own cost, per schedule.

``torch.distributed.pipelining`` does work per action (a micro-batch's forward or backward of one
chunk) besides the layer's compute: it splits and checks arguments, posts the receive, sends the
result, waits, and walks its schedule. With trivial stages (one 16x16 linear per chunk) a step is
nothing but that, plus the point-to-point round trips on the schedule's critical path. On the
2-core CPU test bed with gloo it is ~0.8 ms per action for GPipe / 1F1B and ~1.1 ms for the
multi-chunk schedules, a tenth of an interleaved step of the accuracy bench's model; on GPUs it
is the CPU launch cost the model would otherwise miss.

Ranks 0 and 1 run every schedule (the trainer's own ``build_schedule``), the other ranks wait at
the barrier; rank 0 reports the median step over ``repeats`` after two warm-ups.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("breadth_first", 2))
MICRO_BATCHES = 8


def measure(device, repeats: int, advance=None) -> list[dict]:
    """Every rank calls this (world >= 2); rank 0 returns the entries, the others []."""
    from autoconf.trainer.pipeline import build_schedule, chunk_ids, run_step

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group([0, 1]) if world > 2 else None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    for schedule, v in SCHEDULES:
        if rank < 2:
            torch.manual_seed(0)
            chunks = {c: torch.nn.Linear(16, 16).to(device) for c in chunk_ids(rank, 2, v)}
            sched, _ = build_schedule(chunks, schedule, 2 * v, MICRO_BATCHES, group, device,
                                      lambda out, target: out.sum())
            x = torch.randn(MICRO_BATCHES, 16, device=device)
            y = torch.zeros(MICRO_BATCHES, device=device)
            times = []
            for i in range(repeats + 2):
                dist.barrier(group=group)
                sync()
                t0 = time.perf_counter()
                run_step(sched, rank == 0, rank == 1, x, y)
                sync()
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            step = statistics.median(times)
            if rank == 0:
                out.append({"schedule": schedule, "pp": 2, "virtual_stages": v, "num_micro_batches": MICRO_BATCHES,
                            "step_s": step, "per_action_s": step / (2 * MICRO_BATCHES * v), "repeats": repeats})
        dist.barrier()
        if advance:
            advance(1)
    return out
