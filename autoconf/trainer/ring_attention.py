"""Context parallelism: causal ring attention over a process group, in plain tensor operations.

The sequence is cut into 2 x cp chunks and context-parallel rank i holds chunks i and 2cp-1-i,
concatenated (the load-balanced causal split of Megatron-LM and ring-flash-attention's "zigzag": every
rank then has the same number of visible query-key pairs). Every other layer works on the rank's tokens
only; attention passes the keys and values around the ring of the cp group:

- forward: step 0 attends the rank's queries to its own keys (causal: the local positions are
  increasing); at step t > 0 the rank holds the K/V of rank j = i - t (mod cp), received from its
  predecessor while step t - 1 computed (``isend``/``irecv``). If j < i only j's first chunk is
  visible, to every local query; if j > i only the rank's second query chunk sees j's keys, all of
  them; the other blocks lie above the causal diagonal and are skipped. Partial outputs merge with
  their log-sum-exp (as flash attention's online softmax).
- backward (:class:`_RingAttention`): the standard ring-attention backward. The K/V travel the ring
  again, each with the accumulator of its dK/dV: at step t a rank adds its queries' contribution to
  the accumulator it received with the K/V it holds and passes it on; after cp steps every
  accumulator is back with its owner. Scores are recomputed per block from the saved queries, keys,
  values, output and log-sum-exp (flash attention's backward), so nothing of size s x s is kept.

No all-gather of the sequence's keys and values happens anywhere. Attention dropout is not supported
(the trainer and ``trainer.layers.Block`` refuse it). Grouped-query attention: K/V travel at num_kv_heads and are
expanded per block; their gradients are summed back over each group of query heads. The block math
runs in fp32 (fp64 for fp64 inputs) whatever the model's dtype (a reference implementation, not a kernel).

Pure helpers (no process group): :func:`load_balanced_indices`, :func:`split_load_balanced`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

_TAG_KV, _TAG_DKV = 7101, 7102


def load_balanced_indices(seq_length: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of cp rank ``rank``'s tokens: chunks ``rank`` and ``2cp-1-rank`` of 2 x cp."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} out of range for cp={cp}")
    if seq_length % (2 * cp):
        raise ValueError(f"cp({cp}): seq_length({seq_length}) must be divisible by 2 x cp = {2 * cp}")
    c = seq_length // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def split_load_balanced(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s share of ``x`` along ``dim`` (the sequence): chunks rank and 2cp-1-rank."""
    if cp == 1:
        return x
    if x.shape[dim] % (2 * cp):
        raise ValueError(f"cp({cp}): sequence length {x.shape[dim]} must be divisible by 2 x cp = {2 * cp}")
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim).contiguous()


# -- one block of attention (fp32) ------------------------------------------------------------------------

def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, kv_heads, s, d] -> [b, heads, s, d], query head h reading kv head h // (heads / kv_heads)."""
    b, kv, s, d = t.shape
    if kv == heads:
        return t
    return t[:, :, None].expand(b, kv, heads // kv, s, d).reshape(b, heads, s, d)


def _fold(t: torch.Tensor, kv: int) -> torch.Tensor:
    """The gradient of :func:`_expand`: [b, heads, s, d] summed back to [b, kv, s, d]."""
    b, heads, s, d = t.shape
    if kv == heads:
        return t
    return t.view(b, kv, heads // kv, s, d).sum(2)


def _scores(q, k, scale: float, causal: bool):
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        n = s.shape[-1]
        s = s + torch.full((n, n), float("-inf"), dtype=s.dtype, device=s.device).triu(1)
    return s


def _block_forward(q, k, v, scale: float, causal: bool):
    """(softmax(q k^T) v, logsumexp of the scores) for one block; q [b, H, sq, d], k, v [b, H, sk, d]."""
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def _block_backward(q, k, v, dout, lse, delta, scale: float, causal: bool):
    """(dq, dk, dv) of one block given the final log-sum-exp and delta = rowsum(dout * out)."""
    p = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-2, -1), dout)
    ds = p * (torch.matmul(dout, v.transpose(-2, -1)) - delta.unsqueeze(-1))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, dv


def _merge(out, lse, o, l, rows: slice) -> None:
    """Fold a partial result (o, l) for query rows ``rows`` into the running (out, lse), in place."""
    old_o, old_l = out[:, :, rows], lse[:, :, rows]
    new_l = torch.logaddexp(old_l, l)
    out[:, :, rows] = old_o * torch.exp(old_l - new_l).unsqueeze(-1) + o * torch.exp(l - new_l).unsqueeze(-1)
    lse[:, :, rows] = new_l


def step_plan(step: int, me: int, cp: int, c: int):
    """What step ``step`` computes: (query rows, key columns, causal) or None for step 0's causal block."""
    j = (me - step) % cp
    if step == 0:
        return slice(None), slice(None), True
    if j < me:  # j's first chunk precedes both of ours; its second follows both
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False  # only our second chunk follows j's chunks


class _Ring:
    """Point-to-point neighbours of this rank in the cp group (global ranks, as isend wants)."""

    def __init__(self, group):
        self.group = group
        self.cp, self.me = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.me + 1) % self.cp)
        self.prev = dist.get_global_rank(group, (self.me - 1) % self.cp)

    def shift(self, send: torch.Tensor, tag: int):
        """Start sending ``send`` to the next rank and receiving the previous rank's into a new
        tensor; returns (received, requests)."""
        recv = torch.empty_like(send)
        reqs = [dist.isend(send, self.next, group=self.group, tag=tag),
                dist.irecv(recv, self.prev, group=self.group, tag=tag)]
        return recv, reqs


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group):
        ring = _Ring(group)
        heads, kv_heads, s, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
        c, scale = s // 2, 1.0 / math.sqrt(d)
        acc = torch.promote_types(q.dtype, torch.float32)
        q32 = q.to(acc)
        out = torch.zeros(q32.shape, dtype=acc, device=q.device)
        lse = torch.full(q32.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v]).to(acc).contiguous()  # what travels: [2, b, kv_heads, s, d]
        for t in range(ring.cp):
            if t + 1 < ring.cp:  # the next step's K/V arrive while this one computes
                nxt, reqs = ring.shift(kv, _TAG_KV)
            rows, cols, causal = step_plan(t, ring.me, ring.cp, c)
            kk, vv = _expand(kv[0][:, :, cols], heads), _expand(kv[1][:, :, cols], heads)
            o, l = _block_forward(q32[:, :, rows], kk, vv, scale, causal)
            _merge(out, lse, o, l, rows)
            if t + 1 < ring.cp:
                _wait(reqs)
                kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.kv_heads = group, kv_heads
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        heads, s, d = q.shape[1], q.shape[2], q.shape[3]
        c, scale = s // 2, 1.0 / math.sqrt(d)
        dt = lse.dtype
        q32, do = q.to(dt), dout.to(dt)
        delta = (do * out.to(dt)).sum(-1)
        dq = torch.zeros_like(q32)
        kv = torch.stack([k, v]).to(dt).contiguous()
        acc, acc_reqs = None, []  # the dK/dV accumulator of the K/V held now, arriving from prev
        for t in range(ring.cp):
            if t + 1 < ring.cp:
                nxt, kv_reqs = ring.shift(kv, _TAG_KV)
            rows, cols, causal = step_plan(t, ring.me, ring.cp, c)
            kk, vv = _expand(kv[0][:, :, cols], heads), _expand(kv[1][:, :, cols], heads)
            gq, gk, gv = _block_backward(q32[:, :, rows], kk, vv, do[:, :, rows], lse[:, :, rows],
                                         delta[:, :, rows], scale, causal)
            dq[:, :, rows] += gq
            _wait(acc_reqs)  # the accumulator for these K/V (None at step 0)
            dkv = torch.zeros_like(kv) if acc is None else acc
            dkv[0][:, :, cols] += _fold(gk, ctx.kv_heads)
            dkv[1][:, :, cols] += _fold(gv, ctx.kv_heads)
            if ring.cp == 1:
                acc = dkv
                break
            sent = dkv  # kept alive until its send completes (the next wait)
            acc, acc_reqs = ring.shift(sent, _TAG_DKV)  # after the last step: our own K/V's, home
            if t + 1 < ring.cp:
                _wait(kv_reqs)
                kv = nxt
        _wait(acc_reqs)
        return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
    """Causal attention of this cp rank's tokens against the whole sequence's, over ``group``.

    q [b, heads, s/cp, d], k, v [b, kv_heads, s/cp, d] (heads a multiple of kv_heads), each rank's
    tokens in the load-balanced order (:func:`split_load_balanced`); returns [b, heads, s/cp, d].
    """
    if q.shape[2] % 2:
        raise ValueError(f"ring attention: the local sequence ({q.shape[2]}) must be two equal chunks")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring attention: {k.shape[1]} kv heads do not divide {q.shape[1]} query heads")
    return _RingAttention.apply(q, k, v, group)
