"""The framework's rules applied to a configuration (``autoconf.cost.policy``), without a System:
no device, link or profile enters them."""

from __future__ import annotations

import pytest

from autoconf.cost.policy import Policy, check_moe_options
from autoconf.errors import UserError
from autoconf.space.config import ParallelConfig
from autoconf.specs.frameworks import framework
from autoconf.specs.model import preset


def _cfg(**kw):
    base = dict(dp=8, pp=1, tp=1, micro_batch_size=1, num_micro_batches=4)
    return ParallelConfig(**{**base, **kw})


def test_megatron_pads_the_vocabulary_to_128_times_tp_and_keeps_fp32_gradients():
    m = preset("gpt3-1.3b")  # vocabulary 50,257 (GPT-2's tokenizer)
    p = Policy(m, framework("megatron"))
    for tp in (1, 2, 8):
        v = p.model_at(tp).vocab_size
        assert v % (128 * tp) == 0 and 0 <= v - m.vocab_size < 128 * tp
    assert p.model_at(2) is p.model_at(2)  # built once
    assert p.model_at(1, cp=4).seq_length == m.seq_length // 4
    assert p.grad_bytes == 4  # bf16 gradients accumulated in an fp32 buffer (Megatron's DDP)
    assert Policy(m, framework("reference")).grad_bytes == 2
    assert Policy(m, framework("reference")).model_at(8) is m  # no padding


def test_torchtitan_reduces_fsdp_gradients_in_fp32_and_gathers_once_per_step_under_pp():
    m = preset("gpt3-1.3b")
    tt, ref = Policy(m, framework("torchtitan")), Policy(m, framework("reference"))
    assert tt.reduce_bytes(_cfg(zero_stage=3)) == 4 and tt.reduce_bytes(_cfg(zero_stage=1)) == tt.grad_bytes == 2
    assert ref.reduce_bytes(_cfg(zero_stage=3)) == 2
    assert tt.fsdp_step_gather(3, 4, 8) and tt.fsdp_step_gather(2, 4, 8)
    assert not tt.fsdp_step_gather(3, 1, 8) and not tt.fsdp_step_gather(1, 4, 8) and not tt.fsdp_step_gather(3, 4, 1)
    assert not ref.fsdp_step_gather(3, 4, 8)


def test_deepspeed_bf16_optimizer_under_pipelining_lays_state_out_as_zero1():
    m = preset("gpt3-1.3b")
    ds = Policy(m, framework("deepspeed"))
    piped = _cfg(pp=2, dp=4, zero_stage=0)
    assert ds.bf16_optimizer(piped) and ds.state_zero_stage(piped) == 1 and ds.accumulates(piped)
    assert not ds.bf16_optimizer(_cfg(zero_stage=0)) and ds.state_zero_stage(_cfg(zero_stage=0)) == 0
    assert not Policy(m, framework("megatron")).bf16_optimizer(piped)


def test_accumulation_stops_where_zero2_reduces_every_micro_batch():
    p = Policy(preset("gpt3-1.3b"), framework("reference"))
    assert p.accumulates(_cfg(zero_stage=1))
    assert not p.accumulates(_cfg(zero_stage=2)) and not p.accumulates(_cfg(zero_stage=3))
    assert p.accumulates(_cfg(zero_stage=3, dp=1))
    assert not p.accumulates(_cfg(num_micro_batches=1))


def test_supports_names_what_the_device_lacks():
    p = Policy(preset("gpt3-1.3b"), framework("megatron"))
    assert p.supports("h100-sxm", _cfg(precision="fp8")) is None
    assert "no FP8 tensor cores" in p.supports("a100-80gb", _cfg(precision="fp8"))
    assert p.supports("a100-80gb", _cfg()) is None
    assert p.host_cost("cpu") is None and p.host_cost("h100-sxm") is framework("megatron").host
    assert p.mask_bytes("h100-sxm") == 1 and p.mask_bytes("cpu") == 2


def test_moe_options_are_refused_in_one_line():
    dense, fw = preset("gpt3-1.3b"), framework("megatron")
    check_moe_options(dense, fw, 1.0, "alltoall")
    for bad in (0.5, 65.0, True, "2"):
        with pytest.raises(UserError, match="--moe-imbalance"):
            check_moe_options(dense, fw, bad, "alltoall")
    with pytest.raises(UserError, match="has no experts to dispatch to"):
        check_moe_options(dense, fw, 1.0, "allgather")
