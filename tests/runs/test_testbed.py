"""The shaped-link testbed (autoconf/testbed.py) and the multi-node launch that keeps the plan.

Pure parts (rates, the address plan, the ip / tc / torchrun commands, the cluster file, the
schema's host names, the emitted scripts) run anywhere. The end-to-end tests need root, ip, tc and
unshare (network namespaces with tbf qdiscs) and torch; they are skipped with the reason otherwise.
"""

import glob
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from autoconf.errors import UserError
from autoconf.runs import testbed as tbm
from autoconf.runs import testbed_plan as tbp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_TMPDIR: list = []
"""This module's TMPDIR for the commands it runs (torchrun leaves a ``torchelastic_*`` directory in
it), under pytest's own temporary directory rather than the machine's /tmp."""


@pytest.fixture(autouse=True, scope="module")
def _commands_tmpdir(tmp_path_factory):
    _TMPDIR[:] = [str(tmp_path_factory.mktemp("tmpdir"))]
    yield
    _TMPDIR.clear()


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # torchrun beside python
    if _TMPDIR:
        env["TMPDIR"] = _TMPDIR[0]
    env.update(extra)
    return env


def _cli(*args, timeout=60, **kw):
    return subprocess.run([sys.executable, "-m", "autoconf", *args], capture_output=True, text=True, env=_env(),
                          timeout=timeout, **kw)


# -- rates, addresses, commands ---------------------------------------------------------------------

def test_address_plan_is_private_unique_and_per_node():
    nodes = tbm.plan_nodes(["10gbit", "1gbit", "200mbit"], "actb1x00ff")
    assert [n.address for n in nodes] == ["10.200.0.1", "10.200.0.2", "10.200.0.3"]
    assert [n.host for n in nodes] == ["node-0", "node-1", "node-2"]
    assert [n.namespace for n in nodes] == ["actb1x00ffn0", "actb1x00ffn1", "actb1x00ffn2"]
    assert [n.rate_bit_s for n in nodes] == [10e9, 1e9, 200e6]
    assert tbm.plan_nodes(["1gbit"], "actb1x00ff", subnet="192.168.77")[0].address == "192.168.77.1"
    for bad in ("8.8.8", "10.200", "10.200.0.1", "172.32.0", "10.256.0", "010.1.1"):
        with pytest.raises(UserError, match="private /24"):
            tbm.plan_nodes(["1gbit"], "actb1x00ff", subnet=bad)
    with pytest.raises(UserError, match="expected 1 to"):
        tbm.plan_nodes(["1gbit"] * (tbp.MAX_NODES + 1), "actb1x00ff")


def test_prefixes_are_unique_and_recognised_for_cleanup():
    a, b = tbm.new_prefix(), tbm.new_prefix()
    assert a != b and tbm.PREFIX_RE.match(a)
    assert tbm._owner(a + "br") == (a, os.getpid()) and tbm._owner(a + "n12") == (a, os.getpid())
    assert tbm._owner("myns") is None and tbm._owner("actb12x00ffq") is None


def test_setup_commands_stay_inside_the_testbeds_namespaces_and_shape_both_directions():
    prefix = "actb7x0abc"
    nodes = tbm.plan_nodes(["1gbit", "200mbit"], prefix)
    cmds = tbm.setup_commands(nodes, prefix)
    ours = {prefix + "br", prefix + "n0", prefix + "n1"}
    created = []
    for c in cmds:
        if c[:3] == ["ip", "netns", "add"]:
            created.append(c[3])
            continue
        assert c[1] == "-n" and c[2] in created, c  # every other command names a namespace already made
    assert set(created) == ours and created[0] == prefix + "br"
    tbf = [c for c in cmds if c[0] == "tc"]
    assert len(tbf) == 4
    for n in nodes:  # the node's NIC (what it sends) and its bridge port (what it receives)
        mine = [c for c in tbf if (c[2] == n.namespace and c[6] == tbp.IFACE) or (c[2] == prefix + "br" and c[6] == n.port)]
        assert len(mine) == 2 and all(c[c.index("rate") + 1] == f"{int(n.rate_bit_s)}bit" for c in mine)
    veths = [c for c in cmds if "veth" in c]
    assert [c[c.index("netns", 4) + 1] for c in veths] == [prefix + "n0", prefix + "n1"]
    for c in cmds:  # addresses only from the testbed's own range
        if "addr" in c:
            assert c[c.index("add", 4) + 1].startswith("10.200.0.")


def test_fabrics_send_traffic_between_kinds_of_nic_through_the_slow_class():
    """Two fabrics: each direction of a node's NIC is an htb whose default class runs at the NIC's
    rate and whose second class, at the rate between fabrics, takes exactly the packets to (its
    tb0) or from (its bridge port) the nodes of the other fabric."""
    prefix = "actb7x0abc"
    nodes = tbm.plan_nodes(["1gbit", "1gbit", "400mbit"], prefix, fabrics=["ib", "eth", "ib"], between="100mbit")
    assert [n.cross_rate_bit_s for n in nodes] == [100e6, 100e6, 100e6]
    cmds = tbm.setup_commands(nodes, prefix)
    for n in nodes:
        for ns, dev, way in ((n.namespace, tbp.IFACE, "dst"), (prefix + "br", n.port, "src")):
            mine = [c for c in cmds if c[0] == "tc" and c[2] == ns and c[c.index("dev") + 1] == dev]
            rates = {c[c.index("classid") + 1]: c[c.index("rate") + 1] for c in mine if c[3] == "class"}
            assert rates == {"1:1": f"{int(n.rate_bit_s)}bit", "1:2": "100000000bit"}
            slow = {c[c.index(way) + 1] for c in mine if c[3] == "filter" and c[-1] == "1:2"}
            assert slow == {f"{m.address}/32" for m in nodes if m.fabric != n.fabric}
            assert not any("tbf" in c for c in mine)
    assert tbm.setup_commands(tbm.plan_nodes(["1gbit"] * 2, prefix), prefix) == tbm.setup_commands(
        tbm.plan_nodes(["1gbit"] * 2, prefix, fabrics=["ib", "ib"], between="1mbit"), prefix)  # one fabric: tbf
    for kw, needle in (({"fabrics": ["ib", "eth", "ib"]}, "go together"),
                       ({"fabrics": ["ib"], "between": "1mbit"}, "1 fabrics for 3 nodes"),
                       ({"fabrics": ["ib", "e th", "ib"], "between": "1mbit"}, "fabric 'e th'")):
        with pytest.raises(UserError, match=needle):
            tbm.plan_nodes(["1gbit", "1gbit", "400mbit"], prefix, **kw)


def test_cluster_file_of_a_two_fabric_testbed_caps_only_across_fabrics():
    from autoconf.specs.cluster import cluster_from_mapping
    from autoconf.specs.schema import parse_yaml
    from autoconf.specs.topology import Topology

    nodes = tbm.plan_nodes(["1gbit"] * 4, "actb7x0abc", fabrics=["ib", "eth", "ib", "eth"], between="100mbit")
    c = cluster_from_mapping(parse_yaml(tbp.cluster_yaml(nodes, 1), "tb.yaml"))
    assert [g.fabric for g in c.node_groups] == ["ib", "eth", "ib", "eth"]
    assert c.host_names() == ["node-0", "node-1", "node-2", "node-3"]  # node order kept: rank r on node r
    for topo in (Topology(c.graph()), Topology.of_cluster(c)):
        assert [topo.p2p(0, j)[0] for j in (1, 2, 3)] == [100e6 / 8, 1e9 / 8, 100e6 / 8]
        assert topo.p2p(1, 3)[0] == 1e9 / 8
    assert ClusterSpec_round_trip(c) == c


def ClusterSpec_round_trip(c):
    from autoconf.specs.cluster import ClusterSpec

    return ClusterSpec.from_dict(json.loads(json.dumps(c.to_dict())))


def test_tbf_bucket_holds_a_millisecond_and_queues_50ms():
    for bits in (1e6, 200e6, 1e9, 10e9):
        burst, limit = tbp.tbf_params(bits)
        assert burst >= max(16 << 10, bits / 8 / 1000) and limit == burst + int(bits / 8 * 0.05)


def test_commands_in_a_node():
    nodes = tbm.plan_nodes(["1gbit", "200mbit"], "actb7x0abc")
    argv = tbm.exec_argv(nodes[1], ["echo", "a b", "c"])
    assert argv[:7] == ["ip", "netns", "exec", "actb7x0abcn1", "unshare", "--uts", "--"]
    assert argv[-4:] == ["node-1", "echo", "a b", "c"]
    # sh -c 'hostname "$0" && exec "$@"' node-1 echo ...: the host name, then the command, arguments intact
    assert subprocess.run(["sh", "-c", argv[9].replace("hostname", "echo"), *argv[10:]], capture_output=True,
                          text=True).stdout == "node-1\na b c\n"
    sub = tbm.substitute(["--node-rank", "{node_rank}", "{master_addr}:{master_port}", "n{nnodes}", "{x}",
                          "{nproc_per_node}", "{host}"], nodes, 1, 29555, 4)
    assert sub == ["--node-rank", "1", "10.200.0.1:29555", "n2", "{x}", "4", "node-1"]
    env = tbm.node_env(nodes, 1, 29555, 4, base={"OMP_NUM_THREADS": "3"})
    assert env["GLOO_SOCKET_IFNAME"] == "tb0" and env["MASTER_ADDR"] == "10.200.0.1" and env["MASTER_PORT"] == "29555"
    assert env["AUTOCONF_NODE_RANK"] == "1" and env["AUTOCONF_NNODES"] == "2" and env["AUTOCONF_NPROC_PER_NODE"] == "4"
    assert env["OMP_NUM_THREADS"] == "3"  # kept when set
    run = tbm.torchrun_argv(nodes, 1, 2, 29555, ["-m", "autoconf.trainer"], python="py")
    assert run == ["py", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", "--node-rank=1",
                   "--rdzv-backend=static", "--master-addr=10.200.0.1", "--master-port=29555", "-m", "autoconf.trainer"]


@pytest.mark.skipif(tbm.unavailable_reason() is not None, reason="needs root, ip, tc and unshare")
def test_a_driver_launches_one_torchrun_per_node(monkeypatch):
    nodes = tbm.plan_nodes(["1gbit", "200mbit"], "actb7x0abc")
    monkeypatch.setenv(tbm.ATTACH_ENV, tbm.describe(nodes, 29555, 2))
    tb = tbm.attached()
    assert tb["nodes"] == nodes and tb["master_port"] == 29555
    cmds = tbm.node_commands(tb, [2, 2], ["-m", "autoconf.trainer"], {"A": "1"})
    assert [c[0][3] for c in cmds] == ["actb7x0abcn0", "actb7x0abcn1"]  # ip netns exec <namespace>
    assert os.path.isabs(cmds[0][0][0])  # ip by its resolved path, whatever PATH says
    assert [a for a in cmds[1][0] if a.startswith("--node-rank") or a.startswith("--nproc")] == \
        ["--nproc-per-node=2", "--node-rank=1"]
    assert cmds[1][1]["A"] == "1" and cmds[1][1]["GLOO_SOCKET_IFNAME"] == "tb0"
    # a plan that priced 2 ranks on one host runs them on node 0 only
    one = tbm.node_commands(tb, [2], ["-m", "x"], {})
    assert len(one) == 1 and "--nnodes=1" in one[0][0]
    with pytest.raises(UserError, match="the testbed has 2 node"):
        tbm.node_commands(tb, [4], ["-m", "x"], {})
    monkeypatch.setenv(tbm.ATTACH_ENV, "{not json")
    with pytest.raises(UserError, match="not a testbed description"):
        tbm.attached()


def test_cluster_file_of_the_testbed_loads_with_hosts_and_rates():
    from autoconf.specs.cluster import cluster_from_mapping
    from autoconf.specs.schema import parse_yaml

    nodes = tbm.plan_nodes(["10gbit", "10gbit", "1gbit"], "actb7x0abc")
    text = tbp.cluster_yaml(nodes, 2, memory_gib=3.5)
    c = cluster_from_mapping(parse_yaml(text, "tb.yaml"))
    assert [g.count for g in c.node_groups] == [2, 1]  # consecutive nodes of one rate form a group
    assert [g.nic_bandwidth_bytes_per_s for g in c.node_groups] == [10e9 / 8, 1e9 / 8]
    assert c.host_names() == ["node-0", "node-1", "node-2"] and c.num_devices == 6
    assert all(g.device == "cpu" and g.memory_bytes == 3.5 * 2**30 for g in c.node_groups)


# -- the CLI's refusals -------------------------------------------------------------------------------

@pytest.mark.parametrize("args,needle", [
    (["--rates", "200mbps", "--", "true"], "rate '200mbps'"),
    (["--rates", "1gbit,2gbit", "--nodes", "3", "--", "true"], "--rates has 2 entries but --nodes is 3"),
    (["--", "true"], "--rates"),
    (["--rates", "1gbit"], "after --"),
    (["--rates", "1gbit", "--subnet", "8.8.8", "--", "true"], "private /24"),
    (["--rates", "1gbit", "--master-port", "70000", "--", "true"], "--master-port 70000"),
    (["--rates", "1gbit", "--timeout", "0", "--", "true"], "--timeout"),
])
def test_cli_bad_input_is_one_line_exit_2(args, needle):
    p = _cli("testbed", *args)
    assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "Traceback" not in p.stderr


def test_cli_refuses_without_root_or_tools(monkeypatch, capsys):
    from autoconf.cli import app as cli

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cli.main(["testbed", "--rates", "1gbit", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(tbm, "_which", lambda tool: None if tool == "tc" else "/bin/" + tool)
    assert cli.main(["testbed", "--rates", "1gbit", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "needs tc" in err and len(err.strip().splitlines()) == 1


def test_cli_writes_the_cluster_file_without_root(tmp_path):
    out = tmp_path / "tb.yaml"
    p = _cli("testbed", "--rates", "10gbit,1gbit", "--nproc-per-node", "2", "--cluster-out", str(out))
    assert p.returncode == 0, p.stderr
    p = _cli("search", "--model", "tiny", "--cluster", str(out), "--global-batch", "8", "--storage", "none", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["best"]["config"]


# -- profile: multi-node flags from the testbed's variables; link rounds and NICs ------------------

def test_profile_takes_its_node_flags_from_the_testbed(monkeypatch):
    import argparse

    from profiler.cli import add_profile_parser, launch_command

    ap = argparse.ArgumentParser()
    add_profile_parser(ap.add_subparsers(dest="command"))
    for var in ("AUTOCONF_NNODES", "AUTOCONF_NODE_RANK", "AUTOCONF_MASTER_ADDR", "AUTOCONF_MASTER_PORT",
                "AUTOCONF_NPROC_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    one = launch_command(ap.parse_args(["profile", "--model", "tiny"]))
    assert "--standalone" in one and "--nproc-per-node=2" in one
    monkeypatch.setenv("AUTOCONF_NNODES", "2")
    monkeypatch.setenv("AUTOCONF_NODE_RANK", "1")
    monkeypatch.setenv("AUTOCONF_MASTER_ADDR", "10.200.0.1")
    monkeypatch.setenv("AUTOCONF_MASTER_PORT", "29541")
    monkeypatch.setenv("AUTOCONF_NPROC_PER_NODE", "3")
    two = launch_command(ap.parse_args(["profile", "--model", "tiny"]))
    assert "--standalone" not in two
    assert {"--nnodes=2", "--node-rank=1", "--master-addr=10.200.0.1", "--master-port=29541",
            "--nproc-per-node=3"} <= set(two)
    given = launch_command(ap.parse_args(["profile", "--model", "tiny", "--node-rank", "0", "--nproc-per-node", "1"]))
    assert "--node-rank=0" in given and "--nproc-per-node=1" in given  # flags win over the variables
    monkeypatch.setenv("AUTOCONF_NNODES", "two")
    with pytest.raises(UserError, match="AUTOCONF_NNODES='two'"):
        launch_command(ap.parse_args(["profile", "--model", "tiny"]))


def test_link_rounds_never_share_a_hosts_nic():
    from profiler.links import measure_rounds, split_by_host, tournament_rounds

    for world, per_host in ((4, 2), (8, 2), (8, 4), (6, 3), (5, 2)):
        hosts = [f"h{r // per_host}" for r in range(world)]
        rounds = measure_rounds(world, hosts=hosts)
        pairs = sorted(p for r in rounds for p in r)
        assert pairs == [(a, b) for a in range(world) for b in range(a + 1, world)]  # every pair once
        for r in rounds:
            ranks = [x for p in r for x in p]
            assert len(ranks) == len(set(ranks))
            crossing = [h for a, b in r if hosts[a] != hosts[b] for h in (hosts[a], hosts[b])]
            assert len(crossing) == len(set(crossing)), r  # each host's NIC in at most one measured pair
    assert measure_rounds(6, hosts=["a"] * 6) == tournament_rounds(6)  # one host: as before
    assert measure_rounds(4) == tournament_rounds(4)
    assert split_by_host([(0, 2), (1, 3)], ["a", "a", "b", "b"]) == [[(0, 2)], [(1, 3)]]
    assert split_by_host([(0, 1), (2, 3)], ["a", "a", "b", "b"]) == [[(0, 1), (2, 3)]]


# -- cluster files: host names --------------------------------------------------------------------

def _group(count, **kw):
    return {"count": count, "device": "a100-80gb", "gpus_per_node": 4, "intra_node_bandwidth": "300 GB/s", **kw}


def test_cluster_hosts_default_and_round_trip():
    from autoconf.specs.cluster import ClusterSpec, cluster_from_mapping

    c = cluster_from_mapping({"node_groups": [_group(2, hosts=["gpu-a1", "gpu-a2"]), _group(1)]})
    assert c.host_names() == ["gpu-a1", "gpu-a2", "node-2"]
    d = c.to_dict()
    assert d["node_groups"][0]["hosts"] == ["gpu-a1", "gpu-a2"] and "hosts" not in d["node_groups"][1]
    assert ClusterSpec.from_dict(json.loads(json.dumps(d))) == c
    plain = cluster_from_mapping({"node_groups": [_group(2)]})
    assert "hosts" not in plain.to_dict()["node_groups"][0] and plain.host_names() == ["node-0", "node-1"]


@pytest.mark.parametrize("groups,needle", [
    ([_group(2, hosts=["a"])], "1 name(s) for count 2"),
    ([_group(1, hosts=["a b"])], "is not a host name"),
    ([_group(1, hosts=["-x"])], "is not a host name"),
    ([_group(1, hosts=["$(reboot)"])], "is not a host name"),
    ([_group(2, hosts=["a", "a"])], "'a' appears twice"),
    ([_group(1, hosts=["node-1"]), _group(1)], "'node-1' appears twice"),
    ([_group(1, hosts=[""])], "must not be empty"),
    ([_group(1, hosts="a")], "expected a list"),
    ([_group(1, hosts=[3])], "expected a string"),
])
def test_cluster_hosts_refused(groups, needle):
    from autoconf.specs.cluster import cluster_from_mapping

    with pytest.raises(UserError) as e:
        cluster_from_mapping({"node_groups": groups})
    assert needle in str(e.value)


# -- emitted launch files ----------------------------------------------------------------------------

def _plan(cluster_groups, **cfg):
    from autoconf.cost.estimate import estimate
    from autoconf.space.config import ParallelConfig
    from autoconf.specs.cluster import cluster_from_mapping
    from autoconf.specs.model import preset

    cluster = cluster_from_mapping({"node_groups": cluster_groups})
    model = preset("tiny")
    config = ParallelConfig(**{"dp": 1, "pp": 1, "tp": 1, "micro_batch_size": 1, "num_micro_batches": 2, **cfg})
    return estimate(config, model, cluster), model, cluster


def test_node_plan_and_gpu_order():
    from autoconf.launch.hosts import node_plan, visible_devices

    _, _, cluster = _plan([_group(2, hosts=["a", "b"]), {**_group(1), "device": "cpu"}])
    plan = node_plan(cluster, 10)  # 4 + 4 + 2 of the cpu host
    assert [(p["host"], p["nproc"], p["first_rank"]) for p in plan] == [("a", 4, 0), ("b", 4, 4), ("node-2", 2, 8)]
    assert visible_devices(plan) == ["0,1,2,3", "0,1,2,3", None]
    assert visible_devices(plan, [3, 2, 1, 0, 0, 2, 1, 3, 0, 1]) == ["3,2,1,0", "0,2,1,3", None]
    for bad, needle in (([0] * 9, "10 device indices"), ([0, 0, 1, 2] + [0, 1, 2, 3, 0, 1], "distinct"),
                        ([0, 1, 2, 4] + [0, 1, 2, 3, 0, 1], "in 0..3")):
        with pytest.raises(UserError, match=needle):
            visible_devices(plan, bad)


def test_emitted_scripts_fix_each_hosts_ranks_for_torchrun(tmp_path):
    """The scripts' torchrun lines, parsed by torch's own launcher: node K is group rank K under
    the static rendezvous at MASTER_ADDR:port (what torchrun honours; under c10d it drops --node-rank)."""
    from autoconf.launch.emit import emit

    e, model, cluster = _plan([_group(2, hosts=["gpu-a1", "gpu-a2"])], dp=2, tp=4, num_micro_batches=1)
    files = emit(e, model, cluster, str(tmp_path), master_port=29611, local_devices=[3, 2, 1, 0, 0, 1, 2, 3])
    assert [os.path.basename(f) for f in files] == ["config.json", "node-0.sh", "node-1.sh", "sbatch.sh", "PLAN.md"]
    md = (tmp_path / "PLAN.md").read_text()
    assert "host `gpu-a1` (processes 0..3; pipeline stage" in md and "GPUs 3,2,1,0)" in md and "host `gpu-a2` (processes 4..7" in md
    for k in (0, 1):
        sh = (tmp_path / f"node-{k}.sh").read_text()
        assert f"run on host gpu-a{k + 1}; processes {4 * k}..{4 * k + 3}" in sh
        assert 'if [ -z "${MASTER_ADDR:-}" ]; then MASTER_ADDR=gpu-a1; fi' in sh
        assert f"export CUDA_VISIBLE_DEVICES={'3,2,1,0' if k == 0 else '0,1,2,3'} " in sh
        line = next(ln for ln in sh.splitlines() if ln.startswith("exec torchrun"))
        assert "c10d" not in line and f"--node-rank={k}" in line
        # bash with MASTER_ADDR unset: the default host name, exactly as the script expands it
        expanded = subprocess.run(["bash", "-c", sh.split("exec ", 1)[0] + 'echo "$MASTER_ADDR"'],
                                  env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, cwd=tmp_path)
        assert expanded.stdout.strip() == "gpu-a1"
        torch_args = shlex.split(line.replace("$MASTER_ADDR", "gpu-a1").replace(' "$@"', ""))[2:]
        try:
            from torch.distributed.run import config_from_args, get_args_parser
        except ImportError:  # torch is optional for the planner
            continue
        config, _, cmd_args = config_from_args(get_args_parser().parse_args(torch_args))
        assert config.rdzv_backend == "static" and config.rdzv_configs["rank"] == k
        assert config.rdzv_endpoint == "gpu-a1:29611" and config.max_nodes == 2 and config.nproc_per_node == 4
        assert cmd_args[-4:] == ["--config", "config.json", "--out", "results"]
    doc = json.loads((tmp_path / "config.json").read_text())
    assert doc["cluster"]["node_groups"][0]["hosts"] == ["gpu-a1", "gpu-a2"]


def test_emit_without_hosts_still_needs_master_addr(tmp_path):
    from autoconf.launch.emit import emit

    e, model, cluster = _plan([{**_group(2), "device": "cpu", "gpus_per_node": 1}], dp=2)
    emit(e, model, cluster, str(tmp_path))
    sh = (tmp_path / "node-1.sh").read_text()
    assert ': "${MASTER_ADDR:?set MASTER_ADDR' in sh and "CUDA_VISIBLE_DEVICES" not in sh
    assert "run on host node-1; processes 1..1" in sh


# -- end to end on the testbed (root, ip, tc, unshare) ----------------------------------------------

def _skip_reason():
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "needs torch"
    return tbm.unavailable_reason(probe=True)


_REASON = _skip_reason() if sys.platform.startswith("linux") else "needs Linux"
needs_testbed = pytest.mark.skipif(_REASON is not None, reason=f"no testbed here: {_REASON}")


def _ours(prefix_pid: int) -> list[str]:
    return [ns for ns in tbm._namespaces() if (tbm._owner(ns) or ("", -1))[1] == prefix_pid]


@needs_testbed
@pytest.mark.e2e
def test_testbed_nodes_have_their_names_addresses_and_clean_up():
    with Testbed_(["100mbit", "300mbit"]) as tb:
        names = {tb.nodes[0].namespace, tb.nodes[1].namespace, tb.bridge_namespace}
        assert names <= set(tbm._namespaces())
        got = tb.run(1, ["sh", "-c", "hostname; echo $GLOO_SOCKET_IFNAME $MASTER_ADDR"])
        assert got.stdout.split() == ["node-1", "tb0", "10.200.0.1"]
        # node 1 reaches node 0 by name (the testbed's hosts file) over its NIC; the listener in node 0
        srv = tb.popen(0, [sys.executable, "-c", "import socket; s = socket.create_server(('10.200.0.1', 29599)); "
                           "c, a = s.accept(); c.sendall(a[0].encode())"], stdout=subprocess.PIPE)
        cli = ("import socket, time\nfor _ in range(100):\n    try:\n        c = socket.create_connection(('node-0', "
               "29599)); break\n    except OSError: time.sleep(0.05)\nprint(c.recv(64).decode())")
        assert tb.run(1, [sys.executable, "-c", cli], timeout=30).stdout.strip() == "10.200.0.2"
        srv.wait(10)
        rates = tb.run(0, ["tc", "qdisc", "show", "dev", "tb0"]).stdout
        assert "tbf" in rates and "100Mbit" in rates
    assert not names & set(tbm._namespaces())
    assert not any(os.path.exists(os.path.join(tbm.NETNS_ETC, n)) for n in names)
    with pytest.raises(RuntimeError):  # an exception inside: removed all the same
        with Testbed_(["100mbit"]) as tb:
            ns = tb.nodes[0].namespace
            raise RuntimeError("boom")
    assert ns not in tbm._namespaces()


@needs_testbed
@pytest.mark.e2e
def test_nodes_of_one_fabric_talk_fast_and_across_fabrics_slow():
    """Three nodes, fabrics a, b, a, 200 mbit inside a fabric and 20 mbit between: node 0 sends to
    node 2 (its fabric) and node 1 (the other) at those rates, within 20%."""
    recv = ("import socket, sys\ns = socket.create_server(('0.0.0.0', int(sys.argv[1])))\nc, _ = s.accept()\n"
            "n = 0\nwhile True:\n    b = c.recv(1 << 20)\n    if not b: break\n    n += len(b)\nc.sendall(b'k')\n"
            "print(n)")
    send = ("import socket, sys, time\nfor _ in range(200):\n    try:\n        c = socket.create_connection((sys.argv[1], "
            "int(sys.argv[2]))); break\n    except OSError: time.sleep(0.05)\nc.sendall(b'w' * 65536)\n"
            "t = time.perf_counter(); c.sendall(b'x' * int(sys.argv[3])); c.shutdown(socket.SHUT_WR)\nc.recv(1)\n"
            "print(int(sys.argv[3]) / (time.perf_counter() - t))")
    with Testbed_(["200mbit"] * 3, fabrics=["a", "b", "a"], between="20mbit") as tb:
        got = {}
        for dst, nbytes, port in ((2, 4 << 20, 29597), (1, 1 << 20, 29598)):
            srv = tb.popen(dst, [sys.executable, "-c", recv, str(port)], stdout=subprocess.PIPE)
            out = tb.run(0, [sys.executable, "-c", send, tb.nodes[dst].address, str(port), str(nbytes)], timeout=60)
            srv.wait(30)
            got[dst] = float(out.stdout.strip()) * 8
        assert got[2] == pytest.approx(200e6, rel=0.2) and got[1] == pytest.approx(20e6, rel=0.2), got


def Testbed_(rates, **kw):
    return tbm.Testbed(rates, **{"nproc_per_node": 2, **kw})


@needs_testbed
@pytest.mark.e2e
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 130)])
def test_cli_cleans_up_on_a_signal(sig, code):
    marker = f"{time.time() % 1000:.3f}"
    p = subprocess.Popen([sys.executable, "-m", "autoconf", "testbed", "--rates", "100mbit", "--nodes", "2", "--",
                          "sleep", f"3{marker}"], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while len(_ours(p.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_ours(p.pid)) == 3
        deadline = time.monotonic() + 10  # the commands have started in both nodes
        while len(_sleepers(marker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        p.send_signal(sig)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == code, err
    assert _ours(p.pid) == [] and _sleepers(marker) == []


def _sleepers(marker):
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read() == f"sleep\0003{marker}\0".encode():
                    out.append(pid)
        except OSError:
            pass
    return out


@needs_testbed
@pytest.mark.e2e
def test_cli_a_failing_node_ends_the_others_and_cleanup_removes_a_killed_owners_testbed():
    t0 = time.monotonic()
    p = _cli("testbed", "--rates", "100mbit", "--nodes", "2", "--", "sh", "-c",
             "if [ {node_rank} = 1 ]; then exit 3; fi; sleep 60", timeout=60)
    assert p.returncode == 3 and "node-1 exited with 3" in p.stderr and time.monotonic() - t0 < 30
    # an owner killed outright leaves its namespaces; --cleanup removes them (and only such)
    k = subprocess.Popen([sys.executable, "-m", "autoconf", "testbed", "--rates", "100mbit", "--", "sleep", "60"],
                         env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while len(_ours(k.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    k.kill()
    k.wait()
    assert len(_ours(k.pid)) == 2
    with tbm.Testbed(["100mbit"]) as live:  # a live owner's testbed is left alone
        c = _cli("testbed", "--cleanup")
        assert c.returncode == 0 and live.nodes[0].namespace in tbm._namespaces()
    assert _ours(k.pid) == []


@needs_testbed
@pytest.mark.e2e
def test_profile_across_the_testbed_measures_the_shaped_links(tmp_path):
    """2 nodes x 2 processes: node 0's NIC at 1 gbit, node 1's at 100 mbit, so every link between
    them runs at 100 mbit (the slower NIC) in both directions; inside a node, unshaped loopback.
    (A low rate keeps the shaper, not CPU stalls on a shared 2-core machine, the bottleneck: at
    200 mbit a loaded machine's stalls took a 4 MiB transfer 18% past the shaped time once.)"""
    from autoconf.specs.profile import load_profile

    rate = 100e6 / 8  # bytes/s between the nodes
    out = tmp_path / "p.json"
    p = _cli("testbed", "--rates", "1gbit,100mbit", "--nproc-per-node", "2", "--", sys.executable, "-m", "autoconf",
             "profile", "--model", "tiny", "--quick", "--links-only", "--out", str(out), timeout=170, cwd=tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    prof = load_profile(str(out))
    assert [(r.rank, r.host) for r in prof.ranks] == [(0, "node-0"), (1, "node-0"), (2, "node-1"), (3, "node-1")]
    cross = [x for x in prof.links if (x.src < 2) != (x.dst < 2)]
    inside = [x for x in prof.links if (x.src < 2) == (x.dst < 2)]
    assert len(cross) == 8 and len(inside) == 4
    # the largest message of every link between the nodes moves at the shaped rate (TCP/IP headers
    # take ~4% of a 1500-byte frame), and the fitted bandwidths centre on it
    for x in cross:
        assert x.sizes_bytes[-1] / x.times_s[-1] == pytest.approx(rate, rel=0.15), x
    fitted = sorted(x.bandwidth_bytes_per_s for x in cross)
    for bw in fitted:  # every fitted link: the profile's link matrix reflects the shaping
        assert bw == pytest.approx(rate, rel=0.15), fitted
    assert min(x.bandwidth_bytes_per_s for x in inside) > 10 * max(fitted), (inside, fitted)


@needs_testbed
@pytest.mark.e2e
def test_emitted_node_scripts_keep_the_plan_across_the_testbed(tmp_path):
    """search --emit on the testbed's cluster file, then each node runs its node-K.sh from its own
    copy of the launch directory (as two hosts would): each host's ranks are the ones its script
    names, and each rank runs the pipeline stage and layers the plan gives that rank."""
    from autoconf.cost.estimate import estimate
    from autoconf.launch.emit import emit
    from autoconf.launch.hosts import node_plan
    from autoconf.space.config import ParallelConfig, layers_per_chunk
    from autoconf.space.degrees import rank_coords
    from autoconf.specs.cluster import load_cluster
    from autoconf.specs.model import preset

    nodes = tbm.plan_nodes(["1gbit", "200mbit"], "actb0x0000")
    (tmp_path / "tb.yaml").write_text(tbp.cluster_yaml(nodes, 2))
    cluster = load_cluster(str(tmp_path / "tb.yaml"))
    model = preset("tiny")
    config = ParallelConfig(dp=1, pp=2, tp=2, micro_batch_size=1, num_micro_batches=2)
    emit(estimate(config, model, cluster), model, cluster, str(tmp_path / "plan"), master_port=29561)
    for k in (0, 1):
        subprocess.run(["cp", "-r", str(tmp_path / "plan"), str(tmp_path / f"host-{k}")], check=True)
    # MASTER_ADDR unset: the scripts' default, host 0's name, resolves inside the testbed
    p = _cli("testbed", "--rates", "1gbit,200mbit", "--nproc-per-node", "2", "--master-port", "29561", "--",
             "env", "-u", "MASTER_ADDR", "bash", str(tmp_path / "host-{node_rank}" / "node-{node_rank}.sh"),
             timeout=170)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    layers = layers_per_chunk(model.num_layers, 2)
    stage_layers = [list(range(0, layers[0])), list(range(layers[0], model.num_layers))]
    for host in node_plan(cluster, config.world_size):
        k = int(host["host"].split("-")[1])
        want = list(range(host["first_rank"], host["first_rank"] + host["nproc"]))
        files = sorted(glob.glob(str(tmp_path / f"host-{k}" / "results" / "rank_*.json")))
        got = sorted(int(os.path.basename(f)[5:-5]) for f in files)
        assert got == want == [2 * k, 2 * k + 1]
        for f in files:
            r = json.loads(open(f).read())
            c = rank_coords(r["rank"], 1, 2, 2, config.rank_order)
            assert r["ok"] and r["coords"]["pp"] == c["pp"] == k and r["coords"]["tp"] == c["tp"]
            assert r["layers"] == [stage_layers[c["pp"]]]


@needs_testbed
@pytest.mark.e2e
def test_search_verifies_across_the_testbed_as_a_driver(tmp_path):
    """`autoconf testbed --driver -- autoconf search --verify 1`: the search runs once, and its
    trial runs one torchrun per emulated node, ranks 0-1 on node-0 and 2-3 on node-1."""
    nodes = tbm.plan_nodes(["1gbit", "200mbit"], "actb0x0000")
    (tmp_path / "tb.yaml").write_text(tbp.cluster_yaml(nodes, 2))
    p = _cli("testbed", "--rates", "1gbit,200mbit", "--nproc-per-node", "2", "--master-port", "29563", "--driver",
             "--", "autoconf", "search", "--model", "tiny", "--cluster", str(tmp_path / "tb.yaml"),
             "--global-batch", "8", "--verify", "1", "--steps", "3", "--storage", "none", "--json", timeout=240,
             cwd=tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    doc = json.loads(p.stdout)
    trial = doc["verified"][0]["trial"]
    assert trial["ok"], trial["reason"]
    assert [(r["rank"], r["host"]) for r in sorted(trial["per_rank"], key=lambda r: r["rank"])] == \
        [(0, "node-0"), (1, "node-0"), (2, "node-1"), (3, "node-1")]


@needs_testbed
@pytest.mark.e2e
def test_the_search_keeps_tp_inside_nodes_and_its_pick_beats_the_megatron_default(tmp_path, monkeypatch):
    """2 nodes x 2 processes, 20 mbit between the nodes: the search (placement on) keeps every
    tensor-parallel group inside a node, and its pick, measured across the nodes, beats what a
    Megatron-style default runs there (tp inside a node, data parallelism across, naive order)."""
    from autoconf.launch.plan import LaunchPlan
    from autoconf.runs.trial import run_trial
    from autoconf.space.config import ParallelConfig
    from autoconf.space.placement import Placement
    from autoconf.specs.cluster import load_cluster
    from autoconf.specs.model import preset
    from autoconf.specs.topology import Topology
    from autoconf.study.search import search

    model = preset("tiny")
    with Testbed_(["20mbit", "20mbit"], master_port=29565) as tb:
        (tmp_path / "tb.yaml").write_text(tbp.cluster_yaml(tb.nodes, 2))
        cluster = load_cluster(str(tmp_path / "tb.yaml"))
        host_of = Topology(cluster.graph()).host_of
        best = search(model, cluster, 8, gpus=4, storage=None, place=True, trials=60).top[0].config
        placed = Placement.of(best, model.num_layers)
        for g in placed.device_groups("tp"):
            assert len({host_of[d] for d in g}) == 1, (best.short(), g)
        monkeypatch.setenv(tbm.ATTACH_ENV, tbm.describe(tb.nodes, tb.master_port, 2))
        default = ParallelConfig(dp=2, pp=1, tp=2, micro_batch_size=1, num_micro_batches=4)
        runs = {}
        for name, c in (("pick", best), ("default", default), ("pick again", best)):
            r = run_trial(LaunchPlan(c, model, cluster), steps=4, warmup=1, timeout_s=180)
            assert r.ok, (name, c.short(), r.reason)
            runs.setdefault(name.split()[0], []).append(r)
    pick = min(r.step_time_s for r in runs["pick"])
    assert pick < runs["default"][0].step_time_s, (best.short(), pick, runs["default"][0].step_time_s)
    # and the processes that formed each tensor-parallel group ran on one node
    for r in runs["pick"]:
        groups: dict = {}
        for doc in r.per_rank:
            key = (doc["coords"]["dp"], doc["coords"]["pp"])
            groups.setdefault(key, set()).add(doc["host"])
        assert all(len(h) == 1 for h in groups.values()), groups
