"""Synthetic token batches: the same global batch for a step, whatever the parallel split.

Batch ``step`` is drawn from a generator seeded by (seed, step); data-parallel replica ``r`` takes
rows ``[r*B/dp, (r+1)*B/dp)`` and splits them into micro-batches in order, so any split sees the
same tokens as a single-process run of the same global batch. Under context parallelism each cp
rank then keeps its load-balanced share of every sequence (:func:`cp_shard`).
"""

from __future__ import annotations


def global_batch(step: int, batch: int, seq_length: int, vocab_size: int, seed: int):
    """(inputs, targets), each [batch, seq_length] int64: targets are inputs shifted by one."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab_size, (batch, seq_length + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def replica_batch(step: int, batch: int, seq_length: int, vocab_size: int, seed: int,
                  dp_rank: int, dp: int):
    """This data-parallel replica's rows of the global batch (all micro-batches)."""
    x, y = global_batch(step, batch, seq_length, vocab_size, seed)
    n = batch // dp
    return x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]


def cp_shard(x, y, cp: int, cp_rank: int):
    """Context-parallel rank ``cp_rank``'s tokens and targets: chunks cp_rank and 2cp-1-cp_rank of
    2 x cp along the sequence (``ring_attention.split_load_balanced``); unchanged when cp = 1."""
    from ..ring_attention import split_load_balanced

    return split_load_balanced(x, cp, cp_rank), split_load_balanced(y, cp, cp_rank)
