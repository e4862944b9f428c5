"""The GPU counts ``plan`` sweeps: powers of two times a node up to ``max_gpus``, or, open-ended,
until more GPUs stop paying (:func:`stops_paying`) within the most the space can use
(:func:`space_bound`)."""

from __future__ import annotations

OPEN_SIZE = 1 << 16
"""An open-ended sweep (no ``max_gpus``) prices its GPU counts up to this many on one cluster of
that size, each larger count on a cluster of its own size (the uniform topology is linear in its
devices: a cluster far larger than the count swept would cost memory for nothing)."""

PATIENCE = 2
"""Doublings past the shortest time after which an open-ended sweep stops (:func:`stops_paying`)."""


def space_bound(model, bud, per_node: int, max_cp: int | None = None) -> int:
    """The most GPUs any configuration of the space can use, a power of two times a node: one
    sequence per data-parallel rank (the largest batch swept), one layer per pipeline stage, one
    attention head per tensor-parallel rank, the largest context-parallel degree
    (``enumeration.cp_choices``'s bound)."""
    cp = max_cp if max_cp is not None else max(1, model.seq_length // 4096)
    most = max(bud.batches) * model.num_layers * model.num_attention_heads * cp
    g = per_node
    while g * 2 <= most:
        g *= 2
    return max(g, per_node)


def stops_paying(rows: list, net: str, counts: list, patience: int = PATIENCE) -> bool:
    """Whether an open-ended sweep on ``net`` may stop after GPU ``counts`` (increasing): every
    method with a plan found its shortest time ``patience`` doublings or more before the last
    count, or the last count has no plan at all after smaller ones had (more GPUs than the
    space can use, or a job that fails faster than it progresses)."""
    best: dict = {}  # method -> (days, GPUs) of its shortest time
    last = set()
    for r in rows:
        if r.network != net:
            continue
        if r.method not in best or (r.days, r.gpus) < best[r.method]:
            best[r.method] = (r.days, r.gpus)
        if counts and r.gpus == counts[-1]:
            last.add(r.method)
    if not best or len(counts) <= patience:
        return False
    if not last:
        return True
    return all(counts.index(g) <= len(counts) - 1 - patience for _, g in best.values())


def gpu_grid(max_gpus: int, per_node: int, start: int = 1) -> list:
    """Powers of two times a node, from ``start`` GPUs up to ``max_gpus``, and ``max_gpus`` itself."""
    out, g = [], per_node
    while g <= max_gpus:
        if g >= start:
            out.append(g)
        g *= 2
    if max_gpus not in out and max_gpus >= start:
        out.append(max_gpus)
    return out
