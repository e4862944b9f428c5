"""autoconf/cost/data_parallel.py: gradient reductions, ZeRO's gathers, bucket copies.

Expected times are the alpha-beta closed forms, written out here: ring all-reduce
2(n-1)/n x S / B + 2(n-1) alpha (Patarasuk & Yuan 2009), NCCL's double binary tree 2 S / B +
2 (ceil(log2 H) + k - 1) alpha, ring all-gather / reduce-scatter (n-1)/n x S / B + (n-1) alpha
(ZeRO's volumes, Rajbhandari et al., arXiv 1910.02054 sec. 7), each plus the collective library's
fixed cost per call, at the bus efficiency the device catalog gives per link tier; link figures
come from the cluster file, bucket copies stream through memory at the catalog's bandwidth.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from autoconf.cost import comm
from autoconf.cost.data_parallel import (
    bucket_traffic,
    dp_reduction_s,
    gather_bytes,
    per_micro_batch_s,
    post_all_gather_s,
    reduce_calls,
    reduces_in_backward,
    reduction_tail_s,
)
from autoconf.cost.groups import reduction_collective
from autoconf.cost.layout import layout
from autoconf.cost.memory import BUCKET_BYTES
from autoconf.cost.schedule_time import run_schedule
from autoconf.cost.system import System
from autoconf.space.config import ParallelConfig
from autoconf.specs.cluster import load_cluster
from autoconf.specs.devices import device_type
from autoconf.specs.model import ModelSpec

A100 = load_cluster("examples/clusters/a100-4x8.yaml")
DEV = device_type("a100-80gb")
TUNE = DEV.collective_tuning()
G = A100.node_groups[0]
MODEL = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, num_kv_heads=16, ffn_hidden_size=4096,
                  vocab_size=32000, seq_length=2048)
P = MODEL.num_params()


def cluster(nodes: int = 1, nics: int | None = None):
    g = dataclasses.replace(G, count=nodes, **({} if nics is None else {"nic_count": nics}))
    return dataclasses.replace(A100, node_groups=(g,))


def setup(framework=None, nodes=1, nics=None, **kw):
    system = System(MODEL, cluster(nodes, nics), framework=framework)
    c = ParallelConfig(**{"dp": 8, "pp": 1, "tp": 1, "micro_batch_size": 1, "num_micro_batches": 4, **kw})
    return system, c, layout(system, c)


def copy_s(nbytes: float) -> float:
    """Streaming through HBM at the catalog's bandwidth and efficiency."""
    return nbytes / (DEV.memory_bandwidth_bytes_per_s * DEV.memory_efficiency)


def intra(n: int) -> tuple[float, float]:
    """(bus bandwidth, per-step latency) of a ring of n GPUs inside one NVSwitch host."""
    return G.intra_node_bandwidth_bytes_per_s * TUNE.intra(n), A100.intra_node_latency_s


def ring_all_reduce(S, n, bw, lat):
    return TUNE.base_latency_s + 2 * (n - 1) / n * S / bw + 2 * (n - 1) * lat


def tree_all_reduce(S, n, hosts, k, bw, lat):
    return TUNE.base_latency_s + 2 * S / bw + 2 * (math.ceil(math.log2(hosts)) + k - 1) * lat


def ring_gather(S, n, bw, lat):
    return TUNE.base_latency_s + (n - 1) / n * S / bw + (n - 1) * lat


# --- the step's reduction -------------------------------------------------------------------------


def test_model_has_one_chunk_with_every_parameter():
    _, c, lay = setup()
    assert lay.chunk_params == (P,)


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_zero0_all_reduces_the_gradients_on_a_ring_inside_the_host(dp):
    system, c, lay = setup(dp=dp)
    S = 2 * P  # the reference trainer's bf16 gradients
    bw, lat = intra(dp)
    # inside one host NCCL's ring beats its tree (2(n-1)/n < 2, the same steps)
    want = (min(ring_all_reduce(S, dp, bw, lat), tree_all_reduce(S, dp, 1, dp, bw, lat))
            + copy_s(6 * S))  # DDP: copy in, average, copy out
    assert want == pytest.approx(ring_all_reduce(S, dp, bw, lat) + copy_s(6 * S))
    got = dp_reduction_s(system, c, lay, reduction_collective(0), 0, lay.stage_kinds[0])
    assert got == pytest.approx(want, rel=1e-9)


def test_zero1_reduce_scatters_half_the_all_reduce_s_volume():
    system, c, lay = setup(zero_stage=1)
    S = 2 * P
    bw, lat = intra(8)
    assert reduction_collective(1) is comm.reduce_scatter_s
    got = dp_reduction_s(system, c, lay, reduction_collective(1), 0, lay.stage_kinds[0])
    assert got == pytest.approx(ring_gather(S, 8, bw, lat) + copy_s(6 * S), rel=1e-9)
    # the bandwidth part is half of ZeRO-0's
    ar = dp_reduction_s(system, c, lay, reduction_collective(0), 0, lay.stage_kinds[0])
    assert (ar - copy_s(6 * S) - TUNE.base_latency_s - 14 * lat) == pytest.approx(
        2 * (got - copy_s(6 * S) - TUNE.base_latency_s - 7 * lat), rel=1e-9)


@pytest.mark.parametrize("nics", [1, 8])
def test_all_reduce_across_two_hosts_runs_at_the_rails_bandwidth(nics):
    """dp 16 on two hosts of 8: a ring crosses the hosts on min(8 rails, the host's NICs) flows."""
    system, c, lay = setup(nodes=2, nics=nics, dp=16)
    S = 2 * P
    nic = G.nic_bandwidth_bytes_per_s
    ring_bw = min(G.intra_node_bandwidth_bytes_per_s * TUNE.intra(8), min(8, nics) * nic * TUNE.inter_efficiency)
    lat = A100.inter_node_latency_s
    want = min(ring_all_reduce(S, 16, ring_bw, lat), tree_all_reduce(S, 16, 2, 8, ring_bw, lat)) + copy_s(6 * S)
    got = dp_reduction_s(system, c, lay, reduction_collective(0), 0, lay.stage_kinds[0])
    assert got == pytest.approx(want, rel=1e-9)


def test_megatron_reduces_its_fp32_main_grads():
    system, c, lay = setup("megatron")
    S = 4 * P  # fp32 main_grad in bf16 training
    bw, lat = intra(8)
    got = dp_reduction_s(system, c, lay, reduction_collective(0), 0, lay.stage_kinds[0])
    assert got == pytest.approx(ring_all_reduce(S, 8, bw, lat) + copy_s(6 * S), rel=1e-9)


@pytest.mark.parametrize("zero,dp,want", [(0, 8, 6.0), (1, 8, 6.0), (2, 8, 2 + 3 / 8), (3, 8, 2 + 2 / 8),
                                          (2, 2, 3.5), (3, 4, 2.5)])
def test_bucket_traffic(zero, dp, want):
    assert bucket_traffic(ParallelConfig(dp=dp, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1,
                                         zero_stage=zero)) == pytest.approx(want)


def test_reduce_calls_are_one_per_layer_under_fsdp_and_25_mib_buckets_under_zero2():
    c3 = ParallelConfig(dp=8, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1, zero_stage=3)
    c2 = dataclasses.replace(c3, zero_stage=2)
    assert reduce_calls(c3, 1e9, 12) == 12
    assert reduce_calls(c2, 1e9, 12) == math.ceil(1e9 / (25 * 2**20)) == 39
    assert reduce_calls(c2, BUCKET_BYTES, 12) == 1
    assert reduce_calls(c2, BUCKET_BYTES + 1, 12) == 2


# --- what ZeRO adds per micro-batch -----------------------------------------------------------------


@pytest.mark.parametrize("zero", [0, 1])
def test_zero0_and_1_add_nothing_per_micro_batch(zero):
    system, c, lay = setup(zero_stage=zero)
    assert per_micro_batch_s(system, c, lay, 0, 1e-3, 2e-3) == (0.0, 0.0)


def test_megatron_fsdp_gathers_every_layer_in_each_pass_without_prefetch():
    """Megatron FSDP (ZeRO-3, pp 1) with its defaults (no overlap): each micro-batch gathers every
    layer's parameters in the forward, again in the backward, and reduce-scatters every layer's
    gradients in each backward but the last micro-batch's (that one is the step's reduction)."""
    system, c, lay = setup("megatron", zero_stage=3, num_micro_batches=4)
    nl, n, m = MODEL.num_layers, 8, 4
    bw, lat = intra(n)
    ag_l = ring_gather(P / nl * 2, n, bw, lat)  # bf16 parameters
    grads = P * 4  # fp32 main_grad
    rs = nl * ring_gather(grads / nl, n, bw, lat) + copy_s((2 + 2 / n) * grads)
    fwd, bwd = per_micro_batch_s(system, c, lay, 0, 1e-3, 2e-3)
    assert fwd == pytest.approx(nl * ag_l, rel=1e-9)
    assert bwd == pytest.approx(nl * ag_l + rs * (m - 1) / m, rel=1e-9)


def test_prefetched_gathers_hide_behind_enough_compute():
    """The reference trainer prefetches (overlap_param_gather) and overlaps the reduce-scatter:
    with a long layer only the first layer's gather of each pass is exposed."""
    system, c, lay = setup(zero_stage=3)
    nl, n = MODEL.num_layers, 8
    bw, lat = intra(n)
    ag_l = ring_gather(P / nl * 2, n, bw, lat)
    fwd, bwd = per_micro_batch_s(system, c, lay, 0, 10.0, 20.0)  # seconds of compute: all hidden
    assert fwd == pytest.approx(ag_l, rel=1e-9)
    assert bwd == pytest.approx(ag_l, rel=1e-9)
    # with no compute every gather and reduce-scatter is exposed
    f0, b0 = per_micro_batch_s(system, c, lay, 0, 0.0, 0.0)
    assert f0 == pytest.approx(ag_l + nl * ag_l, rel=1e-9)
    assert b0 > nl * ag_l


def test_fp8_weights_are_gathered_at_one_byte_where_the_framework_does():
    sys_tt, c, _ = setup("torchtitan", zero_stage=3, precision="fp8", fp8_recipe="tensorwise")
    assert gather_bytes(sys_tt, c) == 1.0
    assert gather_bytes(sys_tt, dataclasses.replace(c, fp8_recipe="rowwise")) == 2.0
    sys_ref, _, _ = setup()
    assert gather_bytes(sys_ref, c) == 2.0


# --- after the step ---------------------------------------------------------------------------------


@pytest.mark.parametrize("zero", [0, 3])
def test_no_post_step_gather_outside_zero1_and_2(zero):
    system, c, lay = setup(zero_stage=zero)
    assert post_all_gather_s(system, c, lay) == 0.0


def test_zero1_gathers_the_updated_shards_after_the_step():
    S, n = 2 * P, 8
    bw, lat = intra(n)
    system, c, lay = setup("megatron", zero_stage=1)
    assert post_all_gather_s(system, c, lay) == pytest.approx(ring_gather(S, n, bw, lat), rel=1e-9)
    # the reference trainer flattens each shard, sends it and copies it back: 4 - 2/n copies;
    # prefetched (its default) under the next forward layer by layer, one layer's share waits
    system, c, lay = setup(zero_stage=1)
    assert lay.overlap_param_gather
    full = ring_gather(S, n, bw, lat) + copy_s((4 - 2 / n) * S)
    assert post_all_gather_s(system, c, lay) == pytest.approx(full / MODEL.num_layers, rel=1e-9)
    system, c, lay = setup(zero_stage=1, overlap_param_gather=False)
    assert post_all_gather_s(system, c, lay) == pytest.approx(full, rel=1e-9)
    # Megatron's distributed optimizer with --overlap-param-gather: the same layer-by-layer share
    system, c, lay = setup("megatron", zero_stage=1, overlap_param_gather=True)
    assert post_all_gather_s(system, c, lay) == pytest.approx(ring_gather(S, n, bw, lat) / MODEL.num_layers,
                                                              rel=1e-9)


def test_without_overlap_the_whole_reduction_follows_the_pipeline():
    system, c, lay = setup("megatron")
    assert not lay.overlap_grad_reduce
    fwd, bwd = (1e-3,), (2e-3,)
    sim = run_schedule(lay.schedule, 1, c.num_micro_batches, 1, fwd, bwd, ())
    t = dp_reduction_s(system, c, lay, reduction_collective(0), 0, lay.stage_kinds[0])
    assert reduction_tail_s(system, c, lay, sim, sim.makespan_s, bwd) == pytest.approx(t, rel=1e-12)


def test_overlapped_reduction_hides_all_but_the_last_layer_s_bucket_behind_the_backward():
    system, c, lay = setup()
    assert lay.overlap_grad_reduce
    n, nl = 8, MODEL.num_layers
    bw, lat = intra(n)
    t = dp_reduction_s(system, c, lay, reduction_collective(0), 0, lay.stage_kinds[0])
    last_bucket = ring_all_reduce(min(BUCKET_BYTES, MODEL.layer_params() * 2), n, bw, lat)
    for b in (1e-4, 5e-3, 1.0):  # short, middling and long last backward
        sim = run_schedule(lay.schedule, 1, c.num_micro_batches, 1, (b / 2,), (b,), ())
        # the buckets go once the last backward is 1/nl in; the last can only go at its end
        want = max(t - b * (1 - 1 / nl), last_bucket)
        assert reduction_tail_s(system, c, lay, sim, sim.makespan_s, (b,)) == pytest.approx(want, rel=1e-9)


def test_pipelined_fsdp_gathers_as_often_as_the_schedule_finds_a_chunk_resharded():
    """The reference trainer's FSDP2 under torch.distributed.pipelining (Policy.fsdp_per_pass):
    with no compute to hide them, a pass's gathers are all exposed (the first layer's twice: it is
    not prefetched), and a chunk gathers per ``space.schedules.fsdp_gathers``: GPipe every forward
    and one backward sweep, layered GPipe once each way, 1F1B's first stage twice forward and
    three times backward (m = 4, pp = 2); every reduce-scatter waits for the last backward."""
    m = 4
    per_pass = {}
    for name, kw in (("gpipe", {"schedule": "gpipe"}), ("layered", {"schedule": "gpipe", "layered_grad_accum": True}),
                     ("1f1b", {"schedule": "1f1b"})):
        system, c, lay = setup(nodes=2, zero_stage=3, pp=2, num_micro_batches=m, **kw)
        assert system.policy.fsdp_per_pass(3, 2, 8) and not reduces_in_backward(system, c, lay)
        nl = lay.chunk_layers[0]
        bw, lat = intra(8)
        ag_l = ring_gather(lay.chunk_params[0] / nl * 2, 8, bw, lat)
        one = ag_l + nl * ag_l  # one pass over the chunk's layers, nothing hidden
        per_pass[name] = per_micro_batch_s(system, c, lay, 0, 0.0, 0.0), one
    (f, b), one = per_pass["gpipe"]
    assert f == pytest.approx(m * one / m, rel=1e-9) and b == pytest.approx(one / m, rel=1e-9)
    (f, b), one = per_pass["layered"]
    assert f == pytest.approx(one / m, rel=1e-9) and b == pytest.approx(one / m, rel=1e-9)
    (f, b), one = per_pass["1f1b"]
    assert f == pytest.approx(2 * one / m, rel=1e-9) and b == pytest.approx(3 * one / m, rel=1e-9)
