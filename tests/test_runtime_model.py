"""Size-dependent efficiencies, the host floor, collective tuning and the framework models,
each against its closed form."""

import math

import pytest

from autoconf.catalog import device_type
from autoconf.cost import comm
from autoconf.cost.compute import HostCost, Roofline, block_op_counts, block_times, tile_efficiency
from autoconf.frameworks import FRAMEWORKS, framework
from autoconf.config import ParallelConfig
from autoconf.errors import UserError
from autoconf.model import preset
from autoconf.topology import GroupLinks

A100 = device_type("a100-80gb")


def test_tile_efficiency_is_one_for_the_reference_gemm_and_none_on_cpu():
    assert tile_efficiency(8192, 8192, 8192, 1, 108) == pytest.approx(1.0)
    assert tile_efficiency(1, 1, 1, 1, 0) == 1.0


def test_wave_quantization_closed_form():
    # 108 SMs, m = 128 x 109, n = 128: per tile shape, tiles -> waves -> useful fraction x tile efficiency
    m, n = 128 * 109, 128
    cands = {(256, 128): (55, 1, 1.0), (128, 256): (109, 2, 1.0), (128, 128): (109, 2, 0.92),
             (128, 64): (218, 3, 0.8), (64, 64): (436, 5, 0.65)}
    best = max(m * n / (waves * 108 * tm * tn) * eff for (tm, tn), (_, waves, eff) in cands.items())
    assert best == pytest.approx(m * n / (3 * 108 * 128 * 64) * 0.8)  # 128x64 tiles win
    ref = 8192 * 8192 / (19 * 108 * 256 * 128)  # 2,048 tiles of 256x128: 19 waves
    assert tile_efficiency(m, n, 8192, 1, 108) == pytest.approx(best / ref)


def test_small_k_and_small_gemms_are_less_efficient():
    big = tile_efficiency(8192, 8192, 8192, 1, 108)
    short_k = tile_efficiency(8192, 8192, 64, 1, 108)
    assert short_k == pytest.approx(big * (64 / 128) / (8192 / (8192 + 64)))
    assert tile_efficiency(1024, 384, 1024, 1, 108) < 0.6  # a tp=8 slice of a small model


def test_gemm_time_uses_the_curve_unless_measured():
    rf = Roofline.of(A100, "bf16")
    t = rf.gemm(8192, 8192, 8192, 2)
    assert t == pytest.approx(2 * 8192**3 / (312e12 * 0.75) + A100.kernel_launch_s)
    measured = Roofline.of(A100, "bf16", gemm_eff=lambda m, n, k: 0.5)
    assert measured.gemm(1024, 384, 1024, 2) == pytest.approx(2 * 1024 * 384 * 1024 / (312e12 * 0.5) + 5e-6)


def test_elementwise_is_bound_by_bytes_or_vector_flops():
    rf = Roofline.of(A100, "bf16")
    by_bytes = rf.elementwise(1e9, kernels=1)
    assert by_bytes == pytest.approx(1e9 / (A100.memory_bandwidth_bytes_per_s * 0.8) + 5e-6)
    by_flops = rf.elementwise(1e3, kernels=1, flops=1e12)
    assert by_flops == pytest.approx(1e12 / 19.5e12 + 5e-6)


def test_block_times_carry_the_hosts_issue_time():
    m = preset("gpt2")
    rf = Roofline.of(A100, "bf16")
    dev = block_times(m, 1, 8, False, "none", rf)
    host = HostCost(forward_op_s=1e-3, backward_op_s=0.5e-3)
    hb = block_times(m, 1, 8, False, "none", rf, host)
    ops_f, ops_b = block_op_counts(m, 8, False)
    assert (hb.forward_s, hb.backward_s) == (dev.forward_s, dev.backward_s)  # device times unchanged
    assert hb.host_forward_s == pytest.approx(ops_f * 1e-3)
    assert hb.host_backward_s == pytest.approx(ops_b * 0.5e-3)
    # full recompute issues the forward's operations again in the backward pass
    hr = block_times(m, 1, 8, False, "full", rf, host)
    assert hr.host_backward_s == pytest.approx(ops_f * 1e-3 + ops_b * 0.5e-3)


def test_host_bound_passes_take_the_hosts_time():
    """A small layer at tp 4 on an A100 under Megatron is host-bound: each pass takes the host's
    issue time, and the tp collectives come on top."""
    from autoconf.cluster import cluster_from_mapping
    from autoconf.cost.estimate import estimate
    m = preset("gpt2")
    cl = cluster_from_mapping({"name": "n", "node_groups": [{"count": 1, "device": "a100-80gb", "gpus_per_node": 8,
                               "intra_node_bandwidth": "300 GB/s"}]})
    c = ParallelConfig(dp=1, pp=1, tp=4, micro_batch_size=1, num_micro_batches=1)
    e = estimate(c, m, cl, framework="megatron")
    ops_f, ops_b = block_op_counts(m, 4, False)
    fw = framework("megatron").host
    per_layer = ops_f * fw.forward_op_s + ops_b * fw.backward_op_s
    blocks = e.breakdown_s["compute"] + e.breakdown_s["recompute"]
    assert blocks >= m.num_layers * per_layer  # at least the host's time for the blocks
    assert blocks < m.num_layers * per_layer * 1.5  # and not much more: host-bound
    assert e.breakdown_s["tp_comm"] > 0


def test_op_counts_follow_the_structure():
    m = preset("gpt2")
    f1, b1 = block_op_counts(m, 1, False)
    f2, b2 = block_op_counts(m, 2, False)
    f2sp, _ = block_op_counts(m, 2, True)
    assert f2 == f1 + 2 and f2sp == f1 + 4  # two collectives per block, doubled by SP
    assert b1 < f1


G8 = GroupLinks(size=8, num_hosts=1, local_size=8, intra_bandwidth_bytes_per_s=300e9,
                inter_bandwidth_bytes_per_s=float("inf"), ring_inter_bandwidth_bytes_per_s=float("inf"),
                intra_latency_s=2e-6, inter_latency_s=10e-6)


def test_collective_tuning_closed_form():
    tune = comm.CollectiveTuning(base_latency_s=40e-6, intra_efficiency=0.75)
    S = 2**30
    ring = 40e-6 + 2 * 7 / 8 * S / (300e9 * 0.75) + 14 * 2e-6
    tree = 40e-6 + 2 * S / (300e9 * 0.75) + 2 * 7 * 2e-6  # a chain inside one host
    assert comm.all_reduce_s(S, G8, tune) == pytest.approx(min(ring, tree))
    assert comm.all_reduce_s(S, G8) == pytest.approx(2 * 7 / 8 * S / 300e9 + 14 * 2e-6)
    ag = 40e-6 + 7 / 8 * S / (300e9 * 0.75) + 7 * 2e-6
    assert comm.all_gather_s(S, G8, tune) == pytest.approx(ag)


def test_catalog_tuning_reaches_the_measured_plateau():
    # nccl-tests on 8 A100s: 1 MiB all-reduce 93 us, 1 GiB 7.96 ms (within 10% each)
    tune = A100.collective_tuning()
    assert comm.all_reduce_s(2**20, G8, tune) == pytest.approx(93e-6, rel=0.20)
    assert comm.all_reduce_s(2**30, G8, tune) == pytest.approx(7.96e-3, rel=0.10)


def test_frameworks_check_what_they_can_run():
    c = ParallelConfig(dp=2, pp=2, tp=1, micro_batch_size=1, num_micro_batches=4, schedule="gpipe")
    assert "no gpipe" in framework("megatron").check(c)
    assert framework("reference").check(c) is None
    z3 = ParallelConfig(dp=4, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1, zero_stage=3)
    assert "ZeRO-3" in framework("megatron").check(z3)
    assert framework("deepspeed").check(z3) is None
    z3pp = ParallelConfig(dp=2, pp=2, tp=1, micro_batch_size=1, num_micro_batches=4, zero_stage=3)
    assert "with pipelining" in framework("deepspeed").check(z3pp)
    knob = ParallelConfig(dp=2, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1, overlap_grad_reduce=False)
    assert "cannot switch" in framework("reference").check(knob)
    assert framework("megatron").knob(knob, "overlap_grad_reduce") is False
    assert framework("megatron").knob(z3, "overlap_grad_reduce") is False  # Megatron's default
    assert framework("torchtitan").knob(z3, "overlap_grad_reduce") is True


def test_megatron_pads_the_vocabulary():
    fw = framework("megatron")
    assert fw.padded_vocab(50257, 1) == 50304
    assert fw.padded_vocab(50257, 8) == 51200
    assert framework("reference").padded_vocab(50257, 8) == 50257


def test_unknown_framework_is_a_user_error():
    with pytest.raises(UserError, match="valid: reference, megatron, torchtitan, deepspeed"):
        framework("jax")
    assert set(FRAMEWORKS) == {"reference", "megatron", "torchtitan", "deepspeed"}
