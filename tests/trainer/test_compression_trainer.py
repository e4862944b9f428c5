"""Compressed 3D-parallel traffic in the reference trainer (Optimus-CC): the low-rank compressor and
its lazy error propagation, then real torchrun runs (CPU, gloo) with compressed pipeline backward
sends, PowerSGD on the data-parallel gradients and the fused embedding sync, the bytes each rank
counts against their closed forms (``autoconf.cost.compression``); and ``--data-file`` batches."""

from __future__ import annotations

import dataclasses
import math

import pytest

torch = pytest.importorskip("torch")

from test_trainer import SEED, TINY, TINY_TIED, cfg, trial_matches_single_process  # noqa: E402

from autoconf.launch.plan import LaunchPlan  # noqa: E402
from autoconf.runs.trial import run_trial  # noqa: E402
from autoconf.space.compression import compressed_sends, low_rank_elements, powersgd_split  # noqa: E402
from autoconf.space.config import check  # noqa: E402
from autoconf.trainer.compression import LowRankSender, reconstruct  # noqa: E402

STEPS = 4
F32 = 4  # bytes per value of the tiny model (fp32)


# -- unit: the compressor ---------------------------------------------------------------------------

def _low_rank_plus_noise(n=48, m=32, true_rank=6, noise=1e-2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, true_rank, generator=g) @ torch.randn(true_rank, m, generator=g) \
        + noise * torch.randn(n, m, generator=g)


def _round_trip_error(mat, rank: int, iters: int = 1) -> float:
    s = LowRankSender(rank, seed=1)
    for _ in range(iters):  # warm start: repeated sends of one matrix refine Q
        s.residual = None
        p, q = s.compress(mat)
    return float((reconstruct(p, q) - mat).norm() / mat.norm())


def test_round_trip_error_shrinks_with_rank_and_is_exact_at_full_rank():
    mat = _low_rank_plus_noise()
    errs = [_round_trip_error(mat, r, iters=3) for r in (1, 2, 4, 6, 8)]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert errs[-2] < 0.05  # rank 6 captures the rank-6 signal: only noise is left
    assert _round_trip_error(mat, 32) < 1e-5  # full rank (min(n, m)): exact to fp32 rounding
    p, q = LowRankSender(16).compress(mat)
    assert p.shape == (48, 16) and q.shape == (32, 16) and p.is_contiguous() and q.is_contiguous()
    assert p.numel() + q.numel() == low_rank_elements(48, 32, 16)


def test_factors_keep_the_gradient_dtype():
    g = torch.randn(2, 8, 16, dtype=torch.bfloat16)
    p, q = LowRankSender(4).compress(g)
    assert p.dtype == q.dtype == torch.bfloat16 and p.shape == (16, 4) and q.shape == (16, 4)


def test_lazy_error_propagation_running_sums_converge():
    """Messages (decompressed or exact, residual carried) sum to the exact gradients' sum minus the
    final residual; the running sums' relative error shrinks with the number of messages."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(64, 48, generator=g, dtype=torch.float64)
    s = LowRankSender(2, seed=0)
    exact_sum = torch.zeros_like(base)
    sent_sum = torch.zeros_like(base)
    rel, worst = [], 0.0
    for i in range(200):
        grad = base + 0.3 * torch.randn(64, 48, generator=g, dtype=torch.float64)
        exact_sum += grad
        if i % 5 == 4:  # every fifth message goes exactly (with the residual added)
            sent_sum += s.exact(grad)
        else:
            sent_sum += reconstruct(*s.compress(grad))
        carried = s.residual if s.residual is not None else torch.zeros_like(base)
        worst = max(worst, float((sent_sum + carried - exact_sum).abs().max()))
        if i % 5 != 4:  # after a compressed message: off by the carried residual only
            rel.append(float((sent_sum - exact_sum).norm() / exact_sum.norm()))
    assert worst < 1e-10, worst  # sum of messages + carried residual == sum of exact gradients
    assert rel[-1] < rel[4] / 5 and rel[-1] < 0.03, (rel[4], rel[-1])


# -- end to end ---------------------------------------------------------------------------------------

_RUNS: dict = {}


def _run(model, config, tmp_path, name: str, **kw):
    assert check(config, model) is None, check(config, model)
    key = (model.name, config, tuple(sorted(kw.items())))
    if key not in _RUNS:
        r = run_trial(LaunchPlan(config, model, seed=SEED), steps=STEPS, warmup=1, timeout_s=180,
                      out_dir=str(tmp_path / name), **kw)
        assert r.ok, r.reason
        _RUNS[key] = r
    return _RUNS[key]


def _by_rank(result) -> dict:
    return {r["rank"]: r for r in result.per_rank}


def _pp_bytes_closed_form(config, model, pp_rank: int, peer_pp_rank: int, direction: str) -> int:
    """Bytes a pipeline rank sends one peer in a step: activations n x m exact forward; gradients
    (n + m) r when (micro-batch, chunk) is compressed, else n x m (tp = cp = 1)."""
    n, m = config.micro_batch_size * model.seq_length, model.hidden_size
    sends = compressed_sends(config.schedule, config.pp, config.num_micro_batches, config.virtual_stages,
                             config.pp_compression)
    chunks = [pp_rank + k * config.pp for k in range(config.virtual_stages)]
    total = 0
    for c in chunks:
        target = c + 1 if direction == "forward" else c - 1
        if not 0 <= target < config.num_chunks or target % config.pp != peer_pp_rank:
            continue
        for mb in range(config.num_micro_batches):
            if direction == "backward" and (mb, c) in sends:
                total += low_rank_elements(n, m, config.pp_compression_rank) * F32
            else:
                total += n * m * F32
    return total


def _check_model_bytes(result, config, model):
    """The cost model's bytes per step (``compression.step_bytes``) are what each rank counted."""
    from autoconf.cost.compression import step_bytes
    from autoconf.cost.layout import layout
    from autoconf.cost.system import System
    from autoconf.specs.cluster import cluster_from_mapping

    cluster = cluster_from_mapping({"name": "cpu", "node_groups": [{
        "count": 1, "device": "cpu", "gpus_per_node": config.world_size, "intra_node_bandwidth": "4 GB/s",
        "memory": "4 GiB", "nics": {"count": 1, "bandwidth": "1 Gbit/s", "kind": "loopback"}}]})
    ctx = System(model, cluster)
    want = step_bytes(ctx, config, layout(ctx, config))
    for r in result.per_rank:
        got, pred = r["comm_bytes"], want[r["coords"]["pp"]]
        assert sum(p["forward"] for p in got["pp_send"].values()) == pred["forward"], (got, pred)
        assert sum(p["backward"] for p in got["pp_send"].values()) == pred["backward"], (got, pred)
        assert got["dp_payload"] == pred["dp_payload"], (got, pred)
        assert got["embedding_payload"] == pred["embedding_payload"], (got, pred)


def _check_pp_bytes(result, config, model):
    for rank, r in _by_rank(result).items():  # dp = tp = 1: global rank = pipeline rank
        cb = r["comm_bytes"]
        peers = {int(p) for p in cb["pp_send"]}
        assert peers <= {(rank + 1) % config.pp, (rank - 1) % config.pp}
        for peer, per in cb["pp_send"].items():
            for direction in ("forward", "backward"):
                assert per[direction] == _pp_bytes_closed_form(config, model, rank, int(peer), direction), \
                    (rank, peer, direction, per)
        assert r["comm_bytes_per_step"][-1] == cb and len(r["comm_bytes_per_step"]) == STEPS


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["epilogue", "all"])
def test_pp2_1f1b_compressed_backward(mode, tmp_path):
    plain_cfg = cfg(pp=2, mbs=2, schedule="1f1b")
    config = dataclasses.replace(plain_cfg, pp_compression=mode)
    plain = _run(TINY, plain_cfg, tmp_path, "plain")
    res = _run(TINY, config, tmp_path, mode)
    assert res.losses[0] == plain.losses[0]  # the first forward is untouched
    assert all(math.isfinite(v) for v in res.losses)
    assert res.losses == pytest.approx(plain.losses, abs=2e-2)
    if mode == "all":
        assert res.losses[1:] != plain.losses[1:]  # lossy: it did change the numerics
    _check_pp_bytes(res, config, TINY)
    _check_model_bytes(res, config, TINY)
    sends = compressed_sends("1f1b", 2, config.num_micro_batches, 1, mode)
    n, m = 2 * TINY.seq_length, TINY.hidden_size
    back = _by_rank(res)[1]["comm_bytes"]["pp_send"]["0"]["backward"]
    assert back == len(sends) * (n + m) * 16 * F32 + (config.num_micro_batches - len(sends)) * n * m * F32


@pytest.mark.e2e
def test_pp2_interleaved_v2_all_compressed(tmp_path):
    config = cfg(pp=2, mbs=2, schedule="interleaved", virtual_stages=2, pp_compression="all", pp_compression_rank=8)
    plain = _run(TINY, cfg(pp=2, mbs=2, schedule="1f1b"), tmp_path, "plain")  # same model, same first forward
    res = _run(TINY, config, tmp_path, "interleaved")
    assert res.losses[0] == pytest.approx(plain.losses[0], rel=1e-6)
    assert res.losses == pytest.approx(plain.losses, abs=2e-2)
    _check_pp_bytes(res, config, TINY)
    _check_model_bytes(res, config, TINY)


def _stage_shapes(model, config, pp_rank: int) -> list:
    from autoconf.trainer import layers as gpt
    from autoconf.trainer.run import chunk_layers

    layers = chunk_layers(model, config)
    n = config.num_chunks
    shapes = []
    for c in range(pp_rank, n, config.pp):
        stage = gpt.build_stage(model, layers[c], c == 0, c == n - 1, dtype=torch.float32)
        shapes += [tuple(p.shape) for p in stage.parameters()]
    return shapes


@pytest.mark.e2e
@pytest.mark.parametrize("pp,model", [(1, TINY), (2, TINY_TIED)], ids=["pp1", "pp2-tied"])
def test_dp2_powersgd_payload(pp, model, tmp_path):
    """dp_compression_stages=1: pipeline rank 0 runs torch's PowerSGD (plain all-reduces for two
    steps, then the exact part + Ps + Qs of ``powersgd_split``); other pipeline ranks all-reduce
    exactly, and so does every rank its tied embedding (its own bucket, after the pipeline)."""
    rank = 4
    config = cfg(dp=2, pp=pp, mbs=2, dp_compression_stages=1, dp_compression_rank=rank)
    res = _run(model, config, tmp_path, f"dpc-pp{pp}")
    assert all(math.isfinite(v) for v in res.losses)
    plain = _run(model, cfg(dp=2, pp=pp, mbs=2), tmp_path, f"dp-pp{pp}")
    assert res.losses[:2] == pytest.approx(plain.losses[:2], rel=1e-6)  # plain all-reduces first
    assert res.losses == pytest.approx(plain.losses, abs=2e-2)
    tied = model.vocab_size * model.hidden_size if model.tied_embeddings and pp > 1 else 0
    for r in res.per_rank:
        pp_rank = r["coords"]["pp"]
        shapes = _stage_shapes(model, config, pp_rank)
        if tied:
            shapes.remove((model.vocab_size, model.hidden_size))
        full = sum(math.prod(s) for s in shapes) * F32 + tied * F32
        exact, ps, qs, mats = powersgd_split(shapes, rank)
        assert mats, "nothing compressible at this rank: the test would prove nothing"
        per_step = [s["dp_payload"] for s in r["comm_bytes_per_step"]]
        if pp_rank == 0:
            assert per_step == [full, full] + [(exact + ps + qs + tied) * F32] * (STEPS - 2), (per_step, full)
        else:
            assert per_step == [full] * STEPS
    _check_model_bytes(res, config, model)


@pytest.mark.e2e
def test_fused_embedding_sync_is_lossless(tmp_path):
    config = cfg(dp=2, pp=2, mbs=1, schedule="1f1b", fused_embedding_sync=True)
    res = trial_matches_single_process(TINY_TIED, config, tmp_path)
    v, h = TINY_TIED.vocab_size, TINY_TIED.hidden_size
    for r in res.per_rank:
        # first and last stage each hand the tied weight to the one fused all-reduce, nothing else
        assert r["comm_bytes"]["embedding_payload"] == v * h * F32
        full = sum(math.prod(s) for s in _stage_shapes(TINY_TIED, config, r["coords"]["pp"])) * F32
        assert r["comm_bytes"]["dp_payload"] == full - v * h * F32
    _check_model_bytes(res, config, TINY_TIED)


@pytest.mark.e2e
def test_zero2_bytes_every_micro_batch_as_the_model_counts(tmp_path):
    config = cfg(dp=2, pp=2, mbs=1, schedule="1f1b", zero_stage=2, pp_compression="epilogue")
    res = _run(TINY, config, tmp_path, "zero2")
    assert all(math.isfinite(v) for v in res.losses)
    _check_model_bytes(res, config, TINY)


# -- --data-file ----------------------------------------------------------------------------------------

def _byte_file(tmp_path, n=300):
    path = tmp_path / "bytes.bin"
    path.write_bytes(bytes((7 * i + 3) % 256 for i in range(n)))
    return path


def test_data_file_batches_are_the_files_bytes_whatever_the_split(tmp_path):
    from autoconf.trainer import data

    path = _byte_file(tmp_path)
    raw = path.read_bytes()
    tokens = data.load_bytes(str(path))
    x, y = data.file_batch(5, 8, 16, SEED, tokens)
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        window = bytes(row_x + row_y[-1:])
        assert window in raw and row_x[1:] == row_y[:-1]
    for dp in (1, 2, 4):
        parts = [data.replica_batch(5, 8, 16, TINY.vocab_size, SEED, r, dp, tokens) for r in range(dp)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
    assert not torch.equal(data.file_batch(6, 8, 16, SEED, tokens)[0], x)  # a new draw every step


def test_data_file_refusals(tmp_path):
    from types import SimpleNamespace

    from autoconf.trainer.run import TrainerError, token_data

    path = _byte_file(tmp_path, n=20)
    with pytest.raises(TrainerError, match="vocab_size=100 must be >= 256"):
        token_data(SimpleNamespace(data_file=str(path)), dataclasses.replace(TINY, vocab_size=100))
    with pytest.raises(TrainerError, match="20 bytes"):
        token_data(SimpleNamespace(data_file=str(path)), TINY)  # shorter than seq_length + 1
    assert token_data(SimpleNamespace(data_file=None), TINY) is None


@pytest.mark.e2e
def test_data_file_trains_the_same_whatever_the_dp_split(tmp_path):
    path = _byte_file(tmp_path, n=4096)
    one = _run(TINY, cfg(mbs=2), tmp_path, "file-dp1", data_file=str(path))
    two = _run(TINY, cfg(dp=2, mbs=2), tmp_path, "file-dp2", data_file=str(path))
    assert one.losses == pytest.approx(two.losses, rel=1e-5)
    assert all(math.isfinite(v) for v in one.losses)
