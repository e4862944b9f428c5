"""Communication time: alpha-beta collectives on the links a group really spans.

Every formula is latency + bytes / bandwidth (Hockney's alpha-beta model, as in Calculon) with the
algorithm's step count and volume:

- ring all-reduce: 2(n-1) steps of S/n (Patarasuk & Yuan 2009): 2(n-1)/n * S / B + 2(n-1) * a;
- tree all-reduce (NCCL's pipelined double binary tree across hosts, a chain inside each host):
  2 * S / B + 2 * (ceil(log2 hosts) + k - 1) * a, with k members per host;
- hierarchical all-reduce (reduce-scatter inside hosts, all-reduce across hosts on S/k by k
  parallel flows, all-gather inside hosts; the two-level scheme of NVRAR / Horovod's hierarchical
  mode), its inter-host phase as the reference trainer runs it: recursive doubling for small
  shards (log2 H rounds of the whole shard), a ring above (``trainer/collectives.py``);
- all-gather / reduce-scatter: ring, (n-1)/n * S / B + (n-1) * a;
- point-to-point: a + S / B;
- all-to-all (mixture-of-experts dispatch / combine): each member's bytes to members on its host
  over the fabric and to the others over the NICs at once, n - 1 messages' latency.

A collective library picks the fastest algorithm it has for the group; :func:`all_reduce_s` takes
the fastest of the algorithms the runtime really runs (``frameworks.Framework``).

Real collectives reach neither the links' datasheet bandwidth nor their bare latency. A
:class:`CollectiveTuning` (catalog data per device, or a profile's measurement) adds the fixed cost
of one collective call (kernel launch, channel set-up, the peers' handshake: tens of microseconds
with NCCL) and scales each link tier's bandwidth by the bus efficiency the library really reaches
on it (inside a host, less for short rings). nccl-tests on an 8 x A100 NVSwitch node show all
three: a 1 MiB all-reduce takes 44-93 us (2-8 GPUs), a tenth of its bandwidth-only time's rate,
and a 1 GiB one reaches 197 GB/s of bus bandwidth on 2 GPUs and 229 GB/s on 8, of 300 GB/s links.
Not modelled: NCCL's protocol and channel-count switches between 1 and 16 MiB, where measured
times step by up to 20% off this smooth curve.
``S`` is the full buffer (all-reduce: the reduced tensor; all-gather: the gathered output;
reduce-scatter: the input), ``B`` the slowest link the algorithm crosses.

Across hosts, NCCL's rings and trees run one channel per rail: each of a host's k members sends
its share through its own NIC, so a flat ring or tree of a group with k members on every host
crosses the hosts at k flows' bandwidth (capped by the host's NICs, shared with the axis's other
groups: ``topology.GroupLinks.ring_inter_bandwidth_bytes_per_s``). With one NIC per host
(Ethernet) that is one flow, as before. On 8 DGX-H100 (8 x 400 Gbit/s per host) a 1 GiB flat
all-reduce comes out at 281 GB/s of bus bandwidth (ring) and 322 GB/s (tree), against 188 GB/s
for the hierarchical scheme, which crosses NVLink twice more.
"""

from __future__ import annotations

import math

from autoconf.space.allreduce import inter_host_steps  # torch-free: the runtime's own choice
from autoconf.specs.devices import NEUTRAL, CollectiveTuning
from autoconf.specs.topology import GroupLinks


def p2p_s(nbytes: float, bandwidth: float, latency: float, tune: CollectiveTuning = NEUTRAL,
          inter: bool = False) -> float:
    eff = tune.inter_efficiency if inter else tune.intra(2)
    return tune.base_latency_s + latency + nbytes / (bandwidth * eff)


def _intra(g: GroupLinks, tune: CollectiveTuning) -> float:
    return g.intra_bandwidth_bytes_per_s * tune.intra(g.local_size)


def _ring_link(g: GroupLinks, tune: CollectiveTuning) -> tuple[float, float]:
    if g.num_hosts > 1:
        return (min(_intra(g, tune), g.ring_inter_bandwidth_bytes_per_s * tune.inter_efficiency),
                g.inter_latency_s)
    return _intra(g, tune), g.intra_latency_s


def ring_all_reduce_s(nbytes: float, g: GroupLinks, tune: CollectiveTuning = NEUTRAL) -> float:
    n = g.size
    if n <= 1:
        return 0.0
    bw, lat = _ring_link(g, tune)
    return tune.base_latency_s + 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


def tree_all_reduce_s(nbytes: float, g: GroupLinks, tune: CollectiveTuning = NEUTRAL) -> float:
    n = g.size
    if n <= 1:
        return 0.0
    bw, lat = _ring_link(g, tune)
    steps = math.ceil(math.log2(g.num_hosts)) + g.local_size - 1
    return tune.base_latency_s + 2 * nbytes / bw + 2 * steps * lat


def hierarchical_all_reduce_s(nbytes: float, g: GroupLinks, tune: CollectiveTuning = NEUTRAL) -> float:
    k, hosts = g.local_size, g.num_hosts
    if hosts <= 1 or k <= 1:
        return ring_all_reduce_s(nbytes, g, tune)
    intra, inter = _intra(g, tune), g.inter_bandwidth_bytes_per_s * tune.inter_efficiency
    local = (k - 1) / k * nbytes / intra + (k - 1) * g.intra_latency_s
    how, steps = inter_host_steps(hosts, nbytes / k)
    if how == "recursive_doubling":  # every round exchanges the whole shard
        across = steps * ((nbytes / k) / inter + g.inter_latency_s)
    else:
        across = 2 * (hosts - 1) / hosts * (nbytes / k) / inter + steps * g.inter_latency_s
    return tune.base_latency_s + 2 * local + across


ALL_REDUCE = {"ring": ring_all_reduce_s, "tree": tree_all_reduce_s, "hierarchical": hierarchical_all_reduce_s}
"""The all-reduce algorithms the model knows, by name."""


def all_reduce_s(nbytes: float, g: GroupLinks, tune: CollectiveTuning = NEUTRAL,
                 algorithms: tuple = ("ring", "tree")) -> float:
    """The fastest of ``algorithms`` for this group: a runtime picks among those it can run
    (NCCL among ring and tree, the default; a flat gloo call runs a ring; the hierarchical one
    only where a runtime implements it, ``frameworks.Framework.all_reduce_algorithms``)."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    return min(ALL_REDUCE[a](nbytes, g, tune) for a in algorithms)


def all_gather_s(nbytes: float, g: GroupLinks, tune: CollectiveTuning = NEUTRAL) -> float:
    """All-gather of an ``nbytes`` output (each member contributes nbytes / n); same as
    reduce-scatter. A ring: NCCL's all-gather and reduce-scatter and gloo's are rings (no
    hierarchical form runs in the frameworks modelled, so none is credited)."""
    n = g.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = _ring_link(g, tune)
    return tune.base_latency_s + (n - 1) / n * nbytes / bw + (n - 1) * lat


reduce_scatter_s = all_gather_s


def all_to_all_s(nbytes: float, g, tune: CollectiveTuning = NEUTRAL) -> float:
    """An all-to-all in which every member sends ``nbytes`` spread evenly over the other n - 1:
    the share for members on its own host (domain) over the intra-node fabric, the rest over the
    NICs (each device's share of them), the two at once; n - 1 messages' latency."""
    n = g.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    local_peers = g.local_size - 1
    remote = (n - 1 - local_peers) / (n - 1)
    intra = (1 - remote) * nbytes / (g.intra_bandwidth_bytes_per_s * tune.intra(g.local_size)) if local_peers else 0.0
    inter = remote * nbytes / (g.inter_bandwidth_bytes_per_s * tune.inter_efficiency) if remote else 0.0
    lat = g.inter_latency_s if remote else g.intra_latency_s
    return tune.base_latency_s + max(intra, inter) + (n - 1) * lat
