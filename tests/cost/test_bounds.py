"""``cost.bounds``: every floor is a lower bound of what ``cost.estimate`` computes, and a tight
one where its term dominates the step (more than half of it: a floor off by 2x would fail)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autoconf.cost import bounds
from autoconf.cost.calibration import Calibration
from autoconf.cost.chunk_time import chunk_times, optimizer_step_s
from autoconf.cost.context_parallel import cp_times
from autoconf.cost.estimate import estimate
from autoconf.cost.layout import chunk_params, layout
from autoconf.cost.schedule_time import boundary_bytes, p2p_times, pipeline_floor, sharing
from autoconf.cost.system import System
from autoconf.cost.tensor_parallel import tp_times
from autoconf.space.config import ParallelConfig
from autoconf.space.placement import even_layers
from autoconf.specs.cluster import cluster_from_mapping, load_cluster
from autoconf.specs.model import preset

A100 = load_cluster("examples/clusters/a100-4x8.yaml")
# four nodes of 8 A100s on one 25 Gbit/s Ethernet NIC each: the data-parallel traffic dominates
SLOW = cluster_from_mapping({"name": "a100-4x8-25gbe", "node_groups": [
    {"count": 4, "device": "a100-80gb", "gpus_per_node": 8, "intra_node_bandwidth": "300 GB/s",
     "nics": {"count": 1, "bandwidth": "25 Gbit/s"}}]})
GPT = preset("gpt3-1.3b")
LLAMA = preset("llama-3-8b")
BF16 = ("bf16", "tensorwise")


def cfg(**kw) -> ParallelConfig:
    base = dict(dp=4, pp=2, tp=4, micro_batch_size=1, num_micro_batches=16)
    base.update(kw)
    return ParallelConfig(**base)


def point_of(c: ParallelConfig) -> tuple:
    return (c.dp, c.pp, c.tp, c.micro_batch_size, c.schedule, c.virtual_stages, c.layered_grad_accum, c.cp)


def floors(system: System, c: ParallelConfig) -> dict:
    """Every floor of ``cost.bounds`` for the one configuration ``c`` (its own ZeRO stage, the
    flat all-reduce, the framework's default knobs)."""
    kinds = sorted(set(system.topology.kind_of))
    point, m, zeros = point_of(c), c.num_micro_batches, (c.zero_stage,)
    dp, pp, tp, mbs, sched, v, layered, cp = point
    one = ParallelConfig(dp=1, pp=1, tp=tp, micro_batch_size=mbs, num_micro_batches=1, recompute=c.recompute,
                         sequence_parallel=c.sequence_parallel, cp=cp)
    row = bounds.block_floor(system, one, kinds, (False,), None)
    chunks = bounds.chunk_rows(system.model.num_layers, pp, v, bounds.edge_floors(system, kinds, mbs, tp, cp),
                               bounds.even_chunk_experts(system, pp, tp, v)[0])
    stage = bounds.stage_params(system, pp, tp, v)
    mem = bounds.memory_floors(system, point, m, [row[6]], zeros, stage, bounds.live_sets(system, sched, pp, m, v,
                                                                                          layered), kinds)
    opt = bounds.optimizer_floors(system, point, kinds, stage[0], zeros)
    p2p = None
    if pp > 1:
        link = dataclasses.replace(one, dp=dp, pp=pp)
        p2p = [np.array(p2p_times(system, link, boundary_bytes(system, link)))]
    red = [(0.0, [0.0] * pp, [0.0] * pp, [0.0] * pp)]
    if dp * cp > 1:
        params = chunk_params(system, ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1,
                                                     virtual_stages=v), even_layers(system.model.num_layers, pp * v))
        red = [bounds.reduction_floors(system, point, kinds, params, False, BF16)[c.zero_stage]]
    queued = bounds.reduction_queues(system, point, zeros, red)
    got = bounds.time_floors(point, m, chunks, [row[:6]], p2p=p2p, reductions=queued)
    time, tails = got if queued is not None else (got, None)
    step = bounds.step_floors(system, point, m, zeros, time, red, opt, tails)[0][0]
    return {"time": float(time[0]), "memory": float(mem[0][0]), "optimizer": float(opt[0]), "reductions": red[0][0],
            "micro_batch_dp": bounds.micro_batch_dp_floor(system, point, m, c.zero_stage, red[0][1], red[0][2]),
            "step": step}


CASES = [  # (model, cluster, configuration, the floors besides memory and optimizer more than half their term)
    (GPT, A100, cfg(), ("time", "step")),
    (GPT, A100, cfg(dp=8, pp=4, tp=1, num_micro_batches=32, schedule="interleaved", virtual_stages=2),
     ("time", "step")),
    (LLAMA, A100, cfg(dp=2, pp=4, tp=4, num_micro_batches=8, recompute="full", sequence_parallel=True),
     ("time", "step")),
    (LLAMA, A100, cfg(dp=32, pp=1, tp=1, num_micro_batches=1, zero_stage=3), ("time", "step")),
    (GPT, A100, cfg(dp=1, pp=1, tp=8, micro_batch_size=4, num_micro_batches=4), ("time", "step")),
    (GPT, A100, cfg(dp=8, pp=1, tp=4, num_micro_batches=1, zero_stage=1), ("time", "step")),
    (GPT, SLOW, cfg(dp=32, pp=1, tp=1, num_micro_batches=2), ("reductions", "step")),
    (GPT, SLOW, cfg(dp=32, pp=1, tp=1, num_micro_batches=8, zero_stage=3), ("micro_batch_dp", "step")),
]


@pytest.mark.parametrize("model,cluster,c,tight", CASES)
def test_each_floor_is_a_tight_lower_bound(model, cluster, c, tight):
    """Each floor at most its term of the estimate: the step time, the peak memory, the optimizer
    step; the data-parallel floors dominate where one 25 Gbit/s NIC serves eight GPUs."""
    system = System(model, cluster)
    e = estimate(c, model, cluster, ctx=system)
    got = floors(system, c)
    whole = {"time": e.step_time_s, "memory": e.peak_memory_bytes, "optimizer": e.breakdown_s["optimizer"],
             "reductions": e.step_time_s, "micro_batch_dp": e.step_time_s, "step": e.step_time_s}
    for k, x in got.items():
        assert x <= whole[k] * (1 + 1e-9), (k, x, whole[k])
    for k in ("memory", "optimizer") + tight:
        assert got[k] > 0.5 * whole[k], (k, got[k], whole[k])


@pytest.mark.parametrize("calibration", [None, Calibration(factors={"compute": 1.1, "bubble": 0.8, "optimizer": 1.2})])
@pytest.mark.parametrize("c", [cfg(), cfg(dp=8, pp=4, tp=1, num_micro_batches=32, schedule="interleaved",
                                          virtual_stages=2), cfg(dp=2, pp=1, tp=4, num_micro_batches=4, zero_stage=2)])
def test_the_estimates_lower_bound(c, calibration):
    """``lower_bound``, the pipeline floor plus the optimizer step (with the calibration's
    factors), is at most the estimated step and more than half of it."""
    system = System(GPT, A100, calibration=calibration)
    lay = layout(system, c)
    ct = chunk_times(system, c, lay, tp_times(system, c, lay.stage_kinds), system.pipeline_runtime(c, lay.stage_kinds),
                     cp_times(system, c, lay.stage_kinds))
    floor = pipeline_floor(c, ct.forward_s, ct.backward_s, lay.num_chunks, sharing(system, lay, ct))
    lb = bounds.lower_bound(system, floor, optimizer_step_s(system, c, lay))
    step = estimate(c, GPT, A100, ctx=system).step_time_s
    assert 0.5 * step < lb <= step * (1 + 1e-9)
