"""``autoconf trial``: run one launch plan for a few steps and compare it with the estimate.
"""

from __future__ import annotations

import json

from autoconf.errors import UserError
from autoconf.launch.plan import LaunchPlan, load
from autoconf.runs import trial


def seconds_arg(text: str) -> float:
    """argparse type for time limits (--timeout, --trial-timeout): one-line error, exit 2."""
    import argparse

    try:
        return trial.check_seconds(text, "")
    except UserError:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds above 0") from None


def add_trial_parser(subparsers):
    p = subparsers.add_parser("trial", help="run one configuration for a few real steps and compare with the cost model")
    p.add_argument("--config", required=True, help="launch plan (config.json, written by `autoconf search --emit`)")
    p.add_argument("--steps", type=int, default=6, help="steps to run, warm-up included (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps (default 2)")
    p.add_argument("--timeout", type=seconds_arg, default=300.0, help="wall-clock limit in seconds (default 300)")
    p.add_argument("--cluster", help="cluster YAML for the prediction (default: the one in the config file)")
    p.add_argument("--profile", help="profile JSON for the prediction (`autoconf profile`); the trial then also times "
                   "the profile's reference block after every step and reports how fast the machine ran compared "
                   "with when it was profiled")
    p.add_argument("--run-on-local", action="store_true",
                   help="run the plan on this machine's devices when its cluster (or --cluster, or the --profile) "
                   "describes other ones (CPU processes for a GPU cluster): the measurement then describes this "
                   "machine, not the devices the prediction is for")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--quiet", action="store_true", help="no progress bar (drawn on stderr, when it is a terminal)")
    p.set_defaults(func=cmd_trial)
    return p


def _prediction_cluster(plan: LaunchPlan, cluster_path: str | None):
    """The cluster the prediction is for: --cluster (loaded now: a bad file is one line before the
    trial runs), else the plan's; None without either."""
    if cluster_path:
        from autoconf.specs.cluster import load_cluster

        return load_cluster(cluster_path)
    return plan.cluster


def _predict(plan: LaunchPlan, cluster, profile=None):
    """(Estimate or None, note) — the cost model's view of the same configuration on ``cluster``
    (a ClusterSpec, or None: the profile's topology). Raises UserError where the inputs do not
    fit it (a cluster with too few devices, a configuration the cost model refuses)."""
    if cluster is None and profile is None:
        return None, "no cluster in the config file, no --cluster and no --profile: no prediction"
    try:
        from autoconf.cost.estimate import estimate
    except ImportError as e:
        return None, f"cost model not available ({e}): no prediction"
    return estimate(plan.config, plan.model, cluster, profile, framework=plan.framework), ""


def check_local_devices(plan: LaunchPlan, cluster, profile, run_on_local: bool, what: str = "cluster") -> None:
    """Refuse, in one line, a plan for devices this machine does not have: a cluster (else a
    profile) of GPUs while the trial would start CPU processes here, or the reverse, unless
    ``run_on_local`` (``--run-on-local``, as ``search --verify-on-local``); and more ranks than
    this machine's GPUs. Under ``autoconf testbed --driver`` the ranks go to the testbed's nodes:
    no count check."""
    local = trial.local_device_kind()
    world = plan.config.world_size
    if cluster is not None:
        wanted, name = sorted({g.device for g in cluster.node_groups}), f"{what} {cluster.name!r}"
    elif profile is not None:
        wanted, name = sorted({r.device_kind or r.device_name for r in profile.ranks}), "the --profile"
    else:
        wanted, name = [], ""
    if wanted and ("cpu" if wanted == ["cpu"] else "cuda") != local and not run_on_local:
        here = "CPU processes" if local == "cpu" else "GPUs"
        raise UserError(f"trial runs the plan on this machine ({world} {here}), but {name} has "
                        f"{', '.join(wanted)}: the measurement would not describe it; pass --run-on-local to run "
                        "it here anyway")
    if local == "cuda" and not run_on_local:  # --run-on-local: as the user says (a CPU-only torch beside a driver)
        from autoconf.runs.testbed import attached

        gpus = trial.local_gpu_count()
        if attached() is None and 0 < gpus < world:
            raise UserError(f"the plan has {world} ranks ({plan.config.short()}) but this machine has {gpus} GPU(s): "
                            "run it where it has a GPU per rank (a trial runs on one machine)")


def cmd_trial(args) -> int:
    plan = load(args.config)
    if args.steps < 1 or args.warmup < 0 or args.warmup >= args.steps:
        raise UserError(f"--steps {args.steps} / --warmup {args.warmup}: need steps >= 1 and 0 <= warmup < steps")
    profile = None
    if getattr(args, "profile", None):
        from autoconf.specs.profile import check_profile_matches, load_profile

        profile = load_profile(args.profile)
        check_profile_matches(profile, plan.model)  # one-line error if it does not apply
    # everything the prediction needs, checked before the trial runs (a bad --cluster must not
    # throw a finished measurement away)
    cluster_path = getattr(args, "cluster", None)
    cluster = _prediction_cluster(plan, cluster_path)
    check_local_devices(plan, cluster, profile, getattr(args, "run_on_local", False),
                        "--cluster" if cluster_path else "the plan's cluster")
    est, note = _predict(plan, cluster, profile)
    from autoconf.output.progress import Bars, wanted

    with Bars(wanted(getattr(args, "quiet", False)), transient=True) as bars:
        bars.task(f"trial {plan.config.short()}: {args.steps} steps")
        result = trial.run_trial(plan, steps=args.steps, warmup=args.warmup, timeout_s=args.timeout,
                           speed_probe=profile is not None)
    try:
        speed = trial.speed_vs_profile(result, profile, plan.model) if profile is not None else None
    except UserError as e:  # the measurement is shown all the same, then the error
        _show_trial(args, plan, result, est, note, None)
        raise UserError(f"the trial ran (shown above) but comparing its speed with --profile failed: {e}") from None
    if speed is not None:
        note = (note + "; " if note else "") + (
            f"machine speed: the reference block took {result.speed_probe_s * 1e3:.2f} ms now, {speed:.2f}x its time "
            "in the profile" + (" (the machine ran slower than when profiled: expect the step time to be off by "
                                "about as much)" if abs(speed - 1) > 0.1 else ""))
    _show_trial(args, plan, result, est, note, speed)
    return 0 if result.ok else 1


def _show_trial(args, plan, result, est, note, speed) -> None:
    """Print the trial (``--json``: one document), with the prediction where there is one."""
    if args.json:
        pred = None
        if est is not None:
            pred = est.to_dict() if hasattr(est, "to_dict") else {
                "step_time_s": est.step_time_s, "peak_memory_bytes": est.peak_memory_bytes,
                "breakdown_s": dict(est.breakdown_s)}
        print(json.dumps({"measured": result.to_dict(), "predicted": pred, "speed_vs_profile": speed, "note": note},
                         indent=1, default=str))
        return
    from autoconf.output.tables import show, trial_report

    show(trial_report(result, est, note, plan.config))
