"""Turn what the ranks gathered into an autoconf.specs.profile.Profile (rank 0 only; no torch needed)."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys

from autoconf.errors import UserError
from autoconf.specs.devices import device_type
from autoconf.specs.profile import (
    PROFILE_VERSION,
    ActivationEntry,
    CollectiveEntry,
    GemmEntry,
    HostInfo,
    LayerTiming,
    LinkEntry,
    MemoryEntry,
    MemoryOverhead,
    OptimizerTiming,
    ParameterEntry,
    PipelineOverheadTiming,
    Profile,
    Provenance,
    RankInfo,
    TpBlockTiming,
)
from autoconf.version import __version__
from profiler.links import merge_collectives


def _peak(kind: str | None, dtype: str) -> float | None:
    """The catalog's peak for a GEMM row's dtype (``fp8_<recipe>`` rows: the fp8 peak)."""
    if kind is None:
        return None
    if dtype.startswith("fp8_"):
        dtype = "fp8"
    try:
        return device_type(kind).peak(dtype)
    except UserError:
        return None


def assemble(args, model, everyone: list[dict], gathered: list[dict], backend: str, split: str, repeats: int,
             elapsed_s: float) -> Profile:
    import torch


    ranks = tuple(RankInfo(**e["rank"]) for e in sorted(everyone, key=lambda e: e["rank"]["rank"]))
    hosts, seen = [], set()
    for e in sorted(everyone, key=lambda e: e["rank"]["rank"]):
        h = e["host"]
        if h["name"] not in seen:
            seen.add(h["name"])
            hosts.append(HostInfo(name=h["name"], interfaces=tuple(h["interfaces"]), cpu_count=h["cpu_count"],
                                  memory_bytes=h["memory_bytes"], machine=h.get("machine", "")))
    compute, gemm, acts, params, step_peaks, memory = [], [], {}, {}, {}, []
    for r, g in enumerate(gathered):
        kind = g["kind"]
        for t in g["timings"]:
            compute.append(LayerTiming(layer=t["layer"], micro_batch_size=t["micro_batch_size"], tp=t["tp"],
                                       recompute=t["recompute"], forward_s=t["forward_s"], backward_s=t["backward_s"],
                                       forward_spread_s=t["forward_spread_s"], backward_spread_s=t["backward_spread_s"],
                                       repeats=t["repeats"], device_kind=kind, rank=r))
            nbytes, count = t["parameter_bytes"]
            params[(t["layer"], t["tp"])] = ParameterEntry(layer=t["layer"], tp=t["tp"], bytes=nbytes, count=count)
            if t.get("step_peak_bytes") is not None:
                step_peaks[f"{t['layer']}/{t['micro_batch_size']}/{t['tp']}/{t['recompute']}"] = t["step_peak_bytes"]
        for x in g["gemm"]:
            flops = 2.0 * x["m"] * x["n"] * x["k"] / x["time_s"]
            peak = _peak(kind, x["dtype"])
            gemm.append(GemmEntry(m=x["m"], n=x["n"], k=x["k"], dtype=x["dtype"], time_s=x["time_s"], flop_per_s=flops,
                                  fraction_of_peak=flops / peak if peak else None, device_kind=kind))
        for x in g.get("memory", ()):
            memory.append(MemoryEntry(bytes=x["bytes"], time_s=x["time_s"], dtype=x["dtype"], device_kind=kind))
        for a in g["acts"]:
            key = (a["layer"], a["micro_batch_size"], a["tp"], a["sequence_parallel"], a["recompute"])
            acts[key] = ActivationEntry(**a)
    links = [LinkEntry(**{**x, "sizes_bytes": tuple(x["sizes_bytes"]), "times_s": tuple(x["times_s"])})
             for g in gathered for x in g["links"]]
    colls = [CollectiveEntry(**{**c, "ranks": tuple(c["ranks"])}) for c in merge_collectives([g["coll"] for g in gathered])]
    worst = max(everyone, key=lambda e: e["overhead"]["bytes"])["overhead"]
    overhead = MemoryOverhead(framework_overhead_bytes=worst["bytes"], method=worst["method"] + " (largest over ranks)",
                              step_peak_bytes=step_peaks)
    notes = [
        f"compute split: {split}" + (" (rank 0 measured every layer while the others waited at a barrier)"
                                     if split == "serial" else " (the ranks of each device kind shared the items)"),
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, torch threads {torch.get_num_threads()}",
        f"repeats {repeats} in {args.rounds} round(s) per layer, quick={bool(args.quick)}, compute timed without "
        "sequence parallelism",
        f"profiling took {elapsed_s:.1f} s; load average at the end "
        + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs (other work skews timings)",
        "rank 0 phases ended at (s since start): " + ", ".join(f"{k} {v:.1f}" for k, v in gathered[0]["phases"].items()),
        f"python {platform.python_version()}",
    ]
    notes += list(dict.fromkeys(x for g in gathered for x in g.get("notes", ())))
    prov = Provenance(hosts=tuple(hosts), device_names=tuple(sorted({r.device_name for r in ranks})),
                      torch_version=torch.__version__, backend=backend,
                      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      command=command_line(), world_size=len(ranks), autoconf_version=__version__, notes=tuple(notes))
    order = {"embedding": 0, "block": 1, "head": 2}
    return Profile(
        version=PROFILE_VERSION, provenance=prov, model=model, ranks=ranks, compute_dtype=model.dtype,
        compute=tuple(sorted(compute, key=lambda c: (order[c.layer], c.tp, c.micro_batch_size, c.recompute))),
        gemm=tuple(sorted(gemm, key=lambda e: (e.m * e.n * e.k, e.m, e.n, e.k, e.dtype.startswith("fp8_"), e.dtype))),
        memory=tuple(sorted(memory, key=lambda e: (e.device_kind or "", e.dtype, e.bytes))),
        activations=tuple(sorted(acts.values(), key=lambda a: (order[a.layer], a.tp, a.sequence_parallel,
                                                               a.micro_batch_size, a.recompute))),
        parameters=tuple(sorted(params.values(), key=lambda p: (order[p.layer], p.tp))),
        overhead=overhead, links=tuple(sorted(links, key=lambda x: (x.src, x.dst))),
        collectives=tuple(sorted(colls, key=lambda c: (c.op, len(c.ranks), c.ranks, c.bytes))),
        tp_blocks=tuple(TpBlockTiming(**x, device_kind=gathered[0]["kind"]) for x in gathered[0].get("tp_blocks", ())),
        optimizer=tuple(OptimizerTiming(**x, device_kind=g["kind"]) for g in gathered for x in g.get("optimizer", ())),
        pipeline_overhead=tuple(PipelineOverheadTiming(**x) for x in gathered[0].get("pipeline", ())),
    )


def command_line() -> str:
    return os.environ.get("AUTOCONF_PROFILE_COMMAND") or " ".join(shlex.quote(a) for a in [sys.executable, "-m", "profiler"] + sys.argv[1:])
