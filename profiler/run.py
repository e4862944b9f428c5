"""The profiler's main: run under torchrun, measure, gather to rank 0, write the profile.

Phases: environment (hosts, devices, interfaces, framework overhead) -> compute (layer timings,
GEMM table, activation and parameter bytes) -> point-to-point links -> collectives -> pipeline
runtime (per schedule, trivial stages) -> write.

Who measures compute (``--compute-split``):

- ``serial`` (the default on CPU): rank 0 measures everything while the other ranks wait at a
  barrier (a gloo barrier sleeps; it burns no CPU). CPU ranks share the host's cores, so measuring
  on several at once would time contention, not the device; the numbers are those of one rank
  running alone with OMP_NUM_THREADS threads. Only rank 0's host is measured.
- ``split`` (the default on CUDA): the ranks of each device kind split that kind's items
  round-robin, so each kind is measured on its own devices in 1/n of the time.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import sys
import tempfile
import time
import warnings

from autoconf.errors import UserError
from autoconf.specs.hf import load_model

RECOMPUTE_MODES = ("none", "selective", "full")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m profiler", description="Measure a model and the links between ranks "
                                "(run under torchrun; see `autoconf profile` to launch locally).")
    add_measure_args(p)
    p.add_argument("--out", required=True, help="where to write the profile JSON")
    return p.parse_args(argv)


def add_measure_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by `python -m profiler` and `autoconf profile`."""
    p.add_argument("--model", required=True, help="preset name, model YAML, or Hugging Face config.json")
    p.add_argument("--seq-length", type=int, default=None, help="override the model's sequence length")
    p.add_argument("--micro-batch-sizes", default=None, help="comma-separated (default 1,2,4; --quick 1,2)")
    p.add_argument("--tp", default=None, help="comma-separated tp shard degrees (default: powers of two up to the "
                   "ranks per node that divide the heads and the FFN)")
    p.add_argument("--recompute", default=",".join(RECOMPUTE_MODES), help="comma-separated recompute modes to time")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement (default 10; --quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 2; --quick 1)")
    p.add_argument("--rounds", type=int, default=None,
                   help="time every layer in this many rounds spread over the compute phase, the repeats split "
                   "between them, and take the median of all (a machine whose speed moves for seconds at a time "
                   "then skews no single layer; default 3, --quick 1)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (tests, a first look)")
    p.add_argument("--compute-split", choices=("auto", "serial", "split"), default="auto",
                   help="who measures compute: serial = rank 0 alone, split = ranks of a device kind share the "
                   "items (auto: serial on CPU, split on CUDA)")
    p.add_argument("--serial-links", action="store_true",
                   help="measure one pair of ranks at a time instead of disjoint pairs in parallel")
    p.add_argument("--skip-links", action="store_true", help="no point-to-point or collective measurements")
    p.add_argument("--skip-compute", action="store_true", help="no layer, GEMM or memory measurements")
    p.add_argument("--links-only", action="store_true",
                   help="only the point-to-point links (implies --skip-compute; no collectives, no pipeline "
                   "runtime): a quick look at a network, e.g. an emulated one from `autoconf testbed`")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars (rank 0 draws them on stderr, when it is a terminal)")
    p.add_argument("--timeout-min", type=float, default=60.0, help="process-group timeout (ranks wait at barriers "
                   "while others measure)")


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--{what}={text!r}: expected comma-separated positive integers, e.g. 1,2,4") from None
    if not vals or any(v < 1 for v in vals):
        raise UserError(f"--{what}={text!r}: expected comma-separated positive integers, e.g. 1,2,4")
    return sorted(set(vals))


def check_measure_args(args, model) -> dict:
    """Check the measurement flags (one-line UserErrors naming the value and what is valid) and
    return them resolved: micro_batch_sizes, repeats, warmup, rounds, recompute (modes) and tps
    (None: the default, which depends on the ranks per node). `autoconf profile` calls this before
    it launches torchrun, the ranks again (``python -m profiler`` runs without it)."""
    quick = args.quick
    mbs_list = _ints(args.micro_batch_sizes if args.micro_batch_sizes is not None else ("1,2" if quick else "1,2,4"),
                     "micro-batch-sizes")
    if args.repeats is not None and args.repeats < 1:
        raise UserError(f"--repeats {args.repeats}: expected an integer >= 1")
    repeats = args.repeats if args.repeats is not None else (3 if quick else 10)
    if args.warmup is not None and args.warmup < 0:
        raise UserError(f"--warmup {args.warmup}: expected an integer >= 0")
    warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
    rounds = args.rounds if args.rounds is not None else (1 if quick else 3)
    if args.rounds is None:
        rounds = min(rounds, repeats)  # the default follows a small --repeats
    if rounds < 1 or rounds > repeats:
        raise UserError(f"--rounds {rounds}: expected 1 to the number of repeats ({repeats})")
    rc_modes = [m.strip() for m in (args.recompute or "").split(",") if m.strip()]
    bad = [m for m in rc_modes if m not in RECOMPUTE_MODES]
    if bad or not rc_modes:
        raise UserError(f"--recompute {args.recompute!r}: expected comma-separated modes from "
                        f"{', '.join(RECOMPUTE_MODES)}")
    tps = _ints(args.tp, "tp") if args.tp is not None else None
    for t in tps or ():
        if model.num_attention_heads % t or model.num_kv_heads % t or model.ffn_hidden_size % t:
            raise UserError(f"--tp {t} does not divide num_attention_heads({model.num_attention_heads}), "
                            f"num_kv_heads({model.num_kv_heads}) and ffn_hidden_size({model.ffn_hidden_size}) "
                            f"of model {model.name}: expected a common divisor, e.g. "
                            f"{','.join(map(str, default_tps(model, 8)))}")
    timeout = args.timeout_min
    if timeout is None or not math.isfinite(timeout) or timeout <= 0:
        raise UserError(f"--timeout-min {timeout}: expected a finite number of minutes above 0")
    if getattr(args, "links_only", False) and args.skip_links:
        raise UserError("--links-only and --skip-links leave nothing to measure")
    return {"micro_batch_sizes": mbs_list, "repeats": repeats, "warmup": warmup, "rounds": rounds,
            "recompute": rc_modes, "tps": tps}


def default_tps(model, local_world: int) -> list[int]:
    out, t = [], 1
    while t <= max(1, local_world):
        if not (model.num_attention_heads % t or model.num_kv_heads % t or model.ffn_hidden_size % t):
            out.append(t)
        t *= 2
    return out


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        return run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    import torch
    import torch.distributed as dist

    from profiler import compute, env, links, report

    warnings.filterwarnings("ignore", category=FutureWarning, module="torch")
    model = load_model(args.model, seq_length=args.seq_length)
    quick = args.quick
    checked = check_measure_args(args, model)
    mbs_list, repeats, warmup = checked["micro_batch_sizes"], checked["repeats"], checked["warmup"]
    rounds, rc_modes = checked["rounds"], checked["recompute"]
    args.rounds = rounds

    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    if "MASTER_ADDR" not in os.environ:  # a plain `python -m profiler`: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"),
                          RANK="0", WORLD_SIZE="1")
    kw = {"device_id": device} if cuda else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=args.timeout_min), **kw)
    t_start = time.perf_counter()

    overhead = _overhead(device)
    me = env.rank_info(rank, local_rank, local_world)
    everyone = [None] * world
    dist.all_gather_object(everyone, {"rank": me, "host": env.host_info(), "overhead": overhead})
    ranks = sorted((e["rank"] for e in everyone), key=lambda r: r["rank"])
    max_local = max(sum(1 for r in ranks if r["host"] == h) for h in {r["host"] for r in ranks})
    tps = checked["tps"] if checked["tps"] is not None else default_tps(model, max_local)
    split = args.compute_split if args.compute_split != "auto" else ("split" if cuda else "serial")

    links_only = getattr(args, "links_only", False)
    if links_only:
        args.skip_compute = True
    items = [] if args.skip_compute else compute.layer_items(mbs_list, tps, rc_modes)
    act_items = [] if args.skip_compute else compute.activation_items(mbs_list, tps, rc_modes)
    gemms = [] if args.skip_compute else compute.gemm_shapes(model, mbs_list, tps, quick, cuda)
    measurers = _measurers(ranks, split)
    mine = measurers.get(rank)  # (index, count) among the ranks of this rank's device kind, or None
    my_items = items[mine[0]::mine[1]] if mine else []
    my_acts = act_items[mine[0]::mine[1]] if mine else []
    my_gemms = gemms[mine[0]::mine[1]] if mine else []
    fp8_notes: list[str] = []
    my_fp8 = _fp8_items(me["device_kind"], my_gemms, fp8_notes)
    p2p_sizes = links.P2P_SIZES_QUICK if quick else links.P2P_SIZES
    coll_sizes = links.COLLECTIVE_SIZES_QUICK if quick else links.COLLECTIVE_SIZES
    hosts = [r["host"] for r in ranks]  # ranks is sorted by rank
    n_rounds = 0 if args.skip_links or world < 2 else links.link_rounds(world, args.serial_links, hosts)
    n_coll = 0 if args.skip_links or links_only or world < 2 else links.collective_steps(world, coll_sizes)

    phases: dict = {}  # phase -> seconds since the start when it ended
    bars = report.Bars(enabled=rank == 0 and report.wanted(getattr(args, "quiet", False)))
    with bars:
        t_compute = bars.task("compute (this rank's share)", len(my_items) * rounds + len(my_acts) + len(my_gemms)
                             + len(my_fp8))
        acts, gemm_rows = [], []
        samples: list[list[dict]] = [[] for _ in my_items]
        for r in range(rounds):  # the repeats are split between rounds; later rounds warm up once
            per_round = repeats // rounds + (1 if r < repeats % rounds else 0)
            for it, got in zip(my_items, samples):
                bars.describe(t_compute, f"{it.layer} mbs={it.micro_batch_size} tp={it.tp} rc={it.recompute}"
                              + (f" (round {r + 1}/{rounds})" if rounds > 1 else ""))
                got.append(compute.time_item(model, it, device, warmup if r == 0 else 1, per_round))
                bars.advance(t_compute)
        timings = [compute.merge_rounds(got) for got in samples]
        for layer, mbs, tp, sp, rc in my_acts:
            bars.describe(t_compute, f"saved bytes {layer} mbs={mbs} tp={tp} sp={sp} rc={rc}")
            acts.append({"layer": layer, "micro_batch_size": mbs, "tp": tp, "sequence_parallel": sp, "recompute": rc,
                         "bytes": compute.saved_bytes(model, layer, mbs, tp, sp, rc, device)})
            bars.advance(t_compute)
        for m, n, k in my_gemms:
            bars.describe(t_compute, f"GEMM {m}x{n}x{k} {model.dtype}")
            gemm_rows.append({"m": m, "n": n, "k": k, "dtype": model.dtype,
                              "time_s": compute.time_gemm(m, n, k, model.dtype, device, repeats)})
            bars.advance(t_compute)
        gemm_rows += _time_fp8_gemms(my_fp8, model.dtype, device, repeats, fp8_notes, rank,
                                     lambda what: bars.describe(t_compute, what), lambda: bars.advance(t_compute))
        # one rank of each device kind times the memory-bound kernel over operand sizes, in the
        # model's dtype and in fp32 (FP8 scaling, fp32 logits and optimizer states run in fp32)
        mem_rows = [] if args.skip_compute or not mine or mine[0] != 0 else [
            {"bytes": 3 * size, "time_s": compute.time_memory(size, dt, device, repeats), "dtype": dt}
            for dt in dict.fromkeys((model.dtype, "fp32")) for size in compute.memory_sizes(cuda)]
        opt_rows = [compute.time_optimizer(model, t, device, warmup, repeats) for t in tps] \
            if my_items and mine[0] == 0 else []
        compute.release()
        phases["compute"] = time.perf_counter() - t_start
        bars.describe(t_compute, "compute done; waiting for the other ranks")
        dist.barrier()
        phases["compute (all ranks)"] = time.perf_counter() - t_start
        if args.skip_compute:
            bars.describe(t_compute, "compute skipped")

        # tensor-parallel blocks with their real collectives, on the first tp ranks of the world
        # (all ranks create every group; ranks outside a group wait at the barrier)
        tp_rows = []
        in_host = [t for t in tps if 1 < t <= local_world] if not args.skip_compute else []
        t_tp = bars.task("tp blocks with collectives", len(in_host) * len(mbs_list) * 2)
        for t in in_host:
            group = dist.new_group(list(range(t)))
            for mbs in mbs_list:
                for sp in (False, True):
                    if sp and model.seq_length % t:
                        continue
                    if rank < t:
                        row = compute.time_tp_block(model, mbs, t, sp, group, device, warmup, repeats)
                        if rank == 0:
                            tp_rows.append(row)
                    dist.barrier()
                    bars.advance(t_tp)
        phases["tp blocks"] = time.perf_counter() - t_start

        t_links = bars.task("links (tournament rounds)", n_rounds)
        my_links = links.measure_p2p(device, p2p_sizes, repeats, quick, args.serial_links,
                                     advance=lambda n: bars.advance(t_links, n), hosts=hosts) if n_rounds else []
        phases["links"] = time.perf_counter() - t_start
        t_coll = bars.task("collectives", n_coll)
        my_coll = links.measure_collectives(device, coll_sizes, repeats,
                                            advance=lambda n: bars.advance(t_coll, n)) if n_coll else []

        phases["collectives"] = time.perf_counter() - t_start
        pipe_rows = []
        if not args.skip_links and not links_only and world >= 2:
            from profiler import pipeline_runtime

            t_pipe = bars.task("pipeline runtime (trivial stages)", len(pipeline_runtime.SCHEDULES))
            pipe_rows = pipeline_runtime.measure(device, repeats, advance=lambda n: bars.advance(t_pipe, n))

    phases["pipeline runtime"] = time.perf_counter() - t_start
    mine_all = {"pipeline": pipe_rows, "phases": phases, "timings": timings, "tp_blocks": tp_rows, "optimizer": opt_rows, "acts": acts, "gemm": gemm_rows, "memory": mem_rows, "links": my_links, "coll": my_coll,
                "kind": me["device_kind"], "notes": fp8_notes}
    gathered = [None] * world if rank == 0 else None
    failure = None  # rank 0: why the profile is not at --out
    dist.gather_object(mine_all, gathered, dst=0)
    if rank == 0:
        from profiler.assemble import assemble

        profile = assemble(args, model, everyone, gathered, backend, split, repeats, time.perf_counter() - t_start)
        written, failure = save_or_fallback(profile, args.out)
        if written is not None:
            report.summary(profile, written)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0 and failure:
        status = os.environ.get(STATUS_ENV)
        if status:  # under `autoconf profile`: it prints the one line and exits 2 (no torchrun traceback)
            try:
                with open(status, "w") as f:
                    f.write(failure)
                return 0
            except OSError:
                pass
        print(f"error: {failure}", file=sys.stderr)
        return 2
    return 0


STATUS_ENV = "AUTOCONF_PROFILE_STATUS"
"""Set by `autoconf profile`: a file where rank 0 writes why the profile is not at --out (one line);
the launcher reports it once torchrun is done."""


def save_or_fallback(profile, out: str) -> tuple[str | None, str | None]:
    """Write the profile to ``out``; where that fails (a full disk, a directory gone or read-only),
    to a new file in the temporary directory instead, so the measurements are not lost. Returns
    (the path written or None, the one-line failure or None)."""
    from autoconf.specs.profile import save_profile

    try:
        save_profile(profile, out)
        return out, None
    except OSError as e:
        why = f"cannot write the profile to {out!r} ({e.strerror or e})"
    fallback = None
    try:
        fd, fallback = tempfile.mkstemp(prefix="autoconf-profile-", suffix=".json")
        os.close(fd)
        save_profile(profile, fallback)
    except OSError as e:
        if fallback is not None:
            with contextlib.suppress(OSError):
                os.unlink(fallback)
        return None, (f"{why}; saving the measurements to {fallback or tempfile.gettempdir()!r} failed too "
                      f"({e.strerror or e}): they are lost")
    return fallback, f"{why}; the measurements were saved to {fallback} (move it there once it can be written)"


def _fp8_items(kind: str | None, gemms: list, notes: list) -> list[tuple]:
    """(m, n, k, recipe) of the FP8 GEMMs to time: the shapes of ``gemms`` that suit FP8
    (``compute.fp8_gemm_shapes``) in each recipe, where the catalog has an FP8 peak for ``kind``."""
    from autoconf.specs.devices import device_type
    from profiler import compute

    if not gemms:
        return []
    try:
        ok = kind is not None and device_type(kind).supports("fp8")
    except UserError:
        ok = False
    if not ok:
        notes.append(f"fp8 GEMMs not measured: device kind {kind} has no FP8 peak in the catalog")
        return []
    return [(m, n, k, r) for m, n, k in compute.fp8_gemm_shapes(gemms) for r in compute.FP8_RECIPES]


def _time_fp8_gemms(items: list, model_dtype: str, device, repeats: int, notes: list, rank: int,
                    describe, advance) -> list[dict]:
    """Profile ``gemm`` rows of dtype ``fp8_<recipe>`` for ``items`` (``_fp8_items``); a shape and
    recipe that ``torch._scaled_mm`` refuses on this device is left out with a note."""
    from profiler import compute

    rows, failed = [], {}
    outs = sorted({compute.fp8_out_dtype(model_dtype, r, device) for *_, r in items})
    for m, n, k, recipe in items:
        describe(f"GEMM {m}x{n}x{k} fp8 {recipe}")
        try:
            t = compute.time_fp8_gemm(m, n, k, recipe, compute.fp8_out_dtype(model_dtype, recipe, device), device,
                                      repeats)
        except Exception as e:  # noqa: BLE001 - an unsupported kernel must not end the profile
            first = (str(e).strip().splitlines() or [""])[0][:300]
            failed.setdefault(f"{type(e).__name__}: {first}", []).append(f"{recipe} {m}x{n}x{k}")
        else:
            rows.append({"m": m, "n": n, "k": k, "dtype": f"fp8_{recipe}", "time_s": t})
        advance()
    if items:
        notes.append("fp8 GEMMs: torch._scaled_mm on float8_e4m3fn operands quantised beforehand (not timed), "
                     f"out_dtype {'/'.join(outs)}; tensorwise one scale per operand, rowwise (m,1) and (1,n); "
                     "fraction_of_peak relative to the catalog's fp8 peak")
    for why, what in failed.items():
        notes.append(f"fp8 GEMMs left out on rank {rank} ({len(what)}: {', '.join(what[:6])}"
                     + (", ..." if len(what) > 6 else "") + f"): {why}")
    return rows


def _measurers(ranks: list[dict], split: str) -> dict:
    """rank -> (index, count) of the ranks that measure compute, per device kind."""
    if split == "serial":
        return {ranks[0]["rank"]: (0, 1)}
    by_kind: dict = {}
    for r in ranks:
        by_kind.setdefault(r["device_kind"] or r["device_name"], []).append(r["rank"])
    return {r: (i, len(rs)) for rs in by_kind.values() for i, r in enumerate(rs)}


def _overhead(device) -> dict:
    """Memory one rank costs before any model tensor (see MemoryOverhead)."""
    import torch

    from profiler import env

    if device.type == "cuda":
        a = torch.randn(256, 256, device=device)
        (a @ a).sum().item()  # create the cuBLAS handle and workspace
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return {"bytes": float(used - torch.cuda.memory_reserved(device)),
                "method": "cuda: device memory in use (total - free, mem_get_info) minus the caching allocator's "
                          "reserved bytes, after process-group init and a first GEMM: CUDA context, NCCL and cuBLAS "
                          "workspaces (assumes one rank per GPU)"}
    return {"bytes": env.private_memory_bytes(),
            "method": "cpu: anonymous (private heap) memory of the rank after importing torch and joining the "
                      "process group, before any model tensor (/proc/self/smaps_rollup); shared library pages are "
                      "excluded since all ranks of a host share them; RSS would count them once per rank"}


