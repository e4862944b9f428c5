"""The per-point optimiser of ``plan`` (:class:`PointOptimizer`): the exact best configuration of
the cost model's space at one GPU count and batch, by lower bounds on every inner choice and
warm-started incumbents.
"""

from __future__ import annotations

import dataclasses
import time

from autoconf.cost import comm, schedule_time
from autoconf.cost.data_parallel import dp_reduction_s, gather_bytes
from autoconf.cost.estimate import estimate_on
from autoconf.cost.groups import axis_links, collective_s, grad_group, reduction_collective
from autoconf.cost.layout import chunk_experts, chunk_params
from autoconf.cost.memory import state_bytes_per_param, zero3_working_bytes
from autoconf.cost.moe import a2a_times, moe_activation_bytes, moe_shape
from autoconf.cost.schedule_time import boundary_bytes, p2p_times
from autoconf.cost.system import System
from autoconf.cost.tensor_parallel import tp_times
from autoconf.space.config import RECOMPUTE, ParallelConfig, check, ep_overlap_reason, module_key
from autoconf.space.enumeration import cp_choices, outer_space, point_config
from autoconf.space.placement import Placement, even_layers
from autoconf.specs.devices import device_type
from autoconf.study.choices import (
    dispatcher_at,
    dp_hierarchical,
    ep_degrees,
    expert_parallel_choices,
    framework_inner,
    recompute_module_choices,
    recompute_module_fallback,
)
from autoconf.timetotrain.points import PointStats, _ChunkParams, _neighbours, live_counts
from autoconf.timetotrain.synthetic import METHODS, _prefill


class PointOptimizer:
    """The fastest fitting configuration for each method, at one GPU count and batch: exact for
    the cost model over ``search``'s space (``enumeration.outer_space`` x ``study.choices.framework_inner``,
    no placement search).

    Two cheap bounds decide most of the space without an estimate, both true bounds of what
    ``cost.estimate`` computes (the tests check them against it):

    - time: ``schedule_time.pipeline_floor`` over chunks made of their blocks' least compute per
      micro-batch (device time plus the exposed tensor-parallel collectives, or the host's issue
      time if longer; ``chunk_time``), plus the optimizer step;
    - memory: parameters and optimizer state of the busiest stage (``memory.state_bytes_per_param``)
      plus the fewest activations its schedule keeps alive at its peak (the schedule's own order,
      ``space.schedules.device_orders``), the runtime context and the pipeline runtime's receive buffers.
    """

    def __init__(self, system: System, methods=METHODS, max_micro_batch: int = 64,
                 precision: tuple = ("bf16", "tensorwise"), max_cp: int | None = None):
        self.system = system
        self.max_cp = max_cp
        """Largest context-parallel degree (``enumeration.cp_choices``; None: its default by sequence)."""
        self.precision = precision
        """(precision, FP8 recipe) of every configuration (``study.choices.precision_choices``)."""
        self.fp8 = precision[1] if precision[0] == "fp8" else None
        self.model = system.model
        self.methods = tuple(methods)
        self.max_micro_batch = max_micro_batch
        self.kinds = sorted(set(system.topology.kind_of))
        fw = system.framework
        self.tp_overlap = fw.defaults.get("tp_comm_overlap", False) or "tp_comm_overlap" in fw.knobs
        self.ep_overlap = fw.defaults.get("ep_comm_overlap", False) or "ep_comm_overlap" in fw.knobs
        # torch.compile where the framework compiles by default or lets the user switch it on: the
        # least of both is the bound (compiled kernels are fewer and fused)
        self.compiled = tuple(sorted({bool(fw.defaults.get("torch_compile", False))}
                                     | ({False, True} if "torch_compile" in fw.knobs else set())))
        self.capacity = max(system.capacity_bytes(system.topology.kind_of.index(k)) for k in self.kinds)
        # CPU ranks sharing cores compute up to their share faster alone (processor sharing,
        # ``System.cpu_sharing``): the compute in the bounds is taken at one core per rank
        self.speedup = system.cpu_share("cpu") if "cpu" in self.kinds else 1.0
        self.oom: set = set()
        """Configurations found not to fit (memory does not depend on the network: shareable)."""

    def _prec(self, c: ParallelConfig) -> ParallelConfig:
        """``c`` in the plan's matmul precision."""
        if (c.precision, c.fp8_recipe) == self.precision:
            return c
        return dataclasses.replace(c, precision=self.precision[0], fp8_recipe=self.precision[1])

    # -- bounds ----------------------------------------------------------------------------------
    def _options(self, tp: int, cp: int = 1) -> list:
        sps = (False, True) if tp > 1 and (self.model.seq_length // cp) % tp == 0 else (False,)
        return [(sp, rc) for sp in sps for rc in RECOMPUTE]

    def _per_layer(self, mbs: int, tp: int, sp: bool, rc: str, cp: int = 1, ep: int = 0) -> tuple:
        """(forward, backward, exposed tp forward, exposed tp backward, host forward, host backward,
        activation bytes) of one block per micro-batch on a rank's s/cp tokens: least over device
        kinds and compile modes (the context-parallel exchange is left out: at least 0). ``ep`` > 0:
        a mixture of experts' MoE block with its experts over ``ep`` ranks instead (its all-to-alls
        are the caller's, ``_moe_rows``)."""

        def make():
            sys_ = self.system
            c = self._prec(ParallelConfig(dp=1, pp=1, tp=tp, micro_batch_size=mbs, num_micro_batches=1,
                                          recompute=rc, sequence_parallel=sp, cp=cp))
            moe = ep > 0
            shapes = [moe_shape(sys_, dataclasses.replace(c, ep=ep))] if moe else [None]
            # selective recomputation: the least over what it may recompute (search.recompute_module_choices)
            mods = ((),)
            if rc == "selective":  # (and what FP8 delayed scaling leaves of them: framework_inner)
                choices = recompute_module_choices(sys_.framework, self.model)
                mods = tuple(set(choices) | {recompute_module_fallback(md) for md in choices})
            cs = [dataclasses.replace(c, recompute_modules=md) for md in mods]
            # accumulates=False: no .grad accumulation pass (the least any configuration pays)
            lts = [sys_.block(k, mbs, tp, sp, rc, cp=cp, fp8=self.fp8, compiled=comp, moe=sh, accumulates=False,
                              modules=module_key(c_))
                   for k in self.kinds for comp in self.compiled for sh in shapes for c_ in cs]
            tpt = tp_times(sys_, c, [self.kinds]) if tp > 1 else None
            mask = min(sys_.policy.mask_bytes(k) for k in self.kinds)
            if moe:
                act = min(moe_activation_bytes(sys_, c_, mask)["total"] for c_ in cs)
            else:
                act = min(sys_.layer_activations(c_, mask)["total"] for c_ in cs)
            return (min(lt.forward_s for lt in lts), min(lt.backward_s for lt in lts),
                    tpt.forward_per_layer_s if tpt else 0.0, tpt.backward_per_layer_s if tpt else 0.0,
                    min(lt.host_forward_s for lt in lts), min(lt.host_backward_s for lt in lts), act)
        return self.system.cached(("ttt-layer", mbs, tp, sp, rc, cp, self.fp8, ep), make)

    def _moe_rows(self, point, opts) -> list:
        """Per option (sequence parallel, recompute): a lower bound on every MoE block of ``point``
        as ``_per_layer``'s row, least over the expert-parallel degrees its configurations can
        run: each degree's block with its dispatch and combine all-to-alls (``moe.a2a_times``,
        exposed: added to the compute) on that degree's groups, column by column; none where the
        framework's ``ep_comm_overlap`` can run at the point (its pairs may hide them all)."""
        import numpy as np

        dp, pp, tp, mbs, sched, v, layered, cp = point
        eps = ep_degrees(dp * cp, self.model.num_experts) if self.system.framework.expert_parallel else [1]
        out = []
        for sp, rc in opts:
            rows = []
            for k in eps:
                r = list(self._per_layer(mbs, tp, sp, rc, cp, ep=k))
                if k > 1:
                    c = ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=mbs, num_micro_batches=1, recompute=rc,
                                       sequence_parallel=sp, cp=cp, ep=k, schedule=sched, virtual_stages=v,
                                       moe_dispatcher=dispatcher_at(self.system, k, tp))
                    if self.ep_overlap and ep_overlap_reason(c, self.model) is None:
                        rows.append(r)  # paired passes can hide them all: the least is none exposed
                        continue
                    key = ("ttt-a2a", dp, pp, tp, cp, mbs, sp, rc, k)
                    af, ab = self.system.cached(key, lambda: a2a_times(self.system, c))
                    r[0], r[1] = r[0] + af, r[1] + ab
                rows.append(r)
            out.append(tuple(np.min(np.array(rows), axis=0)))
        return out

    def _edges(self, mbs: int, tp: int, cp: int = 1) -> tuple:
        def make():
            out = []
            for which in ("embedding", "head"):
                es = [self.system.edge(k, mbs, tp, which, cp) for k in self.kinds]
                out += [min(e.forward_s for e in es), min(e.backward_s for e in es),
                        min(e.host_forward_s for e in es), min(e.host_backward_s for e in es)]
            return tuple(out)
        return self.system.cached(("ttt-edges", mbs, tp, cp), make)

    def _chunks(self, pp: int, tp: int, v: int, mbs: int, cp: int = 1):
        """Per chunk (numpy arrays): its blocks, the embedding / head passes' (forward, backward,
        host forward, host backward) it carries, and its mixture-of-experts blocks (zeros for a
        dense model)."""
        import numpy as np


        def make():
            n_chunks = pp * v
            layers = np.array(even_layers(self.model.num_layers, n_chunks), dtype=float)
            ef, eb, ehf, ehb, hf_, hb_, hhf, hhb = self._edges(mbs, tp, cp)
            edge = np.zeros((4, n_chunks))
            edge[:, 0] += (ef, eb, ehf, ehb)
            edge[:, -1] += (hf_, hb_, hhf, hhb)
            moe = np.array(self._chunk_experts(pp, tp, v)[0], dtype=float)
            return layers, edge, moe
        return self.system.cached(("ttt-chunks", pp, tp, v, mbs, cp), make)

    def _p2p(self, point, sp: bool):
        """The model's transfer time across each stage boundary (``schedule_time.p2p_times``) for one
        micro-batch's activation: a numpy vector of pp (0 without pipelining)."""
        import numpy as np

        dp, pp, tp, mbs, sched, v, layered, cp = point
        if pp == 1:
            return np.zeros(1)

        def make():
            c = ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=mbs, num_micro_batches=1, sequence_parallel=sp,
                               cp=cp)
            _prefill(self.system, c)
            return np.array(p2p_times(self.system, c, boundary_bytes(self.system, c)))
        return self.system.cached(("ttt-p2p", dp, pp, tp, mbs, sp, cp), make)

    def _floors(self, point, m: int, layer_rows, p2p=None, reductions=None, moe_rows=None):
        """``schedule_time.pipeline_floor`` over chunk lower bounds, for each row of per-block
        (forward, backward, tp forward, tp backward, host forward, host backward): a numpy vector.
        ``moe_rows``: the same for a mixture of experts' MoE blocks (``_moe_rows``).
        ``p2p`` (options x pp): the transfers micro-batch 0 makes on its way to device d and back
        join its prefix (forward and backward, one per boundary crossed). ``reductions`` (zeros x
        pp, one chunk per device): also a bound per (option, zero) with each device's gradient
        reduction after its last backward."""
        import numpy as np
        dp, pp, tp, mbs, sched, v, layered, cp = point
        layers, edge, moe = self._chunks(pp, tp, v, mbs, cp)
        a = np.asarray(layer_rows, dtype=float) / self.speedup  # options x 6
        am = a if moe_rows is None else np.asarray(moe_rows, dtype=float) / self.speedup
        dense = layers - moe
        edge = edge / self.speedup

        def col(i):  # options x chunks: the chunk's dense blocks and MoE blocks
            return np.outer(a[:, i], dense) + np.outer(am[:, i], moe)
        f = col(0) + edge[0]
        b = col(1) + edge[1]
        tf = col(2)
        tb = col(3)
        hf = col(4) + edge[2]
        hb = col(5) + edge[3]
        if self.tp_overlap:  # the collectives can hide under the GEMMs (tensor_parallel.overlapped)
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
            # ``pipeline.simulate``: a directed link carries one transfer at a time, so the step
            # lasts at least the busiest link's transfers over all micro-batches (activations of
            # boundary c go from device c % pp to (c+1) % pp, their gradients back); 1% below it
            # for the simulation's extrapolation past the warm-up
            per = np.asarray(p2p)  # options x pp: boundary c's transfer is p2p[c % pp]
            count = np.full(pp, float(v))
            count[pp - 1] -= 1  # the last chunk has no boundary after it
            load = per * count  # per boundary class k, one direction
            if pp == 2:  # both directions of a boundary class share one link with the other class
                link = load.sum(axis=1)
            else:
                link = load.max(axis=1)
            floor = np.maximum(floor, 0.99 * m * link)
        if reductions is None:
            return floor
        # ``data_parallel.reduction_tail_s``: a device's reductions queue one after another from
        # its first chunk's last backward (less all but one layer of it). With one chunk per
        # device that backward comes after micro-batch 0's forward reached the device, its m
        # forwards and m - 1 backwards; breadth-first runs every forward of every local chunk
        # first, then the highest chunk's m backwards
        lead = fwd[:, :pp - 1]
        if p2p is not None and pp > 1:
            lead = lead + np.asarray(p2p)[:, :pp - 1]
        pre_f = np.concatenate([np.zeros((len(a), 1)), np.cumsum(lead, axis=1)], axis=1)
        top = slice((v - 1) * pp, v * pp)  # each device's highest chunk
        local_f = fwd.reshape(len(a), v, pp).sum(axis=1)
        b_top = bwd[:, top]
        start = pre_f + m * local_f + (m - 1) * b_top + b_top / layers[top]
        return floor, (start[:, None, :] + np.asarray(reductions)[None, :, :]).max(axis=2)

    def _max_ep(self, point) -> int:
        """The largest expert-parallel degree any configuration of ``point`` runs (1 for a dense
        model): the least routed-expert parameters per rank."""
        dp, pp, tp, mbs, sched, v, layered, cp = point
        m = self.model
        if not m.is_moe or not self.system.framework.expert_parallel:
            return 1
        return max(ep_degrees(dp * cp, m.num_experts))

    def _stage_params(self, pp: int, tp: int, v: int, ep: int = 1):
        """Per stage (numpy arrays): parameters of its chunks' tp shards (a mixture of experts'
        E/ep routed experts per MoE block), and its smallest chunk's blocks."""
        import numpy as np

        from autoconf.space.placement import even_layers

        def make():
            n_chunks = pp * v
            c = ParallelConfig(dp=1, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1, virtual_stages=v,
                               ep=ep)
            layers = even_layers(self.model.num_layers, n_chunks)
            cp = chunk_params(self.system, c, layers)
            params = np.array([sum(cp[ci] for ci in range(s, n_chunks, pp)) for s in range(pp)])
            least = np.array([min(layers[ci] for ci in range(s, n_chunks, pp)) for s in range(pp)], dtype=float)
            buffers = np.array([sum((ci > 0) + (ci < n_chunks - 1) for ci in range(s, n_chunks, pp))
                                for s in range(pp)], dtype=float)
            return params, least, buffers
        return self.system.cached(("ttt-stage", pp, tp, v, ep), make)

    def _live(self, sched: str, pp: int, m: int, v: int, layered: bool):
        """Per stage, the fewest activation sets (one micro-batch through one chunk) its schedule
        keeps alive at its activation peak, as ``stage_memory`` counts them (a simulated prefix of
        the micro-batches, scaled for the schedules that keep them all): from the schedule's own
        order (``space.schedules.device_orders``); closed forms where they are exact (the tests compare)."""
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
        return self.system.cached(("ttt-live", sched, pp, m_sim, v), lambda: np.array(live_counts(sched, pp, m_sim, v),
                                                                                       dtype=float))

    def _memory_floors(self, point, m: int, acts, zeros):
        """Lower bounds on the busiest stage's memory (see the class docstring): an array of
        (options x zeros) for the per-block activation bytes ``acts`` of each option."""
        import numpy as np

        dp, pp, tp, mbs, sched, v, layered, cp = point
        sys_, mod = self.system, self.model
        # routed experts at the largest ep: per rank at most what any ep holds, and their ZeRO
        # shards over dp x cp / ep come to the dense sharding over dp x cp of all E experts
        params, least, buffers = self._stage_params(pp, tp, v, self._max_ep(point))
        live = self._live(sched, pp, m, v, layered)
        units = live * (mod.num_layers if (pp == 1 and layered) else least)  # blocks' activation sets
        rest = np.zeros(pp) + min(device_type(k).framework_overhead_bytes for k in self.kinds)
        if pp > 1 and sys_.framework.per_micro_batch_pipeline_buffers:
            sp_div = tp if tp > 1 and mod.seq_length % tp == 0 else 1
            rest = rest + buffers * m * mbs * mod.seq_length / cp / sp_div * mod.hidden_size * mod.dtype_bytes
        fp32 = sys_.policy.grad_bytes == 4 and mod.dtype != "fp32"
        # ZeRO shards over the gradient group: dp x cp (``cost.groups.grad_group``)
        master = sys_.framework.master_weights
        per_param = np.array([(lambda st: st.parameters + st.optimizer)(state_bytes_per_param(
            mod.dtype, self._state_zero(point, z), dp * cp, fp32, master)) for z in zeros])
        z3 = np.array([zero3_working_bytes(mod, tp) if (z == 3 and dp * cp > 1) else 0.0 for z in zeros])
        # options x zeros x stages
        tot = (np.asarray(acts, dtype=float)[:, None, None] * units[None, None, :]
               + per_param[None, :, None] * params[None, None, :] + rest[None, None, :] + z3[None, :, None])
        return tot.max(axis=2)

    def _optimizer_floor(self, point, zeros):
        import numpy as np
        dp, pp, tp, mbs, sched, v, layered, cp = point
        top = float(self._stage_params(pp, tp, v, self._max_ep(point))[0].max())
        return np.array([min(self.system.optimizer_time(k, top / (dp * cp if self._state_zero(point, z) >= 1 else 1))
                             for k in self.kinds) for z in zeros])

    def _state_zero(self, point, zero: int) -> int:
        """``Policy.state_zero_stage`` at an outer point and ZeRO stage."""
        dp, pp, tp, mbs, sched, v, layered, cp = point
        return self.system.policy.state_zero_stage(ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1,
                                                           num_micro_batches=1, zero_stage=zero))

    def _reduction_floor(self, point, zeros) -> list:
        """Per ZeRO stage: the busiest device's gradient reductions back to back (the model queues
        a device's chunk reductions one after another, ``data_parallel.reduction_tail_s``, so the
        step lasts at least their sum), with the fastest all-reduce the framework offers there."""
        dp, pp, tp, mbs, sched, v, layered, cp = point
        if dp * cp == 1:
            return [(0.0, [0.0] * pp, [0.0] * pp, [0.0] * pp) for _ in zeros]

        def make():
            from autoconf.cost.layout import chunk_params
            from autoconf.space.placement import even_layers
            layers = even_layers(self.model.num_layers, pp * v)
            params = chunk_params(self.system, ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1,
                                                              num_micro_batches=1, virtual_stages=v), layers)
            # a mixture of experts: its dense parameters only (the routed experts' reductions over
            # dp x cp / ep queue after them: at least 0)
            params = [p - e for p, e in zip(params, self._chunk_experts(pp, tp, v)[1])]
            # one chunk of each size and place (the first and last chunks may hold a tied embedding's
            # copy, ``cost.groups.tied_params``): the reductions are per chunk
            n_chunks = pp * v
            keys = [(p, ci in (0, n_chunks - 1)) for ci, p in enumerate(params)]
            reps = {}
            for ci, k in enumerate(keys):
                reps.setdefault(k, ci)
            lay = _ChunkParams(tuple(params))
            _prefill(self.system, ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1, cp=cp))
            hier = dp_hierarchical(self.system, dp, pp, tp)
            out = {}
            for z in (0, 1, 2, 3):
                modes = ("flat", "hierarchical") if (hier and z == 0) else ("flat",)
                best, per_dev = float("inf"), [float("inf")] * pp
                for mode in modes:
                    c = self._prec(ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1,
                                                  virtual_stages=v, zero_stage=z, dp_all_reduce=mode, cp=cp))
                    _prefill(self.system, c)
                    red = reduction_collective(z)
                    one = {k: dp_reduction_s(self.system, c, lay, red, ci, self.kinds) for k, ci in reps.items()}
                    per_chunk = [one[k] for k in keys]
                    sums = [sum(per_chunk[d::pp]) for d in range(pp)]
                    best = min(best, max(sums))
                    per_dev = [min(x, y) for x, y in zip(per_dev, sums)]
                # ZeRO-2/3 during the micro-batches (``data_parallel.per_micro_batch_s``): a chunk's
                # backward is at least its gradients' reduce-scatter (standard accumulation; in
                # buckets, at least one call's time), ZeRO-3's forward and backward at least the
                # gather of its parameters (per micro-batch, except layered accumulation at pp=1)
                rs = ag = [0.0] * (pp * v)
                if z >= 1:
                    c = self._prec(ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1,
                                                  virtual_stages=v, zero_stage=z, cp=cp))
                    one = {k: dp_reduction_s(self.system, c, lay, comm.reduce_scatter_s, ci, self.kinds)
                           for k, ci in reps.items()}
                    rs = [one[k] for k in keys]
                    n, axis = grad_group(c)
                    links = axis_links(self.system, c, axis)
                    one = {p: collective_s(self.system, links, comm.all_gather_s, n, p * gather_bytes(self.system, c))
                           for p in set(params)}
                    ag = [one[p] for p in params]
                out[z] = (best, [sum(rs[d::pp]) for d in range(pp)], [sum(ag[d::pp]) for d in range(pp)], per_dev)
            return out
        red = self.system.cached(("ttt-red", dp, pp, tp, v, cp, self.fp8), make)
        return [red[z] for z in zeros]

    def _chunk_experts(self, pp: int, tp: int, v: int) -> tuple:
        """Per chunk at ep = 1: its MoE blocks and all E experts' parameters of them on a rank
        (``layout.chunk_experts``); zeros for a dense model."""
        if not self.model.is_moe:
            return (0,) * (pp * v), (0.0,) * (pp * v)
        c = ParallelConfig(dp=1, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1, virtual_stages=v)
        return chunk_experts(self.system, c, Placement.of(c, self.model.num_layers).chunk_layers())

    def _micro_batch_dp_floor(self, point, m: int, red) -> float:
        """The busiest device's ZeRO-2/3 traffic over the micro-batches (see _reduction_floor)."""
        dp, pp, tp, mbs, sched, v, layered, cp = point
        z, (_, rs, ag, _) = red
        lay = layered or sched == "breadth_first"
        if dp * cp == 1 or z < 2:
            return 0.0
        if self.system.policy.fsdp_step_gather(z, pp, dp * cp):
            # gathered once per step and reduced after the last micro-batch (Policy.fsdp_step_gather)
            return max(r + (a if z == 3 else 0.0) for r, a in zip(rs, ag))
        per_mb = [0.0] * pp
        if not lay:
            per_mb = [r * (m - 1) / m for r in rs]
        if z == 3 and not (lay and pp == 1):
            per_mb = [x + 2 * a for x, a in zip(per_mb, ag)]
        return max(per_mb) * m

    def bounds(self, point, global_batch: int) -> dict:
        """{(sequence_parallel, recompute, zero): lower bound on the step time} for the inner
        choices whose memory floor fits (empty: nothing of the point can fit)."""
        import numpy as np
        dp, pp, tp, mbs, sched, v, layered, cp = point
        m = global_batch // (dp * mbs)
        zeros = (0, 1, 2, 3) if dp * cp > 1 else (0,)
        opts = self._options(tp, cp)
        rows = [self._per_layer(mbs, tp, sp, rc, cp) for sp, rc in opts]
        mrows = self._moe_rows(point, opts) if self.model.is_moe else None
        # a mixture of experts: every block's activations at least the lesser of a dense and an MoE block's
        acts = [min(r[6], mr[6]) for r, mr in zip(rows, mrows)] if mrows else [r[6] for r in rows]
        fits = self._memory_floors(point, m, acts, zeros) <= self.capacity
        if not fits.any():
            return {}
        keep = np.nonzero(fits.any(axis=1))[0]
        opt = self._optimizer_floor(point, zeros)
        red = self._reduction_floor(point, zeros)
        dp_mb = [self._micro_batch_dp_floor(point, m, (z, red[zi])) for zi, z in enumerate(zeros)]
        # where the queue of reductions has a known earliest start (see _floors); not pp = 1 layered
        # accumulation (its units finish one by one), nor interleaving (its chunks' last backwards
        # interleave with the cool-down)
        standard = dp * cp > 1 and ((v == 1 and (pp > 1 or not layered)) or sched == "breadth_first")
        # ZeRO-3 reduce-scatters inside each backward (``data_parallel.reduces_in_backward``): past
        # the last backward only a layer's is left, so its queue adds nothing to the floor there
        queued = [r[3] if z != 3 or self.system.policy.fsdp_step_gather(z, pp, dp * cp) else [0.0] * pp
                  for z, r in zip(zeros, red)]
        got = self._floors(point, m, [rows[i][:6] for i in keep], [self._p2p(point, opts[i][0]) for i in keep],
                           queued if standard else None,
                           [mrows[i][:6] for i in keep] if mrows else None)
        floors, tails = got if standard else (got, None)
        out = {}
        for j, i in enumerate(keep):
            sp, rc = opts[i]
            for zi, z in enumerate(zeros):
                if fits[i, zi]:
                    lb = max(floors[j], red[zi][0], dp_mb[zi], tails[j, zi] if standard else 0.0)
                    out[(sp, rc, z)] = float(lb + opt[zi])
        return out

    # -- the search ------------------------------------------------------------------------------
    def ep_choices(self, point, global_batch: int) -> tuple:
        """The expert-parallel degrees tried at ``point``: ``search``'s (1 for a dense model)."""
        return expert_parallel_choices(self.system, point, global_batch, self.precision)

    def points(self, world: int, global_batch: int) -> list:
        fw = self.system.framework
        out = []
        # (dp, pp, tp, mbs, schedule, v, layered, cp), cp as ``search`` chooses it
        cps = cp_choices(self.model, world, self.max_cp) if fw.cp_comm else (1,)
        for p in outer_space(self.model, world, global_batch, self.max_micro_batch, cps=cps):
            base = self._prec(point_config(p, 0, "none", False, global_batch))
            if fw.check(base) or check(base, self.model):
                continue
            out.append(p)
        return out

    def run(self, world: int, global_batch: int, seeds=()) -> tuple[dict, PointStats]:
        """{method name: best fitting Estimate or None} and what it took. ``seeds``: configurations
        (of any GPU count and batch) whose neighbours here are tried first."""
        t0 = time.perf_counter()
        st = PointStats()
        inc = {m.name: float("inf") for m in self.methods}
        best: dict = {m.name: None for m in self.methods}
        tried: set = set()

        def consider(c: ParallelConfig, lb: float | None = None) -> None:
            c = self._prec(c)
            if c.recompute_modules and self.system.framework.check(c):  # (FP8 delayed: search.framework_inner)
                c = dataclasses.replace(c, recompute_modules=recompute_module_fallback(c.recompute_modules))
            if c in tried:
                return
            tried.add(c)
            if c in self.oom:
                st.out_of_memory += 1
                return
            ms = [m for m in self.methods if m.admits(c)]
            if not ms or check(c, self.model) or self.system.framework.check(c):
                return
            bound = max(inc[m.name] for m in ms)
            if lb is not None and lb >= bound:
                st.bounded_out += 1
                return
            _prefill(self.system, c)
            e = estimate_on(c, self.system, bound=bound if bound < float("inf") else None, time_if_oom=False)
            st.estimates += 1
            if e is None:
                return
            if not e.fits:
                self.oom.add(c)
                return
            for m in ms:
                if e.step_time_s < inc[m.name]:
                    inc[m.name], best[m.name] = e.step_time_s, e

        for c in _neighbours(seeds, world, global_batch):
            if self.model.is_moe:  # search's expert-parallel degrees at the neighbour's point only
                eps = self.ep_choices((c.dp, c.pp, c.tp, c.micro_batch_size, c.schedule, c.virtual_stages,
                                       c.layered_grad_accum, c.cp), global_batch)
                if c.ep not in eps:
                    c = dataclasses.replace(c, ep=max((e for e in eps if e <= c.ep), default=eps[0]))
                # the System's dispatcher at the neighbour's degree, and the overlap only where it runs
                c = dataclasses.replace(c, moe_dispatcher=dispatcher_at(self.system, c.ep, c.tp))
                if c.ep_comm_overlap and ep_overlap_reason(c, self.model):
                    c = dataclasses.replace(c, ep_comm_overlap=None)
            consider(c)
        pts = self.points(world, global_batch)
        st.outer_points = len(pts)
        ranked = []
        for p in pts:
            b = self.bounds(p, global_batch)
            if b:
                ranked.append((min(b.values()), p, b))
            else:
                st.out_of_memory += 1
        ranked.sort(key=lambda x: x[0])
        for i, (lb, p, b) in enumerate(ranked):
            dp, pp, tp, mbs, sched, v, layered, cp = p
            ms = [m for m in self.methods if m.admits_outer(sched, v, layered)
                  and any(z <= m.max_zero for (_, _, z) in b)]
            if not ms:
                continue
            if lb >= max(inc.values()):
                st.bounded_out += len(ranked) - i
                break
            thr = max(inc[m.name] for m in ms)
            if lb >= thr:
                st.bounded_out += 1
                continue
            _prefill(self.system, ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1))
            hier = dp_hierarchical(self.system, dp, pp, tp) if dp > 1 else False
            inner = [(b[(c.sequence_parallel, c.recompute, c.zero_stage)], c)
                     for c in framework_inner(self.system.framework, dp, pp, tp, mbs, sched, v, layered,
                                              global_batch, hier, cp, moe_experts=self.model.num_experts,
                                              eps=self.ep_choices(p, global_batch), model=self.model,
                                              dispatcher=self.system.moe_dispatcher, precisions=(self.precision,))
                     if (c.sequence_parallel, c.recompute, c.zero_stage) in b]
            for clb, c in sorted(inner, key=lambda x: x[0]):
                consider(c, clb)
        st.seconds = time.perf_counter() - t0
        return best, st


