"""The cost model of context parallelism and FP8 against closed forms (no torch)."""

import dataclasses

import pytest

from autoconf.cost import comm
from autoconf.cost.activations import layer_activation_bytes
from autoconf.cost.attention import attention_core_times
from autoconf.cost.compute import block_times
from autoconf.cost.context_parallel import cp_times, kv_chunk_bytes, ring_step_s
from autoconf.cost.data_parallel import gather_bytes
from autoconf.cost.estimate import TIME_TERMS, estimate
from autoconf.cost.fp8 import QUANT_BYTES, fp8_gemm
from autoconf.cost.groups import axis_links, grad_group
from autoconf.cost.layout import linear_params_per_layer
from autoconf.cost.moe import block_for
from autoconf.cost.roofline import Roofline
from autoconf.cost.system import System
from autoconf.errors import UserError
from autoconf.space.config import ParallelConfig, check
from autoconf.space.enumeration import cp_choices
from autoconf.specs.cluster import load_cluster
from autoconf.specs.devices import device_type
from autoconf.specs.model import preset
from autoconf.study.choices import precision_choices
from autoconf.study.search import search

H100 = load_cluster("examples/clusters/h100-8x8.yaml")
A100 = load_cluster("examples/clusters/a100-4x8.yaml")
B200 = load_cluster("examples/clusters/b200-8x8.yaml")


def llama(seq=131072):
    return dataclasses.replace(preset("llama-3-8b"), seq_length=seq, attention="flash", dropout=0.0)


def cfg(**kw):
    base = dict(dp=1, pp=1, tp=1, micro_batch_size=1, num_micro_batches=4)
    base.update(kw)
    return ParallelConfig(**base)


# -- validity and groups ---------------------------------------------------------------------------

def test_cp_is_a_rank_axis_and_needs_the_balanced_split():
    m = llama(8192)
    c = cfg(dp=2, tp=2, cp=4)
    assert c.world_size == 16 and "cp4" in c.short()
    assert check(c, m) is None
    assert "2 x cp" in check(cfg(cp=3), dataclasses.replace(m, seq_length=8188))
    assert grad_group(c) == (8, ("cp", "dp"))
    assert cp_choices(m, 64) == (1, 2)  # 8K tokens: up to seq / 4096
    assert cp_choices(llama(), 64) == (1, 2, 4, 8, 16, 32)
    assert cp_choices(m, 64, max_cp=8) == (1, 2, 4, 8)


def test_frameworks_and_devices_refuse_what_they_cannot_run():
    m = llama(8192)
    with pytest.raises(UserError, match="deepspeed has no context parallelism"):
        estimate(cfg(cp=2), m, H100, framework="deepspeed")
    with pytest.raises(UserError, match="a100-80gb has no FP8"):
        estimate(cfg(precision="fp8"), m, A100)
    with pytest.raises(UserError, match="h100-sxm has no MXFP8"):
        estimate(cfg(precision="fp8", fp8_recipe="mxfp8"), m, H100, framework="megatron")
    with pytest.raises(UserError, match="megatron has no FP8 recipe rowwise"):
        estimate(cfg(precision="fp8", fp8_recipe="rowwise"), m, H100, framework="megatron")
    assert estimate(cfg(precision="fp8", fp8_recipe="mxfp8"), m, B200, framework="megatron").step_time_s > 0
    # the search's precision axis: FP8 only where every device and the framework run it
    assert precision_choices(System(m, A100)) == (("bf16", "tensorwise"),)
    assert precision_choices(System(m, H100, framework="megatron")) == (("bf16", "tensorwise"), ("fp8", "tensorwise"))
    with pytest.raises(UserError, match="--precision fp8.*a100-80gb has no FP8"):
        precision_choices(System(m, A100), "fp8")


# -- context parallelism: FLOPs, bytes, exchange ----------------------------------------------------

def _compute_only_roofline():
    """A roofline whose time is FLOPs at 1 PFLOP/s (no memory bound, no launches)."""
    return Roofline(1e15, 1e30, 1.0, 1.0, 0.0, attention_efficiency=(1.0, 1.0))


@pytest.mark.parametrize("cp", [1, 2, 8])
def test_cp_attention_flops_are_the_causal_share(cp):
    m, b, tp = llama(32768), 2, 2
    f, bwd = attention_core_times(m, b, tp, _compute_only_roofline(), cp)
    # causal attention: 4 b (a/tp) s^2 d / 2 FLOPs forward, split evenly by the balanced split;
    # each of the cp - 1 extra chunks merges its partial output (memory only: free here)
    flops = 4 * b * (m.num_attention_heads / tp) * m.seq_length ** 2 * m.head_size / 2 / cp
    assert f == pytest.approx(flops / 1e15)
    assert bwd == pytest.approx(2.5 * flops / 1e15)


def test_cp_bytes_and_ring_exchange_closed_forms():
    m = llama()
    c = cfg(dp=8, tp=1, cp=8, num_micro_batches=1)
    sys_ = System(m, H100, framework="megatron")
    # K and V of the rank's s/cp tokens at kv width, bf16
    assert kv_chunk_bytes(sys_, c) == 1 * (m.seq_length / 8) * 2 * m.kv_size * 2
    [g] = {g for g in axis_links(sys_, c, "cp")}  # cp groups inside one host (tp-cp-dp-pp)
    assert g.num_hosts == 1 and g.size == 8
    tune = sys_.collective_tuning
    bw, lat = comm._ring_link(g, tune)
    step = ring_step_s(sys_, c, kv_chunk_bytes(sys_, c))
    assert step == pytest.approx(tune.base_latency_s + lat + kv_chunk_bytes(sys_, c) / bw)
    att_f, att_b = attention_core_times(m, 1, 1, sys_.roofline("h100-sxm"), 8)
    t = cp_times(sys_, c, [["h100-sxm"]])
    assert t.forward_per_layer_s == pytest.approx(7 * max(0.0, step - att_f / 8))
    step_b = ring_step_s(sys_, c, 2 * kv_chunk_bytes(sys_, c))
    home = ring_step_s(sys_, c, kv_chunk_bytes(sys_, c))  # the gradients' last hop home
    assert t.backward_per_layer_s == pytest.approx(7 * max(0.0, step_b - att_b / 8) + home)
    # at 128K tokens each step's attention outlasts its transfer on NVLink: only the last hop shows
    assert t.forward_per_layer_s == 0.0 and t.backward_per_layer_s == pytest.approx(home)
    # across hosts (cp outermost of 64 ranks over 8 hosts) a short sequence exposes the exchange
    short = llama(16384)
    c2 = cfg(tp=8, cp=8, rank_order="tp-dp-pp-cp", num_micro_batches=1)
    s2 = System(short, H100, framework="megatron")
    assert {g.num_hosts for g in axis_links(s2, c2, "cp")} == {8}
    assert cp_times(s2, c2, [["h100-sxm"]]).forward_per_layer_s > 0


def test_all_gather_variant_is_torchtitans():
    m = llama(65536)
    c = cfg(dp=2, cp=4, num_micro_batches=1)
    s = System(m, H100, framework="torchtitan")
    t = cp_times(s, c, [["h100-sxm"]])
    links = axis_links(s, c, "cp")
    from autoconf.cost.groups import collective_s
    ag = collective_s(s, links, comm.all_gather_s, 4, kv_chunk_bytes(s, c) * 4)
    att_f, _ = attention_core_times(m, 1, 1, s.roofline("h100-sxm"), 4)
    assert t.forward_per_layer_s == pytest.approx(max(0.0, ag - att_f / 4))
    assert t.transfer_s == pytest.approx(ag)


def test_cp_splits_every_layers_tokens():
    m = llama(32768)
    rf = Roofline.of(device_type("h100-sxm"), "bf16")
    full = block_times(m, 1, 1, False, "none", rf)
    half = block_times(m, 1, 1, False, "none", rf, cp=2)
    att1 = attention_core_times(m, 1, 1, rf, 1)[0]
    att2 = attention_core_times(m, 1, 1, rf, 2)[0]
    # the rest of the block works on half the tokens: a bit more than half the time (launches)
    rest1, rest2 = full.forward_s - att1, half.forward_s - att2
    assert 0.5 < rest2 / rest1 < 0.52


# -- memory ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_memory_at_128k_with_cp8_is_the_formula_over_8(recompute):
    m = llama()
    one = layer_activation_bytes(m, 1, 2, True, recompute)
    eight = layer_activation_bytes(m, 1, 2, True, recompute, cp=8)
    assert eight["total"] == pytest.approx(one["total"] / 8)
    assert eight["recompute_working_bytes"] == pytest.approx(one["recompute_working_bytes"] / 8)


def test_128k_fits_only_with_context_parallelism():
    m = llama()
    base = dict(dp=1, tp=8, pp=1, micro_batch_size=1, num_micro_batches=8, sequence_parallel=True,
                recompute="full", zero_stage=0)
    e1 = estimate(ParallelConfig(**base), m, H100, framework="megatron")
    e8 = estimate(ParallelConfig(**{**base, "dp": 1, "cp": 8, "zero_stage": 1}), m, H100, framework="megatron")
    a1, a8 = e1.memory_by_stage[0].activations, e8.memory_by_stage[0].activations
    assert a8 == pytest.approx(a1 / 8, rel=1e-6)
    assert e8.fits
    assert dict(e8.memory_by_stage[0].other_parts)["context-parallel exchange"] == pytest.approx(
        4 * kv_chunk_bytes(System(m, H100, framework="megatron"), ParallelConfig(**{**base, "cp": 8})))


def test_fp8_memory_terms():
    m = llama(8192)
    base = cfg(tp=2, sequence_parallel=True)
    fp8 = dataclasses.replace(base, precision="fp8")
    # Megatron (Transformer Engine): FP8 weight and transpose cached (2 bytes per linear weight),
    # the linear layers' inputs saved in FP8
    b_mem, f_mem = (estimate(c, m, H100, framework="megatron").memory_by_stage[0] for c in (base, fp8))
    copies = dict(f_mem.other_parts)["fp8 weight copies"]
    assert copies == pytest.approx(m.num_layers * linear_params_per_layer(m) / 2 * 2.0)
    e, s, h, f, t = 2, m.seq_length, m.hidden_size, m.ffn_hidden_size, 2
    # (e - 1) bytes less per element of the qkv, projection, MLP and down-projection inputs
    saved = (e - 1) * (s * h / t + s * m.q_size / t + s * h / t + s * f / t)
    sys_ = System(m, H100, framework="megatron")
    per_layer = (sys_.layer_activations(base, 1)["total"] - sys_.layer_activations(fp8, 1)["total"])
    assert per_layer == pytest.approx(saved)
    assert f_mem.activations < b_mem.activations
    # torchtitan (torchao): nothing kept in FP8, no weight copies; FSDP gathers FP8 weights
    tb, tf = (estimate(dataclasses.replace(c, dp=2, zero_stage=3), m, H100, framework="torchtitan")
              for c in (base, fp8))
    assert tb.memory_by_stage[0].activations == tf.memory_by_stage[0].activations
    assert "fp8 weight copies" not in dict(tf.memory_by_stage[0].other_parts)
    st = System(m, H100, framework="torchtitan")
    assert gather_bytes(st, dataclasses.replace(fp8, dp=2, zero_stage=3)) == 1.0
    assert gather_bytes(st, dataclasses.replace(base, dp=2, zero_stage=3)) == 2.0


# -- FP8 time -------------------------------------------------------------------------------------------

def test_fp8_gemm_runs_at_the_fp8_rate_and_pays_for_its_casts():
    dev = device_type("h100-sxm")
    rf16 = Roofline.of(dev, "bf16")
    rf8 = dataclasses.replace(Roofline.of(dev, "fp8"), gemm_efficiency=dev.gemm_efficiency_of("fp8"))
    big = 16384
    t16, t8 = rf16.gemm(big, big, big, 2), fp8_gemm(rf8, big, big, big)
    assert t16 / t8 == pytest.approx((1979 * 0.65) / (989 * 0.7), rel=0.01)
    m = llama(8192)
    s = System(m, H100, framework="megatron")
    c = cfg(tp=1)
    b16 = block_for(s, "h100-sxm", c)
    b8 = block_for(s, "h100-sxm", dataclasses.replace(c, precision="fp8"))
    assert b8.forward_s < b16.forward_s and b8.backward_s < b16.backward_s
    # the scaling kernels: tensorwise reads X twice (amax, cast) and writes two FP8 layouts
    assert QUANT_BYTES["tensorwise"][0] == 6.0
    d = block_for(s, "h100-sxm", dataclasses.replace(c, precision="fp8", fp8_recipe="delayed"))
    assert d.forward_s < b8.forward_s  # delayed scaling skips the amax pass


def test_fp8_never_speeds_up_the_attention_core():
    m = llama(131072)
    s = System(m, H100, framework="megatron")
    c = cfg(tp=8, cp=8, sequence_parallel=True)
    b16 = block_for(s, "h100-sxm", c)
    b8 = block_for(s, "h100-sxm", dataclasses.replace(c, precision="fp8"))
    att = attention_core_times(m, 1, 8, s.roofline("h100-sxm"), 8)[0]
    assert b8.forward_s > att and b16.forward_s - b8.forward_s < b16.forward_s - att


def test_estimate_terms_include_cp_comm():
    e = estimate(cfg(dp=2, cp=4, tp=8, sequence_parallel=True), llama(32768), H100, framework="megatron")
    assert set(e.breakdown_s) == set(TIME_TERMS) and "cp_comm" in TIME_TERMS
    assert sum(e.breakdown_s.values()) == pytest.approx(e.step_time_s)


def test_search_picks_cp_for_128k_tokens():
    m = llama()
    r = search(m, H100, 16, gpus=64, top=3, framework="megatron", precision="bf16", trials=60)
    assert r.top and all(e.config.cp > 1 for e in r.top)
    assert all(e.config.precision == "bf16" for e in r.top)
