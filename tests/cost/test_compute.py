"""autoconf/cost/compute.py: a block's, the head's and the optimizer's times from their FLOPs and bytes.

The expected numbers come from the published FLOP counts, not from the code: a GPT block's forward
does 24 b s h^2 + 4 b s^2 h FLOPs = 24 b s h^2 (1 + s / 6h) (Narayanan et al. 2021, arXiv
2104.04473, eq. 3, with f = 4h and one head width of h / a), its backward twice that; each costs
FLOPs / (peak x efficiency) on a roofline whose memory is free and whose tiles are perfect. A
causal flash kernel skips the masked half of the scores (Dao 2022), and its backward does 2.5x its
forward's FLOPs (module docstring).
"""

from __future__ import annotations

import pytest

from autoconf.cost.compute import (
    adamw_bytes_per_param,
    block_times,
    embedding_times,
    head_times,
    optimizer_s,
)
from autoconf.cost.roofline import Roofline
from autoconf.specs.frameworks import HostCost
from autoconf.specs.model import ModelSpec

PEAK, EFF = 300e12, 0.6


def compute_bound() -> Roofline:
    """A roofline where only FLOPs take time: free memory, no launches, perfect tiles (no SMs)."""
    return Roofline(peak_flop_per_s=PEAK, memory_bandwidth_bytes_per_s=1e30, gemm_efficiency=EFF,
                    memory_efficiency=1.0, kernel_launch_s=0.0)


def memory_bound(bw: float = 2e12, eff: float = 0.8, launch: float = 0.0) -> Roofline:
    """A roofline where only bytes take time."""
    return Roofline(peak_flop_per_s=1e30, memory_bandwidth_bytes_per_s=bw, gemm_efficiency=1.0,
                    memory_efficiency=eff, kernel_launch_s=launch)


def gpt(h=2048, a=16, s=2048, attention="eager", **kw) -> ModelSpec:
    return ModelSpec(num_layers=4, hidden_size=h, num_attention_heads=a, num_kv_heads=a, ffn_hidden_size=4 * h,
                     vocab_size=51200, seq_length=s, attention=attention, **kw)


def narayanan_forward_flops(b, s, h) -> float:
    return 24 * b * s * h * h * (1 + s / (6 * h))


@pytest.mark.parametrize("b,s,h,tp", [(1, 2048, 2048, 1), (4, 1024, 4096, 1), (2, 4096, 1024, 2), (1, 2048, 8192, 8)])
def test_eager_block_forward_is_narayanan_s_flops_over_peak_times_efficiency(b, s, h, tp):
    m = gpt(h=h, s=s)
    t = block_times(m, b, tp, False, "none", compute_bound())
    want = narayanan_forward_flops(b, s, h) / tp / (PEAK * EFF)
    assert t.forward_s == pytest.approx(want, rel=1e-9)
    # backward: two GEMMs per forward GEMM (input and weight gradients), both attention bmms twice
    assert t.backward_s == pytest.approx(2 * want, rel=1e-9)
    assert t.recompute_s == 0.0


def test_flash_block_skips_the_masked_half_and_its_backward_does_2_5x():
    b, s, h = 2, 4096, 2048
    m = gpt(h=h, s=s, attention="flash")
    t = block_times(m, b, 1, False, "none", compute_bound())
    gemms = 24 * b * s * h * h
    core = 4 * b * s * s * h / 2  # causal: half the scores
    assert t.forward_s == pytest.approx((gemms + core) / (PEAK * EFF), rel=1e-9)
    assert t.backward_s == pytest.approx((2 * gemms + 2.5 * core) / (PEAK * EFF), rel=1e-9)


def test_grouped_query_attention_shrinks_only_the_kv_projection():
    """Llama-style GQA with a SwiGLU MLP: QKV is h x (h + 2 h kv/a), the MLP three h x f matrices."""
    b, s, h, a, kv, f = 1, 2048, 4096, 32, 8, 14336
    m = ModelSpec(num_layers=2, hidden_size=h, num_attention_heads=a, num_kv_heads=kv, ffn_hidden_size=f,
                  vocab_size=32000, seq_length=s, activation="swiglu", norm="rmsnorm", position_embedding="rope",
                  attention="eager")
    t = block_times(m, b, 1, False, "none", compute_bound())
    T = b * s
    proj = 2 * T * h * (h + 2 * h * kv // a) + 2 * T * h * h  # QKV, output
    mlp = 2 * T * h * 2 * f + 2 * T * f * h  # gate and up, down
    core = 4 * b * s * s * h  # eager: every score, scores and weighted sum
    assert t.forward_s == pytest.approx((proj + mlp + core) / (PEAK * EFF), rel=1e-9)


@pytest.mark.parametrize("attention", ["eager", "flash"])
def test_recomputation_adds_the_forward_or_the_attention_core(attention):
    b, s, h = 1, 2048, 2048
    m = gpt(h=h, s=s, attention=attention)
    rf = compute_bound()
    none = block_times(m, b, 1, False, "none", rf)
    full = block_times(m, b, 1, False, "full", rf)
    sel = block_times(m, b, 1, False, "selective", rf)
    assert full.recompute_s == pytest.approx(none.forward_s, rel=1e-12)
    assert full.backward_s == pytest.approx(none.backward_s + none.forward_s, rel=1e-12)
    core = 4 * b * s * s * h * (0.5 if attention == "flash" else 1.0) / (PEAK * EFF)
    assert sel.recompute_s == pytest.approx(core, rel=1e-9)
    assert sel.backward_s == pytest.approx(none.backward_s + core, rel=1e-9)
    assert full.forward_s == sel.forward_s == none.forward_s


def test_host_issue_time_is_op_count_times_per_op_cost_and_full_recompute_reissues_the_forward():
    m = gpt(h=1024, s=1024)
    host = HostCost(forward_op_s=10e-6, backward_op_s=5e-6)
    t = block_times(m, 1, 1, False, "none", compute_bound(), host=host)
    # 32 forward / 57 backward ops would be the dispatch count; the structural count (block_op_counts):
    # 2 norms, 4 linears, 11 views, eager attention 8, GeLU 1, two residual adds 2 = 28; backward 28 - 11
    assert t.host_forward_s == pytest.approx(28 * 10e-6)
    assert t.host_backward_s == pytest.approx(17 * 5e-6)
    full = block_times(m, 1, 1, False, "full", compute_bound(), host=host)
    assert full.host_backward_s == pytest.approx(17 * 5e-6 + 28 * 10e-6)


def test_head_is_the_vocabulary_projection_and_its_two_backward_gemms():
    b, s, h, V, tp = 2, 1024, 2048, 51200, 4
    m = gpt(h=h, s=s)
    t = head_times(m, b, tp, compute_bound())
    proj = 2 * b * s * h * V / tp
    assert t.forward_s == pytest.approx(proj / (PEAK * EFF), rel=1e-9)
    assert t.backward_s == pytest.approx(2 * proj / (PEAK * EFF), rel=1e-9)


def test_embedding_lookup_is_memory_bound():
    b, s, h, V, tp = 2, 1024, 2048, 51200, 2
    m = gpt(h=h, s=s)
    bw, eff = 2e12, 0.8
    t = embedding_times(m, b, tp, memory_bound(bw, eff))
    # forward: token and position rows read, the sum written (3 x T h elements in bf16)
    assert t.forward_s == pytest.approx(3 * b * s * h * 2 / (bw * eff), rel=1e-12)
    # backward: the gradient read and scattered (2 T h) into a dense V/tp x h table
    assert t.backward_s == pytest.approx((2 * b * s * h + V / tp * h) * 2 / (bw * eff), rel=1e-12)


@pytest.mark.parametrize("master,param_bytes,foreach,per_param", [
    (True, 2, False, 32),   # read grad 2, m 4 and v 4, write m 4 and v 4, fp32 master read + write 8, 16-bit copy 2... = 32
    (False, 4, False, 28),  # fp32 without a master copy: grad, m, v, p: 7 x 4
    (False, 2, False, 14),  # bf16 moments: 7 x 2
    (False, 2, True, 42),   # torch's foreach AdamW: 21 passes' bytes x 2
])
def test_optimizer_step_is_bytes_per_param_over_memory_bandwidth(master, param_bytes, foreach, per_param):
    assert adamw_bytes_per_param(master, param_bytes, foreach) == per_param
    n, bw, eff, launch = 1e9, 2e12, 0.8, 5e-6
    t = optimizer_s(n, master, memory_bound(bw, eff, launch), param_bytes, foreach)
    assert t == pytest.approx(n * per_param / (bw * eff) + 4 * launch, rel=1e-12)
