"""``autoconf search``: the study over the configuration space, verification, emission.
"""

from __future__ import annotations

import dataclasses
import sys

from autoconf.cli.common import _PHASES, _load_inputs, _print_json
from autoconf.errors import UserError
from autoconf.specs.profile import check_profile_devices


def _preflight(args, storage) -> str | None:
    """Every output path is checked before any work: one line now, not after the trials ran.
    Returns the storage the search writes to (None: in memory)."""
    from autoconf.files import check_dir, check_file
    from autoconf.study.storage import check_storage, check_study_name, sqlite_path
    storage = check_storage(storage)
    check_study_name(args.study_name)
    if args.emit:
        if args.cluster is None and not getattr(args, "profile", None):
            raise UserError("--emit needs --cluster or --profile (the launch files name hosts and devices per host)")
        check_dir(args.emit, "--emit")
        if args.cluster is None:  # the profile's hosts must make a launch cluster: say so before searching
            from autoconf.specs.cluster import cluster_from_profile
            from autoconf.specs.profile import load_profile
            cluster_from_profile(load_profile(args.profile))
    if args.calibrate:
        check_file(args.calibrate, "--calibrate")
    if args.plot:
        from autoconf.output.plots import check_plotting
        check_plotting(args.plot)
    db = sqlite_path(storage)
    if db is not None:
        try:
            check_file(db, "--storage")
        except UserError as e:
            raise UserError(f"{e} (cannot open the study)") from None
    return storage


def _search(args, model, cluster, profile, calibration, storage):
    """(the search's result, why its storage failed or None): a storage that fails mid-search (a
    full disk) keeps what it took, and the search's result is still printed, then the reason."""
    from autoconf.output.progress import Bars, wanted
    from autoconf.study.search import search
    with Bars(wanted(args.quiet), transient=True) as bars:
        task = bars.task("search")
        try:
            return search(model, cluster, args.global_batch, gpus=args.gpus, top=max(args.top, args.verify),
                          trials=args.trials, exhaustive=not args.sample_only, storage=storage,
                          study_name=args.study_name, profile=profile, calibration=calibration,
                          max_micro_batch=args.max_micro_batch, max_virtual=args.max_virtual,
                          framework=args.framework, place=not args.no_place,
                          max_cp=args.max_cp, precision=args.precision, fp8_recipe=args.fp8_recipe,
                          moe_imbalance=args.moe_imbalance, moe_dispatcher=args.moe_dispatcher,
                          allow_compression=args.allow_compression,
                          pp_compression_rank=args.pp_compression_rank or 16,
                          dp_compression_rank=args.dp_compression_rank or 128,
                          progress=lambda done, total: bars.update(task, completed=done, total=total),
                          phase=lambda name: bars.update(task, completed=0,
                                                         description=_PHASES.get(name, name))), None
        except UserError as e:
            if getattr(e, "result", None) is None:
                raise
            return e.result, str(e)


def cmd_search(args) -> int:
    from autoconf.cli.verify import check_arguments, verify_devices
    from autoconf.output.progress import Bars, wanted
    from autoconf.runs import verify
    model, cluster, profile, calibration = _load_inputs(args)
    if cluster is not None and profile is not None and not args.allow_other_devices:
        check_profile_devices(profile, cluster.device_kinds(), allow="--allow-other-devices")
    storage = None if args.storage.lower() in ("none", "memory", "") else args.storage
    check_arguments(args)
    if not args.allow_compression and (args.pp_compression_rank or args.dp_compression_rank):
        raise UserError("--pp-compression-rank / --dp-compression-rank set the ranks compression may use: "
                        "they need --allow-compression")
    if args.master_port is not None and not args.emit:
        raise UserError("--master-port is written into the launch files: it needs --emit DIR")
    if (args.script or args.script_args) and not args.emit:
        raise UserError("--script is written into the launch files: it needs --emit DIR")
    if args.emit:
        from autoconf.launch.emit import check_script
        check_script(args.script, args.script_args)
    storage = _preflight(args, storage)
    devices = verify_devices(args, cluster) if args.verify > 0 else None
    result, stored_why = _search(args, model, cluster, profile, calibration, storage)
    if not result.top:
        e = result.smallest_memory
        need = f"; the least memory-hungry configuration ({e.config.short()}) needs {e.peak_memory_bytes / 2**30:.2f} GiB per device" if e else ""
        raise UserError(f"no configuration of {model.name} fits in the devices' memory{need}"
                        + (f"; {stored_why}" if stored_why else ""))
    if cluster is not None and profile is not None:
        from autoconf.specs.measured_graph import overlay_measured_links
        pairs = overlay_measured_links(cluster.graph(), profile)[1]
        result = dataclasses.replace(result, notes=result.notes + (
            f"links: {pairs} device pair(s) measured by the profile replace the cluster file's declared "
            "figures; the rest are as declared",))
    from autoconf.files import fail_after, side_output
    doc = result.to_dict()
    verified = cal_report = None
    best, failed = result.top[0], [stored_why]
    if args.verify > 0:
        with Bars(wanted(args.quiet)) as bars:
            verified, cal_report, why = verify.run_verification(args, model, cluster, profile, result, devices, bars)
        failed.append(why)
        doc["verified"] = verified
        if cal_report is not None:
            doc["calibration"] = cal_report
        best, why = verify.pick(result, verified)
        if best is None:
            if args.json:
                _print_json(doc)
            if any(failed):  # one line: what could not be kept, then why nothing was picked
                fail_after(failed + [why])
            sys.stderr.write(f"autoconf: {why}\n")
            return 1
    doc["top"] = doc["top"][:args.top]
    doc["best"] = best.to_dict()
    if not verified:
        from autoconf.output.tables import near_ties
        doc["near_ties"] = near_ties(result.top[:args.top])
    # the launch files and plots are written beside the result: where one cannot be, the result is
    # still printed, then the reason (exit 2)
    if args.emit:
        from autoconf.launch.emit import DEFAULT_PORT, emit
        if cluster is None:  # the hosts and devices the profile measured
            from autoconf.specs.cluster import cluster_from_profile
            launch_cluster = cluster_from_profile(profile)
        else:
            launch_cluster = cluster
        emitted, why = side_output("--emit", args.emit, lambda: emit(
            best, model, launch_cluster, args.emit, args.profile, master_port=args.master_port or DEFAULT_PORT,
            script=args.script, script_args=args.script_args,
            runners_up=[e for e in result.top[:args.top] if e is not best]))
        failed.append(why)
        if emitted is not None:
            doc["emitted"] = emitted
    if args.plot:
        from autoconf.output.plots import plot_search
        doc["plots"], why = side_output("--plot", args.plot, lambda: plot_search(
            args.plot, result, best, model, cluster, profile, calibration, args.framework, args.global_batch), [])
        failed.append(why)
    if args.json:
        _print_json(doc)
    else:
        from autoconf.output.tables import search_report, show
        show(search_report(result, best, wide=args.wide, rows=args.top, verified=verified, calibration=cal_report,
                           calibrate_path=args.calibrate, emitted=doc.get("emitted")))
        if doc.get("plots"):
            print(f"plots: {', '.join(doc['plots'])}")
    fail_after(failed)
    return 0
