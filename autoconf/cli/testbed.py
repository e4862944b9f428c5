"""``autoconf testbed``: emulated nodes in network namespaces (``runs.testbed``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from autoconf.errors import UserError
from autoconf.runs.testbed import ATTACH_ENV, Testbed, cleanup_stale, describe
from autoconf.runs.testbed_plan import (
    DEFAULT_PORT,
    DEFAULT_SUBNET,
    IFACE,
    MAX_NODES,
    cluster_yaml,
    fmt_rate,
    new_prefix,
    parse_rate,
    plan_nodes,
    setup_commands,
)


def add_testbed_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "testbed", help="emulated nodes with shaped links on this machine (root): run a command on each",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (default: one per --rates entry)")
    p.add_argument("--rates", default=None,
                   help="NIC rate per node, comma-separated (200mbit, 10gbit, '1 Gbit/s'); one rate applies to all")
    p.add_argument("--fabrics", default=None, metavar="F,F,...",
                   help="the network of each node's NIC, comma-separated (e.g. ib,eth,ib,eth): nodes of one fabric "
                   "talk at their NICs' rates, of different ones at --between")
    p.add_argument("--between", default=None, metavar="RATE", help="the rate between nodes of different --fabrics")
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
    from autoconf.files import check_file, write_text

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
    fabrics = [f.strip() for f in args.fabrics.split(",")] if args.fabrics else None
    if fabrics is not None and len(fabrics) == 1:
        fabrics *= len(rates)
    nodes = plan_nodes(rates, prefix, args.subnet, fabrics=fabrics, between=args.between)
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
                 prefix=prefix, fabrics=fabrics, between=args.between) as tb:
        for n in tb.nodes:
            sys.stderr.write(f"testbed: {n.host} = namespace {n.namespace}, {n.address} on {IFACE}, "
                             f"{fmt_rate(n.rate_bit_s)}"
                             + (f", fabric {n.fabric} ({fmt_rate(n.cross_rate_bit_s)} to others)" if n.fabric else "")
                             + "\n")
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
