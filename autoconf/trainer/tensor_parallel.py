"""Tensor and sequence parallelism live in autoconf.nn (hand-written Megatron TP/SP); the trainer's
one extra duty is summing the gradients of sequence-parallel replicated parameters (norms,
row-parallel biases, positions) over the TP group, also after FSDP2 has sharded them over dp.
"""

from __future__ import annotations


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
