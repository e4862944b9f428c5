"""Mixture of experts in the reference trainer: routing (top-k, renormalisation, capacity), the MoE
layer against a token-by-token recomputation, and the trainer under torchrun with expert
parallelism (dp x ep, ZeRO-0/1, pp), losses equal to a single process and the all-to-all bytes
equal to their closed form from the routing a single process observes."""

from __future__ import annotations

import dataclasses
import math

import pytest

torch = pytest.importorskip("torch")

from test_trainer import GLOBAL_BATCH, SEED, STEPS, TINY, cfg  # noqa: E402

from autoconf.launch.plan import LaunchPlan  # noqa: E402
from autoconf.runs.trial import run_trial  # noqa: E402
from autoconf.space.config import check  # noqa: E402

# 4 layers, hidden 64, 4 experts top-2, the first layer dense, one shared expert
MOE = dataclasses.replace(TINY, num_experts=4, experts_per_token=2, expert_ffn_hidden_size=32, num_shared_experts=1,
                          first_dense_layers=1, name="tiny-moe")
MOE_LLAMA = dataclasses.replace(MOE, position_embedding="rope", norm="rmsnorm", activation="swiglu", bias=False,
                                router="sigmoid", moe_layer_freq=2, first_dense_layers=0, name="tiny-moe-llama")


# -- pure: routing and the layer on one process ------------------------------------------------------------

@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_route_top_k_renormalised(router):
    from autoconf.trainer.moe import route

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 6, generator=g)
    idx, w = route(logits, 3, router)
    for n in range(10):
        scores = (logits[n].softmax(-1) if router == "softmax" else logits[n].sigmoid()).tolist()
        top = sorted(range(6), key=lambda e: -scores[e])[:3]
        assert idx[n].tolist() == top
        total = sum(scores[e] for e in top)
        assert w[n].tolist() == pytest.approx([scores[e] / total for e in top], rel=1e-6)


def test_group_limited_route_picks_inside_the_best_groups():
    """DeepSeek-V3's group-limited routing, by hand: 4 groups of 4 experts, the best 2 groups by
    the sum of their top k / 2 scores, then the top k inside those groups only."""
    from autoconf.trainer.moe import route

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(20, 16, generator=g)
    idx, w = route(logits, 4, "sigmoid", groups=4, group_topk=2)
    for n in range(20):
        scores = logits[n].sigmoid().tolist()
        group_score = [sum(sorted(scores[4 * j:4 * j + 4], reverse=True)[:2]) for j in range(4)]
        best = sorted(range(4), key=lambda j: -group_score[j])[:2]
        allowed = [e for j in best for e in range(4 * j, 4 * j + 4)]
        top = sorted(allowed, key=lambda e: -scores[e])[:4]
        assert sorted(idx[n].tolist()) == sorted(top) and {e // 4 for e in idx[n].tolist()} <= set(best)
        total = sum(scores[e] for e in top)
        assert sorted(w[n].tolist()) == pytest.approx(sorted(scores[e] / total for e in top), rel=1e-6)
    # the plain top k goes outside two groups for some token here: the limit changes the routing
    assert any(len({e // 4 for e in row}) > 2 for row in route(logits, 4, "sigmoid")[0].tolist())


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("groups,group_topk", [(0, 0), (4, 2), (8, 4)])
def test_route_is_megatron_cores(router, groups, group_topk):
    """The trainer's routing against megatron-core's own (topk_routing_with_score_function, no
    pre-softmax, no scaling, no expert bias): the same experts and weights per token."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from autoconf.trainer.moe import route

    logits = torch.randn(500, 32, generator=torch.Generator().manual_seed(2))
    idx, w = route(logits, 8, router, groups, group_topk)
    probs, chosen = topk_routing_with_score_function(logits, 8, num_groups=groups or None,
                                                     group_topk=group_topk or None, score_function=router)
    mine = torch.zeros(500, 32, dtype=torch.bool).scatter_(1, idx, True)
    assert torch.equal(mine, chosen)
    assert torch.allclose(torch.zeros(500, 32).scatter_(1, idx, w), probs.float(), atol=1e-6)


def test_cost_models_routing_spread_is_the_routers():
    """The hosts and GPUs per token that the cost model's DeepEP traffic assumes
    (``cost.moe.routing_spread``, simulated) are the ones this router produces on random scores."""
    from autoconf.cost.moe import routing_spread
    from autoconf.trainer.moe import route

    logits = torch.randn(4000, 256, generator=torch.Generator().manual_seed(3))
    for groups, gk in ((0, 0), (8, 4)):
        idx = route(logits, 8, "sigmoid", groups, gk)[0]
        ranks, hosts = idx // 4, idx // 32  # 256 experts on 64 GPUs, 8 hosts of 8
        got = (float(sum(len(set(r)) for r in hosts.tolist())) / 4000,
               float(sum(len(set(r)) for r in ranks.tolist())) / 4000)
        assert routing_spread(256, 8, groups, gk, 64, 8) == pytest.approx(got, rel=0.03)


def test_capacity_drops_first_come_in_token_order():
    from autoconf.trainer.moe import capacity, keep_mask

    assert capacity(6, 2, 4, 1.0) == 3 and capacity(6, 2, 4, 1.1) == 4 and capacity(5, 1, 4, 1.0) == 2
    idx = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 3], [2, 0], [1, 2]])
    keep = keep_mask(idx, 4, 2)
    seen, expected = {}, []
    for row in idx.tolist():
        out = []
        for e in row:
            seen[e] = seen.get(e, 0) + 1
            out.append(seen[e] <= 2)
        expected.append(out)
    assert keep.tolist() == expected
    assert keep.tolist()[3] == [False, True] and keep.tolist()[4] == [True, False]


def _dense_moe(moe, x, cf=None):
    """The MoE layer token by token: route, keep (capacity), sum of weight x expert + shared."""
    m = moe.model
    t = x.reshape(-1, x.shape[-1])
    experts = dict(moe.experts.items())
    out, load = [], {}
    cap = math.ceil(cf * t.shape[0] * m.experts_per_token / m.num_experts) if cf else None
    for tok in t:
        logits = (moe.router.float() @ tok.float())
        scores = logits.softmax(-1) if m.router == "softmax" else logits.sigmoid()
        top = scores.topk(m.experts_per_token).indices.tolist()
        total = sum(scores[e] for e in top)
        y = sum(s(tok[None])[0] for s in moe.shared) if len(moe.shared) else torch.zeros_like(tok)
        for e in top:
            load[e] = load.get(e, 0) + 1
            if cap is None or load[e] <= cap:
                y = y + scores[e] / total * experts[str(e)](tok[None])[0]
        out.append(y)
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("model,cf", [(MOE, None), (MOE_LLAMA, None), (MOE, 0.75)])
def test_moe_layer_equals_token_loop(model, cf):
    from autoconf.trainer.moe import MoE

    moe = MoE(model, "blocks.1.moe", seed=SEED, capacity_factor=cf)
    x = torch.randn(2, 8, model.hidden_size, generator=torch.Generator().manual_seed(1))
    y = moe(x)
    ref = _dense_moe(moe, x, cf)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-6), (y - ref).abs().max()
    y.square().sum().backward()
    assert all(p.grad is not None for p in moe.parameters())  # every expert, even one without tokens


def test_block_layout_and_deterministic_init():
    from autoconf.trainer.layers import GPT

    net = GPT(MOE, seed=SEED)
    names = dict(net.named_parameters())
    assert "blocks.0.fc1.weight" in names and "blocks.1.fc1.weight" not in names
    assert {f"blocks.{i}.moe.experts.3.fc2.weight" for i in (1, 2, 3)} <= set(names)
    assert names["blocks.1.moe.router"].shape == (4, 64)
    assert names["blocks.1.moe.experts.0.fc1.weight"].shape == (32, 64)
    again = dict(GPT(MOE, seed=SEED).named_parameters())
    assert all(torch.equal(p, again[n]) for n, p in names.items())
    expert = sum(p.numel() for n, p in names.items() if "blocks.1.moe.experts.0." in n)
    assert expert == MOE.expert_params()
    assert sum(p.numel() for p in net.parameters()) == MOE.num_params()


def test_trainer_refuses_zero2_with_ep():
    from autoconf.trainer.run import TrainerError, refuse_moe

    with pytest.raises(TrainerError, match="zero_stage=2"):
        refuse_moe(MOE, cfg(dp=2, mbs=2, ep=2, zero_stage=2))
    refuse_moe(MOE, cfg(dp=2, mbs=2, ep=2, zero_stage=1))
    refuse_moe(MOE, cfg(dp=2, mbs=2, zero_stage=3))


# -- a real 2-rank gloo run: expert-parallel gradients against one process --------------------------------

def _grads_worker(rank, world, port, queue):
    """dp2 ep2 (ZeRO-0), one SingleStage step on the replica's rows: every gradient (dense ones
    averaged over dp, experts over their expert-data-parallel group) against one process; with a
    capacity factor, against one process running the same micro-batches (capacity is per micro-batch
    of a rank, whatever ep)."""
    import datetime
    import os

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
    groups = build_groups(Degrees(world, 1, 1, ep=world), rank, timeout)
    assert groups.ep_ranks == list(range(world)) and groups.edp_ranks == [rank]
    worst = {}
    for model, cf in ((MOE, None), (MOE_LLAMA, None), (MOE, 0.75)):
        config = cfg(dp=world, mbs=2, ep=world, moe_capacity_factor=cf)
        x, y = data.global_batch(0, GLOBAL_BATCH, model.seq_length, model.vocab_size, SEED)
        ref = gpt.GPT(model, seed=SEED, moe_capacity_factor=cf)
        if cf is None:
            ref_loss = ref(x, y)
        else:  # capacity is per micro-batch of a rank: the mean of the micro-batches' losses
            ref_loss = sum(ref(xm, ym) for xm, ym in zip(x.split(2), y.split(2))) / (GLOBAL_BATCH // 2)
        ref_loss.backward()
        common = dict(tp_size=1, tp_group=None, sequence_parallel=False, recompute="none", dtype=torch.float32,
                      seed=SEED, device=torch.device("cpu"), ep_size=world, ep_group=groups.ep,
                      moe_capacity_factor=cf)
        runner = SingleStage(model, config, groups, torch.device("cpu"), chunk_layers(model, config), common)
        losses = runner.step(*data.replica_batch(0, GLOBAL_BATCH, model.seq_length, model.vocab_size, SEED,
                                                 rank, world))
        loss = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64)
        dist.all_reduce(loss)
        errs = {"loss": abs(loss.item() / world - ref_loss.item())}
        ref_grads = dict(ref.named_parameters())
        mine = dict(runner.stage.named_parameters())
        experts = sorted(n for n in mine if ".moe.experts." in n)
        assert len(experts) == len([n for n in ref_grads if ".moe.experts." in n]) // world
        for n, p in mine.items():
            g = ref_grads[n].grad
            errs[n] = ((p.grad - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
        worst[(model.name, cf)] = max(errs.items(), key=lambda kv: kv[1])
    queue.put((rank, worst))
    dist.barrier()
    dist.destroy_process_group()


def test_ep_gradients_match_single_process():
    from test_context_parallel import assert_gradients_match

    assert_gradients_match(_grads_worker)


# -- the trainer under torchrun --------------------------------------------------------------------------------

def reference_routing(model, steps: int = STEPS):
    """The single-process run of test_trainer.reference_losses, recording every MoE layer's top-k
    experts: (losses, [step][(layer key, idx [B*s, k])])."""
    from autoconf.trainer import layers as gpt
    from autoconf.trainer import moe
    from autoconf.trainer.data import global_batch
    from autoconf.trainer.run import ADAMW

    torch.manual_seed(SEED)
    net = gpt.GPT(model, dtype=torch.float32, seed=SEED)
    opt = torch.optim.AdamW(net.parameters(), **ADAMW)
    losses, routing = [], []
    for step in range(steps):
        x, y = global_batch(step, GLOBAL_BATCH, model.seq_length, model.vocab_size, SEED)
        moe.RECORD = []
        try:
            loss = net(x, y)
            routing.append([(key, idx) for key, idx, _ in moe.RECORD])
        finally:
            moe.RECORD = None
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, routing


def expected_dispatch_bytes(model, config, coords, layers, routing) -> int:
    """Closed form of one rank's forward-dispatch bytes over the run: its tokens' top-k pairs whose
    expert lives on another rank of its EP group, x hidden x element bytes (cp = 1, the EP group
    along dp: EP rank = dp rank mod ep)."""
    s, b = model.seq_length, GLOBAL_BATCH
    rows = torch.zeros(b, s, dtype=torch.bool)
    n = b // config.dp
    rows[coords["dp"] * n:(coords["dp"] + 1) * n] = True
    if config.tp > 1 and config.sequence_parallel:
        keep = torch.zeros(s, dtype=torch.bool)
        keep[coords["tp"] * s // config.tp:(coords["tp"] + 1) * s // config.tp] = True
        rows &= keep
    mine = rows.reshape(-1)
    per_rank = model.num_experts // config.ep
    me = coords["dp"] % config.ep
    keys = {f"blocks.{i}.moe" for i in layers}
    remote = 0
    for step in routing:
        for key, idx in step:
            if key in keys:
                remote += int(((idx[mine] // per_rank) != me).sum())
    return remote * model.hidden_size * 4  # fp32


E2E = [
    ("dp2-ep2", MOE, cfg(dp=2, mbs=2, ep=2)),
    ("dp2-ep2-zero1", MOE, cfg(dp=2, mbs=2, ep=2, zero_stage=1)),
    ("dp2-pp2-ep2-1f1b-zero1-llama", MOE_LLAMA, cfg(dp=2, pp=2, mbs=1, ep=2, schedule="1f1b", zero_stage=1)),
    ("dp2-tp2-ep2-sp", MOE, cfg(dp=2, tp=2, mbs=2, ep=2, sequence_parallel=True)),
    ("dp2-cp2-ep4-zero1", MOE, cfg(dp=2, cp=2, mbs=2, ep=4, zero_stage=1)),
]

_REFERENCE: dict = {}


@pytest.mark.e2e
@pytest.mark.parametrize("name,model,config", E2E, ids=[c[0] for c in E2E])
def test_moe_losses_and_a2a_bytes(name, model, config, tmp_path):
    assert check(config, model) is None, check(config, model)
    if model.name not in _REFERENCE:
        _REFERENCE[model.name] = reference_routing(model)
    expected, routing = _REFERENCE[model.name]
    result = run_trial(LaunchPlan(config, model, seed=SEED), steps=STEPS, warmup=1, timeout_s=240,
                       out_dir=str(tmp_path))
    assert result.ok, result.reason
    assert len(result.per_rank) == config.world_size
    assert result.losses == pytest.approx(expected, rel=1e-5, abs=1e-6), (result.losses, expected)
    per_step = {r["rank"]: r["moe_a2a_bytes_per_step"] for r in result.per_rank}
    assert all(r["moe_a2a_bytes"] == per_step[r["rank"]][-1] for r in result.per_rank)
    # under pp the first step also holds torch.distributed.pipelining's metadata inference: compare the others
    first = 1 if config.pp > 1 else 0
    for step in range(first, STEPS):
        for r in result.per_rank:
            b = per_step[r["rank"]][step]
            assert b["dispatch_fwd"] > 0
            # the backward reverses each exchange: combine's backward sends what dispatch sent
            assert b["combine_bwd"] == b["dispatch_fwd"] and b["dispatch_bwd"] == b["combine_fwd"]
            if config.cp == 1:
                layers = [i for chunk in r["layers"] for i in chunk]
                assert b["dispatch_fwd"] == expected_dispatch_bytes(model, config, r["coords"], layers,
                                                                    routing[step:step + 1]), (name, step)
        # over the whole world what is dispatched comes back: dispatch and combine are equal
        sent = [per_step[r][step] for r in per_step]
        assert sum(b["dispatch_fwd"] for b in sent) == sum(b["combine_fwd"] for b in sent)
        if config.tp == 1 and config.pp == 1:
            # the cost model's bytes (cost.moe.a2a_bytes: uniform routing) against what the ranks sent
            from autoconf.cost.moe import a2a_bytes
            from autoconf.cost.system import System
            from autoconf.specs.cluster import load_cluster

            sys_ = System(model, load_cluster("examples/clusters/localhost-cpu.yaml"))
            per_rank = a2a_bytes(sys_, config) * model.num_moe_layers * config.num_micro_batches
            mean = sum(b["dispatch_fwd"] for b in sent) / len(sent)
            assert mean == pytest.approx(per_rank, rel=0.3), (name, step, mean, per_rank)
