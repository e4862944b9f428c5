"""Every rich table the command line prints (the human-readable output), in one place.

Each ``*_report`` function returns a list of renderables (headings, tables, lines) for
:func:`show`. The default columns fit an 80-column terminal: a table's natural width stays
within 80 characters for the usual cases, so nothing is cut to an ellipsis; ``wide=True``
(``--wide``) adds the full breakdown (every memory term, the formulas, the time split), which
needs a wider terminal. Titles and explanations are lines of their own, not table titles or
captions, so they wrap at the terminal's width instead of the table's.
"""

from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text

from autoconf.specs.frameworks import framework as framework_model
from autoconf.specs.recipes import recipe_text
from autoconf.specs.units import fmt_bytes, fmt_seconds

# where each number comes from: one hop from the table to the formula
TERM_SOURCES = {
    "compute": "cost/compute.py: roofline per op, or the host's issue time where longer (cost/chunk_time.py); or the profile's measured layer times",
    "recompute": "cost/compute.py: forward recomputed in backward (full / selective)",
    "tp_comm": "cost/tensor_parallel.py: Megatron all-reduces (SP: all-gather + reduce-scatter) per layer, less what the framework hides under the GEMMs beside them",
    "cp_comm": "cost/context_parallel.py: key/value exchange of the sequence split, beyond the attention it hides behind",
    "ep_comm": ("cost/moe.py: the MoE blocks' dispatch and combine (all-to-alls or DeepEP) over the expert-parallel "
                "group, less what paired micro-batches hide"),
    "bubble": "cost/pipeline.py: simulated schedule, idle time without transfers",
    "pp_comm": "cost/pipeline.py: simulated schedule, extra time from stage-to-stage transfers; the pipeline runtime per action (measured)",
    "dp_comm": "cost/data_parallel.py: gradient reduction not hidden behind backward; ZeRO gathers",
    "optimizer": "cost/compute.py: AdamW, memory-bound",
}


# -- building blocks -----------------------------------------------------------------------------

def _table(**kw) -> Table:
    """A table drawn light: a rule under the header, two spaces between columns, no frame."""
    return Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True, **kw)


def _columns(t: Table, spec) -> None:
    """``spec``: (header, kind) with kind "num" (right-aligned, never wrapped), "text" (left,
    never wrapped) or "wrap" (left; wraps at spaces, folds a word longer than the column rather
    than cutting it to an ellipsis)."""
    for header, kind in spec:
        if kind == "num":
            t.add_column(header, justify="right", no_wrap=True)
        elif kind == "text":
            t.add_column(header, no_wrap=True)
        else:
            t.add_column(header, overflow="fold")


def _heading(text: str) -> Text:
    return Text(text, style="bold")


def show(renderables, console=None) -> None:
    """Print what a ``*_report`` function returned (to stdout unless ``console`` is given)."""
    if console is None:
        from rich.console import Console
        console = Console()
    for r in renderables:
        console.print(r)


def schedule_label(c) -> str:
    """The pipeline schedule with its chunks and layered flag: "interleaved v2", "1f1b layered"."""
    s = c.schedule.replace("_", "-") + (f" v{c.virtual_stages}" if c.virtual_stages > 1 else "")
    return s + (" layered" if c.layered_grad_accum and c.schedule != "breadth_first" else "")


def options_label(c, placement: bool = False, framework: str | None = None) -> str:
    """The choices beyond layout and schedule, compactly: ZeRO stage, recomputation, sequence
    parallelism, the hierarchical all-reduce, the framework's knobs (with ``framework``, only
    those set otherwise than its default); with ``placement``, whether the layers are split
    unevenly and the ranks placed (the placement table shows where)."""
    parts = []
    if c.zero_stage:
        parts.append(f"z{c.zero_stage}")
    if c.recompute != "none":
        parts.append({"selective": "rc-sel", "full": "rc-full"}.get(c.recompute, f"rc-{c.recompute}")
                     + c.modules_label)
    if c.sequence_parallel:
        parts.append("sp")
    if getattr(c, "precision", "bf16") == "fp8":
        parts.append("fp8" if c.fp8_recipe == "tensorwise" else f"fp8-{c.fp8_recipe}")
    parts += _extras(c, placement, framework)
    return " ".join(parts) or "-"


def _extras(c, placement: bool = True, framework: str | None = None) -> list[str]:
    parts = []
    if c.dp_all_reduce != "flat":
        parts.append("hier-ar")
    defaults = {}
    if framework is not None:
        from autoconf.specs.frameworks import framework as framework_model
        defaults = framework_model(framework).defaults
    for knob, tag in (("overlap_grad_reduce", "ogr"), ("overlap_param_gather", "opg"), ("tp_comm_overlap", "tpo"),
                      ("ep_comm_overlap", "epo"), ("torch_compile", "compile")):
        v = getattr(c, knob, None)
        if v is not None and (knob not in defaults or bool(v) != defaults[knob]):
            parts.append(tag if v else f"no-{tag}")
    if placement and c.stage_layers is not None:
        parts.append("uneven")
    if placement and c.device_order is not None:
        parts.append("placed")
    return parts


def config_label(c) -> str:
    """One configuration in a few words: "dp2 pp2 tp1 mbs1 1f1b z1 rc-sel"."""
    opts = options_label(c, placement=True)
    cp = f" cp{c.cp}" if getattr(c, "cp", 1) > 1 else ""
    return (f"dp{c.dp} pp{c.pp} tp{c.tp}{cp} mbs{c.micro_batch_size} {schedule_label(c)}"
            + ("" if opts == "-" else f" {opts}"))


# -- models, devices -----------------------------------------------------------------------------

def _params(n: float) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def models_table(models) -> list:
    t = _table()
    _columns(t, [("name", "text"), ("params", "num"), ("layers", "num"), ("hidden", "num"), ("heads", "num"),
                 ("kv", "num"), ("ffn", "num"), ("vocab", "num"), ("seq", "num"), ("act", "text")])
    for m in models:
        t.add_row(m.name, _params(m.num_params()), str(m.num_layers), str(m.hidden_size), str(m.num_attention_heads),
                  str(m.num_kv_heads), str(m.ffn_hidden_size), str(m.vocab_size), str(m.seq_length), m.activation)
    return [_heading("model presets"), t]


def devices_table(devices) -> list:
    t = _table()
    _columns(t, [("name", "text"), ("bf16", "num"), ("fp8", "num"), ("tf32", "num"),
                 ("fp32", "num"), ("memory", "num"), ("mem bw", "num"), ("GEMM eff", "num")])
    for d in devices:
        fp8, tf32 = d.peak_flop_per_s.get("fp8"), d.peak_flop_per_s.get("tf32")
        t.add_row(d.name, f"{d.peak_flop_per_s.get('bf16', 0) / 1e12:g}", f"{fp8 / 1e12:g}" if fp8 else "-",
                  f"{tf32 / 1e12:g}" if tf32 else "-", f"{d.peak_flop_per_s['fp32'] / 1e12:g}",
                  f"{d.memory_bytes / 2**30:.0f} GiB", f"{d.memory_bandwidth_bytes_per_s / 1e9:g} GB/s",
                  f"{d.gemm_efficiency:g}")
    return [_heading("device catalog (datasheet, dense TFLOP/s; a profile replaces the efficiencies)"), t]


# -- estimate ------------------------------------------------------------------------------------

def estimate_report(e, wide: bool = False) -> list:
    """The step time term by term and the memory per pipeline stage of one estimate. Default: the
    source file of each term, and memory as model states (parameters + gradients + optimizer),
    activations, other; ``wide``: the formula of each term and every memory term."""
    out = [_heading(f"{e.config.short()} ({e.framework})"),
           Text(f"step time {fmt_seconds(e.step_time_s)}, {e.tokens_per_s:,.0f} tokens/s, MFU {100 * e.mfu:.1f}%")]
    t = _table()
    _columns(t, [("term", "text"), ("time", "num"), ("share", "num"), ("formula" if wide else "source", "wrap")])
    for k, v in e.breakdown_s.items():
        src = TERM_SOURCES.get(k, "")
        t.add_row(k, fmt_seconds(v), f"{100 * v / e.step_time_s:.1f}%", src if wide else src.split(":")[0])
    t.add_row("step", fmt_seconds(e.step_time_s), "", "")
    out += [Text(""), _heading("time per step, by term"), t]

    m = _table()
    terms = (("parameters", "gradients", "optimizer") if wide else ("model states",)) + \
        ("activations", "other", "total", "capacity")
    _columns(m, [("stage", "num")] + [(k, "num") for k in terms])
    for i, mm in enumerate(e.memory_by_stage):
        vals = {"model states": mm.parameters + mm.gradients + mm.optimizer}
        m.add_row(str(i), *(fmt_bytes(vals[k] if k in vals else getattr(mm, k)) for k in terms))
    out += [Text(""), _heading("memory per device, by pipeline stage") if e.fits else
            Text("memory per device, by pipeline stage: DOES NOT FIT", style="bold red"), m]
    parts = {k for mm in e.memory_by_stage for k, _ in mm.other_parts}
    notes = []
    if not wide:
        notes.append("model states = parameters + gradients + optimizer (--wide splits them)")
    if parts:
        notes.append("other = " + " + ".join(sorted(parts)))
    notes.append(f"capacity = device memory less the {e.framework} allocator's fragmentation margin")
    notes.append("framework " + recipe_text(framework_model(e.framework)))
    out += [Text(n, style="dim") for n in notes]
    out += [Text(f"note: {n}") for n in e.notes]
    out += [Text(r, style="red") for r in e.reasons]
    return out


# -- search --------------------------------------------------------------------------------------

def search_table(r, wide: bool = False, rows: int | None = None) -> Table:
    """The best configurations, fastest first. Default: layout, schedule, options, step time, MFU
    and peak memory; ``wide``: every field in its own column, tokens/s and the time split."""
    t = _table()
    top = r.top[:rows] if rows else r.top
    cp = any(e.config.cp > 1 for e in top)  # a column only where context parallelism is chosen
    if wide:
        _columns(t, [("#", "num"), ("dp", "num"), ("pp", "num"), ("tp", "num"), ("cp", "num"), ("mbs", "num"), ("m", "num"),
                     ("schedule", "wrap"), ("zero", "num"), ("recompute", "text"), ("sp", "text"), ("other", "wrap"),
                     ("step", "num"), ("tokens/s", "num"), ("MFU", "num"), ("peak mem", "num"), ("compute", "num"),
                     ("bubble", "num"), ("comm", "num")])
    else:
        _columns(t, [("#", "num"), ("dp", "num"), ("pp", "num"), ("tp", "num")] + ([("cp", "num")] if cp else [])
                 + [("mbs", "num"), ("schedule", "wrap"), ("options", "wrap"), ("step", "num"), ("MFU", "num"),
                    ("memory", "num")])
    for i, e in enumerate(top, 1):
        c, b = e.config, e.breakdown_s
        if wide:
            t.add_row(str(i), str(c.dp), str(c.pp), str(c.tp), str(c.cp), str(c.micro_batch_size), str(c.num_micro_batches),
                      schedule_label(c), str(c.zero_stage),
                      c.recompute + c.modules_label,
                      "y" if c.sequence_parallel else "",
                      " ".join(_extras(c)), fmt_seconds(e.step_time_s), f"{e.tokens_per_s:,.0f}",
                      f"{100 * e.mfu:.1f}%", fmt_bytes(e.peak_memory_bytes), fmt_seconds(b["compute"] + b["recompute"]),
                      fmt_seconds(b["bubble"]),
                      fmt_seconds(b["tp_comm"] + b.get("cp_comm", 0.0) + b.get("ep_comm", 0.0) + b["pp_comm"]
                                  + b["dp_comm"]))
        else:
            t.add_row(str(i), str(c.dp), str(c.pp), str(c.tp), *([str(c.cp)] if cp else []),
                      str(c.micro_batch_size), schedule_label(c),
                      options_label(c, framework=e.framework), fmt_seconds(e.step_time_s), f"{100 * e.mfu:.1f}%",
                      fmt_bytes(e.peak_memory_bytes))
    return t


def rejected_table(r) -> Table:
    t = _table()
    _columns(t, [("reason", "wrap"), ("count", "num")])
    for k, v in sorted(r.rejected.items(), key=lambda kv: -kv[1]):
        t.add_row(k, f"{v:,}")
    return t


def search_tables(r, wide: bool = False, rows: int | None = None) -> list:
    """The top configurations and what was rejected, with their headings."""
    n = len(r.top[:rows] if rows else r.top)
    out = [_heading(f"top {n} of {r.valid:,} valid configurations"),
           Text(f"{r.trials_run} trials, {r.estimates:,} estimates, {r.sampler}, {r.elapsed_s:.1f} s", style="dim"),
           search_table(r, wide, rows)]
    if not wide:
        out.append(Text("options: z ZeRO stage, rc recomputation, sp sequence parallelism, fp8 FP8 linears, knobs "
                        "(ogr, opg, tpo, epo, compile) where not the framework's default; --wide: all", style="dim"))
    out += [Text(""), _heading(f"rejected ({r.space_size:,} configurations in the space)"), rejected_table(r)]
    return out


def placement_report(outcome: dict, e) -> list:
    """Where the chosen configuration's stages run (``study.placer.Placer.outcome``), and what placement
    gained over the default order (rank r on device r, layers split evenly)."""
    d, h, p = outcome["default_step_time_s"], outcome["heuristic_step_time_s"], outcome["placed_step_time_s"]
    gain = (f"{d / p:.2f}x faster than the default order ({fmt_seconds(d)})" if outcome["default_fits"]
            else "the default order does not fit in memory")
    t = _table()
    _columns(t, [("stage", "num"), ("hosts", "wrap"), ("GPUs", "wrap"), ("layers", "num")])
    for st in outcome["stages"]:
        hosts = st["hosts"]
        shown = ", ".join(hosts) if len(hosts) <= 6 else f"{', '.join(hosts[:3])}, ... {hosts[-1]} ({len(hosts)} hosts)"
        gpus = ", ".join(f"{n} x {k}" for k, n in st["kinds"].items())
        layers = str(st["layers"]) + (f" ({' + '.join(map(str, st['chunk_layers']))})" if len(st["chunk_layers"]) > 1 else "")
        t.add_row(str(st["stage"]), shown, gpus, layers)
    return [Text(""), _heading("placement of the best configuration"), t,
            Text(f"{fmt_seconds(p)} per step, {gain}; graph heuristics {fmt_seconds(h)}, then local search "
                 f"({outcome['evaluations']} estimates)", style="dim")]


def placement_table(outcome: dict, e) -> Table:
    """The table of :func:`placement_report` alone."""
    return next(r for r in placement_report(outcome, e) if isinstance(r, Table))


def verified_report(verified: list, wide: bool = False, ranks: dict | None = None) -> list:
    """The verifying trials against their predictions. ``ranks``: config short string -> its
    place in the search's top list (the "#" column). Why a trial failed or was refused is a line
    below the table; ``wide`` adds the predicted peak memory."""
    from autoconf.space.config import ParallelConfig

    t = _table()
    spec = [("#", "num"), ("configuration", "wrap"), ("predicted", "num"), ("measured", "num"), ("error", "num")]
    spec += [("peak pred", "num"), ("peak meas", "num")] if wide else [("peak mem", "num")]
    _columns(t, spec + [("status", "text")])
    why = []
    for i, v in enumerate(verified, 1):
        tr = v["trial"]
        c = ParallelConfig.from_dict(v["config"])
        n = (ranks or {}).get(c.short(), i)
        meas = tr.get("step_time_s")
        err = f"{100 * (v['predicted_step_time_s'] / meas - 1):+.1f}%" if tr["ok"] and meas else ""
        peak = fmt_bytes(tr["peak_memory_bytes"]) if tr.get("peak_memory_bytes") else "-"
        status = "refused" if v.get("refused") else "ok" if tr["ok"] else "failed"
        if status != "ok":
            why.append(Text(f"#{n} {status}: {v.get('refused') or tr.get('reason')}", style="red"))
        t.add_row(str(n), config_label(c), fmt_seconds(v["predicted_step_time_s"]), fmt_seconds(meas) if meas else "-",
                  err, *([fmt_bytes(v["predicted_peak_memory_bytes"]), peak] if wide else [peak]), status)
    out = [Text(""), _heading("verified by real trials (error: predicted / measured - 1)"), t, *why]
    speeds = [v["speed_vs_profile"] for v in verified if v.get("speed_vs_profile")]
    if speeds:
        lo, hi = min(speeds), max(speeds)
        out.append(Text(f"machine speed during the trials: the profile's reference block took {lo:.2f}-{hi:.2f}x its "
                        "profiled time" + (" (the machine ran slower or faster than when profiled; step-time errors "
                                           "include that drift)" if max(abs(lo - 1), abs(hi - 1)) > 0.1 else "")))
    return out


def study_line(r) -> str:
    """Where the search's trials are kept, whether it resumed, and how to resume it."""
    from autoconf.study.storage import sqlite_path
    if not r.storage or (r.storage.startswith("sqlite:///") and sqlite_path(r.storage) is None):
        return (f"study {r.study_name!r} in memory only ({r.trials_total} trials, nothing written; "
                "--storage sqlite:///FILE.db keeps them)")
    where = sqlite_path(r.storage) or r.storage
    if r.resumed:
        head = f"resumed study {r.study_name!r} ({r.earlier_trials} trials): {r.trials_run} new"
    else:
        head = f"new study {r.study_name!r}: {r.trials_run} trials"
    return f"{head}, kept in {where}; the same command resumes it (--storage none keeps nothing)"


def near_ties(top: list) -> dict | None:
    """The fitting configurations of ``top`` (fastest first) predicted within the cost model's
    stated median step-time error of the fastest (``specs.devices.stated_accuracy``): {"count",
    "within", "configs"}; None where no accuracy is stated or nothing fits. The development set
    shows what to do with them: measuring the model's top 3 finds the measured best within 3% in
    123 of 126 groups, its pick alone in 79 (bench/gpu_devset.py)."""
    from autoconf.specs.devices import stated_accuracy
    acc = stated_accuracy()
    fits = [e for e in top if e.fits]
    if acc is None or not fits:
        return None
    e = acc["median_abs_error"]
    close = [x for x in fits if x.step_time_s <= fits[0].step_time_s * (1 + e)]
    return {"count": len(close), "within": e, "configs": [x.config.short() for x in close]}


def search_report(r, best, wide: bool = False, rows: int | None = None, verified=None, calibration=None,
                  calibrate_path: str | None = None, emitted=None) -> list:
    """Everything `autoconf search` prints: the top configurations, what was rejected, where the
    best runs, notes, the verifying trials and calibration, the pick, the study, launch files."""
    out = search_tables(r, wide, rows)
    if r.placement:
        out += placement_report(r.placement[next(i for i, e in enumerate(r.top) if e is best)], best)
    out += [Text(f"note: {n}") for n in r.notes]
    if verified:
        ranks = {e.config.short(): i for i, e in enumerate(r.top, 1)}
        out += verified_report(verified, wide, ranks)
        if calibration:
            b, a = calibration["before"], calibration["after"]
            out.append(Text(f"calibration saved to {calibrate_path}: step-time error median "
                            f"{100 * b['time_median']:.1f}% -> {100 * a['time_median']:.1f}%, peak memory "
                            f"{100 * b['memory_median']:.1f}% -> {100 * a['memory_median']:.1f}% (on the {a['n']} "
                            "verifying trials)"))
    out += [Text(""), Text(f"best: {best.config.short()}", style="bold"),
            Text(f"predicted {fmt_seconds(best.step_time_s)} per step, {best.tokens_per_s:,.0f} tokens/s, "
                 f"MFU {100 * best.mfu:.1f}%, {fmt_bytes(best.peak_memory_bytes)} peak")]
    ties = None if verified else near_ties(r.top[:rows] if rows else r.top)
    if ties and ties["count"] > 1:
        out.append(Text(f"{ties['count']} of these are predicted within {100 * ties['within']:.1f}% of the best "
                        "(the cost model's median step-time error on GPUs): the model does not order them "
                        f"reliably; --verify {ties['count']} measures them", style="dim"))
    out.append(Text(study_line(r), style="dim"))
    if emitted:
        out.append(Text(f"launch files: {', '.join(emitted)}"))
    return out


# -- trial ---------------------------------------------------------------------------------------

def trial_report(result, est, note: str, config) -> list:
    """One trial measured against the cost model's prediction."""
    t = _table()
    _columns(t, [("quantity", "text"), ("measured", "num"), ("predicted", "num"), ("error", "num")])

    def row(name, measured, predicted, fmt):
        m = fmt(measured) if measured is not None else "-"
        p = fmt(predicted) if predicted is not None else "-"
        err = f"{(predicted - measured) / measured:+.0%}" if measured and predicted is not None else ""
        t.add_row(name, m, p, err)

    row("step time", result.step_time_s, getattr(est, "step_time_s", None), lambda v: f"{v * 1e3:.1f} ms")
    row("peak memory", result.peak_memory_bytes, getattr(est, "peak_memory_bytes", None),
        lambda v: f"{v / 2**20:.1f} MiB")
    out = [_heading(f"trial: {config.short()}"), t]
    if not result.ok:
        out.append(Text(f"trial failed: {result.reason}", style="red"))
    else:
        out.append(Text(f"losses: {', '.join(f'{x:.4f}' for x in result.losses)}   wall {result.wall_s:.1f} s   "
                        f"memory: {result.memory_method}"))
    if note:
        out.append(Text(note, style="yellow"))
    return out


# -- profile -------------------------------------------------------------------------------------

def _gbps(x: float) -> str:
    return f"{x / 1e9:.2f} GB/s"


def _spread(spread: float, value: float) -> str:
    return f"{100 * spread / value:.0f}%" if value > 0 else "-"


MATRIX_MAX_RANKS = 6
"""Links are shown as rank-by-rank matrices up to this many ranks (they fit 80 columns), and as a
summary by pair of hosts beyond."""


def profile_tables(profile) -> list:
    """The summary of a profile: layers, saved activations, GEMMs, links, collectives."""
    out = []
    if profile.compute:
        t = _table()
        _columns(t, [("layer", "text"), ("mbs", "num"), ("tp", "num"), ("recompute", "text"), ("forward", "num"),
                     ("backward", "num"), ("spread f/b", "num"), ("rank", "num")])
        for e in profile.compute:
            t.add_row(e.layer, str(e.micro_batch_size), str(e.tp), e.recompute, fmt_seconds(e.forward_s),
                      fmt_seconds(e.backward_s),
                      f"{_spread(e.forward_spread_s, e.forward_s)} / {_spread(e.backward_spread_s, e.backward_s)}",
                      str(e.rank))
        out += [_heading(f"layer times ({profile.model.name}, {profile.compute_dtype}, one shard)"), t,
                Text("spread: of the samples, relative to the median", style="dim")]
    if profile.activations:
        t = _table()
        _columns(t, [("layer", "text"), ("mbs", "num"), ("tp", "num"), ("sp", "text"), ("recompute", "text"),
                     ("bytes", "num")])
        for a in profile.activations:
            t.add_row(a.layer, str(a.micro_batch_size), str(a.tp), "sp" if a.sequence_parallel else "-", a.recompute,
                      fmt_bytes(a.bytes))
        out += [Text(""), _heading("saved activations per layer shard, one micro-batch"), t]
    if profile.gemm:
        t = _table()
        _columns(t, [("m x n x k", "num"), ("dtype", "text"), ("time", "num"), ("TFLOP/s", "num"), ("of peak", "num")])
        for g in profile.gemm:
            frac = f"{g.fraction_of_peak:.2f}" if g.fraction_of_peak is not None else "-"
            t.add_row(f"{g.m}x{g.n}x{g.k}", g.dtype, fmt_seconds(g.time_s), f"{g.flop_per_s / 1e12:.3f}", frac)
        out += [Text(""), _heading("GEMM efficiency"), t]
    if profile.links:
        out += [Text("")] + _link_tables(profile)
    if profile.collectives:
        t = _table()
        _columns(t, [("op", "text"), ("ranks", "num"), ("bytes", "num"), ("time", "num"), ("algbw", "num"),
                     ("busbw", "num")])
        for c in profile.collectives:
            t.add_row(c.op, f"{c.ranks[0]}..{c.ranks[-1]}", fmt_bytes(c.bytes), fmt_seconds(c.time_s),
                      _gbps(c.algbw_bytes_per_s), _gbps(c.busbw_bytes_per_s))
        out += [Text(""), _heading("collectives (slowest member)"), t]
    return out


def _link_tables(profile) -> list:
    n = profile.world_size
    if n <= MATRIX_MAX_RANKS:
        out = []
        for what, fmt in (("bandwidth, GB/s", lambda e: f"{e.bandwidth_bytes_per_s / 1e9:.3g}"),
                          ("latency", lambda e: fmt_seconds(e.latency_s))):
            t = _table()
            _columns(t, [("src \\ dst", "num")] + [(str(d), "num") for d in range(n)])
            for s in range(n):
                t.add_row(str(s), *("-" if (e := profile.link(s, d)) is None else fmt(e) for d in range(n)))
            out += [_heading(f"links: {what} (row sends to column)"), t]
        return out
    host = {r.rank: r.host for r in profile.ranks}
    groups: dict = {}
    for s in range(n):
        for d in range(n):
            e = profile.link(s, d) if s != d else None
            if e is not None:
                groups.setdefault((host.get(s, "?"), host.get(d, "?")), []).append(e)
    t = _table()
    _columns(t, [("from host", "wrap"), ("to host", "wrap"), ("pairs", "num"), ("bw min", "num"), ("bw median", "num"),
                 ("latency", "num")])
    for (a, b), es in sorted(groups.items()):
        bws = sorted(e.bandwidth_bytes_per_s for e in es)
        lats = sorted(e.latency_s for e in es)
        t.add_row(a, b, str(len(es)), _gbps(bws[0]), _gbps(bws[len(bws) // 2]), fmt_seconds(lats[len(lats) // 2]))
    return [_heading(f"links between {n} ranks, by pair of hosts (latency: median)"), t]


def profile_report(profile, path: str) -> list:
    """What `autoconf profile` prints once the profile is written."""
    out = profile_tables(profile)
    ov = profile.overhead
    if ov is not None:
        out.append(Text(f"framework overhead per rank: {fmt_bytes(ov.framework_overhead_bytes)} ({ov.method})"))
    if profile.pipeline_overhead:
        out.append(Text("pipeline runtime per action (trivial stages, pp 2): " + ", ".join(
            f"{e.schedule} {fmt_seconds(e.per_action_s)}" for e in profile.pipeline_overhead)))
    out.append(Text(f"profile written to {path}"))
    return out


# -- autoconf plan -------------------------------------------------------------------------------

