"""testbed: N emulated nodes with shaped links on one Linux machine (root; ``ip`` and ``tc``).

Each node is a network namespace with one NIC, ``tb0``, the end of a veth pair whose other end is
a port of a bridge living in a namespace of its own; nothing is added to the machine's own
network namespace. Node K gets the address ``10.200.0.<K+1>/24`` (the private range is
configurable) and the host name ``node-K`` (a UTS namespace per command, and an ``/etc/hosts`` of
the testbed's names through ``ip netns exec``'s ``/etc/netns/<namespace>/hosts``), so what runs in
a node sees its own host name and reaches the others by name or address.

Every node's NIC is rate-limited with ``tc`` token-bucket filters (``tbf``) in both directions: on
the node's ``tb0`` (what it sends) and on its bridge port (what it receives), so a transfer
between nodes A and B runs at min(rate A, rate B). Ranks of one node talk over the namespace's
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

import argparse
import atexit
import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import dataclasses
from dataclasses import dataclass

from .errors import UserError

IFACE = "tb0"
"""The NIC's name inside every node (names are per namespace)."""
BRIDGE = "br0"
DEFAULT_SUBNET = "10.200.0"
DEFAULT_PORT = 29540
MAX_NODES = 64
MIN_RATE_BIT_S, MAX_RATE_BIT_S = 1e6, 100e9
NETNS_ETC = "/etc/netns"
PREFIX_RE = re.compile(r"^actb(\d+)x[0-9a-f]{4}$")
TOOLS = ("ip", "tc", "unshare")
PLACEHOLDERS = ("node_rank", "nnodes", "master_addr", "master_port", "nproc_per_node", "host")


class TestbedUnavailable(UserError):
    """This machine cannot host a testbed (not root, or ip / tc / unshare missing)."""


# -- pure parts: rates, the address plan, the commands ---------------------------------------------

_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(bit|Bit)(?:/s)?\s*$")
_RATE_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float:
    """A NIC rate in bits per second, from tc's spelling ("200mbit", "10gbit") or the cluster
    files' ("1 Gbit/s"); bytes per second ("mbps" means megabytes to tc) are refused as ambiguous."""
    m = _RATE_RE.match(str(text))
    if not m:
        raise UserError(f"rate {text!r}: expected bits per second, e.g. 200mbit, 10gbit or '1 Gbit/s'")
    v = float(m.group(1)) * _RATE_PREFIX[m.group(2).lower()]
    if not MIN_RATE_BIT_S <= v <= MAX_RATE_BIT_S:
        raise UserError(f"rate {text!r}: expected 1mbit to 100gbit")
    return v


def fmt_rate(bit_s: float) -> str:
    """'200 Mbit/s', '10 Gbit/s' (the cluster files' spelling)."""
    for div, unit in ((1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bit_s >= div:
            return f"{bit_s / div:g} {unit}"
    return f"{bit_s:g} bit/s"


def tbf_params(bit_s: float) -> tuple[int, int]:
    """(burst, limit) in bytes for a token bucket at ``bit_s``.

    The bucket holds 1.25 ms of traffic, at least 16 KiB: the qdisc's timer wakes about once a
    millisecond under load, so a smaller bucket cannot reach the rate (measured here: a 16 KiB
    bucket passed 1 gbit at about half its rate, 128 KiB at 95%). Messages that fit in the bucket
    pass at loopback speed; larger ones at the rate. The queue holds 50 ms of traffic on top
    (TCP fills it rather than dropping; a drop costs a retransmit). tbf splits GSO packets
    larger than the bucket into frames."""
    rate_b = bit_s / 8
    burst = max(16 << 10, int(rate_b * 0.00125))
    return burst, burst + int(rate_b * 0.05)


@dataclass(frozen=True)
class Node:
    index: int
    host: str
    """Host name inside the node."""
    namespace: str
    address: str
    """IPv4 address of its NIC (no prefix length)."""
    rate_bit_s: float
    """NIC rate, each direction."""
    port: str
    """Its bridge port (in the bridge's namespace)."""


def new_prefix() -> str:
    """A namespace-name prefix unique to this process and call: actb<pid>x<4 hex>."""
    return f"actb{os.getpid()}x{secrets.token_hex(2)}"


def check_subnet(subnet: str) -> str:
    """'10.200.0' style: the first three octets of a /24 in a private range."""
    parts = subnet.split(".")
    ok = len(parts) == 3 and all(p.isdigit() and 0 <= int(p) <= 255 and str(int(p)) == p for p in parts)
    if ok:
        a, b = int(parts[0]), int(parts[1])
        ok = a == 10 or (a == 172 and 16 <= b <= 31) or (a == 192 and b == 168)
    if not ok:
        raise UserError(f"subnet {subnet!r}: expected the first three octets of a private /24, e.g. 10.200.0")
    return subnet


def plan_nodes(rates: list, prefix: str, subnet: str = DEFAULT_SUBNET, host_prefix: str = "node-") -> list[Node]:
    """The nodes: namespace ``<prefix>n<K>``, host ``node-K``, address ``<subnet>.<K+1>``."""
    if not 1 <= len(rates) <= MAX_NODES:
        raise UserError(f"{len(rates)} nodes: expected 1 to {MAX_NODES}")
    check_subnet(subnet)
    bits = [r if isinstance(r, (int, float)) and not isinstance(r, bool) else parse_rate(r) for r in rates]
    for r in bits:
        if not MIN_RATE_BIT_S <= r <= MAX_RATE_BIT_S:
            raise UserError(f"rate {r!r} bit/s: expected 1mbit to 100gbit")
    return [Node(index=k, host=f"{host_prefix}{k}", namespace=f"{prefix}n{k}", address=f"{subnet}.{k + 1}",
                 rate_bit_s=float(r), port=f"p{k}") for k, r in enumerate(bits)]


def bridge_namespace(prefix: str) -> str:
    return f"{prefix}br"


def setup_commands(nodes: list[Node], prefix: str) -> list[list[str]]:
    """The ip / tc commands that build the testbed, in order (each node's namespace is created
    before anything is put in it)."""
    br = bridge_namespace(prefix)
    cmds = [["ip", "netns", "add", br],
            ["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge"],
            ["ip", "-n", br, "link", "set", BRIDGE, "up"]]
    for n in nodes:
        burst, limit = tbf_params(n.rate_bit_s)
        tbf = ["root", "tbf", "rate", f"{int(n.rate_bit_s)}bit", "burst", str(burst), "limit", str(limit)]
        cmds += [["ip", "netns", "add", n.namespace],
                 ["ip", "-n", br, "link", "add", n.port, "type", "veth", "peer", "name", IFACE, "netns", n.namespace],
                 ["ip", "-n", br, "link", "set", n.port, "master", BRIDGE],
                 ["ip", "-n", br, "link", "set", n.port, "up"],
                 ["ip", "-n", n.namespace, "link", "set", "lo", "up"],
                 ["ip", "-n", n.namespace, "addr", "add", f"{n.address}/24", "dev", IFACE],
                 ["ip", "-n", n.namespace, "link", "set", IFACE, "up"],
                 ["tc", "-n", n.namespace, "qdisc", "add", "dev", IFACE, *tbf],   # what the node sends
                 ["tc", "-n", br, "qdisc", "add", "dev", n.port, *tbf]]           # what it receives
    return cmds


def hosts_file(nodes: list[Node]) -> str:
    """The /etc/hosts a process in a node sees: localhost and every node's name."""
    lines = ["127.0.0.1 localhost", "::1 localhost"]
    lines += [f"{n.address} {n.host}" for n in nodes]
    lines += [f"::ffff:{n.address} {n.host}" for n in nodes]  # peers seen on a dual-stack socket
    return "\n".join(lines) + "\n"


def node_env(nodes: list[Node], k: int, master_port: int, nproc_per_node: int | None,
             base: dict | None = None) -> dict:
    """The environment of a process started in node ``k`` (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    master = nodes[0].address
    env.update(GLOO_SOCKET_IFNAME=IFACE, TP_SOCKET_IFNAME=IFACE, MASTER_ADDR=master, MASTER_PORT=str(master_port),
               AUTOCONF_NNODES=str(len(nodes)), AUTOCONF_NODE_RANK=str(k), AUTOCONF_MASTER_ADDR=master,
               AUTOCONF_MASTER_PORT=str(master_port), AUTOCONF_TESTBED_HOST=nodes[k].host)
    env.setdefault("OMP_NUM_THREADS", "1")
    if nproc_per_node:
        env["AUTOCONF_NPROC_PER_NODE"] = str(nproc_per_node)
    return env


def substitute(argv: list[str], nodes: list[Node], k: int, master_port: int, nproc_per_node: int | None) -> list[str]:
    """``{node_rank}`` etc. replaced by node ``k``'s values (other braces are left alone)."""
    values = {"node_rank": str(k), "nnodes": str(len(nodes)), "master_addr": nodes[0].address,
              "master_port": str(master_port), "nproc_per_node": str(nproc_per_node or ""), "host": nodes[k].host}
    out = []
    for a in argv:
        for name, v in values.items():
            a = a.replace("{" + name + "}", v)
        out.append(a)
    return out


def exec_argv(node: Node, argv: list[str]) -> list[str]:
    """``argv`` run inside ``node``: its network namespace, a UTS namespace with its host name."""
    if not argv:
        raise UserError("no command to run in the node")
    return ["ip", "netns", "exec", node.namespace, "unshare", "--uts", "--", "sh", "-c",
            'hostname "$0" && exec "$@"', node.host, *argv]


def torchrun_argv(nodes: list[Node], k: int, nproc_per_node: int, master_port: int, script: list[str],
                  python: str | None = None) -> list[str]:
    """One node's torchrun with the static rendezvous: node ``k`` is group rank ``k`` and its
    workers take the global ranks after those of nodes 0..k-1. ``script``: ``["-m", "mod", ...]``
    or ``["file.py", ...]``."""
    from .launch import python_torchrun, torchrun_argv as argv

    launcher = python_torchrun() if python is None else (python, "-m", "torch.distributed.run")
    return argv(script, nproc_per_node, len(nodes), k, nodes[0].address, master_port, launcher=launcher)


def cluster_yaml(nodes: list[Node], nproc_per_node: int, name: str | None = None,
                 memory_gib: float | None = None) -> str:
    """A cluster file (``autoconf search --cluster``) describing the testbed: CPU processes, one
    node group per run of consecutive nodes of equal rate, the nodes' host names and NIC rates."""
    if memory_gib is None:
        memory_gib = default_memory_gib(len(nodes) * nproc_per_node)
    name = name or f"testbed-{len(nodes)}x{nproc_per_node}"
    groups: list[list[Node]] = []
    for n in nodes:
        if groups and groups[-1][0].rate_bit_s == n.rate_bit_s:
            groups[-1].append(n)
        else:
            groups.append([n])
    out = [f"# autoconf testbed: {len(nodes)} emulated nodes (network namespaces on one machine), "
           f"{nproc_per_node} CPU processes each (gloo).",
           "# NIC rates are tc token-bucket limits, each direction; inside a node the ranks use the namespace's",
           "# loopback, unshaped (the figure below is gloo on loopback on a 2-core machine: `autoconf profile`",
           "# across the testbed measures the real ones). Each process gets a share of this machine's memory.",
           f"name: {name}", "node_groups:"]
    for g in groups:
        out += [f"  - count: {len(g)}", "    device: cpu", f"    gpus_per_node: {nproc_per_node}",
                "    intra_node_bandwidth: 4.5 GB/s", f"    memory: {memory_gib:g} GiB",
                f"    nics: {{count: 1, bandwidth: {fmt_rate(g[0].rate_bit_s)}, kind: ethernet}}",
                f"    hosts: [{', '.join(n.host for n in g)}]"]
    out.append("latency: {intra_node: 80 us, inter_node: 200 us}")
    return "\n".join(out) + "\n"


def default_memory_gib(processes: int) -> float:
    """4 GiB per process, or this machine's memory shared out if that is less (in 0.5 GiB steps)."""
    total = 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = float(line.split()[1]) * 1024
    if total <= 0:
        return 4.0
    share = total / 2**30 / max(1, processes)
    return max(0.5, min(4.0, int(share * 2) / 2))


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
    ``nproc_per_node``: what :meth:`launch` tells the processes (``{nproc_per_node}``,
    ``AUTOCONF_NPROC_PER_NODE``). ``master_port``: the rendezvous port on node 0.
    """

    def __init__(self, nodes: list, *, nproc_per_node: int | None = None, master_port: int = DEFAULT_PORT,
                 subnet: str = DEFAULT_SUBNET, prefix: str | None = None):
        if not (isinstance(master_port, int) and 1 <= master_port <= 65535):
            raise UserError(f"master port {master_port!r}: expected a TCP port, 1 to 65535")
        self.prefix = prefix or new_prefix()
        self.nodes = plan_nodes(list(nodes), self.prefix, subnet)
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
            from .procs import deferred_signals
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
        from .procs import deferred_signals

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
        from .procs import Terminated

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
        from .procs import ProcessTree

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

def add_testbed_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "testbed", help="emulated nodes with shaped links on this machine (root): run a command on each",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (default: one per --rates entry)")
    p.add_argument("--rates", default=None,
                   help="NIC rate per node, comma-separated (200mbit, 10gbit, '1 Gbit/s'); one rate applies to all")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes per node: {nproc_per_node} and AUTOCONF_NPROC_PER_NODE, and the cluster file's "
                   "devices per node (default 2)")
    p.add_argument("--master-port", type=int, default=DEFAULT_PORT,
                   help=f"rendezvous port on node 0 (default {DEFAULT_PORT})")
    p.add_argument("--subnet", default=DEFAULT_SUBNET, help=f"private /24 for the nodes (default {DEFAULT_SUBNET})")
    p.add_argument("--cluster-out", metavar="FILE", help="write a cluster file describing the testbed")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="kill every node's command after S s")
    p.add_argument("--print-commands", action="store_true", help="print the ip / tc commands and exit")
    p.add_argument("--driver", action="store_true",
                   help="run COMMAND once, here, instead of in every node; what it launches across nodes (the "
                   "trials of `autoconf search --verify`) runs in the testbed's nodes")
    p.add_argument("--cleanup", action="store_true",
                   help="remove testbeds left behind by a killed owner (those whose process is gone) and exit")
    p.add_argument("node_command", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="after --: the command to run in every node ({node_rank}, {nnodes}, {master_addr}, "
                   "{master_port}, {nproc_per_node}, {host} are replaced per node)")
    return p


def _rates(args) -> list[str]:
    if not args.rates:
        raise UserError("--rates: give each node's NIC rate, e.g. --rates 10gbit,1gbit")
    rates = [r.strip() for r in args.rates.split(",")]
    for r in rates:
        parse_rate(r)
    n = args.nodes
    if n is not None and not 1 <= n <= MAX_NODES:
        raise UserError(f"--nodes {n}: expected 1 to {MAX_NODES}")
    if n is None:
        n = len(rates)
    if len(rates) == 1:
        rates = rates * n
    if len(rates) != n:
        raise UserError(f"--rates has {len(rates)} entries but --nodes is {n}: give one rate, or one per node")
    return rates


def cmd_testbed(args) -> int:
    from .outputs import check_file, write_text

    if args.cleanup:
        removed = cleanup_stale()
        print(f"removed {len(removed)} namespace(s) of testbeds whose owner is gone"
              + (f": {', '.join(removed)}" if removed else ""))
        return 0
    rates = _rates(args)
    nproc = args.nproc_per_node
    if nproc is not None and not 1 <= nproc <= 1024:
        raise UserError(f"--nproc-per-node {nproc}: expected 1 to 1024")
    if not 1 <= args.master_port <= 65535:
        raise UserError(f"--master-port {args.master_port}: expected a TCP port, 1 to 65535")
    if args.timeout is not None and not args.timeout > 0:
        raise UserError(f"--timeout {args.timeout}: expected a positive number of seconds")
    command = list(args.node_command)
    if command[:1] == ["--"]:
        command = command[1:]
    prefix = new_prefix()
    nodes = plan_nodes(rates, prefix, args.subnet)
    if args.print_commands:
        for c in setup_commands(nodes, prefix):
            print(" ".join(c))
        return 0
    if args.cluster_out:
        check_file(args.cluster_out, "--cluster-out")
        try:
            write_text(args.cluster_out, cluster_yaml(nodes, nproc or 2))
        except OSError as e:
            raise UserError(f"--cluster-out {args.cluster_out!r}: cannot write ({e.strerror or e})") from None
        print(f"cluster file: {args.cluster_out}")
    if not command:
        if args.cluster_out:
            return 0
        raise UserError("give the command to run in every node after --, or --cluster-out FILE")
    if args.driver and command[:1] == ["autoconf"]:
        command = [sys.executable, "-m", "autoconf", *command[1:]]
    with Testbed(rates, nproc_per_node=nproc or 2, master_port=args.master_port, subnet=args.subnet,
                 prefix=prefix) as tb:
        for n in tb.nodes:
            sys.stderr.write(f"testbed: {n.host} = namespace {n.namespace}, {n.address} on {IFACE}, "
                             f"{fmt_rate(n.rate_bit_s)}\n")
        if args.driver:
            env = dict(os.environ, **{ATTACH_ENV: describe(tb.nodes, tb.master_port, tb.nproc_per_node)})
            try:
                codes = [subprocess.run(command, env=env, timeout=args.timeout).returncode]
            except subprocess.TimeoutExpired:
                codes = [124]
        else:
            codes = tb.launch(command, timeout=args.timeout, output=sys.stdout)
    bad = [(k, c) for k, c in enumerate(codes) if c != 0]
    if bad:
        sys.stderr.write("testbed: " + ", ".join(("the command" if args.driver else f"node-{k}") + f" exited with {c}"
                                                 for k, c in bad) + "\n")
        return 124 if all(c == 124 for _, c in bad) else next((c for _, c in bad if c > 0), 1)
    return 0
