"""Four ranks on two cores: how much of the testbed's pipeline misprediction is the fixed core share?

    python bench/cpu_share.py [bench/data/testbed-compression-2026-11-24]

The cost model charges every CPU rank of an oversubscribed machine the same share of a core all
the time (``System.cpu_share``: ranks / cores, 2.0 for four ranks on two cores). A rank that waits
on a link leaves its core to the others, so while some ranks wait, the computing ones run faster.
This bench prices the measured runs of ``bench/compression.py speed --nproc-per-node 2`` (their
profile, cluster file and step times are committed under ``bench/data/``) twice: with the fixed
share, and with a mean-field processor share -- a rank computes alongside the ranks of its own
stage (dp replicas: they run in lockstep) and, with probability u, each rank of the other stages,
u being the busy fraction (compute / step) of the previous pass; share = max(1, (n_stage + (n -
n_stage) u) / cores), iterated to a fixed point. Nothing is fitted: u comes from the model's own
simulation. The cost model does not use the mean field (the search's bounds assume the fixed
share); this measures what modelling processor sharing would change.
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autoconf.cluster import load_cluster  # noqa: E402
from autoconf.config import ParallelConfig  # noqa: E402
from autoconf.cost import system as system_module  # noqa: E402
from autoconf.cost.estimate import estimate  # noqa: E402
from autoconf.model import load_model  # noqa: E402
from autoconf.profile import load_profile  # noqa: E402
from compression import speed_cases  # noqa: E402  (bench/compression.py: the configurations it ran)


def configs() -> dict:
    """{(case, mode): configuration} as ``bench/compression.py speed`` ran them, two per node
    (its default ranks: 16 for the pipeline, 8 for PowerSGD)."""
    return {(name, mode): ParallelConfig(**{**base.to_dict(), **kw})
            for name, base, modes in speed_cases(16, 8, 2) for mode, kw in modes.items()}


def priced(c, model, cluster, profile, share: float | None):
    """The estimate with the fixed share (None) or with every CPU rank at ``share``."""
    fixed = system_module.System.cpu_share
    if share is not None:
        system_module.System.cpu_share = lambda self, kind: share if kind == "cpu" else 1.0
    try:
        return estimate(c, model, cluster=cluster, profile=profile)
    finally:
        system_module.System.cpu_share = fixed


def mean_field(c, model, cluster, profile, ranks: int, cores: int, passes: int = 4):
    per_stage = c.dp * c.tp * c.cp  # ranks computing in lockstep (one machine holds them all here)
    e, share = priced(c, model, cluster, profile, None), None
    for _ in range(passes):
        u = e.breakdown_s["compute"] / e.step_time_s
        share = max(1.0, (per_stage + (ranks - per_stage) * u) / cores)
        e = priced(c, model, cluster, profile, share)
    return e, share


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
    print(f"{'case':<18} {'mode':<14} {'measured':>9} {'fixed share':>18} {'mean field':>26}")
    base: dict = {}
    rows = []
    ran = configs()
    for r in measured["rows"]:
        c = ran[(r["case"], r["mode"])]
        fixed = priced(c, model, cluster, profile, None).step_time_s * 1e3
        mf, share = mean_field(c, model, cluster, profile, ranks, cores)
        mf_ms = mf.step_time_s * 1e3
        meas = r["measured_ms"]
        if r["mode"] == "none":
            base[r["case"]] = (meas, fixed, mf_ms)
        rows.append((r["case"], r["mode"], meas, fixed, mf_ms))
        print(f"{r['case']:<18} {r['mode']:<14} {meas:>7.1f}ms {fixed:>8.1f}ms {fixed / meas - 1:>+7.1%}  "
              f"{mf_ms:>8.1f}ms {mf_ms / meas - 1:>+7.1%} (x{share:.2f})")
    print(f"\n{'case':<18} {'mode':<14} {'gain measured':>13} {'fixed share':>12} {'mean field':>11}")
    for case, mode, meas, fixed, mf_ms in rows:
        if mode == "none":
            continue
        b = base[case]
        print(f"{case:<18} {mode:<14} {b[0] / meas - 1:>+13.1%} {b[1] / fixed - 1:>+12.1%} {b[2] / mf_ms - 1:>+11.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
