"""End to end: search, emit with the user's own script, run the emitted node script (one host, two
CPU processes under torchrun): every rank reads the plan and trains with its coordinates."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from autoconf.launch.plan import load as load_plan

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_the_emitted_node_script_runs_the_users_script_with_the_plan(tmp_path):
    pytest.importorskip("torch")
    root = os.path.dirname(os.path.dirname(HERE))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("AUTOCONF_PLAN", None)
    env["TMPDIR"] = str(tmp_path)  # torchrun's torchelastic_* directory, here rather than in /tmp
    script = tmp_path / "user_train.py"
    shutil.copy(os.path.join(HERE, "..", "data", "user_train.py"), script)
    out = tmp_path / "launch dir"
    p = subprocess.run([sys.executable, "-m", "autoconf", "search", "--model",
                        os.path.join(root, "examples/models/bench-h256.yaml"), "--cluster",
                        os.path.join(root, "examples/clusters/localhost-cpu.yaml"), "--profile",
                        os.path.join(root, "examples/profiles/bench-h256-cpu2.json"), "--global-batch", "4",
                        "--storage", "none", "--emit", str(out), "--script", "user_train.py", "--", "--steps", "3"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    plan = load_plan(str(out / "config.json"))
    assert plan.dp == 2  # the committed profile finds tensor parallelism slow on this machine: two replicas
    node = (out / "node-0.sh").read_text()
    assert f"{script} --steps 3" in node.replace("'", "")
    run = subprocess.run(["bash", str(out / "node-0.sh")], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    docs = [json.loads((out / "user-results" / f"rank_{r}.json").read_text()) for r in range(plan.world_size)]
    for r, d in enumerate(docs):
        assert d["rank"] == r and d["world"] == plan.world_size == 2 and d["steps"] == 3
        assert d["plan"] == str(out / "config.json")
        assert d["coords"] == plan.coords(plan.rank_on(r)) and d["plays"] == plan.rank_on(r)
        assert len(d["losses"]) == 3 and d["losses"][-1] < d["losses"][0]
    for group in plan.groups("dp"):  # data-parallel replicas end with the same weights
        assert len({json.dumps(docs[r]["weights"]) for r in group}) == 1
        assert all(docs[r]["dp_ranks"] == list(group) for r in group)
