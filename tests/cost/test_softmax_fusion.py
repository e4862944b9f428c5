"""Megatron's fused scale-mask-softmax and its fp32 fallback: which shapes the kernel takes, and
what the fallback costs in device time, host operations and saved bytes."""

from __future__ import annotations

import dataclasses

import pytest

from autoconf.cost.activations import layer_activation_bytes
from autoconf.cost.attention import fused_softmax_available
from autoconf.cost.compute import block_times
from autoconf.cost.roofline import Roofline
from autoconf.cost.system import System
from autoconf.specs.cluster import cluster_from_mapping
from autoconf.specs.devices import device_type
from autoconf.specs.frameworks import HostCost
from autoconf.specs.frameworks import framework as framework_model
from autoconf.specs.model import ModelSpec

NODE = cluster_from_mapping({"node_groups": [{"count": 1, "device": "a100-80gb", "gpus_per_node": 8,
                                              "intra_node_bandwidth": "300 GB/s",
                                              "nics": {"count": 1, "bandwidth": "200 Gbit/s"}}]})


def _gpt(seq: int = 1024, heads: int = 16, attention: str = "eager", dtype: str = "fp16") -> ModelSpec:
    return ModelSpec(num_layers=12, hidden_size=1024, num_attention_heads=heads, num_kv_heads=heads,
                     ffn_hidden_size=4096, vocab_size=50257, seq_length=seq, activation="gelu", dtype=dtype,
                     norm="layernorm", position_embedding="learned", bias=True, dropout=0.1, attention=attention)


@pytest.mark.parametrize("b, heads, s, ok", [
    (1, 2, 1024, False),   # 16 heads over tp 8 at micro-batch 1: 2 attention batches, not a multiple of 4
    (2, 2, 1024, True),    # micro-batch 2: 4
    (1, 4, 1024, True),    # tp 4
    (1, 4, 4096, True),    # the kernel's longest keys
    (1, 4, 8192, False),   # longer keys: torch's softmax
    (1, 4, 16, False),     # keys must be more than 16
    (1, 4, 64, False),     # up to 128 keys a block takes 8 rows: 4 batches is not a multiple of 8
    (2, 4, 64, True),
    (1, 28, 2048, True),   # BLOOM-176B at tp 4 (112 heads)
    (1, 6, 1022, False),   # keys not a multiple of 4
])
def test_kernel_availability_follows_megatrons_rule(b, heads, s, ok):
    assert fused_softmax_available(b, heads, s, s) is ok


def test_fallback_adds_the_fp32_kernels_bytes_and_host_operations():
    m = _gpt()
    rf = Roofline.of(device_type("a100-80gb"), "fp16")
    host = HostCost(forward_op_s=50e-6, backward_op_s=20e-6)
    fused = block_times(m, 1, 8, False, "none", rf, host)
    unfused = block_times(m, 1, 8, False, "none", rf, host, unfused_softmax=True)
    # four more operations in the forward, four more autograd nodes in the backward
    assert unfused.host_forward_s - fused.host_forward_s == pytest.approx(4 * 50e-6)
    assert unfused.host_backward_s - fused.host_backward_s == pytest.approx(4 * 20e-6)
    # device: 2 local heads x 1024 x 1024 scores; each kernel of torch's fp32 path, (read, write)
    # bytes per score in fp16 (e = 2), tallied op by op, in place of the fused kernel's (2e, 3e)
    e = 2
    forward = [(e, 4), (4, 4), (4 + 1, 4), (4, 4), (4, e)]  # cast, scale, mask fill, softmax, cast back
    backward = [(e, 4), (4 + 4, 4), (4 + 1, 4), (4, 4), (4, e)]  # their gradients, in reverse
    scores = 1 * 2 * 1024 * 1024
    bw = rf.memory_bandwidth_bytes_per_s * rf.memory_efficiency
    assert unfused.forward_s - fused.forward_s == pytest.approx(
        scores * (sum(r + w for r, w in forward) - 2 * e) / bw + 4 * rf.kernel_launch_s)
    assert unfused.backward_s - fused.backward_s == pytest.approx(
        scores * (sum(r + w for r, w in backward) - 3 * e) / bw + 4 * rf.kernel_launch_s)
    # flash attention has no softmax kernel to fall back from
    flash = dataclasses.replace(m, attention="flash")
    assert block_times(flash, 1, 8, False, "none", rf, host, unfused_softmax=True) == \
        block_times(flash, 1, 8, False, "none", rf, host)


def test_fallback_keeps_the_softmax_output_in_fp32():
    m = _gpt()
    a = layer_activation_bytes(m, 1, 8)
    b = layer_activation_bytes(m, 1, 8, fp32_softmax=True)
    assert b["attention_softmax"] == 2 * a["attention_softmax"] == 4 * 16 * 1024 * 1024 / 8
    assert b["total"] - a["total"] == a["attention_softmax"]  # dropout keeps its own mask and output
    # without dropout the weighted sum keeps the 16-bit cast beside the fp32 softmax output
    nd = dataclasses.replace(m, dropout=0.0)
    a, b = layer_activation_bytes(nd, 1, 8), layer_activation_bytes(nd, 1, 8, fp32_softmax=True)
    assert b["total"] - a["total"] == 4 * 16 * 1024 * 1024 / 8


def test_fallback_saves_what_torch_saves():
    """The fp32 path run on CPU: the bytes autograd keeps for the backward per score, with and
    without dropout, against the activation model's attention parts."""
    torch = pytest.importorskip("torch")
    b, heads, s = 1, 2, 64
    for dropout in (0.0, 0.1):
        saved = []

        def pack(t):
            saved.append(t)
            return t

        q = torch.randn(b * heads, s, 16, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b * heads, s, 16, dtype=torch.bfloat16, requires_grad=True)
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            scores = torch.bmm(q, q.transpose(1, 2))
            x = scores.float() * 0.125
            x.masked_fill_(mask, -10000.0)
            p = torch.softmax(x, dim=-1).bfloat16()
            if dropout:
                p = torch.nn.functional.dropout(p, dropout)
            torch.bmm(p, v)
        big = {t.data_ptr(): t for t in saved if t.dim() == 3 and t.shape[-1] == s and t.shape[-2] == s}
        per_score = sum(t.element_size() for t in big.values())  # the s x s tensors kept (dropout's mask too)
        m = dataclasses.replace(_gpt(seq=s, heads=heads, dtype="bf16"), dropout=dropout)
        parts = layer_activation_bytes(m, b, 1, fp32_softmax=True, mask_bytes=2)  # CPU dropout: a 16-bit mask
        modelled = sum(v_ for k, v_ in parts.items() if k.startswith("attention_") and k != "attention_dropout_mask_out")
        assert modelled / (b * heads * s * s) == per_score == (8 if dropout else 6)


def test_only_megatron_falls_back_and_only_where_the_kernel_refuses():
    m = _gpt()
    meg = System(m, NODE, framework="megatron")
    assert meg.policy.unfused_softmax(1, 8) and not meg.policy.unfused_softmax(2, 8) and not meg.policy.unfused_softmax(1, 4)
    assert not System(m, NODE, framework="reference").policy.unfused_softmax(1, 8)
    assert not System(_gpt(attention="flash"), NODE, framework="megatron").policy.unfused_softmax(1, 8)
    assert not System(_gpt(dtype="fp32"), NODE, framework="megatron").policy.unfused_softmax(1, 8)
    assert System(_gpt(seq=8192), NODE, framework="megatron").policy.unfused_softmax(4, 1)


def test_estimate_says_when_the_softmax_falls_back_and_prices_it():
    from autoconf.cost.estimate import estimate
    from autoconf.space.config import ParallelConfig

    m = _gpt()
    one = ParallelConfig(dp=1, pp=1, tp=8, micro_batch_size=1, num_micro_batches=2, recompute="full")
    two = ParallelConfig(dp=1, pp=1, tp=8, micro_batch_size=2, num_micro_batches=1, recompute="full")
    e1 = estimate(one, m, NODE, framework="megatron")
    e2 = estimate(two, m, NODE, framework="megatron")
    assert any("fused softmax" in n for n in e1.notes)
    assert not any("fused softmax" in n for n in e2.notes)
    # the reference trainer runs its own eager softmax: no Megatron kernel, no note
    ref = estimate(one, m, NODE, framework="reference")
    assert not any("fused softmax" in n for n in ref.notes)
    # the same framework with the kernel taking every shape: the fallback costs time and memory
    off = estimate(one, m, NODE, framework=dataclasses.replace(framework_model("megatron"), megatron_softmax=False))
    assert e1.step_time_s > off.step_time_s
    assert e1.peak_memory_bytes > off.peak_memory_bytes
