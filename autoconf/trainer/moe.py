"""Mixture-of-experts MLP of the reference trainer's blocks, with expert parallelism.

Imported by ``autoconf.trainer.layers`` (a Block whose ``model.is_moe_layer(layer_index)`` holds a :class:`MoE`
instead of fc1 / fc2); imports torch.

- Router: an E x h matrix (no bias), applied in fp32. "softmax": softmax over the experts, the top k,
  their probabilities renormalised over the top k (Mixtral); "sigmoid": a sigmoid per expert, the top
  k, renormalised (DeepSeek-V3); with ``router_groups`` the top k inside each token's
  ``router_group_topk`` best groups (a group scored by the sum of its top k / router_group_topk
  scores, as Megatron-LM's ``group_limited_topk``). :func:`route`.
- Routed experts: each a gated (SwiGLU / GeGLU) or two-matrix MLP of width ``model.expert_ffn``, as the
  dense MLP; shared experts (``num_shared_experts``, width ``model.shared_expert_ffn``) see every token.
  Output = sum over the token's kept (token, expert) pairs of weight x expert(x), + sum of shared(x).
- Capacity (``capacity_factor``; None: dropless): each expert takes at most
  ceil(cf x tokens x k / E) of the (token, expert) pairs of a forward call (one micro-batch of this
  rank: its local tokens), first come in token order (token-major, then the token's top-1, top-2...);
  dropped pairs contribute nothing (the kept weights are not renormalised again). :func:`keep_mask`.
- Expert parallelism (``ep_size`` > 1 with its ``ep_group``): rank j of the group holds experts
  j E/ep .. (j+1) E/ep - 1. Each rank sorts its kept pairs by expert, exchanges the per-expert counts
  with one ``all_to_all_single``, sends the pairs' hidden vectors to the experts' ranks with another
  (dispatch), runs its experts on what it received and sends the results back (combine); the
  autograd function runs the reverse all-to-all in backward. Every local expert runs even on zero
  tokens, so that every rank has a gradient for every one of its parameters.
- :data:`A2A_BYTES` counts the hidden-vector bytes this process *sends to other ranks* in each kind of
  all-to-all (the counts exchange is not included): "dispatch_fwd" = (this rank's kept pairs whose
  expert lives on another rank) x h x element bytes; "combine_fwd" = the pairs it received from other
  ranks, sent back; "combine_bwd" = dispatch_fwd and "dispatch_bwd" = combine_fwd (the backward
  reverses each exchange). Summed over an EP group, dispatch and combine are equal.
- Tensor parallelism: experts are not tensor-parallel. With tp > 1 the MoE runs replicated on every
  tp rank over the tokens that rank holds (the full sequence; its sequence shard under sequence
  parallelism, where the router's and experts' parameters are marked ``sequence_parallel`` so that
  their gradients are summed over tp).

Initialisation: every weight from (seed, parameter name), as ``autoconf.trainer.layers``; an expert's name holds
its global index (``blocks.<i>.moe.experts.<j>.fc1.weight``), so it is identical whatever ep.
Routed experts' parameters carry ``param.expert_parallel = True`` (reduced over the expert-data-
parallel group by the trainer when ep > 1).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autoconf.specs.model import ModelSpec
from autoconf.trainer.tensor_parallel import INIT_STD, ColumnLinear, RowLinear, _mark_sequence_parallel, _param, _randn

A2A_KINDS = ("dispatch_fwd", "combine_fwd", "dispatch_bwd", "combine_bwd")
A2A_BYTES = dict.fromkeys(A2A_KINDS, 0)
"""Bytes of hidden vectors this process sent to other ranks, per kind of all-to-all (see the module doc)."""
RECORD: list | None = None
"""Tests: set to a list to collect (layer key, top-k expert indices [tokens, k], kept mask) per forward."""


def reset_a2a_bytes() -> None:
    for k in A2A_KINDS:
        A2A_BYTES[k] = 0


def route(logits: torch.Tensor, k: int, router: str, groups: int = 0,
          group_topk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert indices [n, k] and their weights [n, k] (fp32, renormalised over the top k) from
    the router logits [n, E]; with ``groups``, only inside each token's ``group_topk`` best groups
    of E / groups consecutive experts. A softmax router chooses on the logits (Megatron-LM without
    --moe-router-pre-softmax: the same experts without groups, and its groups by their logits),
    a sigmoid router on its scores."""
    logits = logits.float()
    scores = F.softmax(logits, dim=-1) if router == "softmax" else torch.sigmoid(logits)
    choice = logits if router == "softmax" else scores
    if groups > 1:
        n = scores.shape[0]
        per_group = choice.view(n, groups, -1)
        group_score = per_group.topk(k // group_topk, dim=-1)[0].sum(dim=-1)  # [n, groups]
        best = group_score.topk(group_topk, dim=-1)[1]
        allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~allowed.unsqueeze(-1).expand_as(per_group).reshape(n, -1), float("-inf"))
    idx = choice.topk(k, dim=-1)[1]
    w = scores.gather(1, idx)
    return idx, w / w.sum(dim=-1, keepdim=True)


def capacity(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Most (token, expert) pairs one expert takes from ``tokens`` tokens."""
    return math.ceil(factor * tokens * k / num_experts)


def keep_mask(idx: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """[n, k] bool: the pairs each expert keeps, the first ``cap`` in token-major order."""
    flat = idx.reshape(-1)
    seen = F.one_hot(flat, num_experts).cumsum(0).gather(1, flat[:, None]).squeeze(1)  # 1-based arrival
    return (seen <= cap).view_as(idx)


def _activate(model: ModelSpec, y):
    if model.gated_mlp:
        gate, up = y.chunk(2, dim=-1)
        return (F.silu(gate) if model.activation == "swiglu" else F.gelu(gate, approximate="tanh")) * up
    return F.gelu(y, approximate="tanh")


class Expert(nn.Module):
    """One expert: the dense MLP's shape at inner width ``width``, whole (not tensor-parallel)."""

    def __init__(self, model: ModelSpec, width: int, key: str, seed: int, dtype, device):
        super().__init__()
        h = model.hidden_size
        self.model = model
        lin = dict(seed=seed, tp=1, group=None, sp=False, dtype=dtype, device=device)
        self.fc1 = ColumnLinear(h, [width, width] if model.gated_mlp else [width], model.bias, key + ".fc1", **lin)
        self.fc2 = RowLinear(width, h, model.bias, key + ".fc2", std=INIT_STD / math.sqrt(2 * model.num_layers),
                             **lin)

    def forward(self, x):
        return self.fc2(_activate(self.model, self.fc1(x)))


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, kind: str) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    row = math.prod(x.shape[1:]) * x.element_size()
    A2A_BYTES[kind] += (sum(in_splits) - in_splits[dist.get_rank(group)]) * row
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single sending ``in_splits[d]`` rows to rank d and receiving ``out_splits[s]`` from
    rank s; backward sends the gradients back with the splits swapped. ``kind``: "dispatch"/"combine"."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, kind):
        ctx.splits, ctx.group, ctx.kind = (out_splits, in_splits), group, kind
        return _a2a(x, out_splits, in_splits, group, kind + "_fwd")

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _a2a(grad, in_splits, out_splits, ctx.group, ctx.kind + "_bwd"), None, None, None, None


class MoE(nn.Module):
    """The mixture-of-experts MLP: [b, s, h] -> [b, s, h] (see the module doc)."""

    def __init__(self, model: ModelSpec, key: str, seed: int = 0, dtype=torch.float32, device=None,
                 ep_size: int = 1, ep_group=None, capacity_factor: float | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        e = model.num_experts
        if ep_size < 1 or e % ep_size:
            raise ValueError(f"ep_size={ep_size} does not divide num_experts={e}")
        if ep_size > 1 and (ep_group is None or dist.get_world_size(ep_group) != ep_size):
            raise ValueError(f"ep_size={ep_size} needs its ep_group of {ep_size} ranks")
        self.model, self.key, self.ep, self.group, self.cf = model, key, ep_size, ep_group, capacity_factor
        self.local = e // ep_size
        first = (dist.get_rank(ep_group) if ep_size > 1 else 0) * self.local
        self.router = _param(_randn((e, model.hidden_size), INIT_STD, key + ".router", seed, device), dtype)
        self.experts = nn.ModuleDict({str(j): Expert(model, model.expert_ffn, f"{key}.experts.{j}", seed, dtype, device)
                                      for j in range(first, first + self.local)})
        self.shared = nn.ModuleList([Expert(model, model.shared_expert_ffn, f"{key}.shared.{j}", seed, dtype, device)
                                     for j in range(model.num_shared_experts)])
        for p in self.experts.parameters():
            p.expert_parallel = True
        if sequence_parallel:  # each tp rank routes its own sequence shard: partial gradients
            _mark_sequence_parallel(*self.parameters())

    def forward(self, x):
        m = self.model
        e, k = m.num_experts, m.experts_per_token
        t = x.reshape(-1, x.shape[-1])
        n = t.shape[0]
        idx, w = route(F.linear(t.float(), self.router.float()), k, m.router, m.router_groups, m.router_group_topk)
        tok = torch.arange(n, device=t.device).repeat_interleave(k)
        ex, wt = idx.reshape(-1), w.reshape(-1)
        keep = None
        if self.cf is not None:
            keep = keep_mask(idx, e, capacity(n, k, e, self.cf))
            flat = keep.reshape(-1)
            tok, ex, wt = tok[flat], ex[flat], wt[flat]
        if RECORD is not None:
            RECORD.append((self.key, idx.detach().clone(), None if keep is None else keep.clone()))
        order = torch.argsort(ex, stable=True)
        tok, ex, wt = tok[order], ex[order], wt[order]
        counts = torch.bincount(ex, minlength=e)
        ys = self._run_experts(t[tok], counts)
        out = torch.zeros_like(t).index_add(0, tok, (ys.float() * wt[:, None]).to(t.dtype))
        for shared in self.shared:
            out = out + shared(t)
        return out.view_as(x)

    def _run_local(self, xs, counts: list[int]):
        """Rows grouped by local expert (``counts`` per expert, in order) through their experts."""
        parts = xs.split(counts)
        return torch.cat([expert(p) for expert, p in zip(self.experts.values(), parts)])

    def _run_experts(self, xs, counts):
        """xs [A, h]: the kept pairs' inputs sorted by expert, ``counts`` [E] per expert -> outputs."""
        if self.ep == 1:
            return self._run_local(xs, counts.tolist())
        ep, el = self.ep, self.local
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts.contiguous(), group=self.group)  # [source, local expert]
        send_splits = counts.view(ep, el).sum(1).tolist()
        recv_by = recv.view(ep, el)
        recv_splits = recv_by.sum(1).tolist()
        xr = _AllToAll.apply(xs, recv_splits, send_splits, self.group, "dispatch")
        local_expert = torch.arange(el, device=xs.device).repeat(ep).repeat_interleave(recv.to(xs.device))
        order = torch.argsort(local_expert, stable=True)
        yr = self._run_local(xr[order], recv_by.sum(0).tolist())[torch.argsort(order)]
        return _AllToAll.apply(yr, send_splits, recv_splits, self.group, "combine")
