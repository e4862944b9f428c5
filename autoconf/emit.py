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
from .outputs import write_text

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
                     rdzv_endpoint: str | None = None, master_port: int = DEFAULT_PORT) -> str:
    rdzv_endpoint = rdzv_endpoint or f"$MASTER_ADDR:{master_port}"
    args = ["torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--node-rank={node_rank}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=autoconf",
            "-m", "autoconf.trainer", "--config", config_file, "--out", "results"]
    if nnodes == 1:  # --standalone picks a free port itself; a chosen port is a local c10d rendezvous
        start = (["--standalone"] if master_port == DEFAULT_PORT else
                 ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{master_port}"])
        args = ["torchrun", *start, f"--nproc-per-node={nproc}", "-m", "autoconf.trainer",
                "--config", config_file, "--out", "results"]
    return " ".join(a if a.startswith("$") or "$" in a else shlex.quote(a) for a in args)


def emit(estimate, model, cluster, out_dir: str, profile_path: str | None = None,
         master_port: int = DEFAULT_PORT) -> list[str]:
    """Write the launch files into ``out_dir``; returns the paths written. ``master_port``: the
    rendezvous port on node 0 (several hosts)."""
    if not (isinstance(master_port, int) and 1 <= master_port <= 65535):
        raise UserError(f"--master-port {master_port!r}: expected a TCP port, 1 to 65535")
    if cluster is None:
        raise UserError("--emit needs --cluster (the launch files name hosts and devices per host)")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"--emit {out_dir!r}: cannot create the directory ({e.strerror})") from None
    try:
        return _write_all(estimate, model, cluster, out_dir, profile_path, master_port)
    except OSError as e:  # a full disk, a read-only file: no partial file is left (write_text)
        raise UserError(f"--emit {out_dir!r}: cannot write the launch files ({e.strerror})") from None


def _write_all(estimate, model, cluster, out_dir, profile_path, master_port) -> list[str]:
    per_host = hosts_used(cluster, estimate.config.world_size)
    written = []
    path = os.path.join(out_dir, "config.json")
    write_text(path, json.dumps(config_document(estimate, model, cluster, profile_path), indent=2) + "\n")
    written.append(path)
    nnodes = len(per_host)
    lines = []
    for rank, nproc in enumerate(per_host):
        cmd = torchrun_command(rank, nnodes, nproc, master_port=master_port)
        p = os.path.join(out_dir, f"node-{rank}.sh")
        env = "" if nnodes == 1 else ': "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"\n'
        write_text(p, f"#!/usr/bin/env bash\n# node {rank} of {nnodes}: {estimate.config.short()}\nset -euo pipefail\n"
                      f"cd \"$(dirname \"$0\")\"\n{env}exec {cmd}\n", mode=0o755)
        written.append(p)
        lines.append(f"- host {rank}: `bash node-{rank}.sh`")
    md = os.path.join(out_dir, "launch.md")
    write_text(md, f"# Launch: {model.name} on {cluster.name}\n\n{estimate.config.short()}\n\n"
                      f"Predicted step time {estimate.step_time_s:.4g} s, peak memory "
                      f"{estimate.peak_memory_bytes / 2**30:.2f} GiB per device.\n\n"
                      + ("Set MASTER_ADDR to node 0's address on every host, then run:\n\n" if nnodes > 1 else "Run:\n\n")
                      + "\n".join(lines) + "\n\nEach writes per-rank results under `results/`.\n"
                      + ("" if estimate.framework == "reference" else
                         f"\nThe plan was modelled for {estimate.framework}; these commands run autoconf's "
                         f"reference trainer, which differs from {estimate.framework} in memory and speed. "
                         f"Set the configuration above in {estimate.framework}'s own launcher.\n"))
    written.append(md)
    return written
