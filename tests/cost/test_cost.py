import dataclasses

import pytest

from autoconf.cost.estimate import TIME_TERMS, estimate
from autoconf.cost.memory import state_bytes_per_param
from autoconf.cost.system import System
from autoconf.errors import UserError
from autoconf.space.config import ParallelConfig
from autoconf.specs.cluster import load_cluster
from autoconf.specs.model import preset

A100 = load_cluster("examples/clusters/a100-4x8.yaml")


@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_zero_state_bytes_match_paper(d):
    # ZeRO (arXiv 1910.02054), mixed-precision Adam: 16, 4 + 12/d, 2 + 14/d, 16/d bytes per parameter
    expect = {0: 16, 1: 4 + 12 / d, 2: 2 + 14 / d, 3: 16 / d}
    for stage, want in expect.items():
        assert state_bytes_per_param("bf16", stage, d).total == pytest.approx(want)


def cfg(**kw):
    base = dict(dp=4, pp=2, tp=4, micro_batch_size=1, num_micro_batches=16)
    base.update(kw)
    return ParallelConfig(**base)


def test_breakdown_adds_up_and_json_fields():
    e = estimate(cfg(recompute="selective", sequence_parallel=True, zero_stage=1), preset("llama-3-8b"), A100)
    assert set(e.breakdown_s) == set(TIME_TERMS)
    assert sum(e.breakdown_s.values()) == pytest.approx(e.step_time_s)
    d = e.to_dict()
    for k in ("step_time_s", "breakdown_s", "peak_memory_bytes", "memory_by_stage", "fits", "tokens_per_s", "mfu", "reasons"):
        assert k in d
    for mm in d["memory_by_stage"]:
        assert {"parameters", "gradients", "optimizer", "activations", "other"} <= set(mm)
    assert 0.2 < e.mfu < 0.8
    # MFU from its definition (Narayanan et al., arXiv 2104.04473): model FLOPs per token, three
    # times the forward's matmuls (projections 2 x weights, scores and weighted sum 2 s q each,
    # the output layer 2 V h), x tokens per second over the 32 GPUs' bf16 peak
    m, c = preset("llama-3-8b"), e.config
    h, q, kv, f = m.hidden_size, m.q_size, m.kv_size, m.ffn_hidden_size
    block = 2 * (h * (q + 2 * kv) + q * h + 3 * h * f) + 4 * m.seq_length * q
    per_token = 3 * (m.num_layers * block + 2 * m.vocab_size * h)
    assert e.tokens_per_s == pytest.approx(c.dp * c.micro_batch_size * c.num_micro_batches * m.seq_length
                                           / e.step_time_s, rel=1e-12)
    assert e.mfu == pytest.approx(per_token * e.tokens_per_s / (32 * 312e12), rel=1e-9)


def test_gpt3_175b_megatron_config_is_plausible():
    # Narayanan et al. 2021 report 138 TFLOP/s per A100 (44% of peak) for 175B on 1024 GPUs
    # (t=8, p=16, full recomputation); a model that is off by 2x is wrong.
    big = dataclasses.replace(A100, node_groups=(dataclasses.replace(A100.node_groups[0], count=128),))
    c = ParallelConfig(dp=8, pp=16, tp=8, micro_batch_size=1, num_micro_batches=192, schedule="interleaved",
                       virtual_stages=2, recompute="full")
    e = estimate(c, preset("gpt3-175b"), big)
    assert 0.3 < e.mfu < 0.6 and e.fits
    # and its MFU is the paper's 72 B s l h^2 (1 + s/6h + V/12hl) FLOPs per batch of B sequences
    m = preset("gpt3-175b")
    ln, h, s, V = m.num_layers, m.hidden_size, m.seq_length, m.vocab_size
    batch_flops = 72 * c.global_batch * s * ln * h * h * (1 + s / (6 * h) + V / (12 * h * ln))
    assert e.mfu == pytest.approx(batch_flops / e.step_time_s / (1024 * 312e12), rel=1e-9)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("schedule,v,layered", [("1f1b", 1, False), ("gpipe", 1, True), ("interleaved", 2, False),
                                                ("breadth_first", 2, True)])
def test_recompute_never_raises_activation_memory(zero, schedule, v, layered):
    m = preset("gpt3-2.7b")
    acts = [estimate(cfg(zero_stage=zero, schedule=schedule, virtual_stages=v, layered_grad_accum=layered, recompute=r),
                     m, A100).memory_by_stage[0].activations for r in ("none", "selective", "full")]
    assert acts[0] >= acts[1] >= acts[2]


def _slower(cluster, factor):
    g = cluster.node_groups[0]
    return dataclasses.replace(cluster, node_groups=(dataclasses.replace(
        g, nic_bandwidth_bytes_per_s=g.nic_bandwidth_bytes_per_s / factor,
        intra_node_bandwidth_bytes_per_s=g.intra_node_bandwidth_bytes_per_s / factor),))


@pytest.mark.parametrize("c", [cfg(), cfg(zero_stage=3), cfg(schedule="interleaved", virtual_stages=2),
                               cfg(pp=1, dp=8, layered_grad_accum=True, num_micro_batches=8, zero_stage=2),
                               cfg(sequence_parallel=True, schedule="breadth_first", virtual_stages=4, layered_grad_accum=True)])
def test_slower_link_never_lowers_step_time(c):
    m = preset("llama-2-7b")
    times = [estimate(c, m, _slower(A100, f)).step_time_s for f in (1, 2, 8, 64)]
    assert times == sorted(times)


def test_more_micro_batches_never_raise_1f1b_bubble_fraction():
    m = preset("gpt3-6.7b")
    fractions = []
    for n in (4, 8, 16, 32, 64, 128):
        e = estimate(cfg(dp=1, pp=4, tp=8, num_micro_batches=n), m, A100)
        fractions.append(e.breakdown_s["bubble"] / e.step_time_s)
    assert all(a >= b - 1e-9 for a, b in zip(fractions, fractions[1:]))


def _fully_simulated(c, m):
    """The estimate with every micro-batch of the step simulated (no steady-state extrapolation)."""
    from autoconf.cost import schedule_time as est
    saved = est.sim_size
    est.sim_size = lambda schedule, pp, mm: mm
    try:
        return estimate(c, m, A100, ctx=System(m, A100))
    finally:
        est.sim_size = saved


def test_steady_state_extrapolation_matches_full_simulation():
    # the estimate simulates a few pp micro-batches and extrapolates; compare with a full run
    m = preset("gpt3-6.7b")
    c = cfg(dp=1, pp=4, tp=8, num_micro_batches=96, schedule="interleaved", virtual_stages=2)
    e = estimate(c, m, A100)
    full = _fully_simulated(c, m)
    assert e.step_time_s == pytest.approx(full.step_time_s, rel=1e-6)
    assert e.peak_memory_bytes == pytest.approx(full.peak_memory_bytes, rel=1e-9)


def test_cross_group_placement_is_slower():
    two = load_cluster("examples/clusters/two-kinds.yaml")
    m = preset("llama-2-7b")
    # dp groups inside the fast InfiniBand group vs across the capped inter-group link
    inside = estimate(ParallelConfig(dp=4, pp=1, tp=8, micro_batch_size=1, num_micro_batches=8), m, two)
    across = estimate(ParallelConfig(dp=6, pp=1, tp=8, micro_batch_size=1, num_micro_batches=8), m, two)
    assert across.breakdown_s["dp_comm"] > inside.breakdown_s["dp_comm"]


def test_layered_accumulation_overlaps_more_dp_than_standard():
    m = preset("gpt3-2.7b")
    c = ParallelConfig(dp=32, pp=1, tp=1, micro_batch_size=1, num_micro_batches=8, zero_stage=3)
    std = estimate(c, m, A100)
    lay = estimate(dataclasses.replace(c, layered_grad_accum=True), m, A100)
    assert lay.breakdown_s["dp_comm"] < std.breakdown_s["dp_comm"]
    assert lay.memory_by_stage[0].activations > std.memory_by_stage[0].activations


def test_too_few_devices_and_invalid_config_are_user_errors():
    with pytest.raises(UserError, match="cluster has 32"):
        estimate(cfg(dp=8, tp=8), preset("llama-3-8b"), A100)
    with pytest.raises(UserError, match="tp"):
        estimate(cfg(tp=3, dp=1), preset("llama-3-8b"), A100)


def test_out_of_memory_gets_reason():
    e = estimate(ParallelConfig(dp=1, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1), preset("llama-3-70b"), A100)
    assert not e.fits and "out of memory" in e.reasons[0]


@pytest.mark.parametrize("schedule,v,layered", [("breadth_first", 4, True), ("interleaved", 4, False), ("1f1b", 1, False)])
def test_extrapolation_exact_with_unequal_stages(schedule, v, layered):
    # 36 layers over 32 chunks: unequal stages take longer to reach the steady state
    m = preset("gpt2-large")
    c = ParallelConfig(dp=2, pp=8, tp=2, micro_batch_size=1, num_micro_batches=256, schedule=schedule,
                       virtual_stages=v, layered_grad_accum=layered)
    e = estimate(c, m, A100)
    assert e.step_time_s == pytest.approx(_fully_simulated(c, m).step_time_s, rel=2e-3)


CPU = load_cluster("examples/clusters/localhost-cpu.yaml")


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("m,b", [(2, 1), (4, 2), (8, 4), (8, 1), (16, 2)])
def test_layered_full_recompute_peak_matches_closed_form(m, b, dp):
    """pp = 1 layered accumulation with full recompute, units embedding, L blocks, head (fp32 on
    CPU: masks and norm statistics at 4 bytes). Candidate peaks:
    - the head's first backward: every unit's activations for every micro-batch, the loss gradient
      of one micro-batch's logits, the head's gradient;
    - block l's first backward: the checkpoints of blocks 0..l and the embedding's indices for every
      micro-batch, every micro-batch's gradient at the boundary above, one block's recompute working
      set and backward temporaries, the gradients of the head and blocks l..L-1, and with dp > 1 the
      reduction's copy of the unit above;
    - the embedding's backward: its indices, the boundary gradients, every gradient.
    """
    from autoconf.cost.activations import (
        block_backward_temporary_bytes,
        embedding_activation_bytes,
        head_activation_bytes,
        layer_activation_bytes,
    )
    from autoconf.cost.memory import BUCKET_BYTES
    from autoconf.specs.hf import load_model

    model = load_model("examples/models/bench-h256.yaml")
    c = ParallelConfig(dp=dp, pp=1, tp=1, micro_batch_size=b, num_micro_batches=m, layered_grad_accum=True,
                       recompute="full")
    st = estimate(c, model, CPU).memory_by_stage[0]
    s, h, L = model.seq_length, model.hidden_size, model.num_layers
    E = embedding_activation_bytes(model, b, mask_bytes=4)
    H = head_activation_bytes(model, b, mask_bytes=4)
    layer = layer_activation_bytes(model, b, recompute="full", mask_bytes=4)
    ckpt, W = layer["total"], layer["recompute_working_bytes"]
    T = block_backward_temporary_bytes(model, b)
    d = 4 * s * b * h  # one micro-batch's gradient at a unit boundary
    ce = 4 * s * b * model.vocab_size
    g_e, g_b, g_h = 4 * model.embedding_params(), 4 * model.layer_params(), 4 * model.output_params()
    copy = (lambda g: min(BUCKET_BYTES, g)) if dp > 1 else (lambda g: 0.0)
    assert ckpt == d
    candidates = [m * (E + L * ckpt + H) + ce + g_h]
    for l in range(L):
        above = g_h if l == L - 1 else g_b
        candidates.append(m * E + m * (l + 1) * ckpt + m * d + W + T + copy(above) + g_h + (L - l) * g_b)
    candidates.append(m * E + m * d + copy(g_b) + g_h + L * g_b + g_e)
    # m = 16: 8 micro-batches simulated, activations and held gradients scaled by 2: the same peak
    assert st.activations + st.gradients == pytest.approx(max(candidates), rel=1e-12)

