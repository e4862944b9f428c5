"""The ``--verify`` flags of ``search`` and their checks (the trials themselves: ``runs.verify``).
"""

from __future__ import annotations

import argparse

from autoconf.errors import UserError
from autoconf.runs import trial
from autoconf.runs.verify import target_devices


def add_verify_arguments(p: argparse.ArgumentParser) -> None:
    """The search's flags for verifying trials and calibration."""
    from autoconf.cli.argtypes import fraction, non_negative_int, positive_int, seconds

    p.add_argument("--verify", type=non_negative_int, default=0, metavar="K", help="run the top K as short real trials")
    p.add_argument("--steps", type=positive_int, default=6, help="steps per verifying trial")
    p.add_argument("--trial-timeout", type=seconds, default=300.0, metavar="S",
                   help="wall-clock limit per verifying trial in seconds (default 300); every process of a trial "
                   "that runs over is killed and the trial recorded as failed")
    p.add_argument("--verify-on-local", action="store_true",
                   help="let --verify run on this machine's devices when the cluster file describes other ones "
                   "(CPU processes for a GPU cluster): the measurements then describe this machine, and a "
                   "calibration fitted on them records that and applies to this machine's devices only")
    p.add_argument("--memory-margin", type=fraction, default=0.0, metavar="F",
                   help="with --verify: refuse a configuration whose measured peak memory exceeds the device "
                   "capacity minus this fraction of it (default 0)")
    p.add_argument("--calibrate", metavar="FILE", help="with --verify: fit correction factors, save them to FILE")


def check_arguments(args) -> None:
    """One-line refusals of verification settings that cannot work, before any search."""
    if args.verify > 0 and args.framework != "reference":
        raise UserError(f"--verify runs autoconf's reference trainer, not {args.framework}: its measurements "
                        f"would not check a {args.framework} prediction; use --framework reference with --verify")
    if args.calibrate and args.verify <= 0:
        raise UserError("--calibrate needs --verify K (K >= 1): it fits factors to the verifying trials")


def verify_devices(args, cluster) -> list[str] | None:
    """The devices the verifying trials run on, as the calibration records them; refuses a
    cluster of other devices unless --verify-on-local."""
    local = trial.local_device_kind()
    if cluster is None:
        return None  # a profile: measured on the machines it describes
    wanted = target_devices(cluster, None)
    kind = "cpu" if wanted == ["cpu"] else "cuda"
    if kind == local:
        return wanted
    if not args.verify_on_local:
        raise UserError(f"--verify runs the trials on this machine ({'CPU processes' if local == 'cpu' else 'its GPUs'}"
                        f"), but cluster {cluster.name!r} has {', '.join(wanted)}: the measurements would not "
                        "describe it; pass --verify-on-local to run them here anyway")
    return [local]
