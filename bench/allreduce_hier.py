"""Hierarchical vs flat all-reduce: measured times per message size, next to the cost model's.

    python bench/allreduce_hier.py [--nproc 4] [--hosts 2] [--sizes 4K,16K,...,64M] [--repeats 15]
                                   [--cluster CLUSTER.yaml] [--json OUT.json]
    python bench/allreduce_hier.py --testbed 1gbit     # across emulated nodes (root; autoconf testbed)
    python bench/allreduce_hier.py --testbed 1gbit --measure-links   # predicted from measured links

``--nproc`` processes are declared as ``--hosts`` hosts of nproc / hosts processes each: one
torchrun agent per host (static rendezvous, ``--node-rank`` K), so each rank learns its host from
torchrun's node rank (``GROUP_RANK``), as in a real multi-node launch. Each rank times, per size,
gloo's flat ``all_reduce`` (a ring) and the trainer's hierarchical all-reduce
(``autoconf/trainer/collectives.py``: intra-host reduce-scatter, inter-host all-reduce, intra-host
all-gather), with the inter-host phase by recursive doubling, by gloo's all-reduce, and as the
trainer picks it (``SMALL_BYTES``). A repeat's time is the slowest rank's (a collective ends when
its last member does); the variants take turns within each repeat, and the table shows the median
over ``--repeats`` after one warm-up round.

The prediction is the cost model's for the same group: ``comm.all_reduce_s`` with the algorithms
the reference trainer runs for ``dp_all_reduce`` flat (ring) and hierarchical, on the links of
``--cluster`` (default: this machine's loopback declared as ``--hosts`` hosts, every link at gloo's
measured loopback send/recv rate, 4.5 GB/s, and 80 us per message).

On localhost every "host" shares the same cores and the loopback device: with more processes than
cores the times measure contention (collectives slow down 2-3x with 4 processes on 2 cores), not
a network. ``--testbed RATE`` runs it across ``--hosts`` emulated nodes instead (``autoconf.runs.testbed``:
a network namespace per host, its NIC shaped to RATE), with the testbed's own cluster file for the
prediction: each host's agent starts inside its namespace (:func:`launch_node` is the seam).
With ``--measure-links`` it first runs ``autoconf profile --links-only`` across the nodes and
predicts from the links it measured (``--profile``: any such profile), as a user who profiled the
machine would: the intra-host phases then cost what gloo's loopback really moves with the cores
shared, not the declared 4.5 GB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
VARIANTS = ("flat", "hier", "hier-rd", "hier-ring")
"""flat: gloo's all_reduce; hier: the trainer's choice; hier-rd / hier-ring: inter-host phase forced
to recursive doubling / to gloo's all-reduce."""

LOOPBACK = """name: loopback-{hosts}x{k}
node_groups:
  - count: {hosts}
    device: cpu
    gpus_per_node: {k}
    intra_node_bandwidth: 4.5 GB/s
    memory: 4 GiB
    nics: {{count: 1, bandwidth: 36 Gbit/s, kind: loopback}}
latency: {{intra_node: 80 us, inter_node: 80 us}}
"""


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in mult:
        return int(float(text[:-1]) * mult[text[-1]])
    return int(text)


def show(nbytes: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div:
            return f"{nbytes / div:g} {unit}"
    return f"{nbytes} B"


# -- one rank ----------------------------------------------------------------------------------------

def worker(args) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from autoconf.trainer import collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    host_of = collectives.rank_hosts()
    everyone = list(range(world))
    variants = {}
    note = "flat"
    for name, small in (("hier", collectives.SMALL_BYTES), ("hier-rd", 1 << 62), ("hier-ring", 0)):
        ar, note = collectives.build([everyone], host_of, rank, datetime.timedelta(seconds=args.timeout), small)
        if ar is not None:
            variants[name] = ar
    results = {"note": note, "hosts": host_of, "sizes": []}
    names = ["flat"] + [v for v in VARIANTS if v in variants]
    for nbytes in args.sizes:
        x = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
        times: dict = {name: [] for name in names}
        for i in range(args.repeats + 1):  # the variants take turns, so drifting load hits them alike
            for name in names:
                dist.barrier()
                t0 = time.perf_counter()
                if name == "flat":
                    dist.all_reduce(x)
                else:
                    variants[name](x)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's time
                if i:
                    times[name].append(float(dt))
                x.fill_(1.0)
        row = {"bytes": nbytes, **{name: statistics.median(ts) for name, ts in times.items()}}
        results["sizes"].append(row)
    if rank == 0:
        with open(args.worker, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


# -- the launch: one torchrun agent per declared host ----------------------------------------------------

def launch_node(node_rank: int, cmd: list, env: dict, log):
    """Start host ``node_rank``'s agent (``cmd``, a torchrun command line; output to the open
    file ``log``) and return its handle (``wait(timeout)`` -> exit code or None, ``kill()``). On
    localhost: a child process tree. The namespace test bed replaces this with the same command
    run inside that host's namespace."""
    from autoconf.procs import ProcessTree

    return ProcessTree(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def node_command(node_rank: int, args, port: int, out: str) -> list:
    sizes = ",".join(str(s) for s in args.sizes)
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={args.hosts}",
            f"--nproc-per-node={args.nproc // args.hosts}", f"--node-rank={node_rank}", "--rdzv-backend=static",
            f"--master-addr={args.master_addr}", f"--master-port={port}", os.path.abspath(__file__),
            "--worker", out, "--sizes", sizes, "--repeats", str(args.repeats), "--timeout", str(args.timeout)]


def measure(args) -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)})
    env.pop("AUTOCONF_RANK_HOSTS", None)  # the hosts are torchrun's nodes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="allreduce-hier-") as tmp:
        out = os.path.join(tmp, "result.json")
        logs = [open(os.path.join(tmp, f"node-{k}.log"), "w") for k in range(args.hosts)]
        nodes = [launch_node(k, node_command(k, args, port, out), env, logs[k]) for k in range(args.hosts)]
        deadline = time.monotonic() + args.timeout
        try:
            codes = [n.wait(max(1.0, deadline - time.monotonic())) for n in nodes]
        finally:
            for n in nodes:
                n.kill()
            for f in logs:
                f.close()
        if not os.path.exists(out):  # (an agent may complain at its exit barrier after the work is done)
            for k in range(args.hosts):
                with open(os.path.join(tmp, f"node-{k}.log")) as f:
                    sys.stderr.write(f"--- node {k}\n" + f.read()[-3000:])
            raise SystemExit(f"no result: a host's agent failed or timed out (exit codes {codes})")
        with open(out) as f:
            return json.load(f)


# -- the cost model's side ---------------------------------------------------------------------------

def predictions(args, sizes) -> dict:
    from autoconf.cost import comm
    from autoconf.cost.groups import axis_links
    from autoconf.cost.system import System
    from autoconf.space.config import ParallelConfig
    from autoconf.specs.cluster import cluster_from_mapping, load_cluster
    from autoconf.specs.model import preset

    if args.cluster:
        cluster = load_cluster(args.cluster)
    else:
        import yaml
        cluster = cluster_from_mapping(yaml.safe_load(LOOPBACK.format(hosts=args.hosts, k=args.nproc // args.hosts)))
    profile = None
    if args.profile:
        from autoconf.specs.profile import load_profile
        profile = load_profile(args.profile)
    system = System(preset("tiny"), cluster, profile=profile)
    fw = system.framework
    out = {"cluster": cluster.name + (" + measured links" if profile is not None else "")}
    for mode in ("flat", "hierarchical"):
        c = ParallelConfig(dp=args.nproc, pp=1, tp=1, micro_batch_size=1, num_micro_batches=1, dp_all_reduce=mode)
        links = axis_links(system, c, "dp")
        eff = system.collective_efficiency(comm.all_reduce_s, args.nproc)
        out[mode] = [max(comm.all_reduce_s(s / eff, g, system.collective_tuning,
                                           algorithms=fw.dp_all_reduce_algorithms(c, g)) for g in links)
                     for s in sizes]
        out[mode + "_algorithms"] = sorted({a for g in links for a in fw.dp_all_reduce_algorithms(c, g)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4, help="processes in all (default 4)")
    ap.add_argument("--hosts", type=int, default=2, help="declared hosts, nproc / hosts processes each (default 2)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes in bytes, K/M suffixes (default {DEFAULT_SIZES})")
    ap.add_argument("--repeats", type=int, default=15, help="timed repeats per size and variant (median; default 15)")
    ap.add_argument("--cluster", help="cluster YAML the prediction uses (default: loopback, see the module doc)")
    ap.add_argument("--profile", help="a profile (autoconf profile) whose measured links replace the cluster's in "
                    "the prediction")
    ap.add_argument("--measure-links", action="store_true", help="with --testbed: first run `autoconf profile "
                    "--links-only` across the nodes and predict from its measured links")
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole measurement")
    ap.add_argument("--testbed", metavar="RATE", help="run across --hosts emulated nodes whose NICs run at RATE "
                    "(e.g. 1gbit; root, ip and tc needed)")
    ap.add_argument("--json", help="also write the table as JSON here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if args.worker:
        worker(args)
        return 0
    if args.hosts < 1 or args.nproc % args.hosts:
        ap.error(f"--nproc {args.nproc} must be a multiple of --hosts {args.hosts}")
    if args.testbed:
        return _on_testbed(args, argv)
    pred = predictions(args, args.sizes)
    print(f"{args.nproc} processes as {args.hosts} hosts x {args.nproc // args.hosts}, {os.cpu_count()} cores; "
          f"prediction on {pred['cluster']}", file=sys.stderr, flush=True)
    got = measure(args)
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"all-reduce, {args.nproc} processes as {args.hosts} hosts ({got['note']}); median of "
                    f"{args.repeats}, ms")
    for col in ("size", "flat", "hier", "hier-rd", "hier-ring", "hier/flat", "pred flat", "pred hier",
                "pred hier/flat"):
        t.add_column(col, justify="right")
    rows = []
    for i, row in enumerate(got["sizes"]):
        pf, ph = pred["flat"][i], pred["hierarchical"][i]
        cells = [show(row["bytes"])] + [f"{row[v] * 1e3:.3f}" if v in row else "-" for v in VARIANTS]
        ratio = row["hier"] / row["flat"] if "hier" in row else None
        cells += [f"{ratio:.2f}" if ratio else "-", f"{pf * 1e3:.3f}", f"{ph * 1e3:.3f}", f"{ph / pf:.2f}"]
        t.add_row(*cells)
        rows.append({**row, "pred_flat": pf, "pred_hier": ph})
    Console(width=max(132, Console().width)).print(t)
    if os.cpu_count() and args.nproc > os.cpu_count():
        print(f"note: {args.nproc} processes on {os.cpu_count()} cores: the times measure contention for the cores",
              file=sys.stderr)
    if args.json:
        from autoconf.files import write_text
        write_text(args.json, json.dumps({"nproc": args.nproc, "hosts": args.hosts, "note": got["note"],
                                          "cluster": pred["cluster"], "rows": rows}, indent=1))
    return 0


def _on_testbed(args, argv) -> int:
    """The same bench with each host's agent inside an emulated node of a fresh testbed."""
    global launch_node
    from autoconf.runs import testbed as tbm
    from autoconf.runs import testbed_plan

    reason = tbm.unavailable_reason()
    if reason:
        print(f"bench/allreduce_hier.py: no testbed here: {reason}", file=sys.stderr)
        return 2
    with tbm.Testbed([args.testbed] * args.hosts, nproc_per_node=args.nproc // args.hosts) as tb, \
            tempfile.TemporaryDirectory(prefix="allreduce-hier-tb-") as tmp:
        cluster = os.path.join(tmp, "testbed.yaml")
        with open(cluster, "w") as f:
            f.write(testbed_plan.cluster_yaml(tb.nodes, args.nproc // args.hosts))
        launch_node = lambda k, cmd, env, log: tb.popen(k, cmd, env=env, stdout=log,  # noqa: E731
                                                        stderr=subprocess.STDOUT)
        extra = []
        if args.measure_links:  # the links as `autoconf profile` measures them across the nodes
            prof = os.path.join(tmp, "links.json")
            with open(os.devnull, "w") as devnull:
                codes = tb.launch([sys.executable, "-m", "autoconf", "profile", "--model", "tiny", "--links-only",
                                   "--out", prof], cwd=ROOT, timeout=900, output=devnull)
            if any(codes):
                print(f"bench/allreduce_hier.py: profiling the links failed: exit codes {codes}", file=sys.stderr)
                return 1
            extra = ["--profile", prof]
        rest, skip = [], False
        for a in argv if argv is not None else sys.argv[1:]:
            if skip:
                skip = False
            elif a == "--testbed":
                skip = True
            elif not a.startswith("--testbed="):
                rest.append(a)
        return main([a for a in rest if a != "--measure-links"] + ["--master-addr", tb.master_addr,
                                                                     "--cluster", cluster, *extra])


if __name__ == "__main__":
    sys.exit(main())
