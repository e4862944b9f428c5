"""The cost model of mixture-of-experts blocks and expert parallelism against closed forms (no torch)."""

import dataclasses

import pytest

from autoconf.cost.comm import all_to_all_s
from autoconf.cost.estimate import TIME_TERMS, estimate
from autoconf.cost.groups import axis_links
from autoconf.cost.layout import layout
from autoconf.cost.moe import a2a_bytes, a2a_times, moe_activation_bytes, moe_shape
from autoconf.cost.system import System
from autoconf.errors import UserError
from autoconf.space.config import ParallelConfig, check
from autoconf.space.degrees import expert_groups
from autoconf.specs.cluster import load_cluster
from autoconf.specs.model import ModelSpec
from autoconf.study.search import search

H100 = load_cluster("examples/clusters/h100-8x8.yaml")

MIXTRAL = ModelSpec(name="mixtral-8x7b", num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
                    ffn_hidden_size=14336, vocab_size=32000, seq_length=4096, activation="swiglu", norm="rmsnorm",
                    position_embedding="rope", num_experts=8, experts_per_token=2)
SMALL_MOE = ModelSpec(name="moe-small", num_layers=8, hidden_size=2048, num_attention_heads=16, num_kv_heads=4,
                      ffn_hidden_size=8192, vocab_size=32000, seq_length=4096, activation="swiglu", norm="rmsnorm",
                      position_embedding="rope", num_experts=64, experts_per_token=8, expert_ffn_hidden_size=768,
                      num_shared_experts=1, first_dense_layers=1)


def cfg(**kw):
    base = dict(dp=8, pp=1, tp=1, micro_batch_size=1, num_micro_batches=4)
    base.update(kw)
    return ParallelConfig(**base)


def test_parameter_counts_and_active_flops():
    m = MIXTRAL
    assert m.num_params() == pytest.approx(46.70e9, rel=2e-3)  # Mixtral-8x7B: 46.7B total
    assert m.active_params() == pytest.approx(12.88e9, rel=2e-3)  # 12.9B active
    h, f, q, kv, s = 4096, 14336, 4096, 1024, 4096
    per_token = 2 * (h * (q + 2 * kv) + q * h + 3 * h * 2 * f + h * 8) + 4 * s * q
    assert m.model_flops_per_token() == pytest.approx(3 * (32 * per_token + 2 * 32000 * h))
    assert [SMALL_MOE.is_moe_layer(i) for i in range(3)] == [False, True, True]


def test_validity_of_ep():
    assert check(cfg(ep=4), MIXTRAL) is None
    assert "ep(3) must divide dp x cp" in check(cfg(ep=3, dp=8), MIXTRAL)
    assert "does not divide num_experts(8)" in check(cfg(dp=16, ep=16), MIXTRAL)
    dense = dataclasses.replace(MIXTRAL, num_experts=0, experts_per_token=0)
    assert "has none" in check(cfg(ep=2), dense)
    with pytest.raises(UserError, match="deepspeed has no expert parallelism"):
        estimate(cfg(ep=2), MIXTRAL, H100, framework="deepspeed")
    with pytest.raises(UserError, match="torchtitan routes dropless only"):
        estimate(cfg(moe_capacity_factor=1.25), MIXTRAL, H100, framework="torchtitan")


def test_expert_groups_lie_inside_dp_times_cp():
    ep, edp = expert_groups(dp=4, pp=1, tp=2, order="tp-dp-pp", ep=2)
    assert ep == [(0, 2), (1, 3), (4, 6), (5, 7)] and edp == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_all_to_all_bytes_and_time_closed_forms():
    c = cfg(dp=8, ep=8, tp=1)
    s = System(MIXTRAL, H100, framework="megatron")
    T, k, h = 4096, 2, 4096
    assert a2a_bytes(s, c) == T * k * 7 / 8 * h * 2
    [g] = set(axis_links(s, c, "ep"))
    assert g.num_hosts == 1 and g.size == 8
    tune = s.collective_tuning
    one = tune.base_latency_s + a2a_bytes(s, c) / (g.intra_bandwidth_bytes_per_s * tune.intra(8)) + 7 * g.intra_latency_s
    assert all_to_all_s(a2a_bytes(s, c), g, tune) == pytest.approx(one)
    assert a2a_times(s, c) == pytest.approx((2 * one, 2 * one))
    # across hosts the NICs carry the remote share and dominate
    c2 = cfg(dp=8, tp=8, ep=8)
    [g2] = set(axis_links(s, c2, "ep"))
    assert g2.num_hosts == 8 and all_to_all_s(a2a_bytes(s, c2), g2, tune) > 4 * one
    assert a2a_times(s, cfg(ep=1)) == (0.0, 0.0)


def test_expert_groups_are_priced_per_expert_parallel_degree():
    """The expert and expert-data-parallel groups of one layout differ with ep (ep 2 inside a host,
    ep 16 over two): a System that priced one ep first prices another as a fresh one does."""
    c2, c16 = cfg(dp=32, tp=2, ep=2), cfg(dp=32, tp=2, ep=16)
    fresh, used = System(SMALL_MOE, H100, framework="megatron"), System(SMALL_MOE, H100, framework="megatron")
    for axis in ("ep", "edp"):
        axis_links(used, c2, axis)
    assert {g.num_hosts for g in axis_links(used, c2, "ep")} == {1}
    assert {g.num_hosts for g in axis_links(used, c16, "ep")} == {4}
    for c in (c16, c2):
        for axis in ("ep", "edp"):
            assert axis_links(used, c, axis) == axis_links(fresh, c, axis)
        assert a2a_times(used, c) == a2a_times(fresh, c)
    assert estimate(c16, SMALL_MOE, ctx=used).step_time_s == estimate(c16, SMALL_MOE, ctx=fresh).step_time_s


def test_expert_shape_imbalance_and_capacity():
    c = cfg(ep=4)
    s = System(MIXTRAL, H100, framework="megatron")
    sh = moe_shape(s, c)
    assert (sh.local_experts, sh.assignments, sh.rows) == (2, 4096 * 2, 4096 * 2 / 2)
    skew = System(MIXTRAL, H100, framework="megatron", moe_imbalance=1.5)
    assert moe_shape(skew, c).assignments == 1.5 * 4096 * 2
    assert moe_shape(skew, dataclasses.replace(c, moe_capacity_factor=1.25)).assignments == 1.25 * 4096 * 2
    slow = estimate(c, MIXTRAL, H100, framework="megatron", moe_imbalance=1.5)
    even = estimate(c, MIXTRAL, H100, framework="megatron")
    assert slow.breakdown_s["compute"] > even.breakdown_s["compute"]
    assert slow.breakdown_s["ep_comm"] > even.breakdown_s["ep_comm"]


def test_expert_states_split_over_ep_and_sharded_over_expert_dp():
    m, s = MIXTRAL, System(MIXTRAL, H100, framework="megatron")
    for ep in (1, 2, 8):
        lay = layout(s, cfg(ep=ep))
        assert lay.chunk_expert_params == (32 * (8 // ep) * m.expert_params(),)
        dense = m.num_params() - 32 * 8 * m.expert_params()
        assert lay.chunk_params[0] == dense + 32 * (8 // ep) * m.expert_params()
    # ZeRO-1: the optimizer's 12 bytes over dp x cp for the rest, over dp x cp / ep for the experts
    for ep in (1, 2, 8):
        e = estimate(cfg(ep=ep, zero_stage=1), m, H100, framework="megatron")
        experts = 32 * (8 // ep) * m.expert_params()
        dense = m.num_params() - 32 * 8 * m.expert_params()
        assert e.memory_by_stage[0].optimizer == pytest.approx(dense * 12 / 8 + experts * 12 / (8 // ep))


def test_moe_activation_memory_closed_form():
    c = cfg(ep=2, tp=2, sequence_parallel=True)
    s = System(SMALL_MOE, H100, framework="megatron")
    dense = s.layer_activations(c, 1)
    got = moe_activation_bytes(s, c, 1)
    T, e, k, h = 4096, 2, 8, 2048
    # Megatron-LM's fused SwiGLU keeps 3 f-wide rows per token (its 2f input and the product)
    dense_mlp = e * T * 3 * 8192 / 2
    expert = e * 3 * (T * k * 768 + T * 768) / 2  # routed rows (T x k) and the shared expert's T rows
    # the dispatched tokens, the router's fp32 score per assignment (Megatron-Core weights the
    # experts' activation, and its combine keeps no expert output) and its fp32 probabilities
    extra = e * T * k * h + 4 * T * k + 4 * T * 64
    assert got["total"] == pytest.approx(dense["total"] - dense_mlp + expert + extra)
    # a combine that weights the experts' outputs in fp32 (the reference trainer) keeps an fp32 copy
    ref, c1 = System(SMALL_MOE, H100, framework="reference"), cfg(ep=2)
    ref_extra = (e + 4) * T * k * h + 4 * T * 64
    ref_mlp = e * T * 4 * 8192  # eager SwiGLU: 4 rows
    assert moe_activation_bytes(ref, c1, 1)["total"] == pytest.approx(
        ref.layer_activations(c1, 1)["total"] - ref_mlp + e * 4 * (T * k * 768 + T * 768) + ref_extra)
    # FP8 keeping the linear layers' inputs (Megatron / Transformer Engine): 1 byte for the
    # down projections' f-wide inputs and for the dispatched tokens the experts' up projection keeps
    c8 = dataclasses.replace(c, precision="fp8", fp8_recipe="tensorwise")
    dense8, got8 = s.layer_activations(c8, 1), moe_activation_bytes(s, c8, 1)
    dense_mlp8 = T * (3 * e - 1) * 8192 / 2
    expert8 = (3 * e - 1) * (T * k * 768 + T * 768) / 2
    extra8 = 1 * T * k * h + 4 * T * k + 4 * T * 64
    assert dense8["mlp_hidden"] == pytest.approx(dense_mlp8)
    assert got8["total"] == pytest.approx(dense8["total"] - dense_mlp8 + expert8 + extra8)


def test_layered_accumulation_at_pp1_keeps_every_moe_blocks_activations():
    """Layered accumulation at pp = 1 keeps every micro-batch's saved activations of every block
    until the backward: the MoE blocks' are their own (the experts' rows, the permuted tokens),
    not a dense block's, and their gradients are those of E/ep experts."""
    from autoconf.cost.stage_memory import block_params
    c = cfg(dp=8, ep=8, num_micro_batches=4, layered_grad_accum=True)
    s = System(SMALL_MOE, H100, framework="reference")
    e = estimate(c, SMALL_MOE, ctx=s)
    moe_act, dense_act = moe_activation_bytes(s, c, 1)["total"], s.layer_activations(c, 1)["total"]
    assert moe_act > 1.5 * dense_act
    n_moe = SMALL_MOE.num_moe_layers
    assert e.memory_by_stage[0].activations >= 4 * (n_moe * moe_act + (8 - n_moe) * dense_act)
    blocks = block_params(s, c)
    experts = 64 // 8 * SMALL_MOE.expert_params()
    assert blocks[0] == SMALL_MOE.layer_params(0) and blocks[1] == pytest.approx(
        SMALL_MOE.layer_params(1) - 64 * SMALL_MOE.expert_params() + experts)


def test_zero3_gathers_an_moe_block_with_its_local_experts():
    """FSDP (torchtitan) gathers a whole block before it runs, an MoE block with its E/ep experts:
    the working set is two of the largest blocks, not two dense ones."""
    from autoconf.cost.stage_memory import block_params
    c = cfg(dp=8, ep=2, zero_stage=3)
    s = System(SMALL_MOE, H100, framework="torchtitan")
    parts = dict(estimate(c, SMALL_MOE, ctx=s).memory_by_stage[0].other_parts)
    local = SMALL_MOE.layer_params(1) - 64 * SMALL_MOE.expert_params() + 32 * SMALL_MOE.expert_params()
    assert max(block_params(s, c)) == local
    assert parts["zero-3 gathered layers"] == 2 * local * 2


def test_estimate_has_ep_term_and_search_weighs_ep():
    e = estimate(cfg(ep=8, tp=8), MIXTRAL, H100, framework="megatron")
    assert set(e.breakdown_s) == set(TIME_TERMS) and e.breakdown_s["ep_comm"] > 0
    assert sum(e.breakdown_s.values()) == pytest.approx(e.step_time_s)
    # on two hosts of 8 NICs (multi-rail), replicated experts and ep 4 are within 5%: both among the best
    r = search(SMALL_MOE, H100, 32, gpus=16, top=10, framework="megatron", precision="bf16", trials=60)
    assert r.top and all(check(t.config, SMALL_MOE) is None for t in r.top)
    assert any(t.config.ep > 1 for t in r.top)


def test_experts_split_over_tp_only_where_the_framework_does():
    c = cfg(dp=4, tp=2, ep=2, sequence_parallel=True)
    per_rank = 32 * 4 * MIXTRAL.expert_params()  # 8 experts / ep 2, whole
    meg = layout(System(MIXTRAL, H100, framework="megatron"), c)
    ref = layout(System(MIXTRAL, H100, framework="reference"), c)
    assert meg.chunk_expert_params == (per_rank / 2,) and ref.chunk_expert_params == (per_rank,)
    # every tp rank dispatches its own sequence shard (half the tokens here), also where the
    # experts are tensor-parallel (Megatron then all-gathers inside the expert-TP group)
    assert a2a_bytes(System(MIXTRAL, H100), c) == a2a_bytes(System(MIXTRAL, H100, framework="megatron"), c)
    assert a2a_bytes(System(MIXTRAL, H100), c) == a2a_bytes(System(MIXTRAL, H100), cfg(dp=4, ep=2)) / 2


def test_paired_layer_time_closed_forms():
    """Megatron-Core's combined 1F1B layer (two streams): no all-to-all time is the compute alone;
    no compute is the four all-to-alls in turn on the communication stream; all-to-alls shorter
    than the work they run beside are hidden; all-to-alls longer than it leave the communication
    stream's four plus nothing else (the dependencies, traced by hand)."""
    from autoconf.cost.moe import paired_layer_s

    assert paired_layer_s(1.0, 2.0, 3.0, 4.0, 0.0) == pytest.approx(10.0)
    assert paired_layer_s(0.0, 0.0, 0.0, 0.0, 0.5) == pytest.approx(2.0)
    assert paired_layer_s(1.0, 1.0, 1.0, 1.0, 0.5) == pytest.approx(4.0)
    # t = 2: combine_bwd [0,2]; mlp_bwd [2,3]; dispatch_fwd [2,4]; dispatch_bwd [4,6];
    # mlp_fwd [4,5]; combine_fwd [6,8]; attn_bwd [6,7]
    assert paired_layer_s(1.0, 1.0, 1.0, 1.0, 2.0) == pytest.approx(8.0)
    # the experts' whole backward before dispatch_bwd (Megatron without --delay-wgrad-compute):
    # combine_bwd [0,1]; attn_fwd [0,1]; mlp_bwd [1,5]; dispatch_fwd [1,2]; dispatch_bwd [5,6];
    # mlp_fwd [5,6]; combine_fwd [6,7]; attn_bwd [6,7]: 7, not the 6 of the compute alone
    assert paired_layer_s(1.0, 1.0, 1.0, 4.0, 1.0) == pytest.approx(7.0)
    for args in ((0.3, 2.0, 0.7, 4.0, 0.9), (2.0, 0.1, 3.0, 0.2, 1.0), (0.1, 0.1, 0.1, 0.1, 5.0)):
        t = paired_layer_s(*args)
        assert max(sum(args[:4]), 4 * args[4]) <= t + 1e-12 <= sum(args[:4]) + 4 * args[4]


def test_paired_fraction_follows_megatrons_warmup():
    from autoconf.cost.moe import paired_fraction

    s = System(SMALL_MOE, H100, framework="megatron")
    assert paired_fraction(s, cfg(ep=8, num_micro_batches=8, ep_comm_overlap=True), 0) == pytest.approx(7 / 8)
    assert paired_fraction(s, cfg(ep=8, num_micro_batches=8), 0) == 0.0  # the knob off (Megatron's default)
    c = cfg(dp=8, pp=4, ep=8, num_micro_batches=8, schedule="interleaved", virtual_stages=2, ep_comm_overlap=True)
    # 16 chunk forwards; warm-up 2 (pp - 1 - rank) + (v - 1) pp + 1
    assert [paired_fraction(s, c, r) for r in range(4)] == pytest.approx([5 / 16, 7 / 16, 9 / 16, 11 / 16])
    c1 = dataclasses.replace(c, num_micro_batches=2)  # every forward in the warm-up
    assert paired_fraction(s, c1, 0) == 0.0


def test_ep_comm_overlap_hides_all_to_alls_and_costs_a_paired_micro_batch():
    """On Megatron the overlap leaves the passes that run alone exposed (1/m of them at pp 1) and
    what the pairs cannot hide; it holds one MoE block more; the other frameworks cannot switch it,
    and Megatron-Core's own conditions are the configuration's."""
    c = cfg(dp=8, ep=8, tp=1, num_micro_batches=8, zero_stage=1)
    s = System(SMALL_MOE, H100, framework="megatron")
    off = estimate(c, SMALL_MOE, ctx=s)
    on = estimate(dataclasses.replace(c, ep_comm_overlap=True), SMALL_MOE, ctx=s)
    assert off.breakdown_s["ep_comm"] / 8 <= on.breakdown_s["ep_comm"] < off.breakdown_s["ep_comm"]
    assert on.step_time_s < off.step_time_s
    parts = dict(on.memory_by_stage[0].other_parts)
    assert parts["ep-overlap paired micro-batch"] == pytest.approx(moe_activation_bytes(s, c, 1)["total"])
    assert on.memory_by_stage[0].total > off.memory_by_stage[0].total
    with pytest.raises(UserError, match="torchtitan cannot switch ep_comm_overlap"):
        estimate(dataclasses.replace(c, ep_comm_overlap=True, zero_stage=0), SMALL_MOE, H100, framework="torchtitan")
    on_c = dataclasses.replace(c, ep_comm_overlap=True)
    assert "needs ep > 1" in check(dataclasses.replace(on_c, ep=1), SMALL_MOE)
    assert "recompute=full" in check(dataclasses.replace(on_c, recompute="full"), SMALL_MOE)
    assert "interleaved" in check(dataclasses.replace(on_c, dp=4, pp=2, ep=4), SMALL_MOE)
    il = dataclasses.replace(on_c, dp=4, pp=2, ep=4, schedule="interleaved", virtual_stages=2)
    assert check(il, SMALL_MOE) is None
    assert "16-bit" in check(on_c, dataclasses.replace(SMALL_MOE, dtype="fp32"))


def test_search_tries_ep_comm_overlap_where_megatron_can_run_it():
    from autoconf.specs.frameworks import framework
    from autoconf.study.choices import framework_inner

    fw = framework("megatron")
    inner = list(framework_inner(fw, 8, 1, 1, 1, "1f1b", 1, False, 32, moe_experts=64))
    assert {c.ep_comm_overlap for c in inner if c.ep > 1 and c.recompute != "full"} == {False, True}
    assert not any(c.ep_comm_overlap for c in inner if c.ep == 1 or c.recompute == "full")
    assert not any(c.ep_comm_overlap for c in framework_inner(fw, 4, 2, 1, 1, "1f1b", 1, False, 32, moe_experts=64))
    fp32 = dataclasses.replace(SMALL_MOE, dtype="fp32")  # Megatron-Core overlaps 16-bit models only
    assert not any(c.ep_comm_overlap for c in framework_inner(fw, 8, 1, 1, 1, "1f1b", 1, False, 32, moe_experts=64,
                                                              model=fp32))


def test_fp8_weight_copies_hold_a_ranks_own_experts():
    """Transformer Engine's FP8 weight copies (2 bytes per linear weight on Megatron): the dense
    block's projections and MLP, each MoE block's projections, shared expert and the rank's E/ep
    routed experts, split over tp like Megatron's experts; MLA's projections at their size."""
    from autoconf.cost.layout import linear_params_per_layer

    m = SMALL_MOE
    c = cfg(dp=8, tp=2, ep=8, precision="fp8", fp8_recipe="tensorwise")
    e = estimate(c, m, H100, framework="megatron")
    h = m.hidden_size
    attn = h * (m.q_size + 2 * m.kv_size) + m.q_size * h
    per_moe = attn + m.shared_expert_params() + 64 // 8 * m.expert_params()
    want = 2.0 * (linear_params_per_layer(m) + 7 * per_moe) / 2
    assert dict(e.memory_by_stage[0].other_parts)["fp8 weight copies"] == pytest.approx(want)
    from autoconf.specs.model import preset

    ds = preset("deepseek-v3")
    assert linear_params_per_layer(ds) == ds.attention_matmul_params() + 3 * ds.hidden_size * ds.ffn_hidden_size
    assert ds.attention_matmul_params() == pytest.approx(187e6, rel=0.02)  # MLA: about 187M weights per block


def test_deepep_spread_and_bytes_closed_forms():
    """DeepEP's traffic per rank and dispatch: a token crosses the NICs once per other host holding
    one of its experts and NVLink once per other GPU there. The spread, simulated, against the
    closed form of k distinct experts drawn uniformly (no groups); group-limited routing caps the
    hosts (DeepSeek-V3: at most 4 of 8)."""
    from math import comb

    from autoconf.cost.moe import deepep_bytes, deepep_spread, routing_spread
    from autoconf.specs.model import preset

    def hit(bins, k, items):  # expected bins hit by k distinct items of ``items`` spread evenly
        return bins * (1 - comb(items - items // bins, k) / comb(items, k))

    assert routing_spread(256, 8, 0, 0, 64, 8) == pytest.approx((hit(8, 8, 256), hit(64, 8, 256)), rel=0.02)
    assert routing_spread(64, 6, 0, 0, 16, 2) == pytest.approx((hit(2, 6, 64), hit(16, 6, 64)), rel=0.02)
    assert routing_spread(256, 8, 8, 4, 64, 8)[0] <= 4.0  # never more hosts than groups allowed
    ds = preset("deepseek-v3")
    s = System(ds, load_cluster("examples/clusters/h100-8x8.yaml"), framework="megatron")
    c = cfg(dp=64, ep=64, moe_dispatcher="deepep")
    [g] = set(axis_links(s, c, "ep"))
    assert (g.size, g.num_hosts, g.local_size) == (64, 8, 8)
    hosts, ranks = deepep_spread(ds, g)
    assert 3.8 < hosts <= 4.0 and 7.0 < ranks < hit(64, 8, 256)  # node-limited: fewer hosts, GPUs
    free = dataclasses.replace(ds, router_groups=0, router_group_topk=0)
    assert deepep_spread(free, g)[0] == pytest.approx(hit(8, 8, 256), rel=0.02)
    nic, nvl = deepep_bytes(s, c, g)
    unit = 4096 * 7168 * 2
    assert nic == pytest.approx(unit * hosts * 7 / 8) and nvl == pytest.approx(unit * ranks * 7 / 8)
    # against every (token, expert) pair: 8 x 63/64 hidden vectors, 7 of 8 of them across the NICs
    assert a2a_bytes(s, dataclasses.replace(c, moe_dispatcher="alltoall")) == pytest.approx(unit * 8 * 63 / 64)
    on, off = a2a_times(s, c), a2a_times(s, dataclasses.replace(c, moe_dispatcher="alltoall"))
    assert on[0] < off[0] / 1.5 and on[1] < off[1] / 1.5


def test_deepep_only_where_the_framework_runs_it():
    c = cfg(ep=8, moe_dispatcher="deepep")
    assert estimate(c, SMALL_MOE, H100, framework="megatron").breakdown_s["ep_comm"] > 0
    with pytest.raises(UserError, match="framework reference has no deepep token dispatcher; valid: alltoall"):
        estimate(c, SMALL_MOE, H100)
    with pytest.raises(UserError, match="--moe-dispatcher deepep: framework deepspeed has no deepep token dispatcher; "
                                        "valid: alltoall"):
        System(SMALL_MOE, H100, framework="deepspeed", moe_dispatcher="deepep")
    assert "needs ep > 1" in check(cfg(moe_dispatcher="deepep"), SMALL_MOE)
    assert ParallelConfig.from_dict(c.to_dict()) == c and "moe_dispatcher" not in cfg(ep=8).to_dict()
    r = search(SMALL_MOE, H100, 32, gpus=16, top=3, framework="megatron", precision="bf16", trials=40,
               moe_dispatcher="deepep")
    assert r.top and all(t.config.moe_dispatcher == ("deepep" if t.config.ep > 1 else "alltoall") for t in r.top)
    assert any(t.config.ep > 1 for t in r.top)
    with pytest.raises(UserError, match="--moe-dispatcher deepep: model .* has no experts"):
        System(dataclasses.replace(SMALL_MOE, num_experts=0, experts_per_token=0, expert_ffn_hidden_size=None,
                                   num_shared_experts=0, first_dense_layers=0), H100, framework="megatron",
               moe_dispatcher="deepep")


def test_deepep_at_tp_one_and_paired_memory_only_where_passes_pair():
    from autoconf.specs.frameworks import framework
    from autoconf.study.choices import framework_inner

    assert "or moe_dispatcher alltoall" in check(cfg(ep=4, tp=2, moe_dispatcher="deepep"), SMALL_MOE)
    inner = list(framework_inner(framework("megatron"), 4, 1, 2, 1, "1f1b", 1, False, 32, moe_experts=64,
                                 dispatcher="deepep"))
    assert inner and all(c.moe_dispatcher == "alltoall" for c in inner)  # priced as all-to-alls at tp 2
    one = cfg(dp=8, ep=8, num_micro_batches=1, zero_stage=1, ep_comm_overlap=True)
    e = estimate(one, SMALL_MOE, H100, framework="megatron")
    assert "ep-overlap paired micro-batch" not in dict(e.memory_by_stage[0].other_parts)  # nothing to pair


SMALL_MLA = dataclasses.replace(SMALL_MOE, name="mla-small", num_kv_heads=16, q_lora_rank=512, kv_lora_rank=256, qk_rope_head_dim=32,
                                qk_nope_head_dim=64, v_head_dim=64)
MODULES = ("layernorm", "moe_act", "mla_up_proj")


def test_recompute_modules_free_their_outputs_closed_form():
    """Megatron-LM's output-discarding recompute modules free exactly their outputs: layernorm the
    MLA input norm's (the down-projections' input, h wide) and the MoE norm's (the router's and
    experts' input); moe_act the routed experts' activation output (T x k rows of the expert
    width); mla_up_proj the heads' queries, keys and values. Leaving core_attn out keeps the
    attention core's log-sum-exp. mla_up_proj keeps MLA's latents themselves (the fused latent
    norms' inputs, 16-bit), not their norms' outputs."""
    s, T, e, h, k = System(SMALL_MLA, H100, framework="megatron"), 4096, 2, 2048, 8
    m = SMALL_MLA
    base = cfg(ep=2, recompute="selective")
    plain = s.layer_activations(base, 1)
    assert plain["mla_latents"] == 2 * e * T * (512 + 256)
    qkv = e * T * (m.q_size + m.k_size + m.v_size)
    assert plain["qkv"] == qkv and "attention_logsumexp" not in plain
    mods = dataclasses.replace(base, recompute_modules=MODULES)
    dense = s.layer_activations(mods, 1)
    lse = 4 * T * m.num_attention_heads
    lat = T * (512 + 256)
    assert dense["mla_latents"] == e * lat
    assert dense["total"] == pytest.approx(plain["total"] - qkv - e * lat - e * T * h + lse)
    moe_plain, moe_mods = moe_activation_bytes(s, base, 1), moe_activation_bytes(s, mods, 1)
    routed_act_out = e * T * k * 768
    assert moe_mods["total"] == pytest.approx(moe_plain["total"] - qkv - e * lat - e * T * h + lse - e * T * h
                                              - routed_act_out)
    # in FP8 the outputs went as FP8 copies: those are what is freed
    f8 = dict(precision="fp8", fp8_recipe="tensorwise")
    p8 = moe_activation_bytes(s, dataclasses.replace(base, **f8), 1)
    m8 = moe_activation_bytes(s, dataclasses.replace(mods, **f8), 1)
    assert m8["total"] == pytest.approx(p8["total"] - qkv - lat - T * h + lse - T * h - T * k * 768)


def test_recompute_modules_time_closed_form():
    """What the modules re-run in the backward, on the roofline: the two separate norms, the
    routed experts' SwiGLU (read 2f, write f), the up-projection GEMMs and the rotary parts."""
    from autoconf.cost.compute import block_times, linear_gemms
    s = System(SMALL_MLA, H100, framework="megatron")
    c = cfg(ep=2, recompute="selective", recompute_modules=MODULES)
    sh = moe_shape(s, c)
    rf, m, T, h, B = s.roofline("h100-sxm"), SMALL_MLA, 4096, 2048, 2
    core = block_times(m, 1, 1, False, "selective", rf, moe=sh)
    got = block_times(m, 1, 1, False, "selective", rf, moe=sh, modules=MODULES)
    ups = linear_gemms(m, 1, 1)["attention_in"][1::2]
    assert [k for _, _, k in ups] == [512, 256]
    elems = sh.rows * sh.local_experts * 768
    want = (rf.elementwise(2 * 2 * T * h * B, kernels=2, flops=16 * T * h)
            + rf.elementwise(3 * elems * B, kernels=1, flops=6 * elems)
            + sum(rf.gemm(a, b, k, B) for a, b, k in ups)
            + rf.elementwise(2 * T * (m.num_attention_heads + 1) * 32 * B, kernels=2))
    assert got.recompute_s == pytest.approx(want)  # no attention core
    assert core.recompute_s > 0 and got.forward_s == core.forward_s


def test_recompute_modules_are_checked_searched_and_kept():
    """Only with selective recomputation, only modules the model has, only where the framework
    lets a user choose them (Megatron-LM); the search tries them beside the attention core; a
    config document keeps them."""
    from autoconf.specs.frameworks import framework
    from autoconf.study.choices import framework_inner, recompute_module_choices
    c = cfg(ep=2, recompute="selective", recompute_modules=MODULES)
    assert check(c, SMALL_MLA) is None
    assert "mla_up_proj" in check(c, SMALL_MOE) and "no MLA" in check(c, SMALL_MOE)
    assert "recompute=full" in check(dataclasses.replace(c, recompute="full"), SMALL_MLA)
    assert "twice" in check(dataclasses.replace(c, recompute_modules=("moe_act", "moe_act")), SMALL_MLA)
    dense = dataclasses.replace(SMALL_MOE, num_experts=0, experts_per_token=0, first_dense_layers=0,
                                num_shared_experts=0, expert_ffn_hidden_size=None)
    assert "fused" in check(cfg(recompute="selective", recompute_modules=("layernorm",)), dense)
    assert "cannot choose" in framework("reference").check(c) and framework("megatron").check(c) is None
    assert "delayed" in framework("megatron").check(dataclasses.replace(c, precision="fp8", fp8_recipe="delayed"))
    # under FP8 delayed scaling the search keeps what Megatron-LM takes of the modules
    delayed = list(framework_inner(framework("megatron"), 8, 1, 1, 1, "1f1b", 1, False, 32, moe_experts=64, eps=(2,),
                                   model=SMALL_MLA, precisions=(("fp8", "delayed"),)))
    assert {x.recompute_modules for x in delayed if x.recompute == "selective"} == {("mla_up_proj",)}
    assert all(framework("megatron").check(x) is None for x in delayed)
    assert cfg(recompute="selective", recompute_modules=["moe_act"]).recompute_modules == ("moe_act",)
    # flash attention: the modules instead of the core alone (which would free only the log-sum-exp)
    assert recompute_module_choices(framework("megatron"), SMALL_MLA) == (MODULES,)
    assert recompute_module_choices(framework("megatron"), SMALL_MOE) == (("layernorm", "moe_act"),)
    eager = dataclasses.replace(SMALL_MOE, attention="eager")
    assert recompute_module_choices(framework("megatron"), eager) == ((), ("core_attn", "layernorm", "moe_act"))
    assert recompute_module_choices(framework("megatron"), dense) == ((),)
    assert recompute_module_choices(framework("torchtitan"), SMALL_MLA) == ((),)
    inner = list(framework_inner(framework("megatron"), 8, 1, 1, 1, "1f1b", 1, False, 32, moe_experts=64,
                                 eps=(2,), model=SMALL_MLA))
    sel = {x.recompute_modules for x in inner if x.recompute == "selective"}
    assert sel == {MODULES} and all(not x.recompute_modules for x in inner if x.recompute != "selective")
    assert ParallelConfig.from_dict(c.to_dict()) == c and c.to_dict()["recompute_modules"] == list(MODULES)
    assert "recompute_modules" not in cfg().to_dict()


def test_recompute_modules_working_set_sits_on_the_peak():
    """Megatron's output-discarding checkpoint rebuilds a block's freed outputs in its backward and
    keeps the recomputed tensors beside them: twice the larger side (attention: MLA's q/k/v, its
    latent norms' outputs and its input norm's output; MLP: the norm before the experts and the
    experts' activation), in 16 bits also under FP8, on the stage's activation peak, and only the
    kinds of block the stage holds."""
    from autoconf.cost.stage_memory import activation_peaks, mask_bytes
    m, T, e, h, k = SMALL_MLA, 4096, 2, 2048, 8
    attn = 2 * e * T * (m.q_size + m.k_size + m.v_size + (512 + 256) + h)
    mlp = 2 * e * T * (h + k * 768)
    s = System(m, H100, framework="megatron")
    for prec in ({}, {"precision": "fp8", "fp8_recipe": "tensorwise"}):
        c = cfg(ep=2, pp=2, dp=4, recompute="selective", recompute_modules=MODULES, **prec)
        lay = layout(s, c)
        dense = s.layer_activations(c, mask_bytes(s, lay))
        peaks = activation_peaks(s, c, lay, dense["total"], 0.0)
        got = estimate(c, m, ctx=s).memory_by_stage
        for st in range(2):
            assert got[st].activations == pytest.approx(peaks[st][0] + max(attn, mlp))
    # a stage of dense blocks only (the first block is dense): no MoE block's working set
    c = cfg(ep=2, pp=8, dp=4, recompute="selective", recompute_modules=MODULES)
    lay = layout(s, c)
    assert lay.chunk_moe_layers[0] == 0
    dense = s.layer_activations(c, mask_bytes(s, lay))
    peak0 = activation_peaks(s, c, lay, dense["total"], 0.0)[0][0]
    assert estimate(c, m, ctx=s).memory_by_stage[0].activations == pytest.approx(peak0 + attn)


def test_megatron_dispatches_each_rank_s_sequence_shard_then_gathers_inside_expert_tp():
    """megatron-core 0.16.1 MoEAlltoAllTokenDispatcher: the all-to-all over the EP group carries
    the rank's own sequence-parallel shard (T / tp tokens, k pairs each), and the received rows
    are all-gathered inside the expert-TP group (tp ranks on NVLink) after it."""
    from autoconf.cost.comm import all_gather_s
    from autoconf.cost.moe import expert_tp_gather_s
    c = cfg(dp=8, tp=2, ep=8, sequence_parallel=True)
    ctx = System(MIXTRAL, H100, framework="megatron")
    T = MIXTRAL.seq_length / 2
    assert a2a_bytes(ctx, c) == pytest.approx(T * 2 * 7 / 8 * 4096 * 2)
    tune = ctx.collective_tuning
    gather = max(all_gather_s(2 * T * 2 * 4096 * 2, g, tune) for g in axis_links(ctx, c, "tp"))
    assert expert_tp_gather_s(ctx, c) == pytest.approx(gather, rel=1e-6)
    one = max(all_to_all_s(a2a_bytes(ctx, c), g, tune) for g in axis_links(ctx, c, "ep")) + gather
    assert a2a_times(ctx, c)[0] == pytest.approx(2 * one, rel=1e-6)
    # whole experts on every tp rank (torchtitan): the same shard, no gather
    assert expert_tp_gather_s(System(MIXTRAL, H100, framework="torchtitan"), c) == 0.0


def test_megatron_folds_the_expert_group_over_tp_with_expert_tp_1():
    """Megatron-Core's MoE parallel folding (expert_tensor_parallel_size 1): whole experts, the EP
    group cut from the tp x cp x dp ranks of a stage (ep may exceed dp x cp), the experts'
    gradients reduced over the tp x dp x cp / ep ranks holding the same ones."""
    from autoconf.space.config import expert_dp
    c = cfg(dp=4, tp=2, ep=8, expert_tp=1, sequence_parallel=True, zero_stage=1)
    assert check(c, MIXTRAL) is None and expert_dp(c) == 1
    assert "fold it over tp too with expert_tp 1" in check(cfg(dp=4, tp=2, ep=8, sequence_parallel=True), MIXTRAL)
    eg, edg = expert_groups(4, 1, 2, "tp-cp-dp-pp", 8, 1, fold=True)
    assert eg == [tuple(range(8))] and edg == [(r,) for r in range(8)]
    meg = System(MIXTRAL, H100, framework="megatron")
    lay = layout(meg, c)
    assert lay.chunk_expert_params == (32 * 1 * MIXTRAL.expert_params(),)  # 8 experts / ep 8, whole
    # each rank dispatches its own sequence shard, no expert-TP gather
    assert a2a_bytes(meg, c) == pytest.approx(MIXTRAL.seq_length / 2 * 2 * 7 / 8 * 4096 * 2)
    assert moe_shape(meg, c).etp == 1
    for fw in ("torchtitan", "reference"):  # their expert groups stay inside dp x cp
        z0 = dataclasses.replace(c, zero_stage=0)
        assert "cannot set expert_tp=1" in System(MIXTRAL, H100, framework=fw).framework.check(z0)
    assert check(cfg(dp=4, tp=2, ep=8, expert_tp=3), MIXTRAL).startswith("expert_tp=3")
