"""FSDP2 / ZeRO-3 as torchtitan runs it: per-layer gathers and reduce-scatters sharing the links,
the reduction in fp32, and under pipelining one gather and one reduction per step (the unsharded
stage held through it). Closed forms from the bytes each rank moves."""

from __future__ import annotations

import dataclasses

import pytest

from autoconf import ParallelConfig, estimate
from autoconf.cost.system import System
from autoconf.specs.cluster import cluster_from_mapping
from autoconf.specs.devices import device_type
from autoconf.specs.model import preset

MODEL = dataclasses.replace(preset("llama-3-8b"), seq_length=1024)


def _cluster(nic: str):
    """Two hosts of 8 H100s joined by one slow NIC each: the gathers are bound by it."""
    return cluster_from_mapping({"node_groups": [{
        "count": 2, "device": "h100-sxm", "gpus_per_node": 8, "intra_node_bandwidth": "450 GB/s",
        "nics": {"count": 1, "bandwidth": nic}}]})


def _one_host(intra: str):
    """One host of 16 GPUs on a slow fabric: every group inside it, bound by the fabric."""
    return cluster_from_mapping({"node_groups": [{
        "count": 1, "device": "h100-sxm", "gpus_per_node": 16, "intra_node_bandwidth": intra}]})


def _cfg(**kw):
    base = dict(dp=16, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1, zero_stage=3)
    return ParallelConfig(**{**base, **kw})


def test_torchtitan_reduces_in_fp32_the_others_in_the_gradients_dtype():
    tt = System(MODEL, _cluster("100 Gbit/s"), framework="torchtitan")
    ref = System(MODEL, _cluster("100 Gbit/s"), framework="reference")
    assert tt.policy.reduce_bytes(_cfg()) == 4 and tt.policy.reduce_bytes(_cfg(zero_stage=0)) == tt.policy.grad_bytes == 2
    assert ref.policy.reduce_bytes(_cfg()) == 2


def test_comm_bound_zero3_moves_gather_gather_reduce_each_micro_batch():
    """Over a very slow link the step is the links' time: per micro-batch a bf16 gather in the
    forward, another in the backward (resharded after forward) and the reduce-scatter, 2 + 2 + 4
    bytes per parameter under torchtitan against 2 + 2 + 2 where the gradients' dtype is reduced;
    twice the micro-batches, twice the traffic."""
    cl = _cluster("2 Gbit/s")
    tt = [estimate(_cfg(num_micro_batches=m), MODEL, cl, framework="torchtitan") for m in (1, 2)]
    ref = estimate(_cfg(), MODEL, cl, framework="reference")

    def comm(e):
        return e.step_time_s - e.breakdown_s["compute"]

    assert comm(tt[0]) / comm(ref) == pytest.approx(8 / 6, rel=0.05)
    assert comm(tt[1]) / comm(tt[0]) == pytest.approx(2.0, rel=0.05)
    # and in seconds: 8 bytes per parameter, (n-1)/n of them over one 2 Gbit/s NIC per host
    # (a ring crossing the two hosts, each host's eight members taking turns on its NIC) at the
    # share of the NIC the collective library reaches
    nic = 2e9 / 8 * device_type("h100-sxm").collective_tuning().inter_efficiency
    assert comm(tt[0]) == pytest.approx(8 * MODEL.num_params() * 15 / 16 / nic, rel=0.05)


def test_under_pipelining_torchtitan_gathers_and_reduces_once_per_step():
    """torch.distributed.pipelining keeps the stage unsharded across micro-batches: the step's
    data-parallel traffic does not grow with the micro-batches, and the stage holds its
    parameters (bf16) and accumulated gradients (fp32) unsharded."""
    cl = _one_host("2 GB/s")
    per = [estimate(_cfg(dp=8, pp=2, num_micro_batches=m), MODEL, cl, framework="torchtitan") for m in (4, 8)]
    dp = [e.breakdown_s["dp_comm"] for e in per]
    assert dp[1] == pytest.approx(dp[0], rel=0.05)
    ref = estimate(_cfg(dp=8, pp=2, num_micro_batches=8), MODEL, cl, framework="reference")
    assert ref.step_time_s > 1.5 * per[1].step_time_s  # the reference re-gathers every micro-batch
    for mem in per[0].memory_by_stage:
        other = dict(mem.other_parts)
        params = other["fsdp unsharded parameters"] / 2
        assert other["fsdp unsharded gradients"] == pytest.approx(4 * params)
        assert "zero-3 gathered layers" not in other
    assert sum(dict(m.other_parts)["fsdp unsharded parameters"] for m in per[0].memory_by_stage) == pytest.approx(
        2 * MODEL.num_params(), rel=0.01)


def test_fsdp_reduces_each_layer_in_one_call_zero2_in_25_mib_buckets():
    """FSDP2 reduce-scatters a unit's (a layer's) gradients in one call (torch 2.13
    ``_fsdp_collectives.foreach_reduce``); ZeRO-2 in DDP's 25 MiB buckets: a 70B model's 80 layers
    are 80 calls per backward, not the ~11,000 buckets whose per-call latency would dominate."""
    from autoconf.cost.data_parallel import reduce_calls
    grads = 70e9 * 4
    assert reduce_calls(_cfg(), grads, 80) == 80
    assert reduce_calls(_cfg(zero_stage=2), grads, 80) == -(-grads // (25 * 2**20))
