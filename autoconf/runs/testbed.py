"""testbed: N emulated nodes with shaped links on one Linux machine (root; ``ip`` and ``tc``).

Each node is a network namespace with one NIC, ``tb0``, the end of a veth pair whose other end is
a port of a bridge living in a namespace of its own; nothing is added to the machine's own
network namespace. Node K gets the address ``10.200.0.<K+1>/24`` (the private range is
configurable) and the host name ``node-K`` (a UTS namespace per command, and an ``/etc/hosts`` of
the testbed's names through ``ip netns exec``'s ``/etc/netns/<namespace>/hosts``), so what runs in
a node sees its own host name and reaches the others by name or address.

Every node's NIC is rate-limited with ``tc`` token-bucket filters (``tbf``) in both directions: on
the node's ``tb0`` (what it sends) and on its bridge port (what it receives), so a transfer
between nodes A and B runs at min(rate A, rate B). With fabrics (``--fabrics ib,eth,ib,eth
--between 100mbit``) each direction is an ``htb`` instead, whose second class carries the traffic
to and from nodes of another fabric at the rate between them: two kinds of NIC, each fast among
its own, slow across (Holmes's clusters). Ranks of one node talk over the namespace's
loopback, unshaped: fast inside a node, slow between nodes. There is no delay or loss emulation
(netem is not available on every kernel; this module does not use it).

Use from Python::

    with Testbed(["10gbit", "1gbit"]) as tb:          # two nodes, each its own NIC speed
        tb.run(1, ["hostname"])                        # a command inside node 1
        codes = tb.launch(["torchrun", "--nnodes", "{nnodes}", "--node-rank", "{node_rank}",
                           "--master-addr", "{master_addr}", "--master-port", "{master_port}",
                           "--nproc-per-node", "2", "-m", "autoconf.trainer", "--config", "c.json",
                           "--out", "results"])        # one process tree per node, all at once

or from the command line (one command per node; ``{node_rank}``, ``{nnodes}``, ``{master_addr}``,
``{master_port}``, ``{nproc_per_node}`` and ``{host}`` in it are replaced per node)::

    autoconf testbed --rates 200mbit,200mbit --nproc-per-node 2 -- autoconf profile --model tiny --quick
    autoconf testbed --rates 10gbit,1gbit --nproc-per-node 2 --cluster-out tb.yaml   # the cluster file only
    autoconf testbed --rates 10gbit,1gbit --nproc-per-node 2 -- bash plan/node-{node_rank}.sh

Every process started in node K also gets ``GLOO_SOCKET_IFNAME=tb0`` (gloo binds to the node's
NIC, not to whatever the host name resolves to), ``MASTER_ADDR`` / ``MASTER_PORT`` (node 0's
address and the rendezvous port, which emitted ``node-K.sh`` scripts read), ``OMP_NUM_THREADS=1``
unless set, and ``AUTOCONF_NNODES``, ``AUTOCONF_NODE_RANK``, ``AUTOCONF_MASTER_ADDR``,
``AUTOCONF_MASTER_PORT``, ``AUTOCONF_NPROC_PER_NODE``, which ``autoconf profile`` takes as the
defaults of its ``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port`` and
``--nproc-per-node``. Multi-node torchrun uses the static rendezvous (``--nnodes N --node-rank K
--master-addr A --master-port P``): the agent of node K is group rank K and its workers get the
global ranks after those of nodes 0..K-1 (torch's agent assigns each node's base rank as the sum of
the local world sizes of the nodes before it), so rank order follows node order.

Clean-up: the context manager kills every process it started, deletes its namespaces (which
removes the veths and the bridge) and its ``/etc/netns`` entries, on a normal exit, an exception,
Ctrl-C, SIGTERM / SIGHUP (turned into an exception while a testbed is open) and at interpreter exit.
Namespace names carry a unique prefix (``actb<pid>x<random>``), so testbeds run in parallel never
collide; a testbed whose owner was SIGKILLed is removed by ``autoconf testbed --cleanup`` (only
those whose owning process is gone). Without root, or without ``ip``, ``tc`` or ``unshare``, it
refuses in one line (exit code 2 from the CLI).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

from autoconf.errors import UserError
from autoconf.procs import ProcessTree, Terminated, deferred_signals
from autoconf.runs.testbed_plan import (
    DEFAULT_PORT,
    DEFAULT_SUBNET,
    NETNS_ETC,
    PREFIX_RE,
    TOOLS,
    Node,
    bridge_namespace,
    exec_argv,
    hosts_file,
    new_prefix,
    node_env,
    plan_nodes,
    setup_commands,
    substitute,
    torchrun_argv,
)


class TestbedUnavailable(UserError):
    """This machine cannot host a testbed (not root, or ip / tc / unshare missing)."""


# -- pure parts: rates, the address plan, the commands ---------------------------------------------


# -- the machine ------------------------------------------------------------------------------------

def _which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin:/usr/bin:/bin")


def check_host() -> dict:
    """The tools' paths; :class:`TestbedUnavailable` (one line) when not root or one is missing."""
    if not sys.platform.startswith("linux"):
        raise TestbedUnavailable(f"the testbed needs Linux network namespaces; this is {sys.platform}")
    if os.geteuid() != 0:
        raise TestbedUnavailable("the testbed needs root (it creates network namespaces and tc qdiscs); "
                                 f"running as uid {os.geteuid()}")
    paths = {t: _which(t) for t in TOOLS}
    missing = [t for t, p in paths.items() if p is None]
    if missing:
        raise TestbedUnavailable(f"the testbed needs {', '.join(missing)} (iproute2 for ip and tc, util-linux "
                                 "for unshare), not found on PATH or in /usr/sbin, /sbin")
    return paths


def unavailable_reason(probe: bool = False) -> str | None:
    """Why no testbed can be made here (tests skip with it), or None. ``probe``: also create and
    delete a namespace with a tbf qdisc (a container may lack the right, a kernel the qdisc)."""
    try:
        paths = check_host()
    except TestbedUnavailable as e:
        return str(e)
    if not probe:
        return None
    ns = bridge_namespace(new_prefix())
    steps = [[paths["ip"], "netns", "add", ns],
             [paths["ip"], "-n", ns, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"],
             [paths["tc"], "-n", ns, "qdisc", "add", "dev", "probe0", "root", "tbf", "rate", "100mbit",
              "burst", "65536", "limit", "100000"],
             [paths["ip"], "netns", "exec", ns, paths["unshare"], "--uts", "--", "hostname", "probe"]]
    try:
        for cmd in steps:
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                return f"`{' '.join(cmd[1:])}` failed here: {' '.join(p.stderr.split())[:200]}"
    finally:
        subprocess.run([paths["ip"], "netns", "delete", ns], capture_output=True)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces(ip: str = "ip") -> list[str]:
    p = subprocess.run([ip, "netns", "list"], capture_output=True, text=True)
    return [ln.split()[0] for ln in p.stdout.splitlines() if ln.strip()]


def _owner(namespace: str) -> tuple[str, int] | None:
    """(prefix, owner pid) of a testbed namespace name, else None."""
    for suffix in ("br",):
        if namespace.endswith(suffix) and PREFIX_RE.match(namespace[:-len(suffix)]):
            p = namespace[:-len(suffix)]
            return p, int(PREFIX_RE.match(p).group(1))
    m = re.match(r"^(actb\d+x[0-9a-f]{4})n\d+$", namespace)
    if m:
        return m.group(1), int(PREFIX_RE.match(m.group(1)).group(1))
    return None


def cleanup_stale() -> list[str]:
    """Delete the namespaces (and /etc/netns entries) of testbeds whose owning process is gone;
    returns the names removed. Testbeds of live processes are left alone."""
    paths = check_host()
    removed = []
    for ns in _namespaces(paths["ip"]):
        own = _owner(ns)
        if own is None or _pid_alive(own[1]):
            continue
        subprocess.run([paths["ip"], "netns", "delete", ns], capture_output=True)
        shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
        removed.append(ns)
    return removed


def _kill_namespace_pids(ip: str, ns: str) -> None:
    """SIGKILL every process still in network namespace ``ns`` (``ip netns pids``)."""
    got = subprocess.run([ip, "netns", "pids", ns], capture_output=True, text=True)
    for tok in got.stdout.split():
        if tok.isdigit():
            with contextlib.suppress(OSError):
                os.kill(int(tok), signal.SIGKILL)


_open: set = set()
_atexit_registered = False


def _close_all() -> None:
    for tb in list(_open):
        tb.close()


class Testbed:
    """N emulated nodes; a context manager that builds them on entry and removes them on exit.

    ``nodes``: one NIC rate per node ("200mbit", "10gbit", or bits per second as a number).
    ``fabrics`` and ``between``: the network of each node's NIC and the rate between nodes of
    different ones (``testbed_plan.plan_nodes``: two kinds of NIC, fast inside each kind).
    ``nproc_per_node``: what :meth:`launch` tells the processes (``{nproc_per_node}``,
    ``AUTOCONF_NPROC_PER_NODE``). ``master_port``: the rendezvous port on node 0.
    """

    def __init__(self, nodes: list, *, nproc_per_node: int | None = None, master_port: int = DEFAULT_PORT,
                 subnet: str = DEFAULT_SUBNET, prefix: str | None = None, fabrics: list | None = None,
                 between=None):
        if not (isinstance(master_port, int) and 1 <= master_port <= 65535):
            raise UserError(f"master port {master_port!r}: expected a TCP port, 1 to 65535")
        self.prefix = prefix or new_prefix()
        self.nodes = plan_nodes(list(nodes), self.prefix, subnet, fabrics=fabrics, between=between)
        self.nproc_per_node = nproc_per_node
        self.master_port = master_port
        self._made: list[str] = []    # namespaces created, in order
        self._etc: list[str] = []     # /etc/netns/<ns> directories created
        self._etc_root_made = False   # /etc/netns itself did not exist before
        self._trees: list = []
        self._old_handlers: dict = {}
        self._lock = threading.Lock()
        self.paths: dict = {}

    @property
    def master_addr(self) -> str:
        return self.nodes[0].address

    @property
    def bridge_namespace(self) -> str:
        return bridge_namespace(self.prefix)

    # -- life cycle --
    def __enter__(self) -> "Testbed":
        self.start()
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def start(self) -> None:
        """Build the namespaces, links and qdiscs (on any failure: remove what was made, raise)."""
        global _atexit_registered
        self.paths = check_host()
        if not _atexit_registered:
            atexit.register(_close_all)
            _atexit_registered = True
        _open.add(self)
        self._hold_terminate()
        try:
            for cmd in setup_commands(self.nodes, self.prefix):
                with deferred_signals():  # a namespace created is recorded before a signal acts
                    self._run_setup(cmd)
            self._etc_root_made = not os.path.isdir(NETNS_ETC)
            for n in self.nodes:
                d = os.path.join(NETNS_ETC, n.namespace)
                self._etc.append(d)  # recorded first: removed even if writing it is cut short
                os.makedirs(d, exist_ok=True)
                with open(os.path.join(d, "hosts"), "w") as f:
                    f.write(hosts_file(self.nodes))
        except BaseException:
            self.close()
            raise

    def _run_setup(self, cmd: list[str]) -> None:
        argv = [self.paths.get(cmd[0], cmd[0]), *cmd[1:]]
        p = subprocess.run(argv, capture_output=True, text=True)
        if cmd[:3] == ["ip", "netns", "add"] and p.returncode == 0:
            self._made.append(cmd[3])
        if p.returncode != 0:
            why = " ".join((p.stderr or p.stdout or f"exit code {p.returncode}").split())[:300]
            hint = (" (the kernel has no tbf qdisc)" if cmd[0] == "tc" and "No such file" in why else "")
            raise UserError(f"testbed set-up failed at `{' '.join(cmd)}`: {why}{hint}")

    def close(self) -> None:
        """Kill what was started in the nodes, delete the namespaces and /etc/netns entries.
        Idempotent; signals are held back while it runs."""

        with self._lock, deferred_signals():
            for tree in self._trees:
                tree.kill(grace_s=1.0)
            self._trees.clear()
            ip = self.paths.get("ip", "ip")
            for ns in self._made:  # what others started there (a --driver command's trials): killed too
                _kill_namespace_pids(ip, ns)
            for ns in reversed(self._made):  # nodes first (their veths go with them), the bridge last
                subprocess.run([ip, "netns", "delete", ns], capture_output=True)
            self._made.clear()
            for d in self._etc:
                shutil.rmtree(d, ignore_errors=True)
            if self._etc and self._etc_root_made:
                with contextlib.suppress(OSError):
                    os.rmdir(NETNS_ETC)  # ours, and only once no other testbed uses it
            self._etc.clear()
            _open.discard(self)
            self._restore_terminate()

    def _hold_terminate(self) -> None:
        """SIGTERM / SIGHUP become :class:`autoconf.procs.Terminated` while the testbed is open
        (where nothing else handles them), so ``with`` blocks clean up for them too."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            raise Terminated(signum)
        for s in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(s) in (signal.SIG_DFL, None):
                self._old_handlers[s] = signal.signal(s, handler)

    def _restore_terminate(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s, h in self._old_handlers.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        self._old_handlers.clear()

    # -- running things --
    def env(self, k: int, base: dict | None = None) -> dict:
        return node_env(self.nodes, k, self.master_port, self.nproc_per_node, base)

    def argv(self, k: int, argv: list[str]) -> list[str]:
        """``argv`` (placeholders substituted) as run inside node ``k``."""
        self._check_node(k)
        argv = substitute(list(argv), self.nodes, k, self.master_port, self.nproc_per_node)
        full = exec_argv(self.nodes[k], argv)
        return [self.paths.get(full[0], full[0]), *full[1:]]

    def _check_node(self, k: int) -> None:
        if not (isinstance(k, int) and 0 <= k < len(self.nodes)):
            raise UserError(f"node {k!r}: expected 0 to {len(self.nodes) - 1}")
        if not self._made:
            raise UserError("the testbed is not started (use it as a context manager)")

    def run(self, k: int, argv: list[str], env: dict | None = None, timeout: float | None = None,
            **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` in node ``k`` to completion (output captured as text unless ``kw`` says
        otherwise)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.argv(k, argv), env=self.env(k, env), timeout=timeout, **kw)

    def popen(self, k: int, argv: list[str], env: dict | None = None, **kw):
        """Start ``argv`` in node ``k`` as a :class:`autoconf.procs.ProcessTree` (killed with the
        testbed at the latest)."""

        tree = ProcessTree(self.argv(k, argv), env=self.env(k, env), **kw)
        self._trees.append(tree)
        return tree

    def launch(self, argv, env: dict | None = None, timeout: float | None = None, cwd=None,
               output=None, private_tmp: bool = False) -> list[int]:
        """Run one command per node, all at once, and wait for all; returns the exit codes.

        ``argv``: a list (the same command in every node, placeholders substituted per node) or a
        function node index -> list. When a node fails, the others are killed (they would wait for
        it at their next collective until a timeout). ``timeout``: seconds for the whole; on expiry
        every node is killed and its code is 124. ``output``: a writable text stream receiving
        every line prefixed with ``[node-K]`` (default: inherit this process's stdout/stderr).
        ``private_tmp``: each node's command gets a temporary directory of its own, removed with it
        (``procs.ProcessTree``; :meth:`torchrun`: torchrun's ``torchelastic_*`` directory).
        """
        make = argv if callable(argv) else (lambda k: list(argv))
        trees, readers = [], []
        for k in range(len(self.nodes)):
            if output is None:
                trees.append(self.popen(k, make(k), env=env, cwd=cwd, private_tmp=private_tmp))
                continue
            tree = self.popen(k, make(k), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              private_tmp=private_tmp)
            trees.append(tree)
            t = threading.Thread(target=_pump, args=(tree.proc.stdout, f"[{self.nodes[k].host}] ", output),
                                 daemon=True)
            t.start()
            readers.append(t)
        codes: list = [None] * len(trees)
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(c is None for c in codes):
            for k, tree in enumerate(trees):
                if codes[k] is None:
                    codes[k] = tree.proc.poll()
            if any(c not in (None, 0) for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.05)
        failed = any(c not in (None, 0) for c in codes)
        if failed:  # give the others a moment to finish on their own (a clean error on each)
            grace = time.monotonic() + 2.0
            while any(c is None for c in codes) and time.monotonic() < grace:
                time.sleep(0.05)
                codes = [c if c is not None else t.proc.poll() for c, t in zip(codes, trees)]
        for k, tree in enumerate(trees):
            if codes[k] is None:  # still running: killed (-9 after another node failed, 124 on timeout)
                tree.kill(grace_s=1.0)
                codes[k] = -9 if failed else 124
        for t in readers:
            t.join(timeout=5)
        return [int(c) for c in codes]

    def torchrun(self, script: list[str], nproc_per_node: int | None = None, **kw) -> list[int]:
        """One torchrun per node (static rendezvous), all at once; see :meth:`launch`."""
        n = nproc_per_node or self.nproc_per_node
        if not n:
            raise UserError("nproc_per_node: give it to Testbed() or torchrun()")
        kw.setdefault("private_tmp", True)
        return self.launch(lambda k: torchrun_argv(self.nodes, k, n, self.master_port, script), **kw)


def _pump(stream, prefix: str, out) -> None:
    with contextlib.suppress(ValueError, OSError):
        for line in iter(stream.readline, b""):
            out.write(prefix + line.decode(errors="replace"))
            out.flush()


# -- a driver inside the testbed ---------------------------------------------------------------------

ATTACH_ENV = "AUTOCONF_TESTBED"
"""Set by ``autoconf testbed --driver`` for the one command it runs: the testbed's nodes, as JSON,
so that what that command launches (``autoconf search --verify``'s trials) runs across them."""


def describe(nodes: list[Node], master_port: int, nproc_per_node: int) -> str:
    import json
    return json.dumps({"nodes": [dataclasses.asdict(n) for n in nodes], "master_port": master_port,
                       "nproc_per_node": nproc_per_node})


def attached() -> dict | None:
    """The testbed this process runs under as a driver (``--driver``), or None."""
    import json
    text = os.environ.get(ATTACH_ENV)
    if not text:
        return None
    try:
        d = json.loads(text)
        return {"nodes": [Node(**n) for n in d["nodes"]], "master_port": int(d["master_port"]),
                "nproc_per_node": int(d["nproc_per_node"])}
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{ATTACH_ENV} is not a testbed description ({e}); unset it, or run under "
                        "`autoconf testbed --driver`") from None


def node_commands(tb: dict, counts: list[int], script: list[str], base_env: dict) -> list[tuple[list, dict]]:
    """(argv, env) per node to run ``script`` (``["-m", "mod", ...]``) under torchrun across the
    attached testbed ``tb``: ``counts[k]`` processes in node k (the plan's hosts in order: the
    testbed's cluster file lists its nodes so), each node's ranks after those of the nodes before."""
    nodes = tb["nodes"]
    if len(counts) > len(nodes) or any(not 1 <= n <= tb["nproc_per_node"] for n in counts):
        raise UserError(f"the plan puts {'+'.join(map(str, counts))} processes on {len(counts)} host(s); the testbed "
                        f"has {len(nodes)} node(s) of {tb['nproc_per_node']}: search with its cluster file "
                        "(autoconf testbed --cluster-out)")
    used = nodes[:len(counts)]
    ip = check_host()["ip"]
    out = []
    for n, k in zip(used, counts):
        argv = exec_argv(n, [*torchrun_argv(used, n.index, k, tb["master_port"], script)])
        out.append(([ip, *argv[1:]], node_env(used, n.index, tb["master_port"], k, base_env)))
    return out


# -- command line -----------------------------------------------------------------------------------

