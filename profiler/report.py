"""Rich progress bars (rank 0, stderr) and the summary tables printed after a profile is written."""

from __future__ import annotations

import sys

from autoconf.units import fmt_bytes, fmt_seconds


class Bars:
    """A rich Progress on stderr when enabled; every method is a no-op otherwise."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.progress = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=Console(file=sys.stderr), transient=False)

    def __enter__(self):
        if self.progress:
            self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        if self.progress:
            self.progress.__exit__(*exc)

    def task(self, description: str, total: int):
        return self.progress.add_task(description, total=max(total, 0)) if self.progress else None

    def describe(self, task, description: str) -> None:
        if self.progress is not None and task is not None:
            self.progress.update(task, description=description)

    def advance(self, task, n: int = 1) -> None:
        if self.progress is not None and task is not None:
            self.progress.advance(task, n)


def _gbps(x: float) -> str:
    return f"{x / 1e9:.2f} GB/s"


def tables(profile):
    """The summary as a list of rich Tables: layers, memory, GEMMs, link matrix, collectives."""
    from rich.table import Table

    out = []
    t = Table(title=f"layer times ({profile.model.name}, {profile.compute_dtype}, one shard)")
    for c in ("layer", "mbs", "tp", "recompute", "forward", "backward", "spread f/b", "rank"):
        t.add_column(c, justify="left" if c in ("layer", "recompute") else "right")
    for e in profile.compute:
        t.add_row(e.layer, str(e.micro_batch_size), str(e.tp), e.recompute, fmt_seconds(e.forward_s),
                  fmt_seconds(e.backward_s), f"{fmt_seconds(e.forward_spread_s)} / {fmt_seconds(e.backward_spread_s)}",
                  str(e.rank))
    if profile.compute:
        out.append(t)
    if profile.activations:
        t = Table(title="saved activations per layer shard, one micro-batch")
        for c in ("layer", "mbs", "tp", "sp", "recompute", "bytes"):
            t.add_column(c, justify="left" if c in ("layer", "recompute") else "right")
        for a in profile.activations:
            t.add_row(a.layer, str(a.micro_batch_size), str(a.tp), "sp" if a.sequence_parallel else "-", a.recompute,
                      fmt_bytes(a.bytes))
        out.append(t)
    if profile.gemm:
        t = Table(title="GEMM efficiency")
        for c in ("m x n x k", "dtype", "time", "TFLOP/s", "of peak"):
            t.add_column(c, justify="right")
        for g in profile.gemm:
            frac = f"{g.fraction_of_peak:.2f}" if g.fraction_of_peak is not None else "-"
            t.add_row(f"{g.m}x{g.n}x{g.k}", g.dtype, fmt_seconds(g.time_s), f"{g.flop_per_s / 1e12:.3f}", frac)
        out.append(t)
    if profile.links:
        n = profile.world_size
        t = Table(title="links: bandwidth / latency (row sends to column)")
        t.add_column("src \\ dst", justify="right")
        for d in range(n):
            t.add_column(str(d), justify="right")
        for s in range(n):
            row = []
            for d in range(n):
                e = profile.link(s, d)
                row.append("-" if e is None else f"{_gbps(e.bandwidth_bytes_per_s)} / {fmt_seconds(e.latency_s)}")
            t.add_row(str(s), *row)
        out.append(t)
    if profile.collectives:
        t = Table(title="collectives (slowest member)")
        for c in ("op", "ranks", "bytes", "time", "algbw", "busbw"):
            t.add_column(c, justify="left" if c == "op" else "right")
        for c in profile.collectives:
            ranks = f"{c.ranks[0]}..{c.ranks[-1]}"
            t.add_row(c.op, ranks, fmt_bytes(c.bytes), fmt_seconds(c.time_s), _gbps(c.algbw_bytes_per_s),
                      _gbps(c.busbw_bytes_per_s))
        out.append(t)
    return out


def summary(profile, path: str) -> None:
    from rich.console import Console

    console = Console()
    for t in tables(profile):
        console.print(t)
    ov = profile.overhead
    if ov is not None:
        console.print(f"framework overhead per rank: {fmt_bytes(ov.framework_overhead_bytes)} ({ov.method})")
    if profile.pipeline_overhead:
        console.print("pipeline runtime per action (trivial stages, pp 2): " + ", ".join(
            f"{e.schedule} {fmt_seconds(e.per_action_s)}" for e in profile.pipeline_overhead))
    console.print(f"profile written to {path}")
