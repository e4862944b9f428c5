"""autoconf/cost/stage_memory.py: model states per pipeline stage under each ZeRO stage.

Expected bytes: Rajbhandari et al. (ZeRO, arXiv 1910.02054, sec. 3.1): mixed-precision Adam keeps
2 bytes of 16-bit parameters, 2 of 16-bit gradients and 12 of optimizer state per parameter;
ZeRO-1 shards the 12 over dp, ZeRO-2 the gradients too, ZeRO-3 the parameters too. Megatron-LM
accumulates bf16 gradients in an fp32 main_grad (4 bytes: its documented 18 bytes per parameter,
6 + 12/d with the distributed optimizer). Parameter counts are the model's, split over tp and
over the pipeline's chunks as the layers fall.
"""

from __future__ import annotations

import dataclasses

import pytest

from autoconf.cost.layout import layout
from autoconf.cost.stage_memory import stage_memory
from autoconf.cost.system import System
from autoconf.space.config import ParallelConfig
from autoconf.specs.cluster import load_cluster
from autoconf.specs.devices import device_type
from autoconf.specs.model import ModelSpec

A100 = load_cluster("examples/clusters/a100-4x8.yaml")
MODEL = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, num_kv_heads=16, ffn_hidden_size=4096,
                  vocab_size=32768, seq_length=2048)
P = MODEL.num_params()


def memory(framework, **kw):
    g = dataclasses.replace(A100.node_groups[0], count=2)
    system = System(MODEL, dataclasses.replace(A100, node_groups=(g,)), framework=framework)
    c = ParallelConfig(**{"dp": 8, "pp": 1, "tp": 1, "micro_batch_size": 1, "num_micro_batches": 4, **kw})
    return stage_memory(system, c, layout(system, c))


@pytest.mark.parametrize("dp", [2, 8, 16])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_deepspeed_model_states_are_the_zero_paper_s(zero, dp):
    (mem,) = memory("deepspeed", dp=dp, zero_stage=zero)
    p, g, o = 2.0, 2.0, 12.0
    assert mem.parameters == pytest.approx(P * (p / dp if zero >= 3 else p), rel=1e-9)
    assert mem.gradients == pytest.approx(P * (g / dp if zero >= 2 else g), rel=1e-9)
    assert mem.optimizer == pytest.approx(P * (o / dp if zero >= 1 else o), rel=1e-9)
    paper = {0: 16, 1: 4 + 12 / dp, 2: 2 + 14 / dp, 3: 16 / dp}[zero]
    assert mem.parameters + mem.gradients + mem.optimizer == pytest.approx(P * paper, rel=1e-9)


@pytest.mark.parametrize("zero,per_param", [(0, 18.0), (1, 6 + 12 / 8)])
def test_megatron_keeps_fp32_main_grads(zero, per_param):
    (mem,) = memory("megatron", zero_stage=zero)
    assert mem.gradients == pytest.approx(4 * P, rel=1e-9)
    assert mem.parameters + mem.gradients + mem.optimizer == pytest.approx(per_param * P, rel=1e-9)


def test_reference_trainer_keeps_bf16_moments_without_a_master_copy():
    """torch.optim.AdamW on bf16 parameters: 2 + 2 + 4 bytes, the moments sharded by ZeRO-1."""
    (mem,) = memory(None, zero_stage=0)
    assert (mem.parameters, mem.gradients, mem.optimizer) == pytest.approx((2 * P, 2 * P, 4 * P), rel=1e-9)
    (mem,) = memory(None, zero_stage=1)
    assert mem.optimizer == pytest.approx(4 * P / 8, rel=1e-9)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_splits_every_parameter(tp):
    (mem,) = memory("deepspeed", dp=2, tp=tp, zero_stage=0)
    assert mem.parameters == pytest.approx(2 * P / tp, rel=1e-9)
    assert mem.optimizer == pytest.approx(12 * P / tp, rel=1e-9)


def test_pipeline_stages_hold_their_layers_the_embedding_and_the_output_layer():
    """pp 2 over 8 layers, untied: 4 blocks each; the embedding (tokens and positions) on the first
    stage, the final norm and the output projection on the last."""
    mems = memory("megatron", dp=4, pp=2, zero_stage=1)
    h, V, s = MODEL.hidden_size, MODEL.vocab_size, MODEL.seq_length
    block = 4 * h * h + 2 * 4 * h * h + 2 * 2 * h  # attention, MLP, two LayerNorms (no biases)
    assert MODEL.layer_params() == block
    first = 4 * block + V * h + s * h
    last = 4 * block + 2 * h + V * h
    assert first + last == P
    assert mems[0].parameters == pytest.approx(2 * first, rel=1e-9)
    assert mems[1].parameters == pytest.approx(2 * last, rel=1e-9)
    assert mems[0].optimizer == pytest.approx(12 * first / 4, rel=1e-9)
    assert mems[1].gradients == pytest.approx(4 * last, rel=1e-9)


def test_megatron_pads_the_vocabulary_to_128_times_tp():
    """vocab 32768 + 5 padded to 33024 at tp 2 (a multiple of 256): the embedding and the output
    layer grow by 251 rows each."""
    model = dataclasses.replace(MODEL, vocab_size=32773)
    g = dataclasses.replace(A100.node_groups[0], count=1)
    system = System(model, dataclasses.replace(A100, node_groups=(g,)), framework="megatron")
    c = ParallelConfig(dp=4, pp=1, tp=2, micro_batch_size=1, num_micro_batches=4)
    (mem,) = stage_memory(system, c, layout(system, c))
    padded = model.num_params() + 2 * (33024 - 32773) * model.hidden_size
    assert mem.parameters == pytest.approx(2 * padded / 2, rel=1e-9)


def test_capacity_is_the_device_memory_less_the_fragmentation_margin():
    (mem,) = memory("megatron")
    assert mem.capacity == pytest.approx(device_type("a100-80gb").memory_bytes * (1 - 0.05), rel=1e-9)


def test_total_is_the_sum_of_the_terms():
    (mem,) = memory("deepspeed", zero_stage=2)
    assert mem.total == pytest.approx(mem.parameters + mem.gradients + mem.optimizer + mem.activations + mem.other)
    assert mem.activations > 0
