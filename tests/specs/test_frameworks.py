"""autoconf/specs/frameworks.py: each framework's documented defaults and what it refuses.

The expected values are the frameworks' own documented behaviour (cited in the module): Megatron-LM
pads the vocabulary to a multiple of 128 x tp (``--make-vocab-size-divisible-by 128``), keeps an
fp32 main_grad in bf16, has ZeRO-1 (its distributed optimizer) with pipelining; DeepSpeed's
pipeline engine runs 1F1B with ZeRO 0-1; torchtitan's FSDP2 is ZeRO-2/3; gloo's all-reduce is a
ring.
"""

from __future__ import annotations

import pytest

from autoconf.errors import UserError
from autoconf.space.config import ParallelConfig
from autoconf.specs.frameworks import FRAMEWORK_NAMES, GLOO_ALL_REDUCE, framework, hierarchical_runs
from autoconf.specs.topology import GroupLinks


def cfg(**kw) -> ParallelConfig:
    return ParallelConfig(**{"dp": 2, "pp": 1, "tp": 1, "micro_batch_size": 1, "num_micro_batches": 4, **kw})


@pytest.mark.parametrize("vocab,tp,want", [(50257, 1, 50304), (50257, 2, 50432), (50257, 8, 51200),
                                           (32000, 1, 32000), (32000, 4, 32256), (128256, 8, 129024),
                                           (1024, 8, 1024)])
def test_megatron_pads_the_vocabulary_to_a_multiple_of_128_tp(vocab, tp, want):
    got = framework("megatron").padded_vocab(vocab, tp)
    assert got == want
    assert got % (128 * tp) == 0 and 0 <= got - vocab < 128 * tp


@pytest.mark.parametrize("name", ["reference", "torchtitan", "deepspeed"])
def test_the_others_do_not_pad(name):
    assert framework(name).padded_vocab(50257, 8) == 50257


def test_no_name_is_the_reference_trainer_and_an_unknown_one_is_a_user_error():
    assert framework(None).name == "reference"
    assert {framework(n).name for n in FRAMEWORK_NAMES} == set(FRAMEWORK_NAMES)
    with pytest.raises(UserError, match="unknown framework 'nemo'"):
        framework("nemo")
    with pytest.raises(UserError, match="no recipe 'x'"):
        framework("megatron:x")


def test_precision_and_optimizer_defaults():
    meg, ds, tt, ref = (framework(n) for n in ("megatron", "deepspeed", "torchtitan", "reference"))
    assert meg.fp32_grad_buffer_bf16 and not ds.fp32_grad_buffer_bf16 and not tt.fp32_grad_buffer_bf16
    assert meg.master_weights and ds.master_weights and tt.master_weights and not ref.master_weights
    assert meg.grad_buffer_up_front and not ref.grad_buffer_up_front
    assert tt.fsdp_reduce_bytes == 4  # torchtitan reduces in fp32 (mixed_precision_reduce)
    assert ref.optimizer_foreach and not meg.optimizer_foreach


def test_pipeline_runtimes_that_allocate_every_micro_batch_s_buffers():
    # torch.distributed.pipelining (reference trainer, torchtitan) allocates them up front
    assert framework("reference").per_micro_batch_pipeline_buffers
    assert framework("torchtitan").per_micro_batch_pipeline_buffers
    assert not framework("megatron").per_micro_batch_pipeline_buffers
    assert not framework("deepspeed").per_micro_batch_pipeline_buffers


@pytest.mark.parametrize("name,c,why", [
    ("megatron", cfg(pp=2, schedule="gpipe"), "framework megatron has no gpipe schedule; valid: 1f1b, interleaved"),
    ("megatron", cfg(pp=2, zero_stage=2), "framework megatron has no ZeRO-2 with pipelining; valid: 0, 1"),
    ("megatron", cfg(zero_stage=2), "framework megatron has no ZeRO-2; valid: 0, 1, 3"),
    ("deepspeed", cfg(pp=2, schedule="interleaved", virtual_stages=2), "framework deepspeed has no interleaved"),
    ("deepspeed", cfg(pp=2, zero_stage=2), "framework deepspeed has no ZeRO-2 with pipelining; valid: 0, 1"),
    ("torchtitan", cfg(zero_stage=1), "framework torchtitan has no ZeRO-1; valid: 0, 2, 3"),
    ("deepspeed", cfg(cp=2), "framework deepspeed has no context parallelism (cp=2)"),
    ("megatron", cfg(layered_grad_accum=True), "framework megatron has no layered gradient accumulation"),
    ("reference", cfg(overlap_grad_reduce=False), "framework reference cannot switch overlap_grad_reduce"),
    ("megatron", cfg(pp_compression="all", pp=2), "framework megatron has no compressed pipeline gradients"),
    ("megatron", cfg(dp_all_reduce="hierarchical"), "framework megatron has no dp_all_reduce=hierarchical"),
    ("deepspeed", cfg(precision="fp8"), "framework deepspeed has no FP8 recipe tensorwise (no FP8 at all)"),
])
def test_check_refuses_what_the_framework_cannot_run(name, c, why):
    got = framework(name).check(c)
    assert got is not None and got.startswith(why), got


@pytest.mark.parametrize("name,c", [
    ("megatron", cfg(pp=2, schedule="interleaved", virtual_stages=2, zero_stage=1)),
    ("megatron", cfg(zero_stage=3)),
    ("deepspeed", cfg(zero_stage=3)),
    ("torchtitan", cfg(pp=2, schedule="breadth_first", virtual_stages=2, zero_stage=3)),
    ("reference", cfg(pp=2, schedule="gpipe", layered_grad_accum=True, zero_stage=2, dp_all_reduce="hierarchical")),
    ("reference", cfg(overlap_grad_reduce=True)),  # its fixed default, stated: accepted
])
def test_check_accepts_what_the_framework_runs(name, c):
    assert framework(name).check(c) is None


def test_knobs_take_the_framework_s_default_unless_set():
    meg, ref = framework("megatron"), framework("reference")
    assert meg.knob(cfg(), "overlap_grad_reduce") is False  # off by default in Megatron-LM
    assert meg.knob(cfg(overlap_grad_reduce=True), "overlap_grad_reduce") is True
    assert ref.knob(cfg(), "overlap_grad_reduce") is True  # DDP / FSDP2 overlap
    # Megatron-Bridge's recipes overlap the reduction, the gather and TP communication
    bridge = framework("megatron:bridge-0.3")
    assert all(bridge.knob(cfg(), k) for k in ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap"))
    assert bridge.fp8_param_gather and not meg.fp8_param_gather


def test_deepspeed_overlaps_the_reduction_only_with_zero_and_without_pipelining():
    ds = framework("deepspeed")
    assert ds.overlaps_grad_reduce(cfg(zero_stage=1, overlap_grad_reduce=True))
    assert not ds.overlaps_grad_reduce(cfg(zero_stage=0, overlap_grad_reduce=True))
    assert not ds.overlaps_grad_reduce(cfg(pp=2, zero_stage=1, overlap_grad_reduce=True))
    assert not ds.overlaps_grad_reduce(cfg(zero_stage=1))  # overlap_comm off by default
    assert framework("megatron").overlaps_grad_reduce(cfg(pp=2, overlap_grad_reduce=True))


def _links(size, hosts, local):
    return GroupLinks(size=size, num_hosts=hosts, local_size=local, intra_bandwidth_bytes_per_s=1e11,
                      inter_bandwidth_bytes_per_s=1e10, ring_inter_bandwidth_bytes_per_s=1e10,
                      intra_latency_s=1e-6, inter_latency_s=1e-5)


def test_all_reduce_algorithms():
    ref, meg = framework("reference"), framework("megatron")
    even = _links(8, 2, 4)
    assert meg.dp_all_reduce_algorithms(cfg(), even) == ("ring", "tree")  # NCCL picks per call
    assert ref.dp_all_reduce_algorithms(cfg(), even, gloo=True) == GLOO_ALL_REDUCE == ("ring",)
    assert ref.dp_all_reduce_algorithms(cfg(dp_all_reduce="hierarchical"), even) == ("hierarchical",)
    # hosts that do not split evenly (or one host) fall back to the flat all-reduce, as the trainer does
    assert ref.dp_all_reduce_algorithms(cfg(dp_all_reduce="hierarchical"), _links(6, 2, 4)) == ("ring", "tree")
    assert ref.dp_all_reduce_algorithms(cfg(dp_all_reduce="hierarchical"), _links(8, 1, 8), gloo=True) == ("ring",)
    assert hierarchical_runs(even) and not hierarchical_runs(_links(4, 4, 1))


def test_experts_are_split_over_tp_in_megatron_and_whole_elsewhere():
    c = cfg(tp=4)
    assert framework("megatron").expert_split(c) == 4
    assert framework("torchtitan").expert_split(c) == 1
    assert framework("reference").expert_split(c) == 1
    assert framework("megatron").expert_split(cfg(tp=4, expert_tp=1)) == 1


def test_host_syncs():
    meg, ds, ref, tt = (framework(n) for n in ("megatron", "deepspeed", "reference", "torchtitan"))
    # Megatron: every p2p transfer of 1F1B (not interleaved: overlap_p2p_comm), and the loss
    assert meg.synced_passes(4, "1f1b", False, first_chunk=False, last_chunk=False) == (True, True)
    assert meg.synced_passes(4, "1f1b", False, first_chunk=True, last_chunk=False) == (True, False)
    assert meg.synced_passes(4, "interleaved", False, first_chunk=False, last_chunk=True) == (True, False)
    assert meg.synced_passes(4, "interleaved", False, first_chunk=False, last_chunk=False) == (False, False)
    # DeepSpeed before every forward: every backward ends synchronised
    assert ds.synced_passes(1, "1f1b", False, True, True) == (False, True)
    # the reference trainer reads the loss after every backward without pipelining or layering
    assert ref.synced_passes(1, "1f1b", False, True, True) == (False, True)
    assert ref.synced_passes(1, "1f1b", True, True, True) == (False, False)
    assert ref.synced_passes(2, "1f1b", False, True, True) == (False, False)
    assert tt.synced_passes(4, "1f1b", False, False, False) == (False, False)
