"""Token batches: the same global batch for a step, whatever the parallel split.

Batch ``step`` is drawn from a generator seeded by (seed, step): synthetic tokens, or with a byte
file (trainer ``--data-file``, :func:`file_batch`) windows of its bytes as tokens at offsets drawn
from that generator. Data-parallel replica ``r`` takes
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


def load_bytes(path: str):
    """A file's bytes as a 1-D uint8 tensor (the token ids of :func:`file_batch`)."""
    import torch

    with open(path, "rb") as f:
        raw = f.read()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def file_batch(step: int, batch: int, seq_length: int, seed: int, data):
    """(inputs, targets) from a byte file's tokens (``data``: :func:`load_bytes`): ``batch`` windows
    of seq_length + 1 bytes at offsets drawn from a generator seeded by (seed, step)."""
    import torch

    span = seq_length + 1
    if data.numel() < span:
        raise ValueError(f"data file has {data.numel()} bytes: a sequence needs seq_length + 1 = {span}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    offsets = torch.randint(0, data.numel() - span + 1, (batch,), generator=g)
    tokens = torch.stack([data[int(o):int(o) + span] for o in offsets]).long()
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def replica_batch(step: int, batch: int, seq_length: int, vocab_size: int, seed: int,
                  dp_rank: int, dp: int, data=None):
    """This data-parallel replica's rows of the global batch (all micro-batches); ``data``: a byte
    file's tokens (:func:`file_batch`) instead of synthetic ones."""
    if data is None:
        x, y = global_batch(step, batch, seq_length, vocab_size, seed)
    else:
        x, y = file_batch(step, batch, seq_length, seed, data)
    n = batch // dp
    return x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]


def cp_shard(x, y, cp: int, cp_rank: int):
    """Context-parallel rank ``cp_rank``'s tokens and targets: chunks cp_rank and 2cp-1-cp_rank of
    2 x cp along the sequence (``ring_attention.split_load_balanced``); unchanged when cp = 1."""
    from autoconf.trainer.ring_attention import split_load_balanced

    return split_load_balanced(x, cp, cp_rank), split_load_balanced(y, cp, cp_rank)
