"""Tensor and sequence parallelism live in autoconf.trainer.layers (hand-written Megatron TP/SP); the trainer's
one extra duty is summing the gradients of sequence-parallel replicated parameters (norms,
row-parallel biases, positions) over the TP group, also after FSDP2 has sharded them over dp.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autoconf.trainer import fp8 as fp8_mm


class SequenceParallelGrads:
    """Sums the gradients of ``module``'s sequence-parallel parameters over the TP group.

    The parameter names are taken before any ``fully_shard`` (which drops the attribute that tags
    them); with FSDP2 the local shards are summed, which commutes with the data-parallel average.
    """

    def __init__(self, module, tp_group):
        self.tp_group = tp_group
        self.names = {n for n, p in module.named_parameters() if getattr(p, "sequence_parallel", False)}

    def __call__(self, module, prefix: str = "") -> None:
        import torch
        import torch.distributed as dist

        if self.tp_group is None or not self.names:
            return
        grads = []
        for n, p in module.named_parameters(prefix=prefix.rstrip(".")):
            if n in self.names and p.grad is not None:
                g = p.grad
                grads.append(g.to_local() if hasattr(g, "to_local") else g)
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.tp_group)
        for g, new in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(new.view_as(g))


INIT_STD = 0.02


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
    return x


def _gather_seq(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    """[b, s/tp, ...] -> [b, s, ...] (concatenate the ranks' sequence chunks in rank order)."""
    if tp == 1:
        return x
    if group is None:
        return torch.cat([x] * tp, dim=1)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(tp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _reduce_scatter_seq(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    """[b, s, ...] partial sums -> [b, s/tp, ...] this rank's chunk of the sum."""
    if tp == 1:
        return x
    chunks = [c.contiguous() for c in x.chunk(tp, dim=1)]
    if group is None:
        return chunks[0]
    out = torch.empty_like(chunks[0])
    try:
        dist.reduce_scatter(out, chunks, group=group)
    except (RuntimeError, NotImplementedError, ValueError):  # backends without reduce_scatter
        full = x.contiguous()
        dist.all_reduce(full, group=group)
        out = full.chunk(tp, dim=1)[_rank(group)].contiguous()
    return out


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceScatterSeq(torch.autograd.Function):
    """Sequence-parallel exit of a row-parallel linear: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, tp):
        ctx.group, ctx.tp = group, tp
        return _reduce_scatter_seq(x, group, tp)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group, ctx.tp), None, None


class _GatherLinear(torch.autograd.Function):
    """Sequence-parallel column-parallel linear: all-gather the sequence, then x @ W^T + b.

    Saves only the sequence shard of x (not the gathered input) and gathers it again in backward, as
    Megatron-LM does, so the saved bytes are those of Korthikanti et al. (arXiv 2205.05198, sec. 4.2.2).
    ``fp8``: None, or an FP8 recipe (``autoconf.trainer.fp8``) for the three GEMMs (bias in high precision).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, tp, fp8=None):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.tp, ctx.has_bias, ctx.fp8 = group, tp, bias is not None, fp8
        full = _gather_seq(x, group, tp)
        if fp8 is None:
            return F.linear(full, weight, bias)
        y = fp8_mm.forward(full.reshape(-1, full.shape[-1]), weight, fp8).view(*full.shape[:-1], weight.shape[0])
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        full = _gather_seq(x, ctx.group, ctx.tp)
        g2 = grad.reshape(-1, grad.shape[-1])
        if ctx.fp8 is None:
            grad_full = grad.matmul(weight)
            grad_w = g2.t().matmul(full.reshape(-1, full.shape[-1]))
        else:
            gx2, grad_w = fp8_mm.backward(g2, full.reshape(-1, full.shape[-1]), weight, ctx.fp8)
            grad_full = gx2.view_as(full)
        grad_x = _reduce_scatter_seq(grad_full, ctx.group, ctx.tp)
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None, None


def _mark_sequence_parallel(*params) -> None:
    """Tag replicated parameters that see only a sequence shard under SP: their grads are partial sums."""
    for p in params:
        if p is not None:
            p.sequence_parallel = True


def sequence_parallel_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters whose gradients must be summed over the TP group under sequence parallelism."""
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]


def allreduce_sequence_parallel_grads(module: nn.Module, tp_group) -> None:
    """Sum the gradients of norms, row-parallel biases and positions over the TP group (SP only).

    Call after backward and before the optimizer step (and before any data-parallel reduction),
    as Megatron-LM does; a no-op for modules built without sequence parallelism.
    """
    grads = [p.grad for p in sequence_parallel_params(module) if p.grad is not None]
    if grads and tp_group is not None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=tp_group)
        for g, new in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(new.view_as(g))


def _randn(shape, std: float, key: str, seed: int, device) -> torch.Tensor:
    """A full (unsharded) weight drawn from a generator seeded by (seed, key): identical for every tp."""
    gen = torch.Generator(device=device or "cpu")
    gen.manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
    return torch.randn(shape, generator=gen, device=device) * std


def shard(full: torch.Tensor, sections: list[int], dim: int, rank: int, tp: int) -> torch.Tensor:
    """Rank's slice of a fused weight: each section (e.g. q, k, v) is split into tp chunks along dim."""
    parts = torch.split(full, sections, dim=dim)
    return torch.cat([p.chunk(tp, dim=dim)[rank] for p in parts], dim=dim).contiguous()


def _param(t: torch.Tensor, dtype) -> nn.Parameter:
    return nn.Parameter(t.to(dtype))


class ColumnLinear(nn.Module):
    """y = x W^T + b with W split by output rows over TP (fused sections split separately).

    ``fp8``: None (GEMMs in the parameters' dtype) or an FP8 recipe (``autoconf.trainer.fp8.RECIPES``).
    """

    def __init__(self, in_f, sections, bias, key, seed, tp, group, sp, dtype, device, std=INIT_STD, fp8=None):
        super().__init__()
        self.tp, self.group, self.sp = tp, group, sp
        self.fp8 = None if fp8 is None else fp8_mm.check_recipe(fp8)
        rank = _rank(group)
        full = _randn((sum(sections), in_f), std, key + ".weight", seed, device)
        self.weight = _param(shard(full, sections, 0, rank, tp), dtype)
        out_local = sum(sections) // tp
        self.bias = _param(torch.zeros(out_local, device=device), dtype) if bias else None

    def forward(self, x):
        if self.sp:
            return _GatherLinear.apply(x, self.weight, self.bias, self.group, self.tp, self.fp8)
        if self.tp > 1 and self.group is not None:
            x = _CopyToTP.apply(x, self.group)
        if self.fp8 is not None:
            return fp8_mm.linear(x, self.weight, self.bias, self.fp8)
        return F.linear(x, self.weight, self.bias)


class RowLinear(nn.Module):
    """y = x W^T + b with W split by input columns over TP; partial sums reduced (or reduce-scattered).

    ``fp8``: None or an FP8 recipe, as ColumnLinear; the bias is added after the reduction, in high precision.
    """

    def __init__(self, in_f, out_f, bias, key, seed, tp, group, sp, dtype, device, std=INIT_STD, fp8=None):
        super().__init__()
        self.tp, self.group, self.sp = tp, group, sp
        self.fp8 = None if fp8 is None else fp8_mm.check_recipe(fp8)
        full = _randn((out_f, in_f), std, key + ".weight", seed, device)
        self.weight = _param(shard(full, [in_f], 1, _rank(group), tp), dtype)
        self.bias = _param(torch.zeros(out_f, device=device), dtype) if bias else None
        if sp:
            _mark_sequence_parallel(self.bias)

    def forward(self, x):
        y = F.linear(x, self.weight) if self.fp8 is None else fp8_mm.linear(x, self.weight, None, self.fp8)
        if self.sp:
            y = _ReduceScatterSeq.apply(y, self.group, self.tp)
        elif self.tp > 1 and self.group is not None:
            y = _ReduceFromTP.apply(y, self.group)
        return y + self.bias if self.bias is not None else y
