"""The command line: thin wrappers that load inputs, call one library function, print.

Every command takes ``--json`` and then prints exactly one JSON document on stdout. Bad input is
one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading

from . import __version__
from .config import DP_ALL_REDUCE
from .errors import UserError
from .frameworks import FRAMEWORK_NAMES

EPILOG = "This is autoconf-parallel (training-parallelism planner), not GNU Autoconf."


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's default prints the usage too)
        sys.stderr.write(f"autoconf: error: {message} (see `autoconf {self.prog.split()[-1]} --help`)\n"
                         if " " in self.prog else f"autoconf: error: {message}\n")
        sys.exit(2)


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return v


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return v


def _seconds(text: str) -> float:
    from .trial import seconds_arg
    return seconds_arg(text)


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a fraction in [0, 1)")
    return v


def _int_list(text: str) -> tuple:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be integers separated by commas, like 1,3") from None


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} must be a TCP port, 1 to 65535")
    return v


def _add_target(p, cluster_required: bool = False):
    p.add_argument("--model", required=True, help="preset name (see `autoconf models`), model YAML, or HF config.json")
    p.add_argument("--cluster", required=cluster_required, help="cluster YAML (see examples/clusters/)")
    p.add_argument("--profile", help="a profile from `autoconf profile` (measured compute, memory, links)")
    p.add_argument("--calibration", help="calibration JSON from `autoconf search --verify K --calibrate`")
    p.add_argument("--seq-length", type=_positive_int, help="override the model's sequence length")
    p.add_argument("--global-batch", type=_positive_int, required=True, help="sequences per optimizer step")
    p.add_argument("--framework", default="reference", choices=FRAMEWORK_NAMES,
                   help="the runtime that will run the plan: its defaults, buffers, overlap and knobs are "
                        "modelled, and search offers only what it can run (default: reference, this project's trainer)")
    p.add_argument("--json", action="store_true", help="print one JSON document")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="autoconf", description="Plan data/pipeline/tensor-parallel training: "
                 "measure, search, verify, launch.", epilog=EPILOG)
    ap.add_argument("--version", action="version", version=f"autoconf (autoconf-parallel) {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("models", help="list the built-in model presets")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("devices", help="list the device catalog")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("estimate", help="explain the time and memory of one configuration")
    _add_target(p)
    p.add_argument("--dp", type=_positive_int, required=True)
    p.add_argument("--pp", type=_positive_int, default=1)
    p.add_argument("--tp", type=_positive_int, default=1)
    p.add_argument("--micro-batch-size", type=_positive_int, default=1)
    p.add_argument("--schedule", default=None, help="gpipe, 1f1b, interleaved, breadth_first (default 1f1b)")
    p.add_argument("--virtual-stages", type=_positive_int, default=1)
    p.add_argument("--layered-grad-accum", action="store_true")
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3")
    p.add_argument("--recompute", default="none", help="none, selective, full")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--rank-order", default="tp-dp-pp")
    p.add_argument("--stage-layers", type=_int_list, metavar="N,N,...",
                   help="transformer blocks of each pipeline chunk (pp x virtual stages numbers; default: even)")
    p.add_argument("--device-order", type=_int_list, metavar="D,D,...",
                   help="the device each rank runs on (a permutation of 0..world-1; default: rank r on device r)")
    for knob, what in (("overlap-grad-reduce", "overlap the data-parallel gradient reduction with the backward"),
                       ("overlap-param-gather", "prefetch ZeRO's parameter gathers behind compute"),
                       ("tp-comm-overlap", "overlap tensor-parallel communication with the GEMMs (needs SP)")):
        p.add_argument(f"--{knob}", action=argparse.BooleanOptionalAction, default=None,
                       help=f"{what} (default: the framework's)")
    p.add_argument("--dp-all-reduce", default="flat", choices=DP_ALL_REDUCE,
                   help="ZeRO-0/1's gradient all-reduce: flat (the collective library's) or hierarchical "
                        "(reduce-scatter inside hosts, all-reduce across, all-gather inside; reference trainer "
                        "only) (default: flat)")

    p = sub.add_parser("search", help="search the space for the fastest configuration that fits")
    _add_target(p)
    p.add_argument("--gpus", type=_positive_int, help="use this many devices (default: all in the cluster)")
    p.add_argument("--top", type=_positive_int, default=5)
    p.add_argument("--trials", type=_positive_int, default=400,
                   help="sampled trials before the exhaustive branch-and-bound sweep (default 400)")
    p.add_argument("--sample-only", action="store_true",
                   help="stop after the sampled trials (no exhaustive sweep)")
    p.add_argument("--storage", default="sqlite:///autoconf-study.db",
                   help="Optuna storage URL (default: sqlite:///autoconf-study.db); 'none' keeps it in memory")
    p.add_argument("--study-name", help="resume or share a study by name")
    p.add_argument("--max-micro-batch", type=_positive_int, default=64)
    p.add_argument("--no-place", action="store_true",
                   help="no placement search: rank r on device r and layers split evenly (the default searches "
                   "which devices run each stage and group, and the layers per stage)")
    p.add_argument("--emit", metavar="DIR", help="write launch files for the best configuration")
    p.add_argument("--verify", type=_non_negative_int, default=0, metavar="K", help="run the top K as short real trials")
    p.add_argument("--steps", type=_positive_int, default=6, help="steps per verifying trial")
    p.add_argument("--trial-timeout", type=_seconds, default=300.0, metavar="S",
                   help="wall-clock limit per verifying trial in seconds (default 300); every process of a trial "
                   "that runs over is killed and the trial recorded as failed")
    p.add_argument("--verify-on-local", action="store_true",
                   help="let --verify run on this machine's devices when the cluster file describes other ones "
                   "(CPU processes for a GPU cluster): the measurements then describe this machine, and a "
                   "calibration fitted on them records that and applies to this machine's devices only")
    p.add_argument("--memory-margin", type=_fraction, default=0.0, metavar="F",
                   help="with --verify: refuse a configuration whose measured peak memory exceeds the device "
                   "capacity minus this fraction of it (default 0)")
    p.add_argument("--master-port", type=_port, default=None,
                   help="rendezvous port written into the --emit launch files (default 29500; one host: torchrun "
                   "--standalone picks a free one)")
    p.add_argument("--calibrate", metavar="FILE", help="with --verify: fit correction factors, save them to FILE")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    for mod, fn in (("autoconf.trial", "add_trial_parser"), ("profiler.cli", "add_profile_parser"),
                    ("autoconf.testbed", "add_testbed_parser"), ("autoconf.timetotrain", "add_plan_parser")):
        try:
            getattr(__import__(mod, fromlist=[fn]), fn)(sub)
        except (ImportError, AttributeError):
            pass
    return ap


def _load_inputs(args):
    from .cluster import load_cluster
    from .model import load_model
    model = load_model(args.model, seq_length=args.seq_length)
    cluster = load_cluster(args.cluster) if args.cluster else None
    profile = calibration = None
    if getattr(args, "profile", None):
        from .profile import check_profile_matches, load_profile
        profile = load_profile(args.profile)
        check_profile_matches(profile, model)
    if getattr(args, "calibration", None):
        from .cost.calibration import load_calibration
        calibration = load_calibration(args.calibration)
    if cluster is None and profile is None:
        raise UserError("give --cluster FILE (see examples/clusters/) or --profile FILE")
    _check_calibration_applies(calibration, cluster, profile, getattr(args, "calibration", None))
    return model, cluster, profile, calibration


def _print_json(doc) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, default=float) + "\n")


def cmd_models(args) -> int:
    from .model import preset, preset_names
    rows = [preset(n) for n in preset_names()]
    if args.json:
        _print_json([{**m.to_dict(), "num_params": m.num_params()} for m in rows])
        return 0
    from rich.console import Console
    from rich.table import Table
    t = Table(title="model presets")
    for col in ("name", "params", "layers", "hidden", "heads", "kv", "ffn", "vocab", "seq", "act"):
        t.add_column(col, justify="left" if col in ("name", "act") else "right")
    for m in rows:
        t.add_row(m.name, f"{m.num_params() / 1e9:.3f}B", str(m.num_layers), str(m.hidden_size),
                  str(m.num_attention_heads), str(m.num_kv_heads), str(m.ffn_hidden_size), str(m.vocab_size),
                  str(m.seq_length), m.activation)
    Console().print(t)
    return 0


def cmd_devices(args) -> int:
    from .catalog import device_names, device_type
    rows = [device_type(n) for n in device_names()]
    if args.json:
        _print_json([d.to_dict() for d in rows])
        return 0
    from rich.console import Console
    from rich.table import Table
    t = Table(title="device catalog (datasheet; a profile replaces the efficiencies)")
    for col in ("name", "bf16 TFLOP/s", "fp32 TFLOP/s", "memory", "mem bw", "GEMM eff"):
        t.add_column(col)
    for d in rows:
        t.add_row(d.name, f"{d.peak_flop_per_s.get('bf16', 0) / 1e12:g}", f"{d.peak_flop_per_s['fp32'] / 1e12:g}",
                  f"{d.memory_bytes / 2**30:.0f} GiB", f"{d.memory_bandwidth_bytes_per_s / 1e9:g} GB/s",
                  f"{d.gemm_efficiency:g}")
    Console().print(t)
    return 0


def cmd_estimate(args) -> int:
    from .config import ParallelConfig
    from .cost.estimate import estimate
    model, cluster, profile, calibration = _load_inputs(args)
    per_replica = args.dp * args.micro_batch_size
    if args.global_batch % per_replica:
        raise UserError(f"--global-batch {args.global_batch} is not divisible by dp({args.dp}) x "
                        f"micro-batch-size({args.micro_batch_size}) = {per_replica}")
    schedule = args.schedule or ("breadth_first" if args.virtual_stages > 1 and args.layered_grad_accum
                                 else "interleaved" if args.virtual_stages > 1 else "1f1b")
    config = ParallelConfig(dp=args.dp, pp=args.pp, tp=args.tp, micro_batch_size=args.micro_batch_size,
                            num_micro_batches=args.global_batch // per_replica, schedule=schedule,
                            virtual_stages=args.virtual_stages, layered_grad_accum=args.layered_grad_accum,
                            zero_stage=args.zero, recompute=args.recompute,
                            sequence_parallel=args.sequence_parallel, rank_order=args.rank_order,
                            overlap_grad_reduce=args.overlap_grad_reduce,
                            overlap_param_gather=args.overlap_param_gather, tp_comm_overlap=args.tp_comm_overlap,
                            dp_all_reduce=args.dp_all_reduce, device_order=args.device_order,
                            stage_layers=args.stage_layers)
    e = estimate(config, model, cluster, profile, calibration, framework=args.framework)
    if args.json:
        _print_json(e.to_dict())
        return 0
    from rich.console import Console
    from .report import estimate_tables
    con = Console()
    for t in estimate_tables(e):
        con.print(t)
    for note in e.notes:
        con.print(f"note: {note}")
    for r in e.reasons:
        con.print(f"[red]{r}[/red]")
    return 0


def _target_devices(cluster, profile) -> list[str]:
    """Catalog names of the devices the search plans for (the cluster's, else the profile's)."""
    if cluster is not None:
        return sorted({g.device for g in cluster.node_groups})
    return sorted({r.device_kind or r.device_name for r in profile.ranks})


def _check_calibration_applies(calibration, cluster, profile, path) -> None:
    if calibration is None or calibration.devices is None:
        return
    target = _target_devices(cluster, profile)
    if sorted(calibration.devices) != target:
        raise UserError(f"--calibration {path!r} was fitted on {', '.join(calibration.devices)} but the "
                        f"{'cluster' if cluster is not None else 'profile'} has {', '.join(target)}: it does not "
                        "apply (fit one on these devices with --verify K --calibrate)")


def _preflight(args, storage) -> None:
    """Every output path is checked before any work: one line now, not after the trials ran."""
    from .outputs import check_dir, check_file
    from .search import sqlite_path
    if args.emit:
        if args.cluster is None and not getattr(args, "profile", None):
            raise UserError("--emit needs --cluster or --profile (the launch files name hosts and devices per host)")
        check_dir(args.emit, "--emit")
        if args.cluster is None:  # the profile's hosts must make a launch cluster: say so before searching
            from .cluster import cluster_from_profile
            from .profile import load_profile
            cluster_from_profile(load_profile(args.profile))
    if args.calibrate:
        check_file(args.calibrate, "--calibrate")
    db = sqlite_path(storage)
    if db is not None:
        try:
            check_file(db, "--storage")
        except UserError as e:
            raise UserError(f"{e} (cannot open the study)") from None


def _verify_devices(args, cluster) -> list[str] | None:
    """The devices the verifying trials run on, as the calibration records them; refuses a
    cluster of other devices unless --verify-on-local."""
    from .trial import local_device_kind
    local = local_device_kind()
    if cluster is None:
        return None  # a profile: measured on the machines it describes
    wanted = _target_devices(cluster, None)
    kind = "cpu" if wanted == ["cpu"] else "cuda"
    if kind == local:
        return wanted
    if not args.verify_on_local:
        raise UserError(f"--verify runs the trials on this machine ({'CPU processes' if local == 'cpu' else 'its GPUs'}"
                        f"), but cluster {cluster.name!r} has {', '.join(wanted)}: the measurements would not "
                        "describe it; pass --verify-on-local to run them here anyway")
    return [local]


def cmd_search(args) -> int:
    from .search import search
    model, cluster, profile, calibration = _load_inputs(args)
    storage = None if args.storage.lower() in ("none", "memory", "") else args.storage
    if args.verify > 0 and args.framework != "reference":
        raise UserError(f"--verify runs autoconf's reference trainer, not {args.framework}: its measurements "
                        f"would not check a {args.framework} prediction; use --framework reference with --verify")
    if args.calibrate and args.verify <= 0:
        raise UserError("--calibrate needs --verify K (K >= 1): it fits factors to the verifying trials")
    if args.master_port is not None and not args.emit:
        raise UserError("--master-port is written into the launch files: it needs --emit DIR")
    _preflight(args, storage)
    devices = _verify_devices(args, cluster) if args.verify > 0 else None
    progress = None
    bar = None
    if not args.quiet and not args.json and sys.stderr.isatty():
        from rich.progress import Progress
        bar = Progress(transient=True)
        task = bar.add_task("search", total=None)
        bar.start()

        def progress(done, total):
            bar.update(task, completed=done, total=total)
    try:
        result = search(model, cluster, args.global_batch, gpus=args.gpus, top=max(args.top, args.verify),
                        trials=args.trials, exhaustive=not args.sample_only, storage=storage, study_name=args.study_name, profile=profile,
                        calibration=calibration, max_micro_batch=args.max_micro_batch, progress=progress,
                        framework=args.framework, place=not args.no_place)
    finally:
        if bar is not None:
            bar.stop()
    if not result.top:
        e = result.smallest_memory
        need = f"; the least memory-hungry configuration ({e.config.short()}) needs {e.peak_memory_bytes / 2**30:.2f} GiB per device" if e else ""
        raise UserError(f"no configuration of {model.name} fits in the devices' memory{need}")
    if cluster is not None and profile is not None:
        from .cost.measured import overlay_measured_links
        pairs = overlay_measured_links(cluster.graph(), profile)[1]
        result = dataclasses.replace(result, notes=result.notes + (
            f"links: {pairs} device pair(s) measured by the profile replace the cluster file's declared "
            "figures; the rest are as declared",))
    doc = result.to_dict()
    verified = None
    if args.verify > 0:
        done: list = []
        try:
            verified, cal_report = _verify(args, model, cluster, profile, result, devices, done)
        except KeyboardInterrupt as e:
            if result.storage:
                e.autoconf_kept = (f"the search's trials and {len(done)} finished verifying trial(s) are kept in "
                                   f"study {result.study_name!r} in {result.storage}")
            raise
        doc["verified"] = verified
        if cal_report is not None:
            doc["calibration"] = cal_report
    best = result.top[0]
    if verified:
        ok = [v for v in verified if v["trial"]["ok"] and not v.get("refused")]
        if not ok:
            why = "; ".join(f"{v['config_short']}: {v.get('refused') or v['trial'].get('reason')}" for v in verified)
            sys.stderr.write(f"autoconf: no verified configuration ran within the devices' memory and time: {why}\n")
            if args.json:
                _print_json(doc)
            return 1
        from .config import ParallelConfig
        chosen = min(ok, key=lambda v: v["trial"]["step_time_s"])
        best = next(e for e in result.top if e.config == ParallelConfig.from_dict(chosen["config"]))
    doc["top"] = doc["top"][:args.top]
    doc["best"] = best.to_dict()
    if args.emit:
        from .emit import DEFAULT_PORT, emit
        if cluster is None:  # the hosts and devices the profile measured
            from .cluster import cluster_from_profile
            launch_cluster = cluster_from_profile(profile)
        else:
            launch_cluster = cluster
        doc["emitted"] = emit(best, model, launch_cluster, args.emit, args.profile,
                              master_port=args.master_port or DEFAULT_PORT)
    if args.json:
        _print_json(doc)
        return 0
    from rich.console import Console
    from .report import search_tables
    con = Console()
    for t in search_tables(result):
        con.print(t)
    if result.placement:
        from .report import placement_table
        con.print(placement_table(result.placement[next(i for i, e in enumerate(result.top) if e is best)], best))
    for n in result.notes:
        con.print(f"note: {n}")
    if verified:
        _print_verified(con, verified)
        if doc.get("calibration"):
            b, a = doc["calibration"]["before"], doc["calibration"]["after"]
            con.print(f"calibration saved to {args.calibrate}: step-time error median {100 * b['time_median']:.1f}% "
                      f"-> {100 * a['time_median']:.1f}%, peak memory {100 * b['memory_median']:.1f}% "
                      f"-> {100 * a['memory_median']:.1f}% (on the {a['n']} verifying trials)")
    con.print(f"best: {best.config.short()}  predicted {best.step_time_s:.4g} s/step, "
              f"{best.tokens_per_s:,.0f} tokens/s, {best.peak_memory_bytes / 2**30:.2f} GiB peak")
    con.print(f"study {result.study_name!r} in {result.storage or 'memory'}")
    if args.emit:
        con.print(f"launch files: {', '.join(doc['emitted'])}")
    return 0


def _capacity_refusal(estimate, trial, margin: float) -> str | None:
    """Why a trial that ran is refused: its measured peak is above the device capacity minus the
    margin (the real run would run out of memory). None when it fits."""
    measured = trial.peak_memory_bytes
    if not trial.ok or not measured:
        return None
    capacity = min(m.capacity for m in estimate.memory_by_stage)
    limit = capacity * (1.0 - margin)
    if measured <= limit:
        return None
    return (f"out of memory: measured peak {measured / 2**20:.1f} MiB > {limit / 2**20:.1f} MiB (device capacity "
            f"{capacity / 2**20:.1f} MiB" + (f" minus a {margin:.0%} margin)" if margin else ")"))


def _verify(args, model, cluster, profile, result, devices=None, out=None) -> tuple[list[dict], dict | None]:
    """Run the top K as real trials, recording each in the study as soon as it finishes (an
    interrupt keeps the finished ones); refuse those measured above the device memory; optionally
    calibrate and report the prediction error before and after."""
    from .trial import speed_vs_profile, verify
    cands = list(result.top[:args.verify])
    out = [] if out is None else out

    def finished(i, t):
        e = cands[i]
        v = {"config": e.config.to_dict(), "config_short": e.config.short(), "predicted_step_time_s": e.step_time_s,
             "predicted_peak_memory_bytes": e.peak_memory_bytes, "trial": t.to_dict(),
             "speed_vs_profile": speed_vs_profile(t, profile, model) if t.ok else None,
             "refused": _capacity_refusal(e, t, args.memory_margin)}
        out.append(v)
        if result.storage:
            _record_verified(result, [v])

    trials = verify([e.config for e in cands], model, cluster, steps=args.steps, timeout_s=args.trial_timeout,
                    speed_probe=profile is not None, on_result=finished)
    report = None
    if args.calibrate:
        from .cost.calibration import calibration_report, fit_calibration, save_calibration
        pairs = [(e, t) for e, t in zip(cands, trials) if t.ok]
        if not pairs:
            raise UserError("--calibrate: no verifying trial succeeded, nothing to fit")
        calibration = dataclasses.replace(fit_calibration(pairs), devices=tuple(devices) if devices else None)
        try:
            save_calibration(calibration, args.calibrate)
        except OSError as e:
            raise UserError(f"--calibrate {args.calibrate!r}: cannot write ({e.strerror})") from None
        report = calibration_report(pairs, calibration)
    return out, report


def _record_verified(result, verified: list[dict]) -> None:
    """Add each verifying run to the study as a trial of its own (finished trials cannot change):
    same parameters, the measured step time as its value, ``verified=True`` and the prediction in
    its user attributes, so optuna-dashboard shows predicted and measured side by side. A run
    refused for its measured memory is a failed trial with ``oom=True``."""
    import optuna

    from .procs import deferred_signals
    from .search import study_lock

    with study_lock(result.storage, result.study_name):
        study = optuna.load_study(study_name=result.study_name, storage=result.storage)
        by_config = {}
        for t in study.get_trials(deepcopy=False):
            if not t.user_attrs.get("verified") and "config" in t.user_attrs:
                by_config.setdefault(json.dumps(t.user_attrs["config"], sort_keys=True), t)
        for v in verified:
            src = by_config.get(json.dumps(v["config"], sort_keys=True))
            tr = v["trial"]
            if src is None:
                continue
            refused = v.get("refused")
            attrs = {"verified": True, "config": v["config"], "predicted_step_time_s": v["predicted_step_time_s"],
                     "predicted_peak_memory_bytes": v["predicted_peak_memory_bytes"],
                     "measured_step_time_s": tr.get("step_time_s"),
                     "measured_peak_memory_bytes": tr.get("peak_memory_bytes"),
                     "trial_ok": tr["ok"] and not refused, "trial_reason": refused or tr.get("reason"),
                     "oom": bool(refused) or "out of memory" in (tr.get("reason") or ""),
                     "speed_vs_profile": v.get("speed_vs_profile")}
            ok = tr["ok"] and tr.get("step_time_s") and not refused
            with deferred_signals():  # whole or not at all
                study.add_trial(optuna.trial.create_trial(
                    params=src.params, distributions=src.distributions, user_attrs=attrs,
                    value=tr["step_time_s"] if ok else None,
                    state=optuna.trial.TrialState.COMPLETE if ok else optuna.trial.TrialState.FAIL))


def _print_verified(con, verified) -> None:
    from rich.table import Table
    t = Table(title="verified by real trials")
    for col in ("config", "predicted", "measured", "error", "peak mem (pred / meas)", "status"):
        t.add_column(col)
    for v in verified:
        tr = v["trial"]
        meas = tr.get("step_time_s")
        err = f"{100 * (v['predicted_step_time_s'] / meas - 1):+.1f}%" if tr["ok"] and meas else ""
        from .config import ParallelConfig
        t.add_row(ParallelConfig.from_dict(v["config"]).short(), f"{v['predicted_step_time_s']:.4g} s",
                  f"{meas:.4g} s" if meas else "-", err,
                  f"{v['predicted_peak_memory_bytes'] / 2**20:.1f} / "
                  + (f"{tr['peak_memory_bytes'] / 2**20:.1f} MiB" if tr.get("peak_memory_bytes") else "-"),
                  f"refused: {v['refused']}" if v.get("refused") else "ok" if tr["ok"] else f"failed: {tr.get('reason')}")
    con.print(t)
    speeds = [v["speed_vs_profile"] for v in verified if v.get("speed_vs_profile")]
    if speeds:
        lo, hi = min(speeds), max(speeds)
        con.print(f"machine speed during the trials: the profile's reference block took {lo:.2f}-{hi:.2f}x its "
                  "profiled time" + (" (the machine ran slower or faster than when profiled; step-time errors "
                                     "include that drift)" if max(abs(lo - 1), abs(hi - 1)) > 0.1 else ""))


COMMANDS = {"models": cmd_models, "devices": cmd_devices, "estimate": cmd_estimate, "search": cmd_search}


def main(argv=None) -> int:
    from . import procs

    parser = build_parser()
    args = parser.parse_args(argv)
    fn = COMMANDS.get(args.command)
    if fn is None:
        fn = {"trial": "autoconf.trial:cmd_trial", "profile": "profiler.cli:cmd_profile",
              "testbed": "autoconf.testbed:cmd_testbed", "plan": "autoconf.timetotrain:cmd_plan"}[args.command]
        mod, name = fn.split(":")
        fn = getattr(__import__(mod, fromlist=[name]), name)
    if threading.current_thread() is threading.main_thread():
        procs.install_terminate_handler()  # SIGTERM / SIGHUP clean up like Ctrl-C
    try:
        return fn(args) or 0
    except UserError as e:
        sys.stderr.write(f"autoconf: error: {' '.join(str(e).split())}\n")  # always one line
        return 2
    except KeyboardInterrupt as e:
        with procs.deferred_signals(reraise=False):
            procs.kill_all()
            kept = getattr(e, "autoconf_kept", None)
            what = "terminated" if isinstance(e, procs.Terminated) else "interrupted"
            sys.stderr.write(f"autoconf: {what}" + (f" ({kept})" if kept else "") + "\n")
        return 128 + e.signum if isinstance(e, procs.Terminated) else 130
    finally:
        with procs.deferred_signals(reraise=False):
            procs.kill_all()


if __name__ == "__main__":
    sys.exit(main())
