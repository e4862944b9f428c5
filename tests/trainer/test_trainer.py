"""End to end: the reference trainer under torchrun (CPU, gloo, one thread per process) gives the
same losses as a single-process run of the same model on the same global batch, for every axis."""

from __future__ import annotations

import dataclasses

import pytest

from autoconf.launch.plan import LaunchPlan
from autoconf.runs.trial import run_trial
from autoconf.space.config import ParallelConfig, check
from autoconf.specs.model import preset

torch = pytest.importorskip("torch")

STEPS = 3
GLOBAL_BATCH = 8
SEED = 1234
TINY = preset("tiny")
TINY_TIED = dataclasses.replace(TINY, tied_embeddings=True, name="tiny-tied")


def reference_losses(model, steps: int = STEPS, seed: int = SEED) -> list[float]:
    """One process, no parallelism, the whole global batch as one micro-batch."""
    from autoconf.trainer import layers as gpt
    from autoconf.trainer.data import global_batch
    from autoconf.trainer.run import ADAMW

    torch.manual_seed(seed)
    net = gpt.GPT(model, dtype=torch.float32, seed=seed)
    opt = torch.optim.AdamW(net.parameters(), **ADAMW)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, GLOBAL_BATCH, model.seq_length, model.vocab_size, seed)
        loss = net(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def cfg(dp=1, pp=1, tp=1, mbs=1, **kw) -> ParallelConfig:
    m = GLOBAL_BATCH // (dp * mbs)
    return ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=mbs, num_micro_batches=m, **kw)


# Every axis at least once, at most 4 processes; each line is one torchrun launch.
CASES = [
    ("dp2-standard", TINY, cfg(dp=2, mbs=2)),
    ("dp2-layered-zero1-selective", TINY, cfg(dp=2, mbs=2, layered_grad_accum=True, zero_stage=1, recompute="selective")),
    ("dp2-layered-zero3-full", TINY, cfg(dp=2, mbs=1, layered_grad_accum=True, zero_stage=3, recompute="full")),
    ("dp2-zero2-tied", TINY_TIED, cfg(dp=2, mbs=2, zero_stage=2)),
    ("tp2-sp-selective-layered", TINY, cfg(tp=2, mbs=2, sequence_parallel=True, recompute="selective", layered_grad_accum=True)),
    ("pp2-gpipe-full", TINY, cfg(pp=2, mbs=2, schedule="gpipe", recompute="full")),
    ("pp2-interleaved-v2", TINY, cfg(pp=2, mbs=2, schedule="interleaved", virtual_stages=2)),
    ("pp2-breadth_first-v2-tied", TINY_TIED, cfg(pp=2, mbs=2, schedule="breadth_first", virtual_stages=2, layered_grad_accum=True)),
    ("dp2-pp2-1f1b-zero1", TINY, cfg(dp=2, pp=2, mbs=1, schedule="1f1b", zero_stage=1)),
    ("dp2-pp2-1f1b-zero2-tied", TINY_TIED, cfg(dp=2, pp=2, mbs=1, schedule="1f1b", zero_stage=2)),
    ("dp2-pp2-gpipe-layered-zero2-tied", TINY_TIED, cfg(dp=2, pp=2, mbs=1, schedule="gpipe", layered_grad_accum=True, zero_stage=2)),
    ("dp2-pp2-1f1b-zero3", TINY, cfg(dp=2, pp=2, mbs=2, schedule="1f1b", zero_stage=3)),
    ("pp2-tp2-sp-interleaved", TINY, cfg(pp=2, tp=2, mbs=2, schedule="interleaved", virtual_stages=2, sequence_parallel=True)),
    ("dp2-tp2-zero2-sp", TINY, cfg(dp=2, tp=2, mbs=2, zero_stage=2, sequence_parallel=True)),
    ("dp2-tp2-zero3-sp-layered", TINY, cfg(dp=2, tp=2, mbs=2, zero_stage=3, sequence_parallel=True, layered_grad_accum=True)),
    ("dp2-tp2-order-dp-tp-pp", TINY, cfg(dp=2, tp=2, mbs=1, rank_order="dp-tp-pp")),
]

_REFERENCE: dict = {}


def trial_matches_single_process(model, config, tmp_path, abs_tol: float = 1e-5):
    """Run ``config`` under torchrun and check its losses against one process's (cached per model)."""
    assert check(config, model) is None, check(config, model)
    if model.name not in _REFERENCE:
        _REFERENCE[model.name] = reference_losses(model)
    expected = _REFERENCE[model.name]
    result = run_trial(LaunchPlan(config, model, seed=SEED), steps=STEPS, warmup=1, timeout_s=180,
                       out_dir=str(tmp_path))
    assert result.ok, result.reason
    assert len(result.losses) == STEPS
    assert result.losses == pytest.approx(expected, rel=1e-5, abs=abs_tol), (result.losses, expected)
    return result


@pytest.mark.e2e
@pytest.mark.parametrize("name,model,config", CASES, ids=[c[0] for c in CASES])
def test_losses_match_single_process(name, model, config, tmp_path):
    result = trial_matches_single_process(model, config, tmp_path)
    assert result.step_time_s and result.step_time_s > 0
    assert result.peak_memory_bytes and result.peak_memory_bytes > 0
    assert len(result.per_rank) == config.world_size


@pytest.mark.e2e
def test_wrong_world_size_fails_cleanly(tmp_path):
    result = run_trial(LaunchPlan(cfg(dp=2, mbs=2), TINY), steps=2, warmup=1, timeout_s=120, nproc=1,
                       out_dir=str(tmp_path))
    assert not result.ok
    assert "world_size(1)" in result.reason


@pytest.mark.e2e
def test_wall_timeout_kills_the_run():
    result = run_trial(LaunchPlan(cfg(dp=2, mbs=2), TINY), steps=1000, warmup=1, timeout_s=2)
    assert not result.ok
    assert "timed out after 2 s" in result.reason
    assert result.wall_s < 30


@pytest.mark.e2e
def test_step_timeout_reports_failure(tmp_path):
    result = run_trial(LaunchPlan(cfg(dp=2, mbs=2), TINY), steps=3, warmup=1, timeout_s=120,
                       step_timeout_s=0.05, out_dir=str(tmp_path))
    assert not result.ok
    assert "exceeded the step timeout" in result.reason or "timed out" in result.reason.lower()


def _peaks(config, model, tmp_path) -> dict:
    """Peak memory bytes of one trial, by rank."""
    result = run_trial(LaunchPlan(config, model, seed=SEED), steps=STEPS, warmup=1, timeout_s=180,
                       out_dir=str(tmp_path))
    assert result.ok, result.reason
    return {r["rank"]: r["peak_memory_bytes"] for r in result.per_rank}


@pytest.mark.e2e
def test_zero2_partitions_gradients(tmp_path):
    """Standard accumulation over 4 micro-batches: ZeRO-2 keeps only its own 1/dp of the gradients
    (plus one bucket in flight), so every rank peaks lower than under ZeRO-1 by at least the
    gradients it does not own, less the largest bucket (a block) and the partition's imbalance."""
    from autoconf.trainer import layers as gpt

    net = gpt.GPT(TINY, dtype=torch.float32)
    grad_bytes = 4 * sum(p.numel() for p in net.parameters())
    bucket = 4 * max(sum(p.numel() for p in u.parameters()) for u in [net.embedding, *net.blocks.values(), net.head])
    largest = 4 * max(p.numel() for p in net.parameters())
    dp = 2
    z1 = _peaks(cfg(dp=dp, mbs=1, zero_stage=1), TINY, tmp_path / "z1")
    z2 = _peaks(cfg(dp=dp, mbs=1, zero_stage=2), TINY, tmp_path / "z2")
    saving = (1 - 1 / dp) * grad_bytes - bucket - largest
    assert saving > 0
    for rank in z1:
        assert z1[rank] - z2[rank] >= saving, (rank, z1[rank], z2[rank], saving)


# The losses above cannot tell a gradient off by a constant factor (AdamW is nearly scale-invariant):
# compare ZeRO-2's gradients with ZeRO-1's (a full all-reduce) right after one step's backward.
GRAD_CASES = [
    ("dp2-standard", TINY_TIED, cfg(dp=2, mbs=1)),
    ("dp2-layered", TINY, cfg(dp=2, mbs=2, layered_grad_accum=True)),
    ("dp2-pp2-1f1b-tied", TINY_TIED, cfg(dp=2, pp=2, mbs=1, schedule="1f1b")),
    ("dp2-pp2-gpipe", TINY, cfg(dp=2, pp=2, mbs=2, schedule="gpipe")),
    ("dp2-pp2-interleaved-v2", TINY, cfg(dp=2, pp=2, mbs=1, schedule="interleaved", virtual_stages=2)),
    ("dp2-tp2-sp", TINY, cfg(dp=2, tp=2, mbs=2, sequence_parallel=True, recompute="selective")),
]


def _grads_worker(rank: int, world: int, port: int, cases: list) -> None:
    """One rank: for each (model, config), one step of ZeRO-1 and of ZeRO-2 on the same batch; every
    gradient ZeRO-2 leaves (the owner's) equals ZeRO-1's, and it leaves exactly the owned ones."""
    import datetime
    import os

    import torch.distributed as dist

    from autoconf.space.degrees import Degrees
    from autoconf.trainer import data
    from autoconf.trainer.process_groups import build_groups
    from autoconf.trainer.run import chunk_layers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    for model, config in cases:
        groups = build_groups(Degrees(config.dp, config.pp, config.tp, config.rank_order), rank, timeout)
        common = dict(tp_size=config.tp, tp_group=groups.tp if config.tp > 1 else None,
                      sequence_parallel=config.sequence_parallel, recompute=config.recompute,
                      dtype=torch.float32, seed=SEED, device=torch.device("cpu"))
        if config.pp == 1:
            from autoconf.trainer.single import SingleStage as Runner
        else:
            from autoconf.trainer.piped import Piped as Runner
        x, y = data.replica_batch(0, GLOBAL_BATCH, model.seq_length, model.vocab_size, SEED,
                                  groups.dp_rank, config.dp)
        grads = {}
        for zero in (1, 2):
            runner = Runner(model, dataclasses.replace(config, zero_stage=zero), groups, torch.device("cpu"),
                            chunk_layers(model, config), common)
            runner.step(x, y)
            grads[zero] = {n: p.grad for m in runner.modules() for n, p in m.named_parameters()}
            owned = {n for m in runner.modules() for n, p in m.named_parameters()
                     if runner.grad_sync.owner[id(p)] == groups.dp_rank}
        assert {n for n, g in grads[2].items() if g is not None} == owned, config.short()
        for n in owned:
            torch.testing.assert_close(grads[2][n], grads[1][n], rtol=1e-5, atol=1e-7, msg=f"{config.short()} {n}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.e2e
@pytest.mark.parametrize("world", [2, 4])
def test_zero2_gradients_match_zero1(world):
    import socket

    import torch.multiprocessing as mp

    cases = [(model, config) for _, model, config in GRAD_CASES if config.world_size == world]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_grads_worker, args=(world, port, cases), nprocs=world)


# The hierarchical data-parallel all-reduce (dp_all_reduce="hierarchical"): 4 processes declared as
# 2 hosts x 2 (interleaved: ranks 0 and 2 on one host), so dp=4 runs the two-level algorithm.
HOSTS_2X2 = "a,b,a,b"


@pytest.mark.e2e
def test_hierarchical_all_reduce_trains_like_flat(tmp_path):
    config = cfg(dp=4, mbs=1, dp_all_reduce="hierarchical")
    assert check(config, TINY) is None
    if TINY.name not in _REFERENCE:
        _REFERENCE[TINY.name] = reference_losses(TINY)
    result = run_trial(LaunchPlan(config, TINY, seed=SEED), steps=STEPS, warmup=1, timeout_s=180,
                       out_dir=str(tmp_path), env_extra={"AUTOCONF_RANK_HOSTS": HOSTS_2X2})
    assert result.ok, result.reason
    assert {r["dp_all_reduce"] for r in result.per_rank} == {"hierarchical (2 hosts x 2)"}
    assert result.losses == pytest.approx(_REFERENCE[TINY.name], rel=1e-5, abs=1e-5)


HIER_GRAD_CASES = [
    ("dp4-zero0-tied", TINY_TIED, cfg(dp=4, mbs=1)),
    ("dp4-layered-zero1", TINY, cfg(dp=4, mbs=1, layered_grad_accum=True, zero_stage=1)),
]


def _hier_grads_worker(rank: int, world: int, port: int, cases: list) -> None:
    """One rank: one step with the flat and one with the hierarchical all-reduce on the same batch;
    the gradients agree, and every dp rank holds the same hierarchical gradients bit for bit."""
    import datetime
    import os

    import torch.distributed as dist

    from autoconf.space.degrees import Degrees
    from autoconf.trainer import data
    from autoconf.trainer.process_groups import build_groups
    from autoconf.trainer.run import add_hierarchical, chunk_layers
    from autoconf.trainer.single import SingleStage

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    for model, config in cases:
        flat = build_groups(Degrees(config.dp, config.pp, config.tp, config.rank_order), rank, timeout)
        hier = dataclasses.replace(flat)
        add_hierarchical(hier, rank, timeout, host_mapping=HOSTS_2X2)
        assert hier.dp_all_reduce is not None, hier.dp_all_reduce_note
        common = dict(tp_size=1, tp_group=None, sequence_parallel=False, recompute="none",
                      dtype=torch.float32, seed=SEED, device=torch.device("cpu"))
        x, y = data.replica_batch(0, GLOBAL_BATCH, model.seq_length, model.vocab_size, SEED,
                                  flat.dp_rank, config.dp)
        grads = {}
        for mode, groups in (("flat", flat), ("hierarchical", hier)):
            c = dataclasses.replace(config, dp_all_reduce=mode)
            runner = SingleStage(model, c, groups, torch.device("cpu"), chunk_layers(model, c), common)
            runner.step(x, y)
            grads[mode] = {n: p.grad for n, p in runner.stage.named_parameters()}
        assert grads["flat"].keys() == grads["hierarchical"].keys()
        for n, g in grads["flat"].items():
            torch.testing.assert_close(grads["hierarchical"][n], g, rtol=1e-5, atol=1e-7, msg=f"{config.short()} {n}")
            everyone = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(everyone, grads["hierarchical"][n])
            assert all(torch.equal(everyone[0], e) for e in everyone), f"{config.short()} {n}: replicas differ"
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.e2e
def test_hierarchical_gradients_match_flat():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_hier_grads_worker, args=(4, port, [(m, c) for _, m, c in HIER_GRAD_CASES]), nprocs=4)


def test_pipeline_schedules_post_receives_first():
    """Over gloo a mixed send/receive batch serialises the two directions of a rank pair when the
    sends are posted first (``trainer.pipeline.post_receives_first``): the schedules' batches are
    reordered, receives first, each kind in its order; installing it twice wraps once."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    from autoconf.trainer.pipeline import post_receives_first, receives_first
    ops = [SimpleNamespace(op=dist.isend, n=0), SimpleNamespace(op=dist.irecv, n=1),
           SimpleNamespace(op=dist.isend, n=2), SimpleNamespace(op=dist.irecv, n=3)]
    assert [o.n for o in receives_first(ops)] == [1, 3, 0, 2]
    post_receives_first()
    installed = schedules._batch_p2p
    post_receives_first()
    assert schedules._batch_p2p is installed and installed._autoconf_receives_first
    assert schedules._batch_p2p([]) == []
