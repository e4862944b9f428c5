"""What the commands share: loading the model, cluster, profile and calibration named by the
flags, and printing JSON.
"""

from __future__ import annotations

import json
import sys

from autoconf.errors import UserError

_PHASES = {"brute force": "evaluating every point", "sampling": "sampling (TPE)",
           "sweep": "every remaining point (branch and bound)", "earlier trials": "the study's earlier best",
           "placement": "placing the best"}


def _load_inputs(args):
    from autoconf.runs.verify import check_calibration_applies
    from autoconf.specs.cluster import load_cluster
    from autoconf.specs.hf import load_model
    model = load_model(args.model, seq_length=args.seq_length)
    cluster = load_cluster(args.cluster) if args.cluster else None
    profile = calibration = None
    if getattr(args, "profile", None):
        from autoconf.specs.profile import check_profile_matches, load_profile
        profile = load_profile(args.profile)
        check_profile_matches(profile, model)
    if getattr(args, "calibration", None):
        from autoconf.cost.calibration import load_calibration
        calibration = load_calibration(args.calibration)
    if cluster is None and profile is None:
        raise UserError("give --cluster FILE (see examples/clusters/) or --profile FILE")
    check_calibration_applies(calibration, cluster, profile, getattr(args, "calibration", None))
    return model, cluster, profile, calibration


def _print_json(doc) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, default=float) + "\n")


