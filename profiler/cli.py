"""`autoconf profile`: launch the profiler under torchrun on this host (no torch import here).

    autoconf profile --model gpt2 --nproc-per-node 8 --out profile.json
    autoconf profile --model gpt2 --nnodes 2 --node-rank 0 --master-addr head --nproc-per-node 8 --out p.json

One node: ``torch.distributed.run --standalone``. Several nodes: run the same command on every
node with its ``--node-rank`` (static rendezvous at --master-addr:--master-port; node K's ranks
follow those of nodes 0..K-1). Under ``autoconf testbed`` these flags default to the node's
``AUTOCONF_*`` variables, so ``autoconf testbed ... -- autoconf profile --model M`` needs none. Each process gets
OMP_NUM_THREADS=1 (CPU ranks share the cores; one thread per process keeps timings honest).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import tempfile

from autoconf import procs
from autoconf.errors import UserError
from autoconf.launch.shell import python_torchrun, torchrun_argv


def add_profile_parser(subparsers) -> argparse.ArgumentParser:
    """Add the 'profile' subcommand; its handler is :func:`cmd_profile` (set as ``func``)."""
    from profiler.run import add_measure_args

    p = subparsers.add_parser("profile", help="measure the model and the links between ranks (launches torchrun)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_measure_args(p)
    p.add_argument("--out", default="profile.json", help="where to write the profile JSON (default profile.json)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks on this host (default: AUTOCONF_NPROC_PER_NODE, else the GPUs here, or 2 CPU "
                   "processes without a GPU)")
    p.add_argument("--nnodes", type=int, default=None,
                   help="hosts taking part (run this command on each; default: AUTOCONF_NNODES, else 1)")
    p.add_argument("--node-rank", type=int, default=None,
                   help="this host's index among --nnodes (default: AUTOCONF_NODE_RANK, else 0)")
    p.add_argument("--master-addr", default=None,
                   help="rank 0's host (several nodes; default: AUTOCONF_MASTER_ADDR, else 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None,
                   help="rendezvous port (several nodes; default: AUTOCONF_MASTER_PORT, else 29533)")
    p.set_defaults(func=cmd_profile)
    return p


def _local_gpus() -> int:
    """CUDA GPUs on this host without importing torch (CUDA_VISIBLE_DEVICES, then the driver's list)."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return len([d for d in vis.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


_PASS = ("model", "seq_length", "micro_batch_sizes", "tp", "recompute", "repeats", "warmup", "rounds",
         "compute_split", "timeout_min")
_FLAGS = ("quick", "serial_links", "skip_links", "skip_compute", "links_only", "quiet")


# flag -> (environment variable, type, default): `autoconf testbed` sets the variables in each node
_NODE_DEFAULTS = {"nnodes": ("AUTOCONF_NNODES", int, 1), "node_rank": ("AUTOCONF_NODE_RANK", int, 0),
                  "master_addr": ("AUTOCONF_MASTER_ADDR", str, "127.0.0.1"),
                  "master_port": ("AUTOCONF_MASTER_PORT", int, 29533),
                  "nproc_per_node": ("AUTOCONF_NPROC_PER_NODE", int, None)}


def node_defaults(args, environ=None) -> None:
    """Fill the multi-node flags not given from the AUTOCONF_* variables (set by `autoconf
    testbed` in each emulated node), else the single-host defaults. Idempotent."""
    environ = os.environ if environ is None else environ
    for flag, (var, cast, default) in _NODE_DEFAULTS.items():
        if getattr(args, flag, None) is not None:
            continue
        text = environ.get(var, "").strip()
        if not text:
            setattr(args, flag, default)
            continue
        try:
            setattr(args, flag, cast(text))
        except ValueError:
            raise UserError(f"{var}={text!r} (the default of --{flag.replace('_', '-')}): expected an integer") from None


def launch_command(args) -> list[str]:
    """The torchrun command line that runs the profiler with these arguments (several nodes: the
    static rendezvous, so this host's ranks follow those of the hosts with a lower --node-rank)."""
    node_defaults(args)
    nproc = args.nproc_per_node if args.nproc_per_node is not None else (_local_gpus() or 2)
    if nproc < 1:
        raise UserError(f"--nproc-per-node {nproc}: expected an integer >= 1 (ranks on this host)")
    if args.nnodes < 1:
        raise UserError(f"--nnodes {args.nnodes}: expected an integer >= 1 (hosts taking part)")
    if not 0 <= args.node_rank < args.nnodes:
        raise UserError(f"--node-rank={args.node_rank} must be in 0..{args.nnodes - 1}")
    target = ["-m", "profiler", "--out", os.path.abspath(args.out)]
    for name in _PASS:
        v = getattr(args, name, None)
        if v is not None:
            target += ["--" + name.replace("_", "-"), str(v)]
    target += ["--" + n.replace("_", "-") for n in _FLAGS if getattr(args, n, False)]
    several = args.nnodes > 1
    return torchrun_argv(target, nproc, args.nnodes, args.node_rank, args.master_addr if several else None,
                         args.master_port if several else None, launcher=python_torchrun())


def cmd_profile(args) -> int:
    """Validate the inputs here (fast, one-line errors), then run torchrun; its exit code is ours."""
    from autoconf.files import check_file
    from autoconf.specs.hf import load_model
    from profiler.run import STATUS_ENV, check_measure_args

    model = load_model(args.model, seq_length=args.seq_length)
    check_measure_args(args, model)  # every flag the ranks read, here: one line, not a torchrun traceback
    check_file(args.out, "--out")  # before the profile runs, not after
    cmd = launch_command(args)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               AUTOCONF_PROFILE_COMMAND=" ".join(shlex.quote(a) for a in sys.argv) or "autoconf profile")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # so `-m profiler` resolves from a checkout
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    before = os.stat(args.out).st_mtime_ns if os.path.exists(args.out) else None
    status, failure = None, ""
    with contextlib.suppress(OSError):  # none: rank 0 says it itself, under torchrun's report
        fd, status = tempfile.mkstemp(prefix="autoconf-profile-status-", suffix=".txt")
        os.close(fd)
        env[STATUS_ENV] = status  # rank 0 writes there why the profile is not at --out (run.save_or_fallback)
    try:
        # interrupted or crashed: every rank ends with us; torchrun's temporary files go with it
        with procs.ProcessTree(cmd, env=env, private_tmp=True) as tree:
            rc = tree.wait()
        if status is not None:
            with contextlib.suppress(OSError), open(status) as f:
                failure = " ".join(f.read().split())
    finally:
        if status is not None:
            with contextlib.suppress(OSError):
                os.unlink(status)
    if rc != 0:
        print(f"error: profiler exited with code {rc} (command: {' '.join(shlex.quote(c) for c in cmd)})"
              + (f"; {failure}" if failure else ""), file=sys.stderr)
        return rc if rc > 0 else 1
    if failure:
        raise UserError(failure)
    if args.node_rank == 0 and (not os.path.exists(args.out) or os.stat(args.out).st_mtime_ns == before):
        print(f"error: the profiler finished but did not write {args.out}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    """Stand-alone entry (`python -m profiler.cli ...`) until autoconf.cli wires the subcommand."""
    parser = argparse.ArgumentParser(prog="autoconf")
    sub = parser.add_subparsers(dest="command", required=True)
    add_profile_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
