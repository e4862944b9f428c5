"""Data parallelism with ZeRO stages 0-3.

- ZeRO-0/1/2 are hand-written over the data-parallel process group (DDP cannot be combined with
  ``torch.distributed.pipelining`` on gloo: the reducer asserts, and with ``static_graph=True`` the
  gradients come out wrong):
  * :class:`GradSync` averages gradients bucket by bucket (one bucket per unit: embedding, block,
    head), each launched asynchronously. ZeRO-0/1 all-reduce each bucket once its gradients are
    final (after the last micro-batch). ZeRO-2 reduces each parameter's gradient to the rank that
    owns its optimizer state:
      - standard accumulation (:meth:`GradSync.reduce_every_backward`): after *every* micro-batch's
        backward, bucket by bucket as ``register_post_accumulate_grad_hook`` sees a bucket's
        gradients complete; the bucket is flattened, ``p.grad`` is dropped on every rank and the
        owner adds the reduced values into a persistent accumulator for the parameters it owns.
        So a rank holds 1/dp of the gradients plus one bucket in flight (DeepSpeed ZeRO-2);
      - layered accumulation (and gradients synced separately, such as tied embeddings across
        pipeline stages): once, when the gradients are final, as ZeRO-0/1; other ranks drop theirs.
  * :class:`ShardedAdamW` (ZeRO-1/2) keeps AdamW state only for the parameters a rank owns
    (greedy partition by size, as ``ZeroRedundancyOptimizer``) and broadcasts updated parameters
    from their owners.
  * the all-reduce of ZeRO-0/1 is the process group's flat ``all_reduce`` (gloo: a ring), or with
    ``dp_all_reduce="hierarchical"`` the two-level one of :mod:`.collectives` (reduce-scatter inside
    each host, all-reduce across hosts, all-gather inside each host), which runs on a worker thread
    from the launch to the point where the flat one's work would be waited on, so it overlaps the
    rest of the backward as the flat one does on gloo's own threads. ZeRO-2's reduce to the owners
    stays a flat ``reduce``.
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

    def __init__(self, params, zero_stage: int, group, group_ranks: list[int], my_index: int, all_reduce=None,
                 divisor: int | None = None, powersgd=None):
        self.zero_stage = zero_stage
        self.divisor = divisor or len(group_ranks)
        """What the summed gradients are divided by: the group's size, or (expert parameters, reduced
        over the expert-data-parallel group) the dp x cp ranks whose losses they carry."""
        self.all_reduce = all_reduce
        """ZeRO-0/1's all-reduce: a ``collectives.HierarchicalAllReduce`` (config ``dp_all_reduce``
        hierarchical), or None for the process group's flat ``all_reduce``."""
        self.group = group
        self.ranks = group_ranks
        self.me = my_index
        self.params = list(params)
        self.owner = {id(p): o for p, o in zip(self.params, partition([p.numel() for p in self.params], len(group_ranks)))}
        self.pending = []  # launch(): (work, flat, params, owner or None)
        # reduce_every_backward() state
        self.buckets: list[list] = []
        self.bucket_of: dict[int, int] = {}
        self.fired: list[int] = []  # parameters of each bucket whose gradient this backward produced
        self.complete = None  # a bucket whose last gradient just arrived, launched at the next hook
        self.callback_queued = False
        self.in_flight = []  # (work, flat, params, owner)
        self.acc: dict[int, object] = {}  # id(p) -> summed reduced gradient (owned parameters only)
        self.grad_scale = 1
        self.payload_bytes = 0
        """Bytes handed to this sync's collectives since the last :meth:`take_payload` (the flat
        all-reduce / reduce buffers; under PowerSGD its exact part + Ps + Qs)."""
        self.powersgd = powersgd
        """torch's ``PowerSGDState`` (``compression.powersgd_state``) when ZeRO-0/1's all-reduce is
        compressed (config ``dp_compression_stages``), else None."""
        self._bucket_ids: dict = {}  # PowerSGD bucket index: the launch's parameters, stable over steps
        self._launched = False

    @property
    def size(self) -> int:
        return len(self.ranks)

    def launch(self, params, exact: bool = False) -> None:
        """Start reducing these parameters' gradients (they must be final); ``exact``: never through
        PowerSGD (tied embeddings: their copies on the first and last stage must stay equal)."""
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors

        with_grad = [p for p in params if p.grad is not None]
        if self.size == 1:
            if self.divisor != 1:
                for p in with_grad:
                    p.grad.div_(self.divisor)
            return
        if not with_grad:
            return
        # at most one launch in flight (as the per-backward path): the previous one lands first and
        # its flat copy goes, instead of every unit's copy of its gradients living to the end of
        # the step (layered accumulation launches once per unit)
        self._land_pending()
        if self.zero_stage < 2:
            flat = _flatten_dense_tensors([p.grad for p in with_grad])
            if self.powersgd is not None and not exact:
                self.pending.append((self._powersgd_launch(flat, with_grad), flat, with_grad, None))
                return
            self.payload_bytes += flat.numel() * flat.element_size()
            if self.all_reduce is not None:  # on a worker thread, as the flat one runs on gloo's
                work = self.all_reduce.start(flat)
            else:
                work = dist.all_reduce(flat, group=self.group, async_op=True)
            self.pending.append((work, flat, with_grad, None))
            return
        self.pending += self._reduce_to_owners(with_grad, drop=False)

    def _reduce_to_owners(self, params, drop: bool) -> list:
        """Launch one reduce per owner of its share of these gradients; ``drop``: set each
        ``p.grad`` to None as soon as it is flattened (the flat copy holds it)."""
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors

        out = []
        for o in range(self.size):
            mine = [p for p in params if self.owner[id(p)] == o]
            if mine:
                flat = _flatten_dense_tensors([p.grad for p in mine])
                self.payload_bytes += flat.numel() * flat.element_size()
                if drop:
                    for p in mine:
                        p.grad = None
                out.append((dist.reduce(flat, dst=self.ranks[o], group=self.group, async_op=True), flat, mine, o))
        return out

    def _powersgd_launch(self, flat, params):
        """torch's ``powerSGD_hook`` on this bucket (:class:`compression.PowerSGDBucket`); a work
        whose wait leaves the averaged gradients in ``flat``. Counts the payload as the hook sends it:
        the whole buffer in its plain steps, else its exact part + Ps + Qs (the elements the hook
        adds to ``total_numel_after_compression``)."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

        from autoconf.trainer.compression import PowerSGDBucket

        state = self.powersgd
        index = self._bucket_ids.setdefault(tuple(id(p) for p in params), len(self._bucket_ids))
        plain = state.iter < state.start_powerSGD_iter
        before = state.total_numel_after_compression
        fut = powerSGD_hook(state, PowerSGDBucket(index, flat, params))
        elements = flat.numel() if plain else state.total_numel_after_compression - before
        self.payload_bytes += elements * flat.element_size()
        self._launched = True
        return _Averaged(fut)

    def take_payload(self) -> int:
        """The payload bytes counted since the last call (reset)."""
        out, self.payload_bytes = self.payload_bytes, 0
        return out

    def reduce_every_backward(self, buckets, grad_scale: int = 1) -> bool:
        """ZeRO-2 with standard accumulation: reduce every bucket (a list of parameters) to its
        owners after each backward, so gradients never accumulate in full. ``grad_scale`` divides
        the result besides dp (the pipeline schedules scale ``p.grad`` by 1/m only after the last
        micro-batch, when these gradients are already gone). Returns whether it is in use (ZeRO-2
        with dp > 1); then :meth:`finish` leaves averaged gradients on the owners only.

        Every rank of the group builds the same buckets and runs the same backward, so the hooks
        launch the same reduces in the same order everywhere."""
        if self.zero_stage != 2 or self.size == 1:
            return False
        self.grad_scale = grad_scale
        for bucket in buckets:
            bucket = [p for p in bucket if id(p) not in self.bucket_of]  # a parameter in one bucket only
            for p in bucket:
                self.bucket_of[id(p)] = len(self.buckets)
                p.register_post_accumulate_grad_hook(self._on_grad)
            if bucket:
                self.buckets.append(bucket)
        self.fired = [0] * len(self.buckets)
        return True

    def _on_grad(self, p) -> None:
        """A gradient was accumulated into ``p.grad``. A completed bucket is launched at the next
        hook (or at the end of the backward), never in the hook of its own last parameter: later
        hooks of that parameter (MemTracker's) still read ``p.grad``."""
        from torch.autograd import Variable

        if not self.callback_queued:
            Variable._execution_engine.queue_callback(self._end_of_backward)
            self.callback_queued = True
        if self.complete is not None:
            self._reduce_bucket(self.complete)
        i = self.bucket_of[id(p)]
        self.fired[i] += 1
        if self.fired[i] == len(self.buckets[i]):
            self.complete = i

    def _reduce_bucket(self, i: int) -> None:
        """Launch bucket ``i`` once the previous one has landed; its gradients go to None."""
        self.fired[i] = 0
        if self.complete == i:
            self.complete = None
        self._drain()  # at most one bucket in flight
        self.in_flight = self._reduce_to_owners([p for p in self.buckets[i] if p.grad is not None], drop=True)

    def _end_of_backward(self) -> None:
        """Launch what is left (buckets with parameters that got no gradient), then wait for all."""
        for i, n in enumerate(self.fired):
            if n:
                self._reduce_bucket(i)
        self._drain()
        self.callback_queued = False

    def _drain(self) -> None:
        """Wait for the reduces in flight; the owner adds its share into its accumulators."""
        from torch._utils import _unflatten_dense_tensors

        for work, flat, params, owner in self.in_flight:
            work.wait()
            if owner != self.me:
                continue
            for p, g in zip(params, _unflatten_dense_tensors(flat, params)):
                if id(p) in self.acc:
                    self.acc[id(p)].add_(g)
                else:
                    self.acc[id(p)] = g.clone()
        self.in_flight = []

    def finish(self) -> None:
        """Wait for every launched bucket and write the averaged gradients back (ZeRO-2: only on
        the owner, whose accumulators become ``p.grad``; other ranks drop theirs)."""
        self._drain()
        for bucket in self.buckets:
            for p in bucket:
                acc = self.acc.pop(id(p), None)
                p.grad = None if acc is None else acc.div_(self.divisor * self.grad_scale)
        self._land_pending()
        if self.powersgd is not None and self._launched:  # the step's buckets have landed
            from autoconf.trainer.compression import end_step

            end_step(self.powersgd)
            self._launched = False

    def _land_pending(self) -> None:
        """Wait for the launched reductions and write the averaged gradients back (ZeRO-2: only
        on the owner; other ranks drop theirs)."""
        from torch._utils import _unflatten_dense_tensors

        for work, flat, params, owner in self.pending:
            work.wait()
            if owner is not None and owner != self.me:
                for p in params:
                    p.grad = None
                continue
            if not isinstance(work, _Averaged):
                flat.div_(self.divisor)
            for p, g in zip(params, _unflatten_dense_tensors(flat, [p.grad for p in params])):
                p.grad.copy_(g)
        self.pending = []


def grad_sync(params, config, groups):
    """ZeRO-0/1/2's gradient averaging: :class:`GradSync` over dp x cp, or :class:`ExpertGradSync`
    with expert parallelism."""
    if getattr(config, "ep", 1) > 1:
        return ExpertGradSync(params, config.zero_stage, groups, all_reduce=groups.dp_all_reduce)
    powersgd = None
    if groups.pp_rank < getattr(config, "dp_compression_stages", 0) and len(groups.grad_ranks) > 1:
        from autoconf.trainer.compression import powersgd_state

        powersgd = powersgd_state(groups.grad, config.dp_compression_rank)
    return GradSync(params, config.zero_stage, groups.grad, groups.grad_ranks, groups.grad_rank,
                    all_reduce=groups.dp_all_reduce, powersgd=powersgd)


class _Averaged:
    """A PowerSGD future as a work: ``wait()`` leaves the averaged gradients in the bucket's buffer
    (the hook divides by the group's size itself)."""

    def __init__(self, fut):
        self.fut = fut

    def wait(self):
        return self.fut.wait()


class ExpertGradSync:
    """Expert parallelism (ep > 1): routed experts' gradients (``param.expert_parallel``) are averaged
    over the expert-data-parallel group (their sum there divided by dp x cp: each expert's gradient
    already holds what the tokens of its whole EP group gave it), every other gradient as
    :class:`GradSync` over dp x cp. ZeRO-0/1 only (the trainer refuses ZeRO-2/3 with ep > 1)."""

    def __init__(self, params, zero_stage: int, groups, all_reduce=None):
        params = list(params)
        expert = [p for p in params if getattr(p, "expert_parallel", False)]
        self.expert_ids = {id(p) for p in expert}
        self.dense = GradSync([p for p in params if id(p) not in self.expert_ids], zero_stage, groups.grad,
                              groups.grad_ranks, groups.grad_rank, all_reduce=all_reduce)
        self.experts = GradSync(expert, zero_stage, groups.edp, groups.edp_ranks, groups.edp_ranks.index(groups.rank),
                                divisor=len(groups.grad_ranks))

    def launch(self, params, exact: bool = False) -> None:
        params = list(params)
        self.dense.launch([p for p in params if id(p) not in self.expert_ids])
        self.experts.launch([p for p in params if id(p) in self.expert_ids])

    def reduce_every_backward(self, buckets, grad_scale: int = 1) -> bool:
        return False

    def take_payload(self) -> int:
        return self.dense.take_payload() + self.experts.take_payload()

    def finish(self) -> None:
        self.dense.finish()
        self.experts.finish()


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


class Optimizers:
    """Several optimizers stepped as one (ZeRO-1 with ep > 1: dense and expert parameters)."""

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none)

    def tracked(self) -> list:
        """The torch optimizers holding this rank's state (for memory tracking)."""
        return [o.tracked() for o in self.optimizers]


def apply_fsdp(units, container, dp_group, device_type: str, reshard_after_forward: bool = True):
    """ZeRO-3: shard every unit, then the container (the pipeline stage or the whole model).
    ``reshard_after_forward=False``: the units stay gathered after a forward (a layered pipeline
    chunk reshards them itself after its last micro-batch, ``piped.Piped``)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from autoconf.trainer.fsdp_counts import count_fsdp_collectives

    count_fsdp_collectives()
    mesh = DeviceMesh.from_group(dp_group, device_type, mesh_dim_names=("dp",))
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
    if container is not None:
        fully_shard(container, mesh=mesh)
    return mesh
