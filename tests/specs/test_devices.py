"""The device catalog (every device has what the cost model reads; FP8 and Blackwell figures) and
NVLink domains that span hosts (a GB200 NVL72 rack: 18 hosts of 4 GPUs on one NVLink fabric)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autoconf.cost.estimate import estimate
from autoconf.cost.roofline import Roofline
from autoconf.cost.system import System
from autoconf.errors import UserError
from autoconf.space.config import ParallelConfig
from autoconf.specs.cluster import ClusterSpec, cluster_from_mapping, load_cluster
from autoconf.specs.devices import device_names, device_type
from autoconf.specs.model import preset
from autoconf.specs.topology import Topology
from autoconf.study.placer import describe
from autoconf.timetotrain import synthetic

GB200 = "examples/clusters/gb200-nvl72.yaml"
GPT = preset("gpt3-1.3b")  # 16 heads: tensor parallelism up to 16


# -- the catalog ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", device_names())
def test_every_device_has_what_the_cost_model_reads(name):
    dev = device_type(name)
    for dtype in ("bf16", "fp16", "fp32"):
        assert dev.supports(dtype) and dev.peak(dtype) > 0
        Roofline.of(dev, dtype)
    assert dev.memory_bytes > 0 and dev.memory_bandwidth_bytes_per_s > 0
    assert 0 < dev.gemm_efficiency <= 1 and 0 < dev.memory_efficiency <= 1 and dev.kernel_launch_s > 0
    assert dev.framework_overhead_bytes >= 0 and isinstance(dev.sm_count, int)
    if dev.sm_count:  # a GPU: NCCL's figures and the fused attention's
        assert set(dev.collective) == {"base_latency_s", "intra_efficiency", "inter_efficiency", "short_ring_loss"}
        dev.collective_tuning()
        assert 0 < dev.attention_efficiency["forward"] <= 1 and 0 < dev.attention_efficiency["backward"] <= 1
    assert set(dev.peak_flop_per_s) <= {"bf16", "fp16", "fp32", "tf32", "fp8", "mxfp8", "fp4"}
    if "tf32" in dev.peak_flop_per_s:  # TF32 tensor cores: half the 16-bit rate, above fp32's
        assert dev.peak("tf32") == pytest.approx(dev.peak("bf16") / 2, rel=0.02)
        assert dev.peak("tf32") > dev.peak("fp32")


@pytest.mark.parametrize("name,exact", [("h100-sxm", False), ("h100-pcie", False), ("h200", False),
                                        ("b200", True), ("gb200", True)])
def test_fp8_is_twice_bf16_on_hopper_and_blackwell(name, exact):
    peak = device_type(name).peak_flop_per_s
    # Hopper's datasheets halve a sparse figure and round: 989 and 1,979 TFLOP/s (within 1 TFLOP/s)
    assert peak["fp8"] == pytest.approx(2 * peak["bf16"], abs=0 if exact else 1e12)
    if exact:  # Blackwell: MXFP8 at the FP8 rate, FP4 twice that
        assert peak["mxfp8"] == peak["fp8"] and peak["fp4"] == 2 * peak["fp8"]


def test_blackwell_and_h200_figures():
    b200, gb200, h200 = device_type("b200"), device_type("gb200"), device_type("h200")
    assert (b200.peak("bf16"), b200.peak("fp4"), b200.memory_bytes) == (2.25e15, 9e15, 180e9)
    assert (gb200.peak("bf16"), gb200.peak("fp4"), gb200.memory_bytes) == (2.5e15, 10e15, 186e9)
    assert b200.memory_bandwidth_bytes_per_s == gb200.memory_bandwidth_bytes_per_s == 8e12
    assert b200.sm_count == gb200.sm_count == 148
    assert h200.memory_bytes == 141e9  # the datasheet's 141 GB, not GiB


def test_a100_and_h100_datasheet_figures():
    """Dense tensor-core peaks, HBM bandwidth, 80 GiB of HBM and SMs (NVIDIA A100 and H100 SXM
    datasheets): 312 / 156 (TF32) / 19.5 TFLOP/s and 2,039 GB/s; 989 / 494.5 / 67 and 3.35 TB/s."""
    a100, h100 = device_type("a100-80gb"), device_type("h100-sxm")
    assert (a100.peak("bf16"), a100.peak("tf32"), a100.peak("fp32")) == (312e12, 156e12, 19.5e12)
    assert (a100.memory_bandwidth_bytes_per_s, a100.memory_bytes, a100.sm_count) == (2039e9, 80 * 2**30, 108)
    assert (h100.peak("bf16"), h100.peak("tf32"), h100.peak("fp32")) == (989e12, 494.5e12, 67e12)
    assert (h100.memory_bandwidth_bytes_per_s, h100.memory_bytes, h100.sm_count) == (3.35e12, 80 * 2**30, 132)


def test_supports_and_peak_agree():
    for name in device_names():
        dev = device_type(name)
        for dtype in ("bf16", "fp16", "fp32", "fp8", "mxfp8", "fp4", "int4"):
            if dev.supports(dtype):
                assert dev.peak(dtype) > 0
            else:
                with pytest.raises(UserError, match=f"device {name} has no {dtype} figure; valid: "):
                    dev.peak(dtype)
    assert device_type("h100-sxm").supports("fp8") and not device_type("h100-sxm").supports("mxfp8")
    assert device_type("gb200").supports("fp4") and device_type("l40s").supports("fp8")
    assert not device_type("a100-80gb").supports("fp8") and not device_type("v100-32gb").supports("fp8")
    v100 = device_type("v100-32gb")  # no bf16 units: PyTorch runs bf16 at fp32 speed
    assert v100.supports("bf16") and v100.peak("bf16") == v100.peak("fp32")
    assert device_type("cpu").supports("fp8")  # nominal: torch._scaled_mm on the CPU


# -- NVLink domains -----------------------------------------------------------------------------------

def _gb200(**group) -> ClusterSpec:
    """The example's GB200 racks with some group fields changed."""
    import yaml

    data = yaml.safe_load(open(GB200))
    data["node_groups"][0].update(group)
    return cluster_from_mapping(data)


def test_a_domain_spanning_hosts_talks_over_nvlink_and_domains_over_the_nics():
    c = load_cluster(GB200)
    assert (c.num_nodes, c.num_devices, c.node_groups[0].nvlink_domain) == (36, 144, 18)
    topo = Topology(c.graph())
    nvlink = (900e9, c.intra_node_latency_s)
    assert topo.p2p(0, 1) == nvlink                       # one tray
    assert topo.p2p(0, 4) == topo.p2p(3, 71) == nvlink    # two trays of one rack
    bw, lat = topo.p2p(71, 72)                            # the two racks
    assert (bw, lat) == (400e9 / 8, pytest.approx(c.inter_node_latency_s))
    assert topo.node_of[4] == 1 and topo.host_of[4] == 0 and topo.host_of[72] == 18
    # a ring over eight GPUs of two trays: one "host" for bandwidth, at NVLink speed
    g = topo.group_links(tuple(range(8)))
    assert (g.num_hosts, g.local_size, g.intra_bandwidth_bytes_per_s) == (1, 8, 900e9)
    across = topo.group_links((0, 72))
    assert across.num_hosts == 2 and across.inter_bandwidth_bytes_per_s == 50e9
    # the rack's 72 NICs are shared by what leaves it
    assert topo.nic_share(0, 72) == 50e9 and topo.nic_share(0, 144) == 25e9
    # the graph: one switch node per rack, every device of the rack on it
    graph = c.graph()
    assert graph.degree[("nvlink", 0)] == graph.degree[("nvlink", 18)] == 72
    assert graph.nodes[4]["node"] == 1 and graph.nodes[4]["domain"] == 0
    # the planner's fast path reads it as the graph does
    fast = synthetic._UniformTopology(c)
    for attr in ("host_of", "node_of", "host_name", "host_nic_bw", "host_nic_total", "host_intra_bw"):
        assert getattr(fast, attr) == getattr(topo, attr), attr


def test_without_a_domain_the_trays_talk_over_the_nics():
    topo = Topology(_gb200(nvlink_domain=1).graph())
    assert topo.p2p(0, 4)[0] == 50e9 and topo.group_links(tuple(range(8))).num_hosts == 2


def test_launch_files_and_stage_reports_see_the_real_hosts():
    c = load_cluster(GB200)
    assert c.host_names()[:2] == ["node-0", "node-1"] and len(c.host_names()) == 36
    cfg = ParallelConfig(dp=1, pp=2, tp=8, micro_batch_size=1, num_micro_batches=4)
    stages = describe(System(GPT, c), cfg)
    assert [s.hosts for s in stages] == [("node-0", "node-1"), ("node-2", "node-3")]


def test_the_domain_survives_to_dict_and_the_plan_file_form():
    c = load_cluster(GB200)
    d = c.to_dict()
    assert d["node_groups"][0]["nvlink_domain"] == 18
    assert ClusterSpec.from_dict(json.loads(json.dumps(d))) == c
    assert "nvlink_domain" not in _gb200(nvlink_domain=1).to_dict()["node_groups"][0]  # digests unchanged
    assert "    nvlink_domain: 18\n" in synthetic.cluster_yaml(c)


@pytest.mark.parametrize("value,match", [
    (5, r"nvlink_domain=5 does not divide count 36; give a positive integer that divides it"),
    (0, r"nvlink_domain=0 is out of range; expected an integer in \[1, "),
    (-18, r"nvlink_domain=-18 is out of range"),
    ("18", r"nvlink_domain"),
    (True, r"nvlink_domain"),
])
def test_a_bad_nvlink_domain_is_one_line_naming_the_value(value, match):
    with pytest.raises(UserError, match=match) as e:
        _gb200(nvlink_domain=value)
    assert "\n" not in str(e.value)


def test_cpu_groups_take_no_nvlink_domain():
    data = {"node_groups": [{"count": 2, "device": "cpu", "gpus_per_node": 2, "intra_node_bandwidth": "4 GB/s",
                             "nvlink_domain": 2}]}
    with pytest.raises(UserError, match=r"nvlink_domain=2 on device 'cpu': only GPUs"):
        cluster_from_mapping(data)


def test_a_group_across_two_trays_of_a_rack_is_priced_like_one_inside_a_tray():
    """An NVL72 rack prices like one 72-GPU host with the rack's NICs; without the domain the same
    tensor- or data-parallel group pays for the NICs."""
    racks = load_cluster(GB200)
    g = racks.node_groups[0]
    one_host_per_rack = dataclasses.replace(
        racks, node_groups=(dataclasses.replace(g, count=2, gpus_per_node=72, nic_count=72, nvlink_domain=1),))
    trays = _gb200(nvlink_domain=1)
    for cfg in (ParallelConfig(dp=2, pp=1, tp=8, micro_batch_size=1, num_micro_batches=4),   # TP over 2 trays
                ParallelConfig(dp=16, pp=1, tp=1, micro_batch_size=1, num_micro_batches=2),  # DP over 4 trays
                ParallelConfig(dp=9, pp=2, tp=8, micro_batch_size=1, num_micro_batches=8)):  # a stage per rack
        on_racks = estimate(cfg, GPT, racks)
        assert on_racks.fits
        assert on_racks.step_time_s == pytest.approx(estimate(cfg, GPT, one_host_per_rack).step_time_s, rel=1e-12)
        assert on_racks.step_time_s < estimate(cfg, GPT, trays).step_time_s
    # inside one tray and across two of a rack: the same links
    inside = Topology(racks.graph()).group_links((0, 1, 2, 3))
    across = Topology(racks.graph()).group_links((2, 3, 4, 5))
    assert (inside.intra_bandwidth_bytes_per_s, inside.intra_latency_s, inside.num_hosts) == \
        (across.intra_bandwidth_bytes_per_s, across.intra_latency_s, across.num_hosts)
