"""Size-dependent efficiencies, the host floor, collective tuning and the framework models,
each against its closed form."""


import dataclasses

import pytest

from autoconf.cost import comm
from autoconf.cost.chunk_time import edge_gradient_s
from autoconf.cost.compute import block_op_counts, block_times
from autoconf.cost.moe import block_for
from autoconf.cost.roofline import Roofline, tile_efficiency
from autoconf.errors import UserError
from autoconf.space.config import ParallelConfig
from autoconf.specs.devices import CollectiveTuning, device_type
from autoconf.specs.frameworks import FRAMEWORKS, HostCost, framework
from autoconf.specs.model import preset
from autoconf.specs.topology import GroupLinks

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
    issue time, and the tp collectives run inside it (queued on the stream like the rest)."""
    from autoconf.cost.estimate import estimate
    from autoconf.specs.cluster import cluster_from_mapping
    m = preset("gpt2")
    cl = cluster_from_mapping({"name": "n", "node_groups": [{"count": 1, "device": "a100-80gb", "gpus_per_node": 8,
                               "intra_node_bandwidth": "300 GB/s"}]})
    c = ParallelConfig(dp=1, pp=1, tp=4, micro_batch_size=1, num_micro_batches=1)
    e = estimate(c, m, cl, framework="megatron")
    ops_f, ops_b = block_op_counts(m, 4, False)
    fw = framework("megatron").host
    per_layer = ops_f * fw.forward_op_s + ops_b * fw.backward_op_s
    passes = e.breakdown_s["compute"] + e.breakdown_s["recompute"] + e.breakdown_s["tp_comm"]
    assert passes >= m.num_layers * per_layer  # at least the host's time for the blocks
    assert passes < m.num_layers * per_layer * 1.2  # and not much more: host-bound, collectives inside
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
    tune = CollectiveTuning(base_latency_s=40e-6, intra_efficiency=0.75)
    S = 2**30
    ring = 40e-6 + 2 * 7 / 8 * S / (300e9 * 0.75) + 14 * 2e-6
    tree = 40e-6 + 2 * S / (300e9 * 0.75) + 2 * 7 * 2e-6  # a chain inside one host
    assert comm.all_reduce_s(S, G8, tune) == pytest.approx(min(ring, tree))
    assert comm.all_reduce_s(S, G8) == pytest.approx(2 * 7 / 8 * S / 300e9 + 14 * 2e-6)
    ag = 40e-6 + 7 / 8 * S / (300e9 * 0.75) + 7 * 2e-6
    assert comm.all_gather_s(S, G8, tune) == pytest.approx(ag)


def test_short_rings_reach_less_of_the_fabric():
    tune = CollectiveTuning(base_latency_s=40e-6, intra_efficiency=0.8, short_ring_loss=0.3)
    S = 2**30
    g2 = GroupLinks(size=2, num_hosts=1, local_size=2, intra_bandwidth_bytes_per_s=300e9,
                    inter_bandwidth_bytes_per_s=float("inf"), ring_inter_bandwidth_bytes_per_s=float("inf"),
                    intra_latency_s=2e-6, inter_latency_s=10e-6)
    assert comm.ring_all_reduce_s(S, g2, tune) == pytest.approx(40e-6 + S / (300e9 * 0.65) + 2 * 2e-6)
    assert comm.ring_all_reduce_s(S, G8, tune) == pytest.approx(40e-6 + 2 * 7 / 8 * S / (300e9 * 0.7625) + 14 * 2e-6)
    # a runtime is credited only with the algorithms it runs
    assert comm.all_reduce_s(S, G8, tune, algorithms=("tree",)) == pytest.approx(comm.tree_all_reduce_s(S, G8, tune))
    assert comm.all_reduce_s(S, G8, tune) == comm.all_reduce_s(S, G8, tune, algorithms=("ring",))


def test_catalog_tuning_reaches_the_measured_plateau():
    # nccl-tests on 8 A100s: 1 MiB all-reduce 93 us, 1 GiB 7.96 ms (within 10% each)
    tune = A100.collective_tuning()
    assert comm.all_reduce_s(2**20, G8, tune) == pytest.approx(93e-6, rel=0.20)
    assert comm.all_reduce_s(2**30, G8, tune) == pytest.approx(7.96e-3, rel=0.10)
    # and a 2-GPU ring its lower bus bandwidth: 1 GiB in 5.44 ms
    g2 = GroupLinks(size=2, num_hosts=1, local_size=2, intra_bandwidth_bytes_per_s=300e9,
                    inter_bandwidth_bytes_per_s=float("inf"), ring_inter_bandwidth_bytes_per_s=float("inf"),
                    intra_latency_s=2e-6, inter_latency_s=10e-6)
    assert comm.all_reduce_s(2**30, g2, tune) == pytest.approx(5.44e-3, rel=0.10)


def test_frameworks_check_what_they_can_run():
    c = ParallelConfig(dp=2, pp=2, tp=1, micro_batch_size=1, num_micro_batches=4, schedule="gpipe")
    assert "no gpipe" in framework("megatron").check(c)
    assert framework("reference").check(c) is None
    z3 = ParallelConfig(dp=4, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1, zero_stage=3)
    assert framework("megatron").check(z3) is None  # Megatron FSDP
    assert "ZeRO-3" in framework("megatron").check(dataclasses.replace(z3, pp=2, num_micro_batches=4))
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


def _a100_node(n_nodes: int = 1):
    from autoconf.specs.cluster import cluster_from_mapping
    return cluster_from_mapping({"name": "n", "node_groups": [{
        "count": n_nodes, "device": "a100-80gb", "gpus_per_node": 8, "intra_node_bandwidth": "300 GB/s",
        "nics": {"count": 8, "bandwidth": "200 Gbit/s", "kind": "infiniband"}}]})


def test_megatron_memory_terms():
    """Megatron keeps bf16 gradients in an fp32 buffer (18 bytes per parameter, 6 + 12/dp with
    the distributed optimizer), has no per-micro-batch receive buffers, and capacity is memory
    less the fragmentation margin."""
    from autoconf.cost.estimate import estimate
    m = preset("llama-3-8b")
    cl = _a100_node(2)
    c = ParallelConfig(dp=2, pp=2, tp=4, micro_batch_size=1, num_micro_batches=8)
    meg = estimate(c, m, cl, framework="megatron")
    ref = estimate(c, m, cl)
    s_meg, s_ref = meg.memory_by_stage[0], ref.memory_by_stage[0]
    params = s_meg.parameters / 2
    assert s_meg.gradients == pytest.approx(4 * params)
    assert s_ref.gradients == pytest.approx(s_ref.parameters)  # 2 bytes each
    # Megatron's padded vocabulary (128,256 -> a multiple of 128 x 4) adds embedding parameters
    pad = (framework("megatron").padded_vocab(m.vocab_size, 4) - m.vocab_size) * m.hidden_size / 4
    assert s_meg.parameters - s_ref.parameters == pytest.approx(2 * pad)
    assert s_meg.optimizer == pytest.approx(12 * params)
    z1 = estimate(ParallelConfig(dp=2, pp=2, tp=4, micro_batch_size=1, num_micro_batches=8, zero_stage=1),
                  m, cl, framework="megatron").memory_by_stage[0]
    assert (z1.parameters + z1.gradients + z1.optimizer) == pytest.approx((6 + 12 / 2) * params)
    recv = dict(s_ref.other_parts).get("pipeline receive buffers")
    assert recv == pytest.approx(1 * 8 * m.seq_length * m.hidden_size * 2)  # stage 0 receives gradients only
    assert "pipeline receive buffers" not in dict(s_meg.other_parts)
    assert s_meg.capacity == pytest.approx(80 * 2**30 * (1 - framework("megatron").memory_fragmentation))
    assert meg.framework == "megatron" and meg.to_dict()["framework"] == "megatron"


def test_megatron_gradient_buffer_is_held_at_every_peak():
    """Megatron-Core allocates every gradient (its fp32 main_grad buffer) when it wraps the model:
    an interleaved stage whose activation peak comes before its later chunks' first backward holds
    them all the same, while the reference trainer's .grad tensors exist only from each chunk's
    first backward (the rest come later, with fewer activations alive)."""
    from autoconf.cost.estimate import estimate
    m = preset("llama-2-70b")
    cl = _a100_node(2)
    c = ParallelConfig(dp=1, pp=2, tp=2, micro_batch_size=1, num_micro_batches=2, schedule="interleaved",
                       virtual_stages=4)
    from autoconf.cost.layout import layout
    from autoconf.cost.stage_memory import activation_peaks, mask_bytes
    from autoconf.cost.system import System
    meg = estimate(c, m, cl, framework="megatron").memory_by_stage[0]
    ref = estimate(c, m, cl).memory_by_stage[0]
    assert meg.gradients == pytest.approx(4 * meg.parameters / 2)  # all of the stage's, in fp32
    assert ref.gradients < 0.75 * ref.parameters  # 2 bytes each when all exist: here not yet
    # the peak is the activations' own (their most over the schedule), the gradients beside it
    s = System(m, cl, framework="megatron")
    lay = layout(s, c)
    own = activation_peaks(s, c, lay, s.layer_activations(c, mask_bytes(s, lay))["total"], 0.0)[0][0]
    late = activation_peaks(s, c, lay, s.layer_activations(c, mask_bytes(s, lay))["total"], 4.0)[0][0]
    assert meg.activations == pytest.approx(own) and own > late


def test_estimate_refuses_what_the_framework_cannot_run():
    from autoconf.cost.estimate import estimate
    c = ParallelConfig(dp=2, pp=2, tp=4, micro_batch_size=1, num_micro_batches=8, schedule="gpipe")
    with pytest.raises(UserError, match="megatron has no gpipe"):
        estimate(c, preset("llama-3-8b"), _a100_node(2), framework="megatron")


def test_zero3_gathers_hide_behind_compute_only_when_prefetched():
    """Layer by layer: with prefetching (torchtitan's FSDP2 default) a gather shorter than its
    layer's compute is hidden; without it every layer's gather, forward and backward, every
    micro-batch, is exposed."""
    import dataclasses

    from autoconf.cost import comm
    from autoconf.cost.estimate import estimate
    from autoconf.cost.groups import axis_links, worst
    from autoconf.cost.system import System
    from autoconf.specs import frameworks
    m = preset("llama-3-8b")
    cl = _a100_node(4)
    c = ParallelConfig(dp=32, pp=1, tp=1, micro_batch_size=1, num_micro_batches=4, zero_stage=3)
    titan = frameworks.FRAMEWORKS["torchtitan"]
    no_prefetch = dataclasses.replace(titan, defaults={**titan.defaults, "overlap_param_gather": False})
    hidden = estimate(c, m, cl, framework="torchtitan")
    sysm = System(m, cl, framework=no_prefetch)
    exposed = estimate(c, m, cl, ctx=sysm)
    assert exposed.breakdown_s["dp_comm"] > hidden.breakdown_s["dp_comm"]
    ag = worst(axis_links(sysm, c, "dp"), comm.all_gather_s, m.layer_params() * 2, 1.0, sysm.collective_tuning)
    assert exposed.breakdown_s["dp_comm"] >= 2 * 4 * m.num_layers * ag * 0.99


def test_cross_entropy_streams_every_logit_as_megatron_does():
    """Forward 38 bytes per 16-bit logit (cast, max, subtract, exp, sum, divide), backward 14."""
    from autoconf.cost.compute import head_times
    m = preset("gpt2")
    rf = Roofline.of(A100, "fp16")
    T, V, h = 4 * m.seq_length, m.vocab_size, m.hidden_size
    t = head_times(m, 4, 1, rf)
    bw = A100.memory_bandwidth_bytes_per_s * A100.memory_efficiency
    fwd_ew = max((2 * T * h * 2 + 38 * T * V) / bw, 4 * T * V / 19.5e12) + 7 * 5e-6
    assert t.forward_s == pytest.approx(rf.gemm(T, V, h, 2) + fwd_ew)
    bwd_ew = (2 * T * h * 2 + 14 * T * V) / bw + 3 * 5e-6
    assert t.backward_s == pytest.approx(rf.gemm(T, h, V, 2) + rf.gemm(V, h, T, 2) + bwd_ew)


def test_layered_pp1_keeps_one_tied_matrix():
    """pp = 1 layered accumulation is simulated as one chunk per layer on one device: a tied output
    layer shares the embedding's matrix there (a copy exists only on another pipeline stage)."""
    import dataclasses

    from autoconf.cost.estimate import estimate
    m = dataclasses.replace(preset("gpt2"), tied_embeddings=True)
    cl = _a100_node()
    std = estimate(ParallelConfig(dp=1, pp=1, tp=1, micro_batch_size=1, num_micro_batches=4), m, cl)
    lay = estimate(ParallelConfig(dp=1, pp=1, tp=1, micro_batch_size=1, num_micro_batches=4,
                                  layered_grad_accum=True), m, cl)
    assert lay.memory_by_stage[0].parameters == pytest.approx(std.memory_by_stage[0].parameters)


def test_verify_refuses_a_framework_it_does_not_run():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "autoconf", "search", "--model", "tiny", "--cluster",
                        "examples/clusters/localhost-cpu.yaml", "--global-batch", "8", "--storage", "none",
                        "--framework", "megatron", "--verify", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "reference trainer" in r.stderr


def test_pipeline_transfers_of_the_replicas_share_the_nic():
    """dp2 pp2 on 2 hosts x 2 with one NIC each: both replicas' stage boundaries cross the same
    NIC at once, so each transfer gets half of it; at dp1 the one transfer has it whole."""
    from autoconf.cost.schedule_time import p2p_times
    from autoconf.cost.system import System
    from autoconf.specs.cluster import cluster_from_mapping
    def hosts(per_host):
        return cluster_from_mapping({"name": "n", "node_groups": [{
            "count": 2, "device": "cpu", "gpus_per_node": per_host, "intra_node_bandwidth": "4 GB/s", "memory": "4 GiB",
            "nics": {"count": 1, "bandwidth": "80 Mbit/s", "kind": "ethernet"}}],
            "latency": {"intra_node": "80 us", "inter_node": "200 us"}})
    nbytes = 1e6
    two = ParallelConfig(dp=2, pp=2, tp=1, micro_batch_size=1, num_micro_batches=2, rank_order="dp-pp-tp")
    one = ParallelConfig(dp=1, pp=2, tp=1, micro_batch_size=1, num_micro_batches=2)
    assert p2p_times(System(model=preset("tiny"), cluster=hosts(1)), one, nbytes)[0] == pytest.approx(
        200e-6 + nbytes / 10e6)
    assert p2p_times(System(model=preset("tiny"), cluster=hosts(2)), two, nbytes)[0] == pytest.approx(
        200e-6 + nbytes / 5e6)


def test_tp_collectives_hide_only_under_the_gemm_beside_them():
    """``tensor_parallel.overlapped`` against its closed form: Megatron-LM's column-parallel
    backward (asynchronous collectives beside its GEMMs) and Transformer Engine's pipelined
    forward (``tp_comm_overlap``); torchtitan without async TP runs every collective in turn."""
    from autoconf.cost import comm
    from autoconf.cost.compute import linear_gemms
    from autoconf.cost.groups import axis_links, collective_s
    from autoconf.cost.system import System
    from autoconf.cost.tensor_parallel import pipelined, tp_times
    m = preset("llama-3-8b")
    cl = _a100_node(1)
    kinds = [("a100-80gb",)]

    def parts(fw, **kw):
        c = ParallelConfig(dp=1, pp=1, tp=4, micro_batch_size=1, num_micro_batches=1, **kw)
        s = System(m, cl, framework=fw)
        rf, B = s.roofline("a100-80gb"), m.dtype_bytes
        nbytes = m.seq_length * m.hidden_size * B
        links = axis_links(s, c, "tp")
        lin = linear_gemms(m, 1, 4)
        g = {k: v[0] for k, v in lin.items()}
        fwd = {k: rf.gemm(a, n, k_, B) for k, (a, n, k_) in g.items()}
        chunked = {k: 4 * rf.gemm(a / 4, n, k_, B) for k, (a, n, k_) in g.items()}
        dgrad = {k: rf.gemm(a, k_, n, B) for k, (a, n, k_) in g.items()}
        chunked_dgrad = {k: 4 * rf.gemm(a / 4, k_, n, B) for k, (a, n, k_) in g.items()}
        wgrad = {k: rf.gemm(n, k_, a, B) for k, (a, n, k_) in g.items()}
        ag = collective_s(s, links, comm.all_gather_s, 4, nbytes)
        rs = collective_s(s, links, comm.reduce_scatter_s, 4, nbytes)
        ar = collective_s(s, links, comm.all_reduce_s, 4, nbytes, lambda _: ("ring", "tree"))
        return tp_times(s, c, kinds), ag, rs, ar, fwd, chunked, dgrad, chunked_dgrad, wgrad

    assert pipelined(4.0, 2.0, 2) == pytest.approx(4.0 + 1.0)  # transfer-bound: all of it, then a chunk
    assert pipelined(1.0, 8.0, 4) == pytest.approx(8.0)  # GEMM-bound: the GEMM alone
    # Megatron, no sequence parallelism: the backward all-reduce of each column layer's input
    # gradient runs under its weight-gradient GEMM
    t, ag, rs, ar, fwd, _, _, _, wgrad = parts("megatron")
    assert t.forward_per_layer_s == pytest.approx(2 * ar)
    assert t.backward_per_layer_s == pytest.approx(max(0, ar - wgrad["attention_in"]) + max(0, ar - wgrad["mlp_in"]))
    assert t.backward_per_layer_s < 2 * ar
    # Megatron with sequence parallelism: the row layers' gathers exposed, the column layers'
    # re-gather under the input-gradient GEMM, their reduce-scatter under the weight-gradient one
    t, ag, rs, ar, fwd, chunked, dgrad, chunked_dgrad, wgrad = parts("megatron", sequence_parallel=True)
    col = [("attention_in"), ("mlp_in")]
    want = sum(ag + max(0, ag - dgrad[k]) + max(0, rs - wgrad[k]) for k in col)
    assert t.forward_per_layer_s == pytest.approx(2 * (ag + rs))
    assert t.backward_per_layer_s == pytest.approx(want)
    # ... and with Transformer Engine's tp_comm_overlap the forward pairs pipeline with their GEMMs
    t, ag, rs, ar, fwd, chunked, dgrad, chunked_dgrad, wgrad = parts("megatron", sequence_parallel=True,
                                                                     tp_comm_overlap=True)
    want_f = sum(pipelined(ag, chunked[c_], 4) - fwd[c_] + pipelined(rs, chunked[r_], 4) - fwd[r_]
                 for c_, r_ in (("attention_in", "attention_out"), ("mlp_in", "mlp_out")))
    assert t.forward_per_layer_s == pytest.approx(want_f)
    want_b = sum(pipelined(ag, chunked_dgrad[r_], 4) - dgrad[r_] + max(0, ag - dgrad[c_]) + max(0, rs - wgrad[c_])
                 for c_, r_ in (("attention_in", "attention_out"), ("mlp_in", "mlp_out")))
    assert t.backward_per_layer_s == pytest.approx(want_b)
    # torchtitan with async TP: both directions pipelined with the input-gradient GEMMs they touch
    t, ag, rs, ar, fwd, chunked, dgrad, chunked_dgrad, wgrad = parts("torchtitan", sequence_parallel=True,
                                                                     tp_comm_overlap=True)
    assert t.forward_per_layer_s == pytest.approx(want_f)
    assert t.backward_per_layer_s == pytest.approx(sum(
        max(0, pipelined(ag, chunked_dgrad[r_], 4) - dgrad[r_])
        + max(0, pipelined(rs, chunked_dgrad[c_], 4) - dgrad[c_])
        for c_, r_ in (("attention_in", "attention_out"), ("mlp_in", "mlp_out"))))
    # torchtitan (no asynchronous backward): every collective in turn; full recompute repeats the forward's
    t, ag, rs, *_ = parts("torchtitan", sequence_parallel=True)
    assert (t.forward_per_layer_s, t.backward_per_layer_s) == pytest.approx((2 * (ag + rs), 2 * (ag + rs)))
    t, ag, rs, *_ = parts("torchtitan", sequence_parallel=True, recompute="full")
    assert t.backward_per_layer_s == pytest.approx(4 * (ag + rs))


def test_tp_overlap_is_not_priced_on_cpu_processes():
    """CPU processes run their collectives on the cores that compute: Megatron's asynchronous
    backward hides nothing there (the same times as a framework that runs them in turn)."""
    from autoconf.cost.system import System
    from autoconf.cost.tensor_parallel import tp_times
    from autoconf.specs.cluster import cluster_from_mapping
    m = preset("gpt2")
    cl = cluster_from_mapping({"name": "cpu", "node_groups": [{
        "count": 1, "device": "cpu", "gpus_per_node": 4, "intra_node_bandwidth": "5 GB/s",
        "nics": {"count": 1, "bandwidth": "1 Gbit/s", "kind": "ethernet"}}]})
    c = ParallelConfig(dp=1, pp=1, tp=2, micro_batch_size=1, num_micro_batches=1)
    meg = tp_times(System(m, cl, framework="megatron"), c, [("cpu",)])
    ref = tp_times(System(m, cl, framework="reference"), c, [("cpu",)])
    assert meg.forward_per_layer_s > 0
    assert meg.backward_per_layer_s == pytest.approx(meg.forward_per_layer_s)
    assert (meg.forward_per_layer_s, meg.backward_per_layer_s) == pytest.approx(
        (ref.forward_per_layer_s, ref.backward_per_layer_s))


def test_deepspeed_gradient_handling():
    """DeepSpeed, against DeepSpeed 0.19.8's code: ZeRO-0/1 leave accumulation to autograd (one
    read-read-write pass over the block's bf16 gradients per micro-batch, a kernel per tensor);
    bf16 without ZeRO under its pipeline engine runs the BF16 optimizer, which zeroes the bf16
    gradients before each backward (2 bytes per parameter) and adds them into a second bf16 copy
    after it (read 2 + 2, write 2; a kernel per tensor), on top of autograd's pass; it keeps that
    copy (2 bytes per parameter), shards its fp32 states over dp and gathers the parameters inside
    the step."""
    from autoconf.cost.data_parallel import post_all_gather_s
    from autoconf.cost.estimate import estimate
    from autoconf.cost.layout import layout
    from autoconf.cost.system import System
    m = preset("llama-3-8b")
    cl = _a100_node(1)
    s = System(m, cl, framework="deepspeed")
    rf = s.roofline("a100-80gb")
    bw = rf.memory_bandwidth_bytes_per_s * rf.memory_efficiency
    tensors = 4 + m.norms_per_block  # no biases, RMSNorm: one weight each

    def block(**kw):
        return block_for(s, "a100-80gb", ParallelConfig(tp=1, micro_batch_size=1, **kw))

    plain = block(dp=1, pp=1, num_micro_batches=1)
    acc = block(dp=1, pp=1, num_micro_batches=4)
    bf16opt = block(dp=1, pp=2, num_micro_batches=4)
    zero1 = block(dp=2, pp=2, num_micro_batches=4, zero_stage=1)
    assert s.policy.bf16_optimizer(ParallelConfig(dp=1, pp=2, tp=1, micro_batch_size=1, num_micro_batches=4))
    assert acc.backward_s - plain.backward_s == pytest.approx(
        (2 + 2 + 2) * m.layer_params() / bw + tensors * rf.kernel_launch_s, rel=1e-6)
    assert zero1.backward_s == pytest.approx(acc.backward_s)
    assert bf16opt.backward_s - plain.backward_s == pytest.approx(
        (6 + 8) * m.layer_params() / bw + 2 * tensors * rf.kernel_launch_s, rel=1e-6)
    # memory: the second gradient copy (2 bytes per parameter of the stage) on top of the bf16
    # gradients, fp32 states sharded as under ZeRO-1
    c0 = ParallelConfig(dp=2, pp=2, tp=1, micro_batch_size=1, num_micro_batches=4)
    e0 = estimate(c0, m, cl, ctx=s)
    e1 = estimate(dataclasses.replace(c0, zero_stage=1), m, cl, ctx=s)
    for a, b in zip(e0.memory_by_stage, e1.memory_by_stage):
        assert a.gradients == pytest.approx(2 * b.gradients, rel=1e-6)
        assert a.optimizer == pytest.approx(b.optimizer)
    # the parameters are gathered inside the step, not under the next forward (DeepSpeed's
    # overlap_param_gather default is ZeRO-3's prefetch)
    gather = post_all_gather_s(s, c0, layout(s, c0))
    meg = System(m, cl, framework="megatron")
    c_meg = dataclasses.replace(c0, zero_stage=1, overlap_param_gather=True)
    assert gather > 0 and gather > 4 * post_all_gather_s(meg, c_meg, layout(meg, c_meg))
    # Megatron-LM fuses its accumulation into the weight-gradient GEMM: no such pass
    c = ParallelConfig(dp=1, pp=2, tp=1, micro_batch_size=1, num_micro_batches=4)
    assert not meg.policy.bf16_optimizer(c)
    assert block_for(meg, "a100-80gb", c).backward_s == pytest.approx(
        block_for(meg, "a100-80gb", dataclasses.replace(c, num_micro_batches=1)).backward_s)


def test_deepspeed_overlaps_the_gradient_reduction_only_with_zero_and_no_pipeline():
    """DeepSpeed 0.19.8: its pipeline engine reduces after the flush (``ReduceGrads``) and ZeRO-0
    after the backward (``buffered_allreduce_fallback``), whatever ``overlap_comm`` says; only
    ZeRO-1/2/3's bucket hooks reduce under the backward. The search does not try the knob where it
    does nothing; Megatron's ``overlap_grad_reduce`` applies with pipelining too."""
    from autoconf.cost.estimate import estimate
    from autoconf.study.choices import framework_inner
    m = preset("llama-3-8b")
    cl = _a100_node(1)
    ds = framework("deepspeed")
    for kw, applies in ((dict(pp=2, zero_stage=0), False), (dict(pp=2, zero_stage=1), False),
                        (dict(pp=1, zero_stage=0), False), (dict(pp=1, zero_stage=1), True),
                        (dict(pp=1, zero_stage=2), True)):
        c = ParallelConfig(dp=8 // kw["pp"], tp=1, micro_batch_size=1, num_micro_batches=4, recompute="full", **kw)
        on, off = (dataclasses.replace(c, overlap_grad_reduce=v) for v in (True, False))
        assert ds.overlaps_grad_reduce(on) == applies and not ds.overlaps_grad_reduce(off)
        t_on, t_off = (estimate(x, m, cl, framework="deepspeed").step_time_s for x in (on, off))
        assert (t_on < t_off) if applies else t_on == t_off
        inner = list(framework_inner(ds, c.dp, c.pp, 1, 1, "1f1b", 1, False, c.dp * 4))
        tried = {x.overlap_grad_reduce for x in inner if x.zero_stage == c.zero_stage}
        assert tried == ({False, True} if applies else {None})
    meg = framework("megatron")
    assert meg.overlaps_grad_reduce(ParallelConfig(dp=4, pp=2, tp=1, micro_batch_size=1, num_micro_batches=4,
                                                   overlap_grad_reduce=True))


def test_deepspeed_gradient_passes_cover_the_embedding_and_output_layer():
    """The embedding's and the output layer's weights take the same gradient passes as a block's
    (``chunk_time.edge_gradient_s``): per micro-batch, autograd's read-read-write over their 16-bit
    gradients and, under the BF16 optimizer, its 8 bytes per parameter; a tied output layer on
    the last stage has its own copy. The BF16 optimizer zeroes the gradients instead of freeing
    them, so autograd's pass runs even at one micro-batch."""
    from autoconf.cost.chunk_time import chunk_compute
    from autoconf.cost.layout import layout
    from autoconf.cost.system import System
    m = preset("gpt2")  # tied embeddings, learned positions
    cl = _a100_node(1)
    s = System(m, cl, framework="deepspeed")
    rf = s.roofline("a100-80gb")
    bw = rf.memory_bandwidth_bytes_per_s * rf.memory_efficiency
    mp = s.policy.model_at(1)
    c = ParallelConfig(dp=1, pp=2, tp=1, micro_batch_size=1, num_micro_batches=1)  # gpt2 trains in bf16
    assert s.policy.bf16_optimizer(c) and s.policy.accumulates(c)
    lay = layout(s, c)
    first, last = chunk_compute(s, c, lay, 0), chunk_compute(s, c, lay, 1)
    blk = block_for(s, "a100-80gb", c)
    emb, head = s.edge("a100-80gb", 1, 1, "embedding"), s.edge("a100-80gb", 1, 1, "head")
    per_param = (6 + 8) / bw
    assert first[1] - lay.chunk_layers[0] * blk.backward_s - emb.backward_s == pytest.approx(
        mp.embedding_params() * per_param + 2 * rf.kernel_launch_s, rel=1e-6)
    assert last[1] - lay.chunk_layers[1] * blk.backward_s - head.backward_s == pytest.approx(
        (mp.output_params() + mp.vocab_size * mp.hidden_size) * per_param + 2 * rf.kernel_launch_s, rel=1e-6)
    # tp 2: the vocabulary's rows are split, the position table and the final norm are not; at
    # pp 1 (ZeRO-0, 4 micro-batches: autograd's pass only) the tied output layer is the
    # embedding's matrix, so the head adds its norm only
    c2 = ParallelConfig(dp=1, pp=1, tp=2, micro_batch_size=1, num_micro_batches=4)
    m2 = s.policy.model_at(2)
    assert not s.policy.bf16_optimizer(c2) and s.policy.accumulates(c2)
    lay2 = layout(s, c2)
    only = chunk_compute(s, c2, lay2, 0)[1] - lay2.chunk_layers[0] * block_for(s, "a100-80gb", c2).backward_s \
        - s.edge("a100-80gb", 1, 2, "embedding").backward_s - s.edge("a100-80gb", 1, 2, "head").backward_s
    vocab, pos = m2.vocab_size * m2.hidden_size, m2.seq_length * m2.hidden_size
    assert only == pytest.approx(6 * (vocab / 2 + pos) / bw + rf.kernel_launch_s
                                 + 6 * m2.norm_params() / bw + rf.kernel_launch_s, rel=1e-6)
    # Megatron-LM: fused accumulation, no BF16 optimizer: nothing added
    meg = System(m, cl, framework="megatron")
    lay_m = layout(meg, c)
    assert edge_gradient_s(meg, "a100-80gb", c, "embedding") == edge_gradient_s(meg, "a100-80gb", c, "head") == 0.0
    assert chunk_compute(meg, c, lay_m, 0)[1] == pytest.approx(
        lay_m.chunk_layers[0] * block_for(meg, "a100-80gb", c).backward_s
        + meg.edge("a100-80gb", 1, 1, "embedding").backward_s, rel=1e-9)


def test_param_gather_after_the_step_copies_only_where_the_trainer_flattens():
    """After a ZeRO-1 step: Megatron-LM and DeepSpeed all-gather into the flat buffer the parameters
    view (the collective alone); the reference trainer flattens each shard and copies it back:
    (4 - 2/n) x the stage's parameter bytes of memory traffic on top."""
    from autoconf.cost.data_parallel import post_all_gather_s
    from autoconf.cost.groups import axis_links, collective_s
    from autoconf.cost.layout import layout
    from autoconf.cost.system import System
    m = preset("llama-3-8b")
    cl = _a100_node(1)
    c = ParallelConfig(dp=8, pp=1, tp=1, micro_batch_size=1, num_micro_batches=4, zero_stage=1,
                       overlap_param_gather=False)
    for fw, copies in (("megatron", 0.0), ("deepspeed", 0.0), ("reference", 4 - 2 / 8)):
        s = System(m, cl, framework=fw)
        lay = layout(s, c)
        nbytes = sum(lay.chunk_params) * m.dtype_bytes
        rf = s.roofline("a100-80gb")
        expect = (collective_s(s, axis_links(s, c, "dp"), comm.all_gather_s, 8, nbytes)
                  + (copies * nbytes / (rf.memory_bandwidth_bytes_per_s * rf.memory_efficiency) if copies else 0.0))
        assert post_all_gather_s(s, c, lay) == pytest.approx(expect, rel=1e-3), fw


def test_gpu_pipeline_receives_wait_for_the_op_before_them():
    """NCCL's point-to-point kernels wait for the compute already issued on the stream: a receive
    issued after the op before it starts when that op ends (every framework's 1F1B on GPUs, and
    gloo on CPUs); Megatron-LM's interleaved schedule posts its receives one step early
    (overlap_p2p_comm) and overlaps them. Posted transfers cost more step time, never less."""
    from autoconf.cost.estimate import estimate
    from autoconf.cost.schedule_time import posted_receives
    from autoconf.cost.system import System
    m = preset("llama-3-8b")
    cl = _a100_node(4)
    c1 = ParallelConfig(dp=1, pp=4, tp=8, micro_batch_size=1, num_micro_batches=16, recompute="full")
    ci = dataclasses.replace(c1, schedule="interleaved", virtual_stages=2)
    for fw in ("megatron", "deepspeed", "torchtitan", "reference"):
        assert posted_receives(System(m, cl, framework=fw), c1)
    meg = System(m, cl, framework="megatron")
    assert not posted_receives(meg, ci) and posted_receives(System(m, cl, framework="torchtitan"), ci)
    import autoconf.cost.estimate as est
    posted = estimate(c1, m, cl, framework="megatron").step_time_s
    saved = est.posted_receives
    try:
        est.posted_receives = lambda system, c: False
        early = estimate(c1, m, cl, framework="megatron").step_time_s
    finally:
        est.posted_receives = saved
    assert posted > early


def test_the_global_gradient_norm_is_a_pass_over_the_gradients_each_framework_holds():
    """The step's norm (and torchtitan's clip, which always multiplies): Megatron-LM reads its
    fp32 main gradients, the distributed optimizer's shard only; torchtitan's clip_grad_norm_
    reads and then scales its FSDP shard (3 passes); DeepSpeed's BF16 optimizer reads the whole
    stage's bf16 gradients; the reference trainer does not clip."""
    from autoconf.cost.chunk_time import optimizer_step_s
    from autoconf.cost.layout import layout
    from autoconf.cost.system import System
    m = preset("llama-3-8b")
    cl = _a100_node(1)
    for fw, kw, traffic, full_stage in (
            ("megatron", dict(dp=8, pp=1, zero_stage=1), 4.0, False),
            ("megatron", dict(dp=8, pp=1, zero_stage=0), 4.0, True),
            ("torchtitan", dict(dp=8, pp=1, zero_stage=3), 3 * 2.0, False),
            ("deepspeed", dict(dp=4, pp=2, zero_stage=0), 2.0, True),
            ("reference", dict(dp=8, pp=1, zero_stage=1), 0.0, False)):
        s = System(m, cl, framework=fw)
        c = ParallelConfig(tp=1, micro_batch_size=1, num_micro_batches=4, **kw)
        lay = layout(s, c)
        dev_params = [sum(lay.chunk_params[ci] for ci in lay.chunks_of(c, d)) for d in range(c.pp)]
        sharded = s.policy.state_zero_stage(c) >= 1
        expect = max(s.optimizer_time("a100-80gb", p / (c.dp if sharded else 1))
                     + (s.copy_time(["a100-80gb"], traffic * (p if full_stage else p / (c.dp if sharded else 1)))
                        if traffic else 0.0) for p in dev_params)
        assert optimizer_step_s(s, c, lay) == pytest.approx(expect, rel=1e-9), (fw, kw)
        assert s.framework.grad_norm_traffic * s.policy.grad_bytes == traffic, fw
