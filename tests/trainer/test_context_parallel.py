"""Context parallelism in the reference trainer: the load-balanced split, ring attention's causal
plan, gradients of a real 2-rank gloo run against one process, and the trainer under torchrun with
cp alone and with dp, tp (+ SP), pp, ZeRO and recomputation, losses equal to a single process."""

from __future__ import annotations

import dataclasses
import os

import pytest

torch = pytest.importorskip("torch")

from test_nn import _free_port  # noqa: E402
from test_trainer import GLOBAL_BATCH, SEED, TINY, cfg, trial_matches_single_process  # noqa: E402

from autoconf.trainer.ring_attention import load_balanced_indices, split_load_balanced, step_plan  # noqa: E402

# llama-like: rope, grouped-query attention (2 kv heads for 4), RMSNorm, SwiGLU, eager attention, tied
LLAMA = dataclasses.replace(TINY, position_embedding="rope", norm="rmsnorm", activation="swiglu", num_kv_heads=2,
                            ffn_hidden_size=192, attention="eager", bias=False, tied_embeddings=True,
                            name="tiny-llama")


# -- pure: the split and the ring's causal plan --------------------------------------------------------------

@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_load_balanced_split(cp):
    s = 8 * cp
    c = s // (2 * cp)
    seen = []
    for r in range(cp):
        idx = load_balanced_indices(s, cp, r)
        assert idx.tolist() == list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
        x = torch.arange(s).repeat(3, 1)
        assert torch.equal(split_load_balanced(x, cp, r), idx.repeat(3, 1))
        assert torch.equal(split_load_balanced(x.T, cp, r, dim=0), idx.repeat(3, 1).T)
        # causal work is balanced: every rank's queries see the same number of keys
        seen.append(int((idx + 1).sum()))
    assert len(set(seen)) == 1
    assert sorted(torch.cat([load_balanced_indices(s, cp, r) for r in range(cp)]).tolist()) == list(range(s))
    with pytest.raises(ValueError, match="divisible by 2 x cp"):
        load_balanced_indices(s + 1, cp, 0)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_plan_covers_the_causal_pairs_once(cp):
    """The blocks ring attention computes on each rank (step by step, the rest skipped) are exactly
    the causal (query, key) pairs of its tokens, each once."""
    s = 4 * cp
    c = s // (2 * cp)
    for me in range(cp):
        q_pos = load_balanced_indices(s, cp, me).tolist()
        pairs = []
        for t in range(cp):
            k_pos = load_balanced_indices(s, cp, (me - t) % cp).tolist()
            rows, cols, causal = step_plan(t, me, cp, c)
            for qi, qp in enumerate(q_pos[rows]):
                for kj, kp in enumerate(k_pos[cols]):
                    if causal and kj > qi + (rows.start or 0):
                        continue
                    assert kp <= qp, (me, t, qp, kp)  # never a block above the diagonal
                    pairs.append((qp, kp))
        assert sorted(pairs) == sorted((qp, kp) for qp in q_pos for kp in range(qp + 1))


def test_attention_dropout_refused():
    from autoconf.trainer.layers import Block
    from autoconf.trainer.run import TrainerError, refuse_cp

    dropping = dataclasses.replace(TINY, attention="eager", dropout=0.1)
    with pytest.raises(TrainerError, match="attention dropout"):
        refuse_cp(dropping, cfg(cp=2, mbs=2))
    with pytest.raises(ValueError, match="attention dropout"):
        Block(dropping, cp_size=2)
    refuse_cp(dropping, cfg(dp=2, mbs=2))  # cp = 1: fine
    refuse_cp(dataclasses.replace(TINY, dropout=0.1), cfg(cp=2, mbs=2))  # flash: no attention dropout


# -- a real 2-rank gloo run: the trainer's runner, gradients against one process -------------------------------

GRAD_CASES = [(TINY, "none"), (LLAMA, "none"), (LLAMA, "selective"), (LLAMA, "full")]


def _grads_worker(rank, world, port, queue):
    """One cp rank: one SingleStage step (cp = 2, ZeRO-0) on the replica's tokens split load-balanced;
    every gradient, averaged over dp x cp by the runner, against the single-process model's."""
    import datetime

    import torch.distributed as dist

    from autoconf.space.degrees import Degrees
    from autoconf.trainer import data
    from autoconf.trainer import layers as gpt
    from autoconf.trainer.process_groups import build_groups
    from autoconf.trainer.run import chunk_layers
    from autoconf.trainer.single import SingleStage

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    groups = build_groups(Degrees(1, 1, 1, "tp-cp-dp-pp", cp=world), rank, timeout)
    assert groups.cp_rank == rank and groups.grad_ranks == list(range(world))
    worst = {}
    for model, rc in GRAD_CASES:
        config = cfg(cp=world, mbs=2, recompute=rc)
        x, y = data.global_batch(0, GLOBAL_BATCH, model.seq_length, model.vocab_size, SEED)
        ref = gpt.GPT(model, seed=SEED)
        ref_loss = ref(x, y)
        ref_loss.backward()
        common = dict(tp_size=1, tp_group=None, sequence_parallel=False, recompute=rc, dtype=torch.float32,
                      seed=SEED, device=torch.device("cpu"), cp_size=world, cp_group=groups.cp)
        runner = SingleStage(model, config, groups, torch.device("cpu"), chunk_layers(model, config), common)
        losses = runner.step(*data.cp_shard(x, y, world, groups.cp_rank))
        loss = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64)
        dist.all_reduce(loss)
        errs = {"loss": abs(loss.item() / world - ref_loss.item())}
        ref_grads = dict(ref.named_parameters())
        for n, p in runner.stage.named_parameters():
            g = ref_grads[n].grad
            errs[n] = ((p.grad - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
        worst[(model.name, rc)] = max(errs.items(), key=lambda kv: kv[1])
    queue.put((rank, worst))
    dist.barrier()
    dist.destroy_process_group()


def assert_gradients_match(worker, world: int = 2, tol: float = 1e-5) -> None:
    """Run ``worker(rank, world, port, queue)`` in ``world`` forked gloo processes; each puts
    (rank, {case: (parameter, relative error)}) with its worst gradient error against one process."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
    assert all(p.exitcode == 0 for p in procs)
    for _, worst in results:
        for case, (name, err) in worst.items():
            assert err < tol, (case, name, err)


def test_cp_gradients_match_single_process():
    assert_gradients_match(_grads_worker)


# -- the trainer under torchrun --------------------------------------------------------------------------------

CASES = [
    ("cp2-llama-full", LLAMA, cfg(cp=2, mbs=2, recompute="full")),
    ("cp2-zero3-layered-selective", TINY,
     cfg(cp=2, mbs=2, zero_stage=3, layered_grad_accum=True, recompute="selective")),
    ("dp2-cp2-zero2", TINY, cfg(dp=2, cp=2, mbs=2, zero_stage=2)),
    ("tp2-cp2-sp", TINY, cfg(tp=2, cp=2, mbs=2, sequence_parallel=True)),
    ("pp2-cp2-1f1b-llama", LLAMA, cfg(pp=2, cp=2, mbs=2, schedule="1f1b")),
]


@pytest.mark.e2e
@pytest.mark.parametrize("name,model,config", CASES, ids=[c[0] for c in CASES])
def test_cp_losses_match_single_process(name, model, config, tmp_path):
    result = trial_matches_single_process(model, config, tmp_path, abs_tol=1e-6)
    assert len(result.per_rank) == config.world_size
