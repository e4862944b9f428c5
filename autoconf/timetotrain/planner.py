"""Time to train: how many GPUs, for how long, at what cost, and the fastest a model can be trained.

``autoconf plan`` (Lamy-Poirier, arXiv 2106.02679, section 3's question). The batch comes from a
scaling law (``scaling``): with the critical batch size of McCandlish et al. / Kaplan et al. the
steps S = S_min (1 + B_crit / B) and the tokens E = E_min (1 + B / B_crit) trade off around it;
DeepSeek LLM's compute-based B_opt(C) and a batch given by the user are the alternatives. For every
GPU count on a grid and every batch, the best configuration of the cost model's space (the same
space as ``search``: context parallelism included, in one matmul precision, without placement,
which ``place=True`` adds afterwards as ``search``'s local search) gives the step time, hence
days, GPU-hours and cost. The same sweep runs with
each method switched off in turn (layered gradient accumulation, modular placement, ZeRO stages)
and on slower networks, so the table shows what each buys where.

The per-point optimiser (:class:`PointOptimizer`) is exact for the cost model, like ``search``'s
branch and bound, and fast enough for tens of thousands of GPUs:

- one :class:`~autoconf.cost.system.System` per (model, cluster), shared by every GPU count (a GPU
  count uses the first devices of the largest cluster) and every batch: its caches of layer times
  and collective links are filled once;
- on a uniform cluster (one node kind, contiguous ranks) every group of an axis sees the same
  links, so the links of a layout are computed from one group (:func:`_prefill`, checked against
  the cost model's own enumeration in the tests) instead of all of them (O(GPUs));
- every inner choice of every outer point gets true lower bounds on its step time and memory
  without simulating its schedule (:meth:`PointOptimizer.bounds`: the pipeline floor of its
  per-layer compute, the busiest link's transfers, the queued gradient reductions, ZeRO-2/3's
  traffic, and a memory floor); points are visited in bound order and the search stops when the
  next bound reaches the incumbent of every method the point could improve;
- incumbents start from the best configurations of the neighbouring GPU count, batch and network,
  mapped to this one (warm start), so most points are pruned before any estimate.

A mixture of experts is planned over the same space with ``search``'s expert-parallel degrees per
outer point (``study.choices.expert_parallel_choices``); its bounds take the MoE blocks, all-to-alls
included, at their least over every degree the point allows.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from autoconf.cost.estimate import Estimate
from autoconf.cost.system import profile_device_kind
from autoconf.errors import UserError
from autoconf.space.enumeration import MAX_VIRTUAL
from autoconf.specs.cluster import MAX_DEVICES
from autoconf.specs.devices import device_type, stated_accuracy
from autoconf.specs.frameworks import framework as framework_model
from autoconf.specs.hf import load_model
from autoconf.specs.model import preset_names
from autoconf.specs.profile import check_profile_matches
from autoconf.specs.recipes import framework_spec
from autoconf.study.choices import precision_choices
from autoconf.study.placer import Placer
from autoconf.timetotrain import laws as scaling
from autoconf.timetotrain.budget import DEFAULT_FACTORS, Budget, make_budget
from autoconf.timetotrain.counts import OPEN_SIZE, gpu_grid, space_bound, stops_paying
from autoconf.timetotrain.optimiser import PointOptimizer
from autoconf.timetotrain.options import MAX_MICRO_BATCH, PlanOptions
from autoconf.timetotrain.points import PointStats
from autoconf.timetotrain.synthetic import METHODS, NETWORKS, NODES, planning_system, synthetic_cluster

# -- methods ------------------------------------------------------------------------------------



METHOD_NAMES = tuple(m.name for m in METHODS)


# -- networks and synthetic clusters ------------------------------------------------------------


# -- the per-point optimiser ---------------------------------------------------------------------



# -- the sweep ------------------------------------------------------------------------------------

BATCH_FACTORS_DEFAULT = ",".join(f"{f:g}" for f in DEFAULT_FACTORS)
"""``--batch-factors`` as the command line gives it by default."""



@dataclass
class Row:
    """One (network, method, GPU count, batch): the best configuration and what the run costs."""

    network: str
    method: str
    gpus: int
    batch: int
    steps: float
    tokens: float
    estimate: Estimate
    work_days: float
    """Failure-free days: steps x step time."""
    days: float
    """Days with restarts and checkpoints (the same without --mtbf-per-gpu)."""
    gpu_hours: float
    cost: float | None
    goodput: object = None

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s

    def to_dict(self) -> dict:
        e = self.estimate
        mm = max(e.memory_by_stage, key=lambda x: x.total)
        return {"network": self.network, "method": self.method, "gpus": self.gpus, "batch": self.batch,
                "steps": self.steps, "tokens": self.tokens, "step_time_s": e.step_time_s, "work_days": self.work_days,
                "days": self.days, "gpu_hours": self.gpu_hours, "cost": self.cost, "mfu": e.mfu,
                "config": e.config.to_dict(), "config_short": e.config.short(),
                "peak_memory_bytes": e.peak_memory_bytes,
                "memory_bytes": {k: getattr(mm, k) for k in ("parameters", "gradients", "optimizer", "activations",
                                                             "other", "capacity")},
                "goodput": self.goodput.to_dict() if self.goodput else None}


@dataclass
class PlanResult:
    model: object
    device: str
    network: str
    networks: tuple
    framework: str
    budget: Budget
    rows: list
    grid: tuple
    skipped: tuple
    """GPU counts left out: even at the datasheet peak the run would exceed --max-days."""
    cluster: object
    """The main network's largest cluster (what --cluster-out writes)."""
    price: float | None
    deadline_days: float | None
    budget_cost: float | None
    mtbf_per_gpu_h: float | None
    checkpoint_s: float
    restart_s: float
    max_days: float
    stats: PointStats
    elapsed_s: float
    methods: tuple = METHODS
    notes: list = field(default_factory=list)
    model_ref: str | None = None
    """How the command line named the model (preset or file), for the printed search command."""
    cluster_path: str | None = None
    """The cluster file the printed search command reads (--cluster, or --cluster-out)."""
    precision: tuple = ("bf16", "tensorwise")
    """(matmul precision, FP8 recipe) of every plan."""
    profile_kind: str | None = None
    """The device kind of the profile whose measurements priced the devices (None: catalog)."""
    profile_path: str | None = None
    """How the command line named the profile, for the printed search command."""
    max_cp: int | None = None
    """--max-cp as given (None: the default by sequence length)."""
    placed: dict | None = None
    """With ``place``: what the placement pass did (``_place_rows``); None: not searched."""
    never_finish: tuple = ()
    """GPU counts left out because, with ``mtbf_per_gpu_h``, the job would fail faster than it
    progresses (``timetotrain.laws.expected_wall_time``)."""
    max_micro_batch: int = MAX_MICRO_BATCH
    """The largest micro-batch tried (``--max-micro-batch``), for the printed search command."""
    max_virtual: int | None = MAX_VIRTUAL
    """The most chunks per device tried (``--max-virtual-stages``; None: one layer per chunk)."""
    moe_imbalance: float = 1.0
    """A mixture of experts' load imbalance the plans were priced at (``--moe-imbalance``)."""
    moe_dispatcher: str = "alltoall"
    """A mixture of experts' token dispatcher (``--moe-dispatcher``)."""

    # -- selections ----------------------------------------------------------------------------
    def select(self, network=None, method="all") -> list:
        net = network or self.network
        return [r for r in self.rows if r.network == net and r.method == method]

    def per_gpus(self, network=None, method="all") -> list:
        """The fastest row at each GPU count (over batches)."""
        best: dict = {}
        for r in self.select(network, method):
            if r.gpus not in best or r.days < best[r.gpus].days:
                best[r.gpus] = r
        return [best[g] for g in sorted(best)]

    def shortest(self, network=None, method="all") -> Row | None:
        rows = self.select(network, method)
        return min(rows, key=lambda r: (r.days, r.gpus)) if rows else None

    def saturation(self, network=None, method="all", within: float = 0.10) -> Row | None:
        """The fewest GPUs whose fastest plan is within ``within`` of the shortest time: adding
        GPUs beyond it buys less than that."""
        best = self.shortest(network, method)
        if best is None:
            return None
        return min((r for r in self.per_gpus(network, method) if r.days <= best.days * (1 + within)),
                   key=lambda r: r.gpus)

    def _cost(self, r: Row) -> float:
        return r.cost if r.cost is not None else r.gpu_hours

    def pareto(self, network=None, method="all") -> list:
        """Rows no other row beats on both days and cost (GPU-hours without a price), by days."""
        rows = sorted(self.select(network, method), key=lambda r: (r.days, self._cost(r)))
        front, cheapest = [], float("inf")
        for r in rows:
            if self._cost(r) < cheapest:
                front.append(r)
                cheapest = self._cost(r)
        return front

    def cheapest_within(self, days: float) -> Row | None:
        ok = [r for r in self.select() if r.days <= days]
        return min(ok, key=lambda r: (self._cost(r), r.days)) if ok else None

    def fastest_within_cost(self, cost: float) -> Row | None:
        ok = [r for r in self.select() if self._cost(r) <= cost]
        return min(ok, key=lambda r: (r.days, self._cost(r))) if ok else None

    def search_command(self, r: Row, cluster_path: str | None = None) -> str:
        """The ``autoconf search`` command that searches the same space at this plan's GPU count and
        batch (no placement search, as the planner) and finds its configuration."""
        import shlex
        m = self.model
        model_ref = self.model_ref or (m.name if m.name in _preset_names() else "MODEL.yaml")
        path = cluster_path or self.cluster_path or "CLUSTER.yaml"
        same = self.model_ref is None or m.seq_length == _seq_of(self.model_ref)
        seq = "" if same else f" --seq-length {m.seq_length}"
        prec = f" --precision {self.precision[0]}" + (f" --fp8-recipe {self.precision[1]}"
                                                     if self.precision[0] == "fp8" else "")
        extra = "" if self.max_cp is None else f" --max-cp {self.max_cp}"
        if self.max_micro_batch != MAX_MICRO_BATCH:
            extra += f" --max-micro-batch {self.max_micro_batch}"
        if self.max_virtual != MAX_VIRTUAL:
            extra += f" --max-virtual-stages {self.max_virtual or 'all'}"
        if self.moe_imbalance != 1.0:
            extra += f" --moe-imbalance {self.moe_imbalance:g}"
        if self.moe_dispatcher != "alltoall":
            extra += f" --moe-dispatcher {self.moe_dispatcher}"
        if self.profile_kind is not None:
            extra += f" --profile {shlex.quote(self.profile_path or 'PROFILE.json')}"
        return (f"autoconf search --model {shlex.quote(model_ref)} --cluster {shlex.quote(path)}{extra} "
                f"--gpus {r.gpus} --global-batch {r.batch}{seq} --framework {self.framework}{prec} "
                "--storage none" + ("" if self.placed is not None else " --no-place"))

    def to_dict(self) -> dict:
        sh = self.shortest()
        sat = self.saturation()
        out = {"model": self.model.to_dict(), "num_params": self.model.num_params(),
               "active_params": self.model.active_params(), "device": self.device,
               "network": self.network, "networks": list(self.networks), "framework": self.framework,
               "precision": self.precision[0], "fp8_recipe": self.precision[1] if self.precision[0] == "fp8" else None,
               "profile_device_kind": self.profile_kind, "max_cp": self.max_cp, "placement": self.placed,
               "budget": self.budget.to_dict(), "grid": list(self.grid), "skipped_gpus": list(self.skipped),
               "never_finish": list(self.never_finish), "max_micro_batch": self.max_micro_batch,
               "moe_imbalance": self.moe_imbalance, "moe_dispatcher": self.moe_dispatcher,
               "max_days": self.max_days,
               "price_per_gpu_hour": self.price, "deadline_days": self.deadline_days, "budget_cost": self.budget_cost,
               "mtbf_per_gpu_hours": self.mtbf_per_gpu_h, "checkpoint_s": self.checkpoint_s,
               "restart_s": self.restart_s, "methods": [m.to_dict() for m in self.methods],
               "rows": [r.to_dict() for r in self.rows],
               "shortest": sh.to_dict() if sh else None, "saturation": sat.to_dict() if sat else None,
               "pareto": [r.to_dict() for r in self.pareto()],
               "methods_table": self.methods_table(),
               "cluster": self.cluster.to_dict() if self.cluster is not None else None,
               "stats": dataclasses.asdict(self.stats), "elapsed_s": self.elapsed_s, "notes": list(self.notes)}
        if self.deadline_days is not None:
            r = self.cheapest_within(self.deadline_days)
            out["deadline_plan"] = r.to_dict() if r else None
        if self.budget_cost is not None:
            r = self.fastest_within_cost(self.budget_cost)
            out["budget_plan"] = r.to_dict() if r else None
        if sh is not None:
            out["search_command"] = self.search_command(sh)
        out["step_time_accuracy"] = stated_accuracy()
        out["shortest_days_range"] = self.days_range(sh) if sh is not None else None
        return out

    def days_range(self, row) -> dict | None:
        """The days of ``row`` read with the cost model's stated step-time error e
        (``specs.devices.stated_accuracy``; e = predicted / measured - 1): {"median": (low, high),
        "max": (low, high)}, the days over 1 + e and over 1 - e, for the median and the max |e|;
        None where none is stated. (Approximate where restarts are counted: their share of the
        days is not linear in the step time.)"""
        acc = stated_accuracy()
        if acc is None:
            return None
        return {k: (row.days / (1 + e), row.days / (1 - e) if e < 1 else math.inf)
                for k, e in ((k, acc[f"{k}_abs_error"]) for k in ("median", "max"))}

    def methods_table(self) -> list:
        """Per network and method: the shortest time, its GPUs and configuration, and how much
        longer it is than with every method."""
        out = []
        for net in self.networks:
            ref = self.shortest(net, "all")
            for m in self.methods:
                r = self.shortest(net, m.name)
                out.append({"network": net, "method": m.name, "label": m.label,
                            "days": r.days if r else None, "gpus": r.gpus if r else None,
                            "batch": r.batch if r else None,
                            "config_short": r.estimate.config.short() if r else None,
                            "peak_memory_bytes": r.estimate.peak_memory_bytes if r else None,
                            "vs_all": (r.days / ref.days) if (r and ref) else None})
        return out


def _preset_names():
    return preset_names()


def _seq_of(model_ref: str) -> int | None:
    try:
        return load_model(model_ref).seq_length
    except UserError:
        return None


def plan(model, options: PlanOptions | None = None, *, progress=None, **overrides) -> PlanResult:
    """Sweep GPU counts x batches x methods x networks; see the module docstring. ``profile``: a
    profile from ``autoconf profile`` taken on the cluster's device kind (``planning_system``);
    ``precision``: the matmul precision of every plan, bf16 (the model's dtype) or fp8 with
    ``fp8_recipe`` (default: the framework's first recipe the device runs); ``max_cp``: the largest
    context-parallel degree (``enumeration.cp_choices``; default by sequence length, as ``search``).
    ``place``: after the sweep, the fastest plan of each GPU count, method and network gets
    ``search``'s placement (the graph heuristic, then its local search over device order and
    uneven layer splits; the reference trainer only), within ``place_budget_s`` in all.
    ``moe_imbalance``: a mixture of experts' load imbalance (``System.moe_imbalance``, as ``search``);
    ``moe_dispatcher``: its token dispatcher (``System.moe_dispatcher``, as ``search``).
    ``options``: a :class:`~autoconf.timetotrain.options.PlanOptions` (each field documented
    there); keyword ``overrides`` replace its fields. ``progress``: a progress callback."""
    o = dataclasses.replace(options or PlanOptions(), **overrides)
    device, max_gpus, cluster, framework = o.device, o.max_gpus, o.cluster, o.framework
    tokens, batch_law, loss_law, global_batch, batch_factors = (o.tokens, o.batch_law, o.loss_law, o.global_batch,
                                                                 o.batch_factors)
    price_per_gpu_hour, deadline_days, budget = o.price_per_gpu_hour, o.deadline_days, o.budget
    methods, mtbf_per_gpu_h = o.methods, o.mtbf_per_gpu_h
    checkpoint_s, restart_s, max_days, max_micro_batch = o.checkpoint_s, o.restart_s, o.max_days, o.max_micro_batch
    profile, precision, fp8_recipe, max_cp = o.profile, o.precision, o.fp8_recipe, o.max_cp
    place, place_budget_s, moe_imbalance, moe_dispatcher = o.place, o.place_budget_s, o.moe_imbalance, o.moe_dispatcher
    t0 = time.perf_counter()
    fw = framework_model(framework)
    bud = make_budget(model, tokens, batch_law, loss_law, global_batch, batch_factors)
    for name, v in (("--price-per-gpu-hour", price_per_gpu_hour), ("--deadline", deadline_days),
                    ("--budget", budget), ("--mtbf-per-gpu", mtbf_per_gpu_h), ("--max-days", max_days)):
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise UserError(f"{name} {v!r}: must be a positive number")
    if checkpoint_s <= 0 or restart_s < 0:
        raise UserError("--checkpoint-time must be positive and --restart-time 0 or more")
    clusters, net_names, device_name, per_node, top = _clusters(o, model, bud)
    first = next(iter(clusters.values()))
    prof_kind = None
    if profile is not None:
        check_profile_matches(profile, model)
        prof_kind = profile_device_kind(profile)
        if prof_kind not in first.device_kinds():
            how = (f"--device {prof_kind} or a cluster file of it" if prof_kind in NODES
                   else "a cluster file of it")
            raise UserError(f"--profile was measured on {prof_kind or 'several device kinds'}; the cluster's devices "
                            f"are {', '.join(first.device_kinds())}: profile that device kind, or plan on it "
                            f"({how})")
    if precision not in ("bf16", "fp8"):
        raise UserError(f"--precision {precision!r}; valid: bf16, fp8")
    if fp8_recipe is not None and precision != "fp8":
        raise UserError(f"--fp8-recipe {fp8_recipe}: needs --precision fp8")
    # the first System
    systems = {net_names[0]: planning_system(model, first, framework_spec(fw), profile, moe_imbalance, moe_dispatcher)}
    (prec,) = precision_choices(systems[net_names[0]], precision, fp8_recipe)
    # GPU counts worth sweeping: the run would take at most --max-days at the datasheet peak
    flops = model.model_flops_per_token() * min(bud.plan(b).tokens for b in bud.batches)
    dtype = model.dtype if prec[0] == "bf16" else ("mxfp8" if prec[1] == "mxfp8" else "fp8")
    peak = max(device_type(k).peak(dtype) for k in first.device_kinds())  # a bound: the fastest kind
    start = flops / (max_days * 86400 * peak)
    grid = gpu_grid(top, per_node)
    skipped = tuple(g for g in grid if g < start)
    grid = [g for g in grid if g >= start]
    if not grid:
        raise UserError(f"even {top} GPUs at their datasheet peak would take more than --max-days {max_days:g} "
                        f"({flops / (top * peak) / 86400:,.0f} days): raise --max-gpus or --max-days")
    stats = PointStats()
    rows: list = []
    shared_oom: set = set()
    done, total = 0, len(net_names) * len(bud.batches) * len(grid)
    other_net: dict = {}  # (GPUs, batch) -> the best configurations on the networks done before
    never_finish: set = set()  # GPU counts whose job fails faster than it can progress

    def make_row(net: str, mname: str, g: int, b: int, e) -> Row | None:
        bp = bud.plan(b)
        work = bp.steps * e.step_time_s
        gp = None
        wall = work
        if mtbf_per_gpu_h:
            try:
                gp = scaling.expected_wall_time(work, mtbf_per_gpu_h * 3600 / g, checkpoint_s, restart_s)
            except UserError:
                never_finish.add(g)
                return None
            wall = gp.wall_s
        gh = wall / 3600 * g
        return Row(network=net, method=mname, gpus=g, batch=b, steps=bp.steps, tokens=bp.tokens, estimate=e,
                   work_days=work / 86400, days=wall / 86400, gpu_hours=gh,
                   cost=gh * price_per_gpu_hour if price_per_gpu_hour else None, goodput=gp)

    def optimiser(net: str) -> PointOptimizer:  # (the network's System made where it is not yet)
        if net not in systems:
            systems[net] = planning_system(model, clusters[net], framework=framework_spec(fw), profile=profile,
                                           moe_imbalance=moe_imbalance, moe_dispatcher=moe_dispatcher)
        opt = PointOptimizer(systems[net], methods, max_micro_batch, prec, max_cp, o.max_virtual)
        opt.oom = shared_oom
        return opt

    swept: dict = {}  # network -> the GPU counts swept on it
    for net in net_names:
        opt = optimiser(net)
        prev_by_batch: dict = {}
        for g in grid:
            if max_gpus is None and cluster is None and stops_paying(rows, net, swept.get(net, [])):
                break
            if g > clusters[net].num_devices:  # open-ended: a cluster of g GPUs (its System anew)
                clusters[net] = synthetic_cluster(device, g, net)
                del systems[net]
                opt = optimiser(net)
            swept.setdefault(net, []).append(g)
            prev_g: list = []
            for b in bud.batches:
                if b % 1:
                    continue
                seeds = prev_by_batch.get(b, []) + prev_g + other_net.get((g, b), [])
                best, st = opt.run(g, b, seeds)
                stats.add(st)
                found = list(dict.fromkeys(e.config for e in best.values() if e is not None))
                other_net[(g, b)] = other_net.get((g, b), []) + found
                prev_by_batch[b] = found
                prev_g = found
                for mname, e in best.items():
                    row = make_row(net, mname, g, b, e) if e is not None else None
                    if row is not None:
                        rows.append(row)
                done += 1
                if progress:
                    progress(done, total)
    if swept and max_gpus is None and cluster is None:  # what was swept, and the largest cluster of it
        grid = sorted({g for gs in swept.values() for g in gs})
        clusters[net_names[0]] = synthetic_cluster(device, max(swept[net_names[0]]), net_names[0])
        if progress:
            progress(total, total)
    notes = []
    placed = None
    if place and fw.name != "reference":
        notes.append(f"placement not searched: framework {fw.name} runs its own rank order and even layer splits "
                     "(as in `search`)")
    elif place:
        placed = _place_rows(rows, systems, methods, make_row, place_budget_s)
        notes.append(f"placement searched on the fastest plan of each GPU count, method and network: "
                     f"{placed['improved']} of {placed['tried']} configurations improved, by up to "
                     f"{100 * placed['best_gain']:.1f}% ({placed['seconds']:.1f} s)")
    gone = sorted(never_finish)
    if not any(r.network == net_names[0] and r.method == "all" for r in rows):
        if gone:
            raise UserError(f"--mtbf-per-gpu {mtbf_per_gpu_h:g} h: even on {gone[0]:,} GPUs the job fails every "
                            f"{mtbf_per_gpu_h / gone[0]:.2g} h on average, faster than a restart and half a checkpoint "
                            "interval: it would never finish; raise --mtbf-per-gpu or lower --restart-time / "
                            "--checkpoint-time")
        raise UserError(f"no configuration of {model.name} fits in memory on {device_name} at any GPU count up to "
                        f"{top:,}: raise --max-gpus, or plan on a device with more memory")
    if gone:
        notes.append(f"{', '.join(f'{g:,}' for g in gone)} GPUs left out: with --mtbf-per-gpu {mtbf_per_gpu_h:g} h "
                     "the job fails faster than a restart and half a checkpoint interval, so it would never finish")
    if skipped:
        notes.append(f"GPU counts below {grid[0]:,} left out: even at the datasheet peak the run would take more than "
                     f"{max_days:g} days (--max-days)")
    if not fw.layered_grad_accum and "breadth_first" not in fw.schedules:
        notes.append(f"framework {fw.name} has no layered accumulation: those rows equal the ones without it")
    if model.is_moe:
        routing = ("routing perfectly balanced (--moe-imbalance 1)" if moe_imbalance == 1.0 else
                   f"the busiest expert rank {moe_imbalance:g}x its balanced share (--moe-imbalance)")
        a2a = ("exposed, or under another micro-batch's computation where ep_comm_overlap pairs the passes "
               "(Megatron-Core's combined 1F1B, DualPipe's idea)" if "ep_comm_overlap" in fw.knobs
               else "exposed (this framework does not overlap them)")
        notes.append(f"mixture of experts: {routing}, the expert-parallel all-to-alls {a2a}, the scaling laws read at "
                     "its active parameters "
                     f"({model.active_params() / 1e9:,.3g}B of {model.num_params() / 1e9:,.4g}B)")
    if prec[0] == "fp8":
        notes.append(f"FP8 matmuls ({prec[1]} scaling) in every plan: faster GEMMs and different numerics than "
                     f"{model.dtype}; the attention core and the output layer stay in {model.dtype}")
    if profile is not None:
        notes.append(f"device compute from the profile measured on {prof_kind} (per-layer times where it measured "
                     "this model, its GEMM table otherwise) and its collective efficiency; its measured links "
                     "replace the cluster's on the first hosts, in order (as `search --profile` does)")
    return PlanResult(model=model, device=device_name, network=net_names[0], networks=net_names,
                      framework=framework_spec(fw), budget=bud, rows=rows, grid=tuple(grid), skipped=skipped,
                      cluster=clusters[net_names[0]], price=price_per_gpu_hour, deadline_days=deadline_days,
                      budget_cost=budget, mtbf_per_gpu_h=mtbf_per_gpu_h, checkpoint_s=checkpoint_s,
                      restart_s=restart_s, max_days=max_days, stats=stats, elapsed_s=time.perf_counter() - t0,
                      methods=tuple(methods), notes=notes, precision=prec, profile_kind=prof_kind,
                      max_cp=max_cp, placed=placed, never_finish=tuple(gone),
                      max_micro_batch=max_micro_batch, moe_imbalance=moe_imbalance, moe_dispatcher=moe_dispatcher,
                      max_virtual=o.max_virtual)


def _clusters(o: PlanOptions, model, bud) -> tuple:
    """(clusters by network, networks, device name, GPUs per node, the largest GPU count): the
    user's cluster, or synthetic ones of ``o.device`` on each network (open-ended without
    ``o.max_gpus``: a first size, grown as the sweep passes it)."""
    cluster, device, max_gpus = o.cluster, o.device, o.max_gpus
    if cluster is not None:
        if device is not None:
            raise UserError("give --cluster FILE or --device NAME, not both")
        top = cluster.num_devices if max_gpus is None else max_gpus
        if top > cluster.num_devices:
            raise UserError(f"--max-gpus {top}: the cluster has only {cluster.num_devices} devices")
        return ({"cluster": cluster}, ("cluster",), ", ".join(cluster.device_kinds()),
                cluster.node_groups[0].gpus_per_node, top)
    if device is None:
        raise UserError("give --device NAME (or --cluster FILE)")
    for n in (o.network, *o.compare_networks):
        if n not in NETWORKS:
            raise UserError(f"network {n!r}; valid: {', '.join(NETWORKS)}")
    net_names = (o.network,) + tuple(n for n in dict.fromkeys(o.compare_networks) if n != o.network)
    per_node = NODES.get(device, (1,))[0]
    # open-ended: up to what the space can use, and at most the largest cluster a file may declare
    # (a 1T model's sweep past it held 24 GB): beyond it give --max-gpus
    top = max_gpus if max_gpus is not None else min(space_bound(model, bud, per_node, o.max_cp), MAX_DEVICES)
    clusters = {n: synthetic_cluster(device, min(top, OPEN_SIZE) if max_gpus is None else top, n) for n in net_names}
    return clusters, net_names, device, per_node, top


def _place_rows(rows: list, systems: dict, methods, make_row, budget_s: float) -> dict:
    """``search``'s placement (``study.placer.Placer``: the heuristic, then its local search) on the
    fastest row of each GPU count, method and network, in place of its estimate where it is
    faster and fits; each distinct configuration once, all within ``budget_s`` (an equal share of
    what is left each)."""
    t0 = time.perf_counter()
    targets: dict = {}  # (network, method, GPUs) -> index of the fastest row
    for i, r in enumerate(rows):
        k = (r.network, r.method, r.gpus)
        if k not in targets or r.days < rows[targets[k]].days:
            targets[k] = i
    done: dict = {}  # (network, config) -> a faster placed estimate, or None
    placers: dict = {}
    todo = sorted(targets.values())
    best_gain = 0.0
    for n, i in enumerate(todo):
        r = rows[i]
        key = (r.network, r.estimate.config)
        if key not in done:
            share = (budget_s - (time.perf_counter() - t0)) / max(1, len(todo) - n)
            pl = placers.setdefault((r.network, r.gpus), Placer(systems[r.network], r.gpus))
            e, _ = pl.improve(pl(r.estimate.config), max_evaluations=100,
                              deadline=time.perf_counter() + max(share, 0.0))
            done[key] = e if (e.fits and e.step_time_s < r.estimate.step_time_s) else None
        e = done[key]
        if e is not None:
            best_gain = max(best_gain, 1 - e.step_time_s / r.estimate.step_time_s)
            rows[i] = make_row(r.network, r.method, r.gpus, r.batch, e)
    return {"tried": len(done), "improved": sum(e is not None for e in done.values()), "best_gain": best_gain,
            "seconds": time.perf_counter() - t0}


# -- input parsing -------------------------------------------------------------------------------


# -- output ----------------------------------------------------------------------------------------


LEGEND = ("config: dp/pp/tp, cp context parallel, ep expert parallel (o: all-to-alls overlapped), micro-batch b, "
          "schedule (gp gpipe, 1f1b, il<v> interleaved, bf<v> breadth-first; L layered), z ZeRO stage, sel/full "
          "recompute (sel+: with recompute modules), sp sequence parallel")



# -- the command -----------------------------------------------------------------------------------

