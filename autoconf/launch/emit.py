"""emit: the launch files for a chosen configuration (``autoconf search --emit DIR``).

- ``config.json``: the launch plan (``autoconf.launch.plan``), which the reference trainer, ``autoconf
  trial`` and a user's script (``autoconf.load_plan()``) read;
- ``node-K.sh``: host K's torchrun command (``autoconf.launch``: static rendezvous across hosts,
  ``CUDA_VISIBLE_DEVICES`` in the plan's order, ``AUTOCONF_PLAN`` pointing to ``config.json``).
  What it runs: the user's script with ``--script``, else the framework's launcher (the reference
  trainer, Megatron-LM's ``pretrain_gpt.py``, ``torchtitan.train``, a DeepSpeed script); arguments
  given to it are passed on;
- the framework's own files (``autoconf.launch.gaps``): ``megatron_args.sh``, ``torchtitan_args.sh``
  and ``torchtitan.toml``, ``ds_config.json``;
- ``sbatch.sh``: the same node scripts under SLURM, one per allocated node;
- ``PLAN.md``: the choice, why (the estimate's terms), the runners-up, and how to run it.

Every line that carries a value is built by ``launch.shell`` (``join``, ``assign``, ``default``,
``array``, ``comment_line``; ``sbatch_line`` for what sbatch reads unquoted), so each value is quoted
or escaped where it is written; all files are written atomically.
"""

from __future__ import annotations

import json
import os
import re
import shlex

from autoconf.errors import UserError
from autoconf.files import write_texts_all_or_none
from autoconf.launch import deepspeed, megatron, torchtitan
from autoconf.launch.hosts import host_roles, node_plan, visible_devices
from autoconf.launch.plan import PLAN_ENV, LaunchPlan
from autoconf.launch.plan_md import plan_markdown
from autoconf.launch.shell import (
    DEFAULT_PORT,
    Raw,
    assign,
    comment,
    comment_line,
    default,
    join,
    quote,
    sbatch_line,
    torchrun_argv,
)
from autoconf.specs.cluster import is_host_name

__all__ = ["DEFAULT_PORT", "emit", "host_roles", "node_plan", "visible_devices"]

_TARGETS = {
    "reference": ["-m", "autoconf.trainer", "--config", "config.json", "--out", "results", Raw('"$@"')],
    "megatron": [Raw('"${MEGATRON_LM:?set MEGATRON_LM to your Megatron-LM checkout}/pretrain_gpt.py"'),
                 Raw('"${MEGATRON_ARGS[@]}"'), Raw('"$@"')],
    "torchtitan": ["-m", "torchtitan.train", "--module", Raw('"${TORCHTITAN_MODULE:-llama3}"'), "--config",
                   Raw('"${TORCHTITAN_CONFIG:?set TORCHTITAN_CONFIG to a torchtitan config function (see '
                       'torchtitan_args.sh)}"'), Raw('"${TORCHTITAN_ARGS[@]}"'), Raw('"$@"'),
                   Raw('"$TORCHTITAN_AC"')],
    "deepspeed": [Raw('"${DEEPSPEED_SCRIPT:?set DEEPSPEED_SCRIPT to your DeepSpeed training script, or emit with '
                      '--script}"'), "--deepspeed", "--deepspeed_config", "ds_config.json", Raw('"$@"')],
}
_SOURCED = {"megatron": "megatron_args.sh", "torchtitan": "torchtitan_args.sh"}


def emit(estimate, model, cluster, out_dir: str, profile_path: str | None = None,
         master_port: int = DEFAULT_PORT, local_devices: list[int] | None = None, script: str | None = None,
         script_args=(), runners_up=(), seed: int = 0) -> list[str]:
    """Write the launch files into ``out_dir``; returns the paths written. ``master_port``: the
    rendezvous port on node 0 (several hosts). ``local_devices``: rank -> device index on its host
    (a placement's GPU order; identity when None). ``script``: the user's training script the node
    scripts run (with ``script_args``) instead of the framework's launcher. ``runners_up``: the
    search's next best estimates, for PLAN.md."""
    if isinstance(master_port, bool) or not isinstance(master_port, int) or not 1 <= master_port <= 65535:
        raise UserError(f"--master-port {master_port!r}: expected a TCP port, 1 to 65535")
    if cluster is None:
        raise UserError("--emit needs --cluster (the launch files name hosts and devices per host)")
    script = check_script(script, script_args)
    plan = LaunchPlan.of_estimate(estimate, model, cluster, profile_path, seed)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"--emit {out_dir!r}: cannot create the directory ({e.strerror})") from None
    hosts = node_plan(cluster, plan.world_size)
    visible = visible_devices(hosts, local_devices)  # checked before anything is written
    try:
        return _write_all(plan, estimate, out_dir, master_port, hosts, visible, script, list(script_args),
                          list(runners_up))
    except OSError as e:  # a full disk, a read-only file: no partial file is left (write_text)
        raise UserError(f"--emit {out_dir!r}: cannot write the launch files ({e.strerror})") from None


def check_script(script: str | None, script_args=()) -> str | None:
    """The user's script as an absolute path (the node scripts run from the launch directory);
    UserError if it is missing, or if arguments come without it."""
    if script is None:
        if script_args:
            raise UserError(f"script arguments {comment(' '.join(map(quote, script_args)))[:80]} need --script FILE")
        return None
    if not os.path.isfile(script):
        raise UserError(f"--script {script!r} is not a file (give the path of your training script)")
    return os.path.abspath(script)


def _header(plan) -> str:
    """The plan in words, for a comment line (:func:`~autoconf.launch.shell.comment_line` makes it
    safe there: names may hold anything)."""
    e = plan.expected
    pred = f"; predicted {e.step_time_s:.4g} s/step, {e.peak_memory_bytes / 2**30:.2f} GiB peak" if e else ""
    return f"{plan.model.name} on {plan.cluster.name}: {plan.config.short()}{pred} (autoconf plan, config.json)"


def _framework_files(plan, out_dir: str) -> list[tuple]:
    """(path, text, mode) of the framework's own launch files."""
    header = _header(plan)
    files = {"megatron": {"megatron_args.sh": lambda: megatron.megatron_file(plan, header)},
             "torchtitan": {"torchtitan_args.sh": lambda: torchtitan.torchtitan_args_file(plan, header),
                            "torchtitan.toml": lambda: torchtitan.torchtitan_toml(plan, header)},
             "deepspeed": {"ds_config.json": lambda: json.dumps(deepspeed.ds_config(plan, header), indent=2) + "\n"},
             }.get(plan.framework_name, {})
    return [(os.path.join(out_dir, name), text(), None) for name, text in files.items()]


_CD_HERE = 'case "$0" in */*) CDPATH= cd -- "${0%/*}/" ;; esac'
"""Into the script's directory ($(dirname ...) would drop a trailing newline of its name)."""


def _node_script(plan, k: int, hosts: list[dict], vis, master_port: int, script, script_args) -> str:
    p, nnodes = hosts[k], len(hosts)
    named = bool(plan.cluster.node_groups[0].hosts)  # host 0 has a real name to rendezvous at
    ranks = (f"processes {p['first_rank']}..{p['first_rank'] + p['nproc'] - 1}"
             f"{host_roles(plan.config, plan.model.num_layers, p['first_rank'], p['nproc'])}")
    lines = ["#!/usr/bin/env bash", comment_line(f"node {k} of {nnodes}: run on host {p['host']}; {ranks}"),
             comment_line(_header(plan)), "set -euo pipefail", _CD_HERE,
             assign(PLAN_ENV, Raw('"$PWD/config.json"'), export=True)]
    if nnodes > 1:
        lines.append(default("MASTER_ADDR", hosts[0]["host"]) + "  # host 0, the rendezvous" if named else
                     ': "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"')
    if vis is not None:
        lines.append(assign("CUDA_VISIBLE_DEVICES", vis, export=True) + "  # local rank i runs on the i-th of these")
    if script is None and plan.framework_name == "megatron" and plan.config.tp > 1:
        # Megatron-LM's column-parallel backward issues its collectives asynchronously beside its
        # GEMMs (the cost model prices them so: cost/tensor_parallel.overlapped); one hardware
        # queue keeps them in issue order (its own example scripts set it; sequence parallelism
        # requires it)
        lines.append(assign("CUDA_DEVICE_MAX_CONNECTIONS", 1, export=True))
    if plan.config.precision == "tf32":
        # fp32 matmuls on TF32 tensor cores in every framework and user script: PyTorch's cuBLAS
        # handle honours this override whatever the code sets allow_tf32 to (NVIDIA's containers
        # set it); the reference trainer also sets allow_tf32 itself
        lines.append(assign("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", 1, export=True))
    if script is not None:
        target = [script, *script_args, Raw('"$@"')]
    else:
        target = _TARGETS[plan.framework_name]
        if plan.framework_name in _SOURCED:
            lines.append(join(["source", "./" + _SOURCED[plan.framework_name]]))
    argv = torchrun_argv(target, p["nproc"], nnodes, k, Raw('"$MASTER_ADDR"') if nnodes > 1 else None,
                         master_port if nnodes > 1 or master_port != DEFAULT_PORT else None)
    lines.append(join(["exec", *argv]))
    return "\n".join(lines) + "\n"


_ON_NODE = r"""set -euo pipefail
rank="$SLURM_NODEID"
if [ "${AUTOCONF_NAMED_HOSTS:-0}" = 1 ]; then
  rank=-1
  for ((i = 0; i < AUTOCONF_NNODES; i++)); do
    v="AUTOCONF_HOST_$i"
    if [ "${!v}" = "${SLURMD_NODENAME:-}" ]; then rank=$i; fi
  done
  if [ "$rank" -lt 0 ]; then echo "sbatch.sh: node ${SLURMD_NODENAME:-?} is not a host of the plan" >&2; exit 1; fi
fi
exec bash -- "$AUTOCONF_LAUNCH_DIR/node-$rank.sh"
"""


def _nodelist(hosts: list[dict]) -> str:
    """``#SBATCH --nodelist``: sbatch reads it unquoted, so each name is checked again here, whole."""
    bad = [p["host"] for p in hosts if not is_host_name(p["host"])]
    if bad:
        return comment_line(f"no #SBATCH --nodelist: host {bad[0]!r} is not a plain host name (letters, digits, "
                            "'.', '_', '-', ':'); sbatch would read it unquoted")
    return sbatch_line("nodelist", ",".join(p["host"] for p in hosts))


def _sbatch(plan, out_dir: str, hosts: list[dict], visible) -> str:
    nnodes = len(hosts)
    named = bool(plan.cluster.node_groups[0].hosts)
    gpus = [p["nproc"] for p, v in zip(hosts, visible) if v is not None]
    lines = ["#!/usr/bin/env bash", sbatch_line("job-name", "autoconf"), sbatch_line("nodes", nnodes),
             sbatch_line("ntasks-per-node", 1)]
    if gpus:
        lines.append(sbatch_line("gpus-per-node", max(gpus)))
    if named:
        lines.append(_nodelist(hosts))
    lines += [comment_line(_header(plan)),
              "# sbatch sbatch.sh: srun starts one task per node; each runs node-K.sh for its node, K from the "
              "plan's host names" if named else
              "# sbatch sbatch.sh: srun starts one task per node; each runs node-$SLURM_NODEID.sh",
              "# (torchrun's static rendezvous, so every node keeps its ranks and GPU order).",
              "set -euo pipefail",
              # where node-K.sh are, on a file system every node shares (sbatch runs a copy of this file)
              default("AUTOCONF_LAUNCH_DIR", os.path.abspath(out_dir)),
              "export AUTOCONF_LAUNCH_DIR " + assign("AUTOCONF_NNODES", nnodes) + " "
              + assign("AUTOCONF_NAMED_HOSTS", int(named))]
    if named:
        lines += [assign(f"AUTOCONF_HOST_{k}", p["host"], export=True) for k, p in enumerate(hosts)]
        lines.append(default("MASTER_ADDR", hosts[0]["host"]))
    else:
        lines.append('if [ -z "${MASTER_ADDR:-}" ]; then '
                     # the first node of the allocation (sed reads all: no SIGPIPE under pipefail, as head -n1 could)
                     'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"; fi')
    srun = ["srun", f"--nodes={nnodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "-c",
            Raw(shlex.quote(_ON_NODE))]  # a constant, kept readable over its lines
    lines += ["export MASTER_ADDR", join(srun)]
    return "\n".join(lines) + "\n"


def _write_all(plan, estimate, out_dir, master_port, hosts, visible, script, script_args, runners_up) -> list[str]:
    """Every launch file rendered first, then written all or none (``files.write_texts_all_or_none``:
    a full disk half-way leaves the previous launch files complete, none of the new ones), then the
    stale ones of an earlier emit removed."""
    files = [(os.path.join(out_dir, "config.json"), plan.to_json(), None)] + _framework_files(plan, out_dir)
    files += [(os.path.join(out_dir, f"node-{k}.sh"), _node_script(plan, k, hosts, vis, master_port, script, script_args),
               0o755) for k, vis in enumerate(visible)]
    files += [(os.path.join(out_dir, "sbatch.sh"), _sbatch(plan, out_dir, hosts, visible), 0o755),
              (os.path.join(out_dir, "PLAN.md"), plan_markdown(plan, estimate, hosts, visible, script, runners_up), None)]
    written = write_texts_all_or_none(files)
    _remove_stale(out_dir, written)
    return written


_EMITTED = re.compile(r"node-\d+\.sh|megatron_args\.sh|torchtitan_args\.sh|torchtitan\.toml|ds_config\.json")


def _remove_stale(out_dir: str, written: list[str]) -> None:
    """Launch files an earlier emit wrote into ``out_dir`` that this plan has none of (a node
    script for a host it does not use, another framework's files): removed, so that no script is
    left that would run the new config.json with the old layout. Only files that carry autoconf's
    header are touched."""
    keep = {os.path.abspath(p) for p in written}
    for name in os.listdir(out_dir):
        path = os.path.abspath(os.path.join(out_dir, name))
        if not _EMITTED.fullmatch(name) or path in keep or not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                head = f.read(4096)
        except OSError:
            continue
        if "(autoconf plan, config.json)" in head:
            os.unlink(path)
