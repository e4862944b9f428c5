"""The per-point optimiser of ``plan`` (:class:`PointOptimizer`): the exact best configuration of
the cost model's space at one GPU count and batch, by lower bounds on every inner choice and
warm-started incumbents.
"""

from __future__ import annotations

import dataclasses
import time

from autoconf.cost.bounds import (
    block_floor,
    chunk_rows,
    edge_floors,
    even_chunk_experts,
    live_sets,
    memory_floors,
    optimizer_floors,
    reduction_floors,
    reduction_queues,
    stage_params,
    step_floors,
    time_floors,
)
from autoconf.cost.estimate import estimate_on
from autoconf.cost.layout import chunk_params
from autoconf.cost.moe import a2a_times
from autoconf.cost.schedule_time import boundary_bytes, p2p_times
from autoconf.cost.system import System
from autoconf.space.config import RECOMPUTE, ParallelConfig, check, ep_overlap_reason
from autoconf.space.enumeration import MAX_VIRTUAL, cp_choices, outer_space, point_config
from autoconf.space.placement import even_layers
from autoconf.study.choices import (
    dispatcher_at,
    dp_hierarchical,
    ep_degrees,
    expert_parallel_choices,
    framework_inner,
    recompute_module_choices,
    recompute_module_fallback,
)
from autoconf.timetotrain.points import PointStats, _neighbours
from autoconf.timetotrain.synthetic import METHODS, _prefill


class PointOptimizer:
    """The fastest fitting configuration for each method, at one GPU count and batch: exact for
    the cost model over ``search``'s space (``enumeration.outer_space`` x ``study.choices.framework_inner``,
    no placement search).

    Two cheap bounds decide most of the space without an estimate, both true bounds of what
    ``cost.estimate`` computes (``cost.bounds``, each floor's docstring says why; the tests check
    them against it); this class gathers their inputs per point and caches them on the System:

    - time: ``schedule_time.pipeline_floor`` over chunks made of their blocks' least compute per
      micro-batch, plus the optimizer step (``bounds.time_floors``, ``bounds.step_floors``);
    - memory: parameters and optimizer state of the busiest stage plus the fewest activations its
      schedule keeps alive at its peak, the runtime context and the pipeline runtime's receive
      buffers (``bounds.memory_floors``).
    """

    def __init__(self, system: System, methods=METHODS, max_micro_batch: int = 64, precision: tuple = ("bf16", "tensorwise"),
                 max_cp: int | None = None, max_virtual: int | None = MAX_VIRTUAL):
        self.system = system
        self.max_cp = max_cp
        """Largest context-parallel degree (``enumeration.cp_choices``; None: its default by sequence)."""
        self.precision = precision
        """(precision, FP8 recipe) of every configuration (``study.choices.precision_choices``)."""
        self.fp8 = precision[1] if precision[0] == "fp8" else None
        self.model = system.model
        self.methods = tuple(methods)
        self.max_micro_batch, self.max_virtual = max_micro_batch, max_virtual
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

    # -- bounds (the floors are ``cost.bounds``'; the caches per point are here) ------------------
    def _options(self, tp: int, cp: int = 1) -> list:
        sps = (False, True) if tp > 1 and (self.model.seq_length // cp) % tp == 0 else (False,)
        return [(sp, rc) for sp in sps for rc in RECOMPUTE]

    def _per_layer(self, mbs: int, tp: int, sp: bool, rc: str, cp: int = 1, ep: int = 0) -> tuple:
        """``bounds.block_floor`` of one block per micro-batch on a rank's s/cp tokens: least over
        device kinds, compile modes and, with selective recomputation, what it may recompute
        (``study.choices.recompute_module_choices``, and what FP8 delayed scaling leaves of them:
        ``framework_inner``). ``ep`` > 0: a mixture of experts' MoE block with its experts over
        ``ep`` ranks instead (its all-to-alls are the caller's, ``_moe_rows``)."""

        def make():
            c = self._prec(ParallelConfig(dp=1, pp=1, tp=tp, micro_batch_size=mbs, num_micro_batches=1,
                                          recompute=rc, sequence_parallel=sp, cp=cp))
            mods = ((),)
            if rc == "selective":
                choices = recompute_module_choices(self.system.framework, self.model)
                mods = tuple(set(choices) | {recompute_module_fallback(md) for md in choices})
            return block_floor(self.system, c, self.kinds, self.compiled, self.fp8, mods, ep)
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

    def _chunks(self, pp: int, tp: int, v: int, mbs: int, cp: int = 1):
        """``bounds.chunk_rows`` of the even split."""
        def edges():
            return self.system.cached(("ttt-edges", mbs, tp, cp), lambda: edge_floors(self.system, self.kinds, mbs, tp, cp))
        return self.system.cached(("ttt-chunks", pp, tp, v, mbs, cp), lambda: chunk_rows(
            self.model.num_layers, pp, v, edges(), even_chunk_experts(self.system, pp, tp, v)[0]))

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

    def _max_ep(self, point) -> int:
        """The largest expert-parallel degree any configuration of ``point`` runs (1 for a dense
        model): the least routed-expert parameters per rank."""
        dp, pp, tp, mbs, sched, v, layered, cp = point
        m = self.model
        if not m.is_moe or not self.system.framework.expert_parallel:
            return 1
        return max(ep_degrees(dp * cp, m.num_experts))

    def _stage_params(self, pp: int, tp: int, v: int, ep: int = 1):
        """``bounds.stage_params``, cached."""
        return self.system.cached(("ttt-stage", pp, tp, v, ep), lambda: stage_params(self.system, pp, tp, v, ep))

    def _live(self, sched: str, pp: int, m: int, v: int, layered: bool):
        """``bounds.live_sets``."""
        return live_sets(self.system, sched, pp, m, v, layered)

    def _memory_floors(self, point, m: int, acts, zeros):
        """``bounds.memory_floors`` at ``point``: an array of (options x zeros) for the per-block
        activation bytes ``acts`` of each option."""
        dp, pp, tp, mbs, sched, v, layered, cp = point
        stage = self._stage_params(pp, tp, v, self._max_ep(point))
        live = self._live(sched, pp, m, v, layered)
        return memory_floors(self.system, point, m, acts, zeros, stage, live, self.kinds)

    def _optimizer_floor(self, point, zeros):
        """``bounds.optimizer_floors`` at ``point``."""
        dp, pp, tp, mbs, sched, v, layered, cp = point
        params = self._stage_params(pp, tp, v, self._max_ep(point))[0]
        return optimizer_floors(self.system, point, self.kinds, params, zeros)

    def _reduction_floor(self, point, zeros) -> list:
        """Per ZeRO stage: ``bounds.reduction_floors``, its chunks' parameters those of the even split."""
        dp, pp, tp, mbs, sched, v, layered, cp = point
        if dp * cp == 1:
            return [(0.0, [0.0] * pp, [0.0] * pp, [0.0] * pp) for _ in zeros]

        def make():
            layers = even_layers(self.model.num_layers, pp * v)
            params = chunk_params(self.system, ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1,
                                                              num_micro_batches=1, virtual_stages=v), layers)
            # a mixture of experts: its dense parameters only (``bounds.reduction_floors``)
            params = [p - e for p, e in zip(params, even_chunk_experts(self.system, pp, tp, v)[1])]
            _prefill(self.system, ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1, cp=cp))
            hier = dp_hierarchical(self.system, dp, pp, tp)
            return reduction_floors(self.system, point, self.kinds, params, hier, self.precision)
        red = self.system.cached(("ttt-red", dp, pp, tp, v, cp, self.fp8), make)
        return [red[z] for z in zeros]

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
        queued = reduction_queues(self.system, point, zeros, red)
        p2p = [self._p2p(point, opts[i][0]) for i in keep]
        got = time_floors(point, m, self._chunks(pp, tp, v, mbs, cp), [rows[i][:6] for i in keep], self.speedup,
                          self.tp_overlap, p2p, queued, [mrows[i][:6] for i in keep] if mrows else None)
        floors, tails = got if queued is not None else (got, None)
        lbs = step_floors(self.system, point, m, zeros, floors, red, opt, tails)
        return {(opts[i][0], opts[i][1], z): lbs[j][zi] for j, i in enumerate(keep) for zi, z in enumerate(zeros)
                if fits[i, zi]}

    # -- the search ------------------------------------------------------------------------------
    def ep_choices(self, point, global_batch: int) -> tuple:
        """The expert-parallel degrees tried at ``point``: ``search``'s (1 for a dense model)."""
        return expert_parallel_choices(self.system, point, global_batch, self.precision)

    def points(self, world: int, global_batch: int) -> list:
        fw = self.system.framework
        out = []
        # (dp, pp, tp, mbs, schedule, v, layered, cp), cp as ``search`` chooses it
        cps = cp_choices(self.model, world, self.max_cp) if fw.cp_comm else (1,)
        for p in outer_space(self.model, world, global_batch, self.max_micro_batch, cps=cps,
                             max_virtual=self.max_virtual):
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


