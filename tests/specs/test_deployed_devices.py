"""Devices as deployed: a cluster file's power cap, clock and HBM bandwidth (specs.devices)."""

import dataclasses

import pytest

from autoconf import ParallelConfig, estimate
from autoconf.errors import UserError
from autoconf.specs.cluster import ClusterSpec, cluster_from_mapping
from autoconf.specs.devices import capped_clock_ratio, deployed_name, device_names, device_type
from autoconf.specs.model import preset

GROUP = {"count": 1, "device": "h100-sxm", "gpus_per_node": 8, "intra_node_bandwidth": "450 GB/s"}


def test_power_cap_follows_the_cubic_law_above_idle():
    dev = device_type("h100-sxm")
    # ((500 - 70) / (700 - 70)) ** (1/3), by hand
    assert capped_clock_ratio(dev, 500.0) == pytest.approx(0.8805, abs=1e-4)
    assert capped_clock_ratio(dev, 700.0) == 1.0 and capped_clock_ratio(dev, 900.0) == 1.0
    capped = device_type(deployed_name("h100-sxm", power_cap_w=500.0))
    assert capped.peak("bf16") == pytest.approx(989e12 * 0.8805, rel=1e-4)
    assert capped.peak("fp8") == pytest.approx(2 * capped.peak("bf16"), rel=1e-2)
    assert capped.memory_bandwidth_bytes_per_s == dev.memory_bandwidth_bytes_per_s


def test_clock_and_hbm_overrides_and_the_lower_of_clock_and_cap():
    dev = device_type(deployed_name("a100-80gb", clock_hz=1.0e9, memory_bandwidth_bytes_per_s=1.5e12))
    assert dev.peak("bf16") == pytest.approx(312e12 * 1.0 / 1.41)
    assert dev.memory_bandwidth_bytes_per_s == 1.5e12
    both = device_type(deployed_name("h100-sxm", power_cap_w=300.0, clock_hz=1.8e9))
    assert both.peak("bf16") == pytest.approx(989e12 * ((300 - 70) / 630) ** (1 / 3))


def test_cluster_file_states_a_deployed_device_and_round_trips():
    c = cluster_from_mapping({"node_groups": [{**GROUP, "power_cap": "500 W", "memory_bandwidth": "2.4 TB/s",
                                               "memory": "95 GiB"}]})
    name = c.node_groups[0].device
    assert name == "h100-sxm@power=500W,hbm=2.4e+12B/s"
    assert ClusterSpec.from_dict(c.to_dict()).node_groups[0].device == name
    assert device_type(name).deployed == {"power_cap_w": 500.0, "memory_bandwidth_bytes_per_s": 2.4e12}


@pytest.mark.parametrize("extra, words", [
    ({"power_cap": "50 W"}, "idle draw (70 W)"),
    ({"device": "cpu", "power_cap": "100 W"}, "no stated TDP"),
    ({"clock": "1500"}, "has no unit"),
    ({"power_cap": "500 GB"}, "not a watts quantity"),
])
def test_bad_deployment_is_one_line_naming_the_value(extra, words):
    with pytest.raises(UserError) as e:
        cluster_from_mapping({"node_groups": [{**GROUP, **extra}]})
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_capped_device_prices_slower_by_about_the_clock():
    model = dataclasses.replace(preset("llama-3-8b"), seq_length=4096)
    cfg = ParallelConfig(dp=8, pp=1, tp=1, micro_batch_size=1, num_micro_batches=4, zero_stage=1)
    full = estimate(cfg, model, cluster_from_mapping({"node_groups": [GROUP]}))
    capped = estimate(cfg, model, cluster_from_mapping({"node_groups": [{**GROUP, "power_cap": "500 W"}]}))
    ratio = capped.breakdown_s["compute"] / full.breakdown_s["compute"]
    # GEMMs slow by 1/0.88; memory-bound kernels do not (HBM unchanged): in between
    assert 1.05 < ratio <= 1 / 0.8805 + 1e-9


def test_new_catalog_devices_have_datasheet_figures():
    for name in ("gh200", "mi300x", "mi325x", "v100-16gb", "l40s"):
        assert name in device_names()
    assert device_type("mi300x").peak("bf16") == pytest.approx(1307.4e12)
    assert device_type("mi325x").memory_bytes == 256e9
    assert device_type("v100-16gb").memory_bytes == 16 * 2**30
    assert device_type("gh200").memory_bandwidth_bytes_per_s == 4.0e12
