"""The annealer (``study.anneal``): deterministic with its seed, never worse than its start, within
its evaluation budget; and the placed search never loses to the placement-blind plan."""

from __future__ import annotations

from autoconf.cost.estimate import estimate_on
from autoconf.cost.system import System
from autoconf.space.config import ParallelConfig
from autoconf.specs.cluster import load_cluster
from autoconf.specs.model import preset
from autoconf.study.anneal import anneal
from autoconf.study.placer import Placer

TWO = load_cluster("examples/clusters/two-kinds.yaml")


def _start():
    ctx = System(preset("gpt3-1.3b"), TWO)
    placer = Placer(ctx, 48)
    c = placer.place(ParallelConfig(dp=8, pp=6, tp=1, micro_batch_size=1, num_micro_batches=6, zero_stage=1))
    return ctx, placer, c


def test_anneal_is_seeded_never_worse_and_within_budget():
    ctx, placer, c = _start()
    start = estimate_on(c, ctx)
    a, na = anneal(placer, c, max_evaluations=40, seed=3)
    b, nb = anneal(Placer(ctx, 48), c, max_evaluations=40, seed=3)
    assert (a.config, a.step_time_s, na) == (b.config, b.step_time_s, nb)  # same seed, same walk
    assert a.fits and a.step_time_s <= start.step_time_s and 1 < na <= 40
    for seed in (0, 1):
        e, n = anneal(placer, c, max_evaluations=25, seed=seed)
        assert e.fits and e.step_time_s <= start.step_time_s and n <= 25


def test_anneal_stops_at_its_deadline():
    _, placer, c = _start()
    _, n = anneal(placer, c, max_evaluations=10_000, deadline=0.0)
    assert n == 1
