"""The testbed's pure parts: link rates, the address plan of the emulated nodes, and the
commands that build them and run torchrun inside them (nothing here touches the machine).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from dataclasses import dataclass

from autoconf.errors import UserError
from autoconf.launch.shell import python_torchrun
from autoconf.launch.shell import torchrun_argv as argv
from autoconf.specs.units import MAX_RATE_BIT_S, MIN_RATE_BIT_S, fmt_rate, parse_rate

IFACE = "tb0"
"""The NIC's name inside every node (names are per namespace)."""
BRIDGE = "br0"
DEFAULT_SUBNET = "10.200.0"
DEFAULT_PORT = 29540
MAX_NODES = 64
NETNS_ETC = "/etc/netns"
PREFIX_RE = re.compile(r"^actb(\d+)x[0-9a-f]{4}$")
TOOLS = ("ip", "tc", "unshare")
PLACEHOLDERS = ("node_rank", "nnodes", "master_addr", "master_port", "nproc_per_node", "host")



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
    fabric: str = ""
    """The network its NIC is on ("": the testbed has one). Between nodes of different fabrics
    traffic runs at ``cross_rate_bit_s``: fast inside each kind of NIC, slow between kinds."""
    cross_rate_bit_s: float = 0.0
    """Its rate to and from nodes of another fabric, each direction (at most its NIC's)."""


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


FABRIC_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


def _bits(r) -> float:
    bits = r if isinstance(r, (int, float)) and not isinstance(r, bool) else parse_rate(r)
    if not MIN_RATE_BIT_S <= bits <= MAX_RATE_BIT_S:
        raise UserError(f"rate {r!r} bit/s: expected 1mbit to 100gbit")
    return float(bits)


def plan_nodes(rates: list, prefix: str, subnet: str = DEFAULT_SUBNET, host_prefix: str = "node-",
               fabrics: list | None = None, between=None) -> list[Node]:
    """The nodes: namespace ``<prefix>n<K>``, host ``node-K``, address ``<subnet>.<K+1>``.
    ``fabrics``: the network of each node's NIC (e.g. ["ib", "eth", "ib", "eth"]), with
    ``between`` the rate between nodes of different fabrics; both or neither."""
    if not 1 <= len(rates) <= MAX_NODES:
        raise UserError(f"{len(rates)} nodes: expected 1 to {MAX_NODES}")
    check_subnet(subnet)
    bits = [_bits(r) for r in rates]
    if (fabrics is None) != (between is None):
        raise UserError("fabrics and the rate between them go together: give both (e.g. --fabrics ib,eth,ib,eth "
                        "--between 100mbit) or neither")
    fabrics = list(fabrics or [""] * len(bits))
    if len(fabrics) != len(bits):
        raise UserError(f"{len(fabrics)} fabrics for {len(bits)} nodes: give one per node")
    for f in fabrics:
        if f and not FABRIC_RE.match(f):
            raise UserError(f"fabric {f!r}: expected a short lower-case name (letters, digits, - or _), e.g. ib")
    cross = _bits(between) if between is not None else 0.0
    return [Node(index=k, host=f"{host_prefix}{k}", namespace=f"{prefix}n{k}", address=f"{subnet}.{k + 1}",
                 rate_bit_s=r, port=f"p{k}", fabric=f, cross_rate_bit_s=min(cross, r) if f else 0.0)
            for k, (r, f) in enumerate(zip(bits, fabrics))]


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
        others = [m for m in nodes if n.fabric and m.fabric != n.fabric]
        cmds += [["ip", "netns", "add", n.namespace],
                 ["ip", "-n", br, "link", "add", n.port, "type", "veth", "peer", "name", IFACE, "netns", n.namespace],
                 ["ip", "-n", br, "link", "set", n.port, "master", BRIDGE],
                 ["ip", "-n", br, "link", "set", n.port, "up"],
                 ["ip", "-n", n.namespace, "link", "set", "lo", "up"],
                 ["ip", "-n", n.namespace, "addr", "add", f"{n.address}/24", "dev", IFACE],
                 ["ip", "-n", n.namespace, "link", "set", IFACE, "up"]]
        for ns, dev, match in ((n.namespace, IFACE, "dst"), (br, n.port, "src")):  # what it sends, receives
            cmds += (_fabric_shaping(n, others, ns, dev, match) if others
                     else [["tc", "-n", ns, "qdisc", "add", "dev", dev, *tbf]])
    return cmds


def _fabric_shaping(n: Node, others: list[Node], ns: str, dev: str, match: str) -> list[list[str]]:
    """A node's NIC on a testbed of several fabrics (one direction, on ``dev`` in ``ns``): an htb
    with a class at the NIC's rate (the default) and one at the rate between fabrics, which the
    packets to (``match`` "dst") or from ("src") every node of another fabric take (u32 filters on
    their addresses). The classes' buckets are ``tbf_params``'s."""
    out = [["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"]]
    for cls, bit_s in (("1:1", n.rate_bit_s), ("1:2", n.cross_rate_bit_s)):
        burst, _ = tbf_params(bit_s)
        out.append(["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", cls, "htb",
                    "rate", f"{int(bit_s)}bit", "burst", str(burst), "cburst", str(burst)])
    for m in others:
        out.append(["tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                    "u32", "match", "ip", match, f"{m.address}/32", "flowid", "1:2"])
    return out


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

    launcher = python_torchrun() if python is None else (python, "-m", "torch.distributed.run")
    return argv(script, nproc_per_node, len(nodes), k, nodes[0].address, master_port, launcher=launcher)


def cluster_yaml(nodes: list[Node], nproc_per_node: int, name: str | None = None,
                 memory_gib: float | None = None) -> str:
    """A cluster file (``autoconf search --cluster``) describing the testbed: CPU processes, one
    node group per run of consecutive nodes of equal rate and fabric, the nodes' host names, NIC
    rates and fabrics, and the rate between fabrics as the cap between groups of different ones."""
    if memory_gib is None:
        memory_gib = default_memory_gib(len(nodes) * nproc_per_node)
    name = name or f"testbed-{len(nodes)}x{nproc_per_node}"
    groups: list[list[Node]] = []
    for n in nodes:
        if groups and (groups[-1][0].rate_bit_s, groups[-1][0].fabric) == (n.rate_bit_s, n.fabric):
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
        if g[0].fabric:
            out.append(f"    fabric: {g[0].fabric}")
    out.append("latency: {intra_node: 80 us, inter_node: 200 us}")
    cross = [n.cross_rate_bit_s for n in nodes if n.fabric]
    if cross:  # the cluster file's cap is one figure: the testbed's (each node's is min(it, its NIC's))
        out.append(f"inter_group_bandwidth: {fmt_rate(max(cross))}")
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
