"""Rich tables for estimates and search results (the CLI's human-readable output)."""

from __future__ import annotations

from rich.table import Table

from .units import fmt_bytes, fmt_seconds

# where each number comes from: one hop from the table to the formula
TERM_SOURCES = {
    "compute": "cost/compute.py: roofline per op, or the host's issue time where longer (cost/chunk_time.py); or the profile's measured layer times",
    "recompute": "cost/compute.py: forward recomputed in backward (full / selective)",
    "tp_comm": "cost/comm.py: Megatron all-reduces (SP: all-gather + reduce-scatter) per layer",
    "bubble": "cost/pipeline.py: simulated schedule, idle time without transfers",
    "pp_comm": "cost/pipeline.py: simulated schedule, extra time from stage-to-stage transfers; the pipeline runtime per action (measured)",
    "dp_comm": "cost/data_parallel.py: gradient reduction not hidden behind backward; ZeRO gathers",
    "optimizer": "cost/compute.py: AdamW, memory-bound",
}


def estimate_tables(e, title: str = "") -> list[Table]:
    t = Table(title=title or f"step time {fmt_seconds(e.step_time_s)}  ({e.config.short()}; framework {e.framework})")
    t.add_column("term")
    t.add_column("time", justify="right")
    t.add_column("share", justify="right")
    t.add_column("formula")
    for k, v in e.breakdown_s.items():
        t.add_row(k, fmt_seconds(v), f"{100 * v / e.step_time_s:.1f}%", TERM_SOURCES.get(k, ""))
    t.add_row("step", fmt_seconds(e.step_time_s), "", f"{e.tokens_per_s:,.0f} tokens/s, MFU {100 * e.mfu:.1f}%")
    m = Table(title="memory per device, by pipeline stage" + ("" if e.fits else "  [red]DOES NOT FIT[/red]"))
    m.add_column("stage")
    for k in ("parameters", "gradients", "optimizer", "activations", "other", "total", "capacity"):
        m.add_column(k, justify="right")
    for i, mm in enumerate(e.memory_by_stage):
        m.add_row(str(i), *(fmt_bytes(getattr(mm, k)) for k in ("parameters", "gradients", "optimizer", "activations",
                                                        "other", "total", "capacity")))
    parts = {k for mm in e.memory_by_stage for k, _ in mm.other_parts}
    if parts:
        m.caption = ("other = " + " + ".join(sorted(parts)) + f"; capacity = device memory less the "
                     f"{e.framework} allocator's fragmentation margin")
    return [t, m]


def search_tables(r) -> list[Table]:
    t = Table(title=f"top {len(r.top)} of {r.valid:,} valid configurations "
                    f"({r.trials_run} trials, {r.estimates:,} estimates, {r.sampler}, {r.elapsed_s:.1f} s)")
    for col in ("#", "dp", "pp", "tp", "mbs", "m", "schedule", "zero", "recompute", "sp",
                "step", "tokens/s", "MFU", "peak mem", "compute", "bubble", "comm"):
        t.add_column(col, justify="right" if col not in ("schedule", "recompute") else "left")
    for i, e in enumerate(r.top, 1):
        c, b = e.config, e.breakdown_s
        sched = c.schedule + (f" v{c.virtual_stages}" if c.virtual_stages > 1 else "") + \
            (" layered" if c.layered_grad_accum and c.schedule != "breadth_first" else "")
        t.add_row(str(i), str(c.dp), str(c.pp), str(c.tp), str(c.micro_batch_size), str(c.num_micro_batches),
                  sched, str(c.zero_stage), c.recompute, "y" if c.sequence_parallel else "",
                  fmt_seconds(e.step_time_s), f"{e.tokens_per_s:,.0f}", f"{100 * e.mfu:.1f}%",
                  fmt_bytes(e.peak_memory_bytes), fmt_seconds(b["compute"] + b["recompute"]),
                  fmt_seconds(b["bubble"]), fmt_seconds(b["tp_comm"] + b["pp_comm"] + b["dp_comm"]))
    rej = Table(title=f"rejected ({r.space_size:,} configurations in the space)")
    rej.add_column("reason")
    rej.add_column("count", justify="right")
    for k, v in sorted(r.rejected.items(), key=lambda kv: -kv[1]):
        rej.add_row(k, f"{v:,}")
    return [t, rej]


def placement_table(outcome: dict, e) -> Table:
    """Where the chosen configuration's stages run (``place.Placer.outcome``), and what placement
    gained over the default order (rank r on device r, layers split evenly)."""
    d, h, p = outcome["default_step_time_s"], outcome["heuristic_step_time_s"], outcome["placed_step_time_s"]
    gain = (f"{d / p:.2f}x faster than the default order ({fmt_seconds(d)})" if outcome["default_fits"]
            else "the default order does not fit in memory")
    t = Table(title="placement of the best configuration")
    for col in ("stage", "hosts", "GPUs", "layers"):
        t.add_column(col, justify="right" if col in ("stage", "layers") else "left")
    for st in outcome["stages"]:
        hosts = st["hosts"]
        shown = ", ".join(hosts) if len(hosts) <= 6 else f"{', '.join(hosts[:3])}, ... {hosts[-1]} ({len(hosts)} hosts)"
        gpus = ", ".join(f"{n} x {k}" for k, n in st["kinds"].items())
        layers = str(st["layers"]) + (f" ({' + '.join(map(str, st['chunk_layers']))})" if len(st["chunk_layers"]) > 1 else "")
        t.add_row(str(st["stage"]), shown, gpus, layers)
    t.caption = (f"{e.config.short()}: {fmt_seconds(p)} per step, {gain}; graph heuristics "
                 f"{fmt_seconds(h)}, then local search ({outcome['evaluations']} estimates)")
    return t
