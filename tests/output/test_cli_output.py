"""A CLI that reads well: tables that fit 80 columns (``--wide`` for the full breakdown), progress
bars on stderr only, study names that follow the inputs, a library search that writes no file,
and a thin CLI whose subcommands are registered statically without importing torch."""

from __future__ import annotations

import glob
import io
import json
import os
import pty
import re
import subprocess
import sys
import threading

import pytest
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from autoconf.cost.estimate import estimate
from autoconf.output import tables as report
from autoconf.runs.trial import TrialResult
from autoconf.specs.cluster import load_cluster
from autoconf.specs.hf import load_model
from autoconf.specs.model import preset
from autoconf.specs.profile import Profile, load_profile
from autoconf.specs.units import fmt_seconds
from autoconf.study.search import search

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H256 = os.path.join(ROOT, "examples/models/bench-h256.yaml")
PROFILE = os.path.join(ROOT, "examples/profiles/bench-h256-cpu2.json")
CPU = os.path.join(ROOT, "examples/clusters/localhost-cpu.yaml")
CLUSTERS = sorted(glob.glob(os.path.join(ROOT, "examples/clusters/*.yaml")))
ELLIPSIS = "\u2026"


def run_cli(*args, cwd=None, env=None):
    env = {**os.environ, "PYTHONPATH": ROOT, "COLUMNS": "80", **(env or {})}
    return subprocess.run([sys.executable, "-m", "autoconf", *args], capture_output=True, text=True, cwd=cwd or ROOT,
                          env=env, timeout=300)


def render(renderables, width=80):
    """(the text as an 80-column terminal shows it, the natural width of each table)."""
    con = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    for r in renderables:
        con.print(r)
    widths = [Measurement.get(con, con.options, t).maximum for t in renderables if isinstance(t, Table)]
    return con.export_text(), widths


def assert_fits(text, widths=()):
    lines = text.splitlines()
    assert max(len(ln) for ln in lines) <= 80, max(lines, key=len)
    assert ELLIPSIS not in text, text
    assert all(w <= 80 for w in widths), (widths, text)


# -- tables fit 80 columns ------------------------------------------------------------------------

def _target(path):
    return (load_cluster(path), None) if path.endswith(".yaml") else (None, load_profile(path))


TARGETS = [(p, "reference") for p in CLUSTERS + [PROFILE]] + [(os.path.join(ROOT, "examples/clusters/two-kinds.yaml"),
                                                                  "megatron")]


def _id(target):
    return os.path.basename(target[0]) + ("" if target[1] == "reference" else f"-{target[1]}")


@pytest.fixture(scope="module")
def results():
    """Real searches of the small model against every example cluster and the committed profile (as
    `autoconf search` runs them: placement searched, top 5), and one for Megatron (its knobs)."""
    model = load_model(H256)
    out = {}
    for path, fw in TARGETS:
        cluster, profile = _target(path)
        # global batch 64 has no layout on two GB200 racks' 144 GPUs: a power of two of them
        gpus = 128 if cluster is not None and cluster.num_devices == 144 else None
        out[_id((path, fw))] = (search(model, cluster, 64, gpus=gpus, profile=profile, storage=None, place=True,
                                       top=5, framework=fw), cluster, profile, fw)
    return model, out


def _verified(result):
    """Verifying-trial records of the search's first three configurations (their real
    predictions; the measurements are made up: the table is what is tested)."""
    out = []
    for i, e in enumerate(result.top[:3]):
        tr = TrialResult(ok=i != 1, reason="" if i != 1 else "rank 1: killed by SIGKILL",
                         step_time_s=e.step_time_s * 1.13 if i != 1 else None,
                         peak_memory_bytes=e.peak_memory_bytes * 1.2 if i != 1 else None, config=e.config.to_dict())
        out.append({"config": e.config.to_dict(), "config_short": e.config.short(),
                    "predicted_step_time_s": e.step_time_s, "predicted_peak_memory_bytes": e.peak_memory_bytes,
                    "trial": tr.to_dict(), "speed_vs_profile": None,
                    "refused": "out of memory: measured peak above the capacity" if i == 2 else None})
    return out


@pytest.mark.parametrize("target", [_id(t) for t in TARGETS])
def test_search_estimate_placement_and_verified_tables_fit_80_columns(results, target):
    model, by_target = results
    r, cluster, profile, fw = by_target[target]
    assert len(r.top) == 5
    best = r.top[0]
    text, widths = render(report.search_report(r, best))
    assert_fits(text, widths)  # every table at its natural width: nothing wrapped, nothing cut
    for i, e in enumerate(r.top, 1):  # every row is there, its numbers whole
        assert re.search(rf"^{i}\s.*{re.escape(fmt_seconds(e.step_time_s))}", text, re.M), text
    text, widths = render(report.estimate_report(estimate(best.config, model, cluster, profile, framework=fw)))
    assert_fits(text, widths)
    header = next(ln for ln in text.splitlines() if ln.startswith("stage"))
    assert header.split() == ["stage", "model", "states", "activations", "other", "total", "capacity"]
    verified = _verified(r)
    text, _ = render(report.verified_report(verified, ranks={e.config.short(): i for i, e in enumerate(r.top, 1)}))
    assert_fits(text)  # the configuration may wrap at spaces; numbers never do
    for v in verified:
        assert fmt_seconds(v["predicted_step_time_s"]) in text
    assert "#2 failed: rank 1: killed by SIGKILL" in text and "#3 refused: out of memory" in text
    assert re.search(r"^1\s.*\sok\s*$", text, re.M), text


def test_the_cli_prints_within_80_columns_and_wide_adds_the_breakdown():
    args = ["search", "--model", H256, "--cluster", os.path.join(ROOT, "examples/clusters/two-kinds.yaml"),
            "--global-batch", "64", "--storage", "none"]
    p = run_cli(*args)
    assert p.returncode == 0, p.stderr
    assert_fits(p.stdout)
    assert "best:" in p.stdout and "tokens/s  " not in p.stdout and "bubble" not in p.stdout
    wide = run_cli(*args, "--wide", env={"COLUMNS": "200"})
    assert wide.returncode == 0, wide.stderr
    header = next(ln for ln in wide.stdout.splitlines() if ln.startswith("#"))
    for col in ("m", "zero", "recompute", "tokens/s", "peak mem", "compute", "bubble", "comm"):
        assert re.search(rf"(^|\s){re.escape(col)}(\s|$)", header), header

    est = ["estimate", "--model", "llama-3-8b", "--cluster", os.path.join(ROOT, "examples/clusters/a100-4x8.yaml"),
           "--global-batch", "512", "--dp", "4", "--pp", "2", "--tp", "4", "--schedule", "interleaved",
           "--virtual-stages", "2", "--recompute", "selective", "--sequence-parallel", "--zero", "1"]
    p = run_cli(*est)
    assert p.returncode == 0, p.stderr
    assert_fits(p.stdout)
    assert "cost/compute.py" in p.stdout and "roofline" not in p.stdout
    wide = run_cli(*est, "--wide", env={"COLUMNS": "200"})
    assert wide.returncode == 0, wide.stderr
    assert "roofline per op" in wide.stdout
    header = next(ln for ln in wide.stdout.splitlines() if ln.startswith("stage"))
    assert header.split() == ["stage", "parameters", "gradients", "optimizer", "activations", "other", "total",
                              "capacity"]


def test_models_devices_trial_and_profile_tables_fit_80_columns():
    from autoconf.space.config import ParallelConfig
    from autoconf.specs.devices import device_names, device_type
    from autoconf.specs.model import preset_names

    for rs in (report.models_table([preset(n) for n in preset_names()]),
               report.devices_table([device_type(n) for n in device_names()])):
        assert_fits(*render(rs))
    c = ParallelConfig(dp=2, pp=1, tp=1, micro_batch_size=2, num_micro_batches=2)
    e = estimate(c, preset("tiny"), load_cluster(CPU))
    t = TrialResult(ok=True, step_time_s=0.012, peak_memory_bytes=3e6, losses=[7.1, 6.9, 6.8], wall_s=9.0,
                    memory_method="ru_maxrss")
    assert_fits(*render(report.trial_report(t, e, "", c)))
    text, widths = render(report.profile_report(load_profile(PROFILE), "p.json"))
    assert_fits(text, widths)
    assert "latency" in text and "bandwidth" in text and "profile written to p.json" in text


def test_a_profile_of_many_ranks_summarises_links_by_pair_of_hosts():
    d = json.load(open(PROFILE))
    link = d["links"][0]
    d["ranks"] = [dict(d["ranks"][0], rank=r, host="node-a" if r < 4 else "node-b", local_rank=r % 4) for r in range(8)]
    d["links"] = [dict(link, src=s, dst=t, bandwidth_bytes_per_s=link["bandwidth_bytes_per_s"] / (1 if s // 4 == t // 4
                                                                                                  else 10))
                  for s in range(8) for t in range(8) if s != t]
    text, widths = render(report.profile_tables(Profile.from_dict(d)))
    assert_fits(text, widths)
    rows = [ln.split() for ln in text.splitlines() if ln.startswith("node-")]
    assert [(r[0], r[1], r[2]) for r in rows] == [("node-a", "node-a", "12"), ("node-a", "node-b", "16"),
                                                  ("node-b", "node-a", "16"), ("node-b", "node-b", "12")]


def test_every_table_is_built_in_output():
    # one place for the human-readable output: no rich table anywhere else in the package or the profiler
    offenders = []
    for path in glob.glob(os.path.join(ROOT, "autoconf", "**", "*.py"), recursive=True) + \
            glob.glob(os.path.join(ROOT, "profiler", "*.py")):
        if os.path.relpath(path, ROOT).startswith(os.path.join("autoconf", "output", "")):
            continue
        src = open(path).read()
        if "rich.table" in src or re.search(r"\bTable\(", src):
            offenders.append(os.path.relpath(path, ROOT))
    assert not offenders


# -- progress bars: stderr only, on a terminal, off with --quiet ---------------------------------------

def run_with_terminal_stderr(argv, cwd=None):
    """Run with stderr on a pseudo-terminal and stdout on a pipe: (exit code, stdout, terminal text)."""
    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONPATH=ROOT, TERM="xterm", COLUMNS="100")
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=env, cwd=cwd or ROOT)
    os.close(slave)
    chunks = []

    def pump():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # the other end closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    out, _ = p.communicate(timeout=300)
    reader.join(10)
    os.close(master)
    return p.returncode, out.decode(), b"".join(chunks).decode(errors="replace")


SEARCH = [sys.executable, "-m", "autoconf", "search", "--model", "gpt3-1.3b", "--cluster",
          os.path.join(ROOT, "examples/clusters/a100-4x8.yaml"), "--gpus", "8", "--global-batch", "64",
          "--storage", "none", "--trials", "20", "--json"]


def test_search_progress_goes_to_a_terminal_stderr_and_never_into_json():
    rc, out, tty = run_with_terminal_stderr(SEARCH)
    assert rc == 0, tty
    assert json.loads(out)["top"]  # stdout is the JSON document alone
    assert "sampling (TPE)" in tty or "every remaining point" in tty, tty
    rc, out, tty = run_with_terminal_stderr(SEARCH + ["--quiet"])
    assert rc == 0 and json.loads(out)["top"]
    assert "sampling" not in tty and "every remaining point" not in tty, tty
    p = subprocess.run(SEARCH, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0 and p.stderr == ""  # not a terminal: nothing drawn


_FAKE_VERIFY = """
import sys, time
from autoconf.cli import app as cli
from autoconf.runs import trial
def fake(plan, **kw):  # the trials' runner stands in; the progress of --verify is what is tested
    time.sleep(0.4)
    return trial.TrialResult(ok=True, step_time_s=0.01, peak_memory_bytes=2**20, config=plan.config.to_dict())
trial.run_trial = fake
sys.exit(cli.main(sys.argv[1:]))
"""


def test_verify_shows_each_trial_on_a_terminal_stderr(tmp_path):
    argv = [sys.executable, "-c", _FAKE_VERIFY, "search", "--model", "tiny", "--cluster", CPU, "--global-batch", "8",
            "--storage", "none", "--verify", "2", "--json"]
    rc, out, tty = run_with_terminal_stderr(argv, cwd=tmp_path)
    assert rc == 0, tty
    assert len(json.loads(out)["verified"]) == 2
    assert "trial 1/2" in tty and "trial 2/2" in tty, tty
    rc, out, tty = run_with_terminal_stderr(argv + ["--quiet"], cwd=tmp_path)
    assert rc == 0 and "trial 1/2" not in tty


def test_profile_passes_quiet_to_the_profiler(tmp_path):
    from autoconf.cli.app import build_parser
    from profiler.cli import launch_command

    args = build_parser().parse_args(["profile", "--model", "tiny", "--quiet", "--out", str(tmp_path / "p.json")])
    assert "--quiet" in launch_command(args)
    args = build_parser().parse_args(["profile", "--model", "tiny", "--out", str(tmp_path / "p.json")])
    assert "--quiet" not in launch_command(args)


@pytest.mark.e2e
def test_profile_and_trial_progress_on_a_terminal(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "p.json"
    base = [sys.executable, "-m", "autoconf", "profile", "--model", "tiny", "--quick", "--nproc-per-node", "2",
            "--micro-batch-sizes", "1", "--recompute", "none", "--out", str(out)]
    rc, stdout, tty = run_with_terminal_stderr(base, cwd=tmp_path)
    assert rc == 0, tty[-3000:]
    assert "compute (this rank's share)" in tty and "links (tournament rounds)" in tty
    assert "profile written to" in stdout and "compute (this rank" not in stdout
    rc, stdout, tty = run_with_terminal_stderr(base + ["--quiet"], cwd=tmp_path)
    assert rc == 0 and "compute (this rank" not in tty

    from autoconf.launch.plan import LaunchPlan
    from autoconf.space.config import ParallelConfig
    cfg = tmp_path / "c.json"
    LaunchPlan(ParallelConfig(dp=2, pp=1, tp=1, micro_batch_size=2, num_micro_batches=2), preset("tiny")).write(str(cfg))
    rc, stdout, tty = run_with_terminal_stderr([sys.executable, "-m", "autoconf", "trial", "--config", str(cfg),
                                                "--steps", "3", "--warmup", "1", "--json"], cwd=tmp_path)
    assert rc == 0, tty[-3000:]
    assert json.loads(stdout)["measured"]["ok"] and "trial dp2 pp1 tp1" in tty


# -- studies named after their inputs; the library writes no file ------------------------------------

def test_reprofiling_starts_a_new_study_and_the_same_inputs_resume(tmp_path):
    prof = tmp_path / "profile.json"
    prof.write_text(open(PROFILE).read())
    args = ["search", "--model", H256, "--profile", str(prof), "--global-batch", "8"]
    first = run_cli(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    said = " ".join(first.stdout.split())  # lines wrap at 80 columns
    name = re.search(r"new study '([^']+)': (\d+) trials, kept in autoconf-study.db", said)
    assert name, first.stdout
    assert (tmp_path / "autoconf-study.db").exists()  # the CLI keeps its default file and says where
    again = run_cli(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"resumed study '{name[1]}' ({name[2]} trials): 0 new" in " ".join(again.stdout.split())

    d = json.loads(prof.read_text())  # profiled again: other timings
    for row in d["compute"]:
        row["forward_s"] *= 1.05
    prof.write_text(json.dumps(d))
    fresh = run_cli(*args, "--json", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    doc = json.loads(fresh.stdout)
    assert doc["study_name"] != name[1] and doc["study_name"].startswith("bench-h256-profile-2gpus-gb8-")
    assert doc["resumed"] is False and doc["earlier_trials"] == 0
    # a study named explicitly is that study: other inputs are refused, saying which
    p = run_cli(*args, "--study-name", name[1], cwd=tmp_path)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "different profile" in p.stderr and name[1] in p.stderr and "Traceback" not in p.stderr


def test_the_library_search_writes_no_file_unless_asked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = search(preset("tiny"), load_cluster(CPU), 8)
    assert r.top and r.storage is None and os.listdir(tmp_path) == []
    assert "in memory only" in report.study_line(r)
    url = f"sqlite:///{tmp_path}/kept.db"
    assert search(preset("tiny"), load_cluster(CPU), 8, storage=url).storage == url
    assert os.listdir(tmp_path) != []


def test_default_study_names_follow_every_input():
    import dataclasses

    from autoconf.cost.calibration import Calibration

    tiny, cpu = preset("tiny"), load_cluster(CPU)
    names = {search(tiny, cpu, 8).study_name, search(tiny, cpu, 8).study_name}
    assert len(names) == 1
    other = [search(tiny, cpu, 16), search(dataclasses.replace(tiny, num_layers=2), cpu, 8),
             search(tiny, dataclasses.replace(cpu, name=cpu.name,
                                              node_groups=(dataclasses.replace(cpu.node_groups[0],
                                                                               memory_bytes=2**31),)), 8),
             search(tiny, cpu, 8, max_micro_batch=2), search(tiny, cpu, 8, place=True),
             search(tiny, cpu, 8, framework="megatron"),
             search(tiny, cpu, 8, calibration=Calibration(factors={"compute": 1.1}, num_trials=2))]
    all_names = names | {r.study_name for r in other}
    assert len(all_names) == 1 + len(other)


# -- a thin CLI: static subcommands, no torch ----------------------------------------------------------

_NO_TORCH = """
import json, sys
from autoconf.cli import main
for argv in (["--help"], ["trial", "--help"], ["profile", "--help"], ["testbed", "--help"]):
    try:
        main(argv)
    except SystemExit:
        pass
rc = main(["search", "--model", "tiny", "--cluster", sys.argv[1], "--global-batch", "8", "--storage", "none",
           "--json"])
sys.stderr.write(json.dumps({"rc": rc, "torch": "torch" in sys.modules}) + "\\n")
"""


def test_help_and_search_do_not_import_torch():
    p = subprocess.run([sys.executable, "-c", _NO_TORCH, CPU], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert json.loads(p.stderr.strip().splitlines()[-1]) == {"rc": 0, "torch": False}, p.stderr[-2000:]
    for sub in ("trial", "profile", "testbed"):
        assert f"usage: autoconf {sub}" in p.stdout


def test_a_subcommand_that_cannot_be_imported_is_an_error_not_a_missing_command():
    code = ("import sys; sys.modules['profiler.cli'] = None\n"
            "try:\n    import autoconf.cli.app as c; c.build_parser(); print('swallowed')\n"
            "except ImportError as e:\n    print('raised', e)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert p.stdout.startswith("raised"), p.stdout + p.stderr


def test_search_result_json_says_whether_the_study_resumed(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    args = ["search", "--model", "tiny", "--cluster", CPU, "--global-batch", "8", "--storage", url, "--json"]
    first, second = json.loads(run_cli(*args).stdout), json.loads(run_cli(*args).stdout)
    assert (first["resumed"], second["resumed"]) == (False, True)
    assert second["earlier_trials"] == first["trials_total"] and second["trials_run"] == 0


def _full_disk(*_a, **_k):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("argv,patch,needle", [
    (["estimate", "--model", "tiny", "--cluster", "examples/clusters/localhost-cpu.yaml", "--global-batch", "16",
      "--dp", "2", "--plot", "PLOTS"], "autoconf.output.plots.write_atomic", "--plot 'PLOTS': cannot write"),
    (["search", "--model", "tiny", "--cluster", "examples/clusters/localhost-cpu.yaml", "--global-batch", "16",
      "--trials", "5", "--storage", "none", "--emit", "EMIT", "--plot", "PLOTS"],
     "autoconf.files.write_all_or_none autoconf.output.plots.write_atomic",
     "--emit 'EMIT': cannot write the launch files (No space left on device); --plot 'PLOTS': cannot write"),
    (["plan", "--model", "gpt3-1.3b", "--device", "a100-80gb", "--max-gpus", "8", "--compare-networks", "none",
      "--quiet", "--cluster-out", "EMIT/c.yaml"], "autoconf.files.write_atomic",
     "--cluster-out 'EMIT/c.yaml': cannot write (No space left on device)"),
])
def test_an_output_that_cannot_be_written_fails_after_the_result_is_printed(argv, patch, needle, tmp_path,
                                                                              monkeypatch, capsys):
    """A full disk under --plot / --emit / --cluster-out: the result is printed first, then one line
    naming the path and why, exit 2; no traceback."""
    pytest.importorskip("matplotlib")
    from autoconf.cli import app as cli
    (tmp_path / "e").mkdir()
    argv = [a.replace("PLOTS", str(tmp_path / "p")).replace("EMIT", str(tmp_path / "e")) for a in argv]
    needle = needle.replace("PLOTS", str(tmp_path / "p")).replace("EMIT", str(tmp_path / "e"))
    for target in patch.split():
        monkeypatch.setattr(target, _full_disk)
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert err.strip() == f"autoconf: error: {needle}" or (needle in err and len(err.strip().splitlines()) == 1), err
    assert "Traceback" not in err
    assert ("shortest time:" if argv[0] == "plan" else "step") in out
