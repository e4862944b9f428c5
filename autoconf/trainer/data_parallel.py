"""Data parallelism with ZeRO stages 0-3.

- ZeRO-0/1/2 are hand-written over the data-parallel process group (DDP cannot be combined with
  ``torch.distributed.pipelining`` on gloo, see TESTBED.md):
  * :class:`GradSync` averages gradients bucket by bucket (one bucket per layer or stage), each
    bucket launched asynchronously as soon as its gradients are final; ZeRO-0/1 all-reduce, ZeRO-2
    reduces each parameter's gradient to the rank that owns its optimizer state and drops it
    elsewhere.
  * :class:`ShardedAdamW` (ZeRO-1/2) keeps AdamW state only for the parameters a rank owns
    (greedy partition by size, as ``ZeroRedundancyOptimizer``) and broadcasts updated parameters
    from their owners.
- ZeRO-3 is FSDP2 (:func:`apply_fsdp`): ``fully_shard`` on every unit (embedding, block, head)
  and on the stage container, over a 1-D mesh made from the data-parallel group.
"""

from __future__ import annotations


def partition(sizes: list[int], n: int) -> list[int]:
    """Owner (0..n-1) of each item: largest first onto the least-loaded owner (deterministic)."""
    load = [0] * n
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        o = min(range(n), key=lambda k: (load[k], k))
        owner[i] = o
        load[o] += sizes[i]
    return owner


class GradSync:
    """Averages gradients over the data-parallel group, one asynchronous bucket at a time."""

    def __init__(self, params, zero_stage: int, group, group_ranks: list[int], my_index: int):
        self.zero_stage = zero_stage
        self.group = group
        self.ranks = group_ranks
        self.me = my_index
        self.params = list(params)
        self.owner = {id(p): o for p, o in zip(self.params, partition([p.numel() for p in self.params], len(group_ranks)))}
        self.pending = []

    @property
    def size(self) -> int:
        return len(self.ranks)

    def launch(self, params) -> None:
        """Start reducing these parameters' gradients (they must be final)."""
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors

        if self.size == 1:
            return
        with_grad = [p for p in params if p.grad is not None]
        if not with_grad:
            return
        if self.zero_stage < 2:
            flat = _flatten_dense_tensors([p.grad for p in with_grad])
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self.pending.append((work, flat, with_grad, None))
            return
        for o in range(self.size):
            mine = [p for p in with_grad if self.owner[id(p)] == o]
            if mine:
                flat = _flatten_dense_tensors([p.grad for p in mine])
                work = dist.reduce(flat, dst=self.ranks[o], group=self.group, async_op=True)
                self.pending.append((work, flat, mine, o))

    def finish(self) -> None:
        """Wait for every launched bucket and write the averaged gradients back (ZeRO-2: only on
        the owner; other ranks drop theirs)."""
        from torch._utils import _unflatten_dense_tensors

        for work, flat, params, owner in self.pending:
            work.wait()
            if owner is not None and owner != self.me:
                for p in params:
                    p.grad = None
                continue
            flat.div_(self.size)
            for p, g in zip(params, _unflatten_dense_tensors(flat, [p.grad for p in params])):
                p.grad.copy_(g)
        self.pending = []


class ShardedAdamW:
    """AdamW whose state lives only on the owner of each parameter (ZeRO-1/2)."""

    def __init__(self, params, group, group_ranks: list[int], my_index: int, owner: dict, **adamw):
        import torch

        self.params = list(params)
        self.group = group
        self.ranks = group_ranks
        self.me = my_index
        self.owner = owner
        local = [p for p in self.params if owner[id(p)] == my_index]
        self.local = torch.optim.AdamW(local, **adamw) if local else None

    def step(self) -> None:
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        if self.local is not None:
            self.local.step()
        for o in range(len(self.ranks)):
            owned = [p for p in self.params if self.owner[id(p)] == o]
            if not owned:
                continue
            flat = _flatten_dense_tensors([p.detach() for p in owned])
            dist.broadcast(flat, src=self.ranks[o], group=self.group)
            if o != self.me:
                for p, v in zip(owned, _unflatten_dense_tensors(flat, owned)):
                    p.data.copy_(v)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def tracked(self):
        """The torch optimizer holding this rank's state (for memory tracking), or None."""
        return self.local


def apply_fsdp(units, container, dp_group, device_type: str):
    """ZeRO-3: shard every unit, then the container (the pipeline stage or the whole model)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(dp_group, device_type, mesh_dim_names=("dp",))
    for unit in units:
        fully_shard(unit, mesh=mesh)
    if container is not None:
        fully_shard(container, mesh=mesh)
    return mesh
