"""How a plan's processes are started: which host runs which ranks on which devices, the one
torchrun command line (emitted scripts, ``autoconf trial``, the profiler and the testbed all build
theirs here), and shell quoting for everything written into a script.

Several hosts: torchrun's static rendezvous (``--rdzv-backend=static --nnodes N --node-rank K
--master-addr A --master-port P``). torchrun honours ``--node-rank`` only there (under c10d it is
ignored and hosts join in arbitrary order); with it, the agent on host K is group rank K and its
workers get the global ranks right after those of hosts 0..K-1 (torch's agent gives each node the
sum of the local world sizes before it as its base rank). So host K holds exactly the ranks the
plan gave it. One host: ``--standalone`` (torchrun picks a free port), or a local c10d rendezvous
on a chosen port.

Quoting: :func:`join` quotes every argument with ``shlex.quote`` except :class:`Raw` ones, which
the emitter builds from constants only (``"$MASTER_ADDR"``, ``"${MEGATRON_ARGS[@]}"``); no value
from a model, cluster, path or user argument is ever Raw. :func:`comment` makes any text safe
inside a ``#`` comment (a newline would end it).
"""

from __future__ import annotations

import shlex
import sys

from autoconf.errors import UserError

DEFAULT_PORT = 29500
TORCHRUN = ("torchrun",)
"""The launcher of emitted scripts (the ``torchrun`` on the user's PATH)."""


def python_torchrun() -> tuple:
    """The launcher of runs started from this process: this Python's torch.distributed.run."""
    return (sys.executable, "-m", "torch.distributed.run")


class Raw(str):
    """A shell word written as is (not quoted): only for constants of the emitter."""


def quote(arg) -> str:
    return str(arg) if isinstance(arg, Raw) else shlex.quote(str(arg))


def join(args) -> str:
    """A shell command line: every argument quoted, :class:`Raw` ones as they are."""
    return " ".join(quote(a) for a in args)


def comment(text: str) -> str:
    """``text`` made safe for the rest of a ``#`` comment line: control characters (newlines
    included) shown as escapes, so nothing after them can become a command."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def torchrun_argv(target, nproc: int, nnodes: int = 1, node_rank: int = 0, master_addr=None,
                  master_port: int | None = None, launcher=TORCHRUN) -> list:
    """The torchrun command that starts ``nproc`` processes of ``target`` (``["-m", "mod", ...]``
    or ``["script.py", ...]``) on this host.

    With ``master_addr`` (or several hosts): the static rendezvous at ``master_addr``:``master_port``
    with this host's ``node_rank``. One host without it: ``--standalone`` when ``master_port`` is
    None, else a local c10d rendezvous on that port. ``master_addr`` may be a :class:`Raw` shell
    word (``'"$MASTER_ADDR"'``) in emitted scripts."""
    for name, v, lo in (("nproc", nproc, 1), ("nnodes", nnodes, 1), ("node_rank", node_rank, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise UserError(f"torchrun: {name}={v!r} must be an integer >= {lo}")
    if node_rank >= nnodes:
        raise UserError(f"torchrun: node_rank={node_rank} must be in 0..{nnodes - 1}")
    if master_port is not None and (isinstance(master_port, bool) or not isinstance(master_port, int)
                                    or not 1 <= master_port <= 65535):
        raise UserError(f"torchrun: master port {master_port!r}: expected a TCP port, 1 to 65535")
    args = [*launcher]
    if master_addr is None and nnodes == 1:
        args += (["--standalone"] if master_port is None else
                 ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{master_port}"])
        args.append(f"--nproc-per-node={nproc}")
    else:
        if master_addr is None or master_port is None:
            raise UserError(f"torchrun: {nnodes} hosts need a master address and port (the static rendezvous)")
        addr = Raw(f"--master-addr={master_addr}") if isinstance(master_addr, Raw) else f"--master-addr={master_addr}"
        args += [f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--node-rank={node_rank}",
                 "--rdzv-backend=static", addr, f"--master-port={master_port}"]
    return args + list(target)


# -- hosts, ranks and devices of a launch -------------------------------------------------------------

