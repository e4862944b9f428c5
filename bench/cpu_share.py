"""Four ranks on two cores: the testbed's pipeline runs priced with a fixed core share and with
processor sharing.

    python bench/cpu_share.py [bench/data/testbed-compression-2026-11-24]

A CPU rank of an oversubscribed machine computes at its machine's cores over the ranks computing
at that moment, at most one core: a rank that waits on a link leaves its core to the others. The
cost model's schedule simulation runs it so (``pipeline.Sharing``, from ``System.cpu_sharing``).
This bench prices the measured runs of ``bench/compression.py speed --nproc-per-node 2`` (their
profile, cluster file and step times are committed under ``bench/data/``) both ways: with every
rank at a fixed share of ranks / cores all the time (the model before processor sharing; here the
simulation is handed no sharing) and as the cost model now prices them. Nothing is fitted.
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from compression import speed_cases  # noqa: E402  (bench/compression.py: the configurations it ran)

from autoconf.cost import system as system_module  # noqa: E402
from autoconf.cost.estimate import estimate  # noqa: E402
from autoconf.space.config import ParallelConfig  # noqa: E402
from autoconf.specs.cluster import load_cluster  # noqa: E402
from autoconf.specs.hf import load_model  # noqa: E402
from autoconf.specs.profile import load_profile  # noqa: E402


def configs() -> dict:
    """{(case, mode): configuration} as ``bench/compression.py speed`` ran them, two per node
    (its default ranks: 16 for the pipeline, 8 for PowerSGD)."""
    return {(name, mode): ParallelConfig(**{**base.to_dict(), **kw})
            for name, base, modes in speed_cases(16, 8, 2) for mode, kw in modes.items()}


def priced(c, model, cluster, profile, sharing: bool):
    """The estimate with processor sharing (the cost model) or at the fixed share (``sharing=False``)."""
    if sharing:
        return estimate(c, model, cluster=cluster, profile=profile)
    real = system_module.System.cpu_sharing
    system_module.System.cpu_sharing = lambda self, stage_devs: None
    try:
        return estimate(c, model, cluster=cluster, profile=profile)
    finally:
        system_module.System.cpu_sharing = real


def main() -> int:
    data = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "bench", "data", "testbed-compression-2026-11-24")
    model = load_model(os.path.join(data, "model.json"))
    cluster = load_cluster(os.path.join(data, "testbed.yaml"))
    profile = load_profile(os.path.join(data, "profile.json"))
    with open(os.path.join(data, "measured.json")) as f:
        measured = json.load(f)
    ranks = len(profile.ranks)
    cores = min(h.cpu_count for h in profile.provenance.hosts)
    print(f"{measured['command']} ({measured['date']}): {ranks} ranks on {cores} cores\n")
    print(f"{'case':<18} {'mode':<14} {'measured':>9} {'fixed share':>18} {'processor sharing':>20}")
    base: dict = {}
    rows = []
    ran = configs()
    for r in measured["rows"]:
        c = ran[(r["case"], r["mode"])]
        fixed = priced(c, model, cluster, profile, False).step_time_s * 1e3
        ps = priced(c, model, cluster, profile, True).step_time_s * 1e3
        meas = r["measured_ms"]
        if r["mode"] == "none":
            base[r["case"]] = (meas, fixed, ps)
        rows.append((r["case"], r["mode"], meas, fixed, ps))
        print(f"{r['case']:<18} {r['mode']:<14} {meas:>7.1f}ms {fixed:>8.1f}ms {fixed / meas - 1:>+7.1%}  "
              f"{ps:>9.1f}ms {ps / meas - 1:>+7.1%}")
    print(f"\n{'case':<18} {'mode':<14} {'gain measured':>13} {'fixed share':>12} {'processor sharing':>18}")
    for case, mode, meas, fixed, ps in rows:
        if mode == "none":
            continue
        b = base[case]
        print(f"{case:<18} {mode:<14} {b[0] / meas - 1:>+13.1%} {b[1] / fixed - 1:>+12.1%} {b[2] / ps - 1:>+18.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
