"""Links: point-to-point alpha-beta for every ordered pair of ranks, and collectives per group.

Point-to-point pairs are scheduled as a round-robin tournament (the circle method): in each round
every rank is in at most one pair, so pairs measured together never share a rank (they may still
share a NIC or, on CPU, the cores; ``--serial-links`` measures one pair at a time instead). With
ranks on several hosts, a round is split further so that each host's NIC carries at most one
measured pair at a time (:func:`split_by_host`): two pairs crossing the same NIC at once would each
see about half of it. In a
pair (a, b) the direction a -> b is timed as a message of ``size`` bytes from a followed by a
4-byte acknowledgement from b, repeated; then b -> a the same way. Per size the median of the
repeats is kept, and t(size) = alpha' + size / beta is fit over the sizes
(:func:`autoconf.specs.profile.fit_alpha_beta`); the link's latency is alpha' / 2 (alpha' is one
message latency each way).

Collectives run for the whole world and for contiguous groups of each power-of-two size (the
groups tensor- and pipeline-parallel layouts use); all groups of one size run at once, as the
groups of one parallel axis do in training. A group's time is the slowest member's median.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from autoconf.specs.profile import busbw_factor, fit_alpha_beta

P2P_SIZES = (4, 64, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
P2P_SIZES_QUICK = (4, 4 << 10, 256 << 10, 4 << 20)
COLLECTIVE_SIZES = (4 << 10, 1 << 20, 16 << 20)
COLLECTIVE_SIZES_QUICK = (64 << 10, 4 << 20)
OPS = ("all_reduce", "all_gather", "reduce_scatter")
# torch >= 2.13 renames the flat-tensor collectives; older versions have only the old names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def tournament_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs covering every unordered pair of 0..n-1 once (circle method)."""
    players = list(range(n)) + ([None] if n % 2 else [])
    m = len(players)
    rounds = []
    for _ in range(m - 1):
        pairs = [(players[i], players[m - 1 - i]) for i in range(m // 2)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None])
        players = [players[0], players[-1]] + players[1:-1]
    return rounds


def split_by_host(pairs: list[tuple[int, int]], hosts: list[str]) -> list[list[tuple[int, int]]]:
    """One round's pairs as sub-rounds in which each host is in at most one cross-host pair (a
    pair inside a host stays in the first sub-round). Pairs keep their order; one host: unchanged."""
    subs: list[list[tuple[int, int]]] = [[]]
    busy: list[set] = [set()]
    for a, b in pairs:
        ha, hb = hosts[a], hosts[b]
        if ha == hb:
            subs[0].append((a, b))
            continue
        for i, used in enumerate(busy):
            if ha not in used and hb not in used:
                break
        else:
            subs.append([])
            busy.append(set())
            i = len(subs) - 1
        subs[i].append((a, b))
        busy[i] |= {ha, hb}
    return [s for s in subs if s]


def measure_rounds(world: int, serial: bool = False, hosts: list[str] | None = None) -> list[list[tuple[int, int]]]:
    """The rounds of pairs measured together: the tournament, one pair at a time with ``serial``,
    and with ``hosts`` (host of each rank) no NIC shared by two pairs of a round."""
    rounds = tournament_rounds(world)
    if serial:
        return [[p] for r in rounds for p in r]
    if hosts is not None and len(set(hosts)) > 1:
        rounds = [sub for r in rounds for sub in split_by_host(r, hosts)]
    return rounds


def _inner_iters(size: int, quick: bool) -> int:
    """Transfers per timed sample: many for tiny messages (timer and loop overhead), few for big."""
    if size <= 16 << 10:
        return 10 if quick else 20
    return 2 if size >= 4 << 20 else 4


def _ping(peer: int, buf, ack, inner: int, sync) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        dist.send(buf, peer)
        dist.recv(ack, peer)
    sync()
    return (time.perf_counter() - t0) / inner


def _pong(peer: int, buf, ack, inner: int, sync) -> None:
    for _ in range(inner):
        dist.recv(buf, peer)
        dist.send(ack, peer)
    sync()


def measure_p2p(device, sizes, repeats: int, quick: bool, serial: bool = False, advance=None,
                hosts: list[str] | None = None) -> list[dict]:
    """Run the tournament; returns this rank's measured links (it is the sender of each).
    ``hosts``: the host of each rank (see :func:`measure_rounds`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ack = torch.zeros(4, dtype=torch.uint8, device=device)
    bufs = {s: torch.zeros(s, dtype=torch.uint8, device=device) for s in sizes}
    rounds = measure_rounds(world, serial, hosts)
    out = []
    for pairs in rounds:
        for a, b in pairs:
            if rank not in (a, b):
                continue
            for src, dst in ((a, b), (b, a)):
                medians = []
                for s in sizes:
                    inner = _inner_iters(s, quick)
                    if rank == src:
                        _ping(dst, bufs[s], ack, inner, sync)  # warm-up (and lazy connection set-up)
                        medians.append(statistics.median(_ping(dst, bufs[s], ack, inner, sync)
                                                         for _ in range(repeats)))
                    else:
                        for _ in range(repeats + 1):
                            _pong(src, bufs[s], ack, inner, sync)
                if rank == src:
                    alpha2, beta = fit_alpha_beta(sizes, medians)
                    out.append({"src": src, "dst": dst, "latency_s": alpha2 / 2, "bandwidth_bytes_per_s": beta,
                                "sizes_bytes": list(sizes), "times_s": medians})
        dist.barrier()
        if advance:
            advance(1)
    return out


def link_rounds(world: int, serial: bool = False, hosts: list[str] | None = None) -> int:
    return len(measure_rounds(world, serial, hosts))


def collective_groups(world: int) -> list[list[int]]:
    """Contiguous groups of each power-of-two size below the world, then the world itself."""
    out, g = [], 2
    while g < world:
        out += [list(range(i, i + g)) for i in range(0, world - g + 1, g)]
        g *= 2
    if world >= 2:
        out.append(list(range(world)))
    return out


def _run_op(op: str, group, n: int, buf, outbuf):
    if op == "all_reduce":
        dist.all_reduce(buf, group=group)
    elif op == "all_gather":
        _ALL_GATHER(outbuf, buf, group=group)
    else:
        _REDUCE_SCATTER(outbuf, buf, group=group)


def measure_collectives(device, sizes, repeats: int, advance=None) -> list[dict]:
    """Every rank takes part; returns this rank's samples per (op, group, size) for rank 0 to merge."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    groups = collective_groups(world)
    handles = [dist.new_group(g) if len(g) < world else None for g in groups]  # every rank creates every group
    by_size: dict = {}
    for g, h in zip(groups, handles):
        by_size.setdefault(len(g), []).append((g, h))
    out = []
    for n, members in sorted(by_size.items()):
        mine = [(g, h) for g, h in members if rank in g]
        for op in OPS:
            for size in sizes:
                elems = max(n, size // 4 // n * n)
                for g, h in mine:
                    full = torch.ones(elems, dtype=torch.float32, device=device)
                    if op == "all_reduce":
                        buf, outbuf = full, None
                    elif op == "all_gather":
                        buf, outbuf = full[: elems // n].clone(), full
                    else:
                        buf, outbuf = full, torch.empty(elems // n, dtype=torch.float32, device=device)
                    times = []
                    for i in range(repeats + 2):
                        dist.barrier(group=h)
                        sync()
                        t0 = time.perf_counter()
                        _run_op(op, h, n, buf, outbuf)
                        sync()
                        if i >= 2:  # two warm-ups (the first sets up the group's connections)
                            times.append(time.perf_counter() - t0)
                    out.append({"op": op, "ranks": g, "bytes": elems * 4, "median_s": statistics.median(times)})
                dist.barrier()
                if advance:
                    advance(1)
    return out


def collective_steps(world: int, sizes) -> int:
    return len({len(g) for g in collective_groups(world)}) * len(OPS) * len(sizes)


def merge_collectives(per_rank: list[list[dict]]) -> list[dict]:
    """One entry per (op, group, bytes): the slowest member's median."""
    merged: dict = {}
    for samples in per_rank:
        for s in samples:
            key = (s["op"], tuple(s["ranks"]), s["bytes"])
            merged[key] = max(merged.get(key, 0.0), s["median_s"])
    out = []
    for (op, ranks, nbytes), t in merged.items():
        alg = nbytes / t
        out.append({"op": op, "ranks": list(ranks), "bytes": float(nbytes), "time_s": t,
                    "algbw_bytes_per_s": alg, "busbw_bytes_per_s": alg * busbw_factor(op, len(ranks))})
    return out
