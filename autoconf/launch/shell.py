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

Quoting, by construction: every line of an emitted script that carries a value is built here.
:func:`join` (a command), :func:`assign` (``NAME=value``), :func:`default` (a value unless the
environment gives one) and :func:`array` (a bash array) quote every value (:func:`quote`:
``shlex.quote``, or bash's ``$'...'`` for control characters, so a value never spans lines)
except :class:`Raw` ones, which the emitters build from constants only (``"$MASTER_ADDR"``,
``"${MEGATRON_ARGS[@]}"``); no value from a model, cluster, path or user argument is ever Raw.
:func:`comment_line` writes any text as one ``#`` comment line (:func:`comment`: a newline would
end it). Lines sbatch reads itself (``#SBATCH``) are no shell, so nothing can be quoted there:
:func:`sbatch_line` writes only values that match a strict pattern whole, and a comment otherwise.
"""

from __future__ import annotations

import re
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
    """One shell word holding ``arg`` (a :class:`Raw` one as it is): ``shlex.quote`` where every
    character is printable, else bash's ``$'...'`` with the others as ``\\xHH`` bytes, so that no
    value spans lines of a script (its second line could read as a command or an ``#SBATCH`` line
    to whatever reads the file by lines). UserError for a NUL, which no shell word can hold."""
    if isinstance(arg, Raw):
        return str(arg)
    text = str(arg)
    if "\0" in text:
        raise UserError(f"{text!r:.80}: a NUL character cannot go into a shell script; give the value without it")
    return shlex.quote(text) if text.isprintable() else "$'" + "".join(map(_ansi_c, text)) + "'"


def _ansi_c(c: str) -> str:
    """One character inside bash's ``$'...'``: quote and backslash escaped, control characters as
    their UTF-8 bytes (a path's undecodable bytes, held as surrogates, as those bytes)."""
    if c in "\\'":
        return "\\" + c
    if c.isprintable():
        return c
    try:
        raw = c.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raw = c.encode("utf-8", "surrogatepass")
    return "".join(f"\\x{b:02x}" for b in raw)


def join(args) -> str:
    """A shell command line: every argument quoted, :class:`Raw` ones as they are."""
    return " ".join(quote(a) for a in args)


def comment(text: str) -> str:
    """``text`` made safe for the rest of a ``#`` comment line: control characters (newlines
    included) shown as escapes, so nothing after them can become a command."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def comment_line(text: str) -> str:
    """One ``#`` comment line holding ``text`` (:func:`comment`), without its line break."""
    return "# " + comment(text)


_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _var(name: str) -> str:
    if not isinstance(name, str) or not _VAR.fullmatch(name):
        raise ValueError(f"not a shell variable name: {name!r}")  # an emitter's constant, never user input
    return name


def assign(name: str, value, export: bool = False) -> str:
    """``NAME=value`` (``export NAME=value``), the value quoted (a :class:`Raw` one as it is)."""
    return ("export " if export else "") + f"{_var(name)}={quote(value)}"


def default(name: str, value) -> str:
    """``NAME=value`` unless the environment already sets ``NAME`` (to something non-empty)."""
    return f'if [ -z "${{{_var(name)}:-}}" ]; then {assign(name, value)}; fi'


def array(name: str, words: list) -> str:
    """A bash array assignment, one option (with its values) per line, every word quoted."""
    lines, cur = [], []
    for w in words:
        if isinstance(w, str) and w.startswith("--") and cur:
            lines.append(cur)
            cur = []
        cur.append(w)
    if cur:
        lines.append(cur)
    return f"{_var(name)}=(\n" + "".join("  " + join(ln) + "\n" for ln in lines) + ")\n"


_SBATCH_OPTION = re.compile(r"[a-z][a-z-]*")
_SBATCH_VALUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:,-]{0,4095}")
"""What an ``#SBATCH`` value may be: sbatch splits the line itself, with no shell quoting."""


def sbatch_line(option: str, value) -> str:
    """``#SBATCH --option=value``, written only where ``value`` matches :data:`_SBATCH_VALUE` whole
    (letters, digits, '.', '_', ':', ',', '-'); else a comment saying the line was left out."""
    text = str(value)
    if _SBATCH_OPTION.fullmatch(option) and _SBATCH_VALUE.fullmatch(text):
        return f"#SBATCH --{option}={text}"
    return comment_line(f"no #SBATCH --{option}: {text!r} is not a plain word for sbatch (letters, digits, "
                        "'.', '_', ':', ',', '-')")


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

