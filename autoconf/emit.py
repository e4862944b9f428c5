"""emit: the launch files for a chosen configuration.

``config.json`` holds the configuration, the model and the cluster (the reference trainer and
``autoconf trial`` read it); ``node-K.sh`` is the torchrun command for host K; ``launch.md`` says
which script runs on which host, which global ranks (processes) it holds and what they play in the
plan (placed ranks, pipeline stages, blocks).

Several hosts: each script uses torchrun's static rendezvous (``--rdzv-backend=static --nnodes N
--node-rank K --master-addr A --master-port P``). torchrun honours ``--node-rank`` only there (under
c10d it is ignored and hosts join in arbitrary order); with it, the agent on host K is group rank
K and its workers get the global ranks right after those of hosts 0..K-1 (torch's agent gives each
node the sum of the local world sizes before it as its base rank). So host K holds exactly the
ranks the plan gave it. ``MASTER_ADDR`` defaults to host 0's name where the cluster file names its
hosts (``hosts: [...]`` per node group), else it must be set. On GPUs each script exports
``CUDA_VISIBLE_DEVICES`` in the order of the per-rank device mapping (``local_devices``: rank ->
device index on its host; identity by default), so local rank i runs on the GPU the plan chose.
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


def node_plan(cluster, world: int) -> list[dict]:
    """The hosts used, in rank order: name, devices used (nproc), first global rank, device kind."""
    names = cluster.host_names()
    out, first = [], 0
    for (_, grp), name, n in zip(cluster.nodes(), names, hosts_used(cluster, world)):
        out.append({"host": name, "nproc": n, "first_rank": first, "device": grp.device,
                    "gpus_per_node": grp.gpus_per_node})
        first += n
    return out


def visible_devices(plan: list[dict], local_devices: list[int] | None = None) -> list[str | None]:
    """Per host the CUDA_VISIBLE_DEVICES value (None for CPU hosts): the devices of its ranks in
    rank order, from ``local_devices`` (rank -> device index on its host; identity when None)."""
    world = sum(p["nproc"] for p in plan)
    if local_devices is not None:
        if len(local_devices) != world or not all(isinstance(d, int) and not isinstance(d, bool)
                                                  for d in local_devices):
            raise UserError(f"local_devices: expected {world} device indices (one per rank), got "
                            f"{local_devices!r:.80}")
    out = []
    for p in plan:
        first, n = p["first_rank"], p["nproc"]
        devs = list(range(n)) if local_devices is None else list(local_devices[first:first + n])
        if local_devices is not None and (len(set(devs)) != n or not all(0 <= d < p["gpus_per_node"] for d in devs)):
            raise UserError(f"local_devices for host {p['host']} (ranks {first}..{first + n - 1}): {devs} must be "
                            f"distinct device indices in 0..{p['gpus_per_node'] - 1}")
        out.append(None if p["device"] == "cpu" else ",".join(str(d) for d in devs))
    return out


def config_document(estimate, model, cluster, profile_path: str | None = None) -> dict:
    return {"version": CONFIG_VERSION, "created_by": f"autoconf {__version__}",
            "model": model.to_dict(), "config": estimate.config.to_dict(), "framework": estimate.framework,
            "cluster": cluster.to_dict() if cluster is not None else None,
            "profile": profile_path, "estimate": estimate.to_dict()}


def torchrun_command(node_rank: int, nnodes: int, nproc: int, config_file: str = "config.json",
                     rdzv_endpoint: str | None = None, master_port: int = DEFAULT_PORT) -> str:
    """One host's torchrun line. Several hosts: the static rendezvous with this host's node rank,
    at ``$MASTER_ADDR``:``master_port`` (or ``rdzv_endpoint``, host:port); one host: --standalone
    (or a local rendezvous on ``master_port`` when one is chosen)."""
    train = ["-m", "autoconf.trainer", "--config", config_file, "--out", "results"]
    if nnodes == 1:  # --standalone picks a free port itself; a chosen port is a local c10d rendezvous
        start = (["--standalone"] if master_port == DEFAULT_PORT else
                 ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{master_port}"])
        args = ["torchrun", *start, f"--nproc-per-node={nproc}", *train]
    else:
        where = ([f"--rdzv-endpoint={rdzv_endpoint}"] if rdzv_endpoint else
                 ['--master-addr="$MASTER_ADDR"', f"--master-port={master_port}"])
        args = ["torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--node-rank={node_rank}",
                "--rdzv-backend=static", *where, *train]
    return " ".join(a if "$" in a else shlex.quote(a) for a in args)


def emit(estimate, model, cluster, out_dir: str, profile_path: str | None = None,
         master_port: int = DEFAULT_PORT, local_devices: list[int] | None = None) -> list[str]:
    """Write the launch files into ``out_dir``; returns the paths written. ``master_port``: the
    rendezvous port on node 0 (several hosts). ``local_devices``: rank -> device index on its host
    (a placement's GPU order; identity when None)."""
    if not (isinstance(master_port, int) and 1 <= master_port <= 65535):
        raise UserError(f"--master-port {master_port!r}: expected a TCP port, 1 to 65535")
    if cluster is None:
        raise UserError("--emit needs --cluster (the launch files name hosts and devices per host)")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"--emit {out_dir!r}: cannot create the directory ({e.strerror})") from None
    plan = node_plan(cluster, estimate.config.world_size)
    visible = visible_devices(plan, local_devices)  # checked before anything is written
    try:
        return _write_all(estimate, model, cluster, out_dir, profile_path, master_port, plan, visible)
    except OSError as e:  # a full disk, a read-only file: no partial file is left (write_text)
        raise UserError(f"--emit {out_dir!r}: cannot write the launch files ({e.strerror})") from None


def host_roles(config, num_layers: int, first: int, n: int) -> str:
    """What the processes ``first..first+n-1`` (torchrun's global ranks = devices) play in the
    plan: the ranks of its order (``placement``), their pipeline stages and transformer blocks."""
    from .placement import Placement
    pl = Placement.of(config, num_layers)
    ranks = [pl.rank_on(d) for d in range(first, first + n)]
    stages = sorted({pl.coords(r)["pp"] for r in ranks})
    chunks = pl.chunk_layers()
    blocks = []
    for st in stages:
        for ci in pl.chunks_of_stage(st):
            if chunks[ci]:
                blocks.append(f"{chunks[ci][0]}-{chunks[ci][-1]}")
    moved = "" if ranks == list(range(first, first + n)) else f", playing plan ranks {','.join(map(str, ranks))}"
    return (f"{moved}; pipeline stage{'s' if len(stages) > 1 else ''} {','.join(map(str, stages))}, "
            f"blocks {','.join(blocks)}")


def _write_all(estimate, model, cluster, out_dir, profile_path, master_port, plan, visible) -> list[str]:
    written = []
    path = os.path.join(out_dir, "config.json")
    write_text(path, json.dumps(config_document(estimate, model, cluster, profile_path), indent=2) + "\n")
    written.append(path)
    nnodes = len(plan)
    named = bool(cluster.node_groups[0].hosts)  # host 0 has a real name to rendezvous at
    master = plan[0]["host"]
    lines = []
    for rank, (p, vis) in enumerate(zip(plan, visible)):
        cmd = torchrun_command(rank, nnodes, p["nproc"], master_port=master_port)
        ranks = (f"processes {p['first_rank']}..{p['first_rank'] + p['nproc'] - 1}"
                 f"{host_roles(estimate.config, model.num_layers, p['first_rank'], p['nproc'])}")
        path = os.path.join(out_dir, f"node-{rank}.sh")
        env = ""
        if nnodes > 1:
            env = (f'MASTER_ADDR="${{MASTER_ADDR:-{master}}}"  # host 0, the rendezvous\n' if named else
                   ': "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"\n')
        if vis is not None:
            env += f"export CUDA_VISIBLE_DEVICES={vis}  # local rank i runs on the i-th of these\n"
        write_text(path, f"#!/usr/bin/env bash\n# node {rank} of {nnodes}: run on host {p['host']}; {ranks}; "
                         f"{estimate.config.short()}\nset -euo pipefail\ncd \"$(dirname \"$0\")\"\n{env}exec {cmd}\n",
                   mode=0o755)
        written.append(path)
        gpus = f", GPUs {vis}" if vis is not None else ""
        lines.append(f"- host `{p['host']}` ({ranks}{gpus}): `bash node-{rank}.sh`")
    if nnodes == 1:
        start = "Run:\n\n"
    elif named:
        start = (f"Run each script on its host (any order; each waits for the others). MASTER_ADDR defaults to "
                 f"`{master}` (host 0); set it where that name does not resolve to host 0 on every host. "
                 f"The static rendezvous gives each host the ranks below, so every host runs the stages the "
                 f"plan gave it:\n\n")
    else:
        start = ("Set MASTER_ADDR to node 0's address on every host, then run each script on its host (the "
                 "static rendezvous gives each host the ranks below, so every host runs the stages the plan "
                 "gave it):\n\n")
    md = os.path.join(out_dir, "launch.md")
    write_text(md, f"# Launch: {model.name} on {cluster.name}\n\n{estimate.config.short()}\n\n"
                      f"Predicted step time {estimate.step_time_s:.4g} s, peak memory "
                      f"{estimate.peak_memory_bytes / 2**30:.2f} GiB per device.\n\n"
                      + start + "\n".join(lines) + "\n\nEach writes per-rank results under `results/`.\n"
                      + ("" if estimate.framework == "reference" else
                         f"\nThe plan was modelled for {estimate.framework}; these commands run autoconf's "
                         f"reference trainer, which differs from {estimate.framework} in memory and speed. "
                         f"Set the configuration above in {estimate.framework}'s own launcher.\n"))
    written.append(md)
    return written
