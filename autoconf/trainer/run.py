"""One rank's training run: groups, model share, optimizer, steps, measurements.

The parts, one file per technique: parallel_dims (groups in rank order), pipeline (stages and
schedules), accumulation (pp = 1: standard or layered), data_parallel (ZeRO 0-3), memory.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import time

from ..config import ParallelConfig, check, layers_per_chunk
from ..model import ModelSpec
from .main import ADAMW, median_after_warmup


class TrainerError(RuntimeError):
    """A configuration the trainer cannot run (reported as a failed trial)."""


def load(path: str):
    with open(path) as f:
        doc = json.load(f)
    model = ModelSpec.from_dict(doc["model"])
    config = ParallelConfig.from_dict(doc["config"])
    reason = check(config, model)
    if reason:
        raise TrainerError(f"invalid configuration ({config.short()}): {reason}")
    return doc, model, config, int(doc.get("seed", 0))


def setup(config: ParallelConfig, timeout_s: float):
    """Init the default process group (gloo on CPU, nccl on CUDA) and this rank's groups."""
    import torch
    import torch.distributed as dist

    from .parallel_dims import ParallelDims, build_groups

    timeout = datetime.timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ParallelDims(config.dp, config.pp, config.tp, config.rank_order)
    try:
        dims.validate(world)
    except ValueError as e:
        raise TrainerError(str(e)) from None
    groups = build_groups(dims, rank, timeout)
    if config.dp_all_reduce == "hierarchical" and config.dp > 1:
        add_hierarchical(groups, rank, timeout)
    return device, backend, groups


def add_hierarchical(groups, rank: int, timeout, host_mapping=None) -> None:
    """Build the hierarchical data-parallel all-reduce (every rank, every dp group's subgroups in
    the same order) from where each rank runs (``collectives.rank_hosts``); a group that cannot run
    it stays flat and the rank says so on stderr."""
    import sys

    from . import collectives

    try:
        host_of = collectives.rank_hosts(host_mapping)
    except ValueError as e:
        raise TrainerError(str(e)) from None
    groups.dp_all_reduce, groups.dp_all_reduce_note = collectives.build(groups.dims.groups("dp"), host_of, rank,
                                                                        timeout)
    if groups.dp_all_reduce is None:
        print(f"rank {rank}: dp_all_reduce: {groups.dp_all_reduce_note}", file=sys.stderr, flush=True)


def chunk_layers(model: ModelSpec, config: ParallelConfig) -> list[list[int]]:
    """Global layer indices of each pipeline chunk (uneven splits as config.layers_per_chunk)."""
    out, start = [], 0
    for n in layers_per_chunk(model.num_layers, config.num_chunks):
        out.append(list(range(start, start + n)))
        start += n
    return out


def train(args, rank: int, watchdog) -> dict:
    import torch

    from .. import nn as gpt
    from . import data, data_parallel, memory

    doc, model, config, seed = load(args.config)
    if model.tied_embeddings and config.zero_stage == 3:
        raise TrainerError("tied embeddings with zero_stage=3 are not supported by this trainer "
                           "(FSDP2 cannot shard one weight used by two units)")
    watchdog.start("rendezvous")
    device, backend, groups = setup(config, args.step_timeout)
    watchdog.stop()
    torch.manual_seed(seed)
    dtype = gpt.TORCH_DTYPES[model.dtype]
    tp_group = groups.tp if config.tp > 1 else None
    common = dict(tp_size=config.tp, tp_group=tp_group, sequence_parallel=config.sequence_parallel,
                  recompute=config.recompute, dtype=dtype, seed=seed, device=device)

    layers = chunk_layers(model, config)
    if config.pp == 1:
        from .single import SingleStage as Runner
    else:
        from .piped import Piped as Runner
    runner = Runner(model, config, groups, device, layers, common)
    optimizer, tracked_opt = _make_optimizer(runner, config, groups, data_parallel)

    steps, warmup = args.steps, args.warmup
    mem_step = min(1, steps - 1) if warmup >= 2 or steps == 1 else steps - 1
    losses, step_times, timed, probes = [], [], [], []
    peak, breakdown, method = None, {}, ""
    for step in range(steps):
        x, y = data.replica_batch(step, config.global_batch, model.seq_length, model.vocab_size, seed,
                                  groups.dp_rank, config.dp)
        x, y = x.to(device), y.to(device)
        watchdog.start(f"step {step}")
        torch.distributed.barrier(group=None)

        def one_step():
            local = runner.step(x, y)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return local

        t0 = time.perf_counter()
        if step == mem_step:
            local, peak, breakdown, method = memory.measure(one_step, device, runner.modules(),
                                                            [tracked_opt])
        else:
            local = one_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_times.append(time.perf_counter() - t0)
        timed.append(step >= warmup and step != mem_step)
        losses.append(_global_loss(local, runner, groups, config, device))
        if getattr(args, "speed_probe", False) and timed[-1]:
            probes.append(speed_probe(model, device, dtype))
        watchdog.stop()

    return {
        "rank": rank, "ok": True, "reason": "", "host": socket.gethostname(), "coords": groups.coords,
        "chunks": runner.chunk_ids,
        "layers": [layers[c] for c in runner.chunk_ids], "backend": backend, "device": str(device),
        "torch_version": torch.__version__, "config": config.to_dict(), "model": model.to_dict(),
        "step_times_s": step_times, "timed": timed, "step_time_s": median_after_warmup(step_times, timed),
        "peak_memory_bytes": peak, "memory_breakdown": breakdown, "memory_method": method,
        "memory_step": mem_step, "losses": losses, "dp_all_reduce": groups.dp_all_reduce_note,
        "speed_probe_s": statistics.median(probes) if probes else None,
        "local_parameters": sum(_numel_local(p) for m in runner.modules() for p in m.parameters()),
    }


def speed_probe(model: ModelSpec, device, dtype, repeats: int = 3) -> float:
    """How fast this machine runs now: the median of ``repeats`` forward+backward passes of one
    transformer block at micro-batch size 1, tp 1, no recomputation (after one warm-up), the
    measurement the profile also holds. The ranks take turns (barriers), as the profiler measured
    alone; the block is built and freed here, outside the timed and memory-tracked steps."""
    import torch
    import torch.distributed as dist

    from .. import nn as gpt

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    mine = None
    for r in range(dist.get_world_size()):
        dist.barrier()
        if r != dist.get_rank():
            continue
        block = gpt.Block(model, dtype=dtype, device=device)
        x = torch.randn(1, model.seq_length, model.hidden_size, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn_like(x)
        times = []
        for i in range(repeats + 1):
            sync()
            t0 = time.perf_counter()
            block(x).backward(g)
            sync()
            if i:
                times.append(time.perf_counter() - t0)
        mine = statistics.median(times)
        del block, x, g
    dist.barrier()
    return mine


def _numel_local(p) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def _make_optimizer(runner, config, groups, data_parallel):
    """AdamW (ZeRO-0/3) or ShardedAdamW (ZeRO-1/2); returns (optimizer, torch optimizer to track)."""
    import torch

    params = runner.parameters()
    if config.zero_stage in (1, 2):
        opt = data_parallel.ShardedAdamW(params, groups.dp, groups.dp_ranks, groups.dp_rank,
                                         runner.grad_sync.owner, **ADAMW)
        return opt, opt.tracked()
    opt = torch.optim.AdamW(params, **ADAMW)
    return opt, opt


def _global_loss(local: list, runner, groups, config, device) -> float:
    """Mean loss over the global batch: the last stage's tp-rank-0 losses summed over the world / dp."""
    import torch
    import torch.distributed as dist

    mine = runner.is_last and groups.tp_rank == 0 and local
    t = torch.tensor([sum(local) / len(local) if mine else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / config.dp
