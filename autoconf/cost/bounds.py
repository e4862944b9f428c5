"""Lower bounds on what ``cost.estimate`` computes, cheaper than an estimate: they let the search
(``estimate_on(..., bound=)``) and the time-to-train planner (``timetotrain.optimiser``) skip
configurations that cannot win without simulating their schedule.

Each function here is a pure function of the ``System`` and the data of an outer point or a
configuration, and each docstring says why it is at most what the estimate computes (the tests
check them against it: ``tests/cost/test_bounds.py``, ``tests/timetotrain``). An outer point is
``space.enumeration``'s tuple (dp, pp, tp, micro-batch size, schedule, v, layered, cp).

- :func:`lower_bound`: one configuration's step, from ``schedule_time.pipeline_floor`` and the
  optimizer step, with the calibration's factors (what ``estimate_on`` prunes with);
- for every inner choice of an outer point at once (numpy arrays over its options):
  :func:`block_floor` and :func:`edge_floors` (least compute per block and per embedding / head
  pass), :func:`time_floors` (the pipeline floor over them, the busiest link, the queued
  reductions), :func:`memory_floors` (parameters, optimizer states and the fewest live
  activations of the busiest stage), :func:`optimizer_floors`, :func:`reduction_floors`,
  :func:`reduction_queues` and :func:`micro_batch_dp_floor` (the data-parallel traffic), and
  :func:`step_floors`, which makes one step bound per inner choice of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autoconf.cost import comm, schedule_time
from autoconf.cost.data_parallel import dp_reduction_s, gather_bytes
from autoconf.cost.groups import axis_links, collective_s, grad_group, reduction_collective
from autoconf.cost.layout import chunk_experts, chunk_params
from autoconf.cost.memory import state_bytes_per_param, zero3_working_bytes
from autoconf.cost.moe import moe_activation_bytes, moe_shape
from autoconf.cost.system import System
from autoconf.cost.tensor_parallel import tp_times
from autoconf.space.config import ParallelConfig, module_key
from autoconf.space.placement import Placement, even_layers
from autoconf.space.schedules import device_orders, fsdp_gathers
from autoconf.specs.devices import device_type

FLOOR_TERMS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "dp_comm", "bubble", "pp_comm")
"""The step-time terms (``estimate.TIME_TERMS``) the pipeline floor and the data-parallel tail are
made of: all but the optimizer step."""


def lower_bound(ctx: System, floor: float, opt: float) -> float:
    """Lower bound on the step time (to skip dominated configurations in the search): ``floor``,
    the configuration's ``schedule_time.pipeline_floor``, plus ``opt``, its optimizer step.

    The estimate's step is makespan + data-parallel tail + gather + optimizer step, the makespan
    at least the floor (``estimate_on`` takes the larger of both) and the other terms at least 0;
    its breakdown adds up to that step. A calibration scales each term of the breakdown by its
    factor: the terms other than the optimizer step add up to at least the floor, so scaled they
    are at least the floor times the least of their factors."""
    cal = ctx.calibration
    if cal is not None:  # calibration scales the terms the floor is made of
        return floor * min(cal.factor(k) for k in FLOOR_TERMS) + opt * cal.factor("optimizer")
    return floor + opt


def _at(c: ParallelConfig, precision: tuple) -> ParallelConfig:
    """``c`` in the (precision, FP8 recipe) ``precision``."""
    if (c.precision, c.fp8_recipe) == precision:
        return c
    return dataclasses.replace(c, precision=precision[0], fp8_recipe=precision[1])


# -- compute -------------------------------------------------------------------------------------
def block_floor(system: System, c: ParallelConfig, kinds, compiled, fp8, modules=((),), ep: int = 0) -> tuple:
    """(forward, backward, exposed tp forward, exposed tp backward, host forward, host backward,
    activation bytes) of one block per micro-batch of ``c`` (its tp, micro-batch size, sequence
    parallelism, recomputation and cp) on a rank's s/cp tokens: each the least over the device
    ``kinds``, the compile modes ``compiled``, and ``modules`` (what selective recomputation may
    recompute; ``c.recompute_modules`` set to each). ``ep`` > 0: a mixture of experts' MoE block
    with its experts over ``ep`` ranks instead (its all-to-alls are left out: at least 0).

    A bound: the estimate prices each block with ``System.block`` on its stage's slowest kind, in
    one of these compile modes and recomputed modules, and pays autograd's ``.grad``
    accumulation pass where it runs (here none: ``accumulates=False``); its exposed tensor-parallel
    collectives are ``tensor_parallel.tp_times`` at the same degree (the context-parallel exchange
    is left out: at least 0); its activations are ``layer_activations`` (``moe_activation_bytes``)
    with the least attention mask of the kinds."""
    mbs, tp, sp, rc, cp = c.micro_batch_size, c.tp, c.sequence_parallel, c.recompute, c.cp
    moe = ep > 0
    shapes = [moe_shape(system, dataclasses.replace(c, ep=ep))] if moe else [None]
    cs = [dataclasses.replace(c, recompute_modules=md) for md in modules]
    # accumulates=False: no .grad accumulation pass (the least any configuration pays)
    lts = [system.block(k, mbs, tp, sp, rc, cp=cp, fp8=fp8, compiled=comp, moe=sh, accumulates=False,
                        modules=module_key(c_))
           for k in kinds for comp in compiled for sh in shapes for c_ in cs]
    tpt = tp_times(system, c, [kinds]) if tp > 1 else None
    mask = min(system.policy.mask_bytes(k) for k in kinds)
    if moe:
        act = min(moe_activation_bytes(system, c_, mask)["total"] for c_ in cs)
    else:
        act = min(system.layer_activations(c_, mask)["total"] for c_ in cs)
    return (min(lt.forward_s for lt in lts), min(lt.backward_s for lt in lts),
            tpt.forward_per_layer_s if tpt else 0.0, tpt.backward_per_layer_s if tpt else 0.0,
            min(lt.host_forward_s for lt in lts), min(lt.host_backward_s for lt in lts), act)


def edge_floors(system: System, kinds, mbs: int, tp: int, cp: int = 1) -> tuple:
    """(forward, backward, host forward, host backward) of the embedding's pass, then the same of
    the output layer's (head), per micro-batch: each the least over the device ``kinds``. A
    bound: the estimate adds ``System.edge`` on the stage's slowest kind to the first and the last
    chunk, the output layer's weight gradients besides."""
    out = []
    for which in ("embedding", "head"):
        es = [system.edge(k, mbs, tp, which, cp) for k in kinds]
        out += [min(e.forward_s for e in es), min(e.backward_s for e in es),
                min(e.host_forward_s for e in es), min(e.host_backward_s for e in es)]
    return tuple(out)


def chunk_rows(num_layers: int, pp: int, v: int, edges: tuple, moe_blocks) -> tuple:
    """Per chunk of the even split (numpy arrays): its blocks, the embedding / head passes'
    (forward, backward, host forward, host backward) it carries (``edges``: :func:`edge_floors`),
    and its mixture-of-experts blocks ``moe_blocks`` (zeros for a dense model)."""
    import numpy as np

    n_chunks = pp * v
    layers = np.array(even_layers(num_layers, n_chunks), dtype=float)
    ef, eb, ehf, ehb, hf_, hb_, hhf, hhb = edges
    edge = np.zeros((4, n_chunks))
    edge[:, 0] += (ef, eb, ehf, ehb)
    edge[:, -1] += (hf_, hb_, hhf, hhb)
    moe = np.array(moe_blocks, dtype=float)
    return layers, edge, moe


# -- time ----------------------------------------------------------------------------------------
def time_floors(point, m: int, chunks, layer_rows, speedup: float = 1.0, tp_overlap: bool = False, p2p=None,
                reductions=None, moe_rows=None):
    """``schedule_time.pipeline_floor`` over chunk lower bounds, for each row of per-block
    (forward, backward, tp forward, tp backward, host forward, host backward): a numpy vector.
    ``chunks``: :func:`chunk_rows`; ``m`` micro-batches; ``speedup``: how much faster than
    priced a CPU rank sharing cores runs alone (``System.cpu_share``); ``tp_overlap``: whether the
    framework can hide the tensor-parallel collectives under the GEMMs. ``moe_rows``: the same
    rows for a mixture of experts' MoE blocks. ``p2p`` (options x pp): the transfers micro-batch
    0 makes on its way to device d and back join its prefix (forward and backward, one per
    boundary crossed). ``reductions`` (zeros x pp, one chunk per device): also a bound per
    (option, zero) with each device's gradient reduction after its last backward.

    A bound: a chunk's pass in the estimate is its blocks' device time plus its exposed
    collectives, or the host's issue time where longer (``chunk_time``), plus costs at least 0;
    each is at least the rows' (least) times. The pipeline floor is a makespan no schedule can
    beat for such passes, the busiest link carries its transfers one at a time, and a device's
    reductions queue after its first chunk's last backward (:func:`_reduction_tails`)."""
    import numpy as np
    dp, pp, tp, mbs, sched, v, layered, cp = point
    layers, edge, moe = chunks
    a = np.asarray(layer_rows, dtype=float) / speedup  # options x 6
    am = a if moe_rows is None else np.asarray(moe_rows, dtype=float) / speedup
    dense = layers - moe
    edge = edge / speedup

    def col(i):  # options x chunks: the chunk's dense blocks and MoE blocks
        return np.outer(a[:, i], dense) + np.outer(am[:, i], moe)
    f = col(0) + edge[0]
    b = col(1) + edge[1]
    tf = col(2)
    tb = col(3)
    hf = col(4) + edge[2]
    hb = col(5) + edge[3]
    if tp_overlap:  # the collectives can hide under the GEMMs (tensor_parallel.overlapped)
        fwd, bwd = np.maximum(np.maximum(f, tf), hf), np.maximum(np.maximum(b, tb), hb)
    else:
        fwd, bwd = np.maximum(f + tf, hf), np.maximum(b + tb, hb)
    both = fwd + bwd  # options x chunks; chunk c on device c % pp
    busy = both.reshape(len(a), v, pp).sum(axis=1) * m
    step = both[:, :pp - 1]
    if p2p is not None and pp > 1:
        step = step + 2.0 * np.asarray(p2p)[:, :pp - 1]
    prefix = np.concatenate([np.zeros((len(a), 1)), np.cumsum(step, axis=1)], axis=1)
    floor = (prefix + busy).max(axis=1)
    if p2p is not None and pp > 1:
        floor = np.maximum(floor, _link_floor(p2p, pp, v, m))
    if reductions is None:
        return floor
    return floor, _reduction_tails(fwd, bwd, layers, p2p, reductions, pp, v, m)


def _link_floor(p2p, pp: int, v: int, m: int):
    """``pipeline.simulate``: a directed link carries one transfer at a time, so the step lasts at
    least the busiest link's transfers over all micro-batches (activations of boundary c go from
    device c % pp to (c+1) % pp, their gradients back); 1% below it for the simulation's
    extrapolation past the warm-up. Per option (``p2p``: options x pp)."""
    import numpy as np
    per = np.asarray(p2p)  # options x pp: boundary c's transfer is p2p[c % pp]
    count = np.full(pp, float(v))
    count[pp - 1] -= 1  # the last chunk has no boundary after it
    load = per * count  # per boundary class k, one direction
    if pp == 2:  # both directions of a boundary class share one link with the other class
        link = load.sum(axis=1)
    else:
        link = load.max(axis=1)
    return 0.99 * m * link


def _reduction_tails(fwd, bwd, layers, p2p, reductions, pp: int, v: int, m: int):
    """``data_parallel.reduction_tail_s``: a device's reductions queue one after another from its
    first chunk's last backward (less all but one layer of it). With one chunk per device that
    backward comes after micro-batch 0's forward reached the device, its m forwards and m - 1
    backwards; breadth-first runs every forward of every local chunk first, then the highest
    chunk's m backwards. Per (option, zero): the latest device's end of its queue."""
    import numpy as np
    n = len(fwd)
    lead = fwd[:, :pp - 1]
    if p2p is not None and pp > 1:
        lead = lead + np.asarray(p2p)[:, :pp - 1]
    pre_f = np.concatenate([np.zeros((n, 1)), np.cumsum(lead, axis=1)], axis=1)
    top = slice((v - 1) * pp, v * pp)  # each device's highest chunk
    local_f = fwd.reshape(n, v, pp).sum(axis=1)
    b_top = bwd[:, top]
    start = pre_f + m * local_f + (m - 1) * b_top + b_top / layers[top]
    return (start[:, None, :] + np.asarray(reductions)[None, :, :]).max(axis=2)


# -- memory --------------------------------------------------------------------------------------
def stage_params(system: System, pp: int, tp: int, v: int, ep: int = 1) -> tuple:
    """Per stage of the even split (numpy arrays): parameters of its chunks' tp shards (a mixture
    of experts' E/ep routed experts per MoE block, ``layout.chunk_params``), its smallest chunk's
    blocks, and its chunks' pipeline receive buffers (one per neighbouring chunk)."""
    import numpy as np

    n_chunks = pp * v
    c = ParallelConfig(dp=1, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1, virtual_stages=v,
                       ep=ep)
    layers = even_layers(system.model.num_layers, n_chunks)
    cp = chunk_params(system, c, layers)
    params = np.array([sum(cp[ci] for ci in range(s, n_chunks, pp)) for s in range(pp)])
    least = np.array([min(layers[ci] for ci in range(s, n_chunks, pp)) for s in range(pp)], dtype=float)
    buffers = np.array([sum((ci > 0) + (ci < n_chunks - 1) for ci in range(s, n_chunks, pp))
                        for s in range(pp)], dtype=float)
    return params, least, buffers


def state_zero(system: System, point, zero: int) -> int:
    """``Policy.state_zero_stage`` at an outer point and ZeRO stage: the stage its optimizer
    states are sharded at."""
    dp, pp, tp, mbs, sched, v, layered, cp = point
    return system.policy.state_zero_stage(ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1,
                                                  num_micro_batches=1, zero_stage=zero))


def even_chunk_experts(system: System, pp: int, tp: int, v: int) -> tuple:
    """Per chunk of the even split at ep = 1: its MoE blocks and all E experts' parameters of
    them on a rank (``layout.chunk_experts``); zeros for a dense model."""
    if not system.model.is_moe:
        return (0,) * (pp * v), (0.0,) * (pp * v)
    c = ParallelConfig(dp=1, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1, virtual_stages=v)
    return chunk_experts(system, c, Placement.of(c, system.model.num_layers).chunk_layers())


def live_counts(schedule: str, pp: int, m: int, v: int) -> tuple:
    """Per device, the most activation sets (micro-batch x chunk) alive at once in the schedule's
    order (``space.schedules.device_orders``): what ``stage_memory`` sees at the activation peak."""
    out = []
    for order in device_orders(schedule, pp, m, v):
        live = peak = 0
        for op, _mb, _c in order:
            live += -1 if op == "B" else 1
            peak = max(peak, live)
        out.append(peak)
    return tuple(out)


def live_sets(system: System, sched: str, pp: int, m: int, v: int, layered: bool):
    """Per stage, the fewest activation sets (one micro-batch through one chunk) its schedule
    keeps alive at its activation peak, as ``stage_memory`` counts them (a simulated prefix of
    the micro-batches, scaled for the schedules that keep them all): from the schedule's own
    order (:func:`live_counts`); closed forms where they are exact (the tests compare)."""
    import numpy as np

    if pp == 1 and layered:  # every micro-batch through every block before any backward
        return np.array([float(m)])
    if sched == "gpipe":
        return np.full(pp, float(m))
    if sched == "breadth_first":
        return np.full(pp, float(m * v))
    if sched == "1f1b":
        return np.minimum(pp - np.arange(pp), m).astype(float)
    m_sim = schedule_time.sim_size(sched, pp, m)
    return system.cached(("ttt-live", sched, pp, m_sim, v), lambda: np.array(live_counts(sched, pp, m_sim, v),
                                                                               dtype=float))


def memory_floors(system: System, point, m: int, acts, zeros, stage, live, kinds):
    """Lower bounds on the busiest stage's memory: an array of (options x zeros) for the per-block
    activation bytes ``acts`` of each option and the ZeRO stages ``zeros``. ``stage``:
    :func:`stage_params` (a mixture of experts' at its largest expert-parallel degree); ``live``:
    :func:`live_sets`; ``kinds``: the device kinds.

    A bound of ``stage_memory``: each stage holds its parameters and optimizer states
    (``memory.state_bytes_per_param``; the routed experts at the largest ep: per rank at most
    what any ep holds, and their ZeRO shards over dp x cp / ep come to the dense sharding over
    dp x cp of all E experts), at least the least activations per block times the blocks of the
    fewest live activation sets, the least runtime context of the kinds, the pipeline runtime's
    receive buffers where the framework keeps one per micro-batch, and ZeRO-3's gathered
    working set."""
    import numpy as np

    dp, pp, tp, mbs, sched, v, layered, cp = point
    mod = system.model
    params, least, buffers = stage
    units = live * (mod.num_layers if (pp == 1 and layered) else least)  # blocks' activation sets
    rest = np.zeros(pp) + min(device_type(k).framework_overhead_bytes for k in kinds)
    if pp > 1 and system.framework.per_micro_batch_pipeline_buffers:
        sp_div = tp if tp > 1 and mod.seq_length % tp == 0 else 1
        rest = rest + buffers * m * mbs * mod.seq_length / cp / sp_div * mod.hidden_size * mod.dtype_bytes
    fp32 = system.policy.grad_bytes == 4 and mod.dtype != "fp32"
    # ZeRO shards over the gradient group: dp x cp (``cost.groups.grad_group``)
    master = system.framework.master_weights
    per_param = np.array([(lambda st: st.parameters + st.optimizer)(state_bytes_per_param(
        mod.dtype, state_zero(system, point, z), dp * cp, fp32, master)) for z in zeros])
    # (under pipelining the reference trainer's FSDP2 holds whole chunks instead, Policy.fsdp_per_pass:
    # at least 0, a chunk's share of a mixture of experts' layer being smaller than a layer)
    z3 = np.array([zero3_working_bytes(mod, tp) if (z == 3 and dp * cp > 1 and not
                                                    system.policy.fsdp_per_pass(z, pp, dp * cp)) else 0.0
                   for z in zeros])
    # options x zeros x stages
    tot = (np.asarray(acts, dtype=float)[:, None, None] * units[None, None, :]
           + per_param[None, :, None] * params[None, None, :] + rest[None, None, :] + z3[None, :, None])
    return tot.max(axis=2)


# -- the optimizer step and data parallelism -----------------------------------------------------
def optimizer_floors(system: System, point, kinds, params, zeros):
    """Per ZeRO stage of ``zeros``: the optimizer step over the most parameters a stage holds
    (``params``: per stage, from :func:`stage_params`), sharded over dp x cp where the optimizer
    states are (:func:`state_zero`), on the fastest of the device ``kinds`` (a numpy vector). A bound of
    ``chunk_time.optimizer_step_s``: the slowest stage's step over its local parameters on its
    slowest kind (a mixture of experts' routed experts sharded over fewer ranks: at least this),
    the gradient-norm pass besides."""
    import numpy as np
    dp, pp, tp, mbs, sched, v, layered, cp = point
    top = float(params.max())
    return np.array([min(system.optimizer_time(k, top / (dp * cp if state_zero(system, point, z) >= 1 else 1))
                         for k in kinds) for z in zeros])


@dataclass(frozen=True)
class _ChunkParams:
    """What ``data_parallel.dp_reduction_s`` reads of a layout: each chunk's parameters (the
    reduction floor takes a mixture of experts' dense parameters only: no routed experts)."""

    chunk_params: tuple
    chunk_expert_params: tuple = ()


def reduction_floors(system: System, point, kinds, params, hier: bool, precision: tuple) -> dict:
    """{ZeRO stage: (the busiest device's gradient reductions back to back, per device its
    ZeRO-2/3 reduce-scatters, per device its ZeRO-3 parameter gathers, per device its reductions
    back to back)} at ``point`` (its dp, pp, tp, v and cp), dp x cp > 1. ``params``: each
    chunk's parameters on a rank, a mixture of experts' dense ones only (the routed experts'
    reductions over dp x cp / ep queue after them: at least 0); ``hier``: whether the
    hierarchical all-reduce runs there (``study.choices.dp_hierarchical``); ``precision``: the
    (precision, FP8 recipe) of the configurations.

    A bound: the estimate queues a device's chunk reductions one after another
    (``data_parallel.reduction_tail_s``), so the step lasts at least their sum, here with the
    fastest all-reduce the framework offers. ZeRO-2/3 during the micro-batches
    (``data_parallel.per_micro_batch_s``): a chunk's backward is at least its gradients'
    reduce-scatter (standard accumulation; in buckets, at least one call's time), ZeRO-3's
    forward and backward at least the gather of its parameters (:func:`micro_batch_dp_floor`)."""
    dp, pp, tp, mbs, sched, v, layered, cp = point
    # one chunk of each size and place (the first and last chunks may hold a tied embedding's
    # copy, ``cost.groups.tied_params``): the reductions are per chunk
    n_chunks = pp * v
    keys = [(p, ci in (0, n_chunks - 1)) for ci, p in enumerate(params)]
    reps = {}
    for ci, k in enumerate(keys):
        reps.setdefault(k, ci)
    lay = _ChunkParams(tuple(params))
    out = {}
    for z in (0, 1, 2, 3):
        modes = ("flat", "hierarchical") if (hier and z == 0) else ("flat",)
        best, per_dev = float("inf"), [float("inf")] * pp
        for mode in modes:
            c = _at(ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1,
                                   virtual_stages=v, zero_stage=z, dp_all_reduce=mode, cp=cp), precision)
            red = reduction_collective(z)
            one = {k: dp_reduction_s(system, c, lay, red, ci, kinds) for k, ci in reps.items()}
            per_chunk = [one[k] for k in keys]
            sums = [sum(per_chunk[d::pp]) for d in range(pp)]
            best = min(best, max(sums))
            per_dev = [min(x, y) for x, y in zip(per_dev, sums)]
        rs = ag = [0.0] * (pp * v)
        if z >= 1:
            c = _at(ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1,
                                   virtual_stages=v, zero_stage=z, cp=cp), precision)
            one = {k: dp_reduction_s(system, c, lay, comm.reduce_scatter_s, ci, kinds) for k, ci in reps.items()}
            rs = [one[k] for k in keys]
            n, axis = grad_group(c)
            links = axis_links(system, c, axis)
            one = {p: collective_s(system, links, comm.all_gather_s, n, p * gather_bytes(system, c))
                   for p in set(params)}
            ag = [one[p] for p in params]
        out[z] = (best, [sum(rs[d::pp]) for d in range(pp)], [sum(ag[d::pp]) for d in range(pp)], per_dev)
    return out


def micro_batch_dp_floor(system: System, point, m: int, zero: int, rs, ag) -> float:
    """The busiest device's ZeRO-2/3 traffic over the ``m`` micro-batches at ZeRO stage ``zero``
    (``rs``, ``ag``: per device its reduce-scatters and gathers, :func:`reduction_floors`). A
    bound of ``data_parallel.per_micro_batch_s``: each micro-batch but the last reduce-scatters
    its gradients (not in layered accumulation, which reduces once per unit), ZeRO-3 gathers its
    parameters for the forward and again for the backward (except layered accumulation at
    pp = 1); where the framework gathers once per step (``Policy.fsdp_step_gather``) once; under
    the reference trainer's pipelining (``Policy.fsdp_per_pass``) as often as the fewest-gathered
    of a device's chunks (``space.schedules.fsdp_gathers``), reduce-scattering after the last
    backward (:func:`reduction_queues`)."""
    dp, pp, tp, mbs, sched, v, layered, cp = point
    lay = layered or sched == "breadth_first"
    if dp * cp == 1 or zero < 2:
        return 0.0
    if system.policy.fsdp_step_gather(zero, pp, dp * cp):
        # gathered once per step and reduced after the last micro-batch (Policy.fsdp_step_gather)
        return max(r + (a if zero == 3 else 0.0) for r, a in zip(rs, ag))
    if system.policy.fsdp_per_pass(zero, pp, dp * cp):
        # gathered as often as the schedule finds a chunk resharded, at least the fewest times
        # any of the device's chunks is; reduce-scattered after the last backward (the queue)
        if sched == "interleaved" and m % pp:  # (no such configuration: nothing to bound)
            return 0.0
        passes = fsdp_gathers(sched, pp, m, v, lay)
        return max(min(sum(passes[ci]) for ci in range(d, pp * v, pp)) * a for d, a in enumerate(ag))
    per_mb = [0.0] * pp
    if not lay:
        per_mb = [r * (m - 1) / m for r in rs]
    if zero == 3 and not (lay and pp == 1):
        per_mb = [x + 2 * a for x, a in zip(per_mb, ag)]
    return max(per_mb) * m


def reduction_queues(system: System, point, zeros, red):
    """Per ZeRO stage of ``zeros``: each device's gradient reductions back to back (``red``:
    :func:`reduction_floors`' per stage), the queue :func:`time_floors` starts after a device's
    last backward; None where that queue has no known earliest start: without data parallelism,
    at pp = 1 with layered accumulation (its units finish one by one), and interleaved (its
    chunks' last backwards interleave with the cool-down). ZeRO-3 reduce-scatters inside each
    backward (``data_parallel.reduces_in_backward``): past the last backward only a layer's is
    left, so its queue adds nothing to the floor there (zeros), unless the framework reduces once
    per step (``Policy.fsdp_step_gather``, ``Policy.fsdp_per_pass``)."""
    dp, pp, tp, mbs, sched, v, layered, cp = point
    standard = dp * cp > 1 and ((v == 1 and (pp > 1 or not layered)) or sched == "breadth_first")
    if not standard:
        return None
    once = (system.policy.fsdp_step_gather(3, pp, dp * cp) or system.policy.fsdp_per_pass(3, pp, dp * cp))
    return [r[3] if z != 3 or once else [0.0] * pp for z, r in zip(zeros, red)]


def step_floors(system: System, point, m: int, zeros, floors, red, opt, tails=None) -> list:
    """Per option (``floors``: :func:`time_floors`' per option, ``tails``: its reduction tails
    per option and ZeRO stage, or None) and ZeRO stage of ``zeros``: the lower bound on the step
    time, the largest of the time floor, the busiest device's reductions back to back and its
    ZeRO-2/3 traffic over the micro-batches (``red``: :func:`reduction_floors`' per stage;
    :func:`micro_batch_dp_floor`) and the reduction tail, plus the optimizer floor (``opt``:
    :func:`optimizer_floors`). The estimate's step is at least each of the former (each a
    duration the step holds one after another on one device or link, or its makespan) and the
    optimizer step runs after them."""
    dp_mb = [micro_batch_dp_floor(system, point, m, z, r[1], r[2]) for z, r in zip(zeros, red)]
    out = []
    for j in range(len(floors)):
        row = []
        for zi in range(len(zeros)):
            lb = max(floors[j], red[zi][0], dp_mb[zi], tails[j, zi] if tails is not None else 0.0)
            row.append(float(lb + opt[zi]))
        out.append(row)
    return out
