"""The hierarchical all-reduce's plan (reduce-scatter inside each host, all-reduce of the shards
across hosts by recursive doubling or a ring, all-gather inside each host): which steps it takes.
Shared by the trainer (``trainer.collectives`` runs it) and the cost model (``cost.comm`` prices
it). Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

SMALL_BYTES = 256 << 10
"""Default largest inter-host shard (bytes) that goes by recursive doubling; larger shards use the
process group's all-reduce (gloo: a ring). Measured with bench/allreduce_hier.py, 2 hosts x 2 over a
1 gbit link (gloo over TCP, 4 processes on 2 cores, medians of 9-15): recursive doubling is ahead
for small shards (64 KiB message: 1.6-5.6 ms against 6.2-7.5 ms), the two are within the
run-to-run noise at 256-512 KiB shards, and the ring is ahead from 1 MiB shards (2 MiB message:
21.7 against 29.6 ms; 16 MiB: 166-178 against 276-285 ms)."""


def shard_bounds(numel: int, k: int) -> list[tuple[int, int]]:
    """[start, end) of each of the ``k`` shards of a buffer of ``numel`` elements: ceil(numel / k)
    elements each, in order, the last ones shorter or empty (what padding the buffer with zeros to
    a multiple of k would give, without the copy)."""
    if k < 1:
        raise ValueError(f"k={k} must be at least 1")
    c = -(-max(numel, 0) // k)
    return [(min(j * c, numel), min((j + 1) * c, numel)) for j in range(k)] if numel > 0 else [(0, 0)] * k


@dataclass(frozen=True)
class HostLayout:
    """A group's ranks by host: ``hosts[h][j]`` is the global rank with local index j on host h."""

    hosts: tuple
    """One tuple of global ranks (ascending) per host, hosts in the order of their lowest rank."""

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def local_size(self) -> int:
        return len(self.hosts[0])

    def intra(self, h: int) -> list[int]:
        """Ranks of host h (an intra-host subgroup)."""
        return list(self.hosts[h])

    def inter(self, j: int) -> list[int]:
        """Ranks with local index j, one per host (an inter-host subgroup), in host order."""
        return [members[j] for members in self.hosts]

    def position(self, rank: int) -> tuple[int, int] | None:
        """(host index, local index) of a global rank, None if it is not in the group."""
        for h, members in enumerate(self.hosts):
            if rank in members:
                return h, members.index(rank)
        return None


def host_layout(group_ranks, host_of) -> tuple[HostLayout | None, str]:
    """How the hierarchical all-reduce splits this group, or None and why it cannot.

    ``host_of`` maps a global rank to a host label (a list indexed by rank, or a dict). Returns
    (layout, "hierarchical (H hosts x k)") or (None, reason). The rule is the cost model's too
    (``frameworks.hierarchical_runs``): at least two hosts, at least two ranks on each, the same
    number on every host.
    """
    by_host: dict = {}
    for r in sorted(group_ranks):
        by_host.setdefault(host_of[r], []).append(r)
    hosts = sorted((tuple(v) for v in by_host.values()), key=lambda m: m[0])
    counts = [len(m) for m in hosts]
    if len(hosts) < 2:
        return None, f"its {len(group_ranks)} ranks are on one host"
    if len(set(counts)) > 1:
        return None, f"its hosts hold different numbers of its ranks ({', '.join(map(str, counts))})"
    if counts[0] < 2:
        return None, "it has one rank per host (the inter-host all-reduce alone is the flat one)"
    layout = HostLayout(tuple(hosts))
    return layout, f"hierarchical ({layout.num_hosts} hosts x {layout.local_size})"


@dataclass(frozen=True)
class Step:
    """One step of a recursive-doubling all-reduce, from one rank's view.

    kind: ``send`` (give my data to ``peer``, then wait for the result), ``recv_add`` (add the
    peer's data into mine), ``exchange_add`` (swap with the peer, add theirs into mine),
    ``send_result`` (give the peer the final sum), ``recv_result`` (my data becomes the peer's).
    """

    round: int
    kind: str
    peer: int


def recursive_doubling_schedule(n: int, i: int) -> list[Step]:
    """The steps rank ``i`` of ``n`` takes in a recursive-doubling all-reduce (Thakur, Rabenseifner
    and Gropp 2005, as in MPICH): with p the largest power of two <= n and r = n - p, the first 2r
    ranks pair up (odd ones hand their data to the even one before and wait), the p remaining ranks
    exchange with the partner at distance 1, 2, 4, ... (log2 p rounds), and the even ranks hand the
    result back. Rounds: log2 p, plus 2 when n is not a power of two."""
    if not 0 <= i < n:
        raise ValueError(f"rank {i} not in 0..{n - 1}")
    if n == 1:
        return []
    p = 1 << (n.bit_length() - 1)
    r = n - p
    steps: list[Step] = []
    rnd = 0
    if r:
        if i < 2 * r and i % 2:
            return [Step(0, "send", i - 1), Step(p.bit_length(), "recv_result", i - 1)]
        if i < 2 * r:
            steps.append(Step(0, "recv_add", i + 1))
        rnd = 1
    v = i // 2 if i < 2 * r else i - r  # index among the p active ranks

    def rank_of(w: int) -> int:
        return 2 * w if w < r else w + r

    mask = 1
    while mask < p:
        steps.append(Step(rnd, "exchange_add", rank_of(v ^ mask)))
        mask <<= 1
        rnd += 1
    if r and i < 2 * r:
        steps.append(Step(rnd, "send_result", i + 1))
    return steps


def inter_host_steps(num_hosts: int, shard_bytes: float, small_bytes: float = SMALL_BYTES) -> tuple[str, int]:
    """(algorithm, sequential message steps) of the inter-host phase: recursive doubling
    (``len`` of its rounds) up to ``small_bytes``, else a ring all-reduce (2(H-1) steps)."""
    if num_hosts <= 1:
        return "none", 0
    if shard_bytes <= small_bytes:
        p = 1 << (num_hosts.bit_length() - 1)
        return "recursive_doubling", (p.bit_length() - 1) + (2 if p != num_hosts else 0)
    return "ring", 2 * (num_hosts - 1)
