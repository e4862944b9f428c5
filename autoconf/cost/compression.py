"""Compressed 3D-parallel traffic (Optimus-CC, Song et al., ASPLOS 2023, arXiv 2301.09830): what
it sends, which sends it touches, what its kernels and buffers cost.

- **Compressed backpropagation** (``pp_compression``): the activation gradient a pipeline chunk
  sends backwards, an ``n x m`` matrix (n = tokens of the micro-batch on this rank, m = hidden
  size), goes as a rank-r product ``P Q^T``: ``(n + m) r`` values instead of ``n m``
  (:func:`low_rank_elements`). The sender runs one power iteration warm-started from its last Q
  (``P = M Q``, orthogonalise P, ``Q = M^T P``), keeps the residual ``M - P Q^T`` for the next
  micro-batch (lazy error propagation); the receiver multiplies ``P Q^T`` back.
- **Epilogue-only compression**: only the sends nothing overlaps are compressed, those a device
  makes after its last forward (:func:`compressed_sends`): under 1F1B stage s's last p - s (the
  last steady-state send and the cool-down); under GPipe and breadth-first every backward send
  (all come after the last forward); under interleaved 1F1B the cool-down's sends of every chunk.
- **Data-parallel compression** (``dp_compression_stages``): PowerSGD with error feedback (Vogels
  et al., NeurIPS 2019) as torch's ``powerSGD_hook`` runs it on each gradient bucket: a matrix
  ``n x m`` (a weight, viewed as ``shape[0] x rest``) is compressed when ``(n + m) r`` is less
  than half of ``n m``, every other tensor (biases, norms, small matrices) is all-reduced exactly
  (:func:`powersgd_split`); three all-reduces in a row per bucket (the exact part, the Ps, the Qs).

Pure: no torch.
"""

from __future__ import annotations

from functools import lru_cache

from .pipeline import device_orders

MIN_COMPRESSION_RATE = 2
"""torch's ``PowerSGDState.min_compression_rate`` default: compress a matrix only if that at
least halves it."""


@lru_cache(maxsize=256)
def compressed_sends(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int,
                     mode: str) -> frozenset:
    """The backward sends compressed under ``mode`` ("none", "epilogue", "all"), as
    ``(micro_batch, sending_chunk)`` pairs: chunk c >= 1 sends the gradient of its input to chunk
    c - 1 after its backward of that micro-batch. "epilogue": the backward ops each device runs
    after its last forward op (in the schedule's order, ``pipeline.device_orders``)."""
    if mode == "none" or pp == 1:
        return frozenset()
    orders = device_orders(schedule, pp, num_micro_batches, virtual_stages)
    out = set()
    for order in orders:
        last_f = max(i for i, (kind, _mb, _c) in enumerate(order) if kind == "F")
        for i, (kind, mb, c) in enumerate(order):
            if kind == "B" and c > 0 and (mode == "all" or i > last_f):
                out.add((mb, c))
    return frozenset(out)


def sends_per_chunk(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int, mode: str) -> tuple:
    """Per global chunk: how many of its backward sends are compressed (chunk 0 sends none)."""
    counts = [0] * (pp * virtual_stages)
    for _mb, c in compressed_sends(schedule, pp, num_micro_batches, virtual_stages, mode):
        counts[c] += 1
    return tuple(counts)


def effective_rank(n: int, m: int, rank: int) -> int:
    """The rank a factorisation of an n x m matrix can have: at most min(n, m)."""
    return max(1, min(n, m, rank))


def low_rank_elements(n: int, m: int, rank: int) -> int:
    """Values sent for an n x m matrix as P (n x r) and Q (m x r)."""
    return (n + m) * effective_rank(n, m, rank)


def matrix_of(shape) -> tuple[int, int]:
    """How PowerSGD views a tensor: ``shape[0] x (numel / shape[0])`` (a 1-D tensor is n x 1)."""
    shape = tuple(int(d) for d in shape)
    if not shape:
        return 1, 1
    numel = 1
    for d in shape:
        numel *= d
    return shape[0], numel // max(1, shape[0])


def powersgd_split(shapes, rank: int, min_rate: int = MIN_COMPRESSION_RATE) -> tuple[int, int, int, list]:
    """How ``powerSGD_hook`` sends a bucket of tensors of these shapes: (exact elements, P
    elements, Q elements, the (n, m, r) of each compressed matrix)."""
    exact = ps = qs = 0
    mats = []
    for shape in shapes:
        n, m = matrix_of(shape)
        r = min(n, m, rank)
        if (n + m) * r * min_rate < n * m:
            ps += n * r
            qs += m * r
            mats.append((n, m, r))
        else:
            exact += n * m
    return exact, ps, qs, mats
