"""The reference trainer's host model: the ATen operations ``autoconf.trainer.layers``'s layers really dispatch
(counted on the modules under a TorchDispatchMode) against ``compute.dispatch_op_counts``, and the
host floor it sets."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from autoconf.cost.compute import DISPATCH_EDGE_OPS, dispatch_op_counts  # noqa: E402
from autoconf.specs.frameworks import HostCost  # noqa: E402
from autoconf.specs.model import ModelSpec  # noqa: E402

BASE = ModelSpec(name="x", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=4, ffn_hidden_size=128,
                 vocab_size=100, seq_length=16, dtype="fp32")


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _dispatched(model: ModelSpec, layer: str, recompute: str = "none") -> tuple[int, int]:
    from profiler import compute

    mod, inputs = compute.build(model, layer, 1, 1, recompute, False, torch.device("cpu"))
    try:
        out = mod(*inputs)
        (out if out.dim() == 0 else out.sum()).backward()  # a first step: .grad exists, as in training
        with _Count() as fwd:
            out = mod(*inputs)
        g = None if out.dim() == 0 else torch.randn_like(out)
        with _Count() as bwd:
            out.backward(g)
        return fwd.n, bwd.n
    finally:
        compute.release()


VARIANTS = [{}, {"activation": "swiglu"}, {"norm": "rmsnorm"}, {"bias": True}, {"position_embedding": "rope"},
            {"dropout": 0.1}, {"attention": "eager"}, {"qkv_bias": True}, {"num_kv_heads": 2},
            {"activation": "swiglu", "norm": "rmsnorm", "position_embedding": "rope", "num_kv_heads": 2,
             "qkv_bias": True},  # Qwen-like
            {"bias": True, "dropout": 0.1, "activation": "gelu"}]  # GPT-2-like


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("over", VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "base")
def test_block_dispatch_counts_match_the_real_block(over, dtype):
    m = dataclasses.replace(BASE, dtype=dtype, **over)
    assert dispatch_op_counts(m, 1, False) == _dispatched(m, "block")


def test_edge_dispatch_counts_match_the_real_layers():
    assert _dispatched(BASE, "embedding") == DISPATCH_EDGE_OPS["embedding"]
    f, b = _dispatched(BASE, "head")
    assert (f, b) == pytest.approx(DISPATCH_EDGE_OPS["head"], abs=1)


def test_full_recompute_dispatches_the_forward_about_twice_more():
    """The model charges full recomputation 2 x the forward's dispatches in the backward (the forward
    re-run and its saved tensors' unpacking); the real count is within 20% of that."""
    for over in ({}, {"bias": True}, {"activation": "swiglu", "norm": "rmsnorm"}):
        m = dataclasses.replace(BASE, **over)
        f, b = dispatch_op_counts(m, 1, False)
        _, b_full = _dispatched(m, "block", "full")
        assert b_full - b == pytest.approx(2 * f, rel=0.2)


def test_host_floor_of_a_block():
    """host times = dispatches x seconds per op, plus half a checkpoint region per pass when
    recomputing (closed form on the compute module's own layer times)."""
    from autoconf.cost.compute import block_times
    from autoconf.cost.roofline import Roofline
    from autoconf.specs.devices import device_type

    rf = Roofline.of(device_type("h100-sxm"), "bf16")
    host = HostCost(forward_op_s=1e-5, backward_op_s=2e-5, dispatch_counts=True, checkpoint_s=1e-3)
    f, b = dispatch_op_counts(BASE, 1, False)
    t = block_times(BASE, 1, 1, False, "none", rf, host=host)
    assert (t.host_forward_s, t.host_backward_s) == pytest.approx((f * 1e-5, b * 2e-5))
    t = block_times(BASE, 1, 1, False, "full", rf, host=host)
    assert t.host_forward_s == pytest.approx(f * 1e-5 + 5e-4)
    assert t.host_backward_s == pytest.approx(b * 2e-5 + 2 * f * 1e-5 + 5e-4)
    t = block_times(BASE, 1, 1, False, "selective", rf, host=host)
    assert t.host_backward_s == pytest.approx(b * 2e-5 + 8 * 2e-5 + 5e-4)


def test_selective_recompute_re_dispatches_the_attention_core():
    """The re-run attention core's dispatches, fused or eager, within 20% of the real count."""
    from autoconf.cost.compute import block_times
    from autoconf.cost.roofline import Roofline
    from autoconf.specs.devices import device_type

    rf = Roofline.of(device_type("h100-sxm"), "bf16")
    host = HostCost(forward_op_s=1e-5, backward_op_s=1e-5, dispatch_counts=True)
    for over in ({}, {"attention": "eager"}):
        m = dataclasses.replace(BASE, **over)
        _, b = dispatch_op_counts(m, 1, False)
        _, b_sel = _dispatched(m, "block", "selective")
        t = block_times(m, 1, 1, False, "selective", rf, host=host)
        assert t.host_backward_s / 1e-5 - b == pytest.approx(b_sel - b, rel=0.2)
