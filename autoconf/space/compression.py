"""What compressed traffic (Optimus-CC) sends, as a rule of the configuration: which backward
sends a pipeline schedule compresses (``compressed_sends``) and how PowerSGD splits a bucket of
tensors (``powersgd_split``). Shared by the cost model, which prices it, and the trainer, which runs
it. Pure: no torch.
"""

from __future__ import annotations

from functools import lru_cache

from autoconf.space.schedules import device_orders

MIN_COMPRESSION_RATE = 2
"""torch's ``PowerSGDState.min_compression_rate`` default: compress a matrix only if that at
least halves it."""


@lru_cache(maxsize=256)
def compressed_sends(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int,
                     mode: str) -> frozenset:
    """The backward sends compressed under ``mode`` ("none", "epilogue", "all"), as
    ``(micro_batch, sending_chunk)`` pairs: chunk c >= 1 sends the gradient of its input to chunk
    c - 1 after its backward of that micro-batch. "epilogue": the backward ops each device runs
    after its last forward op (in the schedule's order, ``space.schedules.device_orders``)."""
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


def norm_shapes(model) -> list:
    h = model.hidden_size
    return [(h,), (h,)] if model.norm == "layernorm" else [(h,)]


def block_shapes(model, tp: int) -> list:
    """The parameter shapes of one dense transformer block on a tp rank, as the reference
    trainer (``trainer.layers.Block``) and Megatron shard them: fused QKV and fc1 split by rows, proj and fc2
    by columns, norms and row-parallel biases whole."""
    h, q, kv, f = model.hidden_size, model.q_size, model.kv_size, model.ffn_hidden_size
    fc1 = (2 * f if model.gated_mlp else f) // tp
    shapes = norm_shapes(model) + [((q + 2 * kv) // tp, h)]
    if model.bias or model.qkv_bias:
        shapes.append(((q + 2 * kv) // tp,))
    shapes.append((h, q // tp))
    if not model.shared_norm:
        shapes += norm_shapes(model)
    shapes += [(fc1, h), (h, f // tp)]
    if model.bias:
        shapes += [(h,), (fc1,), (h,)]
    return shapes
