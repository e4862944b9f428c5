"""The evaluator of one outer point of the search: every inner choice (ZeRO, recomputation,
sequence parallelism, the framework's knobs) priced by the cost model, the fastest that fits kept.
"""

from __future__ import annotations

import dataclasses

from autoconf.cost.estimate import Estimate, estimate_on
from autoconf.cost.system import System
from autoconf.space.config import ParallelConfig, check, ep_overlap_reason
from autoconf.space.enumeration import make_config
from autoconf.study.choices import (
    compression_variants,
    dispatcher_at,
    dp_hierarchical,
    expert_parallel_choices,
    framework_inner,
)
from autoconf.study.result import _parse_pipeline
from autoconf.study.storage import config_digest


class Evaluator:
    """Evaluates outer points: the fastest fitting inner choices, counting rejections.

    ``top``: how many of the fastest configurations the search must return exactly. The bound a
    configuration is pruned against is the step time of the ``top``-th fastest fitting one known
    (over all outer points; see :attr:`incumbent`), so every configuration that can still be
    among the ``top`` fastest is simulated: the runners-up are the model's, not whatever the
    search happened to meet before the winner."""

    def __init__(self, ctx: System, global_batch: int, valid_per_point: dict, placer=None, top: int = 1,
                 precisions=(("bf16", "tensorwise"),), compression: tuple | None = None):
        self.ctx = ctx
        self.compression = compression
        """(pipeline-gradient rank, data-parallel rank) when lossy communication is allowed
        (:func:`compression_variants`), else None."""
        self.precisions = tuple(precisions)
        """(precision, FP8 recipe) pairs tried per configuration (:func:`precision_choices`)."""
        self.placer = placer
        """``study.placer.Placer``: every configuration is estimated with its heuristic placement."""
        self.valid_per_point = valid_per_point
        self.global_batch = global_batch
        self.top = max(1, int(top))
        self.rejected: dict = {}
        self.estimates = 0
        self.pruned = 0
        self.smallest: Estimate | None = None
        self._kept: list = []
        """(step time, outer point, Estimate or config digest) of the ``top`` fastest fitting
        configurations known, fastest first."""
        self.dominated = 0
        self.points: list = []
        """(config, step time, peak memory bytes, fits) of every estimate."""
        self.bound_used: float | None = None
        """The smallest bound that decided anything in the last call (the point pruned whole, or
        some of its inner choices), None if none did: whatever it skipped is at least this slow,
        so its outcome holds for any search whose ``top``-th best is no slower."""

    @property
    def incumbent(self) -> float:
        """The bound: step time of the ``top``-th fastest fitting configuration known (inf until
        ``top`` are known). A configuration whose least work is slower cannot be among the top."""
        return self._kept[-1][0] if len(self._kept) >= self.top else float("inf")

    def offer(self, point, entries) -> None:
        """The fitting configurations known for ``point``, as (step time, Estimate or config
        digest): all of them, replacing what was offered for it before, so a point evaluated
        again is not counted twice."""
        kept = [x for x in self._kept if x[1] != point]
        kept.extend((t, point, ident) for t, ident in entries)
        kept.sort(key=lambda x: x[0])
        self._kept = kept[:self.top]

    def kept(self) -> list:
        """[step time, outer point, config digest] of the ``top`` fastest fitting configurations known."""
        return [[t, p, ident if isinstance(ident, str) else config_digest(ident.config)] for t, p, ident in self._kept]

    def reevaluate(self, point) -> list:
        """The fitting configurations of a point evaluated by an earlier run (which stored only its
        best): bounded by the other points' times, not its own."""
        self._kept = [x for x in self._kept if x[1] != point]
        rejected = dict(self.rejected)
        fits, _ = self(point)
        self.rejected = rejected  # counted by the run that stored it
        return fits

    def _dominated(self, point) -> bool:
        """Whether even the least work of this point is slower than the incumbent: then no inner
        choice can beat it. Least work: no recomputation, either sequence-parallel setting, the
        ZeRO stages of which one has the least (``_least_work_zero_stages``), every precision and
        expert-parallel degree tried; each bounded by the pipeline floor plus the optimizer step
        (``cost.bounds.lower_bound``)."""
        dp, pp, tp, mbs, sched, v, layered, cp = point
        fw = self.ctx.framework
        zeros = self._least_work_zero_stages(point)
        # tp_comm_overlap is not always cheaper: its chunked GEMMs can cost more than the
        # collectives they hide (tensor_parallel.overlapped), so both settings are bounds
        tpos = (False, True) if "tp_comm_overlap" in fw.knobs else (None,)
        for sp, tpo, zero in ((s_, o, z) for s_ in ((False, True) if tp > 1 else (False,)) for o in tpos
                              for z in zeros if s_ or not o):
            c = make_config(dp, pp, tp, mbs, sched, v, layered, zero, "none", sp, self.global_batch, cp)
            # the other switchable knobs at their cheapest (overlap on), so the bound stays a lower bound
            c = dataclasses.replace(c, **{k: (tpo if k == "tp_comm_overlap" else True) for k in fw.knobs})
            # the cheapest precision and expert-parallel degree are not known in advance
            for prec, ep in ((p_, e) for p_ in self.precisions for e in self._eps_of(point)):
                cc = dataclasses.replace(c, precision=prec[0], fp8_recipe=prec[1], ep=ep,
                                         moe_dispatcher=dispatcher_at(self.ctx, ep, tp))
                if "ep_comm_overlap" in fw.knobs:  # on where it can be: it only hides time
                    cc = dataclasses.replace(cc, ep_comm_overlap=ep_overlap_reason(cc, self.ctx.model) is None)
                # (not filtered by the framework's own check: a stage it refuses here only
                # loosens the bound, while refusing them all would prune the point unseen)
                if check(cc, self.ctx.model) is None and estimate_on(self._placed(cc), self.ctx,
                                                                   bound=self.incumbent) is not None:
                    return False
        return True

    def _least_work_zero_stages(self, point) -> list:
        """The ZeRO stages of which one has the least pipeline floor plus optimizer step at
        ``point`` (the bound ``_dominated`` takes): ZeRO-1, which stands for ZeRO-0 too (the same
        floor, its step sharded) whether or not the framework runs it; and ZeRO-2 where the
        framework runs it and charges autograd's own accumulation pass, which ZeRO-2 escapes
        (``Policy.accumulates``: data parallelism outside layered accumulation). ZeRO-3 has
        ZeRO-2's floor and its gathers besides. (Over the whole step the order can differ, e.g.
        DeepSpeed's ZeRO-1 gathers after the step in the open; the floor leaves the tail out.)"""
        dp, pp, tp, mbs, sched, v, layered, cp = point
        fw = self.ctx.framework
        if dp * cp == 1:
            return [0]
        stages = fw.zero_stages_with_pp if pp > 1 else fw.zero_stages
        escapes = (fw.grad_accumulation_kernel or fw.bf16_optimizer_with_pp) and not layered
        return [1] + ([2] if escapes and 2 in stages else [])

    def _eps_of(self, point) -> tuple:
        """The expert-parallel degrees tried at an outer point (:func:`expert_parallel_choices`)."""
        return expert_parallel_choices(self.ctx, point, self.global_batch, self.precisions[0])

    def __call__(self, point) -> tuple[list, Estimate | None]:
        """(the fitting estimates of this point that can be among the ``top`` fastest, fastest
        first; the least-memory estimate). ``([], None)`` when the bound dominated it whole."""
        dp, pp, tp, mbs, sched, v, layered, cp = point
        fits: list = []
        least = None
        self.bound_used = None
        if self.incumbent < float("inf") and self._dominated(point):
            self.dominated += self.valid_per_point.get(point, 0)
            self.bound_used = self.incumbent
            return [], None
        for c in framework_inner(self.ctx.framework, dp, pp, tp, mbs, sched, v, layered, self.global_batch,
                                 dp_hierarchical(self.ctx, dp, pp, tp), cp, self.precisions,
                                 self.ctx.model.num_experts, self._eps_of(point), self.ctx.model,
                                 self.ctx.moe_dispatcher):
            if check(c, self.ctx.model):
                continue
            # memory first (no simulation when it cannot fit); skip the schedule simulation when
            # the busiest device's work alone is slower than the top-th best found (branch and bound)
            bound = self.incumbent
            bound = bound if bound < float("inf") else None
            placed = self._placed(c)
            e = estimate_on(placed, self.ctx, bound=bound, time_if_oom=False)
            if e is not None and not e.fits and placed.stage_layers is not None:
                # more layers on the faster stages can overflow their memory: the even split may fit
                e = estimate_on(dataclasses.replace(placed, stage_layers=None), self.ctx, bound=bound,
                              time_if_oom=False)
            if placed != c:  # never worse than the cluster file's own order: the unplaced one too
                plain = estimate_on(c, self.ctx, bound=bound, time_if_oom=False)
                if plain is not None and (e is None or (plain.fits, -plain.step_time_s) > (e.fits, -e.step_time_s)):
                    e = plain
            if e is None:
                self.pruned += 1
                self.bound_used = bound  # the bound only tightens: the last one used is the smallest
                continue
            self.estimates += 1
            self.points.append((e.config, e.step_time_s, e.peak_memory_bytes, e.fits))
            if least is None or e.memory_excess_bytes < least.memory_excess_bytes:
                least = e
            if e.fits:
                fits.append(e)
                fits.sort(key=lambda x: x.step_time_s)
                del fits[self.top:]
                self.offer(point, [(f.step_time_s, f) for f in fits])
            else:
                self.rejected["out of memory"] = self.rejected.get("out of memory", 0) + 1
        if self.compression is not None and fits:
            fits = self._compress(point, fits)
        if least is not None and (self.smallest is None or least.memory_excess_bytes < self.smallest.memory_excess_bytes):
            self.smallest = least
        return fits, least

    def _placed(self, c: ParallelConfig) -> ParallelConfig:
        return self.placer(c) if self.placer is not None else c

    def _compress(self, point, fits: list) -> list:
        """The point's fastest configuration with compressed traffic too: one choice at a time
        (fused embedding sync, then the pipeline-gradient mode, then the data-parallel stages),
        each kept where it is faster and still fits (compression only changes communication, its
        kernels and buffers, so the choices barely interact). Returns the point's fits with the
        compressed ones offered among them."""
        best = fits[0]
        for group in compression_variants(best.config, self.ctx.model, *self.compression):
            base = best.config
            for kw in group:
                c = dataclasses.replace(base, **kw)
                if c == best.config or check(c, self.ctx.model) or self.ctx.framework.check(c):
                    continue
                e = estimate_on(c, self.ctx)
                self.estimates += 1
                self.points.append((e.config, e.step_time_s, e.peak_memory_bytes, e.fits))
                if e.fits and e.step_time_s < best.step_time_s:
                    best = e
        if best is fits[0]:
            return fits
        fits = sorted(fits + [best], key=lambda x: x.step_time_s)[:self.top]
        self.offer(point, [(f.step_time_s, f) for f in fits])
        return fits


class _Repair:
    """Map a sampled (tp, pp, micro-batch size, pipeline) to the nearest valid outer point.

    The axes are coupled (dp = world / (pp x tp); micro-batch sizes and chunk counts depend on the
    others), so TPE samples them independently and each sample is projected: nearest tp (in log
    scale), then the nearest pp valid with it, then micro-batch size, then the same schedule with
    the nearest v.
    """

    def __init__(self, key_of: dict):
        self.tree: dict = {}
        for k in key_of:
            self.tree.setdefault(k[0], {}).setdefault(k[5], {}).setdefault(k[1], {}).setdefault(k[3], []).append(k)
        self.memo: dict = {}

    @staticmethod
    def _nearest(options, want):
        import math
        return min(options, key=lambda o: (abs(math.log2(o) - math.log2(want)), o))

    def __call__(self, params: dict) -> tuple:
        sig = (params["tp"], params["pp"], params["micro_batch_size"], params["pipeline"], params.get("cp", 1))
        if sig in self.memo:
            return self.memo[sig]
        by_tp = self.tree[self._nearest(self.tree, params["tp"])]
        by_cp = by_tp[self._nearest(list(by_tp), params.get("cp", 1))]
        by_pp = by_cp[self._nearest(list(by_cp), params["pp"])]
        keys = by_pp[self._nearest(list(by_pp), params["micro_batch_size"])]
        sched, v, layered = _parse_pipeline(params["pipeline"])

        def dist(k):
            s2, v2, l2 = _parse_pipeline(k[4])
            return (s2 != sched) * 100 + abs(v2 - v) + (l2 != layered) * 10
        out = self.memo[sig] = min(keys, key=dist)
        return out


def _bound_s(t) -> float:
    """The bound that decided part of a stored trial's outcome (see ``Evaluator.bound_used``);
    inf when none did (the outcome holds for any ``top``). A pruned trial from before the bound
    was recorded this way: the incumbent it was dominated by."""
    b = t.user_attrs.get("bound_s")
    if b is None and t.user_attrs.get("fits") is None:
        b = t.user_attrs.get("dominated_by_s")
    return float("inf") if b is None else float(b)
