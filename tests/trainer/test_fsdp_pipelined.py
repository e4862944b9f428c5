"""ZeRO-3 (FSDP2) under pipelining in the reference trainer: how often each unit is gathered and
reduce-scattered per step is what the cost model counts (``space.schedules.fsdp_gathers``), and
with layered accumulation (breadth-first, Lamy-Poirier's arXiv 2106.02679) that is once per chunk
per pass, not once per micro-batch; the losses are 1F1B's."""

from __future__ import annotations

import pytest

from autoconf.launch.plan import LaunchPlan
from autoconf.runs.trial import run_trial
from autoconf.space.config import ParallelConfig, check
from autoconf.space.placement import Placement
from autoconf.space.schedules import fsdp_gathers
from autoconf.specs.model import preset

pytest.importorskip("torch")

TINY = preset("tiny")  # 4 blocks: at pp 2 and v 2, one block per chunk (fully modular)
M = 4


def _cfg(schedule: str, v: int = 1, layered: bool = False) -> ParallelConfig:
    c = ParallelConfig(dp=2, pp=2, tp=1, micro_batch_size=1, num_micro_batches=M, schedule=schedule,
                       virtual_stages=v, layered_grad_accum=layered, zero_stage=3)
    assert check(c, TINY) is None, check(c, TINY)
    return c


def _expected(c: ParallelConfig) -> dict:
    """{unit: [all-gathers, reduce-scatters]} per step, from the cost model's count."""
    counts = fsdp_gathers(c.schedule, c.pp, c.num_micro_batches, c.virtual_stages, c.layered_grad_accum)
    chunks = Placement.of(c, TINY.num_layers).chunk_layers()
    out = {}
    for ci, blocks in enumerate(chunks):
        per = [sum(counts[ci]), 1]
        for b in blocks:
            out[f"blocks.{b}"] = per
        if ci == 0:
            out["embedding"] = per
        if ci == len(chunks) - 1:
            out["head"] = per
    return out


def _run(c: ParallelConfig, tmp_path):
    r = run_trial(LaunchPlan(c, TINY, seed=1234), steps=3, warmup=1, timeout_s=300, out_dir=str(tmp_path))
    assert r.ok, r.reason
    return r


def _counted(r) -> dict:
    """{unit: [all-gathers, reduce-scatters]} of a steady step (the second: the first infers shapes),
    over every rank (each rank holds its own chunks' units)."""
    out: dict = {}
    for rank in r.per_rank:
        for unit, calls in rank["comm_bytes_per_step"][1]["fsdp_calls"].items():
            assert out.setdefault(unit, calls) == calls, (unit, out[unit], calls)  # dp ranks alike
    return out


@pytest.mark.e2e
def test_breadth_first_gathers_each_chunk_once_per_pass_and_trains_as_1f1b(tmp_path):
    bfs, ref = _cfg("breadth_first", v=2, layered=True), _cfg("1f1b")
    got = _run(bfs, tmp_path / "bfs")
    assert _counted(got) == _expected(bfs)
    assert set(map(tuple, _expected(bfs).values())) == {(2, 1)}  # one gather per pass: forward, backward
    base = _run(ref, tmp_path / "1f1b")
    counted = _counted(base)
    assert counted == _expected(ref)
    assert all(ag > 2 for ag, _ in counted.values())  # 1F1B re-gathers between micro-batches
    assert got.losses == pytest.approx(base.losses, rel=1e-6)


@pytest.mark.e2e
@pytest.mark.parametrize("schedule,v,layered", [("gpipe", 1, False), ("gpipe", 1, True), ("interleaved", 2, False)])
def test_each_schedule_gathers_as_the_model_counts(schedule, v, layered, tmp_path):
    c = _cfg(schedule, v, layered)
    assert _counted(_run(c, tmp_path)) == _expected(c)
