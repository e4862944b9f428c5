"""Communication time: alpha-beta collectives on the links a group really spans.

Every formula is latency + bytes / bandwidth (Hockney's alpha-beta model, as in Calculon) with the
algorithm's step count and volume:

- ring all-reduce: 2(n-1) steps of S/n (Patarasuk & Yuan 2009): 2(n-1)/n * S / B + 2(n-1) * a;
- tree all-reduce (NCCL's pipelined double binary tree): 2 * S / B + 2 * ceil(log2 n) * a;
- hierarchical all-reduce (reduce-scatter inside hosts, all-reduce across hosts on S/k by k
  parallel flows, all-gather inside hosts; the two-level scheme of NVRAR / Horovod's hierarchical
  mode);
- all-gather / reduce-scatter: ring, (n-1)/n * S / B + (n-1) * a, or its hierarchical form;
- point-to-point: a + S / B.

A collective library picks the fastest algorithm for the group; so does :func:`all_reduce_s`.
``S`` is the full buffer (all-reduce: the reduced tensor; all-gather: the gathered output;
reduce-scatter: the input), ``B`` the slowest link the algorithm crosses.
"""

from __future__ import annotations

import math

from ..topology import GroupLinks


def p2p_s(nbytes: float, bandwidth: float, latency: float) -> float:
    return latency + nbytes / bandwidth


def _ring_link(g: GroupLinks) -> tuple[float, float]:
    if g.num_hosts > 1:
        return min(g.intra_bandwidth_bytes_per_s, g.ring_inter_bandwidth_bytes_per_s), g.inter_latency_s
    return g.intra_bandwidth_bytes_per_s, g.intra_latency_s


def ring_all_reduce_s(nbytes: float, g: GroupLinks) -> float:
    n = g.size
    if n <= 1:
        return 0.0
    bw, lat = _ring_link(g)
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


def tree_all_reduce_s(nbytes: float, g: GroupLinks) -> float:
    n = g.size
    if n <= 1:
        return 0.0
    bw, lat = _ring_link(g)
    return 2 * nbytes / bw + 2 * math.ceil(math.log2(n)) * lat


def hierarchical_all_reduce_s(nbytes: float, g: GroupLinks) -> float:
    k, hosts = g.local_size, g.num_hosts
    if hosts <= 1 or k <= 1:
        return ring_all_reduce_s(nbytes, g)
    intra, inter = g.intra_bandwidth_bytes_per_s, g.inter_bandwidth_bytes_per_s
    local = (k - 1) / k * nbytes / intra + (k - 1) * g.intra_latency_s
    across = 2 * (hosts - 1) / hosts * (nbytes / k) / inter + 2 * (hosts - 1) * g.inter_latency_s
    return 2 * local + across


def all_reduce_s(nbytes: float, g: GroupLinks) -> float:
    """The fastest of ring, tree and hierarchical for this group."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    return min(ring_all_reduce_s(nbytes, g), tree_all_reduce_s(nbytes, g), hierarchical_all_reduce_s(nbytes, g))


def all_gather_s(nbytes: float, g: GroupLinks) -> float:
    """All-gather of an ``nbytes`` output (each member contributes nbytes / n); same as reduce-scatter."""
    n = g.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = _ring_link(g)
    ring = (n - 1) / n * nbytes / bw + (n - 1) * lat
    k, hosts = g.local_size, g.num_hosts
    if hosts <= 1 or k <= 1:
        return ring
    local = (k - 1) / k * nbytes / g.intra_bandwidth_bytes_per_s + (k - 1) * g.intra_latency_s
    across = (hosts - 1) / hosts * (nbytes / k) / g.inter_bandwidth_bytes_per_s + (hosts - 1) * g.inter_latency_s
    return min(ring, local + across)


reduce_scatter_s = all_gather_s
