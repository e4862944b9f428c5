"""search: an Optuna study over the configuration space, ranked by the cost model.

The space is split in two:

- the *outer* choices (tp, pp, dp, micro-batch size, schedule with its chunks and layered flag)
  are what the study samples: each Optuna trial is one outer point;
- the *inner* memory savers (ZeRO stage, recomputation, sequence parallelism, the framework's
  knobs) are searched exhaustively inside a trial (24 cheap estimates or more); the trial records
  the fastest that fits in its user attributes (optuna-dashboard shows them) and its memory
  excess as the constraint (negative: fits).

When the outer space is no bigger than the trial budget every point is evaluated (brute force).
Otherwise a constrained TPE sampler explores it for the budget (seeded with every point already
in the study) and then every remaining point is evaluated by branch and bound: a configuration
whose least possible work (``schedule_time.pipeline_floor`` plus the optimizer step; a true lower
bound for every schedule) is already slower than the ``top``-th fastest found is skipped without
simulating its schedule. The result is the model's exhaustive ``top`` fastest configurations (the
runners-up included, so ``--verify K`` checks the real K best), at a fraction of the cost
(``--sample-only`` stops after the sampler).

Trials are sampled in memory (about 2 ms each) and, with a storage (``sqlite:///file.db``; the
library keeps nothing by default, the CLI keeps a file), written in batches, so an interrupted
search keeps what it finished and a rerun with the same inputs resumes: the default study name
carries a fingerprint of them (model, cluster, profile content, calibration, framework, batch,
devices, space options), and points already in the study are not evaluated again. An outcome the
bound decided holds for the ``top`` it was taken for (stored with it) and smaller ones; a rerun
asking for more evaluates those points again."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from dataclasses import dataclass, field

from .config import (RECOMPUTE_MODULES, ParallelConfig, check, cp_choices, ep_overlap_reason, inner_choices,
                     make_config, outer_space, recompute_modules_reason)
from .cost import comm
from .cost.data_parallel import reduction_collective
from .cost.estimate import Estimate, _estimate
from .cost.system import System
from .errors import UserError
from .procs import deferred_signals

PARAMS = ("tp", "pp", "dp", "micro_batch_size", "pipeline", "cp")


@dataclass(frozen=True)
class SearchResult:
    top: tuple
    """The best Estimates that fit, fastest first (at most ``top`` of them)."""
    rejected: dict
    """Why configurations were rejected: reason -> count (invalid ones, and out of memory)."""
    space_size: int
    """Configurations in the whole space (valid and invalid)."""
    valid: int
    outer_points: int
    trials_run: int
    """Trials this run added to the study (dominated points of the sweep are counted, not stored)."""
    trials_total: int
    """Trials in the study after this run (including earlier runs)."""
    estimates: int
    sampler: str
    study_name: str
    storage: str | None
    elapsed_s: float
    smallest_memory: Estimate | None = None
    """When nothing fits: the configuration needing the least memory."""
    notes: tuple = field(default_factory=tuple)
    placement: tuple = ()
    """With placement search: one dict per entry of ``top`` (``place.Placer.outcome``): the step
    time in the default order with the even split, after the heuristic and after the local search,
    and each stage's hosts, devices and layers."""
    placement_s: float = 0.0
    """Seconds of ``elapsed_s`` the placement's local search took."""
    evaluated: tuple = ()
    """Every configuration this run estimated, as ``(config, step time, peak memory bytes, fits)``
    (the step time is inf where it does not fit: its schedule was not simulated), then the
    configuration each earlier run's trial recorded (its memory rounded to 1 MiB). Not in
    ``to_dict``; for the time-versus-memory picture (``plots``)."""
    resumed: bool = False
    """Whether the study existed before this run (same inputs: its trials were reused)."""
    earlier_trials: int = 0
    """Trials of earlier runs this one reused (not evaluated again)."""

    def to_dict(self) -> dict:
        return {"top": [e.to_dict() for e in self.top], "rejected": dict(self.rejected),
                "space_size": self.space_size, "valid": self.valid, "outer_points": self.outer_points,
                "trials_run": self.trials_run, "trials_total": self.trials_total,
                "estimates": self.estimates, "sampler": self.sampler, "study_name": self.study_name,
                "storage": self.storage, "elapsed_s": self.elapsed_s,
                "smallest_memory": self.smallest_memory.to_dict() if self.smallest_memory else None,
                "notes": list(self.notes), "placement": list(self.placement), "placement_s": self.placement_s,
                "resumed": self.resumed, "earlier_trials": self.earlier_trials}


def _pipeline_label(sched: str, v: int, layered: bool) -> str:
    s = sched if v == 1 else f"{sched}-v{v}"
    return s + "-layered" if layered and sched != "breadth_first" else s


def outer_params(c: ParallelConfig) -> dict:
    """The study parameters of the outer point a configuration belongs to (its trial's ``params``)."""
    return {"tp": c.tp, "pp": c.pp, "dp": c.dp, "micro_batch_size": c.micro_batch_size,
            "pipeline": _pipeline_label(c.schedule, c.virtual_stages, c.layered_grad_accum), "cp": c.cp}


def _parse_pipeline(label: str) -> tuple[str, int, bool]:
    layered = label.endswith("-layered")
    label = label.removesuffix("-layered")
    sched, _, v = label.partition("-v")
    return sched, int(v) if v else 1, layered or sched == "breadth_first"


class _Evaluator:
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
        """``place.Placer``: every configuration is estimated with its heuristic placement."""
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
        (``cost.estimate._lower_bound``)."""
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
                if check(cc, self.ctx.model) is None and _estimate(self._placed(cc), self.ctx,
                                                                   bound=self.incumbent) is not None:
                    return False
        return True

    def _least_work_zero_stages(self, point) -> list:
        """The ZeRO stages of which one has the least pipeline floor plus optimizer step at
        ``point`` (the bound ``_dominated`` takes): ZeRO-1, which stands for ZeRO-0 too (the same
        floor, its step sharded) whether or not the framework runs it; and ZeRO-2 where the
        framework runs it and charges autograd's own accumulation pass, which ZeRO-2 escapes
        (``System.accumulates``: data parallelism outside layered accumulation). ZeRO-3 has
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
            e = _estimate(placed, self.ctx, bound=bound, time_if_oom=False)
            if e is not None and not e.fits and placed.stage_layers is not None:
                # more layers on the faster stages can overflow their memory: the even split may fit
                e = _estimate(dataclasses.replace(placed, stage_layers=None), self.ctx, bound=bound,
                              time_if_oom=False)
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
                e = _estimate(c, self.ctx)
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


def precision_choices(system: System, precision: str = "auto", fp8_recipe: str | None = None) -> tuple:
    """The (precision, FP8 recipe) pairs a search tries: bf16 (the model's dtype), and FP8 where
    asked ("auto" or "fp8") and every device of the cluster and the framework run it (with "auto"
    only where the devices' FP8 rate beats the model dtype's: not on CPUs, which emulate it), with
    ``fp8_recipe`` or else the framework's first recipe the devices run (MXFP8 needs Blackwell).
    A one-line error where "fp8" is asked and cannot run."""
    from .config import FP8_RECIPES
    if precision not in ("auto", "bf16", "fp8"):
        raise UserError(f"--precision {precision!r}; valid: auto, bf16, fp8")
    if fp8_recipe is not None and fp8_recipe not in FP8_RECIPES:
        raise UserError(f"--fp8-recipe {fp8_recipe!r}; valid: {', '.join(FP8_RECIPES)}")
    bf16 = ("bf16", "tensorwise")
    if precision == "bf16":
        return (bf16,)
    fw = system.framework
    kinds = sorted(set(system.topology.kind_of))
    from .catalog import device_type

    def runs(recipe, faster: bool):
        dtype = "mxfp8" if recipe == "mxfp8" else "fp8"
        return recipe in fw.fp8_recipes and all(
            device_type(k).supports(dtype)
            and (not faster or device_type(k).peak(dtype) > device_type(k).peak(system.model.dtype)) for k in kinds)
    recipes = [fp8_recipe] if fp8_recipe else list(fw.fp8_recipes)
    # auto: only where FP8 can be faster (tensor cores above the model dtype's rate; a CPU
    # emulates FP8 at its fp32 rate); asked for, wherever it runs
    ok = [r for r in recipes if runs(r, precision == "auto")]
    if not ok:
        if precision == "fp8":
            why = (f"framework {fw.name} has no FP8" if not fw.fp8_recipes else
                   f"framework {fw.name} runs {', '.join(fw.fp8_recipes)}" if fp8_recipe and fp8_recipe not in fw.fp8_recipes
                   else f"device {', '.join(kinds)} has no {'MXFP8' if fp8_recipe == 'mxfp8' else 'FP8'} tensor cores")
            raise UserError(f"--precision fp8{f' --fp8-recipe {fp8_recipe}' if fp8_recipe else ''}: {why}; "
                            "use --precision bf16")
        return (bf16,)
    fp8 = ("fp8", ok[0])
    return (fp8,) if precision == "fp8" else (bf16, fp8)


def compression_variants(c: ParallelConfig, model, pp_rank: int, dp_rank: int) -> list:
    """Groups of field settings tried in turn on a point's best configuration when lossy
    communication is allowed (the best of each group is kept before the next). The ranks are the
    user's (a quality budget: a lower rank is always cheaper to send); the search picks what to
    compress: the fused embedding sync, the pipeline-gradient mode, the data-parallel stages (the
    powers of two below pp, and pp: the first k pipeline ranks, whose reductions the pipeline
    hides least)."""
    out = []
    if model.tied_embeddings and c.pp > 1:
        out.append([{"fused_embedding_sync": True}])
    if c.pp > 1:
        out.append([{"pp_compression": mode, "pp_compression_rank": pp_rank} for mode in ("epilogue", "all")])
    if c.dp * c.cp > 1 and c.zero_stage <= 1:
        ks = sorted({k for k in (2 ** i for i in range(8)) if k < c.pp} | {c.pp})
        out.append([{"dp_compression_stages": k, "dp_compression_rank": dp_rank} for k in ks])
    return out


def compression_savings(result_top, ctx: System) -> list:
    """One line per compressed configuration among ``result_top``: what compression saved against
    the same configuration without it."""
    from .config import COMPRESSION_FIELDS
    lines = []
    for i, e in enumerate(result_top, 1):
        if not (e.config.compressed or e.config.fused_embedding_sync):
            continue
        plain = _estimate(dataclasses.replace(e.config, **COMPRESSION_FIELDS), ctx)
        lines.append(f"#{i} compresses its traffic: {e.step_time_s:.3f} s/step against {plain.step_time_s:.3f} s "
                     f"without ({(plain.step_time_s - e.step_time_s) / plain.step_time_s:.1%} saved"
                     + (f"; pp_comm {plain.breakdown_s['pp_comm']:.3f} -> {e.breakdown_s['pp_comm']:.3f} s"
                        if e.config.pp_compression != "none" else "")
                     + (f"; dp_comm {plain.breakdown_s['dp_comm']:.3f} -> {e.breakdown_s['dp_comm']:.3f} s"
                        if e.config.dp_compression_stages or e.config.fused_embedding_sync else "") + ")")
    return lines


def dp_hierarchical(system: System, dp: int, pp: int, tp: int) -> bool:
    """Whether ``dp_all_reduce="hierarchical"`` can change anything for (dp, pp, tp) in the
    default rank order: the framework runs one, and some data-parallel group spans several hosts
    with the same number of its ranks on each (elsewhere the trainer falls back to flat)."""
    from .cost.tensor_parallel import axis_links
    from .frameworks import hierarchical_runs

    if dp == 1 or "hierarchical" not in system.framework.all_reduce_algorithms:
        return False
    c = ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=1)
    return any(hierarchical_runs(g) for g in axis_links(system, c, "dp"))


def ep_degrees(ranks: int, experts: int) -> list:
    """Expert-parallel degrees possible over ``ranks`` (dp x cp) ranks: those dividing both it and
    the expert count."""
    return [k for k in range(1, ranks + 1) if ranks % k == 0 and experts % k == 0]


def dispatcher_at(system: System, ep: int, tp: int) -> str:
    """The token dispatcher a configuration of ``ep`` and ``tp`` gets in ``search`` and ``plan``:
    the System's where it can be priced (ep > 1; DeepEP at tp 1, ``config.check``), else alltoall."""
    if ep == 1 or (system.moe_dispatcher == "deepep" and tp > 1):
        return "alltoall"
    return system.moe_dispatcher


def expert_parallel_choices(system: System, point, global_batch: int,
                            precision: tuple = ("bf16", "tensorwise")) -> tuple:
    """The expert-parallel degrees tried at an outer point (1 for dense models): of those dividing
    dp x cp and the experts, the two whose steps are fastest with the plainest memory savers (ZeRO-1
    where the framework has it, no recomputation, ``precision``: the other choices can reorder
    close ones) and the largest (the least expert memory), so ep is weighed against tp and dp
    without multiplying every inner choice by every degree; each degree at its faster of
    ``ep_comm_overlap`` off and on where the framework can switch it. ``search`` and ``plan`` try
    the same ones (cached on the System)."""
    m, fw = system.model, system.framework
    dp, pp, tp, mbs, sched, v, layered, cp = point
    if not m.num_experts or not fw.expert_parallel:
        return (1,)

    def make():
        eps = ep_degrees(dp * cp, m.num_experts)
        stages = fw.zero_stages_with_pp if pp > 1 else fw.zero_stages
        zero = next((z for z in (1, 0, 2, 3) if z in stages and (z == 0 or dp * cp > 1)), 0)
        base = make_config(dp, pp, tp, mbs, sched, v, layered, zero, "none", False, global_batch, cp)
        base = dataclasses.replace(base, precision=precision[0], fp8_recipe=precision[1])
        timed = []
        for k in eps:
            c = dataclasses.replace(base, ep=k, moe_dispatcher=dispatcher_at(system, k, tp))
            if check(c, m) is None and fw.check(c) is None:
                t = _estimate(c, system).step_time_s
                on = dataclasses.replace(c, ep_comm_overlap=True)  # hidden all-to-alls favour other degrees
                if "ep_comm_overlap" in fw.knobs and check(on, m) is None:
                    t = min(t, _estimate(on, system).step_time_s)
                timed.append((t, k))
        return tuple(sorted({k for _, k in sorted(timed)[:2]} | {eps[-1]})) if timed else (eps[-1],)
    return system.cached(("ep-choices", tuple(point), global_batch, tuple(precision), system.moe_dispatcher), make)


def recompute_module_choices(fw, model) -> tuple:
    """The ``recompute_modules`` values tried with recompute="selective": the framework's own
    selective recomputation (empty: the attention core) and, where the framework lets a user
    choose (Megatron-LM's ``--recompute-modules``) and the model has modules beyond the core,
    all of those (the norms before the experts or MLA's down-projections, the experts'
    activation, MLA's up-projections). With eager attention the second also recomputes the core;
    with fused (flash) attention the core alone is not tried at all, since a recomputed core frees
    only its log-sum-exp there (it is slower than no recomputation for no memory that matters),
    so the space keeps its size."""
    if model is None or not fw.recompute_modules:
        return ((),)
    return _module_choices(fw.recompute_modules, model)


@functools.lru_cache(maxsize=64)
def _module_choices(offered: tuple, model) -> tuple:
    """:func:`recompute_module_choices` for a framework offering ``offered`` (once per model:
    ``framework_inner`` asks at every outer point)."""
    probe = ParallelConfig(dp=1, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1, recompute="selective")
    extra = tuple(m for m in RECOMPUTE_MODULES if m != "core_attn" and m in offered
                  and recompute_modules_reason(dataclasses.replace(probe, recompute_modules=(m,)), model) is None)
    if not extra:
        return ((),)
    return ((), ("core_attn",) + extra) if model.attention == "eager" else (extra,)


def recompute_module_fallback(mods: tuple) -> tuple:
    """``mods`` without the modules Megatron-LM refuses under FP8 delayed scaling (moe_act,
    layernorm); the attention core alone where none is left."""
    rest = tuple(m for m in mods if m not in ("moe_act", "layernorm"))
    return () if rest in ((), ("core_attn",)) else rest


def framework_inner(fw, dp, pp, tp, mbs, sched, v, layered, global_batch, dp_hier: bool = False, cp: int = 1,
                    precisions=(("bf16", "tensorwise"),), moe_experts: int = 0, eps=None, model=None,
                    dispatcher: str = "alltoall"):
    """The inner configurations of an outer point that framework ``fw`` can run: ZeRO stages it
    has, every recompute mode, sequence parallelism, and both values of each knob it lets a user
    switch where the knob matters (overlap_grad_reduce with dp > 1 where the framework applies it,
    ``Framework.can_overlap_grad_reduce``; overlap_param_gather with
    ZeRO, tp_comm_overlap with sequence parallelism, ep_comm_overlap where ``config.ep_overlap_reason``
    allows it for ``model``); other knobs stay at the framework's default.
    ``dp_hier`` (:func:`dp_hierarchical`): the data-parallel all-reduce is tried flat and
    hierarchical too, for the ZeRO stages whose modelled reduction is an all-reduce
    (``data_parallel.reduction_collective``: ZeRO-0; the trainer's ZeRO-1 all-reduce is modelled
    as a reduce-scatter, which the choice does not change). ``precisions``: the (precision, FP8
    recipe) pairs to try (:func:`precision_choices`). ``moe_experts``: a mixture of experts' expert
    count: every expert-parallel degree dividing dp x cp and the experts is tried (where the
    framework has expert parallelism), or those of ``eps``, with token dispatcher ``dispatcher``
    (all-to-alls where DeepEP cannot be priced: tp > 1). Selective recomputation is tried with each
    of :func:`recompute_module_choices`."""
    module_choices = recompute_module_choices(fw, model)
    if eps is None:
        eps = (1,) if not moe_experts or not fw.expert_parallel else tuple(ep_degrees(dp * cp, moe_experts))
    for (zero, rc, sp), ep in ((z, e) for z in inner_choices(dp, tp, cp) for e in eps):
        c = make_config(dp, pp, tp, mbs, sched, v, layered, zero, rc, sp, global_batch, cp)
        if ep > 1:  # (DeepEP is priced at tp 1 only: config.check)
            c = dataclasses.replace(c, ep=ep, moe_dispatcher="alltoall" if dispatcher == "deepep" and tp > 1
                                    else dispatcher)
        if fw.check(c):
            continue
        matters = {"overlap_grad_reduce": dp * cp > 1 and fw.can_overlap_grad_reduce(c),
                   "overlap_param_gather": dp * cp > 1 and zero >= 1,
                   "tp_comm_overlap": sp, "torch_compile": True,
                   "ep_comm_overlap": ep > 1 and "ep_comm_overlap" in fw.knobs and not ep_overlap_reason(c, model)}
        variants = [{}] if tuple(precisions) == (("bf16", "tensorwise"),) else [
            {"precision": p, "fp8_recipe": r} for p, r in precisions]
        if rc == "selective" and module_choices != ((),):
            variants = [{**v_, "recompute_modules": mods} if mods else v_ for v_ in variants for mods in module_choices]
        for knob in fw.knobs:
            if matters[knob]:
                variants = [{**v_, knob: val} for v_ in variants for val in (False, True)]
        if dp_hier and reduction_collective(zero) is comm.all_reduce_s:
            variants = [{**v_, "dp_all_reduce": mode} for v_ in variants for mode in ("flat", "hierarchical")]
        seen = set()
        for kw in variants:
            got = dataclasses.replace(c, **kw) if kw else c
            if got.recompute_modules and fw.check(got):  # (FP8 delayed scaling takes no moe_act, layernorm)
                got = dataclasses.replace(got, recompute_modules=recompute_module_fallback(got.recompute_modules))
            if got not in seen and not fw.check(got):
                seen.add(got)
                yield got


def count_space(model, world: int, global_batch: int, max_micro_batch: int, fw=None, dp_hier=None, cps=(1,),
                precisions=(("bf16", "tensorwise"),)):
    """(outer points, total configs, valid configs, rejected reason counts).

    ZeRO, recomputation and sequence parallelism only add reasons to an outer point's own, so an
    outer point that fails with the plainest inner choice fails with all of them. With a framework
    ``fw``, the schedules and layered accumulation it cannot run are rejected with that reason.
    ``dp_hier(dp, pp, tp)``: whether the hierarchical data-parallel all-reduce is tried there
    (:func:`dp_hierarchical`; never when None).
    """
    from .config import reason_key
    from .frameworks import framework as framework_model
    fw = fw or framework_model(None)
    rejected: dict = {}
    points = []
    for point in outer_space(model, world, global_batch, max_micro_batch, rejected, cps):
        dp, pp, tp, mbs, sched, v, layered, cp = point
        why = fw.check(make_config(dp, pp, tp, mbs, sched, v, layered, 0, "none", False, global_batch, cp))
        if why:
            key = f"{fw.name} cannot run it"
            rejected[key] = rejected.get(key, 0) + len(inner_choices(dp, tp, cp))
            continue
        points.append(point)
    total = sum(rejected.values())
    valid = 0

    def count(reason, n):
        key = reason_key(reason)
        rejected[key] = rejected.get(key, 0) + n

    valid_per_point: dict = {}
    for point in points:
        dp, pp, tp, mbs, sched, v, layered, cp = point
        inner = list(framework_inner(fw, dp, pp, tp, mbs, sched, v, layered, global_batch,
                                     bool(dp_hier and dp_hier(dp, pp, tp)), cp, precisions, model.num_experts,
                                     model=model))
        total += len(inner)
        base = check(make_config(dp, pp, tp, mbs, sched, v, layered, 0, "none", False, global_batch, cp), model)
        if base:
            count(base, len(inner))
            continue
        n = 0
        for c in inner:
            reason = check(c, model) if c.sequence_parallel else None
            if reason:
                count(reason, 1)
            else:
                n += 1
        valid += n
        valid_per_point[point] = n
    return points, total, valid, rejected, valid_per_point


def _digest(d: dict) -> str:
    import hashlib
    import json
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def sqlite_path(storage: str | None) -> str | None:
    """The database file of a ``sqlite:///`` storage URL (None for other storages or in memory)."""
    if not storage or not storage.startswith("sqlite:///"):
        return None
    path = storage[len("sqlite:///"):].split("?", 1)[0]
    return None if path in ("", ":memory:") else path


_held_locks: dict = {}


@contextlib.contextmanager
def study_lock(storage: str | None, name: str):
    """Hold a study for this process: a second search on the same SQLite study (another process)
    is refused in one line instead of storing every trial twice. The lock is a byte-range lock on
    ``<database>.lock`` (released by the kernel when the process ends, however it ends); creating
    the database's tables is serialised through the same file. Other storages are not locked."""
    path = sqlite_path(storage)
    if path is None or (path, name) in _held_locks:
        yield
        return
    import fcntl
    import hashlib

    try:
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise UserError(f"--storage {storage!r}: cannot open the study (cannot create {path + '.lock'!r}: "
                        f"{e.strerror})") from None
    offset = 1 + int(hashlib.sha256(name.encode()).hexdigest()[:12], 16) % (2**40)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
        except OSError:
            raise UserError(f"study {name!r} in {storage} is in use by another search; wait for it to finish "
                            "or pass another --study-name") from None
        _held_locks[(path, name)] = fd
        try:
            yield
        finally:
            del _held_locks[(path, name)]
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def _schema_lock(storage: str | None):
    """Serialise creating a new SQLite database's tables between processes (optuna's table
    creation races: 'table studies already exists')."""
    path = sqlite_path(storage)
    held = next((fd for (p, _), fd in _held_locks.items() if p == path), None)
    if held is None:
        yield
        return
    import fcntl

    fcntl.lockf(held, fcntl.LOCK_EX, 1, 0)
    try:
        yield
    finally:
        fcntl.lockf(held, fcntl.LOCK_UN, 1, 0)


def default_study_name(model, world: int, global_batch: int, cluster_name: str, framework: str = "reference",
                       signature: dict | None = None) -> str:
    """The study name a search uses when none is given: readable parts, then a fingerprint of
    everything the stored values depend on (``signature``: model, cluster, profile content,
    calibration, framework, batch, devices, space options), so the same inputs resume the same
    study and changed ones (a new profile) start a fresh one."""
    name = f"{model.name}-{cluster_name}-{world}gpus-gb{global_batch}"
    name = name if framework == "reference" else f"{name}-{framework}"
    return f"{name}-{_digest(signature)[:8]}" if signature is not None else name


_COST_MODEL_SOURCES = ("cost", "frameworks.py", "catalog.py", "model.py", "config.py", "placement.py", "moe.py",
                       "fp8.py", "data/devices.json", "data/models.json")


@functools.lru_cache(maxsize=1)
def cost_model_digest() -> str:
    """A digest of the code and data that price a configuration (``_COST_MODEL_SOURCES``): a study
    stored by another version of the cost model is not resumed as if its times still held (the
    default study name changes with it)."""
    import hashlib
    from importlib import resources
    h = hashlib.sha256()
    root = resources.files("autoconf")
    for name in _COST_MODEL_SOURCES:
        node = root.joinpath(name)
        files = sorted((f for f in node.iterdir() if f.name.endswith(".py")), key=lambda f: f.name) \
            if node.is_dir() else [node]
        for f in files:
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


_SIGNATURE_WHAT = {"model": "model", "cost_model": "cost model (autoconf was updated since)",
                   "global_batch": "global batch", "devices": "devices", "framework": "framework",
                   "max_micro_batch": "max micro-batch", "cluster": "cluster file", "profile": "profile",
                   "calibration": "calibration", "placement": "placement search",
                   "cp": "context-parallel degrees", "precisions": "precisions"}


def _difference(stored: dict, now: dict) -> str:
    """What differs between a study's inputs and this search's, in a few words each."""
    out = []
    for k in sorted(set(stored) | set(now)):
        a, b = stored.get(k), now.get(k)
        if a == b:
            continue
        what = _SIGNATURE_WHAT.get(k, k)
        if k == "model" and isinstance(a, dict) and isinstance(b, dict) and a.get("name") != b.get("name"):
            out.append(f"model ({a.get('name')} in the study, {b.get('name')} now)")
        elif k in ("cluster", "profile", "calibration", "model", "cost_model"):
            out.append(f"{what} ({'none' if a is None else 'other content' if b is not None else 'one'} in the study, "
                       f"{'none' if b is None else 'this one'} now)")
        else:
            out.append(f"{what} ({a if a is not None else 'none'} in the study, {b if b is not None else 'none'} now)")
    return "; ".join(out)


def config_digest(c: ParallelConfig) -> str:
    """A configuration's identity in the study's records."""
    return _digest(c.to_dict())


def _bound_s(t) -> float:
    """The bound that decided part of a stored trial's outcome (see ``_Evaluator.bound_used``);
    inf when none did (the outcome holds for any ``top``). A pruned trial from before the bound
    was recorded this way: the incumbent it was dominated by."""
    b = t.user_attrs.get("bound_s")
    if b is None and t.user_attrs.get("fits") is None:
        b = t.user_attrs.get("dominated_by_s")
    return float("inf") if b is None else float(b)


class _Study:
    """The persistent Optuna study and this run's bookkeeping: what is known per outer point,
    trials waiting to be written (in batches: SQLite costs ~10 ms a trial), the in-memory study
    TPE samples from."""

    def __init__(self, storage, name, signature, points, evaluate, seed, budget):
        import optuna
        from optuna.distributions import CategoricalDistribution

        self.optuna = optuna
        self.evaluate = evaluate
        self.top = evaluate.top
        self.dists = {
            "tp": CategoricalDistribution(sorted({p[2] for p in points})),
            "pp": CategoricalDistribution(sorted({p[1] for p in points})),
            "dp": CategoricalDistribution(sorted({p[0] for p in points})),
            "micro_batch_size": CategoricalDistribution(sorted({p[3] for p in points})),
            "pipeline": CategoricalDistribution(sorted({_pipeline_label(p[4], p[5], p[6]) for p in points})),
            "cp": CategoricalDistribution(sorted({p[7] for p in points})),
        }
        self.sample_dists = {k: v for k, v in self.dists.items() if k != "dp"}  # dp = world / (pp x tp)
        self.key_of = {(p[2], p[1], p[0], p[3], _pipeline_label(p[4], p[5], p[6]), p[7]): p for p in points}
        self.results: dict = {}
        """outer key -> (best fitting estimate or None, least-memory estimate or None)"""
        self.fits: dict = {}
        """outer key -> the fitting estimates of this run that can be among the top, fastest first"""
        self.earlier: dict = {}
        """outer key -> finished trial of an earlier run (resumed) whose outcome holds for this search"""
        self.pending: list = []
        self.stored = 0
        self.written = 0
        """Trials this run wrote to the storage."""
        self.swept_skipped = 0
        self.skipped_keys: set = set()
        """Outer points the sweep decided without storing a trial, in this run and earlier ones, so a
        resumed sweep does not decide them again. Kept as study attributes (indices into the space):
        ``swept_nofit`` (nothing fits: holds for any search) and ``swept_dominated`` ([index,
        bound] pairs: holds while the ``top``-th best is no slower than the bound)."""
        self.nofit_keys: set = set()
        self.dominated_keys: dict = {}
        self.top_times: list = []
        """[step time, index, config digest] of the fastest configurations the study has seen (the
        ``top_times`` attribute): what a resumed search knows of its ``top``-th best at the start."""
        self._attrs_written = None
        self.last_flush = time.perf_counter()
        self.resumed = False
        """Whether the study existed before this run (made by an earlier search with the same inputs)."""
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.persistent = self._open(storage, name, signature) if storage else None
        self.seed, self.budget = seed, budget
        self.memory = None
        self.earlier_sampled = sum(1 for t in self.earlier.values() if t.user_attrs.get("phase", "sampled") == "sampled")
        """Sampled trials of earlier runs (trials stored before the phase was recorded count as sampled)."""

    def _memory_study(self):
        """The in-memory study TPE samples from, seeded with every earlier trial (built only when
        this run samples)."""
        optuna = self.optuna
        self.memory = optuna.create_study(
            direction="minimize",
            sampler=optuna.samplers.TPESampler(seed=self.seed, multivariate=True,
                                               n_startup_trials=min(40, max(10, self.budget // 5))))
        for t in self.earlier.values():
            params = {k: t.params[k] for k in self.sample_dists}
            if t.state == optuna.trial.TrialState.PRUNED:
                self.memory.add_trial(optuna.trial.create_trial(params=params, distributions=self.sample_dists,
                                                                state=optuna.trial.TrialState.PRUNED))
            else:
                self.memory.add_trial(optuna.trial.create_trial(
                    params=params, distributions=self.sample_dists, value=t.value,
                    constraints={"memory_excess_bytes": t.user_attrs.get("memory_excess_bytes", 0.0)}))

    def _open(self, storage, name, signature: dict):
        """Open (or create) the study; refuse one made for another search. ``signature`` holds
        everything the stored values depend on: model, cluster, profile, calibration, batch,
        devices and the space's bounds."""
        optuna = self.optuna
        try:
            with _schema_lock(storage):
                study = optuna.create_study(storage=storage, study_name=name, direction="minimize",
                                            load_if_exists=True)
        except Exception as e:  # a bad URL or an unwritable file: say so in one line
            raise UserError(f"--storage {storage!r}: cannot open the study "
                            f"({type(e).__name__}: {str(e).splitlines()[0]})") from None
        try:
            return self._load(study, storage, name, signature)
        except UserError:
            raise
        except (ValueError, TypeError, AttributeError, KeyError, IndexError) as e:  # JSON errors are ValueErrors
            why = (str(e).splitlines() or [""])[0][:120]
            raise UserError(f"study {name!r} in {storage} is unreadable ({type(e).__name__}: {why}); "
                            "pass another --study-name or --storage") from None

    def _load(self, study, storage, name, signature: dict):
        """What the study's stored trials and attributes tell this search (``_open``)."""
        optuna = self.optuna
        stored = study.user_attrs.get("signature")
        if stored is not None and not isinstance(stored, dict):
            raise TypeError(f"its signature is a {type(stored).__name__}, not a mapping")
        if stored is not None and stored != signature:
            raise UserError(f"study {name!r} in {storage} was made for another search (different "
                            f"{_difference(stored, signature)}); pass another --study-name, or none to "
                            "get the study of these inputs")
        self.resumed = stored is not None
        if stored is None:
            study.set_user_attr("signature", signature)
        index = list(self.key_of)
        where = {k: i for i, k in enumerate(index)}
        done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        found: dict = {}
        for t in study.get_trials(deepcopy=False, states=done):
            if t.user_attrs.get("verified"):  # a measured run, recorded by --verify
                continue
            k = tuple(t.params.get(p) for p in PARAMS)
            if k in self.key_of:
                found.setdefault(k, []).append(t)

        # what the earlier runs know of this search's top-th best: configurations that exist
        # (the fastest ones they kept, and each stored point's best), each counted once
        known: dict = {}
        for row in study.user_attrs.get("top_times", []):
            if (isinstance(row, list) and len(row) == 3 and isinstance(row[1], int) and 0 <= row[1] < len(index)
                    and isinstance(row[0], (int, float)) and isinstance(row[2], str)):
                known[row[2]] = (float(row[0]), index[row[1]])
        for k, ts in found.items():
            for t in ts:
                if t.user_attrs.get("fits") and t.value is not None and isinstance(t.user_attrs.get("config"), dict):
                    known.setdefault(_digest(t.user_attrs["config"]), (t.value, k))
        self.top_times = sorted([t, where[k], d] for d, (t, k) in known.items())[:max(self.top, 1)]
        kth = sorted(t for t, _ in known.values())[self.top - 1] if len(known) >= self.top else float("inf")

        # a stored outcome holds if what its bound skipped is slower than that top-th best; the
        # others (decided against a tighter bound: a search for fewer) are evaluated again
        for k, ts in found.items():
            ok = [t for t in ts if _bound_s(t) >= kth]
            if ok:
                self.earlier[k] = max(ok, key=lambda t: (t.state == optuna.trial.TrialState.COMPLETE, _bound_s(t)))
        by_point: dict = {}
        for d, (t, k) in known.items():
            by_point.setdefault(self.key_of[k], []).append((t, d))
        for point, entries in by_point.items():  # what earlier runs found bounds this one
            self.evaluate.offer(point, entries)

        def keys(indices):
            return {index[i] for i in indices if isinstance(i, int) and 0 <= i < len(index)}

        self.nofit_keys = keys(study.user_attrs.get("swept_nofit", []))
        for pair in study.user_attrs.get("swept_dominated", []):
            if (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int) and 0 <= pair[0] < len(index)
                    and isinstance(pair[1], (int, float))):
                k = index[pair[0]]
                self.dominated_keys[k] = max(self.dominated_keys.get(k, 0.0), float(pair[1]))
        # (a study from before the bound was recorded kept them as "swept_skipped": decided again)
        self.skipped_keys = self.nofit_keys | {k for k, b in self.dominated_keys.items() if b >= kth}
        self._attrs_written = self._attrs()
        return study

    def _attrs(self) -> tuple:
        where = {k: i for i, k in enumerate(self.key_of)}
        known = {d: (t, i) for t, i, d in self.top_times}
        for t, point, d in self.evaluate.kept():
            known[d] = (t, where[self._key(point)])
        self.top_times = sorted([t, i, d] for d, (t, i) in known.items())[:max(self.top, len(self.top_times))]
        return (sorted(where[k] for k in self.nofit_keys),
                sorted([where[k], b] for k, b in self.dominated_keys.items()), self.top_times)

    @staticmethod
    def _key(point) -> tuple:
        return (point[2], point[1], point[0], point[3], _pipeline_label(point[4], point[5], point[6]), point[7])

    def record(self, k, fits, least, phase: str):
        """Keep the outcome of an outer point and queue its trial; None when it was dominated.
        ``phase`` (sampled, swept, brute force) is stored: a resumed search counts the sampled
        trials already in the study against its budget. Where the bound decided anything, it is
        stored (``bound_s``): the outcome holds for a search whose ``top``-th best is no slower."""
        optuna = self.optuna
        best = fits[0] if fits else None
        self.results[k] = (best, least)
        self.fits[k] = fits
        self.stored += 1
        b = self.evaluate.bound_used
        bounded = {"bound_s": b} if b is not None else {}
        if best is None and least is None:  # every choice was dominated by the incumbent
            self.pending.append(optuna.trial.create_trial(
                params=dict(zip(PARAMS, k)), distributions=self.dists, state=optuna.trial.TrialState.PRUNED,
                user_attrs={"fits": None, "dominated_by_s": self.evaluate.incumbent, "phase": phase, **bounded}))
            return None
        e = best or least
        attrs = {"phase": phase, "config": e.config.to_dict(), "fits": bool(best), "step_time_s": e.step_time_s,
                 "memory_excess_bytes": e.memory_excess_bytes,
                 "peak_memory_gib": round(e.peak_memory_bytes / 2**30, 3), "mfu": round(e.mfu, 4),
                 "breakdown_s": e.breakdown_s, **bounded}
        ft = optuna.trial.create_trial(params=dict(zip(PARAMS, k)), distributions=self.dists,
                                       value=min(e.step_time_s, 1e30), user_attrs=attrs,
                                       constraints={"memory_excess_bytes": e.memory_excess_bytes})
        self.pending.append(ft)
        return ft

    def flush(self, every_s: float = 0.0) -> None:
        """Write pending trials to the storage (at most every ``every_s`` seconds)."""
        if time.perf_counter() - self.last_flush < every_s:
            return
        if self.persistent is None:
            self.pending.clear()
        while self.pending:  # one at a time, each write whole: an interrupt lands between two
            with deferred_signals():
                try:
                    self.persistent.add_trial(self.pending[0])
                except Exception as e:  # the storage went away or disagrees: one line, trials kept so far
                    raise UserError(f"cannot write trials to the study ({type(e).__name__}: "
                                    f"{str(e).splitlines()[0]})") from None
                self.pending.pop(0)
                self.written += 1
        state = self._attrs() if self.persistent is not None else None
        if state is not None and state != self._attrs_written:
            with deferred_signals():
                for name, value in zip(("swept_nofit", "swept_dominated", "top_times"), state):
                    self.persistent.set_user_attr(name, value)
                self._attrs_written = state
        self.last_flush = time.perf_counter()

    def brute_force(self, todo, progress) -> None:
        for i, k in enumerate(todo, 1):
            self.record(k, *self.evaluate(self.key_of[k]), "brute force")
            if progress:
                progress(i, len(todo))
            self.flush(every_s=5)

    def _tell_known(self, trial, k) -> bool:
        """Answer a sampled point already known (earlier run or this one); False if it is new."""
        pruned = self.optuna.trial.TrialState.PRUNED
        if k in self.earlier:
            t = self.earlier[k]
            if t.value is None:
                self.memory.tell(trial, state=pruned)
            else:
                trial.set_constraint("memory_excess_bytes", t.user_attrs.get("memory_excess_bytes", 0.0))
                self.memory.tell(trial, t.value)
            return True
        if k in self.results:
            e = self.results[k][0] or self.results[k][1]
            if e is None:
                self.memory.tell(trial, state=pruned)
            else:
                trial.set_constraint("memory_excess_bytes", e.memory_excess_bytes)
                self.memory.tell(trial, e.step_time_s)
            return True
        return False

    def sample(self, target: int, repair, progress, stall: float = float("inf")) -> int:
        """Constrained TPE over (tp, pp, micro-batch size, pipeline, cp), each sample repaired to a
        valid point; returns the number of new points evaluated. ``stall``: stop once that many
        samples in a row were points already known, or after twice ``target`` samples (TPE has
        settled; an exhaustive search's sweep decides the rest, and each sample costs more as the
        study grows); without it, after five times ``target``."""
        run = asks = repeats = 0
        if target > 0 and self.memory is None:
            self._memory_study()
        while run < target and asks < (2 if stall < float("inf") else 5) * target and repeats < stall:
            asks += 1
            trial = self.memory.ask(self.sample_dists)
            k = repair(trial.params)
            if self._tell_known(trial, k):
                repeats += 1
                continue
            repeats = 0
            ft = self.record(k, *self.evaluate(self.key_of[k]), "sampled")
            if ft is None:
                self.memory.tell(trial, state=self.optuna.trial.TrialState.PRUNED)
            else:
                trial.set_constraint("memory_excess_bytes", ft.constraints["memory_excess_bytes"])
                self.memory.tell(trial, ft.value)
            run += 1
            if progress:
                progress(run, target)
            self.flush(every_s=5)
        return run

    def sweep(self, todo, done: int, progress) -> int:
        """Every remaining point under the bound of the top-th best found: exact, and fast once
        the incumbent is good (dominated points skip the schedule simulation). Only points that
        fit are stored; dominated and out-of-memory ones are counted."""
        rest = [k for k in todo if k not in self.results]
        n_total = done + len(rest)
        for i, k in enumerate(rest):
            fits, least = self.evaluate(self.key_of[k])
            if fits:
                self.record(k, fits, least, "swept")
            else:
                self.results[k] = (None, least)
                self.swept_skipped += 1
                self.skipped_keys.add(k)
                if self.evaluate.bound_used is not None:
                    self.dominated_keys[k] = self.evaluate.bound_used
                else:
                    self.nofit_keys.add(k)
            if progress and i % 50 == 0:
                progress(done + i + 1, n_total)
            self.flush(every_s=5)
        if progress:
            progress(n_total, n_total)
        return len(rest)


def search(model, cluster=None, global_batch: int = 0, *, gpus: int | None = None, top: int = 5,
           trials: int | None = None, storage: str | None = None,
           study_name: str | None = None, profile=None, calibration=None, max_micro_batch: int = 64,
           seed: int = 0, exhaustive: bool = True, progress=None, framework=None,
           place: bool = False, phase=None, max_cp: int | None = None, precision: str = "auto",
           fp8_recipe: str | None = None, moe_imbalance: float = 1.0, allow_compression: bool = False,
           pp_compression_rank: int = 16, dp_compression_rank: int = 128,
           moe_dispatcher: str = "alltoall") -> SearchResult:
    """Search the space for the ``top`` fastest configurations that fit (exactly the model's
    ``top`` fastest, unless ``exhaustive=False``). ``storage``: an Optuna storage URL to keep the
    trials in (``sqlite:///file.db``; resumable), or None to keep them in memory only (no file
    is written). ``study_name`` defaults to one derived from the inputs (see
    :func:`default_study_name`). ``progress(done, total)`` is called as trials finish, and
    ``phase(name)`` as each phase starts ("brute force", "sampling", "sweep", "earlier trials",
    "placement"). ``framework``: the runtime that will run the plan (a name from
    ``frameworks.FRAMEWORK_NAMES``; default the reference trainer): only what it can run is
    offered, its switchable knobs are searched, and its behaviour is modelled. ``place``: search
    the placement too (``place``): every configuration is estimated with the graph heuristics'
    placement, and the ``top`` best are improved by a local search and ranked again; otherwise
    rank r runs on device r with the layers split evenly. ``max_cp``: the largest context-parallel
    degree tried (``config.cp_choices``); ``precision`` ("auto", "bf16" or "fp8") and
    ``fp8_recipe``: the matmul precisions tried (:func:`precision_choices`). ``allow_compression``:
    lossy communication may be picked (compressed pipeline gradients, PowerSGD on data-parallel
    gradients, at the ranks given; :func:`compression_variants`), and the fused embedding sync.
    ``moe_dispatcher``: the token dispatcher of a mixture of experts' configurations
    (``config.MOE_DISPATCHERS``, one the framework runs)."""
    t0 = time.perf_counter()
    if top < 1:
        raise UserError(f"--top {top}: must be a positive number of configurations")
    ctx = System(model, cluster, profile, calibration, framework=framework, moe_imbalance=moe_imbalance,
                 moe_dispatcher=moe_dispatcher)
    world = gpus or ctx.num_devices
    if world > ctx.num_devices:
        raise UserError(f"--gpus {world}: the cluster has only {ctx.num_devices} devices")
    if global_batch <= 0:
        raise UserError(f"--global-batch {global_batch}: must be a positive number of sequences")
    cps = cp_choices(model, world, max_cp) if ctx.framework.cp_comm else (1,)
    precisions = precision_choices(ctx, precision, fp8_recipe)
    points, total, valid, rejected, valid_per_point = count_space(
        model, world, global_batch, max_micro_batch, ctx.framework,
        lambda dp, pp, tp: dp_hierarchical(ctx, dp, pp, tp), cps, precisions)
    if not points or not valid:
        raise UserError(f"no valid configuration: global batch {global_batch} on {world} devices; "
                        f"rejected: {', '.join(f'{k} ({v})' for k, v in rejected.items())}")
    placer = None
    if place and ctx.framework.name == "reference":
        # only the reference trainer plays any rank on any device and builds any layer split; the
        # other frameworks take rank = launch order, which the emitted files do not reorder yet
        from .place import Placer
        placer = Placer(ctx, world)
    compression = None
    if allow_compression:
        for name, r in (("--pp-compression-rank", pp_compression_rank), ("--dp-compression-rank", dp_compression_rank)):
            if isinstance(r, bool) or not isinstance(r, int) or r < 1:
                raise UserError(f"{name} {r!r}: must be a positive integer")
        if not ctx.framework.compression:
            raise UserError(f"--allow-compression: framework {ctx.framework.name} cannot run compressed traffic "
                            "(no low-rank pipeline gradients, no PowerSGD on its gradient buffers); "
                            "valid: --framework reference")
        compression = (pp_compression_rank, dp_compression_rank)
    evaluate = _Evaluator(ctx, global_batch, valid_per_point, placer, top=top, precisions=precisions,
                          compression=compression)
    budget = trials if trials is not None else 400
    signature = {"model": model.to_dict(), "global_batch": global_batch, "devices": world,
                 "framework": ctx.framework.name, "cost_model": cost_model_digest(),
                 "max_micro_batch": max_micro_batch,
                 "cluster": _digest(cluster.to_dict()) if cluster is not None else None,
                 "profile": _digest(profile.to_dict()) if profile is not None else None,
                 "calibration": _digest(calibration.to_dict()) if calibration is not None else None}
    if place:  # the stored step times are those of the placed configurations
        signature["placement"] = "searched"
    if cps != (1,):  # (absent when the space has neither, so earlier studies keep their names)
        signature["cp"] = list(cps)
    if precisions != (("bf16", "tensorwise"),):
        signature["precisions"] = [list(p) for p in precisions]
    if moe_imbalance != 1.0:
        signature["moe_imbalance"] = moe_imbalance
    if moe_dispatcher != "alltoall":
        signature["moe_dispatcher"] = moe_dispatcher
    if compression is not None:
        signature["compression"] = list(compression)
    name = study_name or default_study_name(model, world, global_batch,
                                            cluster.name if cluster is not None else "profile",
                                            ctx.framework.name, signature)

    def enter(what):
        if phase is not None:
            phase(what)

    with study_lock(storage, name):
        study = _Study(storage, name, signature, points, evaluate, seed, budget)
        todo = [k for k in study.key_of if k not in study.earlier and k not in study.skipped_keys]
        brute = len(todo) <= budget
        sampler_name = ("brute force" if brute else
                        "TPE, then every point by branch and bound" if exhaustive else "TPE (constrained, multivariate)")
        try:
            if brute:
                enter("brute force")
                study.brute_force(todo, progress)
                run = len(todo)
            else:
                # exhaustive: the sweep decides the answer, so sampled trials already in the study
                # count against the budget (a resumed search finishes the same search)
                target = budget - study.earlier_sampled if exhaustive else budget
                enter("sampling")
                run = study.sample(min(max(target, 0), len(todo)), _Repair(study.key_of), progress,
                                   stall=20 if exhaustive else float("inf"))
                if exhaustive:
                    enter("sweep")
                    run += study.sweep(todo, run, progress)
            study.flush()
        except BaseException as e:  # interrupted (or failed): every finished evaluation goes to the study
            if study.persistent is not None and not isinstance(e, UserError):
                with deferred_signals():
                    study.flush()
                e.autoconf_kept = (f"{study.written} trials of this run and {len(study.earlier)} earlier ones are "
                                   f"kept in study {name!r} in {storage}; rerun the same command to resume")
            raise

    # rank: this run's results plus the earlier runs' best points (only each point's best was
    # stored: the `top` best earlier points are evaluated again for their runners-up; a
    # configuration among the `top` fastest lies in one of them)
    fitting = [e for fits in study.fits.values() for e in fits]
    earlier_fit = sorted(((k, t) for k, t in study.earlier.items()
                          if t.user_attrs.get("fits") and "config" in t.user_attrs and t.value is not None),
                         key=lambda kt: kt[1].value)
    if earlier_fit:
        enter("earlier trials")
    for i, (k, _) in enumerate(earlier_fit[:top], 1):
        fitting.extend(evaluate.reevaluate(study.key_of[k]))
        if progress:
            progress(i, min(top, len(earlier_fit)))
    fitting.sort(key=lambda e: e.step_time_s)
    placement, t_place = (), time.perf_counter()
    if placer is not None and fitting:
        enter("placement")
        fitting, placement = _improve_placements(placer, fitting[:top], progress=progress)
    t_place = time.perf_counter() - t_place
    rejected = dict(rejected)
    for k2, v2 in evaluate.rejected.items():
        rejected[k2] = rejected.get(k2, 0) + v2
    slower = evaluate.dominated + evaluate.pruned
    if slower:
        rejected[f"slower than the {_nth_best(top)} found (bound, not simulated)"] = slower
    notes = []
    if not brute and not exhaustive:
        notes.append(f"sampled {run} of {len(points)} outer points ({len(todo)} not yet in the study); "
                     f"raise --trials to cover more, or rerun to continue the study")
    if study.swept_skipped:
        notes.append(f"{study.swept_skipped} outer points were dominated by the {_nth_best(top)} found or did "
                     "not fit (not stored in the study)")
    if place and placer is None:
        notes.append(f"placement not searched: {ctx.framework.name} runs rank r on the r-th launched process, "
                     "and the launch files keep that order (autoconf's reference trainer places any rank on any "
                     "device)")
    if compression is not None:
        notes.append("lossy communication allowed (--allow-compression): compressed gradients change the "
                     "numerics of training (low-rank pipeline gradients, PowerSGD with error feedback); "
                     "check the loss before a long run")
        notes.extend(compression_savings(fitting[:top], ctx))
    return SearchResult(top=tuple(fitting[:top]), rejected=rejected, space_size=total, valid=valid,
                        outer_points=len(points), trials_run=study.stored,
                        trials_total=len(study.earlier) + study.stored, estimates=evaluate.estimates,
                        sampler=sampler_name, study_name=name, storage=storage,
                        elapsed_s=time.perf_counter() - t0,
                        smallest_memory=evaluate.smallest if not fitting else None, notes=tuple(notes),
                        placement=placement, placement_s=t_place if placement else 0.0,
                        evaluated=tuple(evaluate.points) + tuple(
                            (ParallelConfig.from_dict(t.user_attrs["config"]), t.user_attrs["step_time_s"],
                             t.user_attrs["peak_memory_gib"] * 2**30, t.user_attrs["fits"])
                            for t in study.earlier.values()
                            if {"config", "step_time_s", "peak_memory_gib", "fits"} <= t.user_attrs.keys()),
                        resumed=study.resumed, earlier_trials=len(study.earlier))


def _nth_best(n: int) -> str:
    """"best" for 1, else "2nd best", "5th best", "21st best"."""
    if n == 1:
        return "best"
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix} best"


def _improve_placements(placer, top: list, max_evaluations: int = 200, budget_s: float = 20.0, progress=None):
    """The local search (``place.Placer.improve``) on each of the best configurations, ranked
    again; with what placement gained for each. ``budget_s`` bounds the whole (each configuration
    gets an equal share of what is left)."""
    t0 = time.perf_counter()
    out = []
    for i, e in enumerate(top):
        if progress:
            progress(i, len(top))
        share = (budget_s - (time.perf_counter() - t0)) / (len(top) - i)
        better, evals = placer.improve(e.config, max_evaluations=max_evaluations,
                                       deadline=time.perf_counter() + max(share, 0.0))
        out.append((better, placer.outcome(better, e.step_time_s, evals)))
    if progress:
        progress(len(top), len(top))
    out.sort(key=lambda pair: pair[0].step_time_s)
    return [e for e, _ in out], tuple(o for _, o in out)
