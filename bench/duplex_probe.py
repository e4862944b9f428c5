"""Do transfers between two ranks in opposite directions at once share the link? (torchrun worker)

One rank per node of the emulated testbed; each pass times 3 sends of MB MiB one way, then 3
exchanges (both ranks send and receive MB MiB at once, ``batch_isend_irecv`` as the pipeline
schedules fuse them):

    autoconf testbed --rates 100mbit,100mbit --nproc-per-node 1 -- bash -c 'torchrun --nnodes {nnodes} \\
        --node-rank {node_rank} --master-addr {master_addr} --master-port {master_port} \\
        --nproc-per-node 1 bench/duplex_probe.py'

A full-duplex link takes about as long both ways as one way; a link whose directions share it, twice.
Measured here (2 MiB at 100 Mbit/s): 175 ms one way; both ways 350 ms with the sends posted first
(gloo's TCP pair then queues this rank's "ready to receive" behind its own data, so the peer's send
waits: the directions serialise), 186 ms with the receives posted first. The link is full duplex;
the reference trainer posts receives first (``trainer.pipeline.post_receives_first``).
"""

import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    r = dist.get_rank()
    peer = 1 - r
    n = int(os.environ.get("MB", "2")) << 20
    a, b = torch.ones(n // 4), torch.empty(n // 4)

    def one_way():
        if r == 0:
            dist.send(a, 1)
        else:
            dist.recv(b, 0)

    def sends_first():
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, a, peer), dist.P2POp(dist.irecv, b, peer)]):
            w.wait()

    def receives_first():
        for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, peer), dist.P2POp(dist.isend, a, peer)]):
            w.wait()

    for name, fn in (("one way", one_way), ("both ways, sends first", sends_first),
                     ("both ways, receives first", receives_first)) * 2:
        dist.barrier()
        t = time.perf_counter()
        for _ in range(3):
            fn()
        dist.barrier()
        if r == 0:
            print(f"{name}: {(time.perf_counter() - t) / 3 * 1e3:.1f} ms for {n / 2**20:.0f} MiB", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
