"""Pictures (``--plot DIR``): the simulated step of a configuration, and the search's time versus memory.

- ``timeline.png`` / ``.svg``: one row per pipeline device (stage), every forward and backward of the
  step as the cost model's own simulation ran it (``cost.timeline.step_timeline``, which reads the
  events out of ``cost.pipeline``'s simulation), with the exposed tensor-parallel and ZeRO
  communication inside each op, the point-to-point transfers in flight, the data-parallel gradient
  reductions, the parameter gather and the optimizer step; idle time is the bubble.
- ``time-memory.png`` / ``.svg`` (search): every configuration the search estimated, predicted step
  time against peak memory per device, the usable device memory, the Pareto front and the pick.

matplotlib is optional (``pip install 'autoconf-parallel[plot]'``) and imported only here, only when
``--plot`` is given; figures are drawn on the Agg canvas, never through pyplot.
"""

from __future__ import annotations

import math
import os

from autoconf.errors import UserError
from autoconf.files import write_atomic
from autoconf.output.plan_report import _num
from autoconf.timetotrain.planner import PlanResult

__all__ = ["check_plotting", "plot_estimate", "plot_search", "timeline_figure", "time_memory_figure"]

INSTALL_HINT = "pip install 'autoconf-parallel[plot]' (or pip install 'matplotlib>=3.7')"

# forward blues and backward oranges (a device's second chunk lighter; more chunks: a ramp)
_FORWARD = ("#3b6fb6", "#8db3e2")
_BACKWARD = ("#e07b39", "#f4b183")
_PART_COLOR = {"tp_comm": "#7b5ea7", "cp_comm": "#c77dff", "ep_comm": "#e76f51", "dp_comm": "#2a9d8f",
               "runtime": "#9a9a9a"}
_TRANSFER = "#333333"
_REDUCTION = "#c0392b"
_GATHER = "#d98cb3"
_OPTIMIZER = "#6b5a3e"
_IDLE = "#ececec"
_DENSE = "#8e7578"  # forward and backward too narrow to draw apart


def check_plotting(directory: str) -> None:
    """Before any work: matplotlib can be imported and ``directory`` can hold the pictures."""
    import importlib
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise UserError(f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}") from None
    from autoconf.files import check_dir
    check_dir(directory, "--plot")


# ------------------------------------------------------------------------------------------------
# what the commands call


def plot_estimate(directory: str, estimate, model, cluster=None, profile=None, calibration=None,
                  framework=None) -> list[str]:
    """Draw the timeline of ``estimate``'s configuration; returns the files written."""
    from autoconf.cost.system import System
    ctx = System(model, cluster, profile, calibration, framework=framework)
    return _save(timeline_figure(estimate, ctx, _where(model, cluster)), directory, "timeline")


def plot_search(directory: str, result, best, model, cluster=None, profile=None, calibration=None,
                framework=None, global_batch: int | None = None) -> list[str]:
    """Draw the chosen configuration's timeline and the search's time versus memory."""
    from autoconf.cost.system import System
    ctx = System(model, cluster, profile, calibration, framework=framework)
    where = _where(model, cluster)
    files = _save(timeline_figure(best, ctx, where), directory, "timeline")
    return files + _save(time_memory_figure(result, best, ctx, where, global_batch), directory, "time-memory")


def _where(model, cluster) -> str:
    return f"{model.name} on {cluster.name if cluster is not None else 'the profiled machines'}"


def _save(fig, directory: str, stem: str) -> list[str]:
    """PNG and SVG, each written atomically (temp file in the directory, then renamed); the same
    figure gives the same bytes (no date, fixed SVG ids)."""
    import matplotlib
    os.makedirs(directory, exist_ok=True)
    out = []
    for ext, kw in (("png", {"dpi": 150}), ("svg", {"metadata": {"Date": None}})):
        path = os.path.join(directory, f"{stem}.{ext}")
        with matplotlib.rc_context({"svg.hashsalt": stem}):
            write_atomic(path, lambda f: fig.savefig(f, format=ext, **kw), binary=True)
        out.append(path)
    return out


def _figure(width: float, height: float):
    """A figure on its own Agg canvas: no pyplot, no GUI, nothing global switched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _seconds(s: float) -> str:
    from autoconf.specs.units import fmt_seconds
    return fmt_seconds(s)


# ------------------------------------------------------------------------------------------------
# the timeline


def _shade(palette: tuple, local: int, v: int) -> str:
    """The colour of a device's ``local``-th chunk: two shades for two chunks, a ramp for more."""
    if v <= 2:
        return palette[local]
    import matplotlib
    cmap = matplotlib.colormaps["Blues" if palette is _FORWARD else "Oranges"]
    return matplotlib.colors.to_hex(cmap(0.4 + 0.55 * local / (v - 1)))


def _ink(color: str) -> str:
    """Black or white text, whichever reads on ``color``."""
    import matplotlib
    r, g, b = matplotlib.colors.to_rgb(color)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


_ROW = 0.62  # op box height; transfers drawn below it, reductions above it


def _draw_step(ax, st, x0: float, x1: float, numbers: bool = True) -> bool:
    """Draw the step ``st`` (a StepTimeline) on ``ax`` between times x0 and x1, with the
    micro-batch numbers in the boxes wide enough for them (``numbers``). Returns whether the ops
    were too narrow to draw apart (then each device's busy stretches are drawn whole, idle gaps
    narrower than a pixel left out, and the transfers left to a zoomed panel)."""
    tl, pp, v, h = st.pipeline, st.config.pp, st.virtual_stages, _ROW
    t_red = tl.makespan_s + st.dp_tail_s
    t_gather = t_red + st.post_gather_s
    t_end = t_gather + st.optimizer_s
    ax.set_xlim(x0, x1)
    ax.set_ylim(pp - 0.35, -0.65)
    px_per_s = ax.get_window_extent().width / (x1 - x0)
    shown = [op for op in tl.ops if op.end_s >= x0 and op.start_s <= x1]
    widths = sorted(op.end_s - op.start_s for op in shown)
    dense = bool(widths) and widths[len(widths) // 2] * px_per_s < 3.0

    for d in range(pp):  # idle: the row's background over the step
        ax.broken_barh([(0.0, t_end)], (d - h / 2, h), facecolors=_IDLE, edgecolor="none", zorder=0)
    if dense:
        runs: dict = {}
        for op in sorted(shown, key=lambda op: op.start_s):
            mine = runs.setdefault(op.device, [])
            if mine and (op.start_s - mine[-1][1]) * px_per_s < 1.0:
                mine[-1][1] = max(mine[-1][1], op.end_s)
            else:
                mine.append([op.start_s, op.end_s])
        for d, xr in runs.items():
            ax.broken_barh([(a, b - a) for a, b in xr], (d - h / 2, h), facecolors=_DENSE, edgecolor="none", zorder=2)
    else:
        boxes: dict = {}
        for op in shown:  # each op split into its parts, numbered where the number fits
            base = _shade(_FORWARD if op.kind == "F" else _BACKWARD, op.chunk // pp, v)
            parts = (st.forward_parts if op.kind == "F" else st.backward_parts)[op.chunk]
            total = sum(s for _, s in parts) or 1.0
            x, width = op.start_s, op.end_s - op.start_s
            for part, s in parts:
                w = width * s / total
                boxes.setdefault((op.device, _PART_COLOR.get(part, base), part == "recompute"), []).append((x, w))
                x += w
            text = str(op.micro_batch)
            if numbers and width * px_per_s >= 6.5 * len(text) + 6 and x0 <= op.start_s + width / 2 <= x1:
                ax.text(op.start_s + width / 2, op.device, text, ha="center", va="center", fontsize=7,
                        color=_ink(base), zorder=3, clip_on=True)
        for (d, color, hatched), xr in boxes.items():
            ax.broken_barh(xr, (d - h / 2, h), facecolors=color, zorder=2,
                           **({"hatch": "//", "edgecolor": "white", "linewidth": 0.0} if hatched else
                              {"edgecolor": "white", "linewidth": 0.4}))
        by_dst: dict = {}  # transfers in flight to each stage, under its row
        for t in tl.transfers:
            if t.end_s >= x0 and t.start_s <= x1:
                by_dst.setdefault(t.dst_device, []).append((t.start_s, t.end_s - t.start_s))
        for d, xr in by_dst.items():
            ax.broken_barh(xr, (d + h / 2 + 0.03, 0.09), facecolors=_TRANSFER, edgecolor="none", zorder=2)
    for d, spans in enumerate(st.dp_reductions):  # data-parallel reductions, over its row
        if spans:
            ax.broken_barh([(a, b - a) for a, b, _ in spans], (d - h / 2 - 0.12, 0.09), facecolors=_REDUCTION,
                           edgecolor="none", zorder=2)
    for d in range(pp):  # after the pipeline: every device waits for the slowest, gathers, steps
        if st.post_gather_s > 0:
            ax.broken_barh([(t_red, st.post_gather_s)], (d - h / 2, h), facecolors=_GATHER, zorder=2)
        ax.broken_barh([(t_gather, st.optimizer_s)], (d - h / 2, h), facecolors=_OPTIMIZER, zorder=2)
    ax.axvline(tl.makespan_s, color="black", linestyle=":", linewidth=0.9, zorder=4)
    ax.grid(axis="x", color="#cccccc", linewidth=0.5)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return dense


def _zoom_window(st, width_px: float) -> float:
    """Seconds of a zoomed panel ``width_px`` wide in which a typical op is wide enough for its
    number; 0 when the whole step already is."""
    durations = sorted(op.end_s - op.start_s for op in st.pipeline.ops)
    typical = durations[len(durations) // 2]
    window = width_px * typical / 40.0
    return window if 2.5 * window < st.step_time_s else 0.0


def timeline_figure(estimate, ctx, where: str = ""):
    """The step of ``estimate.config`` as simulated, one row per pipeline device; where the ops
    are too narrow for their micro-batch numbers, the start and end of the step again, zoomed."""
    import textwrap

    from matplotlib.patches import Patch

    from autoconf.cost.timeline import step_timeline
    from autoconf.study.placer import describe

    c = estimate.config
    st = step_timeline(c, ctx)
    tl, pp, v = st.pipeline, c.pp, st.virtual_stages
    t_end = st.step_time_s
    row_in = 0.62 if pp > 1 else 0.8
    fig = _figure(14.0, 2.3 + row_in * pp)
    ax = fig.add_subplot()
    fig.canvas.draw()  # lay out once: the axes' width in pixels says which boxes can hold a number
    window = _zoom_window(st, ax.get_window_extent().width / 2)
    if window:  # a second row of panels: the warm-up and the cool-down, zoomed
        fig.set_figheight(2.8 + 2 * row_in * pp)
        grid = fig.add_gridspec(2, 2, height_ratios=(1, 1))
        ax.set_subplotspec(grid[0, :])
        zooms = (fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1]))
        fig.canvas.draw()
    dense = _draw_step(ax, st, 0.0, t_end * 1.005, numbers=not window)  # the zoomed panels number them
    if window:
        left, right = zooms
        _draw_step(left, st, 0.0, window)
        _draw_step(right, st, t_end - window, t_end + 0.005 * window)
        left.set_title(f"the first {_seconds(window)}", fontsize=9, loc="left")
        right.set_title(f"the last {_seconds(window)}", fontsize=9, loc="left")
        right.set_yticks([])
        right.spines["left"].set_visible(False)
        for z in zooms:
            ax.axvspan(z.get_xlim()[0], z.get_xlim()[1], color="#ffd54f", alpha=0.25, zorder=-1)
            z.set_xlabel("time in the step (s)", fontsize=9)

    stages = describe(ctx, c)
    ticks = []
    for s in stages:
        kinds = ", ".join(f"{n} x {k}" for k, n in s.kinds)
        hosts = s.hosts[0] if len(s.hosts) == 1 else f"{s.hosts[0]}..{s.hosts[-1]}"
        ticks.append(f"stage {s.stage}\n{kinds}\n{hosts}")
    for a in (ax, zooms[0]) if window else (ax,):
        a.set_yticks(range(pp), ticks, fontsize=8)
    busy = [0.0] * pp
    for op in tl.ops:
        busy[op.device] += op.end_s - op.start_s
    idle = ax.secondary_yaxis("right")
    idle.set_yticks(range(pp), [f"idle {100 * (1 - b / tl.makespan_s):.0f}%\nof the pipeline" for b in busy],
                    fontsize=8)
    idle.tick_params(length=0)
    idle.spines["right"].set_visible(False)
    ax.set_xlabel("time in the step (s)", fontsize=9)

    sched = st.schedule + (f", {v} chunks per device" if v > 1 else "")
    if st.schedule != c.schedule:
        sched += " (layered accumulation at pp=1: one layer per chunk)"
    after = [f"{name} {_seconds(s)}" for name, s in (("gradient reduction beyond it", st.dp_tail_s),
                                                    ("ZeRO parameter gather", st.post_gather_s),
                                                    ("optimizer step", st.optimizer_s)) if s > 0]
    lines = [f"{where}: {c.short()}" if where else c.short(),
             f"predicted {_seconds(estimate.step_time_s)} per step, {estimate.tokens_per_s:,.0f} tokens/s, MFU "
             f"{100 * estimate.mfu:.1f}%, peak {estimate.peak_memory_bytes / 2**30:.1f} GiB per device"
             + ("" if estimate.fits else " (DOES NOT FIT)"),
             f"pipeline {_seconds(tl.makespan_s)}: {sched}, {c.num_micro_batches} micro-batches (numbers in the "
             f"boxes); after it (dotted line): {', '.join(after)}"]
    if st.simulated_micro_batches != c.num_micro_batches:
        lines.append(f"all {c.num_micro_batches} micro-batches simulated here; the estimate simulated "
                     f"{st.simulated_micro_batches} and extrapolated the steady state ({_seconds(st.priced_makespan_s)})")
    if ctx.calibration is not None:
        lines.append(f"the simulation before calibration: {_seconds(st.step_time_s)}")
    fig.suptitle("\n".join(textwrap.fill(line, 170) for line in lines), fontsize=10)

    if v == 1:
        legend = [Patch(facecolor=_FORWARD[0], label="forward"), Patch(facecolor=_BACKWARD[0], label="backward")]
    else:
        legend = [Patch(facecolor=_shade(pal, i, v), label=f"{'forward' if pal is _FORWARD else 'backward'} chunk {i}")
                  for pal in (_FORWARD, _BACKWARD) for i in ((0, 1, 2, 3) if v <= 4 else (0, v - 1)) if i < v]
    present = {p for parts in st.forward_parts + st.backward_parts for p, _ in parts}
    if "recompute" in present:
        legend.append(Patch(facecolor=_BACKWARD[0], hatch="//", edgecolor="white", label="recompute"))
    for part, label in (("tp_comm", "TP comm (exposed)"), ("cp_comm", "CP key/value exchange (exposed)"),
                        ("ep_comm", "MoE all-to-alls"),
                        ("dp_comm", "ZeRO comm per micro-batch (exposed)"),
                        ("runtime", "pipeline runtime")):
        if part in present:
            legend.append(Patch(facecolor=_PART_COLOR[part], label=label))
    if tl.transfers:
        legend.append(Patch(facecolor=_TRANSFER, label="p2p transfer in flight (to this stage)"))
    if any(st.dp_reductions):
        legend.append(Patch(facecolor=_REDUCTION, label="DP gradient reduction"))
    if st.post_gather_s > 0:
        legend.append(Patch(facecolor=_GATHER, label="ZeRO parameter all-gather"))
    if dense:
        legend.append(Patch(facecolor=_DENSE, label="forward + backward, too dense to tell apart (zoomed below)"))
    legend += [Patch(facecolor=_OPTIMIZER, label="optimizer step"), Patch(facecolor=_IDLE, label="idle (bubble)")]
    fig.legend(handles=legend, loc="outside lower center", ncol=min(len(legend), 6), fontsize=8, frameon=False)
    return fig


# ------------------------------------------------------------------------------------------------
# the search's time versus memory


def _pareto(points: dict) -> list:
    """The configurations of ``points`` (config -> (time, memory)) that no other matches in time
    with less memory, nor beats in both: ``(time, memory, config)`` in ascending time."""
    front, best_mem = [], math.inf
    for (t, mem), config in sorted(((tm, c) for c, tm in points.items()), key=lambda x: x[0]):
        if mem < best_mem:
            front.append((t, mem, config))
            best_mem = mem
    return front


def time_memory_figure(result, best, ctx, where: str = "", global_batch: int | None = None):
    """Every configuration the search estimated: predicted step time against peak memory per
    device. Those that do not fit were priced for memory only in the search; their step time is
    estimated here (as if the memory were there) to place them."""
    from autoconf.cost.estimate import estimate_on

    fit, over = {}, {}
    for config, t, mem, ok in result.evaluated:
        if ok:
            fit[config] = (t, mem)
        elif config not in over:
            if not math.isfinite(t):
                e = estimate_on(config, ctx)
                t, mem = e.step_time_s, e.peak_memory_bytes
            over[config] = (t, mem)
    fit.setdefault(best.config, (best.step_time_s, best.peak_memory_bytes))
    gib = 2.0 ** 30

    fig = _figure(10.0, 6.4)
    ax = fig.add_subplot()
    if over:
        xs, ys = zip(*over.values())
        ax.scatter(xs, [y / gib for y in ys], marker="x", s=18, color="#a0a0a0", linewidths=0.9,
                   label=f"does not fit ({len(over):,}; its time as if it did)", zorder=2)
    xs, ys = zip(*fit.values())
    ax.scatter(xs, [y / gib for y in ys], s=22, color="#3b6fb6", alpha=0.8, edgecolors="none",
               label=f"fits ({len(fit):,})", zorder=3)
    front = _pareto(fit)
    ax.step([t for t, _, _ in front], [m / gib for _, m, _ in front], where="post", color="#e07b39",
            linewidth=1.4, zorder=4)
    ax.scatter([t for t, _, _ in front], [m / gib for _, m, _ in front], s=36, facecolors="none",
               edgecolors="#e07b39", linewidths=1.4, label=f"Pareto front: none both faster and smaller ({len(front)})",
               zorder=5)
    import textwrap
    chosen = textwrap.fill(f"chosen: {best.config.short()}", 60, subsequent_indent="  ")
    ax.scatter([best.step_time_s], [best.peak_memory_bytes / gib], marker="*", s=260, color="#c0392b",
               edgecolors="black", linewidths=0.6, zorder=6,
               label=f"{chosen}\n  {_seconds(best.step_time_s)}, {best.peak_memory_bytes / gib:.1f} GiB")

    caps: dict = {}
    for d in range(ctx.num_devices):
        caps.setdefault(ctx.capacity_bytes(d), set()).add(ctx.topology.kind_of[d])
    for cap, kinds in sorted(caps.items()):
        ax.axhline(cap / gib, color="#c0392b", linestyle="--", linewidth=1.0, zorder=1)
        ax.annotate(f"usable memory per device: {cap / gib:.1f} GiB ({', '.join(sorted(kinds))})", (1.0, cap / gib),
                    xycoords=("axes fraction", "data"), xytext=(-4, 3), textcoords="offset points", fontsize=8,
                    ha="right", color="#c0392b")
    times = [t for t, _ in list(fit.values()) + list(over.values())]
    if max(times) / min(times) > 20:
        ax.set_xscale("log")
    mems = [m for _, m in list(fit.values()) + list(over.values())] + list(caps)
    if max(mems) / min(mems) > 8:
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel("predicted step time (s)")
    ax.set_ylabel("peak memory per device (GiB)")
    ax.grid(color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(loc="best", fontsize=8)
    skipped = result.rejected.get("slower than the best found (bound, not simulated)", 0)
    batch = f", global batch {global_batch}" if global_batch else ""
    earlier = len(result.evaluated) - result.estimates
    sub = (f"{len(result.evaluated):,} configurations estimated of {result.valid:,} valid"
           + (f" ({earlier:,} as recorded by earlier runs of the study, one per point)" if earlier else "")
           + (f"; {skipped:,} more skipped (their least possible step time was already slower)" if skipped else ""))
    beaten = [p for p in front if p[0] <= best.step_time_s and p[1] < best.peak_memory_bytes]
    if beaten:
        t, m, other = min(beaten, key=lambda p: p[1])
        why = ("the search ranks by predicted step time alone" if result.top and best is result.top[0]
               else "the pick was made by measured trials")
        sub += (f"\nthe chosen one is not on the front: {other.short()} is predicted at {_seconds(t)} with "
                f"{m / gib:.1f} GiB ({why})")
    fig.suptitle("\n".join(textwrap.fill(line, 125) for line in f"search: {where}{batch}\n{sub}".split("\n")),
                 fontsize=10)
    return fig


def write_plots(r: PlanResult, directory: str) -> list:
    """days vs GPUs per method (and network), cost vs days with the Pareto front: PNG and SVG."""
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    written = []

    def save(fig, name):
        from autoconf.files import write_atomic
        for ext in ("png", "svg"):
            path = os.path.join(directory, f"{name}.{ext}")
            write_atomic(path, lambda f: fig.savefig(f, format=ext, dpi=120, bbox_inches="tight"), binary=True)
            written.append(path)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    styles = ["-", "--", ":", "-."]
    for ni, net in enumerate(r.networks):
        for meth in r.methods:
            if ni > 0 and meth.name not in ("all", "baseline"):
                continue
            rows = r.per_gpus(net, meth.name)
            if rows:
                ax.plot([x.gpus for x in rows], [x.days for x in rows], styles[ni % 4], marker="o", markersize=3,
                        label=f"{meth.label} ({net})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("days to train")
    ax.set_title(f"{r.model.name} on {r.device}: {_num(r.budget.tokens)} tokens, batch law {r.budget.law}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, "days_vs_gpus")

    fig, ax = plt.subplots(figsize=(8, 5))
    rows = r.select()
    ax.scatter([x.days for x in rows], [r._cost(x) for x in rows], s=12, alpha=0.6, label="GPU count x batch")
    front = r.pareto()
    ax.plot([x.days for x in front], [r._cost(x) for x in front], "r-o", markersize=4, label="Pareto front")
    for x in front:
        ax.annotate(f"{x.gpus:,}", (x.days, r._cost(x)), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if r.deadline_days is not None:
        ax.axvline(r.deadline_days, color="grey", linestyle="--", label=f"deadline {r.deadline_days:g} d")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("days to train")
    ax.set_ylabel("cost ($)" if r.price else "GPU-hours")
    ax.set_title(f"{r.model.name}: time against cost ({r.network}, every method)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, "cost_vs_days")
    return written
