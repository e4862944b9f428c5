"""``autoconf plan``'s tables: the sweep's rows, the shortest time per method and network, and the
compact configuration label (``compact``) they and the plots use.
"""

from __future__ import annotations

from rich import box
from rich.table import Table

from autoconf.space.config import ParallelConfig

_SCHED = {"gpipe": "gp", "1f1b": "1f1b", "interleaved": "il", "breadth_first": "bf"}


def compact(c: ParallelConfig) -> str:
    """dp/pp/tp, cp<k> (context parallel), ep<k> (expert parallel), micro-batch, schedule (gp,
    1f1b, il<v>, bf<v>; L: layered), ZeRO, recompute (sel+: selective with Megatron-LM's recompute
    modules), sp; ep<k>o: all-to-alls overlapped (``ep_comm_overlap``)."""
    s = _SCHED[c.schedule] + (str(c.virtual_stages) if c.virtual_stages > 1 else "")
    if c.layered_grad_accum and c.schedule != "breadth_first":
        s += "L"
    ep = f"ep{c.ep}" + ("o" if c.ep_comm_overlap else "")
    parts = ([f"{c.dp}/{c.pp}/{c.tp}"] + ([f"cp{c.cp}"] if c.cp > 1 else []) + ([ep] if c.ep > 1 else [])
             + [f"b{c.micro_batch_size}", s])
    if c.zero_stage:
        parts.append(f"z{c.zero_stage}")
    if c.recompute != "none":
        parts.append(("sel" + ("+" if c.recompute_modules else "")) if c.recompute == "selective" else "full")
    if c.sequence_parallel:
        parts.append("sp")
    if c.dp_all_reduce == "hierarchical":
        parts.append("hier")
    return " ".join(parts)


def _num(x: float) -> str:
    for unit, f in (("P", 1e15), ("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= f:
            return f"{x / f:.3g}{unit}"
    return f"{x:.3g}"


def _days(d: float) -> str:
    """Days for the tables: one decimal, two significant figures below one day (a run of hours
    would read 0.0 otherwise), none from 1,000."""
    if d < 1:
        return f"{d:.2g}"
    return f"{d:,.1f}" if d < 1000 else f"{d:,.0f}"


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f}"


def _plan_table(title: str):
    return Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 0, 0, 1), title_justify="left",
                 title_style="bold")


def plan_report(r, console) -> None:
    """``autoconf plan``'s report (a ``timetotrain.planner.PlanResult``; every line within 80 columns)."""
    from autoconf.specs.devices import stated_accuracy
    from autoconf.timetotrain import laws as scaling
    from autoconf.timetotrain.planner import LEGEND
    m, bud = r.model, r.budget
    say = console.print
    active = f" ({m.active_params() / 1e9:,.3g}B active)" if m.is_moe else ""
    say(f"[bold]autoconf plan[/bold] {m.name}: {m.num_params() / 1e9:,.4g}B parameters{active}, "
        f"sequence {m.seq_length}; "
        f"{r.device} up to {r.grid[-1]:,} GPUs on {r.network}; framework {r.framework}"
        + (f"; FP8 ({r.precision[1]})" if r.precision[0] == "fp8" else "")
        + (f"; profile of {r.profile_kind}" if r.profile_kind else ""))
    say(f"tokens: {_num(bud.tokens)}, {bud.tokens_rule}")
    k = scaling.KAPLAN_BCRIT.constants
    say(f"loss {bud.loss:.3f} nats/token ({'Kaplan' if bud.loss_law == 'kaplan' else 'Chinchilla'} L(N, D)); "
        f"B_crit = {k['B_star_tokens']:.0e} / L^(1/{k['alpha_B']}) = {_num(bud.b_crit_tokens)} tokens = "
        f"{bud.b_crit_tokens / bud.seq_length:,.0f} sequences")
    if bud.law == "kaplan":
        say(f"batch law kaplan (B_crit and S = S_min (1 + B_crit/B), E = E_min (1 + B/B_crit)): batches "
            f"{', '.join(f'{b:,}' for b in bud.batches)}")
    elif bud.law == "deepseek":
        kd = scaling.DEEPSEEK_BATCH.constants
        say(f"batch law deepseek: B_opt = {kd['batch_coef']} C^{kd['batch_exp']}, C = {bud.compute_flops:.3g} FLOPs "
            f"-> {bud.batches[0]:,} sequences; lr_opt = {kd['lr_coef']} C^{kd['lr_exp']} = {bud.learning_rate:.3g}")
    else:
        say(f"batch law fixed: {bud.batches[0]:,} sequences per step "
            f"({bud.batches[0] * bud.seq_length / bud.b_crit_tokens:.2g} x B_crit)")
    laws = {"kaplan": [scaling.KAPLAN_BCRIT], "deepseek": [scaling.DEEPSEEK_BATCH], "fixed": []}[bud.law]
    laws.append(scaling.KAPLAN_LOSS if bud.loss_law == "kaplan" else scaling.CHINCHILLA_LOSS)
    say("[dim]sources: " + "; ".join(f"{law.name}: {law.source}" for law in laws) + "[/dim]")
    for n in bud.notes:
        say(f"[dim]note: {n}[/dim]")
    rows = r.per_gpus()
    if not rows:
        say("[red]no configuration fits at any GPU count of the grid[/red]")
        return
    front = {id(x) for x in r.pareto()}
    t = _plan_table(f"fastest plan per GPU count ({r.network}, every method)")
    cols = ["GPUs", "batch", "config", "s/step", "days", "GPU-h"] + (["cost"] if r.price else []) + ["GiB"]
    for col in cols:
        t.add_column(col, justify="left" if col == "config" else "right", no_wrap=True)
    for x in rows:
        cells = [f"{x.gpus:,}", f"{x.batch:,}", compact(x.estimate.config), f"{x.step_time_s:.3g}",
                 _days(x.days) + ("*" if id(x) in front else " "), _num(x.gpu_hours)]
        if r.price:
            cells.append("$" + _num(x.cost))
        cells.append(_gib(x.estimate.peak_memory_bytes))
        t.add_row(*cells)
    say(t)
    say(f"[dim]{LEGEND}; *: on the time-cost Pareto front; GiB: peak memory per GPU[/dim]")
    sh, sat = r.shortest(), r.saturation()
    per_gpus = r.per_gpus()
    top = max(x.gpus for x in per_gpus)
    say(f"[bold]shortest time: {_days(sh.days)} days[/bold] on {sh.gpus:,} GPUs, batch {sh.batch:,}: "
        f"{sh.steps:,.0f} steps x {sh.step_time_s:.3g} s ({compact(sh.estimate.config)}, "
        f"MFU {100 * sh.estimate.mfu:.0f}%)")
    acc, rng = stated_accuracy(), r.days_range(sh)
    if acc is not None:
        say(f"[dim]step times are the cost model's: median |error| {100 * acc['median_abs_error']:.1f}%, max "
            f"{100 * acc['max_abs_error']:.0f}% against {acc['rows']:,} measured A100 iterations ({acc['framework']} "
            f"runtime, datasheet mode; {acc['bench']}, {acc['date']}); so {_days(sh.days)} days reads as "
            f"{_days(rng['median'][0])}-{_days(rng['median'][1])} (median error), "
            f"{_days(rng['max'][0])}-{_days(rng['max'][1])} (max)[/dim]")
    if sat is not None and sat.gpus < sh.gpus:
        say(f"adding GPUs stops paying at {sat.gpus:,}: {_days(sat.days)} days, within 10% of the shortest "
            f"with {sh.gpus / sat.gpus:.2g}x fewer GPUs")
    elif len(per_gpus) > 1 and sh.gpus == top:
        say(f"adding GPUs still pays at {sh.gpus:,}: every smaller count is more than 10% slower")
    if top > sh.gpus:
        say(f"more GPUs than {sh.gpus:,} are no faster: the batch bounds data parallelism, and more tensor or "
            "pipeline parallelism costs more than it saves")
    unit = "$" if r.price else ""
    say("Pareto front (GPUs: days, " + ("cost" if r.price else "GPU-hours") + "): "
        + "; ".join(f"{x.gpus:,}: {_days(x.days)} d, {unit}{_num(r._cost(x))}" for x in r.pareto()))
    if r.deadline_days is not None:
        d = r.cheapest_within(r.deadline_days)
        say(f"deadline {r.deadline_days:g} days: " + (
            f"cheapest plan {d.gpus:,} GPUs, batch {d.batch:,}: {_days(d.days)} days, {unit}{_num(r._cost(d))} "
            f"({compact(d.estimate.config)})" if d else "[red]no plan of the sweep meets it[/red]"))
    if r.budget_cost is not None:
        b = r.fastest_within_cost(r.budget_cost)
        say(f"budget {unit}{_num(r.budget_cost)}: " + (
            f"fastest plan {b.gpus:,} GPUs, batch {b.batch:,}: {_days(b.days)} days, {unit}{_num(r._cost(b))}"
            if b else "[red]no plan of the sweep fits it[/red]"))
    if r.mtbf_per_gpu_h and sh.goodput is not None:
        gp = sh.goodput
        say(f"restarts: a failure every {gp.mtbf_s / 3600:.3g} h ({r.mtbf_per_gpu_h:,.0f} h per GPU / {sh.gpus:,}); "
            f"checkpoint every {gp.interval_s / 60:.0f} min (Young/Daly sqrt(2 x {r.checkpoint_s:g} s x MTBF)); "
            f"{gp.failures:,.1f} failures and the checkpoints cost {gp.lost_s / 86400:.1f} days "
            f"({100 * (1 - gp.goodput):.0f}%), "
            "counted in the days")
    mt = _plan_table("shortest days without each method (x: vs all)")
    mt.add_column("methods", no_wrap=True)
    for net in r.networks:
        mt.add_column(net, justify="right", no_wrap=True)
    mt.add_column("GPUs", justify="right", no_wrap=True)
    table = r.methods_table()
    for meth in r.methods:
        cells = [meth.label]
        gpus = set()
        for net in r.networks:
            e = next(x for x in table if x["network"] == net and x["method"] == meth.name)
            cells.append("none fits" if e["days"] is None else
                         _days(e["days"]) if meth.name == "all" else f"{_days(e['days'])} x{e['vs_all']:.2f}")
            if e["gpus"]:
                gpus.add(e["gpus"])
        cells.append("/".join(_num(g) for g in sorted(gpus)))
        mt.add_row(*cells)
    say(mt)
    base = r.shortest(r.network, "baseline")
    if base is not None:
        say(f"layered accumulation + modular placement: {base.days / sh.days:.2f}x shorter on {r.network}"
            + "".join(f", {r.shortest(n, 'baseline').days / r.shortest(n, 'all').days:.2f}x on {n}"
                      for n in r.networks[1:] if r.shortest(n, "all") and r.shortest(n, "baseline")))
    for n in r.networks[1:]:
        a = r.shortest(n, "all")
        if a is not None:
            say(f"{n} instead of {r.network}: the shortest time is {a.days / sh.days:.2f}x ({_days(a.days)} days on "
                f"{a.gpus:,} GPUs, {compact(a.estimate.config)})")
    chosen = [("shortest", sh)]
    if sat is not None and sat is not sh:
        chosen.append(("stops paying", sat))
    if r.deadline_days is not None and r.cheapest_within(r.deadline_days) is not None:
        chosen.append(("deadline", r.cheapest_within(r.deadline_days)))
    if base is not None:
        chosen.append(("no methods", base))
    mem = _plan_table("GiB per GPU at the chosen plans (busiest stage)")
    for col in ("plan", "GPUs", "params", "grads", "optim", "acts", "other", "total", "of"):
        mem.add_column(col, justify="left" if col == "plan" else "right", no_wrap=True)
    for label, x in chosen:
        st = max(x.estimate.memory_by_stage, key=lambda s: s.total)
        mem.add_row(label, f"{x.gpus:,}", _gib(st.parameters), _gib(st.gradients), _gib(st.optimizer),
                    _gib(st.activations), _gib(st.other), _gib(st.total), _gib(st.capacity))
    say(mem)
    say("[dim]" + "; ".join(f"{label}: {compact(x.estimate.config)}" for label, x in chosen) + "[/dim]")
    say(f"reproduce the shortest plan: {r.search_command(sh)}"
        + ("" if r.cluster_path else " (write CLUSTER.yaml with --cluster-out)"))
    for n in r.notes:
        say(f"[dim]note: {n}[/dim]")
    st = r.stats
    say(f"[dim]{len(r.grid)} GPU counts x {len(bud.batches)} batches x {len(r.networks)} networks x "
        f"{len(r.methods)} method sets: {st.outer_points:,} outer points, {st.estimates:,} estimates, "
        f"{r.elapsed_s:.1f} s[/dim]")


