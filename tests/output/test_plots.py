"""Pictures: the timeline's events are the simulation that prices the step; --plot writes PNG and SVG."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings

from autoconf.cost.estimate import estimate
from autoconf.cost.pipeline import simulate
from autoconf.cost.system import System
from autoconf.cost.timeline import step_timeline, timeline
from autoconf.space.config import ParallelConfig
from autoconf.space.schedules import device_orders
from autoconf.specs.cluster import load_cluster
from autoconf.specs.model import preset
from autoconf.study.search import search

A100 = load_cluster("examples/clusters/a100-4x8.yaml")
A100_YAML = os.path.abspath("examples/clusters/a100-4x8.yaml")
CPU_YAML = os.path.abspath("examples/clusters/localhost-cpu.yaml")

# --- the events (pure, fast) ------------------------------------------------------------------

from tests.cost.test_pipeline import shapes  # noqa: E402  (the schedule shapes the simulator's own properties use)


def check_events(schedule, pp, m, v, f, b, p):
    """Everything the picture relies on: the events are the priced simulation."""
    tl = timeline(schedule, pp, m, v, f, b, p)
    r = simulate(schedule, pp, m, v, f, b, p)
    assert tl.makespan_s == r.makespan_s  # the same simulation, not an approximation of it
    assert max(op.end_s for op in tl.ops) == tl.makespan_s and min(op.start_s for op in tl.ops) >= 0.0
    nc = pp * v
    # every (micro-batch, chunk) has exactly one forward and one backward, on the chunk's device
    seen = {}
    for op in tl.ops:
        assert (op.kind, op.micro_batch, op.chunk) not in seen
        seen[(op.kind, op.micro_batch, op.chunk)] = op
        assert op.device == op.chunk % pp
        assert op.end_s - op.start_s == pytest.approx((f if op.kind == "F" else b)[op.chunk])
    assert set(seen) == {(k, mb, c) for k in "FB" for mb in range(m) for c in range(nc)}
    # per device: its schedule's order, never two ops at once, busy as the simulation says
    orders = device_orders(schedule, pp, m, v)
    for d in range(pp):
        mine = sorted((op for op in tl.ops if op.device == d), key=lambda op: op.start_s)
        assert [(op.kind, op.micro_batch, op.chunk) for op in mine] == list(orders[d])
        assert all(a.end_s <= b_.start_s for a, b_ in zip(mine, mine[1:]))
        assert sum(op.end_s - op.start_s for op in mine) == pytest.approx(r.busy_s[d])
    # dependencies: an op starts after its input arrived (the transfer after the op it needs)
    for (kind, mb, c), op in seen.items():
        if kind == "F" and c > 0:
            assert op.start_s >= seen["F", mb, c - 1].end_s + p[c - 1] - 1e-12
        if kind == "B":
            assert op.start_s >= seen["F", mb, c].end_s - 1e-12
            if c < nc - 1:
                assert op.start_s >= seen["B", mb, c + 1].end_s + p[c] - 1e-12
    # the transfers are exactly the nonzero ones: each leaves once its data is ready, takes its
    # link's time, arrives before the op that needs it, and a link carries one at a time
    assert len(tl.transfers) == 2 * m * sum(1 for x in p if x > 0)
    on_link: dict = {}
    for t in tl.transfers:
        src = seen[("F", t.micro_batch, t.chunk - 1) if t.kind == "activation" else ("B", t.micro_batch, t.chunk + 1)]
        dst = seen[("F" if t.kind == "activation" else "B", t.micro_batch, t.chunk)]
        link = t.chunk - 1 if t.kind == "activation" else t.chunk
        assert (t.src_device, t.dst_device) == (src.device, dst.device)
        assert src.end_s <= t.start_s and t.end_s == pytest.approx(t.start_s + p[link]) and t.end_s <= dst.start_s
        on_link.setdefault((t.src_device, t.dst_device), []).append(t)
    for ts in on_link.values():
        ts.sort(key=lambda t: t.start_s)
        assert all(a.end_s <= b_.start_s for a, b_ in zip(ts, ts[1:]))
    return tl


@settings(max_examples=120, deadline=None)
@given(shapes())
def test_timeline_events_are_the_simulated_step(shape):
    check_events(*shape)


@pytest.mark.parametrize("schedule,pp,m,v", [("1f1b", 4, 8, 1), ("gpipe", 3, 5, 1), ("interleaved", 2, 4, 2),
                                             ("breadth_first", 2, 3, 3)])
def test_timeline_with_unequal_stages_and_slow_links(schedule, pp, m, v):
    nc = pp * v
    tl = check_events(schedule, pp, m, v, [1.0 + 0.3 * c for c in range(nc)], [2.0 + 0.5 * (c % 3) for c in range(nc)],
                      [0.25 * (1 + c % 2) for c in range(nc - 1)])
    # the bubble is there: some device waits inside the step
    busy = [sum(op.end_s - op.start_s for op in tl.ops if op.device == d) for d in range(pp)]
    assert min(busy) < tl.makespan_s


# --- the step the estimate prices -------------------------------------------------------------

LLAMA = preset("llama-3-8b")
CONFIGS = {
    "interleaved zero1 sp": ParallelConfig(dp=4, pp=2, tp=4, micro_batch_size=1, num_micro_batches=8,
                                           schedule="interleaved", virtual_stages=2, recompute="selective",
                                           sequence_parallel=True, zero_stage=1),
    "1f1b zero3": ParallelConfig(dp=4, pp=4, tp=2, micro_batch_size=1, num_micro_batches=12, zero_stage=3),
    "pp1 layered zero3": ParallelConfig(dp=8, pp=1, tp=4, micro_batch_size=1, num_micro_batches=8,
                                        layered_grad_accum=True, zero_stage=3),
    "breadth-first": ParallelConfig(dp=2, pp=4, tp=4, micro_batch_size=1, num_micro_batches=4,
                                    schedule="breadth_first", virtual_stages=2, layered_grad_accum=True, zero_stage=2),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_step_timeline_is_what_the_estimate_priced(name):
    c = CONFIGS[name]
    ctx = System(LLAMA, A100)
    e = estimate(c, LLAMA, A100, ctx=ctx)
    st_ = step_timeline(c, ctx)
    assert st_.simulated_micro_batches == c.num_micro_batches  # the estimate simulated the whole step
    assert st_.makespan_s == pytest.approx(st_.priced_makespan_s, rel=1e-12)
    assert st_.step_time_s == pytest.approx(e.step_time_s, rel=1e-12)
    # each op's parts add up to the duration the simulation played
    for op in st_.pipeline.ops:
        parts = (st_.forward_parts if op.kind == "F" else st_.backward_parts)[op.chunk]
        assert sum(s for _, s in parts) == pytest.approx(op.end_s - op.start_s, rel=1e-9)
    # reductions start after their chunk's first backward began and end by the step's tail
    for d, spans in enumerate(st_.dp_reductions):
        assert len(spans) == (len(range(d, len(st_.forward_parts), c.pp)) if c.dp > 1 else 0)
        for a, b, chunk in spans:
            first_b = min(op.start_s for op in st_.pipeline.ops if op.kind == "B" and op.chunk == chunk)
            assert first_b <= a < b <= st_.makespan_s + st_.dp_tail_s + 1e-12


def test_step_timeline_of_an_extrapolated_estimate_simulates_every_micro_batch():
    c = ParallelConfig(dp=4, pp=4, tp=2, micro_batch_size=1, num_micro_batches=64)
    ctx = System(LLAMA, A100)
    st_ = step_timeline(c, ctx)
    assert st_.simulated_micro_batches < 64
    assert len(st_.pipeline.ops) == 2 * 64 * 4
    assert st_.makespan_s == pytest.approx(st_.priced_makespan_s, rel=1e-6)
    assert st_.step_time_s == pytest.approx(estimate(c, LLAMA, A100, ctx=ctx).step_time_s, rel=1e-6)


def test_search_result_carries_every_estimated_configuration():
    r = search(preset("gpt3-6.7b"), A100, 64, gpus=8, storage=None)
    assert len(r.evaluated) == r.estimates > len(r.top)
    configs = [p[0] for p in r.evaluated]
    assert all(e.config in configs for e in r.top)
    for _config, t, mem, fits in r.evaluated:
        assert mem > 0 and (t > 0 if fits else t == float("inf"))
    assert sum(1 for p in r.evaluated if not p[3]) == r.rejected.get("out of memory", 0) > 0


def test_a_resumed_search_carries_what_earlier_runs_recorded(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    first = search(preset("gpt3-6.7b"), A100, 64, gpus=8, storage=url)
    again = search(preset("gpt3-6.7b"), A100, 64, gpus=8, storage=url)
    # the resumed run re-estimates only the few points its top K needs, yet draws all recorded ones
    assert again.estimates < first.estimates and len(again.evaluated) > again.estimates
    seen = {c: (t, mem, fits) for c, t, mem, fits in first.evaluated}
    for c, t, mem, fits in again.evaluated[again.estimates:]:  # what the first run recorded
        assert seen[c][2] == fits and seen[c][0] == t and seen[c][1] == pytest.approx(mem, abs=2**20)


# --- the command line -------------------------------------------------------------------------


def run_cli(*args, code=None):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "autoconf", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def assert_pictures(paths, stems):
    import matplotlib.image

    assert sorted(os.path.basename(p) for p in paths) == sorted(f"{s}.{x}" for s in stems for x in ("png", "svg"))
    for p in paths:
        assert os.path.getsize(p) > 20_000, p
        if p.endswith(".png"):
            img = matplotlib.image.imread(p)
            assert img.ndim == 3 and img.shape[0] > 400 and img.shape[1] > 1000
            assert img[..., :3].std() > 0.05  # not a blank canvas
        else:
            text = open(p).read()
            assert text.lstrip().startswith("<?xml") and "<svg" in text and text.rstrip().endswith("</svg>")
    leftovers = [f for f in os.listdir(os.path.dirname(paths[0])) if f.startswith(".")]
    assert not leftovers  # written atomically: no temp file stays


ESTIMATE = ["estimate", "--model", "llama-3-8b", "--cluster", A100_YAML, "--global-batch", "64", "--dp", "4",
            "--pp", "2", "--tp", "4", "--schedule", "interleaved", "--virtual-stages", "2", "--recompute", "selective"]


def test_cli_estimate_draws_the_timeline(tmp_path):
    out = tmp_path / "pics" / "new"  # created, parents too
    p = run_cli(*ESTIMATE, "--plot", str(out), "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert_pictures(doc["plots"], ["timeline"])
    assert all(os.path.dirname(f) == str(out) for f in doc["plots"])


def test_cli_search_draws_the_timeline_and_the_scatter(tmp_path):
    p = run_cli("search", "--model", "gpt3-6.7b", "--cluster", A100_YAML, "--global-batch", "64", "--gpus", "8",
                "--storage", "none", "--plot", str(tmp_path), "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert all(os.path.dirname(f) == str(tmp_path) for f in doc["plots"])
    assert_pictures(doc["plots"], ["timeline", "time-memory"])


@pytest.mark.parametrize("cmd", ["estimate", "search"])
def test_bad_plot_directory_is_one_line_exit_2_before_any_work(tmp_path, cmd):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    db = tmp_path / "s.db"
    args = (ESTIMATE if cmd == "estimate" else
            ["search", "--model", "gpt2", "--cluster", A100_YAML, "--global-batch", "64", "--gpus", "8",
             "--storage", f"sqlite:///{db}"])
    for bad in (afile, afile / "below"):
        p = run_cli(*args, "--plot", str(bad))
        assert p.returncode == 2, (p.stdout, p.stderr)
        assert p.stderr.startswith("autoconf: error: --plot") and len(p.stderr.strip().splitlines()) == 1
        assert "Traceback" not in p.stderr and p.stdout == ""
    assert not db.exists()  # refused before the search opened its study


MISSING = ("import sys; sys.modules['matplotlib'] = None\n"  # as if it were not installed
           "from autoconf.cli import main; sys.exit(main(sys.argv[1:]))")


def test_without_matplotlib_plot_is_refused_with_how_to_install(tmp_path):
    p = run_cli(*ESTIMATE, "--plot", str(tmp_path), code=MISSING)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert "matplotlib" in p.stderr and "pip install" in p.stderr and "[plot]" in p.stderr
    assert os.listdir(tmp_path) == []
    # and without --plot, nothing needs it
    p = run_cli(*ESTIMATE, "--json", code=MISSING)
    assert p.returncode == 0, p.stderr


def test_search_without_plot_never_imports_matplotlib():
    code = ("import sys\nfrom autoconf.cli import main\n"
            "rc = main(['search', '--model', 'tiny', '--cluster', sys.argv[1], '--global-batch', '8', '--storage', "
            "'none', '--json'])\nprint('matplotlib' in sys.modules, 'torch' in sys.modules, file=sys.stderr)\n"
            "sys.exit(rc)")
    p = run_cli(CPU_YAML, code=code)
    assert p.returncode == 0 and p.stderr.strip().splitlines()[-1] == "False False", p.stderr
