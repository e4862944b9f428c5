"""TF32 as a precision: an fp32 model's GEMMs on TF32 tensor cores (PyTorch's allow_tf32), every
byte still fp32; refused where the model is not fp32 or the device has no TF32 units."""

from __future__ import annotations

import dataclasses

import pytest

from autoconf import ParallelConfig, estimate
from autoconf.cost.system import System
from autoconf.errors import UserError
from autoconf.specs.cluster import cluster_from_mapping, load_cluster
from autoconf.specs.devices import device_type
from autoconf.specs.model import preset
from autoconf.study.choices import precision_choices

H100 = load_cluster("examples/clusters/h100-8x8.yaml")
FP32 = dataclasses.replace(preset("llama-3-8b"), seq_length=2048, dtype="fp32")


def _cfg(**kw):
    return ParallelConfig(**{**dict(dp=8, pp=1, tp=1, micro_batch_size=1, num_micro_batches=2), **kw})


def test_tf32_gemms_run_at_the_tf32_peak_with_fp32_bytes():
    ctx = System(FP32, H100)
    rf, rf32 = ctx.gemm_roofline("h100-sxm"), ctx.gemm_roofline("h100-sxm", tf32=True)
    assert rf32.peak_flop_per_s == device_type("h100-sxm").peak("tf32") == 494.5e12
    assert rf.peak_flop_per_s == 67e12 and rf32.memory_bandwidth_bytes_per_s == rf.memory_bandwidth_bytes_per_s
    m, n, k = 8192, 8192, 8192  # compute-bound: the time scales by the peaks' ratio
    assert rf.gemm(m, n, k, 4) / rf32.gemm(m, n, k, 4) == pytest.approx(494.5 / 67, rel=0.01)
    f32, t32 = (estimate(_cfg(precision=p), FP32, H100) for p in ("bf16", "tf32"))
    assert t32.config.short().endswith("tf32")
    assert 3 < f32.breakdown_s["compute"] / t32.breakdown_s["compute"] < 494.5 / 67
    assert t32.memory_by_stage[0].total == f32.memory_by_stage[0].total


def test_tf32_is_refused_off_fp32_models_and_tf32_devices():
    with pytest.raises(UserError, match="precision tf32 runs an fp32 model"):
        estimate(_cfg(precision="tf32"), preset("llama-3-8b"), H100)
    v100 = cluster_from_mapping({"node_groups": [{"count": 1, "device": "v100-32gb", "gpus_per_node": 8,
                                                  "intra_node_bandwidth": "150 GB/s"}]})
    with pytest.raises(UserError, match="device v100-32gb has no TF32 tensor cores"):
        estimate(_cfg(precision="tf32"), FP32, v100)


def test_search_tries_tf32_for_fp32_models_where_the_devices_have_it():
    assert precision_choices(System(FP32, H100), "auto") == (("bf16", "tensorwise"), ("tf32", "tensorwise"))
    assert ("tf32", "tensorwise") not in precision_choices(System(preset("llama-3-8b"), H100), "auto")
    assert precision_choices(System(FP32, H100), "tf32") == (("tf32", "tensorwise"),)
    with pytest.raises(UserError, match="--precision tf32 .* is bf16"):
        precision_choices(System(preset("llama-3-8b"), H100), "tf32")


def test_launch_files_turn_tf32_on_and_the_trainer_sets_allow_tf32(tmp_path):
    import torch

    from autoconf.launch.emit import emit
    from autoconf.trainer.run import set_matmul_precision
    est = estimate(_cfg(precision="tf32"), FP32, H100, framework="torchtitan")
    written = emit(est, FP32, H100, str(tmp_path))
    import os
    nodes = [open(p).read() for p in written if os.path.basename(p).startswith("node-")]
    assert nodes and all("export TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1" in t for t in nodes)
    was = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        set_matmul_precision(_cfg(precision="tf32"))
        assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was
