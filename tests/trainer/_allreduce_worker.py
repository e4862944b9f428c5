"""One torchrun rank of tests/test_collectives.py: the hierarchical all-reduce against gloo's flat one.

Run as ``torchrun --nproc-per-node=4 tests/trainer/_allreduce_worker.py OUT_DIR``; every rank writes
``OUT_DIR/rank_<K>.json`` with what it checked, and exits non-zero on the first mismatch.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from autoconf.trainer import collectives

SIZES = [0, 1, 2, 3, 5, 7, 64, 1001, 65537]
"""Elements: empty, tiny, odd (not divisible by the 2 local ranks), and larger ones."""


def check_sum(ar, group, rank: int, size: int, dtype, seed: int, asynchronous: bool) -> None:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(size, generator=gen).to(dtype)
    flat = x.clone()
    dist.all_reduce(flat, group=group)
    if asynchronous:
        ar.start(x).wait()
    else:
        ar(x)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(x, flat, **tol, msg=f"size {size} {dtype}")
    # every member holds the same bits (data-parallel replicas must not drift apart)
    everyone = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, x, group=group)
    assert all(torch.equal(everyone[0], e) for e in everyone), f"members differ, size {size}"


def main() -> None:
    out = sys.argv[1]
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, world
    checked = []

    # 2 hosts x 2, contiguous and interleaved host membership; recursive doubling (small shards)
    # and the process group's all-reduce (large) across hosts
    for mapping in ("a,a,b,b", "a,b,a,b"):
        host_of = collectives.rank_hosts(mapping)
        for small in (1 << 62, 0):
            ar, note = collectives.build([[0, 1, 2, 3]], host_of, rank, timeout, small_bytes=small)
            assert ar is not None and note == "hierarchical (2 hosts x 2)", note
            for i, size in enumerate(SIZES):
                check_sum(ar, None, rank, size, torch.float32, i, asynchronous=bool(i % 2))
            check_sum(ar, None, rank, 1001, torch.bfloat16, 99, asynchronous=False)
            checked.append(f"{mapping} small_bytes={small}")

    # two dp groups at once ([0, 2] and [1, 3]) with one rank per host: both stay flat, say why
    ar, note = collectives.build([[0, 2], [1, 3]], collectives.rank_hosts("a,a,b,b"), rank, timeout)
    assert ar is None and "one rank per host" in note, note
    # uneven hosts: flat, and the note says so
    ar, note = collectives.build([[0, 1, 2, 3]], collectives.rank_hosts("a,a,a,b"), rank, timeout)
    assert ar is None and note.startswith("flat (hierarchical asked") and "(3, 1)" in note, note
    checked.append("fallbacks")

    # recursive doubling over 3 (not a power of two) and 4 hosts of one rank each: built by hand
    # (build() keeps one rank per host flat), each rank its own intra-host group
    solo = [dist.new_group([r], timeout=timeout) for r in range(world)]
    for n in (3, 4):
        layout = collectives.HostLayout(tuple((r,) for r in range(n)))
        inter = dist.new_group(list(range(n)), timeout=timeout)
        if rank < n:
            ar = collectives.HierarchicalAllReduce(layout, rank, 0, solo[rank], inter, small_bytes=1 << 62)
            for i, size in enumerate((1, 6, 4097)):
                check_sum(ar, inter, rank, size, torch.float32, 50 + n * 10 + i, asynchronous=bool(i % 2))
        checked.append(f"recursive doubling over {n}")

    # the intra-host rings with 3 and 4 ranks on one host (no inter-host phase), sizes not divisible
    for k in (3, 4):
        layout = collectives.HostLayout((tuple(range(k)),))
        intra = dist.new_group(list(range(k)), timeout=timeout)
        if rank < k:
            ar = collectives.HierarchicalAllReduce(layout, 0, rank, intra, solo[rank])
            for i, size in enumerate((1, 2, 5, 4099)):
                check_sum(ar, intra, rank, size, torch.float32, 90 + k * 10 + i, asynchronous=bool(i % 2))
        checked.append(f"ring of {k} in a host")

    with open(os.path.join(out, f"rank_{rank}.json"), "w") as f:
        json.dump({"rank": rank, "checked": checked}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
