"""Host-device synchronisation inside a step (``Framework.host_syncs``): where each framework
makes the host wait, and what a synchronised pass costs (``chunk_time.issue_bound_s``), against
closed forms."""

import dataclasses

import pytest

from autoconf.cost.chunk_time import chunk_times, issue_bound_s, synced_passes
from autoconf.cost.layout import layout
from autoconf.cost.moe import block_for
from autoconf.cost.system import System
from autoconf.cost.tensor_parallel import tp_times
from autoconf.space.config import ParallelConfig
from autoconf.specs.frameworks import FRAMEWORKS
from autoconf.specs.model import ModelSpec


def test_one_segment_takes_the_longer_of_host_and_device():
    assert issue_bound_s([(2.0, 5.0)]) == 5.0
    assert issue_bound_s([(5.0, 2.0)]) == 5.0


def test_late_device_work_cannot_use_the_hosts_earlier_lead():
    # host-bound layers (device 1, host 3), then an output layer heavy on the device (2, 0.5):
    # the device idles while the layers are issued and runs the output layer after them
    assert issue_bound_s([(1.0, 3.0), (2.0, 0.5)]) == pytest.approx(3.0 + 2.0)
    # the same work in the other order hides the device-heavy part behind the host
    assert issue_bound_s([(2.0, 0.5), (1.0, 3.0)]) == pytest.approx(3.5)
    # max(all host, host before k + device from k on) for k = 0, 1, 2
    segs = [(1.0, 0.2), (0.5, 2.0), (3.0, 0.1)]
    assert issue_bound_s(segs) == pytest.approx(max(2.3, 0 + 4.5, 0.2 + 3.5, 2.2 + 3.0))


def test_synced_passes():
    fwd, bwd = (3.0, 3.5), (4.0, 4.0)  # (device, host) of the whole pass
    head = (2.0, 0.5, 1.0, 0.5)  # forward device, host; backward device, host
    assert synced_passes((False, False), fwd, bwd, (None, head)) == (3.5, 4.0)
    f, b = synced_passes((True, True), fwd, bwd, (None, head))
    assert f == pytest.approx(issue_bound_s([(1.0, 3.0), (2.0, 0.5)])) == pytest.approx(5.0)
    assert b == pytest.approx(issue_bound_s([(1.0, 0.5), (3.0, 3.5)])) == pytest.approx(4.0)
    assert synced_passes((False, True), fwd, bwd, (None, head)) == (3.5, b)
    emb = (0.1, 0.2, 0.6, 0.1)  # the first chunk: the embedding's backward comes last
    f, b = synced_passes((True, True), fwd, bwd, (emb, None))
    assert f == pytest.approx(issue_bound_s([(0.1, 0.2), (2.9, 3.3)]))
    assert b == pytest.approx(issue_bound_s([(3.4, 3.9), (0.6, 0.1)])) == pytest.approx(3.9 + 0.6)
    # a synchronised pass is never shorter than the longer of its host and device times
    assert min(f - max(fwd), b - max(bwd)) >= -1e-12


def test_where_each_framework_synchronises():
    meg, ds, ref, tt = (FRAMEWORKS[n] for n in ("megatron", "deepspeed", "reference", "torchtitan"))
    # (pp, schedule, layered, first chunk, last chunk) -> (forward ends synced, backward ends synced)
    assert meg.synced_passes(2, "1f1b", False, True, False) == (True, False)  # batch_p2p_sync; the first
    assert meg.synced_passes(2, "1f1b", False, False, True) == (True, True)  # stage sends no gradient
    assert meg.synced_passes(1, "1f1b", False, True, True) == (True, False)  # the loss check
    assert meg.synced_passes(2, "interleaved", False, False, True) == (True, False)  # overlap_p2p_comm
    assert meg.synced_passes(2, "interleaved", False, True, False) == (False, False)
    assert ds.synced_passes(2, "1f1b", False, False, True) == (False, True)  # sync before each forward
    assert ref.synced_passes(1, "1f1b", False, True, True) == (False, True)  # float(loss) after it
    assert ref.synced_passes(1, "1f1b", True, True, True) == (False, False)
    assert ref.synced_passes(2, "1f1b", False, False, True) == (False, False)
    assert tt.synced_passes(2, "1f1b", False, False, True) == (False, False)


def _cfg(**kw):
    base = {"dp": 1, "pp": 1, "tp": 1, "micro_batch_size": 1, "num_micro_batches": 4}
    return ParallelConfig(**{**base, **kw})


def _a100_node():
    from autoconf.specs.cluster import cluster_from_mapping
    return cluster_from_mapping({"name": "n", "node_groups": [{
        "count": 1, "device": "a100-80gb", "gpus_per_node": 8, "intra_node_bandwidth": "300 GB/s",
        "nics": {"count": 8, "bandwidth": "200 Gbit/s", "kind": "infiniband"}}]})


def test_megatron_pipeline_exposes_the_output_layer_of_a_host_bound_last_stage():
    """A small GPT at micro-batch 1 is host-bound; under Megatron's p2p syncs the last stage's
    forward takes its layers' host time plus the output layer's device time (the output layer's
    own host time being shorter), where without syncs the host's lead over the layers hid it."""
    model = ModelSpec(name="g", num_layers=8, hidden_size=1024, num_attention_heads=16, num_kv_heads=16,
                      ffn_hidden_size=4096, vocab_size=50257, seq_length=1024, dtype="fp16", activation="gelu",
                      norm="layernorm", position_embedding="learned", bias=True, attention="eager")
    c = _cfg(pp=2, schedule="1f1b", recompute="full")
    synced = System(model, _a100_node(), framework=FRAMEWORKS["megatron"])
    free = System(model, _a100_node(), framework=dataclasses.replace(FRAMEWORKS["megatron"], host_syncs=()))
    times = []
    for s in (synced, free):
        lay = layout(s, c)
        times.append(chunk_times(s, c, lay, tp_times(s, c, lay.stage_kinds), 0.0))
    head = synced.edge("a100-80gb", 1, 1, "head")
    assert head.forward_s > head.host_forward_s  # device-heavy
    last_synced, last_free = times[0].forward_s[-1], times[1].forward_s[-1]
    blk = block_for(synced, "a100-80gb", c)
    assert blk.host_forward_s > blk.forward_s  # the layers are host-bound
    layers_host = 4 * blk.host_forward_s
    assert last_free == pytest.approx(layers_host + head.host_forward_s, rel=1e-9)
    assert last_synced == pytest.approx(layers_host + head.forward_s, rel=1e-9)
    # the first stage's forward ends in layers: the same either way
    assert times[0].forward_s[0] == pytest.approx(times[1].forward_s[0], rel=1e-9)


def test_megatron_loss_check_ends_the_forward_without_pipelining():
    """At pp 1 Megatron-LM's loss check ends each forward synchronised: the forward takes its host
    time with the output layer's device time in place of the output layer's host time."""
    model = ModelSpec(name="g", num_layers=8, hidden_size=1024, num_attention_heads=16, num_kv_heads=16,
                      ffn_hidden_size=4096, vocab_size=50257, seq_length=1024, dtype="fp16", activation="gelu",
                      norm="layernorm", position_embedding="learned", bias=True, attention="eager")
    c = _cfg(recompute="full")
    s = System(model, _a100_node(), framework=FRAMEWORKS["megatron"])
    lay = layout(s, c)
    t = chunk_times(s, c, lay, tp_times(s, c, lay.stage_kinds), 0.0)
    blk, emb, head = (block_for(s, "a100-80gb", c), s.edge("a100-80gb", 1, 1, "embedding"),
                      s.edge("a100-80gb", 1, 1, "head"))
    assert head.forward_s > head.host_forward_s and blk.host_forward_s > blk.forward_s
    host_f = 8 * blk.host_forward_s + emb.host_forward_s + head.host_forward_s
    assert t.forward_s[0] == pytest.approx(host_f - head.host_forward_s + head.forward_s, rel=1e-9)
    # the backward ends unsynchronised (no transfer, the loss already checked): host-bound
    host_b = 8 * blk.host_backward_s + emb.host_backward_s + head.host_backward_s
    assert t.backward_s[0] == pytest.approx(host_b, rel=1e-9)
    # DeepSpeed synchronises before each forward instead: its forward leaves the output layer to
    # the backward's issue (host-bound as a whole pass)
    d = System(model, _a100_node(), framework=FRAMEWORKS["deepspeed"])
    lay = layout(d, c)
    t = chunk_times(d, c, lay, tp_times(d, c, lay.stage_kinds), 0.0)
    blk, emb, head = (block_for(d, "a100-80gb", c), d.edge("a100-80gb", 1, 1, "embedding"),
                      d.edge("a100-80gb", 1, 1, "head"))
    host_f = 8 * blk.host_forward_s + emb.host_forward_s + head.host_forward_s
    assert t.forward_s[0] == pytest.approx(host_f, rel=1e-9)
