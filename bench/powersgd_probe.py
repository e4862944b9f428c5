"""What torch's PowerSGD hook costs a rank beside the transfers (torchrun worker, gloo, 1 thread).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/powersgd_probe.py [MODEL.json] [RANK]

Builds the reference trainer's model (default: the one ``bench/compression.py speed`` trains,
committed with its testbed run), gives every parameter a random gradient, flattens them into one
bucket as the trainer's data-parallel sync does, and times, over loopback: a plain all-reduce of
the bucket, the trainer's PowerSGD launch (``powerSGD_hook`` on ``trainer.compression``'s bucket,
past its plain steps) and a 4 KB all-reduce (the latency of each of the hook's three chained
all-reduces). Over loopback the transfers are nearly free, so the hook's time is its kernels:
compare with ``cost.powersgd.powersgd_bucket``'s kernel time at a full core. Measured
2026-11-24 on the 2-core VM, two runs: plain 6.3 / 7.0 ms, PowerSGD 24.2 / 26.6 ms median (15.1 /
12.1 ms min), 4 KB all-reduce 0.6 / 2.9 ms median; the model's kernels for the same bucket: 16.5 ms
(33.0 ms at the committed testbed profile's half core, 16.5 at a full one).
"""

import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    from autoconf.specs.hf import load_model
    from autoconf.trainer.compression import PowerSGDBucket, end_step, powersgd_state
    from autoconf.trainer.layers import GPT

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "bench", "data",
                                                              "testbed-compression-2026-11-24", "model.json")
    approx_rank = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    params = list(GPT(load_model(path)).parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    flat = _flatten_dense_tensors([p.grad for p in params])
    state = powersgd_state(dist.group.WORLD, approx_rank)
    small = torch.zeros(1024)

    def plain():
        dist.all_reduce(flat)

    def powersgd():
        powerSGD_hook(state, PowerSGDBucket(0, flat, params)).wait()
        end_step(state)

    def latency():
        dist.all_reduce(small)

    for name, fn in (("plain all-reduce", plain), ("PowerSGD hook", powersgd), ("4 KB all-reduce", latency)):
        for _ in range(4):  # warm-up, and PowerSGD's plain steps
            fn()
        times = []
        for _ in range(15):
            dist.barrier()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        if rank == 0:
            print(f"{name}: median {statistics.median(times) * 1e3:.2f} ms, min {min(times) * 1e3:.2f} ms", flush=True)
    if rank == 0:
        print(f"{sum(p.numel() for p in params):,} parameters, bucket {flat.numel() * 4 / 2**20:.1f} MiB, "
              f"rank {approx_rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
