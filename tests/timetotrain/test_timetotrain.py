"""autoconf plan: the fast per-point optimiser is exact for the cost model (its bounds are bounds,
its shortcuts change nothing), and the sweep, its selections and the command behave."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from importlib import resources

import pytest

from autoconf.cost.estimate import estimate_on
from autoconf.cost.system import System
from autoconf.errors import UserError
from autoconf.output import plan_report
from autoconf.space.config import ParallelConfig, check
from autoconf.space.enumeration import inner_choices, make_config, point_config
from autoconf.specs.model import preset
from autoconf.specs.topology import Topology
from autoconf.study.choices import dp_hierarchical, framework_inner
from autoconf.study.search import search
from autoconf.timetotrain import budget, synthetic
from autoconf.timetotrain import planner as T

GPT = preset("gpt3-1.3b")


def test_uniform_topology_reads_as_the_graph_does():
    cl = T.synthetic_cluster("h100-sxm", 32, "25gbe")
    fast, slow = synthetic._UniformTopology(cl), Topology(cl.graph())
    for attr in ("num_devices", "host_of", "group_of", "kind_of", "memory_of", "intra_latency_s", "inter_latency_s",
                 "host_nic_kind", "host_name", "host_nic_bw", "host_nic_total", "host_intra_bw", "group_cap",
                 "measured"):
        assert getattr(fast, attr) == getattr(slow, attr), attr


@pytest.mark.parametrize("network", ["ib", "25gbe"])
def test_prefilled_links_give_the_cost_models_own_estimates(network):
    """One representative group per axis (``_prefill``) against every group enumerated."""
    cl = T.synthetic_cluster("a100-80gb", 128, network)
    fast, slow = T.planning_system(GPT, cl), System(GPT, cl)
    rng = random.Random(1)
    prefilled = 0
    shapes = [(dp, pp, tp) for tp in (1, 2, 4, 8, 16) for pp in (1, 2, 4, 8) for dp in (1, 2, 4, 8, 16, 32)
              if dp * pp * tp in (64, 128)]
    n = 0
    for dp, pp, tp in shapes:
        for sched, v, layered in ([("1f1b", 1, False)] if pp == 1 else [("1f1b", 1, False), ("interleaved", 2, False),
                                                                         ("breadth_first", 2, True)]):
            zero = rng.choice([0, 1, 2, 3]) if dp > 1 else 0
            c = make_config(dp, pp, tp, 1, sched, v, layered, zero, rng.choice(["none", "full"]), tp > 1, 128)
            if check(c, GPT):
                continue
            synthetic._prefill(fast, c)
            prefilled += ("p2p", c.dp, c.pp, c.tp, c.cp, c.rank_order, c.device_order) in fast._cache
            a, b = estimate_on(c, fast), estimate_on(c, slow)
            assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-12), c.short()
            assert a.peak_memory_bytes == pytest.approx(b.peak_memory_bytes, rel=1e-12), c.short()
            assert a.mfu == pytest.approx(b.mfu, rel=1e-12)
            n += 1
    assert n > 40
    assert prefilled > n // 2  # the shortcut's keys are the cost model's: it is used


BF16 = ("bf16", "tensorwise")
LONG = dataclasses.replace(preset("llama-3-8b"), seq_length=32768)
# a mixture of experts with dense blocks first (chunks of both kinds), 12 blocks of Qwen3-30B-A3B
MOE = dataclasses.replace(preset("qwen3-30b-a3b"), num_layers=12, first_dense_layers=2, ffn_hidden_size=6144,
                          name="moe-12")


@pytest.mark.parametrize("network,framework,device,precision,model", [
    ("ib", None, "a100-80gb", BF16, GPT), ("25gbe", None, "a100-80gb", BF16, GPT),
    ("100gbe", "megatron", "a100-80gb", BF16, GPT), ("ib", "torchtitan", "a100-80gb", BF16, GPT),
    ("ib", "megatron", "h100-sxm", ("fp8", "delayed"), GPT), ("25gbe", None, "h100-sxm", ("fp8", "rowwise"), GPT),
    ("ib", None, "h100-sxm", BF16, LONG), ("100gbe", "megatron", "h100-sxm", BF16, LONG),
    ("ib", "torchtitan", "h100-sxm", ("fp8", "rowwise"), LONG), ("25gbe", "deepspeed", "a100-80gb", BF16, GPT),
    ("ib", "megatron", "h100-sxm", BF16, MOE), ("25gbe", None, "a100-80gb", BF16, MOE),
    ("ib", "torchtitan", "h100-sxm", ("fp8", "rowwise"), MOE)])
def test_the_bounds_are_bounds(network, framework, device, precision, model):
    """Every pruning bound is at most what the cost model computes: the time bound of each inner
    choice, and a memory floor over capacity only where the estimate does not fit (also in FP8,
    whose GEMMs are faster and whose saved inputs are smaller under Megatron; with torchtitan's
    torch.compile knob; with context parallelism on a 32K sequence; for a mixture of experts at
    every expert-parallel degree, its experts split over tp (Megatron) or whole (the others))."""
    cl = T.synthetic_cluster(device, 64, network)
    system = T.planning_system(model, cl, framework=framework)
    opt = T.PointOptimizer(system, precision=precision)
    rng = random.Random(7)
    checked = oom = 0
    cps, eps = set(), set()
    for batch in (64, 256):
        pts = opt.points(64, batch) + opt.points(32, batch)
        for p in rng.sample(pts, min(len(pts), 70)):
            b = opt.bounds(p, batch)
            dp, pp, tp, mbs, sched, v, layered, cp = p
            cps.add(cp)
            synthetic._prefill(system, point_config(p, 0, "none", False, batch))
            for c in framework_inner(system.framework, dp, pp, tp, mbs, sched, v, layered, batch,
                                     dp_hierarchical(system, dp, pp, tp), cp, moe_experts=model.num_experts):
                c = opt._prec(c)
                if check(c, model):
                    continue
                assert c.precision == precision[0]
                eps.add(c.ep)
                synthetic._prefill(system, c)
                e = estimate_on(c, system)
                key = (c.sequence_parallel, c.recompute, c.zero_stage)
                if key not in b:
                    assert not e.fits, f"memory floor refused {c.short()} that fits"
                    oom += 1
                    continue
                assert b[key] <= e.step_time_s * (1 + 1e-9), (c.short(), b[key], e.step_time_s)
                checked += 1
    assert checked > 200
    assert len(cps) > 1 if model is LONG else cps == {1}
    assert len(eps) > 3 if model is MOE else eps == {1}


def _checked_estimates(system, opt, model, points, batch: int):
    """Every valid inner configuration of ``points`` at ``batch`` with its estimate, checked
    against the point's bounds: a memory floor refuses only what does not fit, a time bound is at
    most the estimate. Yields (configuration, estimate, whether a time bound covered it)."""
    for p in points:
        b = opt.bounds(p, batch)
        dp, pp, tp, mbs, sched, v, layered, cp = p
        for c in framework_inner(system.framework, dp, pp, tp, mbs, sched, v, layered, batch,
                                 dp_hierarchical(system, dp, pp, tp), cp):
            c = opt._prec(c)
            if check(c, model):
                continue
            e = estimate_on(c, system)
            key = (c.sequence_parallel, c.recompute, c.zero_stage)
            if key not in b:
                assert not e.fits, f"memory floor refused {c.short()} that fits"
                yield c, e, False
                continue
            assert b[key] <= e.step_time_s * (1 + 1e-9), (c.short(), b[key], e.step_time_s)
            yield c, e, True


@pytest.mark.parametrize("framework", ["megatron", "torchtitan"])
def test_the_bounds_are_bounds_with_a_gpu_profile(framework):
    """With a profile's measured GEMM table (which can rate small GEMMs faster than large ones, so
    a GEMM split into tp chunks faster than whole) the exposed tensor-parallel time of a pipelined
    ``tp_comm_overlap`` is never negative, and every bound stays at or below the estimate."""
    from autoconf.specs.hf import load_model
    from autoconf.specs.profile import load_profile

    root = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
    model = load_model(os.path.join(root, "models", "llama3-8l.yaml"))
    system = T.planning_system(model, T.synthetic_cluster("h100-sxm", 16, "ib"), framework=framework,
                               profile=load_profile(os.path.join(root, "profiles", "h100-sxm-llama3-8l.json")))
    opt = T.PointOptimizer(system)
    rng = random.Random(3)
    checked = overlapped = 0
    for batch in (32, 128):
        pts = opt.points(16, batch)
        for c, e, bounded in _checked_estimates(system, opt, model, rng.sample(pts, min(len(pts), 40)), batch):
            assert e.breakdown_s.get("tp_comm", 0.0) >= 0.0, c.short()
            checked += bounded
            overlapped += bounded and bool(c.tp_comm_overlap)
    assert checked > 100 and overlapped > 10


def test_the_bounds_are_bounds_on_cpu_ranks_sharing_cores():
    """On an oversubscribed CPU testbed (four ranks, two emulated nodes, one 2-core machine, from a
    committed profile) the schedule simulation runs at processor-sharing rates, faster than the
    fixed core share where stages take turns: the plan's bounds take compute at one core per rank
    and stay below every estimate."""
    from autoconf.specs.cluster import load_cluster
    from autoconf.specs.hf import load_model
    from autoconf.specs.profile import load_profile

    data = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "data", "testbed-compression-2026-11-24")
    model = load_model(os.path.join(data, "model.json"))
    system = T.planning_system(model, load_cluster(os.path.join(data, "testbed.yaml")),
                               profile=load_profile(os.path.join(data, "profile.json")))
    assert system.cpu_share("cpu") == 2.0 and system.cpu_sharing(((0, 1), (2, 3))).cores == (2.0,)
    opt = T.PointOptimizer(system)
    checked = pipelined = 0
    for batch in (8, 16):
        for c, e, bounded in _checked_estimates(system, opt, model, opt.points(4, batch), batch):
            checked += bounded
            pipelined += bounded and c.pp > 1
    assert checked > 50 and pipelined > 20


@pytest.mark.parametrize("model,network,gpus,batch,device,precision", [
    ("gpt3-1.3b", "ib", 32, 64, "a100-80gb", "bf16"), ("llama-3-8b", "25gbe", 64, 256, "a100-80gb", "bf16"),
    ("gpt3-1.3b", "ib", 32, 64, "h100-sxm", "fp8"), ("llama-3-8b-32k", "ib", 32, 2, "h100-sxm", "bf16"),
    ("moe-12", "ib", 32, 64, "h100-sxm", "bf16")])
def test_the_optimiser_finds_searchs_exhaustive_optimum(model, network, gpus, batch, device, precision):
    m = LONG if model == "llama-3-8b-32k" else MOE if model == "moe-12" else preset(model)
    cl = T.synthetic_cluster(device, gpus, network)
    prec = ("fp8", "tensorwise") if precision == "fp8" else ("bf16", "tensorwise")
    best, st = T.PointOptimizer(T.planning_system(m, cl), precision=prec).run(gpus, batch)
    ref = search(m, cl, batch, storage=None, place=False, top=1, precision=precision, fp8_recipe=prec[1])
    assert best["all"].config.precision == ref.top[0].config.precision == precision
    assert best["all"].step_time_s == pytest.approx(ref.top[0].step_time_s, rel=1e-9)
    assert best["all"].config.cp == ref.top[0].config.cp
    assert (best["all"].config.cp > 1) == (m is LONG)  # 2 sequences of 32K on 32 GPUs: split
    assert best["all"].config.ep == ref.top[0].config.ep
    # the bounds decide most of the space (a mixture of experts' leave the all-to-alls out: looser
    # than search's own, which estimate each expert-parallel degree)
    assert st.estimates < ref.estimates or m is MOE


def test_methods_restrict_the_space():
    cl = T.synthetic_cluster("a100-80gb", 64, "ib")
    best, _ = T.PointOptimizer(T.planning_system(GPT, cl)).run(64, 128)
    c = {k: e.config for k, e in best.items() if e is not None}
    assert c["baseline"].virtual_stages == 1 and not c["baseline"].layered_grad_accum
    assert c["no-modular"].virtual_stages == 1
    assert not c["no-layered"].layered_grad_accum and c["no-layered"].schedule != "breadth_first"
    assert c["no-zero"].zero_stage == 0 and c["zero<=1"].zero_stage <= 1
    for k, e in best.items():
        assert best["all"].step_time_s <= e.step_time_s


def test_live_counts_closed_forms():
    cl = T.synthetic_cluster("a100-80gb", 8, "ib")
    opt = T.PointOptimizer(T.planning_system(GPT, cl))
    from autoconf.cost import bounds
    from autoconf.cost.schedule_time import sim_size
    for sched, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("breadth_first", (2, 3))):
        for pp in (2, 3, 4, 8):
            for m in (1, 3, 8, 40, 100):
                for v in vs:
                    m_sim = sim_size(sched, pp, m)
                    scale = m / m_sim if sched in ("gpipe", "breadth_first") else 1.0
                    want = [x * scale for x in bounds.live_counts(sched, pp, m_sim, v)]
                    assert list(opt._live(sched, pp, m, v, False)) == pytest.approx(want), (sched, pp, m, v)


def test_round_batch_and_budget():
    assert [budget.round_batch(x) for x in (1, 5, 7, 11_157, 21_300, 40_000)] == [1, 6, 8, 12_288, 24_576, 32_768]
    b = T.make_budget(GPT, tokens=2e11)
    assert b.law == "kaplan" and b.tokens == 2e11 and "given" in b.tokens_rule
    at = b.b_crit_tokens / GPT.seq_length
    plan_at = b.plan(at)  # at B_crit: exactly the given tokens, in D / B_crit steps
    assert plan_at.tokens == pytest.approx(2e11) and plan_at.steps == pytest.approx(2e11 / b.b_crit_tokens)
    half = b.plan(at / 2)  # half the batch: 3/4 of the tokens in 1.5x the steps
    assert half.tokens == pytest.approx(0.75 * 2e11) and half.steps == pytest.approx(1.5 * plan_at.steps)
    fixed = T.make_budget(GPT, tokens=2e11, law="fixed", global_batch=512)
    assert fixed.batches == (512,) and fixed.plan(512).steps == pytest.approx(2e11 / (512 * 2048))
    d = T.make_budget(GPT, law="deepseek")
    assert d.tokens == pytest.approx(20 * GPT.num_params()) and d.compute_flops > 0 and len(d.batches) == 1
    with pytest.raises(UserError, match="needs --global-batch"):
        T.make_budget(GPT, law="fixed")
    with pytest.raises(UserError, match="valid: kaplan, deepseek, fixed"):
        T.make_budget(GPT, law="mine")


@pytest.fixture(scope="module")
def small_plan():
    return T.plan(GPT, device="a100-80gb", max_gpus=64, tokens=2.6e10, price_per_gpu_hour=2.0,
                  deadline_days=3.0, budget=2000.0, mtbf_per_gpu_h=20000.0, compare_networks=("25gbe",))


def test_sweep_selections(small_plan):
    r = small_plan
    rows = r.select()
    assert rows and {x.network for x in r.rows} == {"ib", "25gbe"}
    sh = r.shortest()
    assert sh.days == min(x.days for x in rows)
    front = r.pareto()
    cost = r._cost
    for x in rows:  # every plan is on the front or beaten on both axes by a plan of the front
        assert x in front or any(f.days <= x.days and cost(f) <= cost(x) for f in front)
    for f in front:
        assert not any(x.days < f.days and cost(x) < cost(f) for x in rows)
    d = r.cheapest_within(3.0)
    assert d is not None and d.days <= 3.0
    assert cost(d) == min(cost(x) for x in rows if x.days <= 3.0)
    b = r.fastest_within_cost(2000.0)
    assert b is None or (cost(b) <= 2000.0 and b.days == min(x.days for x in rows if cost(x) <= 2000.0))
    sat = r.saturation()
    assert sat.days <= 1.1 * sh.days and all(x.days > 1.1 * sh.days for x in r.per_gpus() if x.gpus < sat.gpus)
    for x in rows:  # restarts and checkpoints are in the days
        assert x.days > x.work_days and x.goodput is not None
        assert x.gpu_hours == pytest.approx(x.days * 24 * x.gpus) and x.cost == pytest.approx(2.0 * x.gpu_hours)
        assert x.steps * x.step_time_s == pytest.approx(x.work_days * 86400)
    doc = json.loads(json.dumps(r.to_dict(), default=float))
    assert doc["shortest"]["gpus"] == sh.gpus and doc["deadline_plan"]["gpus"] == d.gpus
    assert "--gpus" in doc["search_command"] and doc["budget"]["laws"][0]["source"].startswith("Kaplan")


def _run(*argv, env_extra=None):
    env = dict(os.environ, PYTHONPATH=os.getcwd(), COLUMNS="200", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "autoconf", "plan", *argv], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.parametrize("argv,needle", [
    (["--device", "b200", "--max-gpus", "64"], "--device 'b200'; valid: a100-40gb"),
    (["--device", "a100-80gb", "--max-gpus", "64", "--network", "eth"], "network 'eth'; valid: ib, 100gbe, 25gbe"),
    (["--device", "a100-80gb", "--max-gpus", "60"], "must be a multiple of 8"),
    (["--device", "a100-80gb", "--max-gpus", "64", "--deadline", "soon"], "--deadline 'soon'"),
    (["--device", "a100-80gb", "--max-gpus", "64", "--tokens", "lots"], "--tokens 'lots'"),
    (["--device", "a100-80gb", "--max-gpus", "64", "--batch-law", "fixed"], "needs --global-batch"),
    (["--device", "a100-80gb", "--max-gpus", "64", "--batch-law", "huge"], "valid: kaplan, deepseek, fixed"),
    (["--device", "a100-80gb", "--max-gpus", "64", "--budget", "1M"], "give --price-per-gpu-hour"),
    (["--max-gpus", "64"], "give --device NAME (or --cluster FILE)"),
    (["--device", "a100-80gb", "--max-gpus", "64", "--precision", "fp8"], "device a100-80gb has no FP8 tensor cores"),
    (["--device", "h100-sxm", "--max-gpus", "64", "--fp8-recipe", "rowwise"], "--fp8-recipe rowwise: needs --precision fp8"),
    (["--device", "h100-sxm", "--max-gpus", "64", "--precision", "fp8", "--fp8-recipe", "delayed"],
     "framework reference runs tensorwise, rowwise"),
    (["--device", "a100-80gb", "--max-gpus", "64", "--tokens", "1e-300"], "--tokens 1e-300: fewer than one sequence"),
    (["--device", "a100-80gb", "--max-gpus", "64", "--batch-factors", "1e7"], "even the smallest batch"),
    (["--device", "a100-80gb", "--max-gpus", "64", "--batch-law", "deepseek", "--batch-factors", "1,2"],
     "--batch-law deepseek sets the batch itself"),
    (["--device", "a100-80gb", "--max-gpus", "64", "--restart-time", "-1"], "--restart-time"),
    (["--device", "a100-80gb", "--max-gpus", "64", "--tokens", "-1T"], "--tokens '-1T': expected a number"),
    (["--device", "a100-80gb", "--max-gpus", "64", "--deadline", "-5d"], "--deadline '-5d': expected a duration"),
    (["--device", "a100-80gb", "--max-gpus", "16", "--mtbf-per-gpu", "1h"], "--mtbf-per-gpu 1 h: even on 8 GPUs"),
    (["--device", "a100-40gb", "--max-gpus", "8", "--model", "llama-2-70b", "--batch-law", "fixed",
      "--global-batch", "1", "--max-days", "1e9"], "no configuration of llama-2-70b fits in memory"),
])
def test_bad_input_is_one_line_and_exit_2(argv, needle):
    p = _run("--model", "gpt3-1.3b", *argv)
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and needle in p.stderr, p.stderr


def test_the_command_prints_80_columns_json_and_plots(tmp_path):
    argv = ["--model", "gpt3-1.3b", "--device", "a100-80gb", "--max-gpus", "32", "--tokens", "26B",
            "--compare-networks", "none", "--price-per-gpu-hour", "2", "--deadline", "2d",
            "--cluster-out", str(tmp_path / "c.yaml")]
    p = _run(*argv, "--plot", str(tmp_path / "plots"))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert max(len(x) for x in lines) <= 80
    assert any(x.startswith("shortest time:") for x in lines)
    cmd = next(x for x in lines if "reproduce the shortest plan" in x)
    assert "autoconf search" in cmd
    for name in ("days_vs_gpus", "cost_vs_days"):
        for ext in ("png", "svg"):
            assert (tmp_path / "plots" / f"{name}.{ext}").stat().st_size > 1000
    from autoconf.specs.cluster import load_cluster
    assert load_cluster(str(tmp_path / "c.yaml")).num_devices == 32
    j = _run(*argv, "--json")
    doc = json.loads(j.stdout)
    assert doc["shortest"]["gpus"] <= 32 and doc["deadline_days"] == 2.0
    assert {r["network"] for r in doc["rows"]} == {"ib"}
    # the days come with the cost model's stated step-time accuracy and what it means for them
    stated = json.loads(resources.files("autoconf").joinpath("data/accuracy.json").read_text())["step_time"]
    assert doc["step_time_accuracy"] == stated
    days, e = doc["shortest"]["days"], stated["max_abs_error"]
    assert doc["shortest_days_range"]["max"] == pytest.approx([days / (1 + e), days / (1 - e)])
    assert 0 < stated["median_abs_error"] < stated["max_abs_error"] < 1
    text = " ".join(lines)
    assert f"median |error| {100 * stated['median_abs_error']:.1f}%" in text and "reads as" in text


def test_gpu_counts_that_would_never_finish_are_left_out_and_said():
    """With failures, the job on g GPUs fails every MTBF/g on average; where that is shorter than a
    restart and half a checkpoint interval (Young's interval, scaling.expected_wall_time) the run
    never finishes: those counts are left out, the others planned, and the note names them."""
    from autoconf.timetotrain import laws as scaling
    mtbf_h, ckpt, restart = 10.0, 120.0, 600.0
    r = T.plan(GPT, device="a100-80gb", max_gpus=64, tokens=2.6e10, compare_networks=(), mtbf_per_gpu_h=mtbf_h,
               checkpoint_s=ckpt, restart_s=restart)

    def finishes(g):
        m = mtbf_h * 3600 / g
        return restart + (scaling.young_daly_interval(ckpt, m) + ckpt) / 2 < m
    assert r.never_finish == tuple(g for g in r.grid if not finishes(g)) and r.never_finish == (64,)
    assert {x.gpus for x in r.select()} == {g for g in r.grid if finishes(g)}
    assert any("64 GPUs left out" in n for n in r.notes)
    assert r.to_dict()["never_finish"] == [64]


def test_the_report_says_when_more_gpus_are_slower():
    """A fixed batch of 8 sequences bounds dp at 8: more GPUs only add tp or pp, and the output says
    so instead of claiming that adding GPUs still pays."""
    p = _run("--model", "gpt2", "--device", "a100-80gb", "--max-gpus", "64", "--compare-networks", "none",
             "--batch-law", "fixed", "--global-batch", "8")
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    assert "more GPUs than 8 are no faster" in text and "still pays" not in text


def test_days_under_one_keep_two_significant_figures():
    assert plan_report._days(0.0844) == "0.084" and plan_report._days(3.14159) == "3.1" and plan_report._days(12345.6) == "12,346"


def test_reproduce_command_finds_the_same_step_time(tmp_path):
    """The printed `autoconf search` command, run on the written cluster file, finds the plan's
    step time (the same space, exhaustively)."""
    r = T.plan(GPT, device="a100-80gb", max_gpus=16, tokens=2.6e10, compare_networks=())
    sh = r.shortest()
    path = tmp_path / "c.yaml"
    path.write_text(synthetic.cluster_yaml(r.cluster))
    cmd = r.search_command(sh, str(path)).split()[1:] + ["--json"]
    assert "--max-micro-batch" not in cmd
    small = T.plan(GPT, device="a100-80gb", max_gpus=8, tokens=2.6e10, compare_networks=(), max_micro_batch=2)
    assert "--max-micro-batch 2 " in small.search_command(small.shortest(), str(path))
    assert small.shortest().estimate.config.micro_batch_size <= 2
    p = subprocess.run([sys.executable, "-m", "autoconf", *cmd], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()), timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["best"]["step_time_s"] == pytest.approx(sh.step_time_s, rel=1e-9)


def test_inner_choices_cover_what_the_bounds_key():
    """bounds() keys inner choices by (sequence parallel, recompute, zero): every inner choice of
    the search has such a key."""
    for dp, tp in ((1, 1), (4, 2), (8, 8)):
        keys = {(sp, rc, z) for z, rc, sp in inner_choices(dp, tp)}
        cl = T.synthetic_cluster("a100-80gb", 64, "ib")
        opt = T.PointOptimizer(T.planning_system(GPT, cl))
        opts = {(sp, rc) for sp, rc in opt._options(tp)}
        assert {(sp, rc) for sp, rc, _ in keys} == opts


def test_fp8_plans_are_faster_on_h100_with_fused_casts():
    """FP8 GEMMs run at twice the dense peak on Hopper: with Megatron-LM's fused casts (Transformer
    Engine) every fastest plan per GPU count is faster than in bf16, and the notes say the numerics
    change. The reference trainer quantises every operand with eager operations
    (``cost.fp8.EAGER_QUANT_BYTES``; measured 1.7-2.1x slower than bf16 on an H100): its FP8 plans
    are slower."""
    kw = dict(device="h100-sxm", max_gpus=64, tokens=2.6e10, compare_networks=())
    bf, f8 = T.plan(GPT, framework="megatron", **kw), T.plan(GPT, framework="megatron", precision="fp8", **kw)
    assert f8.precision[0] == "fp8" and any("different numerics" in n for n in f8.notes)
    for a, b in zip(bf.per_gpus(), f8.per_gpus()):
        assert b.estimate.config.precision == "fp8" and b.step_time_s < a.step_time_s
    assert f"--precision fp8 --fp8-recipe {f8.precision[1]}" in f8.search_command(f8.shortest())
    ref_bf, ref_f8 = T.plan(GPT, **kw), T.plan(GPT, precision="fp8", **kw)
    assert all(b.step_time_s > a.step_time_s for a, b in zip(ref_bf.per_gpus(), ref_f8.per_gpus()))


PROFILE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "profiles", "bench-h256-cpu2.json")
CPU_MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "models", "bench-h256.yaml")
TESTBED = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "clusters", "testbed-2x2.yaml")
LOCALHOST = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "clusters", "localhost-cpu.yaml")


@pytest.mark.parametrize("cluster_file", [TESTBED, LOCALHOST])
def test_a_profile_prices_the_plans_and_the_search_command_carries_it(cluster_file):
    """With --profile the plan's step times are the cost model's with that profile (measured
    per-layer compute and links), not the catalog's, on a cluster of two node groups and of one;
    the printed search command finds the same time."""
    from autoconf.specs.cluster import load_cluster
    from autoconf.specs.hf import load_model
    from autoconf.specs.profile import load_profile
    model, cl, prof = load_model(CPU_MODEL), load_cluster(cluster_file), load_profile(PROFILE)
    kw = dict(cluster=cl, tokens=1e6, batch_law="fixed", global_batch=16)
    with_p, without = T.plan(model, profile=prof, **kw), T.plan(model, **kw)
    sh = with_p.shortest()
    assert with_p.profile_kind == "cpu" and any("profile measured on cpu" in n for n in with_p.notes)
    assert sh.step_time_s == pytest.approx(estimate_on(sh.estimate.config, System(model, cl, prof)).step_time_s,
                                           rel=1e-12)
    assert sh.step_time_s != pytest.approx(without.shortest().step_time_s, rel=1e-3)
    with_p.profile_path, with_p.model_ref = PROFILE, CPU_MODEL
    cmd = with_p.search_command(sh, cluster_file).split()[1:] + ["--json"]
    assert "--profile" in cmd
    p = subprocess.run([sys.executable, "-m", "autoconf", *cmd], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()), timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["best"]["step_time_s"] == pytest.approx(sh.step_time_s, rel=1e-9)


def test_a_profile_of_another_device_kind_is_refused():
    p = _run("--model", CPU_MODEL, "--device", "a100-80gb", "--max-gpus", "8", "--profile", PROFILE)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "--profile was measured on cpu; the cluster's devices are a100-80gb" in p.stderr
    assert "--device cpu" not in p.stderr and "(a cluster file of it)" in p.stderr  # plan has no --device cpu


def test_placement_improves_the_fastest_plans_and_they_are_the_cost_models():
    """--place: the fastest plan of each GPU count gets search's placement where it is faster; every
    placed estimate is the cost model's own for that placement (priced on the whole graph)."""
    kw = dict(device="h100-sxm", max_gpus=256, tokens=2e11, compare_networks=("25gbe",))
    m = preset("llama-2-13b")
    plain, placed = T.plan(m, **kw), T.plan(m, place=True, **kw)
    assert placed.placed["tried"] > 0 and placed.placed["improved"] > 0
    assert any("placement searched" in n for n in placed.notes)
    assert "--no-place" not in placed.search_command(placed.shortest())
    moved = 0
    for net in plain.networks:
        for meth in T.METHOD_NAMES:
            for a, b in zip(plain.per_gpus(net, meth), placed.per_gpus(net, meth)):
                assert a.gpus == b.gpus and b.step_time_s <= a.step_time_s * (1 + 1e-12)
                c = b.estimate.config
                if c.device_order is not None or c.stage_layers is not None:
                    moved += 1
                    cl = T.synthetic_cluster("h100-sxm", b.gpus, net)
                    assert estimate_on(c, System(m, cl)).step_time_s == pytest.approx(b.step_time_s, rel=1e-9)
    assert moved > 0


def test_placement_is_the_reference_trainers():
    r = T.plan(GPT, device="a100-80gb", max_gpus=16, tokens=2.6e10, compare_networks=(), framework="megatron",
               place=True)
    assert r.placed is None and any("placement not searched: framework megatron" in n for n in r.notes)


def test_deepspeed_bf16_optimizer_memory_floor_shards_the_optimizer():
    """DeepSpeed's BF16 optimizer (bf16, pipeline, no ZeRO) shards its fp32 states over dp as
    ZeRO-1 does: the planner's memory floor for ZeRO-0 there is ZeRO-1's, and stays below the
    estimate (which keeps the fp32 gradient copies on top)."""
    model = preset("gpt3-13b")
    system = T.planning_system(model, T.synthetic_cluster("a100-80gb", 64, "ib"), framework="deepspeed")
    opt = T.PointOptimizer(system)
    point = (8, 4, 2, 1, "1f1b", 1, False, 1)
    floors = opt._memory_floors(point, 16, [0.0], [0, 1])
    assert floors[0][0] == pytest.approx(floors[0][1])
    c = ParallelConfig(dp=8, pp=4, tp=2, micro_batch_size=1, num_micro_batches=16)
    e = estimate_on(c, system)
    assert floors[0][0] <= e.peak_memory_bytes
    assert system.policy.bf16_optimizer(c) and not system.policy.bf16_optimizer(dataclasses.replace(c, pp=1, dp=32))


def test_cluster_yaml_keeps_the_host_names(tmp_path):
    from autoconf.specs.cluster import cluster_from_mapping, load_cluster
    c = cluster_from_mapping({"name": "two", "node_groups": [
        {"count": 2, "device": "a100-80gb", "gpus_per_node": 4, "intra_node_bandwidth": "300 GB/s",
         "nics": {"count": 1, "bandwidth": "100 Gbit/s"}, "hosts": ["gpu-a", "fe80::1"]}]})
    p = tmp_path / "c.yaml"
    p.write_text(synthetic.cluster_yaml(c))
    assert load_cluster(str(p)).node_groups[0].hosts == ("gpu-a", "fe80::1")


def test_a_mixture_of_experts_is_planned_with_expert_parallelism():
    """The command plans a mixture of experts: its laws read at the active parameters, its expert
    parallelism among the choices, and the printed search command finds the same step time."""
    out = subprocess.run([sys.executable, "-m", "autoconf", "plan", "--model", "qwen3-30b-a3b", "--device", "h100-sxm",
                          "--max-gpus", "32", "--compare-networks", "none", "--batch-law", "fixed",
                          "--global-batch", "64", "--tokens", "100B", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    m = preset("qwen3-30b-a3b")
    assert d["active_params"] == m.active_params() < d["num_params"] / 5
    rows = [r for r in d["rows"] if r["method"] == "all"]
    assert {r["gpus"] for r in rows} == {8, 16, 32}
    # expert parallelism is among the choices at every GPU count; whether it pays is the model's
    # answer (with multi-rail data parallelism, replicating the experts is as fast at 32 GPUs)
    assert all(m.num_experts % r["config"]["ep"] == 0 for r in rows)
    assert any("mixture of experts" in n for n in d["notes"])
    sh = d["shortest"]
    cmd = d["search_command"].split()
    assert cmd[:3] == ["autoconf", "search", "--model"]
    ref = search(m, T.synthetic_cluster("h100-sxm", 32, "ib"), 64, gpus=sh["gpus"], storage=None, place=False, top=1)
    assert ref.top[0].step_time_s == pytest.approx(sh["step_time_s"], rel=1e-9)
    # an imbalanced router is priced as search prices it, and the printed command says so
    r = T.plan(m, device="h100-sxm", max_gpus=16, compare_networks=(), batch_law="fixed", global_batch=64,
               tokens=1e11, moe_imbalance=1.3)
    assert "--moe-imbalance 1.3" in r.search_command(r.shortest()) and r.to_dict()["moe_imbalance"] == 1.3
    slow = search(m, T.synthetic_cluster("h100-sxm", 16, "ib"), 64, storage=None, place=False, top=1,
                  moe_imbalance=1.3)
    assert slow.top[0].step_time_s == pytest.approx(r.shortest().step_time_s, rel=1e-9)
    assert any("1.3x its balanced share" in n for n in r.notes)
    bad = subprocess.run([sys.executable, "-m", "autoconf", "plan", "--model", "qwen3-30b-a3b", "--device", "h100-sxm",
                          "--max-gpus", "16", "--moe-imbalance", "0.5"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--moe-imbalance 0.5" in bad.stderr and "Traceback" not in bad.stderr
