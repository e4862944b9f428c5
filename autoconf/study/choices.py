"""The choices per axis that the search tries: precisions, compression variants, expert-parallel
degrees and dispatchers, recomputation modules, the framework's inner knobs; and the space's size.
"""

from __future__ import annotations

import dataclasses
import functools

from autoconf.cost import comm
from autoconf.cost.estimate import estimate_on
from autoconf.cost.groups import axis_links, reduction_collective
from autoconf.cost.system import System
from autoconf.errors import UserError
from autoconf.space.config import (
    COMPRESSION_FIELDS,
    FP8_RECIPES,
    RECOMPUTE_MODULES,
    ParallelConfig,
    check,
    ep_overlap_reason,
    reason_key,
    recompute_modules_reason,
)
from autoconf.space.enumeration import MAX_VIRTUAL, inner_choices, make_config, outer_space
from autoconf.specs.devices import device_type
from autoconf.specs.frameworks import framework as framework_model
from autoconf.specs.frameworks import hierarchical_runs


def precision_choices(system: System, precision: str = "auto", fp8_recipe: str | None = None) -> tuple:
    """The (precision, FP8 recipe) pairs a search tries: bf16 (the model's dtype), and FP8 where
    asked ("auto" or "fp8") and every device of the cluster and the framework run it (with "auto"
    only where the devices' FP8 rate beats the model dtype's: not on CPUs, which emulate it), with
    ``fp8_recipe`` or else the framework's first recipe the devices run (MXFP8 needs Blackwell).
    A one-line error where "fp8" is asked and cannot run. An fp32 model tries TF32 tensor cores
    instead ("auto" or "tf32": PyTorch's ``allow_tf32``) where every device has them; "tf32"
    is refused for other models and devices."""
    if precision not in ("auto", "bf16", "fp8", "tf32"):
        raise UserError(f"--precision {precision!r}; valid: auto, bf16, fp8, tf32")
    if fp8_recipe is not None and fp8_recipe not in FP8_RECIPES:
        raise UserError(f"--fp8-recipe {fp8_recipe!r}; valid: {', '.join(FP8_RECIPES)}")
    bf16 = ("bf16", "tensorwise")
    if precision == "bf16":
        return (bf16,)
    fw = system.framework
    kinds = sorted(set(system.topology.kind_of))
    if system.model.dtype == "fp32" or precision == "tf32":
        tf32 = system.model.dtype == "fp32" and all("tf32" in device_type(k).peak_flop_per_s for k in kinds)
        if precision == "tf32" and not tf32:
            why = (f"model {system.model.name} is {system.model.dtype}" if system.model.dtype != "fp32"
                   else f"device {', '.join(kinds)} has no TF32 tensor cores")
            raise UserError(f"--precision tf32 runs an fp32 model's matmuls on TF32 tensor cores: {why}; "
                            "use --precision bf16")
        if precision == "tf32":
            return (("tf32", "tensorwise"),)
        if precision == "auto":
            return (bf16, ("tf32", "tensorwise")) if tf32 else (bf16,)

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
    lines = []
    for i, e in enumerate(result_top, 1):
        if not (e.config.compressed or e.config.fused_embedding_sync):
            continue
        plain = estimate_on(dataclasses.replace(e.config, **COMPRESSION_FIELDS), ctx)
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
                t = estimate_on(c, system).step_time_s
                on = dataclasses.replace(c, ep_comm_overlap=True)  # hidden all-to-alls favour other degrees
                if "ep_comm_overlap" in fw.knobs and check(on, m) is None:
                    t = min(t, estimate_on(on, system).step_time_s)
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
    (``cost.groups.reduction_collective``: ZeRO-0; the trainer's ZeRO-1 all-reduce is modelled
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
                precisions=(("bf16", "tensorwise"),), max_virtual: int | None = MAX_VIRTUAL):
    """(outer points, total configs, valid configs, rejected reason counts).

    ZeRO, recomputation and sequence parallelism only add reasons to an outer point's own, so an
    outer point that fails with the plainest inner choice fails with all of them. With a framework
    ``fw``, the schedules and layered accumulation it cannot run are rejected with that reason.
    ``dp_hier(dp, pp, tp)``: whether the hierarchical data-parallel all-reduce is tried there
    (:func:`dp_hierarchical`; never when None).
    """
    fw = fw or framework_model(None)
    rejected: dict = {}
    points = []
    for point in outer_space(model, world, global_batch, max_micro_batch, rejected, cps, max_virtual):
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
