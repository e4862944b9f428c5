"""A hierarchical all-reduce over ``torch.distributed`` subgroups, for the data-parallel gradients.

A group whose ranks sit on H hosts with k ranks on each (the same k everywhere) is reduced in three
phases (the two-level scheme of Horovod's hierarchical mode and of NVRAR):

1. **intra-host reduce-scatter**: the k ranks of a host split the buffer into k shards of
   ceil(n / k) elements, the last ones shorter (or empty) when k does not divide n -- the same
   split as padding the buffer to a multiple of k, without the padded copy; local rank j ends with
   the host's sum of shard j (a ring of k - 1 point-to-point steps, empty shards skipped);
2. **inter-host all-reduce** of shard j among the H ranks with local index j (one rank per host,
   k such groups at once, each carrying 1/k of the bytes): recursive doubling when the shard is
   small (at most ``small_bytes``: log2 H exchange rounds when H is a power of two, floor(log2 H)
   + 2 otherwise, instead of a ring's 2(H-1) steps), the process group's own all-reduce otherwise;
3. **intra-host all-gather**: every rank of the host receives every reduced shard (a ring of k - 1
   steps).

The result is the same sum as a flat all-reduce, in another order of additions: equal to it up to
floating-point rounding, and bit-identical on every rank of the group (each shard is reduced once
per host, the recursive-doubling partners add the same two values, a + b == b + a).

When it cannot run, the caller keeps the flat all-reduce, and :func:`host_layout` says why: a group
on one host (nothing to split), one rank per host (the inter-host all-reduce alone *is* the flat
one), or hosts holding different numbers of the group's ranks (the shards would not line up).

Where a rank runs comes from the launch (:func:`rank_hosts`): a mapping passed in (or the
``AUTOCONF_RANK_HOSTS`` environment variable: one host label per global rank, comma-separated),
else torchrun's node rank (``GROUP_RANK``, which differs between the agents of a multi-node launch),
else the machine's host name, gathered from every rank.

Every rank of the job must create the subgroups, in the same order (``torch.distributed.new_group``
is collective over the default group): :func:`build` walks every group of the axis, whether this
rank is in it or not.

Pure helpers (no torch): :func:`shard_bounds`, :func:`host_layout`, :func:`recursive_doubling_schedule`,
:func:`inter_host_steps`. torch is imported inside the functions that run collectives.
"""

from __future__ import annotations

import os
import threading

from autoconf.space.allreduce import (
    SMALL_BYTES,
    HostLayout,
    host_layout,
    inter_host_steps,
    recursive_doubling_schedule,
    shard_bounds,
)

HOSTS_ENV = "AUTOCONF_RANK_HOSTS"


# -- pure parts ----------------------------------------------------------------------------------


def parse_hosts(text: str, world: int) -> list[str]:
    """Host labels of every rank from ``a,a,b,b``; ValueError naming what is wrong."""
    labels = [s.strip() for s in text.split(",")]
    if len(labels) != world or not all(labels):
        raise ValueError(f"{HOSTS_ENV}={text!r} must name one host per rank, comma-separated "
                         f"({world} ranks, e.g. {','.join(['a'] * (world // 2) + ['b'] * (world - world // 2))})")
    return labels


# -- running -------------------------------------------------------------------------------------

def rank_hosts(mapping=None) -> list:
    """The host label of every global rank (collective over the default group unless a mapping is
    given): ``mapping`` (a list, or "a,a,b,b"), else ``$AUTOCONF_RANK_HOSTS``, else torchrun's node
    rank (``GROUP_RANK``), else the host name."""
    import socket

    import torch.distributed as dist

    world = dist.get_world_size()
    if mapping is None:
        mapping = os.environ.get(HOSTS_ENV) or None
    if isinstance(mapping, str):
        return parse_hosts(mapping, world)
    if mapping is not None:
        mapping = list(mapping)
        if len(mapping) != world:
            raise ValueError(f"host mapping has {len(mapping)} entries for {world} ranks")
        return mapping
    mine = f"node{os.environ['GROUP_RANK']}" if "GROUP_RANK" in os.environ else socket.gethostname()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


def build(axis_groups, host_of, rank: int, timeout=None, small_bytes: int = SMALL_BYTES):
    """(HierarchicalAllReduce or None, note) for this rank's group among ``axis_groups`` (every
    group of the axis, the same list on every rank). Every rank calls ``new_group`` for every
    group's subgroups in the same order; the note says what runs ("hierarchical (2 hosts x 2)"), or
    why this rank's group stays flat."""
    import torch.distributed as dist

    mine, note = None, None
    for ranks in axis_groups:
        layout, why = host_layout(ranks, host_of)
        member = rank in ranks
        if member:
            note = why if layout is not None else f"flat (hierarchical asked; group {sorted(ranks)}: {why})"
        if layout is None:
            continue
        intra = [dist.new_group(layout.intra(h), timeout=timeout) for h in range(layout.num_hosts)]
        inter = [dist.new_group(layout.inter(j), timeout=timeout) for j in range(layout.local_size)]
        if member:
            h, j = layout.position(rank)
            mine = HierarchicalAllReduce(layout, h, j, intra[h], inter[j], small_bytes)
    return mine, note or "flat"


class _Handle:
    """What :meth:`HierarchicalAllReduce.start` returns: ``wait()`` joins the worker and re-raises
    its error."""

    def __init__(self, fn):
        self.error = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name="hier-allreduce")
        self.thread.start()

    def _run(self, fn) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - raised in the waiting thread
            self.error = e

    def wait(self) -> bool:
        self.thread.join()
        if self.error is not None:
            err, self.error = self.error, None
            raise err
        return True


class HierarchicalAllReduce:
    """Sum-all-reduce over one group in three phases (module doc); ``layout`` and the subgroups
    come from :func:`build`."""

    def __init__(self, layout: HostLayout, host: int, local: int, intra, inter, small_bytes: int = SMALL_BYTES):
        self.layout, self.host, self.local = layout, host, local
        self.intra, self.inter = intra, inter
        self.small_bytes = small_bytes
        self._last: _Handle | None = None

    @property
    def k(self) -> int:
        return self.layout.local_size

    def buffers(self, t):
        """The receive buffer one reduction of ``t`` needs (one shard), or None for an empty ``t``.
        Allocated by the caller's thread (memory tracking sees it)."""
        import torch

        (start, end), *_ = shard_bounds(t.numel(), self.k)
        return torch.empty(end - start, dtype=t.dtype, device=t.device) if end > start else None

    def __call__(self, t, recv=None) -> None:
        """Sum ``t`` (contiguous) over the group, in place, now."""
        import torch.distributed as dist

        if not t.is_contiguous():
            raise ValueError("the hierarchical all-reduce needs a contiguous tensor")
        if t.numel() == 0:
            return
        recv = self.buffers(t) if recv is None else recv
        full = t.view(-1)
        shards = [full[a:b] for a, b in shard_bounds(full.numel(), self.k)]
        self._ring_reduce_scatter(shards, recv)
        shard = shards[self.local]
        algo, _ = inter_host_steps(self.layout.num_hosts, shard.numel() * t.element_size(), self.small_bytes)
        if shard.numel() == 0:  # every rank with this local index has the same empty shard
            pass
        elif algo == "recursive_doubling":
            self._recursive_doubling(shard, recv[: shard.numel()])
        elif algo == "ring":
            dist.all_reduce(shard, group=self.inter)
        self._ring_all_gather(shards)

    def _exchange(self, send, recv, dst: int, src: int, group) -> None:
        """Send ``send`` to ``dst`` while receiving ``recv`` from ``src``; an empty side is skipped
        (its peer's matching side is empty too)."""
        import torch.distributed as dist

        reqs = []
        if send.numel():
            reqs.append(dist.isend(send, group=group, group_dst=dst))
        if recv.numel():
            reqs.append(dist.irecv(recv, group=group, group_src=src))
        for req in reqs:
            req.wait()

    def _ring_reduce_scatter(self, shards, recv) -> None:
        """Ring reduce-scatter inside the host, in place: after k - 1 steps local rank j holds the
        host's sum of shard j. Point-to-point messages, not gloo's ``reduce_scatter``, which takes
        longer than its all-reduce of the whole buffer (16 MiB between 2 processes on loopback:
        30 ms against 17 ms; this ring: 9 ms)."""
        k, j = self.k, self.local
        nxt, prv = (j + 1) % k, (j - 1) % k
        for s in range(k - 1):
            out, into = shards[(j - s - 1) % k], shards[(j - s - 2) % k]
            got = recv[: into.numel()]
            self._exchange(out, got, nxt, prv, self.intra)
            into.add_(got)

    def _ring_all_gather(self, shards) -> None:
        """Ring all-gather inside the host, in place: every local rank ends with every shard."""
        k, j = self.k, self.local
        nxt, prv = (j + 1) % k, (j - 1) % k
        for s in range(k - 1):
            self._exchange(shards[(j - s) % k], shards[(j - s - 1) % k], nxt, prv, self.intra)

    def _recursive_doubling(self, data, recv) -> None:
        import torch.distributed as dist

        g = self.inter
        for step in recursive_doubling_schedule(self.layout.num_hosts, self.host):
            if step.kind == "send" or step.kind == "send_result":
                dist.send(data, group=g, group_dst=step.peer)
            elif step.kind == "recv_result":
                dist.recv(data, group=g, group_src=step.peer)
            elif step.kind == "recv_add":
                dist.recv(recv, group=g, group_src=step.peer)
                data.add_(recv)
            else:  # exchange_add
                self._exchange(data, recv, step.peer, step.peer, g)
                data.add_(recv)

    def start(self, t) -> _Handle:
        """Sum ``t`` over the group on a worker thread (as ``async_op=True``): returns a handle
        whose ``wait()`` lands it. The receive buffer is allocated here, in the caller's thread; the
        previous reduction lands first, so the subgroups see the same order on every rank."""
        if self._last is not None:
            self._last.wait()
        if not t.is_contiguous():
            raise ValueError("the hierarchical all-reduce needs a contiguous tensor")
        recv = self.buffers(t)
        self._last = _Handle(lambda: self(t, recv))
        return self._last
