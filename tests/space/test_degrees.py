"""Degrees: the parallel degrees, the rank order, and the ranks and groups they make (the one
rank-order arithmetic the cost model and the trainer share), checked against Megatron-Core's."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from autoconf.space.degrees import AXES, Degrees, full_order
from autoconf.space.placement import Placement

ORDERS = ["-".join(p) for p in itertools.permutations(AXES)] + ["tp-dp-pp", "dp-tp-pp", "pp-dp-tp"]
"""Every order of the four axes, and orders written without cp (cp right after tp)."""

SHAPES = [dict(dp=2, pp=3, tp=2, cp=2), dict(dp=3, pp=2, tp=4, cp=1), dict(dp=1, pp=1, tp=1, cp=1),
          dict(dp=4, pp=1, tp=1, cp=2)]


def degrees(order: str, shape: dict, **kw) -> Degrees:
    return Degrees(shape["dp"], shape["pp"], shape["tp"], order, cp=shape["cp"], **kw)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape", SHAPES)
def test_coords_and_rank_of_round_trip(order, shape):
    d = degrees(order, shape)
    seen = set()
    for r in range(d.world_size):
        c = d.coords(r)
        assert all(0 <= c[a] < d.size(a) for a in AXES)
        assert d.rank_of(c) == r
        seen.add(tuple(c[a] for a in AXES))
    assert len(seen) == d.world_size  # every rank its own coordinates


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape", SHAPES)
def test_groups_along_each_axis_partition_the_ranks(order, shape):
    d = degrees(order, shape, ep=2 if shape["dp"] * shape["cp"] % 2 == 0 else 1)
    axes = list(AXES) + [("cp", "dp"), ("tp", "cp", "dp"), "ep", "edp"]
    for axis in axes:
        groups = d.groups(axis)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(d.world_size)), axis
        size = {"ep": d.ep, "edp": d.dp * d.cp // d.ep}.get(axis) or (
            d.size(axis) if isinstance(axis, str) else len(d.groups(axis)[0]))
        assert all(len(g) == size for g in groups), axis
        if isinstance(axis, str) and axis in AXES:  # the ranks differ in that coordinate alone
            for g in groups:
                cs = [d.coords(r) for r in g]
                assert [c[axis] for c in cs] == list(range(len(g)))
                assert all({a: c[a] for a in AXES if a != axis} == {a: cs[0][a] for a in AXES if a != axis}
                           for c in cs)
    assert sorted(r for s in d.stage_ranks() for r in s) == list(range(d.world_size))
    assert d.grad_groups() == (d.groups("dp") if d.cp == 1 else d.groups(("cp", "dp")))


def test_rank_order_tp_innermost_like_megatron():
    d = Degrees(dp=2, pp=2, tp=2, rank_order="tp-dp-pp")
    assert d.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert d.groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert d.groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert d.embedding_groups() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert d.fused_embedding_groups() == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert d.order == ("tp", "dp", "pp")
    d2 = Degrees(dp=2, pp=1, tp=2, rank_order="dp-tp-pp")
    assert d2.groups("dp") == [(0, 1), (2, 3)] and d2.groups("tp") == [(0, 2), (1, 3)]
    assert d2.embedding_groups() == [] and d2.fused_embedding_groups() == []
    with pytest.raises(ValueError, match=r"dp\(2\) \* pp\(1\) \* tp\(2\) \* cp\(1\) = 4 != world_size\(2\)"):
        d2.validate(2)
    with pytest.raises(ValueError, match="rank_order='tp-pp' must order tp, dp, pp"):
        Degrees(1, 1, 1, "tp-pp").validate(1)


def test_a_placement_is_its_degrees_plus_devices_and_layers():
    """The positional fields of a Placement are the ones it always had (dp, pp, tp, rank_order,
    virtual_stages, num_layers, device_order, stage_layers); cp, ep and expert_fold are keywords."""
    p = Placement(2, 2, 2, "dp-tp-pp", 2, 8, None, (1, 3, 2, 2), cp=2, ep=2)
    assert isinstance(p, Degrees) and (p.virtual_stages, p.num_layers, p.stage_layers) == (2, 8, (1, 3, 2, 2))
    d = Degrees(2, 2, 2, "dp-tp-pp", cp=2, ep=2)
    for axis in list(AXES) + ["ep", "edp", ("cp", "dp")]:
        assert p.groups(axis) == d.groups(axis)
    assert p.world_size == d.world_size == 16 and p.coords(5) == d.coords(5)
    with pytest.raises(TypeError):
        Degrees(2, 2, 2, "tp-dp-pp", 2)  # cp by keyword only
    q = dataclasses.replace(p, stage_layers=None)
    assert q.cp == 2 and q.chunk_layer_counts() == [2, 2, 2, 2] and hash(q) == hash(dataclasses.replace(q))


# -- Megatron-Core ----------------------------------------------------------------------------------
# megatron-core 0.16.1, megatron/core/parallel_state.py: ``RankGenerator(tp, ep, dp, pp, cp, order)``
# lists the axes innermost first, as rank_order does; ``initialize_model_parallel`` builds the
# decoder's groups with ``RankGenerator(tp, ep=1, dp, pp, cp, order="tp-cp-ep-dp-pp")`` and the
# experts' with ``RankGenerator(expert_tp, ep, world // (expert_tp * ep * pp), pp, cp=1, order)``.
# Our full order (cp placed) is Megatron's order with ep left out: an axis missing from Megatron's
# order with size 1 is appended, so ep = 1 needs no place.

def megatron_rank_generator():
    ps = pytest.importorskip("megatron.core.parallel_state",
                             reason="megatron-core is not installed (pip install -e '.[megatron]')")
    return ps.RankGenerator


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape", SHAPES)
def test_groups_are_megatron_rank_generators(order, shape):
    RankGenerator = megatron_rank_generator()
    d = degrees(order, shape)
    gen = RankGenerator(tp=d.tp, ep=1, dp=d.dp, pp=d.pp, cp=d.cp, order="-".join(full_order(order)))
    for token, axis in [("tp", "tp"), ("dp", "dp"), ("pp", "pp"), ("cp", "cp"), ("dp-cp", ("cp", "dp")),
                        ("tp-cp", ("tp", "cp")), ("tp-dp-cp", ("tp", "cp", "dp"))]:
        assert [tuple(g) for g in gen.get_ranks(token)] == d.groups(axis), (token, order)


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("shape", [dict(dp=4, pp=2, tp=2, cp=1), dict(dp=2, pp=2, tp=2, cp=2),
                                   dict(dp=8, pp=1, tp=1, cp=1)])
def test_expert_groups_are_megatron_expert_rank_generators(shape, fold):
    """Megatron's own order ("tp-cp-ep-dp-pp", pipeline outermost): the expert-parallel and
    expert-data-parallel groups, with the experts split over tp (expert_tp = tp) or folded
    (expert_tp = 1, MoE parallel folding)."""
    RankGenerator = megatron_rank_generator()
    ep = 4 if fold and shape["dp"] * shape["cp"] < 4 else 2
    d = degrees("tp-cp-dp-pp", shape, ep=ep, expert_fold=fold and shape["tp"] > 1)
    etp = 1 if fold else d.tp
    gen = RankGenerator(tp=etp, ep=ep, dp=d.world_size // (etp * ep * d.pp), pp=d.pp, cp=1,
                        order="tp-cp-ep-dp-pp")
    assert [tuple(g) for g in gen.get_ranks("ep")] == d.groups("ep")
    assert [tuple(g) for g in gen.get_ranks("dp")] == d.groups("edp")
