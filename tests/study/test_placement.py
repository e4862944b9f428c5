"""Placement: the one rank order, rank -> device, layers per stage; the cost model and the trainer
reading it; the placement search (graph heuristics + local search) inside ``autoconf search``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from autoconf.cost.estimate import estimate, estimate_on
from autoconf.cost.system import System
from autoconf.errors import UserError
from autoconf.space.config import ParallelConfig, check
from autoconf.space.degrees import AXES, Degrees, axis_groups, rank_coords, rank_of
from autoconf.space.enumeration import outer_space
from autoconf.space.placement import Placement, even_layers
from autoconf.specs.cluster import cluster_from_mapping, load_cluster
from autoconf.specs.model import preset
from autoconf.study.evaluator import Evaluator
from autoconf.study.placer import Placer, describe
from autoconf.study.search import search

TWO = load_cluster("examples/clusters/two-kinds.yaml")
A100 = load_cluster("examples/clusters/a100-4x8.yaml")
ORDERS = ["tp-dp-pp", "dp-tp-pp", "pp-tp-dp", "tp-pp-dp", "dp-pp-tp", "pp-dp-tp"]


def one_host_each(first: str, second: str):
    """Two 8-GPU hosts, one of each device kind, on InfiniBand."""
    group = {"count": 1, "gpus_per_node": 8, "intra_node_bandwidth": "300 GB/s",
             "nics": {"count": 8, "bandwidth": "200 Gbit/s"}}
    return cluster_from_mapping({"name": f"{first}+{second}", "node_groups": [{**group, "device": first},
                                                                             {**group, "device": second}]})


# -- the rank order ----------------------------------------------------------------------------

@pytest.mark.parametrize("order", ORDERS)
def test_rank_order_is_one_bijection_and_groups_partition_the_ranks(order):
    dp, pp, tp = 2, 3, 4
    world = dp * pp * tp
    seen = set()
    for r in range(world):
        co = rank_coords(r, dp, pp, tp, order)
        assert rank_of(co, dp, pp, tp, order) == r
        seen.add(tuple(co[a] for a in AXES))
    assert len(seen) == world
    inner = order.split("-")[0]
    for axis in AXES:
        groups = axis_groups(dp, pp, tp, order, axis)
        assert sorted(r for g in groups for r in g) == list(range(world))
        for g in groups:  # a group varies only along its axis, in coordinate order
            cos = [rank_coords(r, dp, pp, tp, order) for r in g]
            assert [co[axis] for co in cos] == list(range(len(g)))
            assert all({a: co[a] for a in AXES if a != axis} == {a: cos[0][a] for a in AXES if a != axis}
                       for co in cos)
        if axis == inner:
            assert groups[0] == tuple(range(len(groups[0])))  # innermost axis: consecutive ranks


@pytest.mark.parametrize("order", ORDERS)
def test_trainer_groups_are_the_cost_models_groups(order):
    degrees, place = Degrees(2, 2, 2, order), Placement(2, 2, 2, order)
    for axis in AXES:
        assert degrees.groups(axis) == place.groups(axis)
    assert [degrees.coords(r) for r in range(8)] == [place.coords(r) for r in range(8)]
    stages = place.stage_ranks()
    assert all(place.coords(r)["pp"] == s for s, ranks in enumerate(stages) for r in ranks)


def test_device_order_maps_ranks_groups_and_stages_to_devices():
    order = (5, 4, 7, 6, 1, 0, 3, 2)
    p = Placement(dp=2, pp=2, tp=2, device_order=order)
    assert [p.device(r) for r in range(8)] == list(order)
    assert all(p.rank_on(p.device(r)) == r for r in range(8))
    assert p.device_groups("tp") == [tuple(order[r] for r in g) for g in p.groups("tp")]
    assert p.stage_devices() == [[5, 4, 7, 6], [1, 0, 3, 2]]
    identity = Placement(dp=2, pp=2, tp=2)
    assert identity.device_groups("dp") == identity.groups("dp") and identity.rank_on(6) == 6


def test_layers_per_chunk_default_and_given():
    p = Placement(dp=1, pp=2, tp=1, virtual_stages=2, num_layers=10)
    assert p.chunk_layer_counts() == even_layers(10, 4) == [3, 3, 2, 2]
    assert p.stage_layer_counts() == [5, 5]
    q = dataclasses.replace(p, stage_layers=(1, 4, 2, 3))
    assert q.chunk_layers() == [[0], [1, 2, 3, 4], [5, 6], [7, 8, 9]]
    assert q.stage_layer_counts() == [3, 7] and q.chunks_of_stage(1) == [1, 3]


# -- the configuration -------------------------------------------------------------------------

TINY = preset("tiny")  # 4 layers


@pytest.mark.parametrize("kw,needle", [
    ({"stage_layers": (1, 2)}, "sum to 3; expected num_layers=4"),
    ({"stage_layers": (0, 4)}, "at least 1 layer"),
    ({"stage_layers": (1, 1, 2)}, "expected one per pipeline chunk (pp x virtual_stages = 2)"),
    ({"device_order": (0, 0)}, "a device appears twice"),
    ({"device_order": (0, 2)}, "2 is not a device of 0..1"),
    ({"device_order": (1, 0, 2)}, "device_order has 3 entries"),
])
def test_invalid_placement_is_one_line_naming_the_value(kw, needle):
    c = ParallelConfig(dp=1, pp=2, tp=1, micro_batch_size=1, num_micro_batches=4, **kw)
    reason = check(c, TINY)
    assert reason and needle in reason and "\n" not in reason, reason


def test_placement_round_trips_and_old_documents_load():
    c = ParallelConfig(dp=2, pp=2, tp=1, micro_batch_size=1, num_micro_batches=4, stage_layers=(3, 1),
                       device_order=(3, 1, 2, 0))
    d = json.loads(json.dumps(c.to_dict()))
    assert d["stage_layers"] == [3, 1] and ParallelConfig.from_dict(d) == c
    plain = ParallelConfig(dp=2, pp=2, tp=1, micro_batch_size=1, num_micro_batches=4)
    assert "stage_layers" not in plain.to_dict() and "device_order" not in plain.to_dict()
    assert ParallelConfig.from_dict(plain.to_dict()) == plain
    with pytest.raises(UserError, match=r"config: stage_layers\[1\]=0"):
        ParallelConfig.from_dict({**plain.to_dict(), "stage_layers": [4, 0]})


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "autoconf", *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.getcwd()))


def test_cli_estimate_takes_a_placement_and_refuses_a_bad_one():
    base = ["estimate", "--model", "llama-2-7b", "--cluster", "examples/clusters/two-kinds.yaml", "--global-batch",
            "48", "--dp", "3", "--pp", "2", "--tp", "8", "--json"]
    p = run_cli(*base, "--stage-layers", "12,20", "--device-order", ",".join(map(str, [*range(32, 48), *range(32)])))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["config"]["stage_layers"] == [12, 20]
    p = run_cli(*base, "--stage-layers", "12,21")
    assert p.returncode == 2 and "sum to 33; expected num_layers=32" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


# -- the cost model reads it -------------------------------------------------------------------

def test_faster_stage_gets_more_layers_and_that_is_faster():
    m = preset("llama-2-7b")
    for first, second in (("a100-80gb", "h100-sxm"), ("h100-sxm", "a100-80gb")):
        cluster = one_host_each(first, second)
        ctx = System(m, cluster)
        c = ParallelConfig(dp=1, pp=2, tp=8, micro_batch_size=1, num_micro_batches=16)
        even = estimate(c, m, ctx=ctx)
        split = Placer(ctx, 16).stage_layers(c, None)
        assert split is not None and sum(split) == m.num_layers
        fast = 0 if first == "h100-sxm" else 1
        assert split[fast] > split[1 - fast]  # the H100 stage takes more layers
        uneven = estimate(dataclasses.replace(c, stage_layers=split), m, ctx=ctx)
        assert uneven.step_time_s < even.step_time_s
        # with everything on one kind the split is even again
        assert Placer(System(m, one_host_each(first, first)), 16).stage_layers(c, None) is None


def test_device_order_decides_which_stage_runs_where():
    m = preset("llama-2-7b")
    cluster = one_host_each("a100-80gb", "h100-sxm")
    c = ParallelConfig(dp=1, pp=2, tp=8, micro_batch_size=1, num_micro_batches=16, stage_layers=(8, 24))
    swapped = dataclasses.replace(c, device_order=(*range(8, 16), *range(8)))
    ctx = System(m, cluster)
    a, b = estimate(c, m, ctx=ctx), estimate(swapped, m, ctx=ctx)
    assert [s.kinds for s in describe(ctx, c)] == [(("a100-80gb", 8),), (("h100-sxm", 8),)]
    assert [s.kinds for s in describe(ctx, swapped)] == [(("h100-sxm", 8),), (("a100-80gb", 8),)]
    assert a.step_time_s < b.step_time_s  # the 24-layer stage on the H100s, not on the A100s


def test_homogeneous_cluster_heuristic_changes_nothing():
    m = preset("gpt3-1.3b")
    placer = Placer(System(m, A100), 32)
    for dp, pp, tp in ((4, 2, 4), (1, 4, 8), (32, 1, 1), (2, 8, 2)):
        c = ParallelConfig(dp=dp, pp=pp, tp=tp, micro_batch_size=1, num_micro_batches=8)
        assert placer.place(c) == c


def test_heuristic_puts_tp_in_hosts_and_stages_on_one_nic_kind():
    m = preset("llama-2-7b")
    ctx = System(m, TWO)
    topo = ctx.topology
    c = Placer(ctx, 48).place(ParallelConfig(dp=2, pp=3, tp=8, micro_batch_size=1, num_micro_batches=8))
    p = Placement.of(c, m.num_layers)
    for g in p.device_groups("tp"):
        assert len({topo.host_of[d] for d in g}) == 1
    for g in p.device_groups("dp"):  # the 2 Ethernet hosts form one stage: no dp group crosses the cap
        assert len({topo.group_of[d] for d in g}) == 1
    kinds = [s.kinds for s in describe(ctx, c)]
    assert sorted(kinds) == [(("a100-80gb", 16),), (("a100-80gb", 16),), (("h100-sxm", 16),)]
    h100 = next(s for s in describe(ctx, c) if s.kinds == (("h100-sxm", 16),))
    assert h100.layers > m.num_layers // 3


def test_local_search_never_loses_to_its_start():
    m = preset("gpt3-1.3b")
    ctx = System(m, TWO)
    placer = Placer(ctx, 48)
    c = placer.place(ParallelConfig(dp=8, pp=6, tp=1, micro_batch_size=1, num_micro_batches=6, zero_stage=1))
    start = estimate_on(c, ctx)
    better, evals = placer.improve(c, max_evaluations=60)
    assert better.fits and better.step_time_s <= start.step_time_s and 1 < evals <= 60


# -- the search --------------------------------------------------------------------------------

def _stage_shape(r):
    return [(s["kinds"], s["layers"], len(s["hosts"])) for s in r.placement[0]["stages"]]


def test_search_result_does_not_depend_on_the_order_of_node_groups():
    # large enough that its blocks are device-bound: the device kinds' order matters before placement
    m = preset("gpt3-2.7b")
    reordered = dataclasses.replace(TWO, node_groups=tuple(reversed(TWO.node_groups)))
    kw = dict(storage=None, place=True, top=1, max_micro_batch=1)
    a, b = search(m, TWO, 48, **kw), search(m, reordered, 48, **kw)
    assert a.top[0].step_time_s == pytest.approx(b.top[0].step_time_s, rel=1e-12)
    ca, cb = a.top[0].config, b.top[0].config
    assert dataclasses.replace(ca, device_order=None) == dataclasses.replace(cb, device_order=None)
    assert _stage_shape(a) == _stage_shape(b)
    # without the placement search the file's order changes the answer of the same configuration
    assert a.placement[0]["default_step_time_s"] != b.placement[0]["default_step_time_s"]
    assert a.top[0].step_time_s < min(a.placement[0]["default_step_time_s"], b.placement[0]["default_step_time_s"])


def test_a_configuration_is_never_priced_slower_than_in_the_files_order():
    # the graph heuristic can place a configuration worse than the file's order (here some of
    # gpt3-2.7b's 6-stage ones on two kinds): the search prices both and keeps the faster
    m = preset("gpt3-2.7b")
    ctx = System(m, TWO)
    placer = Placer(ctx, TWO.num_devices)
    ev = Evaluator(ctx, 48, {}, placer, top=1000)
    heuristic_worse = 0
    for point in outer_space(m, TWO.num_devices, 48, max_micro_batch=1):
        if point[1] != 6:
            continue
        for e in ev(point)[0]:
            plain = dataclasses.replace(e.config, device_order=None, stage_layers=None)
            default = estimate_on(plain, ctx)
            assert e.step_time_s <= default.step_time_s or not default.fits
            heuristic = estimate_on(placer(plain), ctx)
            heuristic_worse += heuristic.fits and default.fits and heuristic.step_time_s > default.step_time_s
    assert heuristic_worse > 0  # (else this test could not fail)


def test_placed_search_never_loses_to_a_placement_blind_one_in_any_listing():
    # every configuration is priced placed and in the file's own order, the faster kept: the
    # placed search's best is at most the blind search's of the file, whatever its listing
    m = preset("gpt3-2.7b")
    kw = dict(storage=None, top=1, max_micro_batch=1)
    for cl in (TWO, dataclasses.replace(TWO, node_groups=tuple(reversed(TWO.node_groups)))):
        placed, blind = search(m, cl, 48, place=True, **kw), search(m, cl, 48, place=False, **kw)
        assert placed.top[0].step_time_s <= blind.top[0].step_time_s


def test_faster_gpus_change_the_searched_prediction():
    m = preset("gpt3-2.7b")  # GPT-3 1.3B's blocks at micro-batch 1 are host-bound: any GPU takes as long
    slow = dataclasses.replace(TWO, node_groups=tuple(dataclasses.replace(g, device="a100-80gb")
                                                      for g in TWO.node_groups))
    kw = dict(storage=None, place=True, top=1, max_micro_batch=1)
    assert search(m, TWO, 48, **kw).top[0].step_time_s < search(m, slow, 48, **kw).top[0].step_time_s


def test_cli_search_reports_and_records_the_placement(tmp_path):
    p = run_cli("search", "--model", "gpt3-1.3b", "--cluster", "examples/clusters/two-kinds.yaml", "--global-batch",
                "48", "--max-micro-batch", "1", "--top", "1", "--storage", "none", "--emit", str(tmp_path / "plan"))
    assert p.returncode == 0, p.stderr
    assert "placement of the best configuration" in p.stdout and "faster than the default order" in p.stdout
    assert "h100-sxm" in p.stdout and "node-4" in p.stdout
    plan = json.loads((tmp_path / "plan" / "config.json").read_text())
    c = ParallelConfig.from_dict(plan["config"])
    # the placement is recorded: the device order, and with pp > 1 the uneven layer split
    assert c.device_order is not None or c.stage_layers is not None
    assert check(c, preset("gpt3-1.3b")) is None
    off = run_cli("search", "--model", "gpt3-1.3b", "--cluster", "examples/clusters/two-kinds.yaml",
                  "--global-batch", "48", "--max-micro-batch", "1", "--top", "1", "--storage", "none", "--no-place",
                  "--json")
    assert off.returncode == 0, off.stderr
    d = json.loads(off.stdout)
    assert d["placement"] == [] and "stage_layers" not in d["best"]["config"]


# -- the trainer honours it (torchrun, gloo) ---------------------------------------------------

torch = pytest.importorskip("torch")
SEED, STEPS, GLOBAL_BATCH = 1234, 3, 8


def reference_losses(model):
    """One process, no parallelism, the whole global batch at once."""
    from autoconf.trainer import layers as gpt
    from autoconf.trainer.data import global_batch
    from autoconf.trainer.run import ADAMW

    torch.manual_seed(SEED)
    net = gpt.GPT(model, dtype=torch.float32, seed=SEED)
    opt = torch.optim.AdamW(net.parameters(), **ADAMW)
    out = []
    for step in range(STEPS):
        x, y = global_batch(step, GLOBAL_BATCH, model.seq_length, model.vocab_size, SEED)
        loss = net(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss.detach()))
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("dp,stage_layers,device_order", [
    (1, (1, 3), None),
    (2, (3, 1), (2, 0, 3, 1)),  # rank 0 (stage 0, replica 0) on device 2, ...
])
def test_trainer_runs_the_placement(dp, stage_layers, device_order, tmp_path):
    from autoconf.launch.plan import LaunchPlan
    from autoconf.runs.trial import run_trial

    c = ParallelConfig(dp=dp, pp=2, tp=1, micro_batch_size=1, num_micro_batches=GLOBAL_BATCH // dp,
                       stage_layers=stage_layers, device_order=device_order)
    assert check(c, TINY) is None
    result = run_trial(LaunchPlan(c, TINY, seed=SEED), steps=STEPS, warmup=1, timeout_s=180, out_dir=str(tmp_path))
    assert result.ok, result.reason
    assert result.losses == pytest.approx(reference_losses(TINY), rel=1e-5, abs=1e-5)
    place = Placement.of(c, TINY.num_layers)
    layers = place.chunk_layers()
    for r in result.per_rank:  # the process on device d plays the rank the order gives it
        d = r["rank"]
        rank = place.rank_on(d)
        assert r["placement_rank"] == rank and r["coords"] == place.coords(rank)
        assert r["layers"] == [layers[r["coords"]["pp"]]]


def _grads_worker(rank: int, world: int, port: int, splits: list) -> None:
    """pp=2 on two processes: after one step's backward, every local gradient of an uneven split
    equals the single-process model's."""
    import datetime

    import torch.distributed as dist

    from autoconf.trainer import data
    from autoconf.trainer import layers as gpt
    from autoconf.trainer.piped import Piped
    from autoconf.trainer.process_groups import build_groups
    from autoconf.trainer.run import chunk_layers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    x, y = data.global_batch(0, GLOBAL_BATCH, TINY.seq_length, TINY.vocab_size, SEED)
    ref = gpt.GPT(TINY, dtype=torch.float32, seed=SEED)
    ref(x, y).backward()
    expected = {n: p.grad for n, p in ref.named_parameters()}
    for split in splits:
        config = ParallelConfig(dp=1, pp=2, tp=1, micro_batch_size=2, num_micro_batches=4, stage_layers=split)
        groups = build_groups(Degrees(1, 2, 1), rank, timeout)
        common = dict(tp_size=1, tp_group=None, sequence_parallel=False, recompute="none", dtype=torch.float32,
                      seed=SEED, device=torch.device("cpu"))
        runner = Piped(TINY, config, groups, torch.device("cpu"), chunk_layers(TINY, config), common)
        runner.step(x, y)
        names = [n for m in runner.modules() for n, _ in m.named_parameters()]
        blocks = {int(n.split(".")[1]) for n in names if n.startswith("blocks.")}
        assert blocks == set(chunk_layers(TINY, config)[rank]), (split, blocks)
        for m in runner.modules():
            for n, p in m.named_parameters():
                torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-7, msg=f"{split} {n}")
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
def test_uneven_stage_gradients_match_single_process():
    import torch.multiprocessing as mp

    port = _free_port()
    mp.spawn(_grads_worker, args=(2, port, [(1, 3), (3, 1), (2, 2)]), nprocs=2)


def _setup_worker(process_rank: int, world: int, port: int, order: tuple) -> None:
    """A plain env:// launch (no torchrun agent): the process of device RANK starts the default
    group at the rank the order gives it; RANK 0 hosts the store whatever rank it plays."""
    import torch.distributed as dist

    from autoconf.trainer.run import setup

    for k in ("TORCHELASTIC_USE_AGENT_STORE", "LOCAL_RANK"):
        os.environ.pop(k, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(process_rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    c = ParallelConfig(dp=2, pp=2, tp=1, micro_batch_size=1, num_micro_batches=4, device_order=order)
    _, _, groups = setup(c, 60)
    place = Placement.of(c, 4)
    assert dist.get_rank() == groups.rank == place.rank_on(process_rank)
    assert groups.coords == place.coords(groups.rank)
    assert groups.pp_ranks == list(next(g for g in place.groups("pp") if groups.rank in g))
    got = [None] * world
    dist.all_gather_object(got, process_rank)
    assert got == [place.device(r) for r in range(world)]  # rank r is the process of device order[r]
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.e2e
def test_plain_env_launch_starts_each_process_at_its_placed_rank():
    import torch.multiprocessing as mp

    port = _free_port()
    mp.spawn(_setup_worker, args=(4, port, (2, 0, 3, 1)), nprocs=4)


# -- a placed plan on two emulated nodes (root, ip, tc: autoconf.runs.testbed) -----------------------

def _testbed_reason():
    from autoconf.runs import testbed

    return testbed.unavailable_reason(probe=True) if sys.platform.startswith("linux") else "needs Linux"


@pytest.mark.e2e
def test_placed_plan_runs_its_stages_on_the_hosts_it_names(tmp_path):
    """Stage 0 (3 layers) on the second host, stage 1 (1 layer) on the first: the emitted node
    scripts start the processes of each host's devices, and each plays the rank the order gives it."""
    reason = _testbed_reason()
    if reason is not None:
        pytest.skip(f"no testbed here: {reason}")
    import glob

    from autoconf.launch.emit import emit
    from autoconf.runs import testbed_plan

    (tmp_path / "tb.yaml").write_text(testbed_plan.cluster_yaml(testbed_plan.plan_nodes(["1gbit", "200mbit"], "acpl0x0000"), 2))
    cluster = load_cluster(str(tmp_path / "tb.yaml"))
    c = ParallelConfig(dp=1, pp=2, tp=2, micro_batch_size=1, num_micro_batches=2, stage_layers=(3, 1),
                       device_order=(2, 3, 0, 1))
    emit(estimate(c, TINY, cluster), TINY, cluster, str(tmp_path / "plan"), master_port=29563)
    for k in (0, 1):
        subprocess.run(["cp", "-r", str(tmp_path / "plan"), str(tmp_path / f"host-{k}")], check=True)
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    p = subprocess.run([sys.executable, "-m", "autoconf", "testbed", "--rates", "1gbit,200mbit", "--nproc-per-node",
                        "2", "--master-port", "29563", "--", "env", "-u", "MASTER_ADDR", "bash",
                        str(tmp_path / "host-{node_rank}" / "node-{node_rank}.sh")],
                       capture_output=True, text=True, env=env, timeout=170)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    place = Placement.of(c, TINY.num_layers)
    layers = place.chunk_layers()
    names = cluster.host_names()
    stages = {}
    for k in (0, 1):
        for f in sorted(glob.glob(str(tmp_path / f"host-{k}" / "results" / "rank_*.json"))):
            r = json.loads(open(f).read())
            assert r["ok"], r.get("reason")
            device = r["rank"]  # torchrun's rank: the devices of host k are 2k, 2k + 1
            assert device // 2 == k and r["host"] == names[k]
            rank = place.rank_on(device)
            assert r["placement_rank"] == rank and r["coords"] == place.coords(rank)
            assert r["layers"] == [layers[r["coords"]["pp"]]]
            stages.setdefault(r["coords"]["pp"], set()).add(r["host"])
    assert stages == {0: {names[1]}, 1: {names[0]}}
