"""Profile files and the measured lookups the cost model uses (pure: no torch)."""

import dataclasses
import json
import os

import pytest

from autoconf.cost import measured
from autoconf.errors import UserError
from autoconf.specs import measured_graph
from autoconf.specs.cluster import ClusterSpec, NodeGroup
from autoconf.specs.model import preset
from autoconf.specs.profile import (
    PROFILE_VERSION,
    ActivationEntry,
    CollectiveEntry,
    GemmEntry,
    HostInfo,
    LayerTiming,
    LinkEntry,
    MemoryOverhead,
    ParameterEntry,
    PipelineOverheadTiming,
    Profile,
    Provenance,
    RankInfo,
    busbw_factor,
    catalog_kind,
    check_profile_matches,
    fit_alpha_beta,
    load_profile,
    save_profile,
)

TINY = preset("tiny")


def _timing(layer, mbs, tp, rc, f, b):
    return LayerTiming(layer=layer, micro_batch_size=mbs, tp=tp, recompute=rc, forward_s=f, backward_s=b,
                       forward_spread_s=0.0, backward_spread_s=0.0, repeats=3, device_kind="cpu", rank=0)


def _link(src, dst, bw, lat=1e-4):
    sizes = (4, 1 << 20)
    return LinkEntry(src=src, dst=dst, latency_s=lat, bandwidth_bytes_per_s=bw, sizes_bytes=sizes,
                     times_s=tuple(2 * lat + s / bw for s in sizes))


def make_profile(model=TINY, hosts=("a",), per_host=2, **over) -> Profile:
    ranks = tuple(RankInfo(rank=h * per_host + i, host=name, local_rank=i, device_name="cpu", device_kind="cpu",
                           memory_bytes=4e9) for h, name in enumerate(hosts) for i in range(per_host))
    n = len(ranks)
    prov = Provenance(hosts=tuple(HostInfo(name=h, interfaces=({"name": "eth0", "speed_bytes_per_s": 1.25e9},))
                                  for h in hosts),
                      device_names=("cpu",), torch_version="2.13.0", backend="gloo", date="2026-01-01T00:00:00+00:00",
                      command="python -m profiler --model tiny", world_size=n, notes=("test",))
    compute = (
        _timing("block", 1, 1, "none", 1.0e-3, 2.0e-3),
        _timing("block", 4, 1, "none", 2.5e-3, 5.0e-3),  # affine: 0.5 ms + 0.5 ms per sequence
        _timing("block", 1, 1, "full", 1.0e-3, 3.0e-3),
        _timing("embedding", 2, 1, "none", 1e-4, 2e-4),
        _timing("head", 2, 1, "none", 4e-4, 8e-4),
    )
    gemm = (GemmEntry(m=32, n=64, k=64, dtype="fp32", time_s=1e-6, flop_per_s=1e9, fraction_of_peak=0.2, device_kind="cpu"),
            GemmEntry(m=128, n=256, k=64, dtype="fp32", time_s=1e-6, flop_per_s=1e9, fraction_of_peak=0.6,
                      device_kind="cpu"))
    acts = (ActivationEntry(layer="block", micro_batch_size=2, tp=1, sequence_parallel=False, recompute="none",
                            bytes=1000.0),
            ActivationEntry(layer="head", micro_batch_size=1, tp=1, sequence_parallel=False, recompute="none",
                            bytes=300.0))
    params = (ParameterEntry(layer="block", tp=1, bytes=4.0 * TINY.layer_params(), count=TINY.layer_params()),)
    links = tuple(_link(a, b, 4e9 if ranks[a].host == ranks[b].host else 1e9) for a in range(n) for b in range(n)
                  if a != b)
    colls = (CollectiveEntry(op="all_reduce", ranks=tuple(range(n)), bytes=1 << 20, time_s=1e-3,
                             algbw_bytes_per_s=(1 << 20) / 1e-3,
                             busbw_bytes_per_s=(1 << 20) / 1e-3 * busbw_factor("all_reduce", n)),)
    p = Profile(version=PROFILE_VERSION, provenance=prov, model=model, ranks=ranks, compute_dtype=model.dtype,
                compute=compute, gemm=gemm, activations=acts, parameters=params,
                overhead=MemoryOverhead(framework_overhead_bytes=1.5e8, method="test"), links=links, collectives=colls)
    return dataclasses.replace(p, **over)


# -- files ---------------------------------------------------------------------------------------------

def test_round_trip(tmp_path):
    p = make_profile()
    path = tmp_path / "p.json"
    save_profile(p, str(path))
    assert load_profile(str(path)) == p
    assert json.loads(path.read_text())["version"] == PROFILE_VERSION
    assert os.listdir(tmp_path) == ["p.json"]


def test_atomic_write_keeps_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    save_profile(make_profile(), str(path))
    before = path.read_text()

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        save_profile(make_profile(compute=()), str(path))
    assert path.read_text() == before
    assert os.listdir(tmp_path) == ["p.json"]


def test_failed_serialisation_writes_nothing(tmp_path):
    bad = make_profile(overhead=MemoryOverhead(framework_overhead_bytes=1.0, method="x", step_peak_bytes={"k": object()}))
    with pytest.raises(TypeError):
        save_profile(bad, str(tmp_path / "p.json"))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("content, needle", [
    (None, "does not exist"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not an autoconf profile"),
    (json.dumps({"version": PROFILE_VERSION + 1}), f"version {PROFILE_VERSION + 1}"),
    (json.dumps({"version": PROFILE_VERSION, "model": {}}), "malformed"),
])
def test_load_errors_are_one_line(tmp_path, content, needle):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError) as e:
        load_profile(str(path))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_check_profile_matches():
    p = make_profile()
    assert check_profile_matches(p, TINY) == []
    deeper = dataclasses.replace(TINY, num_layers=12, name="tiny12")
    warnings = check_profile_matches(p, deeper)
    assert any("12" in w for w in warnings)
    wider = dataclasses.replace(TINY, hidden_size=128, name="wide")
    with pytest.raises(UserError, match="hidden_size: 64 -> 128"):
        check_profile_matches(p, wider)
    assert any("link" in w for w in check_profile_matches(p, wider, need_compute=False))
    with pytest.raises(UserError, match="seq_length"):
        check_profile_matches(p, dataclasses.replace(TINY, seq_length=64))


# -- fits and names ------------------------------------------------------------------------------------

def test_fit_alpha_beta_recovers_parameters():
    sizes = [4, 64, 1024, 1 << 14, 1 << 18, 1 << 22]
    a, b = fit_alpha_beta(sizes, [2e-5 + s / 5e9 for s in sizes])
    assert a == pytest.approx(2e-5, rel=1e-6) and b == pytest.approx(5e9, rel=1e-6)
    a, b = fit_alpha_beta([1 << 20], [1e-3])
    assert a == 0.0 and b == pytest.approx((1 << 20) / 1e-3)


def test_fit_alpha_beta_takes_bandwidth_from_large_messages():
    # a 25 MB/s shaped link whose token bucket lets small messages through at line rate
    sizes = [4, 64, 1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24]
    times = [1e-4 + (s / 1e9 if s <= 1 << 14 else s / 25e6) for s in sizes]
    a, b = fit_alpha_beta(sizes, times)
    assert b == pytest.approx(25e6, rel=1e-6)
    assert 0.0 <= a <= 1e-4


@pytest.mark.parametrize("name, mem, kind", [
    ("cpu", 0, "cpu"), ("NVIDIA H100 80GB HBM3", 80e9, "h100-sxm"), ("NVIDIA H100 PCIe", 80e9, "h100-pcie"),
    ("NVIDIA H200", 141e9, "h200"), ("NVIDIA A100-SXM4-40GB", 40e9, "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", 80 * 2**30, "a100-80gb"), ("Tesla V100-SXM2-32GB", 32e9, "v100-32gb"),
    ("NVIDIA L40S", 48e9, "l40s"), ("Some New GPU", 1e9, None),
])
def test_catalog_kind(name, mem, kind):
    assert catalog_kind(name, mem) == kind


# -- measured layer times ---------------------------------------------------------------------------------

def test_block_times_exact_interpolated_extrapolated():
    p = make_profile()
    assert measured.block_times(p, TINY, 1, 1, "none") == (1.0e-3, 2.0e-3)
    f, b = measured.block_times(p, TINY, 2, 1, "none")
    assert f == pytest.approx(1.5e-3) and b == pytest.approx(3.0e-3)
    f, b = measured.block_times(p, TINY, 8, 1, "none")
    assert f == pytest.approx(4.5e-3) and b == pytest.approx(9.0e-3)


def test_block_times_single_point_is_proportional():
    p = make_profile()
    f, b = measured.block_times(p, TINY, 3, 1, "full")
    assert f == pytest.approx(3e-3) and b == pytest.approx(9e-3)


def test_block_times_derives_missing_recompute():
    p = make_profile()
    f, b = measured.block_times(p, TINY, 4, 1, "selective")
    share = 4.0 * TINY.seq_length * TINY.hidden_size / TINY.layer_forward_flops_per_token()
    assert f == pytest.approx(2.5e-3) and b == pytest.approx(5.0e-3 + share * 2.5e-3)


def test_block_times_other_tp_scales_by_flops_and_efficiency():
    p = make_profile()
    f1, _ = measured.block_times(p, TINY, 1, 1, "none")
    f2, _ = measured.block_times(p, TINY, 1, 2, "none")
    e1 = measured.gemm_efficiency(p, 32, TINY.ffn_hidden_size, 64)
    e2 = measured.gemm_efficiency(p, 32, TINY.ffn_hidden_size // 2, 64)
    assert e2 < e1  # a narrower shard runs less efficiently
    assert f2 == pytest.approx(f1 / 2 * e1 / e2)


def test_layer_times_need_matching_shapes():
    p = make_profile()
    assert measured.block_times(p, dataclasses.replace(TINY, num_layers=40, name="x"), 1, 1) == (1.0e-3, 2.0e-3)
    assert measured.block_times(p, dataclasses.replace(TINY, seq_length=64), 1, 1) is None
    assert measured.block_times(p, dataclasses.replace(TINY, ffn_hidden_size=128), 1, 1) is None
    # the vocabulary changes the embedding and head, not the block
    other_vocab = dataclasses.replace(TINY, vocab_size=1024)
    assert measured.block_times(p, other_vocab, 1, 1) is not None
    assert measured.head_times(p, other_vocab, 2, 1) is None
    assert measured.block_times(make_profile(compute=()), TINY, 1, 1) is None


def test_embedding_and_head_times():
    p = make_profile()
    assert measured.embedding_times(p, TINY, 2, 1) == (1e-4, 2e-4)
    assert measured.embedding_times(p, TINY, 2, 2) == (1e-4, 2e-4)  # a lookup: tp does not change it
    f, b = measured.head_times(p, TINY, 4, 1)
    assert f == pytest.approx(8e-4) and b == pytest.approx(1.6e-3)
    assert measured.head_times(p, TINY, 2, 1, device_kind="h100-sxm") is None


def test_gemm_efficiency_interpolates_in_log_flops():
    p = make_profile()
    assert measured.gemm_efficiency(p, 32, 64, 64) == 0.2
    assert measured.gemm_efficiency(p, 4, 4, 4) == 0.2  # clamped below
    assert measured.gemm_efficiency(p, 4096, 4096, 4096) == 0.6  # clamped above
    mid = measured.gemm_efficiency(p, 64, 128, 64)  # FLOPs 4x the small, 1/4 the large: halfway in log
    assert mid == pytest.approx(0.4)
    assert measured.gemm_efficiency(p, 64, 128, 64, dtype="bf16") is None
    assert measured.gemm_efficiency(make_profile(gemm=()), 64, 128, 64) is None


def test_gemm_efficiency_keeps_unaligned_gemms_apart():
    """A GEMM with a dimension that is not a multiple of 16 bytes (an unpadded vocabulary) runs at a
    fraction of an aligned one's rate: it neither drags aligned GEMMs down nor borrows their rate."""
    from autoconf.cost.roofline import aligned_gemm

    assert aligned_gemm(2048, 50264, 2048, 2) and not aligned_gemm(2048, 50257, 2048, 2)
    assert aligned_gemm(4, 8, 12, 4) and not aligned_gemm(4, 8, 10, 4)  # fp32: 4 elements
    assert aligned_gemm(2048, 50257 / 3, 2048, 2)  # an average, not a shape
    def gpu(p):  # the same table, measured on an H100
        return dataclasses.replace(p, gemm=tuple(dataclasses.replace(e, device_kind="h100-sxm") for e in p.gemm))

    slow = GemmEntry(m=2048, n=50257, k=64, dtype="fp32", time_s=1e-6, flop_per_s=1e9, fraction_of_peak=0.05,
                     device_kind="cpu")
    base = make_profile()
    p = gpu(dataclasses.replace(base, gemm=base.gemm + (slow,)))
    kw = {"device_kind": "h100-sxm"}
    assert measured.gemm_efficiency(p, 64, 128, 64, **kw) == pytest.approx(0.4)  # as without the slow row
    assert measured.gemm_efficiency(p, 4096, 4096, 4096, **kw) == 0.6
    assert measured.gemm_efficiency(p, 64, 127, 64, **kw) == 0.05  # unaligned: only the unaligned row
    # only aligned GEMMs measured: their rate at the catalog's unaligned factor
    factor = measured.device_type("h100-sxm").unaligned_gemm_factor
    assert measured.gemm_efficiency(gpu(base), 64, 127, 64, **kw) == pytest.approx(0.4 * factor, rel=0.05)
    # a CPU has no such penalty: one table for every shape
    cpu = dataclasses.replace(base, gemm=base.gemm + (slow,))
    assert measured.gemm_efficiency(cpu, 64, 127, 64) == pytest.approx(
        measured.gemm_efficiency(cpu, 64, 128, 64), rel=0.05)


def test_catalog_gemm_rate_falls_for_unaligned_dimensions():
    """The roofline of a GPU charges an unaligned GEMM the catalog's measured factor; a CPU none."""
    from autoconf.cost.roofline import Roofline
    from autoconf.specs.devices import device_type

    h100 = Roofline.of(device_type("h100-sxm"), "bf16")
    fast, slow = h100.gemm(8192, 50264, 2048, 2), h100.gemm(8192, 50257, 2048, 2)
    assert slow / fast == pytest.approx(1 / device_type("h100-sxm").unaligned_gemm_factor, rel=0.02)
    cpu = Roofline.of(device_type("cpu"), "fp32")
    assert cpu.gemm(64, 127, 64, 4) == pytest.approx(cpu.gemm(64, 128, 64, 4), rel=0.02)


def test_activation_bytes():
    p = make_profile()
    assert measured.activation_bytes(p, TINY, 2, 1, False, "none") == 1000.0
    assert measured.activation_bytes(p, TINY, 6, 1, False, "none") == pytest.approx(3000.0)
    # other tp / sp / recompute: scaled by the ratio of the analytic formula (CPU: masks at dtype size)
    from autoconf.cost.activations import head_activation_bytes, layer_activation_bytes

    def formula(tp, sp, rc):
        return layer_activation_bytes(TINY, 2, tp, sp, rc, TINY.dtype_bytes)["total"]

    base = formula(1, False, "none")
    for tp, sp, rc in ((2, False, "none"), (2, True, "none"), (1, False, "full"), (4, True, "selective")):
        got = measured.activation_bytes(p, TINY, 2, tp, sp, rc)
        assert got == pytest.approx(1000.0 * formula(tp, sp, rc) / base)
        assert got < 1000.0
    head = measured.activation_bytes(p, TINY, 4, 2, False, "none", layer="head")
    ratio = head_activation_bytes(TINY, 4, 2, False, 4) / head_activation_bytes(TINY, 1, 1, False, 4)
    assert head == pytest.approx(300.0 * ratio)
    assert measured.activation_bytes(p, dataclasses.replace(TINY, hidden_size=128), 2, 1, False, "none") is None


# -- links ---------------------------------------------------------------------------------------------------

def test_topology_graph_has_cluster_schema():
    from autoconf.specs.topology import Topology

    p = make_profile(hosts=("a", "b"), per_host=2)
    g = measured_graph.topology_graph(p)
    ref = ClusterSpec(name="ref", node_groups=(NodeGroup(count=2, device="cpu", gpus_per_node=2,
                                                          intra_node_bandwidth_bytes_per_s=4e9),)).graph()
    for attr in ("intra_node_latency_s", "inter_node_latency_s"):
        assert attr in g.graph
    assert sorted(n for n in g.nodes if isinstance(n, int)) == [0, 1, 2, 3]
    for node in (0, ("host", 0)):
        assert set(ref.nodes[node]) <= set(g.nodes[node])
    assert g.nodes[2]["node"] == 1 and g.nodes[2]["device"] == "cpu" and g.nodes[2]["memory_bytes"] == 4e9
    e = g.edges[0, 1]
    assert e["kind"] == "measured" and e["bandwidth_bytes_per_s"] == 4e9 and e["latency_s"] == 1e-4
    assert g.edges[0, 2]["bandwidth_bytes_per_s"] == 1e9
    assert g.nodes[("host", 0)]["nic_bandwidth_bytes_per_s"] == 1e9
    assert g.edges[0, ("host", 0)]["kind"] == "nic"
    topo = Topology(g)  # the cost model's reader accepts it
    assert topo.p2p(0, 1) == (4e9, 1e-4)


def test_topology_graph_takes_the_slower_direction():
    p = make_profile()
    links = (_link(0, 1, 4e9, 1e-4), _link(1, 0, 1e9, 3e-4))
    g = measured_graph.topology_graph(dataclasses.replace(p, links=links))
    e = g.edges[0, 1]
    assert e["bandwidth_bytes_per_s"] == 1e9 and e["latency_s"] == 3e-4
    assert e["bandwidth_by_direction_bytes_per_s"] == {(0, 1): 4e9, (1, 0): 1e9}
    assert g.graph["intra_node_latency_s"] == 3e-4


def test_collective_efficiency():
    p = make_profile()
    eff = measured.collective_efficiency(p, "all_reduce", 2)
    assert eff == pytest.approx((1 << 20) / 1e-3 / 4e9)
    assert measured.collective_efficiency(p, "all_gather", 2) is None
    assert measured.collective_efficiency(p, "all_reduce", 4) is None
    with pytest.raises(UserError):
        measured.collective_efficiency(p, "broadcast", 2)


# -- in-place tensor-parallel communication and optimizer timing (lead's additions) -------------------

def _with(profile, **kw):
    import dataclasses
    return dataclasses.replace(profile, **kw)


def test_tp_comm_is_in_place_minus_local_width_and_reaches_the_estimate():
    import dataclasses

    from autoconf.cost.estimate import estimate
    from autoconf.cost.measured import optimizer_seconds_per_param, tp_comm_times
    from autoconf.space.config import ParallelConfig
    from autoconf.specs.profile import OptimizerTiming, TpBlockTiming

    prof = _tp_profile()
    model = prof.model
    base = [(e.micro_batch_size, e.forward_s, e.backward_s) for e in prof.compute
            if e.layer == "block" and e.tp == 2 and e.recompute == "none"]
    assert base, "fixture must hold local-width tp=2 block timings"
    extra_f, extra_b = 0.003, 0.005
    rows = tuple(TpBlockTiming(micro_batch_size=m, tp=2, sequence_parallel=False, forward_s=f + extra_f,
                               backward_s=b + extra_b, repeats=3, device_kind="cpu") for m, f, b in base)
    p2 = _with(prof, tp_blocks=rows, optimizer=(OptimizerTiming(tp=1, num_params=1000, time_s=1e-3, repeats=3,
                                                                device_kind="cpu"),))
    got = tp_comm_times(p2, model, base[0][0], 2, False)
    assert got == pytest.approx((extra_f, extra_b), rel=1e-6)
    assert tp_comm_times(p2, model, 1, 4, False) is None  # not measured in place: the links decide
    # measured on a 1-core host, the two ranks computed at half speed: that is not communication
    one_core = _with(p2, provenance=dataclasses.replace(p2.provenance, hosts=tuple(
        dataclasses.replace(h, cpu_count=1) for h in p2.provenance.hosts)))
    half = [(m, f + extra_f + f, b + extra_b + b) for m, f, b in base]
    one_core = _with(one_core, tp_blocks=tuple(TpBlockTiming(micro_batch_size=m, tp=2, sequence_parallel=False,
                     forward_s=f, backward_s=b, repeats=3, device_kind="cpu") for m, f, b in half))
    assert tp_comm_times(one_core, model, base[0][0], 2, False) == pytest.approx((extra_f, extra_b), rel=1e-6)
    assert optimizer_seconds_per_param(p2) == pytest.approx(1e-6)
    c = ParallelConfig(dp=1, pp=1, tp=2, micro_batch_size=base[0][0], num_micro_batches=2)
    with_comm = estimate(c, model, None, p2)
    assert with_comm.breakdown_s["tp_comm"] == pytest.approx(2 * model.num_layers * (extra_f + extra_b)
                                                               + 2 * extra_f, rel=0.05)
    assert with_comm.breakdown_s["optimizer"] == pytest.approx(model.num_params() / 2 * 1e-6, rel=0.05)
    assert dataclasses.asdict(p2) == dataclasses.asdict(type(p2).from_dict(p2.to_dict()))


def _tp_profile():
    base = make_profile()
    extra = (_timing("block", 1, 2, "none", 0.6e-3, 1.2e-3), _timing("block", 4, 2, "none", 1.5e-3, 3.0e-3))
    return dataclasses.replace(base, compute=base.compute + extra)


def test_oversubscribed_cpu_host_computes_at_its_share():
    """4 single-threaded ranks on a 2-core host: each computes at half speed (time-sharing)."""
    from autoconf.cost.system import System
    from autoconf.space.config import ParallelConfig

    prof = make_profile()
    two_cores = dataclasses.replace(prof, provenance=dataclasses.replace(
        prof.provenance, hosts=tuple(dataclasses.replace(h, cpu_count=2) for h in prof.provenance.hosts)))
    cl = ClusterSpec(name="cpu", node_groups=(NodeGroup(count=1, device="cpu", gpus_per_node=4,
                                                                 intra_node_bandwidth_bytes_per_s=4e9),))
    base = System(TINY, cl, prof)  # no core count recorded: no sharing assumed
    shared = System(TINY, cl, two_cores)
    own = System(TINY, dataclasses.replace(cl, node_groups=(dataclasses.replace(cl.node_groups[0], gpus_per_node=2),)),
                      two_cores)
    assert (base.cpu_share("cpu"), shared.cpu_share("cpu"), own.cpu_share("cpu")) == (1.0, 2.0, 1.0)
    assert shared.cpu_share("h100-sxm") == 1.0
    t1, t2 = own.block("cpu", 1, 1, False, "none"), shared.block("cpu", 1, 1, False, "none")
    assert t2.forward_s == pytest.approx(2 * t1.forward_s) and t2.backward_s == pytest.approx(2 * t1.backward_s)
    from autoconf.cost.estimate import estimate
    a = estimate(ParallelConfig(dp=2, pp=1, tp=1, micro_batch_size=1, num_micro_batches=4), TINY, ctx=own)
    # all four ranks compute at once (data parallel, in lockstep): each at half a core
    b = estimate(ParallelConfig(dp=4, pp=1, tp=1, micro_batch_size=1, num_micro_batches=4), TINY,
                 ctx=System(TINY, cl, two_cores))
    assert b.breakdown_s["compute"] == pytest.approx(2 * a.breakdown_s["compute"])
    assert b.breakdown_s["optimizer"] == pytest.approx(2 * a.breakdown_s["optimizer"])
    # two of the four ranks: they have the two cores to themselves
    half = estimate(ParallelConfig(dp=2, pp=1, tp=1, micro_batch_size=1, num_micro_batches=4), TINY,
                    ctx=System(TINY, cl, two_cores))
    assert half.breakdown_s["compute"] == pytest.approx(a.breakdown_s["compute"])


def test_pipeline_stages_that_take_turns_on_one_core_share_it_by_turns():
    """Processor sharing (``pipeline.Sharing``): two pipeline ranks on a one-core host. A stage
    waiting on the other leaves it the core, so the pipeline takes what one rank doing all the
    work at a full core takes (the core is never idle), not the fill and drain at half a core
    each that a fixed share charges."""
    from autoconf.cost.estimate import estimate
    from autoconf.cost.system import System
    from autoconf.space.config import ParallelConfig

    prof = make_profile()
    one_core = dataclasses.replace(prof, provenance=dataclasses.replace(
        prof.provenance, hosts=tuple(dataclasses.replace(h, cpu_count=1) for h in prof.provenance.hosts)))
    cl = ClusterSpec(name="cpu", node_groups=(NodeGroup(count=1, device="cpu", gpus_per_node=2,
                                                        intra_node_bandwidth_bytes_per_s=1e15),))
    ctx = System(TINY, cl, one_core)
    assert ctx.cpu_share("cpu") == 2.0
    for sched in ("gpipe", "1f1b"):
        two = estimate(ParallelConfig(dp=1, pp=2, tp=1, micro_batch_size=1, num_micro_batches=8, schedule=sched),
                       TINY, ctx=ctx)
        one = estimate(ParallelConfig(dp=1, pp=1, tp=1, micro_batch_size=1, num_micro_batches=8),
                       TINY, ctx=ctx)  # one rank: the core to itself
        pipe = two.step_time_s - two.breakdown_s["optimizer"] - two.breakdown_s["dp_comm"]
        alone = one.breakdown_s["compute"] + one.breakdown_s["recompute"]
        assert pipe == pytest.approx(alone, rel=0.01), sched
        # (a fixed half core would charge the fill and drain on top: (m + 1) / m of the work)


def test_pipeline_runtime_per_action_reaches_the_estimate(tmp_path):
    from autoconf.cost.estimate import estimate
    from autoconf.space.config import ParallelConfig

    def entry(sched, v, per_action):
        return PipelineOverheadTiming(schedule=sched, pp=2, virtual_stages=v, num_micro_batches=8,
                                      step_s=per_action * 16 * v, per_action_s=per_action, repeats=3)

    base = make_profile()
    prof = dataclasses.replace(base, pipeline_overhead=(entry("1f1b", 1, 1e-3), entry("interleaved", 2, 2e-3)))
    assert measured.pipeline_action_overhead(prof, "interleaved") == 2e-3
    assert measured.pipeline_action_overhead(prof, "gpipe") == pytest.approx(1.5e-3)  # not measured: the median
    assert measured.pipeline_action_overhead(base, "1f1b") is None
    save_profile(prof, str(tmp_path / "p.json"))  # round trip keeps it
    assert load_profile(str(tmp_path / "p.json")).pipeline_overhead == prof.pipeline_overhead

    c = ParallelConfig(dp=1, pp=2, tp=1, micro_batch_size=1, num_micro_batches=4)
    a, b = estimate(c, TINY, profile=base), estimate(c, TINY, profile=prof)
    # every one of the 2 x 4 actions of the busiest device pays 1 ms, on top of what it did
    assert b.breakdown_s["pp_comm"] - a.breakdown_s["pp_comm"] == pytest.approx(8e-3)
    assert b.step_time_s - a.step_time_s >= 8e-3 - 1e-9
    single = ParallelConfig(dp=2, pp=1, tp=1, micro_batch_size=1, num_micro_batches=4)
    assert estimate(single, TINY, profile=prof).step_time_s == estimate(single, TINY, profile=base).step_time_s


def test_the_memory_curve_interpolates_in_log_log_and_prices_elementwise_kernels():
    """``measured.memory_time``: a measured size returns its time; between two it is linear in
    log(bytes) and log(seconds); above the largest it grows with the bytes (the stream's rate),
    below the smallest it stays at the smallest's. ``Roofline.elementwise`` with it: each of the
    kernels moves an equal share at the measured time of that share."""
    import dataclasses
    import math

    from autoconf.cost.measured import memory_time
    from autoconf.cost.roofline import Roofline
    from autoconf.specs.devices import device_type
    from autoconf.specs.profile import MemoryEntry
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "profiles", "bench-h256-cpu2.json")
    prof = dataclasses.replace(load_profile(example), memory=(
        MemoryEntry(bytes=1e5, time_s=2e-6, dtype="fp32", device_kind="cpu"),
        MemoryEntry(bytes=1e7, time_s=8e-5, dtype="fp32", device_kind="cpu")))
    mt = memory_time(prof, "cpu", "fp32")
    assert mt(1e5) == pytest.approx(2e-6) and mt(1e7) == pytest.approx(8e-5)
    assert mt(1e6) == pytest.approx(math.sqrt(2e-6 * 8e-5))  # the log-log midpoint
    assert mt(1e3) == pytest.approx(2e-6) and mt(4e7) == pytest.approx(4 * 8e-5)
    assert memory_time(prof, "cpu", "bf16") is None and memory_time(prof, "h100-sxm", "fp32") is None
    # a profile from before the curve keeps its dictionary (and so its digest: study names)
    assert "memory" not in load_profile(example).to_dict() and "memory" in prof.to_dict()
    rf = Roofline.of(device_type("cpu"), "fp32", memory_time=mt)
    assert rf.elementwise(4e6, kernels=4) == pytest.approx(4 * mt(1e6))
    plain = Roofline.of(device_type("cpu"), "fp32")
    assert plain.elementwise(4e6, kernels=4) == pytest.approx(
        4e6 / (plain.memory_bandwidth_bytes_per_s * plain.memory_efficiency) + 4 * plain.kernel_launch_s)
