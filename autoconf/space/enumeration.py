"""The search space: every (dp, pp, tp, cp) factorization of a world, the pipeline schedules and
micro-batch sizes per point, and the configurations they make (``config.ParallelConfig``)."""

from __future__ import annotations

import itertools

from autoconf.space.config import RECOMPUTE, ParallelConfig, check
from autoconf.specs.model import ModelSpec


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order (pairs up to sqrt(n): a batch of 1e11 too)."""
    low, high = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            low.append(d)
            if d * d != n:
                high.append(n // d)
        d += 1
    return low + high[::-1]


def factorizations(world: int, cps=None) -> list[tuple]:
    """All (dp, pp, tp) with dp x pp x tp = world; with ``cps``, all (dp, pp, tp, cp) with
    dp x pp x tp x cp = world and cp in ``cps``."""
    if cps is None:
        return [(world // (pp * tp), pp, tp) for tp in divisors(world) for pp in divisors(world // tp)]
    return [(world // (pp * tp * cp), pp, tp, cp) for cp in cps if world % cp == 0
            for tp in divisors(world // cp) for pp in divisors(world // (cp * tp))]


def cp_choices(model: ModelSpec, world: int, max_cp: int | None = None) -> tuple:
    """Context-parallel degrees worth searching: those the load-balanced split allows
    (``seq_length`` divisible by 2 x cp) up to ``max_cp``; by default up to seq_length / 4096
    (sequences of 8K tokens and more: shorter ones leave each rank's attention too short to hide
    the ring's transfers, and their activations fit without it)."""
    if max_cp is None:
        max_cp = max(1, model.seq_length // 4096)
    return tuple(c for c in divisors(world) if c <= max_cp and (c == 1 or model.seq_length % (2 * c) == 0))


MAX_VIRTUAL = 8
"""Chunks per device the space offers by default (``--max-virtual-stages``): each chunk more makes
every estimate's schedule longer to simulate (gpt-1t on 3,072 A100s: 34 s of search up to 8, 852 s
up to one layer per chunk)."""


def pipeline_choices(pp: int, model: ModelSpec, max_virtual: int | None = MAX_VIRTUAL) -> list[tuple[str, int, bool]]:
    """(schedule, virtual_stages, layered) combinations worth considering for a pp degree: every
    number of chunks per device that divides its layers up to ``max_virtual``; None: up to one
    layer per chunk (fully modular placement, Lamy-Poirier's arXiv 2106.02679)."""
    if pp == 1:
        return [("1f1b", 1, False), ("1f1b", 1, True)]
    out = [("gpipe", 1, False), ("gpipe", 1, True), ("1f1b", 1, False)]
    max_v = model.num_layers // pp if max_virtual is None else min(max_virtual, model.num_layers // pp)
    out += [("interleaved", v, False) for v in range(2, max_v + 1) if (model.num_layers // pp) % v == 0]
    out += [("breadth_first", v, True) for v in range(2, max_v + 1) if (model.num_layers // pp) % v == 0]
    return out


def micro_batch_choices(per_replica_batch: int, max_micro_batch: int = 64) -> list[int]:
    return [b for b in range(1, min(per_replica_batch, max_micro_batch) + 1) if per_replica_batch % b == 0]


def outer_space(model: ModelSpec, world: int, global_batch: int, max_micro_batch: int = 64,
                rejected: dict | None = None, cps=(1,), max_virtual: int | None = MAX_VIRTUAL):
    """Yield the structural choices (dp, pp, tp, mbs, schedule, v, layered, cp) whose batch
    splits, cp from ``cps`` (``cp_choices``).

    Divisibility of the global batch by dp is counted in ``rejected`` (reason -> count).
    """
    for dp, pp, tp, cp in factorizations(world, cps):
        if global_batch % dp:
            if rejected is not None:
                key = f"global batch({global_batch}) not divisible by dp"
                rejected[key] = rejected.get(key, 0) + 1
            continue
        for mbs in micro_batch_choices(global_batch // dp, max_micro_batch):
            for sched, v, layered in pipeline_choices(pp, model, max_virtual):
                yield dp, pp, tp, mbs, sched, v, layered, cp


def inner_choices(dp: int, tp: int, cp: int = 1):
    """(zero_stage, recompute, sequence_parallel) combinations."""
    zeros = (0, 1, 2, 3) if dp * cp > 1 else (0,)
    sps = (False, True) if tp > 1 else (False,)
    return list(itertools.product(zeros, RECOMPUTE, sps))


def make_config(dp, pp, tp, mbs, sched, v, layered, zero, recompute, sp, global_batch, cp: int = 1) -> ParallelConfig:
    return ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=mbs,
                          num_micro_batches=global_batch // (dp * mbs), schedule=sched,
                          virtual_stages=v, layered_grad_accum=layered, zero_stage=zero,
                          recompute=recompute, sequence_parallel=sp, cp=cp)


def point_config(point, zero, recompute, sp, global_batch) -> ParallelConfig:
    """The configuration of an outer point (``outer_space``) with these inner choices."""
    dp, pp, tp, mbs, sched, v, layered, cp = point
    return make_config(dp, pp, tp, mbs, sched, v, layered, zero, recompute, sp, global_batch, cp)


def enumerate_space(model: ModelSpec, world: int, global_batch: int, max_micro_batch: int = 64, cps=(1,)):
    """Yield (config, reason-or-None) for every configuration of the space."""
    rejected: dict = {}
    for point in outer_space(model, world, global_batch, max_micro_batch, rejected, cps):
        dp, tp, cp = point[0], point[2], point[7]
        for zero, rc, sp in inner_choices(dp, tp, cp):
            c = point_config(point, zero, rc, sp, global_batch)
            yield c, check(c, model)
