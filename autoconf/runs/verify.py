"""`autoconf search --verify K`: the search's top K run as short real trials, and ``--calibrate``.

Each trial is recorded in the study as soon as it finishes (an interrupt keeps the finished
ones); a trial measured above the device memory (less ``--memory-margin``) is refused and stored
as an out-of-memory trial; the fastest measured trial that was not refused becomes the pick. With
``--calibrate FILE`` correction factors are fitted to the trials and saved, recording the
devices they were fitted on, and a calibration is refused where it does not apply.

No torch here: the trials run under torchrun (``trial.verify``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os

from autoconf.errors import UserError
from autoconf.runs import trial


def target_devices(cluster, profile) -> list[str]:
    """Catalog names of the devices the search plans for (the cluster's, else the profile's)."""
    if cluster is not None:
        return sorted({g.device for g in cluster.node_groups})
    return sorted({r.device_kind or r.device_name for r in profile.ranks})


def check_calibration_applies(calibration, cluster, profile, path) -> None:
    """Refuse a calibration fitted on other devices than those planned for."""
    if calibration is None or calibration.devices is None:
        return
    target = target_devices(cluster, profile)
    if sorted(calibration.devices) != target:
        raise UserError(f"--calibration {path!r} was fitted on {', '.join(calibration.devices)} but the "
                        f"{'cluster' if cluster is not None else 'profile'} has {', '.join(target)}: it does not "
                        "apply (fit one on these devices with --verify K --calibrate)")



def capacity_refusal(estimate, result, margin: float) -> str | None:
    """Why a trial that ran is refused: its measured peak is above the device capacity minus the
    margin (the real run would run out of memory). None when it fits."""
    measured = result.peak_memory_bytes
    if not result.ok or not measured:
        return None
    capacity = min(m.capacity for m in estimate.memory_by_stage)
    limit = capacity * (1.0 - margin)
    if measured <= limit:
        return None
    return (f"out of memory: measured peak {measured / 2**20:.1f} MiB > {limit / 2**20:.1f} MiB (device capacity "
            f"{capacity / 2**20:.1f} MiB" + (f" minus a {margin:.0%} margin)" if margin else ")"))


def run_verification(args, model, cluster, profile, result, devices=None, bars=None) \
        -> tuple[list[dict], dict | None, str | None]:
    """Run the top ``args.verify`` as real trials, recording each in the study as soon as it
    finishes (an interrupt keeps the finished ones and says so); refuse those measured above the
    device memory; with ``args.calibrate``, fit and save a calibration and report the prediction
    error before and after. ``bars``: a ``progress.Bars`` (one step per trial). Returns (the
    verifying trials, the calibration report or None, why a measurement or the calibration was not
    written, one line, or None): the caller prints the trials, then fails with the reason."""
    cands = list(result.top[:args.verify])
    out: list = []
    unrecorded: list = []  # why the study stopped taking the measurements
    task = bars.task(f"verifying trial 1/{len(cands)}", len(cands)) if bars is not None else None

    def started(i, config):
        if bars is not None:
            bars.describe(task, f"trial {i + 1}/{len(cands)}: {config.short()}")

    def finished(i, t):
        e = cands[i]
        v = {"config": e.config.to_dict(), "config_short": e.config.short(), "predicted_step_time_s": e.step_time_s,
             "predicted_peak_memory_bytes": e.peak_memory_bytes, "trial": t.to_dict(),
             "speed_vs_profile": trial.speed_vs_profile(t, profile, model) if t.ok else None,
             "refused": capacity_refusal(e, t, args.memory_margin)}
        out.append(v)
        if result.storage and not unrecorded:
            unrecorded.extend(_record(result, v))
        if bars is not None:
            bars.advance(task)

    try:
        trials = trial.verify([e.config for e in cands], model, cluster, steps=args.steps, timeout_s=args.trial_timeout,
                              speed_probe=profile is not None, on_result=finished, progress=started)
    except KeyboardInterrupt as e:
        where = _keep(args, result, out, unrecorded)
        if where:
            e.autoconf_kept = f"the search's trials and {len(out)} finished verifying trial(s) are kept in {where}"
        raise
    where = _keep(args, result, out, unrecorded)  # with --calibrate: before the calibration file is tried
    report, why = _calibrate(args, cands, trials, devices) if args.calibrate else (None, None)
    if unrecorded:
        why = "; ".join(filter(None, [why, f"cannot record the verifying trials in study {result.study_name!r} "
                                           f"({unrecorded[0]})"]))
    if why:
        return out, report, f"{why}; the {len(out)} measured trial(s) are kept in {where or 'the output above'}"
    if args.calibrate and not result.storage and where is not None:  # saved: the fallback is not needed
        with contextlib.suppress(OSError):
            os.unlink(_fallback(args))
    return out, report, None


def _fallback(args) -> str:
    """The file the measurements go to where the study does not take them: beside the calibration."""
    return args.calibrate + ".trials.json"


def _record(result, v: dict) -> list[str]:
    """Record one verifying trial in the study: [] where it was, else [why not] (a full disk, the
    study taken by another search since)."""
    from autoconf.study.storage import storage_failure
    try:
        record_verified(result, [v])
    except UserError as e:
        return [str(e)]
    except Exception as e:  # the storage's own error: its cause in a few words
        return [storage_failure(e)]
    return []


def _keep(args, result, out: list, unrecorded: list) -> str | None:
    """Where the measured trials are kept: the study, else (with ``--calibrate FILE``) FILE.trials.json,
    written now; None where neither holds them."""
    if result.storage and not unrecorded:
        return f"study {result.study_name!r} in {result.storage}"
    if not args.calibrate or not out:
        return None
    from autoconf.files import write_text
    try:
        write_text(_fallback(args), json.dumps({"verified": out}, indent=1))
    except OSError:
        return None
    return repr(_fallback(args))


def _calibrate(args, cands, trials, devices) -> tuple[dict | None, str | None]:
    """Fit the calibration to the trials that ran and save it: (its report, None), or (None, why not)."""
    from autoconf.cost.calibration import calibration_report, fit_calibration, save_calibration
    pairs = [(e, t) for e, t in zip(cands, trials) if t.ok]
    if not pairs:
        return None, "--calibrate: no verifying trial succeeded, nothing to fit"
    calibration = dataclasses.replace(fit_calibration(pairs), devices=tuple(devices) if devices else None)
    try:
        save_calibration(calibration, args.calibrate)
    except OSError as e:
        return None, f"--calibrate {args.calibrate!r}: cannot write ({e.strerror or e})"
    except UserError as e:  # what the path became while the trials ran (a directory, a FIFO)
        return None, f"--calibrate {args.calibrate!r}: cannot write ({e})"
    return calibration_report(pairs, calibration), None


def pick(result, verified: list[dict]):
    """(the search estimate of the fastest measured trial that ran within the memory, or None;
    why none did, one line)."""
    from autoconf.space.config import ParallelConfig

    ok = [v for v in verified if v["trial"]["ok"] and not v.get("refused")]
    if not ok:
        why = "; ".join(f"{v['config_short']}: {v.get('refused') or v['trial'].get('reason')}" for v in verified)
        return None, f"no verified configuration ran within the devices' memory and time: {why}"
    chosen = min(ok, key=lambda v: v["trial"]["step_time_s"])
    return next(e for e in result.top if e.config == ParallelConfig.from_dict(chosen["config"])), ""


def record_verified(result, verified: list[dict]) -> None:
    """Add each verifying run to the study as a trial of its own (finished trials cannot change):
    the parameters of its outer point, the measured step time as its value, ``verified=True`` and
    the prediction in its user attributes, so optuna-dashboard shows predicted and measured side
    by side. A run refused for its measured memory is a failed trial with ``oom=True``."""
    import optuna

    from autoconf.procs import deferred_signals
    from autoconf.space.config import ParallelConfig
    from autoconf.study.result import outer_params
    from autoconf.study.storage import study_lock

    with study_lock(result.storage, result.study_name):
        study = optuna.load_study(study_name=result.study_name, storage=result.storage)
        by_point = {}
        for t in study.get_trials(deepcopy=False):
            if not t.user_attrs.get("verified") and t.params:
                by_point.setdefault(json.dumps(t.params, sort_keys=True), t)
        for v in verified:
            src = by_point.get(json.dumps(outer_params(ParallelConfig.from_dict(v["config"])), sort_keys=True))
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
