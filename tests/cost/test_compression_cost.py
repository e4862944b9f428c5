"""Compressed 3D-parallel traffic in the cost model: which sends, how many bytes, what it saves."""

import dataclasses

import pytest

from autoconf.cost.estimate import estimate
from autoconf.cost.pipeline import Compression, simulate
from autoconf.cost.timeline import timeline
from autoconf.errors import UserError
from autoconf.space.compression import compressed_sends, low_rank_elements, powersgd_split, sends_per_chunk
from autoconf.space.config import ParallelConfig, check
from autoconf.specs.cluster import cluster_from_mapping
from autoconf.specs.model import preset


def _cluster(nic: str, nodes: int = 4, gpus: int = 8):
    return cluster_from_mapping({"name": "c", "node_groups": [{
        "count": nodes, "device": "a100-80gb", "gpus_per_node": gpus, "intra_node_bandwidth": "300 GB/s",
        "nics": {"count": 1, "bandwidth": nic, "kind": "ethernet"}}],
        "latency": {"intra_node": "2 us", "inter_node": "20 us"}})


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 4), (4, 2), (8, 16)])
def test_1f1b_epilogue_is_the_last_p_minus_s_sends_of_stage_s(pp, m):
    sends = compressed_sends("1f1b", pp, m, 1, "epilogue")
    want = {(mb, s) for s in range(1, pp) for mb in range(m - min(pp - s, m), m)}
    assert sends == want
    assert sends_per_chunk("1f1b", pp, m, 1, "epilogue") == (0,) + tuple(min(pp - s, m) for s in range(1, pp))


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("breadth_first", 2)])
def test_all_compresses_every_backward_send_and_none_nothing(schedule, v):
    pp, m = 4, 8
    assert compressed_sends(schedule, pp, m, v, "all") == {(mb, c) for c in range(1, pp * v) for mb in range(m)}
    assert compressed_sends(schedule, pp, m, v, "none") == frozenset()
    assert compressed_sends(schedule, 1, m, 1, "all") == frozenset()


def test_epilogue_of_gpipe_and_breadth_first_is_every_send():
    # every backward of these schedules comes after the device's last forward
    for schedule, v in (("gpipe", 1), ("breadth_first", 2)):
        assert compressed_sends(schedule, 4, 8, v, "epilogue") == compressed_sends(schedule, 4, 8, v, "all")


@pytest.mark.parametrize("pp,v,m", [(4, 2, 8), (2, 3, 4), (4, 2, 4)])
def test_interleaved_epilogue_is_the_cool_down_plus_one(pp, v, m):
    # device r: warm-up min((v-1) pp + 2 (pp-1-r), m v) forwards, as many cool-down backwards, plus the
    # backward paired with the last forward; chunk 0's backward sends nothing
    sends = compressed_sends("interleaved", pp, m, v, "epilogue")
    for r in range(pp):
        warmup = min((v - 1) * pp + 2 * (pp - 1 - r), m * v)
        after_last_forward = min(warmup + 1, m * v)
        mine = sum(1 for _mb, c in sends if c % pp == r)
        if r > 0:
            assert mine == after_last_forward
        else:  # less chunk 0's, which send nothing
            assert 0 < mine < after_last_forward


def test_message_sizes_closed_form():
    assert low_rank_elements(4096, 1024, 16) == (4096 + 1024) * 16
    assert low_rank_elements(8, 1024, 16) == (8 + 1024) * 8  # rank capped at min(n, m)
    assert low_rank_elements(1, 1, 16) == 2


def test_powersgd_split_agrees_with_torchs_hook():
    torch = pytest.importorskip("torch")
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress
    shapes = [(1024, 4096), (4096,), (64, 64), (3072, 1024), (50304, 1024), (8, 2, 16), (16, 1024)]
    exact, ps, qs, mats = powersgd_split(shapes, 128)
    want_exact = want_ps = want_qs = 0
    for shape in shapes:
        t = torch.empty(shape)
        n, m = t.view(t.shape[0], -1).shape
        r = min(n, m, 128)
        if _should_compress(n, m, r, 2)[0]:
            want_ps, want_qs = want_ps + n * r, want_qs + m * r
        else:
            want_exact += n * m
    assert (exact, ps, qs) == (want_exact, want_ps, want_qs)
    assert len(mats) == 3


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("breadth_first", 2)])
def test_free_compression_at_the_same_speed_changes_nothing(schedule, v):
    pp, m = 4, 8
    nc = pp * v
    f, b, p2p = [1.0] * nc, [2.0] * nc, [0.5] * (nc - 1)
    plain = simulate(schedule, pp, m, v, f, b, p2p)
    same = simulate(schedule, pp, m, v, f, b, p2p, compression=Compression("all", tuple(p2p), (0.0,) * nc, (0.0,) * nc))
    assert same.makespan_s == pytest.approx(plain.makespan_s)


def test_compressed_transfers_shorten_a_link_bound_pipeline_and_kernels_cost():
    pp, m, nc = 4, 8, 4
    f, b, p2p = [1.0] * nc, [2.0] * nc, [3.0] * (nc - 1)
    plain = simulate("1f1b", pp, m, 1, f, b, p2p).makespan_s
    fast = Compression("all", (0.3,) * 3, (0.0,) * nc, (0.0,) * nc)
    epi = dataclasses.replace(fast, mode="epilogue")
    t_all = simulate("1f1b", pp, m, 1, f, b, p2p, compression=fast).makespan_s
    t_epi = simulate("1f1b", pp, m, 1, f, b, p2p, compression=epi).makespan_s
    assert t_all < t_epi < plain
    # the cool-down alone: stage s's last p - s backward transfers save (3.0 - 0.3) each on the critical path
    costly = dataclasses.replace(fast, send_s=(0.5,) * nc, recv_s=(0.5,) * nc)
    assert simulate("1f1b", pp, m, 1, f, b, p2p, compression=costly).makespan_s > t_all


def _cfg(**kw):
    base = dict(dp=4, pp=4, tp=2, micro_batch_size=1, num_micro_batches=16, zero_stage=1, recompute="full")
    base.update(kw)
    return ParallelConfig(**base)


def test_estimate_pipeline_compression_on_a_slow_link():
    m = preset("gpt3-6.7b")
    slow = _cluster("10 Gbit/s")
    plain = estimate(_cfg(), m, slow)
    epi = estimate(_cfg(pp_compression="epilogue"), m, slow)
    every = estimate(_cfg(pp_compression="all"), m, slow)
    assert every.breakdown_s["pp_comm"] < epi.breakdown_s["pp_comm"] < plain.breakdown_s["pp_comm"]
    assert every.step_time_s < epi.step_time_s < plain.step_time_s
    # what it keeps (stage 1 sends and receives): the residual and the fp32 warm-start Q, the 16 micro-batches'
    # factors it sent in the step, the factors of one it receives
    parts = dict(every.memory_by_stage[1].other_parts)
    n, h, r, eb = m.seq_length, m.hidden_size, 16, m.dtype_bytes
    assert eb == 2
    assert parts["compression residuals"] == pytest.approx(n * h * eb + h * r * 4 + (16 + 1) * (n + h) * r * eb)
    assert "compression residuals" not in dict(plain.memory_by_stage[1].other_parts)


def test_estimate_dp_compression_where_the_reduction_crosses_slow_nics():
    m = preset("gpt3-6.7b")
    slow = _cluster("10 Gbit/s")
    kw = dict(rank_order="tp-pp-dp")  # dp across the nodes' single NIC
    plain = estimate(_cfg(**kw), m, slow)
    all_stages = estimate(_cfg(dp_compression_stages=4, **kw), m, slow)
    assert all_stages.breakdown_s["dp_comm"] < 0.5 * plain.breakdown_s["dp_comm"]
    assert all_stages.breakdown_s["compute"] == plain.breakdown_s["compute"]
    # error feedback: one more copy of the gradients, and a bucket copy
    grow = all_stages.memory_by_stage[0].total - plain.memory_by_stage[0].total
    assert grow == pytest.approx(dict(all_stages.memory_by_stage[0].other_parts)["powersgd error feedback"])
    # on NVLink the compression kernels are not worth it
    fast = _cluster("1600 Gbit/s")
    assert estimate(_cfg(dp_compression_stages=4), m, fast).step_time_s >= estimate(_cfg(), m, fast).step_time_s


def test_fused_embedding_sync_is_one_all_reduce_after_the_pipeline():
    from autoconf.cost.compression import embedding_sync_s
    from autoconf.cost.system import System
    m = preset("gpt2-medium")  # tied embeddings
    assert m.tied_embeddings
    slow = _cluster("10 Gbit/s", nodes=2, gpus=4)
    ctx = System(m, slow)
    for order, fused_wins in (("tp-pp-dp", True), ("tp-dp-pp", False)):
        c = ParallelConfig(dp=2, pp=4, tp=1, micro_batch_size=1, num_micro_batches=8, rank_order=order)
        fc = dataclasses.replace(c, fused_embedding_sync=True)
        # tp-pp-dp: first and last stage share a node, the replicas do not: the first/last sum (fast), then
        # the replicas' reduction (slow), against one all-reduce over 4 ranks; tp-dp-pp: first and last stage
        # on different nodes, the replicas on one: fusing puts the replicas' reduction on the slow link too
        beside, after = embedding_sync_s(ctx, c)
        f_beside, f_after = embedding_sync_s(ctx, fc)
        assert after > 0 and f_after == 0
        assert (f_beside < beside + after) == fused_wins
        plain, fused = estimate(c, m, slow), estimate(fc, m, slow)
        assert fused.breakdown_s["compute"] == plain.breakdown_s["compute"]
        assert plain.breakdown_s["dp_comm"] >= beside + after  # the copies' own reduction follows the rest
        if fused_wins:
            assert fused.step_time_s < plain.step_time_s
    # a framework that reduces the copies in its buckets all-reduces them once more between each
    # replica's first and last stage, after the pipeline: Megatron on its fp32 main gradients of the
    # padded vocabulary, DeepSpeed on its bf16 copy
    from autoconf.cost import comm
    from autoconf.cost.groups import collective_s
    c = ParallelConfig(dp=2, pp=4, tp=1, micro_batch_size=1, num_micro_batches=8, rank_order="tp-pp-dp")
    pair = ctx.topology.group_links((0, 3))  # replica 0's first and last stage, on one node
    for fw, grad_bytes, vocab in (("megatron", 4, 50304), ("deepspeed", 2, m.vocab_size)):
        sys_ = System(m, slow, framework=fw)
        assert sys_.policy.grad_bytes == grad_bytes
        nbytes = vocab * m.hidden_size * grad_bytes
        assert embedding_sync_s(sys_, c) == (0.0, pytest.approx(collective_s(sys_, [pair], comm.all_reduce_s, 2, nbytes)))
    assert embedding_sync_s(System(m, slow, framework="megatron"), dataclasses.replace(c, pp=1, dp=8)) == (0, 0)
    assert embedding_sync_s(System(m, slow, framework="torchtitan"), c) == (0, 0)  # pipelining has no such step


def test_distinct_costs_land_on_the_right_sends():
    """1F1B pp 2, m 2, every send compressed: stage 1 sends B(0), B(1) compressed to stage 0; chunk 1's
    backward carries the send kernel, chunk 0's the receive kernel, the link the compressed time."""
    f, b = (1.0, 1.0), (2.0, 2.0)
    z = Compression("all", (0.25,), (0.0, 0.125), (0.5, 0.0))
    tl = timeline("1f1b", 2, 2, 1, f, b, (4.0,), compression=z)
    grads = [t for t in tl.transfers if t.kind == "gradient"]
    assert len(grads) == 2 and all(t.end_s - t.start_s == pytest.approx(0.25) for t in grads)
    back = {(o.micro_batch, o.chunk): o.end_s - o.start_s for o in tl.ops if o.kind == "B"}
    assert back == {(0, 1): pytest.approx(2.125), (1, 1): pytest.approx(2.125),
                    (0, 0): pytest.approx(2.5), (1, 0): pytest.approx(2.5)}
    acts = [t for t in tl.transfers if t.kind == "activation"]
    assert all(t.end_s - t.start_s == pytest.approx(4.0) for t in acts)  # forward never compressed
    epi = timeline("1f1b", 2, 2, 1, f, b, (4.0,), compression=dataclasses.replace(z, mode="epilogue"))
    assert sorted(round(t.end_s - t.start_s, 6) for t in epi.transfers if t.kind == "gradient") == [0.25, 4.0]


def test_block_shapes_are_the_trainers_parameters():
    torch = pytest.importorskip("torch")
    from autoconf.space.compression import block_shapes
    from autoconf.trainer import layers as gpt
    for name in ("tiny", "gpt2", "llama-2-7b"):
        m = dataclasses.replace(preset(name), num_layers=1)
        if m.hidden_size > 1024:
            m = dataclasses.replace(m, hidden_size=256, num_attention_heads=4, num_kv_heads=4, ffn_hidden_size=688,
                                    head_dim=None)
        block = gpt.Block(m, dtype=torch.float32)
        assert sorted(tuple(p.shape) for p in block.parameters()) == sorted(block_shapes(m, 1)), name


def test_validity_and_frameworks():
    m, tied = preset("gpt3-1.3b"), preset("gpt2")
    assert "pp=1" in check(ParallelConfig(2, 1, 1, 1, 4, pp_compression="all"), m)
    assert "zero_stage" in check(ParallelConfig(2, 2, 1, 1, 4, zero_stage=2, dp_compression_stages=1), m)
    assert "from 0 to pp" in check(ParallelConfig(2, 2, 1, 1, 4, dp_compression_stages=3), m)
    assert "dp=1" in check(ParallelConfig(1, 2, 1, 1, 4, dp_compression_stages=1), m)
    assert check(ParallelConfig(2, 2, 1, 1, 4, fused_embedding_sync=True), tied) is None
    with pytest.raises(UserError, match="framework megatron has no compressed pipeline gradients"):
        estimate(ParallelConfig(2, 2, 1, 1, 4, pp_compression="all"), m, _cluster("10 Gbit/s"),
                 framework="megatron")
    c = ParallelConfig(2, 2, 1, 1, 4, pp_compression="epilogue", pp_compression_rank=8)
    assert ParallelConfig.from_dict(c.to_dict()) == c
    assert "pp_compression" not in ParallelConfig(2, 2, 1, 1, 4).to_dict()


def test_search_picks_compression_on_a_slow_link_only():
    from autoconf.study.search import search
    m = preset("gpt3-1.3b")
    kw = dict(top=3, storage=None, allow_compression=True, place=False, pp_compression_rank=8, dp_compression_rank=64)
    slow = search(m, _cluster("1 Gbit/s", nodes=2, gpus=4), 32, **kw)
    best = slow.top[0].config
    assert best.compressed, best.short()
    for e in slow.top:  # the user's ranks, not the defaults
        if e.config.pp_compression != "none":
            assert e.config.pp_compression_rank == 8
        if e.config.dp_compression_stages:
            assert e.config.dp_compression_rank == 64
    assert any("compresses its traffic" in n and "saved" in n for n in slow.notes)
    assert any("change the numerics" in n for n in slow.notes)
    plain = search(m, _cluster("1 Gbit/s", nodes=2, gpus=4), 32, top=1, storage=None, place=False)
    assert not plain.top[0].config.compressed
    assert slow.top[0].step_time_s < plain.top[0].step_time_s
    fast = search(m, _cluster("1600 Gbit/s", nodes=2, gpus=4), 32, **kw)
    assert not fast.top[0].config.compressed, fast.top[0].config.short()
    with pytest.raises(UserError, match="--allow-compression: framework megatron"):
        search(m, _cluster("1 Gbit/s", nodes=2, gpus=4), 32, framework="megatron", **kw)


@pytest.mark.parametrize("argv,needle", [
    (["estimate", "--dp", "2", "--pp", "2", "--dp-compression-stages", "3"], "dp_compression_stages=3 must be an integer"),
    (["estimate", "--dp", "2", "--pp", "1", "--pp-compression", "all"], "pp=1 has none"),
    (["estimate", "--dp", "2", "--pp", "2", "--pp-compression", "most"], "invalid choice: 'most'"),
    (["estimate", "--dp", "2", "--pp", "2", "--pp-compression-rank", "0"], "--pp-compression-rank"),
    (["search", "--storage", "none", "--allow-compression", "--framework", "megatron"],
     "--allow-compression: framework megatron"),
])
def test_cli_refuses_bad_compression_in_one_line(argv, needle, tmp_path):
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    argv = argv + ["--model", "gpt2", "--cluster", os.path.join(root, "examples/clusters/a100-4x8.yaml"),
                   "--global-batch", "16"]
    out = subprocess.run([sys.executable, "-m", "autoconf", *argv], capture_output=True, text=True, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=root), timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert os.listdir(tmp_path) == []
