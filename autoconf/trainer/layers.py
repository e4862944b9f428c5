"""The project's GPT-style transformer, built from a ModelSpec, with hand-written Megatron tensor parallelism.

Imported only by the profiler and the trainer (``import autoconf`` never imports this module, it
imports torch). Layout of activations everywhere: ``[batch, sequence, hidden]``.

Tensor parallelism (Shoeybi et al., arXiv 1909.08053): column-parallel fused qkv and fc1 (gate_up
for the gated SwiGLU / GeGLU), row-parallel attention output projection and fc2, with the autograd
functions f (identity forward, all-reduce backward) and g (all-reduce forward, identity backward)
over the TP group. Sequence parallelism (Korthikanti et al., arXiv 2205.05198): between blocks the hidden
states are sharded along the sequence, ``[b, s/tp, h]``; a column-parallel linear all-gathers the
sequence first and saves only its *sharded* input for backward (re-gathering it there), a
row-parallel linear reduce-scatters its output along the sequence; norms and dropouts run on shards.
The replicated parameters that then see only a sequence shard (norms, row-parallel biases, learned
positions) carry ``param.sequence_parallel = True``: call ``allreduce_sequence_parallel_grads(module,
tp_group)`` after backward, as Megatron-LM does.

Dropout (p = model.dropout, skipped when 0): on attention probabilities (eager attention only; the
fused SDPA path has none) and after the attention projection and the MLP. Parameters are created in
``dtype``; the loss is computed in fp32.

Local-width mode (the profiler's): ``tp_size > 1`` with ``tp_group=None`` builds rank 0's shard at
its local width and skips every collective (an all-gather becomes a repeat of the local shard, a
reduce-scatter takes the first chunk), so compute and saved activations are those of one TP rank.

Context parallelism (``cp_size > 1`` with its ``cp_group``): each cp rank holds s/cp tokens of every
sequence, chunks i and 2cp-1-i of 2 x cp (``ring_attention.split_load_balanced``); attention is
:func:`ring_attention.ring_attention` over the group, rope and learned positions are taken at the
rank's global positions, everything else works on the local tokens (under sequence parallelism, the
shards are of the local s/cp tokens). Attention-probability dropout is refused with cp > 1.

Initialisation is deterministic from ``seed`` and identical for every tp: each full weight is drawn
from a generator seeded by (seed, parameter name), and the rank's shard is sliced from it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from autoconf.specs.model import ModelSpec
from autoconf.trainer.ring_attention import load_balanced_indices, ring_attention
from autoconf.trainer.tensor_parallel import (
    INIT_STD,
    ColumnLinear,
    RowLinear,
    _CopyToTP,
    _GatherLinear,
    _mark_sequence_parallel,
    _param,
    _randn,
    _rank,
    _ReduceFromTP,
    _ReduceScatterSeq,
)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NORM_EPS = 1e-5
RECOMPUTE = ("none", "selective", "full")


# -- collectives (group None: local-width emulation of rank 0, no communication) ---------------------


# -- deterministic initialisation ----------------------------------------------------------------------


# -- norms --------------------------------------------------------------------------------------------

class RMSNormFn(torch.autograd.Function):
    """Fused-style RMSNorm: saves its input and the fp32 1/rms per token (as Apex / TE kernels do)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x32 * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(rstd.dtype) * rstd
        g = grad.to(rstd.dtype)
        grad_w = (g * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        gx = g * weight.to(rstd.dtype)
        grad_x = rstd * (gx - xhat * (gx * xhat).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None


class Norm(nn.Module):
    """LayerNorm (weight and bias, F.layer_norm) or RMSNorm (weight only), as ModelSpec.norm says."""

    def __init__(self, model: ModelSpec, dtype, device=None, sequence_parallel: bool = False):
        super().__init__()
        h = model.hidden_size
        self.kind = model.norm
        self.weight = _param(torch.ones(h, device=device), dtype)
        self.bias = _param(torch.zeros(h, device=device), dtype) if model.norm == "layernorm" else None
        if sequence_parallel:
            _mark_sequence_parallel(self.weight, self.bias)

    def forward(self, x):
        if self.kind == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, NORM_EPS)
        return RMSNormFn.apply(x, self.weight, NORM_EPS)


# -- the transformer block ----------------------------------------------------------------------------

def _check_tp(model: ModelSpec, tp: int, group, sp: bool) -> None:
    if group is not None and dist.get_world_size(group) != tp:
        raise ValueError(f"tp_size={tp} but the tp_group has {dist.get_world_size(group)} ranks")
    for name, v in (("num_attention_heads", model.num_attention_heads), ("num_kv_heads", model.num_kv_heads),
                    ("ffn_hidden_size", model.ffn_hidden_size)):
        if v % tp:
            raise ValueError(f"tp_size={tp} does not divide {name}={v}")
    if sp and model.seq_length % tp:
        raise ValueError(f"sequence_parallel: tp_size={tp} does not divide seq_length={model.seq_length}")


def _check_cp(model: ModelSpec, cp: int, group, tp: int, sp: bool) -> None:
    if cp == 1:
        return
    if model.dropout > 0 and model.attention == "eager":
        raise ValueError(f"context parallelism (cp={cp}) does not support attention dropout "
                         f"(dropout={model.dropout} with eager attention): set dropout to 0")
    if group is None:
        raise ValueError(f"cp_size={cp} needs its cp_group (ring attention has no local emulation)")
    if dist.get_world_size(group) != cp:
        raise ValueError(f"cp_size={cp} but the cp_group has {dist.get_world_size(group)} ranks")
    if model.seq_length % (2 * cp):
        raise ValueError(f"cp({cp}): seq_length({model.seq_length}) must be divisible by 2 x cp = {2 * cp}")
    if sp and (model.seq_length // cp) % tp:
        raise ValueError(f"sequence_parallel: tp_size={tp} does not divide seq_length / cp = "
                         f"{model.seq_length // cp}")


def cp_positions(model: ModelSpec, cp: int, group, device=None):
    """Global positions of this cp rank's tokens (None when cp = 1)."""
    if cp == 1:
        return None
    return load_balanced_indices(model.seq_length, cp, _rank(group)).to(device)


def rope_tables(model: ModelSpec, dtype, device):
    d = model.rotary_dim
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(model.seq_length, device=device, dtype=torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rope(x, cos, sin):
    """Rotary embedding on [b, s, heads, d] (rotate-half convention, as Llama and GPT-NeoX): the first
    r = cos.shape[-1] dimensions of each head rotate, the others (partial rotary) pass through."""
    s, r = x.shape[1], cos.shape[-1]
    cos, sin = cos[:s, None, :].to(x.dtype), sin[:s, None, :].to(x.dtype)
    rot = x[..., :r] if r < x.shape[-1] else x
    x1, x2 = rot.chunk(2, dim=-1)
    out = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([out, x[..., r:]], dim=-1) if r < x.shape[-1] else out


class Block(nn.Module):
    """Pre-norm transformer block: x + drop(attn(norm1(x))), then x + drop(mlp(norm2(x))); with
    ``model.parallel_attention`` x + drop(attn(norm1(x))) + drop(mlp(norm2(x))), one norm for both
    with ``model.shared_norm``. Q is num_attention_heads x head_size wide (``model.q_size``).

    Input and output: [b, s, h], or [b, s/tp, h] under sequence parallelism (s/cp instead of s under
    context parallelism). ``recompute``: "full" checkpoints the whole block, "selective" only the
    attention core (QK^T, softmax, dropout, AV, or the fused SDPA call; not under cp > 1, whose ring
    attention keeps only q, k, v, output and log-sum-exp anyway). ``layer_index`` and ``seed`` pick
    the deterministic initial weights; ``cp_size`` / ``cp_group``: context parallelism.
    ``fp8_recipe``: None, or the FP8 recipe of the four linear layers' GEMMs (``autoconf.trainer.fp8``); the
    attention core and the norms stay in ``dtype``.
    Where ``model.is_moe_layer(layer_index)`` the MLP is ``autoconf.trainer.moe.MoE`` (its experts in ``dtype``,
    not tensor-parallel): ``ep_size`` / ``ep_group`` split the routed experts (expert parallelism),
    ``moe_capacity_factor`` drops (token, expert) pairs beyond each expert's capacity (None: dropless).
    """

    def __init__(self, model: ModelSpec, tp_size: int = 1, tp_group=None, sequence_parallel: bool = False,
                 recompute: str = "none", dtype=torch.float32, layer_index: int = 0, seed: int = 0,
                 device=None, cp_size: int = 1, cp_group=None, fp8_recipe: str | None = None,
                 ep_size: int = 1, ep_group=None, moe_capacity_factor: float | None = None):
        super().__init__()
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute={recompute!r}; valid: {', '.join(RECOMPUTE)}")
        _check_tp(model, tp_size, tp_group, sequence_parallel)
        _check_cp(model, cp_size, cp_group, tp_size, bool(sequence_parallel) and tp_size > 1)
        self.cp, self.cp_group = cp_size, cp_group
        self.model, self.tp, self.group, self.recompute = model, tp_size, tp_group, recompute
        self.sp = bool(sequence_parallel) and tp_size > 1
        self.p = model.dropout
        h, q, kv, f = model.hidden_size, model.q_size, model.kv_size, model.ffn_hidden_size
        self.n_heads, self.n_kv = model.num_attention_heads // tp_size, model.num_kv_heads // tp_size
        key = f"blocks.{layer_index}"
        out_std = INIT_STD / math.sqrt(2 * model.num_layers)
        lin = dict(seed=seed, tp=tp_size, group=tp_group, sp=self.sp, dtype=dtype, device=device, fp8=fp8_recipe)
        self.norm1 = Norm(model, dtype, device, self.sp)
        self.qkv = ColumnLinear(h, [q, kv, kv], model.bias or model.qkv_bias, key + ".qkv", **lin)
        self.proj = RowLinear(q, h, model.bias, key + ".proj", std=out_std, **lin)
        self.norm2 = None if model.shared_norm else Norm(model, dtype, device, self.sp)
        self.moe = None
        if model.is_moe_layer(layer_index):  # experts replace fc1 / fc2 (autoconf.trainer.moe)
            from autoconf.trainer.moe import MoE

            self.moe = MoE(model, key + ".moe", seed, dtype, device, ep_size, ep_group, moe_capacity_factor,
                           self.sp)
        else:
            fc1_sections = [f, f] if model.gated_mlp else [f]
            self.fc1 = ColumnLinear(h, fc1_sections, model.bias, key + ".fc1", **lin)
            self.fc2 = RowLinear(f, h, model.bias, key + ".fc2", std=out_std, **lin)
        if model.position_embedding == "rope":
            cos, sin = rope_tables(model, dtype, device)
            pos = cp_positions(model, cp_size, cp_group, device)
            if pos is not None:  # the rows of this cp rank's tokens, in their local order
                cos, sin = cos[pos], sin[pos]
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def _dropout(self, x):
        return F.dropout(x, self.p, self.training) if self.p > 0 else x

    def attention_core(self, q, k, v):
        """softmax(q k^T / sqrt(d), causal) v on [b, heads, s, d]; k, v may have fewer (GQA) heads."""
        if self.model.attention == "flash":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        b, _, s, d = q.shape
        if self.n_kv != self.n_heads:
            g = self.n_heads // self.n_kv
            k = k[:, :, None].expand(b, self.n_kv, g, s, d).reshape(b, self.n_heads, s, d)
            v = v[:, :, None].expand(b, self.n_kv, g, s, d).reshape(b, self.n_heads, s, d)
        # explicit [b, heads, s, d] copies, so that what the matmuls keep (q, k, v at full head count,
        # as Korthikanti et al. count them) does not depend on whether a reshape happens to be a view
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        causal = torch.full((s, s), float("-inf"), dtype=scores.dtype, device=scores.device).triu(1)
        probs = self._dropout(F.softmax(scores + causal, dim=-1))
        return torch.matmul(probs, v)

    def attention(self, x):
        qkv = self.qkv(x)
        b, s, _ = qkv.shape
        d = self.model.head_size
        q, k, v = qkv.split([self.n_heads * d, self.n_kv * d, self.n_kv * d], dim=-1)
        q, k, v = q.view(b, s, self.n_heads, d), k.view(b, s, self.n_kv, d), v.view(b, s, self.n_kv, d)
        if self.model.position_embedding == "rope":
            q, k = rope(q, self.rope_cos, self.rope_sin), rope(k, self.rope_cos, self.rope_sin)
            v = v.contiguous()  # so that the qkv output itself is not kept alive through a view of v
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.cp > 1:
            o = ring_attention(q, k, v, self.cp_group)
        elif self.recompute == "selective" and torch.is_grad_enabled():
            o = checkpoint(self.attention_core, q, k, v, use_reentrant=False)
        else:
            o = self.attention_core(q, k, v)
        return self.proj(o.transpose(1, 2).reshape(b, s, self.n_heads * d))

    def mlp(self, x):
        if self.moe is not None:
            return self.moe(x)
        y = self.fc1(x)
        if self.model.gated_mlp:
            gate, up = y.chunk(2, dim=-1)
            y = (F.silu(gate) if self.model.activation == "swiglu" else F.gelu(gate, approximate="tanh")) * up
        else:
            y = F.gelu(y, approximate="tanh")
        return self.fc2(y)

    def _forward(self, x):
        if self.model.parallel_attention:
            a = self.norm1(x)
            m = a if self.norm2 is None else self.norm2(x)
            return x + self._dropout(self.attention(a)) + self._dropout(self.mlp(m))
        x = x + self._dropout(self.attention(self.norm1(x)))
        return x + self._dropout(self.mlp(self.norm2(x)))

    def forward(self, x):
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


# -- embedding, head and loss ---------------------------------------------------------------------------

def padded_vocab(model: ModelSpec, tp: int) -> int:
    """Vocabulary padded up to a multiple of tp (padding rows are zero and never produce probability)."""
    return -(-model.vocab_size // tp) * tp


def _vocab_shard(model: ModelSpec, key: str, seed: int, tp: int, group, dtype, device) -> nn.Parameter:
    v, vp, h = model.vocab_size, padded_vocab(model, tp), model.hidden_size
    full = _randn((v, h), INIT_STD, key, seed, device)
    if vp > v:
        full = torch.cat([full, torch.zeros(vp - v, h, device=full.device)])
    # clone: a chunk along dim 0 is a view, which would keep the whole table's storage alive
    return _param(full.chunk(tp, dim=0)[_rank(group)].clone(), dtype)


class Embedding(nn.Module):
    """Vocab-parallel token embedding (+ learned positions): tokens [b, s] -> hidden [b, s(/tp), h].

    Each TP rank holds rows [rank*Vp/tp, (rank+1)*Vp/tp) of the (padded) table; partial lookups are
    all-reduced, or reduce-scattered along the sequence under sequence parallelism.
    """

    WEIGHT_KEY = "embedding.weight"

    def __init__(self, model: ModelSpec, tp_size: int = 1, tp_group=None, sequence_parallel: bool = False,
                 dtype=torch.float32, seed: int = 0, device=None, cp_size: int = 1, cp_group=None):
        super().__init__()
        self.tp, self.group, self.sp = tp_size, tp_group, bool(sequence_parallel) and tp_size > 1
        self.vocab_start = _rank(tp_group) * padded_vocab(model, tp_size) // tp_size
        self.weight = _vocab_shard(model, self.WEIGHT_KEY, seed, tp_size, tp_group, dtype, device)
        self.position = None
        if model.position_embedding == "learned":
            self.position = _param(_randn((model.seq_length, model.hidden_size), INIT_STD,
                                          "embedding.position", seed, device), dtype)
            if self.sp:
                _mark_sequence_parallel(self.position)
            pos = cp_positions(model, cp_size, cp_group, device)  # this cp rank's positions, or None
            if pos is not None:
                self.register_buffer("position_index", pos, persistent=False)
        self.cp = cp_size

    def forward(self, tokens):
        if self.tp > 1:
            local = tokens - self.vocab_start
            outside = (local < 0) | (local >= self.weight.shape[0])
            x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
            x = _ReduceScatterSeq.apply(x, self.group, self.tp) if self.sp else _ReduceFromTP.apply(x, self.group)
        else:
            x = F.embedding(tokens, self.weight)
        if self.position is not None:
            s = x.shape[1]
            start = _rank(self.group) * s if self.sp else 0
            if self.cp > 1:
                x = x + self.position[self.position_index[start:start + s]]
            else:
                x = x + self.position[start:start + s]
        return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross entropy over vocab-sharded logits [b, s, Vp/tp], computed in fp32 (Megatron-LM style).

    Saves the fp32 softmax of the local shard plus the local target index and its mask.
    """

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size):
        x = logits.to(torch.float32, copy=True)
        n_local = x.shape[-1]
        valid = vocab_size - vocab_start
        if valid < n_local:  # padding columns of the last shard never get probability
            x[..., max(valid, 0):] = float("-inf")
        m = x.amax(dim=-1, keepdim=True)
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        x.sub_(m)
        local = target - vocab_start
        outside = (local < 0) | (local >= n_local)
        local = local.masked_fill(outside, 0)
        picked = torch.gather(x, -1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        x.exp_()
        sum_exp = x.sum(dim=-1)
        if group is not None:
            dist.all_reduce(picked, group=group)
            dist.all_reduce(sum_exp, group=group)
        loss = torch.log(sum_exp) - picked
        x.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(x, local, outside)
        ctx.logits_dtype = logits.dtype
        return loss.mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), (outside.to(g.dtype) - 1.0).unsqueeze(-1))
        g.mul_(grad / local.numel())
        return g.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits, target, model: ModelSpec, tp_group=None):
    """Mean cross entropy of logits [b, s, Vp/tp] (this rank's vocabulary shard) against target [b, s].

    Works for tp = 1 and in local-width mode (tp_group None: rank 0's shard, no communication). This is
    the loss_fn a pipeline schedule needs on the last stage.
    """
    start = _rank(tp_group) * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, start, model.vocab_size)


class Head(nn.Module):
    """Final norm + vocab-parallel output projection: hidden [b, s(/tp), h] -> logits [b, s, Vp/tp].

    ``forward(x, target)`` returns the mean cross entropy instead. With tied embeddings and an
    ``embedding`` given (same stage), the projection uses the embedding's weight; tied but on another
    stage, the head holds its own copy initialised identically (key "embedding.weight") and the trainer
    must keep the two in sync (sum their gradients over the first and last pipeline stage).
    """

    def __init__(self, model: ModelSpec, tp_size: int = 1, tp_group=None, sequence_parallel: bool = False,
                 dtype=torch.float32, seed: int = 0, device=None, embedding: Embedding | None = None):
        super().__init__()
        self.model, self.tp, self.group = model, tp_size, tp_group
        self.sp = bool(sequence_parallel) and tp_size > 1
        self.norm = Norm(model, dtype, device, self.sp)
        self.weight = None
        if model.tied_embeddings and embedding is not None:
            object.__setattr__(self, "_tied", embedding)  # not a submodule: no duplicate parameters
        else:
            object.__setattr__(self, "_tied", None)
            key = Embedding.WEIGHT_KEY if model.tied_embeddings else "head.weight"
            self.weight = _vocab_shard(model, key, seed, tp_size, tp_group, dtype, device)

    def forward(self, x, target=None):
        x = self.norm(x)
        w = self._tied.weight if self._tied is not None else self.weight
        if self.sp:
            logits = _GatherLinear.apply(x, w, None, self.group, self.tp)
        else:
            if self.tp > 1 and self.group is not None:
                x = _CopyToTP.apply(x, self.group)
            logits = F.linear(x, w)
        if target is None:
            return logits
        return _VocabParallelCrossEntropy.apply(logits, target, self.group, _rank(self.group) * w.shape[0],
                                                self.model.vocab_size)


# -- stages and the whole model ---------------------------------------------------------------------------

class Stage(nn.Module):
    """A pipeline stage: optional Embedding, the blocks ``layer_indices``, optional Head.

    forward(x, target=None):
      (under context parallelism s is the rank's s/cp tokens, in the load-balanced order; the loss is
      the mean over those tokens)
      x: token ids [b, s] (int64) if the stage has the embedding, else hidden states [b, s, h]
         ([b, s/tp, h], this rank's sequence chunk, under sequence parallelism);
      returns: hidden states (same layout as the input hidden states) if the stage has no head;
         with a head, this rank's vocabulary shard of the logits [b, s, Vp/tp] (Vp = vocab padded to
         a multiple of tp), or the mean cross entropy (scalar) when ``target`` [b, s] is given.
    For torch.distributed.pipelining, give the schedule the logits-returning module and
    ``loss_fn = lambda logits, y: vocab_parallel_cross_entropy(logits, y, model, tp_group)``.
    Parameter names match GPT's ("blocks.<global layer index>. ...", "embedding.weight", "head.weight").
    """

    def __init__(self, model: ModelSpec, layer_indices, has_embedding: bool, has_head: bool,
                 tp_size: int = 1, tp_group=None, sequence_parallel: bool = False, recompute: str = "none",
                 dtype=torch.float32, seed: int = 0, device=None, cp_size: int = 1, cp_group=None,
                 fp8_recipe: str | None = None, ep_size: int = 1, ep_group=None,
                 moe_capacity_factor: float | None = None):
        super().__init__()
        common = dict(tp_size=tp_size, tp_group=tp_group, sequence_parallel=sequence_parallel, dtype=dtype,
                      seed=seed, device=device)
        cp = dict(cp_size=cp_size, cp_group=cp_group)
        self.model = model
        self.layer_indices = list(layer_indices)
        self.embedding = Embedding(model, **common, **cp) if has_embedding else None
        moe = dict(ep_size=ep_size, ep_group=ep_group, moe_capacity_factor=moe_capacity_factor)
        self.blocks = nn.ModuleDict({str(i): Block(model, recompute=recompute, layer_index=i, fp8_recipe=fp8_recipe,
                                                   **common, **cp, **moe)
                                     for i in self.layer_indices})
        self.head = Head(model, embedding=self.embedding, **common) if has_head else None

    def forward(self, x, target=None):
        if self.embedding is not None:
            x = self.embedding(x)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            return self.head(x, target)
        return x


def build_stage(model: ModelSpec, layer_indices, has_embedding: bool, has_head: bool, **tp_kwargs) -> Stage:
    """A pipeline stage module; see Stage for inputs and outputs.

    tp_kwargs: tp_size, tp_group, sequence_parallel, recompute, dtype, seed, device, cp_size, cp_group,
    fp8_recipe (None, or the FP8 recipe of the blocks' linear layers; embedding and head stay in dtype),
    ep_size, ep_group, moe_capacity_factor (mixture-of-experts blocks, ``autoconf.trainer.moe``).
    """
    return Stage(model, layer_indices, has_embedding, has_head, **tp_kwargs)


class GPT(Stage):
    """The whole model (embedding, every block, head) for single-process or TP-only reference runs.

    forward(tokens [b, s], target=None) -> logits [b, s, Vp/tp] or the mean cross entropy.
    """

    def __init__(self, model: ModelSpec, **tp_kwargs):
        super().__init__(model, range(model.num_layers), True, True, **tp_kwargs)
