"""Pipeline schedules as per-device orders of forward and backward chunks: GPipe, 1F1B,
interleaved 1F1B (modular pipelines) and breadth-first (looped BFS), as
``torch.distributed.pipelining`` runs them. The cost model simulates these orders
(``cost.pipeline``); compressed traffic picks its sends from them.
"""

from __future__ import annotations

from functools import lru_cache

SCHEDULES = ("gpipe", "1f1b", "interleaved", "breadth_first")


def _order_gpipe(pp: int, m: int, v: int, rank: int) -> list[tuple[bool, int, int]]:
    # ScheduleGPipe (v = 1): F 0..m-1, then B 0..m-1.
    return [(False, mb, rank) for mb in range(m)] + [(True, mb, rank) for mb in range(m)]


def _order_1f1b(pp: int, m: int, v: int, rank: int) -> list[tuple[bool, int, int]]:
    # Schedule1F1B: warm-up forwards, 1F1B steady state, cool-down backwards.
    warmup = min(pp - rank - 1, m)
    ops = [(False, mb, rank) for mb in range(warmup)]
    for i in range(m - warmup):
        ops.append((False, warmup + i, rank))
        ops.append((True, i, rank))
    ops += [(True, mb, rank) for mb in range(m - warmup, m)]
    return ops


def _order_interleaved(pp: int, m: int, v: int, rank: int) -> list[tuple[bool, int, int]]:
    # ScheduleInterleaved1F1B._calculate_single_rank_operations + _get_1f1b_rank_ops (no zero bubble).
    per_round = m // max(1, m // pp)  # = pp, since m % pp == 0
    total = m * v
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), total)
    fwd_next = [0] * v
    bwd_next = [0] * v
    ops: list[tuple[bool, int, int]] = []

    def fwd(step: int) -> None:
        local = (step // per_round) % v
        ops.append((False, fwd_next[local], local * pp + rank))
        fwd_next[local] += 1

    def bwd(step: int) -> None:
        local = v - 1 - ((step - warmup) // per_round) % v
        ops.append((True, bwd_next[local], local * pp + rank))
        bwd_next[local] += 1

    for step in range(total + warmup):
        if step < warmup:
            fwd(step)
        elif step < total:
            fwd(step)
            bwd(step)
        else:
            bwd(step)
    return ops


def _order_breadth_first(pp: int, m: int, v: int, rank: int) -> list[tuple[bool, int, int]]:
    # ScheduleLoopedBFS: local chunks ascending, all forwards; then descending, backwards mb m-1..0.
    chunks = range(rank, pp * v, pp)
    ops = [(False, mb, c) for c in chunks for mb in range(m)]
    ops += [(True, mb, c) for c in reversed(chunks) for mb in reversed(range(m))]
    return ops


ORDERS = {
    "gpipe": _order_gpipe,
    "1f1b": _order_1f1b,
    "interleaved": _order_interleaved,
    "breadth_first": _order_breadth_first,
}


def check_shape(schedule: str, pp: int, m: int, v: int) -> None:
    if schedule not in ORDERS:
        raise ValueError(f"schedule={schedule!r}; valid: {', '.join(SCHEDULES)}")
    for name, val in (("pp", pp), ("num_micro_batches", m), ("virtual_stages", v)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name}={val!r} must be a positive integer")
    if schedule in ("gpipe", "1f1b") and v != 1:
        raise ValueError(f"schedule {schedule} has one chunk per device; virtual_stages={v} must be 1")
    if schedule == "interleaved" and m % pp:
        raise ValueError(f"interleaved: pp({pp}) does not divide num_micro_batches({m})")


def device_orders(schedule: str, pp: int, num_micro_batches: int,
                  virtual_stages: int = 1) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Per device, its ops in execution order as ``("F" | "B", micro_batch, global_chunk)``."""
    check_shape(schedule, pp, num_micro_batches, virtual_stages)
    make = ORDERS[schedule]
    return tuple(tuple(("B" if b else "F", mb, c) for b, mb, c in make(pp, num_micro_batches, virtual_stages, r))
                 for r in range(pp))


@lru_cache(maxsize=4096)
def fsdp_gathers(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int = 1,
                 layered: bool = False) -> dict[int, tuple[int, int]]:
    """{chunk: (forward gathers, backward gathers)} per step of an FSDP (ZeRO-3) unit of each
    chunk, under ``torch.distributed.pipelining`` running ``device_orders``; every unit
    reduce-scatters its gradients once per step, after the chunk's last backward.

    FSDP2 gathers a unit's parameters before a pass that finds them sharded. The pipeline stage
    (torch 2.13 ``pipelining/stage.py``, ``backward_one_chunk``) keeps them gathered after every
    backward but the chunk's last (``set_reshard_after_backward(False)``, and no gradient sync
    until ``perform_reduce_grad``). After a forward they are resharded at once under standard
    accumulation (``reshard_after_forward``), so an interleaving of forwards and backwards
    gathers again and again; with layered accumulation (breadth-first, gpipe-layered) the reference
    trainer keeps them through the chunk's forwards and reshards after its last one, so that each
    chunk gathers once in the forward and once in the backward (Lamy-Poirier, arXiv 2106.02679)."""
    out: dict[int, list[int]] = {}
    for device in range(pp):
        for kind, c, gathered, _live, _grads in _fsdp_walk(schedule, pp, num_micro_batches, virtual_stages, layered,
                                                          device):
            out.setdefault(c, [0, 0])[kind == "B"] += not gathered
    return {c: (f, b) for c, (f, b) in out.items()}


def fsdp_unsharded_peak(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int, layered: bool,
                        device: int, param_bytes: dict, grad_bytes: dict) -> float:
    """The most bytes device ``device``'s chunks hold unsharded at once under
    ``fsdp_gathers``'s rules: a chunk's gathered parameters (``param_bytes[chunk]``) while they
    are gathered, and its unsharded gradients (``grad_bytes[chunk]``) from its first backward to
    its last, which reduce-scatters them (no gradient sync before it)."""
    peak = 0.0
    for gathered, grads in _fsdp_live(schedule, pp, num_micro_batches, virtual_stages, layered, device):
        peak = max(peak, sum(param_bytes[c] for c in gathered) + sum(grad_bytes[c] for c in grads))
    return peak


@lru_cache(maxsize=1024)
def _fsdp_live(schedule: str, pp: int, m: int, v: int, layered: bool, device: int) -> tuple:
    """The distinct (gathered chunks, chunks with unsharded gradients) a device passes through,
    each during some pass (:func:`fsdp_unsharded_peak`)."""
    return tuple({(live, grads) for _k, _c, _g, live, grads in _fsdp_walk(schedule, pp, m, v, layered, device)})


def _fsdp_walk(schedule: str, pp: int, m: int, v: int, layered: bool, device: int):
    """Each pass of ``device_orders(...)[device]`` under :func:`fsdp_gathers`'s rules, as (kind,
    chunk, whether its units were already gathered, the chunks gathered during it, the chunks
    holding unsharded gradients during it)."""
    gathered: set = set()
    grads: set = set()
    seen: dict = {}
    for kind, _mb, c in device_orders(schedule, pp, m, v)[device]:
        before = c in gathered
        gathered.add(c)
        if kind == "B":
            grads.add(c)
        yield kind, c, before, frozenset(gathered), frozenset(grads)
        n = seen[kind, c] = seen.get((kind, c), 0) + 1
        if kind == "B" and n >= m:  # the last backward reshards and reduce-scatters
            gathered.discard(c)
            grads.discard(c)
        elif kind == "F" and not (layered and n < m):  # a forward reshards, but a layered chunk's last
            gathered.discard(c)
