"""The reference trainer's eager element-wise code and fused attention's shape: the bytes
``autoconf.trainer.layers``'s RMSNorm and rotary embedding really move (every ATen call's operands and results,
tallied under a TorchDispatchMode on CPU) against ``compute.eager_elementwise_bytes``, and the
attention efficiency's closed forms."""

from __future__ import annotations

import dataclasses

import pytest

from autoconf.cost.attention import ATTENTION_TILE_OVERHEAD, attention_shape_efficiency
from autoconf.cost.compute import block_times, eager_elementwise_bytes
from autoconf.cost.roofline import Roofline
from autoconf.specs.devices import device_type
from autoconf.specs.model import ModelSpec

LLAMA = ModelSpec(name="l", num_layers=2, hidden_size=512, num_attention_heads=8, num_kv_heads=2,
                  ffn_hidden_size=1024, vocab_size=128, seq_length=64, activation="swiglu", norm="rmsnorm",
                  position_embedding="rope", bias=False, dtype="bf16")


def _bytes_moved(fn) -> int:
    """Bytes every ATen call reads and writes (views excluded) while ``fn`` runs."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    class Tally(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(a.alias_info is not None for a in func._schema.returns):
                return out  # a view: nothing moves
            ins = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                   if isinstance(t, torch.Tensor)]  # cat takes a list
            outs = out if isinstance(out, (tuple, list)) else [out]
            Tally.n += sum(t.numel() * t.element_size() for t in ins)
            Tally.n += sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
            return out

    with Tally():
        fn()
    return Tally.n


def test_rmsnorm_bytes_match_the_dispatched_operations():
    torch = pytest.importorskip("torch")
    from autoconf.trainer.layers import NORM_EPS, RMSNormFn

    model = dataclasses.replace(LLAMA, position_embedding="learned", activation="gelu")
    T, h = 256, model.hidden_size
    x = torch.randn(T, h, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(h, dtype=torch.bfloat16, requires_grad=True)
    out = {}
    fwd = _bytes_moved(lambda: out.setdefault("y", RMSNormFn.apply(x, w, NORM_EPS)))
    g = torch.randn(T, h, dtype=torch.bfloat16)
    bwd = _bytes_moved(lambda: torch.autograd.grad(out["y"], (x, w), g))
    # the model's extra for the block's two norms, the QKV split's share removed, halved, plus
    # the fused kernel it replaces (2e forward, 4e backward per element)
    xf, xb, _, _ = eager_elementwise_bytes(model, T, T, 1, 0.0)
    xb -= T * (model.q_size + 2 * model.kv_size) * 2 * 2
    xf, xb = xf / 2, xb / 2
    e = 2
    assert xf + 2 * e * T * h == pytest.approx(fwd, rel=0.03)
    assert xb + 4 * e * T * h == pytest.approx(bwd, rel=0.03)
    assert fwd / (T * h) == pytest.approx(36, rel=0.03) and bwd / (T * h) == pytest.approx(94, rel=0.03)


def test_rope_bytes_match_the_dispatched_operations():
    torch = pytest.importorskip("torch")
    from autoconf.trainer.layers import rope, rope_tables

    b, s, heads, d = 2, LLAMA.seq_length, 32, LLAMA.head_size
    cos, sin = rope_tables(LLAMA, torch.bfloat16, torch.device("cpu"))
    x = torch.randn(b, s, heads, d, dtype=torch.bfloat16, requires_grad=True)
    out = {}
    fwd = _bytes_moved(lambda: out.setdefault("y", rope(x, cos, sin)))
    g = torch.randn_like(out["y"])
    bwd = _bytes_moved(lambda: torch.autograd.grad(out["y"], x, g))
    n = x.numel()
    # 10e per rotated element both ways (cos / sin tables are 1/(b*heads) of it, inside the tolerance)
    assert fwd / n == pytest.approx(20, rel=0.03)
    assert bwd / n == pytest.approx(20, rel=0.03)


def test_block_charges_the_eager_code_and_the_gradient_accumulation():
    rf = Roofline.of(device_type("h100-sxm"), "bf16")
    base = block_times(LLAMA, 4, 1, False, "none", rf)
    eager = block_times(LLAMA, 4, 1, False, "none", rf, eager_elementwise=True)
    acc = block_times(LLAMA, 4, 1, False, "none", rf, grad_accumulation=True)
    T = 4 * LLAMA.seq_length
    xf, xb, kf, kb = eager_elementwise_bytes(LLAMA, T, T, 1, T * LLAMA.ffn_hidden_size)
    bw = rf.memory_bandwidth_bytes_per_s * rf.memory_efficiency
    assert eager.forward_s - base.forward_s == pytest.approx(xf / bw + kf * rf.kernel_launch_s, rel=1e-6)
    assert eager.backward_s - base.backward_s == pytest.approx(xb / bw + kb * rf.kernel_launch_s, rel=1e-6)
    # read the accumulated and the new gradient, write the sum: 3 x the block's parameters in bf16,
    # one kernel per weight (four linears, two norms)
    assert acc.backward_s - base.backward_s == pytest.approx(3 * LLAMA.layer_params() * 2 / bw
                                                            + 6 * rf.kernel_launch_s, rel=1e-6)
    assert acc.forward_s == base.forward_s
    # torch.compile fuses the chains: no eager extra
    assert (block_times(LLAMA, 4, 1, False, "none", rf, eager_elementwise=True, compiled=True).forward_s
            == block_times(LLAMA, 4, 1, False, "none", rf, compiled=True).forward_s)


def test_attention_tiles_closed_form():
    rf = Roofline.of(device_type("a100-80gb"), "bf16")
    rf0 = dataclasses.replace(rf, special_function_per_s=0.0)
    c0f, c0b = ATTENTION_TILE_OVERHEAD
    for s in (512, 2048, 16384):
        n = s / 128
        f, b = attention_shape_efficiency(rf0, 0.6, 0.5, 128, s)
        assert f == pytest.approx(0.6 * n / (n + 1 + 2 * c0f))
        assert b == pytest.approx(0.5 * n / (n + 1 + 2 * c0b))
    # long sequences approach the catalog's rate; short ones lose more in the backward
    f, b = attention_shape_efficiency(rf0, 0.6, 0.5, 128, 1 << 20)
    assert f == pytest.approx(0.6, rel=1e-3) and b == pytest.approx(0.5, rel=1e-2)
    # a window of w keys: w / 128 useful tiles per query tile, about one masked
    f, _ = attention_shape_efficiency(rf0, 0.6, 0.5, 128, 8192, window=1024)
    assert f == pytest.approx(0.6 * 8 / (8 + 1 + c0f))
    # head dim 128 is the catalog's: unchanged by the softmax term
    assert attention_shape_efficiency(rf, 0.6, 0.5, 128, 4096) == attention_shape_efficiency(rf0, 0.6, 0.5, 128, 4096)


def test_attention_head_dim_closed_form():
    """1 / eff(d) = 1 / eff(128) + peak / X * k * (1 / (F d) - 1 / (F 128)): one exponential per score
    forward (F = 4 FLOPs per d), two backward (F = 10)."""
    rf = Roofline.of(device_type("h100-sxm"), "bf16")
    rf0 = dataclasses.replace(rf, special_function_per_s=0.0)
    r = rf.peak_flop_per_s / rf.special_function_per_s
    f64, b64 = attention_shape_efficiency(rf, 0.63, 0.52, 64, 1 << 30)
    f128, b128 = attention_shape_efficiency(rf0, 0.63, 0.52, 128, 1 << 30)
    assert 1 / f64 == pytest.approx(1 / f128 + r * (1 / 256 - 1 / 512), rel=1e-3)
    assert 1 / b64 == pytest.approx(1 / b128 + r * 2 * (1 / 640 - 1 / 1280), rel=1e-2)
    # what the H100 measured at head dim 64 (bench/data/h100-2026-11-24/kernels.json, cuDNN): 0.47 / 0.43
    assert f64 == pytest.approx(0.47, abs=0.02) and b64 == pytest.approx(0.43, abs=0.02)


@pytest.mark.parametrize("dim", [None, -1])
def test_fp8_quantize_bytes_match_the_dispatched_operations(dim):
    """``autoconf.trainer.fp8.quantize`` (tensorwise: dim None; rowwise: one scale per row) moves
    ``EAGER_QUANT_BYTES`` per element of a bf16 operand."""
    torch = pytest.importorskip("torch")
    from autoconf.cost.fp8 import EAGER_QUANT_BYTES
    from autoconf.trainer import fp8

    t = torch.randn(512, 256, dtype=torch.bfloat16)
    moved = _bytes_moved(lambda: fp8.quantize(t, fp8.FWD_DTYPE, dim))
    assert moved / t.numel() == pytest.approx(EAGER_QUANT_BYTES, rel=0.03)


def test_eager_fp8_quantisation_is_priced_per_operand():
    from autoconf.cost.fp8 import EAGER_QUANT_BYTES, EAGER_QUANT_KERNELS, Fp8, quantize_times

    rf = Roofline.of(device_type("h100-sxm"), "bf16")
    m, n, k = 4096.0, 28672.0, 4096.0
    f, b = quantize_times([(m, n, k)], Fp8(rf, "tensorwise", eager=True), rf)
    bw = rf.memory_bandwidth_bytes_per_s * rf.memory_efficiency
    assert f == pytest.approx((m * k + k * n) * EAGER_QUANT_BYTES / bw + 2 * EAGER_QUANT_KERNELS * rf.kernel_launch_s)
    assert b == pytest.approx(((2 * m * n + k * n + m * k) * EAGER_QUANT_BYTES + 2 * (k * n + m * n + m * k)) / bw
                              + (4 * EAGER_QUANT_KERNELS + 3) * rf.kernel_launch_s)
    fused_f, fused_b = quantize_times([(m, n, k)], Fp8(rf, "tensorwise"), rf)
    assert f > 5 * fused_f and b > 5 * fused_b


def test_attention_efficiency_against_the_measured_h100_rows():
    """The H100 catalog's cuDNN attention (0.63 / 0.52 at head dim 128, scaled by shape) against every
    measured cuDNN row: head dims 64 and 128, multi-head and grouped-query, 512-16384 tokens."""
    import json
    import os

    here = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "data", "h100-2026-11-24")
    rows = []
    for name in ("kernels.json", "kernels-gqa-breakdown.json"):
        with open(os.path.join(here, name)) as f:
            rows += json.load(f)["attention"]
    rf = Roofline.of(device_type("h100-sxm"), "bf16")
    att = device_type("h100-sxm").attention_efficiency
    checked = 0
    for r in rows:
        if r["backend"] != "cudnn" or "error" in r:
            continue
        f, b = attention_shape_efficiency(rf, att["forward"], att["backward"], r["head_dim"], r["seq"])
        measured_f = r["flops_fwd"] / r["fwd_s"] / rf.peak_flop_per_s
        measured_b = r["flops_bwd"] / r["bwd_s"] / rf.peak_flop_per_s
        assert f == pytest.approx(measured_f, rel=0.09), r
        assert b == pytest.approx(measured_b, rel=0.09), r
        checked += 1
    assert checked == 17
    # a constant rate (the catalog's old FlashAttention-2 figure) misses them by far more
    assert not all(0.35 == pytest.approx(r["flops_fwd"] / r["fwd_s"] / rf.peak_flop_per_s, rel=0.09)
                   for r in rows if r["backend"] == "cudnn" and "error" not in r)
