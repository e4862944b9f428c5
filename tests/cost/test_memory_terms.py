"""Closed forms of the memory terms one H100 run corrected: optimizer state without a master copy,
the foreach AdamW step's temporaries, and the loss gradient's copies."""

from __future__ import annotations

import dataclasses

import pytest

from autoconf.cost.estimate import estimate
from autoconf.cost.memory import bytes_per_param, optimizer_temporary_bytes, state_bytes_per_param
from autoconf.space.config import ParallelConfig
from autoconf.specs.cluster import cluster_from_mapping
from autoconf.specs.hf import load_model

GIB = 2**30


def _one(device: str):
    return cluster_from_mapping({"node_groups": [{"count": 1, "device": device, "gpus_per_node": 1,
                                                  "intra_node_bandwidth": "100 GB/s",
                                                  "nics": {"count": 1, "bandwidth": "100 Gbit/s"}}]})


def test_state_bytes_with_and_without_a_master_copy():
    assert bytes_per_param("bf16") == (2, 2, 12)  # ZeRO paper: 2 + 2 + K, K = 12
    assert bytes_per_param("bf16", master_copy=False) == (2, 2, 4)  # torch AdamW on bf16: m, v in bf16
    assert bytes_per_param("fp32", master_copy=False) == bytes_per_param("fp32") == (4, 4, 8)
    st = state_bytes_per_param("bf16", 1, 8, master_copy=False)
    assert (st.parameters, st.gradients, st.optimizer) == (2, 2, 0.5)
    # one moment: a third of (master, m, v), half of (m, v)
    assert optimizer_temporary_bytes(12.0, "bf16", True) == 4.0
    assert optimizer_temporary_bytes(4.0, "bf16", False) == 2.0
    assert optimizer_temporary_bytes(8.0, "fp32", True) == 4.0


def _parts(e) -> dict:
    st = e.memory_by_stage[0]
    return {"parameters": st.parameters, "gradients": st.gradients, "optimizer": st.optimizer,
            "activations": st.activations, **dict(st.other_parts)}


def test_reference_trainer_on_a_gpu_keeps_8_bytes_per_parameter_and_one_moment_more_at_the_step():
    m = load_model("gpt3-1.3b")
    n = m.num_params()
    c = ParallelConfig(dp=1, pp=1, tp=1, micro_batch_size=1, num_micro_batches=8, recompute="full")
    p = _parts(estimate(c, m, _one("h100-sxm")))
    assert p["parameters"] == pytest.approx(2 * n) and p["gradients"] == pytest.approx(2 * n)
    assert p["optimizer"] == pytest.approx(4 * n)
    # full recompute keeps little: the step's sqrt(v) (2 bytes per parameter) is the peak's top
    assert p["activations"] < 2 * n
    assert p["optimizer step temporaries"] == pytest.approx(2 * n - p["activations"])
    # Megatron-LM: fp32 main_grad and master copy, fused Adam (no temporaries)
    q = _parts(estimate(c, m, _one("h100-sxm"), framework="megatron"))
    assert q["optimizer"] == pytest.approx(12 * n, rel=0.01) and "optimizer step temporaries" not in q


def test_no_step_temporaries_on_cpu_ranks():
    """torch's AdamW steps CPU tensors one at a time (no foreach default there): the configuration
    whose peak is the step's on a GPU has no such term on CPU processes."""
    m = load_model("gpt3-1.3b")
    c = ParallelConfig(dp=1, pp=1, tp=1, micro_batch_size=1, num_micro_batches=8, recompute="full")
    assert _parts(estimate(c, m, _one("h100-sxm"))).get("optimizer step temporaries", 0) > 0
    assert "optimizer step temporaries" not in _parts(estimate(c, m, _one("cpu")))


def test_step_peak_counts_gradients_the_activation_peak_did_not_hold():
    """Layered accumulation peaks before most gradients exist; the step holds them all, with the
    foreach temporary on top: the predicted peak is at least what the step needs."""
    m = load_model("gpt2-large")
    c = ParallelConfig(dp=1, pp=1, tp=1, micro_batch_size=2, num_micro_batches=2, recompute="full",
                       layered_grad_accum=True)
    e = estimate(c, m, _one("h100-sxm"))
    st = e.memory_by_stage[0]
    n = m.num_params()
    step = 2 * n + 2 * n + 4 * n + 2 * n + dict(st.other_parts)["runtime context"]  # params, grads, m+v, sqrt(v)
    assert e.peak_memory_bytes >= step * 0.999


def test_loss_gradient_is_an_fp32_copy_and_its_16_bit_cast():
    from autoconf.cost.stage_memory import loss_grad_bytes
    from autoconf.cost.system import System

    m = load_model("gpt3-1.3b")
    c = ParallelConfig(dp=1, pp=1, tp=2, micro_batch_size=2, num_micro_batches=4)
    logits = 2 * m.seq_length * (-(-m.vocab_size // 2))
    assert loss_grad_bytes(System(m, _one("h100-sxm")), c) == pytest.approx(6 * logits)
    # Megatron-LM pads the vocabulary and writes the gradient into the saved softmax
    mg = System(m, _one("h100-sxm"), framework="megatron")
    vp = mg.policy.model_at(2).vocab_size
    assert loss_grad_bytes(mg, c) == pytest.approx(2 * 2 * m.seq_length * (-(-vp // 2)))


def test_torch_cross_entropy_backward_holds_two_fp32_logit_tensors_beside_the_saved_softmax():
    """Measured, not assumed: torch's ``F.cross_entropy`` on ``logits.float()`` (torchtitan's loss)
    on CPU under MemTracker. Its backward peaks at the saved fp32 log-softmax plus two fp32
    logits-sized gradients, which is what the torchtitan model prices (4 + 8 bytes per logit)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker

    from autoconf.cost.stage_memory import loss_grad_bytes
    from autoconf.cost.system import System

    T, V, h = 512, 32000, 64
    torch.manual_seed(0)
    hid = torch.randn(T, h, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(V, h, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, V, (T,))
    mt = MemTracker()
    mt.track_external(hid, w)
    with mt:
        pred = hid @ w.t()
        loss = F.cross_entropy(pred.float(), y)
        del pred
        loss.backward()
    peak = max(int(v.get("Total", 0)) for v in mt.get_tracker_snapshot("peak").values())
    # less the parameters (their gradients are written after the loss's backward, past the peak)
    measured = (peak - 2 * (hid.numel() + w.numel())) / (T * V)
    m = dataclasses.replace(load_model("gpt3-1.3b"), vocab_size=V, seq_length=T, dtype="bf16")
    c = ParallelConfig(dp=1, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1)
    modelled = 4 + loss_grad_bytes(System(m, _one("h100-sxm"), framework="torchtitan"), c) / (T * V)
    assert modelled == 12
    assert measured == pytest.approx(modelled, rel=0.005)
