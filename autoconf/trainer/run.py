"""One rank's training run: groups, model share, optimizer, steps, measurements.

The parts, one file per technique: process_groups (groups in rank order), pipeline (stages and
schedules), accumulation (pp = 1: standard or layered), data_parallel (ZeRO 0-3), memory.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import time

from autoconf.launch.plan import load as load_plan
from autoconf.space.config import ParallelConfig
from autoconf.space.placement import Placement
from autoconf.specs.model import ModelSpec


class TrainerError(RuntimeError):
    """A configuration the trainer cannot run (reported as a failed trial)."""


def setup(config: ParallelConfig, timeout_s: float):
    """Init the default process group (gloo on CPU, nccl on CUDA) and this rank's groups.

    The launch starts the process of device d with torchrun's ``RANK`` = d (and ``LOCAL_RANK``
    its GPU on the host). With a device order it plays rank ``Placement.rank_on(d)`` of the rank
    order: the default group is started at that rank, so every group, stage and shard below
    follows the placement (on CPU processes this only permutes which process plays which
    coordinate)."""
    import torch
    import torch.distributed as dist

    from autoconf.trainer.process_groups import build_groups

    timeout = datetime.timedelta(seconds=timeout_s)
    set_matmul_precision(config)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    degrees = config.degrees
    if config.device_order is None:
        dist.init_process_group(backend, timeout=timeout)
        world, rank = dist.get_world_size(), dist.get_rank()
    else:  # rank remapped: check the world first (a device beyond the order has no rank to play)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = None
    try:
        degrees.validate(world)
    except ValueError as e:
        raise TrainerError(str(e)) from None
    if rank is None:
        rank = Placement.of(config, 0).rank_on(int(os.environ["RANK"]))
        dist.init_process_group(backend, timeout=timeout, store=_store(world, timeout), rank=rank,
                                world_size=world)
    groups = build_groups(degrees, rank, timeout, fused_embedding=config.fused_embedding_sync and config.pp > 1)
    if config.dp_all_reduce == "hierarchical" and config.dp * config.cp > 1:
        add_hierarchical(groups, rank, timeout)
    return device, backend, groups


def add_hierarchical(groups, rank: int, timeout, host_mapping=None) -> None:
    """Build the hierarchical data-parallel all-reduce (every rank, every dp group's subgroups in
    the same order) from where each rank runs (``collectives.rank_hosts``); a group that cannot run
    it stays flat and the rank says so on stderr."""
    import sys

    from autoconf.trainer import collectives

    try:
        host_of = collectives.rank_hosts(host_mapping)
    except ValueError as e:
        raise TrainerError(str(e)) from None
    groups.dp_all_reduce, groups.dp_all_reduce_note = collectives.build(groups.degrees.grad_groups(), host_of, rank,
                                                                        timeout)
    if groups.dp_all_reduce is None:
        print(f"rank {rank}: dp_all_reduce: {groups.dp_all_reduce_note}", file=sys.stderr, flush=True)


def _store(world: int, timeout):
    """The rendezvous store the default group would get from ``env://`` (torchrun's agent store,
    else a TCPStore hosted by the process with RANK 0 at MASTER_ADDR), for starting the group at a
    rank other than the launcher's ``RANK``."""
    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(addr, port, world, is_master=not agent and int(os.environ["RANK"]) == 0,
                          timeout=timeout)
    return dist.PrefixStore("default_pg", store)


def fp8_recipe(config: ParallelConfig) -> str | None:
    """The FP8 recipe of the blocks' linear layers (None: every GEMM in the model's dtype); a recipe
    ``autoconf.trainer.fp8`` does not implement is a TrainerError naming the valid ones."""
    if config.precision != "fp8":
        return None
    from autoconf.trainer.fp8 import RECIPES

    if config.fp8_recipe not in RECIPES:
        raise TrainerError(f"fp8_recipe={config.fp8_recipe!r} is not implemented by the reference trainer; "
                           f"valid: {', '.join(RECIPES)}")
    return config.fp8_recipe


def set_matmul_precision(config: ParallelConfig) -> None:
    """precision tf32: an fp32 model's matmuls and convolutions on TF32 tensor cores (PyTorch's
    ``allow_tf32`` switches; CPUs have none and ignore them); else PyTorch's defaults (fp32 matmuls
    in full fp32)."""
    if config.precision == "tf32":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def refuse_cp(model: ModelSpec, config: ParallelConfig) -> None:
    """The context-parallel combinations this trainer cannot run, as a TrainerError (one line)."""
    if config.cp > 1 and model.dropout > 0 and model.attention == "eager":
        raise TrainerError(f"cp={config.cp} with attention dropout ({model.dropout}, eager attention) is not "
                           "supported by this trainer's ring attention: set dropout to 0")


def refuse_moe(model: ModelSpec, config: ParallelConfig) -> None:
    """The mixture-of-experts combinations this trainer cannot run, as a TrainerError (one line)."""
    if config.ep > 1 and config.zero_stage > 1:
        raise TrainerError(f"ep={config.ep} with zero_stage={config.zero_stage} is not supported by this trainer "
                           "(expert gradients are reduced over their own group): use zero_stage 0 or 1")


def token_data(args, model: ModelSpec):
    """The ``--data-file``'s bytes as tokens (None: synthetic tokens); a TrainerError (one line) when
    the vocabulary cannot hold a byte or the file is shorter than one sequence."""
    path = getattr(args, "data_file", None)
    if path is None:
        return None
    from autoconf.trainer import data

    if model.vocab_size < 256:
        raise TrainerError(f"--data-file: token ids are bytes (0..255): vocab_size={model.vocab_size} must be >= 256")
    try:
        tokens = data.load_bytes(path)
    except OSError as e:
        raise TrainerError(f"--data-file {path}: {e.strerror or e}") from None
    if tokens.numel() < model.seq_length + 1:
        raise TrainerError(f"--data-file {path}: {tokens.numel()} bytes, a sequence needs seq_length + 1 = "
                           f"{model.seq_length + 1}")
    return tokens


def chunk_layers(model: ModelSpec, config: ParallelConfig) -> list[list[int]]:
    """Global layer indices of each pipeline chunk: the placement's ``stage_layers``, else as even
    as possible (``placement.Placement.chunk_layers``)."""
    return Placement.of(config, model.num_layers).chunk_layers()


def train(args, rank: int, watchdog) -> dict:
    import torch

    from autoconf.trainer import data, data_parallel, memory
    from autoconf.trainer import layers as gpt

    plan = load_plan(args.config)  # checked: a bad plan is a one-line reason
    model, config, seed = plan.model, plan.config, plan.seed
    if model.tied_embeddings and config.zero_stage == 3:
        raise TrainerError("tied embeddings with zero_stage=3 are not supported by this trainer "
                           "(FSDP2 cannot shard one weight used by two units)")
    refuse_cp(model, config)
    refuse_moe(model, config)
    tokens = token_data(args, model)
    watchdog.start("rendezvous")
    device, backend, groups = setup(config, args.step_timeout)
    watchdog.stop()
    torch.manual_seed(seed)
    dtype = gpt.TORCH_DTYPES[model.dtype]
    tp_group = groups.tp if config.tp > 1 else None
    common = dict(tp_size=config.tp, tp_group=tp_group, sequence_parallel=config.sequence_parallel,
                  recompute=config.recompute, dtype=dtype, seed=seed, device=device,
                  fp8_recipe=fp8_recipe(config), cp_size=config.cp, cp_group=groups.cp if config.cp > 1 else None,
                  ep_size=config.ep, ep_group=groups.ep, moe_capacity_factor=config.moe_capacity_factor)

    layers = chunk_layers(model, config)
    if config.pp == 1:
        from autoconf.trainer.single import SingleStage as Runner
    else:
        from autoconf.trainer.piped import Piped as Runner
    runner = Runner(model, config, groups, device, layers, common)
    optimizer, tracked_opt = _make_optimizer(runner, config, groups, data_parallel)

    a2a = []  # per step: the MoE all-to-all bytes this rank sent (autoconf.trainer.moe.A2A_BYTES)
    comm = []  # per step: runner.comm_bytes()
    steps, warmup = args.steps, args.warmup
    mem_step = min(1, steps - 1) if warmup >= 2 or steps == 1 else steps - 1
    losses, step_times, timed, probes = [], [], [], []
    peak, breakdown, method = None, {}, ""
    for step in range(steps):
        x, y = data.replica_batch(step, config.global_batch, model.seq_length, model.vocab_size, seed,
                                  groups.dp_rank, config.dp, tokens)
        x, y = data.cp_shard(x, y, config.cp, groups.cp_rank)
        x, y = x.to(device), y.to(device)
        watchdog.start(f"step {step}")
        torch.distributed.barrier(group=None)

        def one_step():
            local = runner.step(x, y)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return local

        if model.is_moe:
            from autoconf.trainer import moe

            moe.reset_a2a_bytes()
        t0 = time.perf_counter()
        if step == mem_step:
            local, peak, breakdown, method = memory.measure(one_step, device, runner.modules(),
                                                            tracked_opt if isinstance(tracked_opt, list)
                                                            else [tracked_opt])
        else:
            local = one_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_times.append(time.perf_counter() - t0)
        comm.append(runner.comm_bytes())
        if model.is_moe:
            a2a.append(dict(moe.A2A_BYTES))
        timed.append(step >= warmup and step != mem_step)
        losses.append(_global_loss(local, runner, groups, config, device))
        if getattr(args, "speed_probe", False) and timed[-1]:
            probes.append(speed_probe(model, device, dtype))
        watchdog.stop()

    return {
        "rank": rank, "ok": True, "reason": "", "host": socket.gethostname(), "placement_rank": groups.rank,
        "coords": groups.coords,
        "chunks": runner.chunk_ids,
        "layers": [layers[c] for c in runner.chunk_ids], "backend": backend, "device": str(device),
        "torch_version": torch.__version__, "config": config.to_dict(), "model": model.to_dict(),
        "step_times_s": step_times, "timed": timed, "step_time_s": median_after_warmup(step_times, timed),
        "peak_memory_bytes": peak, "memory_breakdown": breakdown, "memory_method": method,
        "memory_step": mem_step, "losses": losses, "dp_all_reduce": groups.dp_all_reduce_note,
        "speed_probe_s": statistics.median(probes) if probes else None,
        "local_parameters": sum(_numel_local(p) for m in runner.modules() for p in m.parameters()),
        # hidden-vector bytes this rank sent to other ranks in the MoE all-to-alls, per kind
        # (autoconf.trainer.moe.A2A_BYTES): the last step's, and every step's (under pp the first step's also
        # hold torch.distributed.pipelining's metadata inference through each stage)
        "moe_a2a_bytes": a2a[-1] if a2a else None, "moe_a2a_bytes_per_step": a2a or None,
        # bytes this rank handed to communication in a step (trainer.compression.CommCounter): "pp_send":
        # {peer global rank: {"forward": activation bytes, "backward": gradient bytes (P + Q when
        # compressed)}} of the pipeline's data isends (not torch's first-step metadata objects);
        # "dp_payload": the data-parallel gradient collectives' buffers (ZeRO-0/1 all-reduce, ZeRO-2
        # reduces; PowerSGD: exact part + Ps + Qs; None under ZeRO-3); "embedding_payload": the tied
        # embedding's sync. The last step's, and every step's.
        "comm_bytes": comm[-1] if comm else None, "comm_bytes_per_step": comm,
    }


def speed_probe(model: ModelSpec, device, dtype, repeats: int = 3) -> float:
    """How fast this machine runs now: the median of ``repeats`` forward+backward passes of one
    transformer block at micro-batch size 1, tp 1, no recomputation (after one warm-up), the
    measurement the profile also holds. The ranks take turns (barriers), as the profiler measured
    alone; the block is built and freed here, outside the timed and memory-tracked steps."""
    import torch
    import torch.distributed as dist

    from autoconf.trainer import layers as gpt

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
    if config.zero_stage == 1 and config.ep > 1:  # dense and expert parameters each over their group
        sync = runner.grad_sync
        opts = [data_parallel.ShardedAdamW(sync.dense.params, groups.grad, groups.grad_ranks, groups.grad_rank,
                                           sync.dense.owner, **ADAMW),
                data_parallel.ShardedAdamW(sync.experts.params, groups.edp, groups.edp_ranks,
                                           groups.edp_ranks.index(groups.rank), sync.experts.owner, **ADAMW)]
        both = data_parallel.Optimizers(opts)
        return both, both.tracked()
    if config.zero_stage in (1, 2):
        opt = data_parallel.ShardedAdamW(params, groups.grad, groups.grad_ranks, groups.grad_rank,
                                         runner.grad_sync.owner, **ADAMW)
        return opt, opt.tracked()
    opt = torch.optim.AdamW(params, **ADAMW)
    return opt, opt


def _global_loss(local: list, runner, groups, config, device) -> float:
    """Mean loss over the global batch: the last stage's tp-rank-0 losses summed over the world / (dp x cp)
    (each cp rank's loss is the mean over its s/cp tokens of every sequence: their mean is the mean
    over all tokens)."""
    import torch
    import torch.distributed as dist

    mine = runner.is_last and groups.tp_rank == 0 and local
    t = torch.tensor([sum(local) / len(local) if mine else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / (config.dp * config.cp)


ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-8}
"""Optimizer settings (the tests' single-process reference uses the same)."""


def median_after_warmup(step_times: list[float], timed: list[bool]) -> float | None:
    xs = [t for t, keep in zip(step_times, timed) if keep]
    return statistics.median(xs) if xs else None
