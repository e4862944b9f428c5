"""emit: the launch files for a chosen configuration.

``config.json`` holds the configuration, the model and the cluster (the reference trainer and
``autoconf trial`` read it); ``node-K.sh`` is the torchrun command for host K (nnodes,
nproc-per-node, node-rank, c10d rendezvous); ``launch.md`` says how to start them.
"""

from __future__ import annotations

import json
import os
import shlex

from . import __version__
from .errors import UserError

CONFIG_VERSION = 1
DEFAULT_PORT = 29500


def hosts_used(cluster, world: int) -> list[int]:
    """Devices per host for the first ``world`` devices (hosts in cluster order)."""
    out, left = [], world
    for _, grp in cluster.nodes():
        if left <= 0:
            break
        n = min(grp.gpus_per_node, left)
        out.append(n)
        left -= n
    return out


def config_document(estimate, model, cluster, profile_path: str | None = None) -> dict:
    return {"version": CONFIG_VERSION, "created_by": f"autoconf {__version__}",
            "model": model.to_dict(), "config": estimate.config.to_dict(), "framework": estimate.framework,
            "cluster": cluster.to_dict() if cluster is not None else None,
            "profile": profile_path, "estimate": estimate.to_dict()}


def torchrun_command(node_rank: int, nnodes: int, nproc: int, config_file: str = "config.json",
                     rdzv_endpoint: str = "$MASTER_ADDR:%d" % DEFAULT_PORT) -> str:
    args = ["torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--node-rank={node_rank}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=autoconf",
            "-m", "autoconf.trainer", "--config", config_file, "--out", "results"]
    if nnodes == 1:
        args = ["torchrun", "--standalone", f"--nproc-per-node={nproc}", "-m", "autoconf.trainer",
                "--config", config_file, "--out", "results"]
    return " ".join(a if a.startswith("$") or "$" in a else shlex.quote(a) for a in args)


def emit(estimate, model, cluster, out_dir: str, profile_path: str | None = None) -> list[str]:
    """Write the launch files into ``out_dir``; returns the paths written."""
    if cluster is None:
        raise UserError("--emit needs --cluster (the launch files name hosts and devices per host)")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"--emit {out_dir!r}: cannot create the directory ({e.strerror})") from None
    per_host = hosts_used(cluster, estimate.config.world_size)
    written = []
    path = os.path.join(out_dir, "config.json")
    _atomic_write(path, json.dumps(config_document(estimate, model, cluster, profile_path), indent=2) + "\n")
    written.append(path)
    nnodes = len(per_host)
    lines = []
    for rank, nproc in enumerate(per_host):
        cmd = torchrun_command(rank, nnodes, nproc)
        p = os.path.join(out_dir, f"node-{rank}.sh")
        env = "" if nnodes == 1 else ': "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"\n'
        _atomic_write(p, f"#!/usr/bin/env bash\n# node {rank} of {nnodes}: {estimate.config.short()}\nset -euo pipefail\n"
                         f"cd \"$(dirname \"$0\")\"\n{env}exec {cmd}\n")
        os.chmod(p, 0o755)
        written.append(p)
        lines.append(f"- host {rank}: `bash node-{rank}.sh`")
    md = os.path.join(out_dir, "launch.md")
    _atomic_write(md, f"# Launch: {model.name} on {cluster.name}\n\n{estimate.config.short()}\n\n"
                      f"Predicted step time {estimate.step_time_s:.4g} s, peak memory "
                      f"{estimate.peak_memory_bytes / 2**30:.2f} GiB per device.\n\n"
                      + ("Set MASTER_ADDR to node 0's address on every host, then run:\n\n" if nnodes > 1 else "Run:\n\n")
                      + "\n".join(lines) + "\n\nEach writes per-rank results under `results/`.\n")
    written.append(md)
    return written


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
