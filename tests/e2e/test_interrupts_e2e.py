"""Faults and interrupts end to end: whatever happens to autoconf or to one of its ranks, no process
it started is left running (checked with `ps`), no temp directory is left behind, the reason names
the rank and the signal, and the study holds every finished evaluation."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = pytest.mark.e2e
ROOT = os.getcwd()
CLUSTER = os.path.join(ROOT, "examples/clusters/localhost-cpu.yaml")


def _tagged(tag: str) -> list[tuple[int, str, str]]:
    """(pid, state, command line) of every live process carrying the test's tag in its environment."""
    out = subprocess.run(["ps", "-eww", "-o", "pid=,stat=,args=", "e"], capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        if f"AUTOCONF_TEST_TAG={tag}" in line:
            pid, stat, rest = line.split(None, 2)
            if not stat.startswith("Z"):
                rows.append((int(pid), stat, rest))
    return rows


def _ranks(tag: str, module: str) -> dict[int, int]:
    """rank -> pid of the tagged worker processes running ``module``."""
    out = {}
    for pid, _, args in _tagged(tag):
        m = re.search(r"(?<![A-Z_])RANK=(\d+)", args)
        if f"-m {module}" in args and m:
            out[int(m.group(1))] = pid
    return out


def _launchers(tag: str) -> list[int]:
    """Pids of the tagged torchrun launchers (``python -m torch.distributed.run``)."""
    return [pid for pid, _, args in _tagged(tag)
            if "torch.distributed.run" in args or os.path.basename(args.split()[0]) == "torchrun"]


def _wait(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Cli:
    """`python -m autoconf ...` in a process group of its own (as a shell runs a foreground job),
    tagged so that every process it starts can be found with ps; TMPDIR is the test's."""

    def __init__(self, tmp_path, *args):
        self.tag = uuid.uuid4().hex
        self.tmp = tmp_path / "tmp"
        self.tmp.mkdir(exist_ok=True)
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TMPDIR=str(self.tmp),
                   AUTOCONF_TEST_TAG=self.tag)
        self.out, self.err = open(tmp_path / "stdout", "w+"), open(tmp_path / "stderr", "w+")
        self.p = subprocess.Popen([sys.executable, "-m", "autoconf", *args], cwd=tmp_path, env=env,
                                  stdout=self.out, stderr=self.err, start_new_session=True)

    def ranks(self, module="autoconf.trainer"):
        return _ranks(self.tag, module)

    def signal_group(self, sig):
        os.killpg(self.p.pid, sig)

    def finish(self, timeout_s=60):
        rc = self.p.wait(timeout=timeout_s)
        self.out.seek(0)
        self.err.seek(0)
        return rc, self.out.read(), self.err.read()

    def assert_nothing_left(self):
        _wait(lambda: not _tagged(self.tag), 10, "every tagged process to end")  # already so, normally
        assert not _tagged(self.tag)
        assert not [p for p in os.listdir(self.tmp) if p.startswith("autoconf-")], os.listdir(self.tmp)


@pytest.fixture(scope="module")
def trial_config(tmp_path_factory):
    from autoconf.launch.plan import LaunchPlan
    from autoconf.space.config import ParallelConfig
    from autoconf.specs.model import preset

    path = tmp_path_factory.mktemp("cfg") / "c.json"
    path.write_text(LaunchPlan(ParallelConfig(dp=2, pp=1, tp=1, micro_batch_size=2, num_micro_batches=2),
                               preset("tiny")).to_json())
    return str(path)


@pytest.mark.parametrize("signals", [(signal.SIGINT,), (signal.SIGTERM,), (signal.SIGINT, signal.SIGINT)],
                         ids=["ctrl-c", "sigterm", "ctrl-c-twice"])
def test_interrupted_trial_leaves_no_process_and_no_temp_dir(tmp_path, trial_config, signals):
    cli = Cli(tmp_path, "trial", "--config", trial_config, "--steps", "100000")
    _wait(lambda: len(cli.ranks()) == 2, 60, "both ranks to start")
    time.sleep(1.0)  # let them get into the steps
    for sig in signals:
        cli.signal_group(sig)
        time.sleep(0.05)
    rc, _, err = cli.finish()
    assert rc == 128 + signals[0], err
    assert err.strip().splitlines()[-1].startswith("autoconf: ")
    assert "study" not in err  # no study here: no claim about one
    cli.assert_nothing_left()


def test_timeout_with_a_stopped_rank_kills_it(tmp_path, trial_config):
    cli = Cli(tmp_path, "trial", "--config", trial_config, "--steps", "100000", "--timeout", "12", "--json")
    ranks = _wait(lambda: len(cli.ranks()) == 2 and cli.ranks(), 60, "both ranks to start")
    time.sleep(1.0)
    os.kill(ranks[1], signal.SIGSTOP)
    rc, out, err = cli.finish()
    assert rc == 1, err
    assert "timed out after 12 s" in json.loads(out)["measured"]["reason"]
    cli.assert_nothing_left()


def test_a_killed_rank_is_named_with_its_signal(tmp_path, trial_config):
    cli = Cli(tmp_path, "trial", "--config", trial_config, "--steps", "100000", "--json")
    ranks = _wait(lambda: len(cli.ranks()) == 2 and cli.ranks(), 60, "both ranks to start")
    time.sleep(1.0)
    os.kill(ranks[1], signal.SIGKILL)
    rc, out, err = cli.finish()
    assert rc == 1, err
    assert json.loads(out)["measured"]["reason"] == "rank 1: killed by SIGKILL", (ranks, out[-3000:])
    cli.assert_nothing_left()


def test_interrupted_profile_leaves_no_process_and_no_partial_file(tmp_path):
    cli = Cli(tmp_path, "profile", "--model", "tiny", "--nproc-per-node", "2", "--out", str(tmp_path / "p.json"))
    _wait(lambda: len(cli.ranks("profiler")) == 2, 60, "both profiler ranks to start")
    time.sleep(1.0)
    cli.signal_group(signal.SIGINT)
    rc, _, err = cli.finish()
    assert rc == 130, err
    assert "study" not in err
    cli.assert_nothing_left()
    assert not [p for p in os.listdir(tmp_path) if p.startswith((".profile-", "p.json"))]


def _study_trials(url, name):
    """The study's trials as the CLI has stored them so far, read through a read-only SQLite
    connection: optuna's storage stamps ``version_info`` when it finds the table empty, which
    raced the CLI creating the database (its own stamp then failed and the search died). A
    database not created yet, or not stamped yet, reads as no trials."""
    import optuna
    import sqlalchemy.exc

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path = url[len("sqlite:///"):]
    if not os.path.exists(path):
        return []
    try:
        storage = optuna.storages.RDBStorage(f"sqlite:///file:{path}?mode=ro&uri=true", skip_table_creation=True,
                                             skip_compatibility_check=True)
        return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    except (KeyError, sqlalchemy.exc.OperationalError, optuna.exceptions.StorageInternalError):
        return []


def test_interrupted_search_verify_keeps_every_finished_trial_and_leaves_nothing(tmp_path):
    """The first verifying trial runs out its time limit (a finished, failed evaluation); Ctrl-C
    during the second: the study holds the search's trials and the first, the second's processes
    are gone."""
    url = f"sqlite:///{tmp_path}/s.db"
    cli = Cli(tmp_path, "search", "--model", "tiny", "--cluster", CLUSTER, "--global-batch", "8", "--storage", url,
              "--study-name", "v", "--verify", "2", "--steps", "100000", "--trial-timeout", "6")
    verified = lambda: [t for t in _study_trials(url, "v") if t.user_attrs.get("verified")]  # noqa: E731
    _wait(verified, 300, "the first verifying trial to be stored")
    # the first trial's processes are gone once it is stored: a launcher seen now is the second's.
    # Ctrl-C as soon as it runs (its ranks may still be importing torch on a busy machine; waiting
    # for them could outlast the second trial's own 6-s limit there)
    _wait(lambda: _launchers(cli.tag), 300, "the second trial's launcher to start")
    cli.signal_group(signal.SIGINT)
    rc, _, err = cli.finish()
    assert rc == 130, err
    assert "1 finished verifying trial(s) are kept in study 'v'" in err
    cli.assert_nothing_left()
    done = verified()
    assert len(done) == 1 and "timed out after 6 s" in done[0].user_attrs["trial_reason"]
    # every point the search evaluated is there, once
    from autoconf.specs.cluster import load_cluster
    from autoconf.specs.model import preset
    from autoconf.study.search import search

    fresh = search(preset("tiny"), load_cluster(CLUSTER), 8, storage=f"sqlite:///{tmp_path}/fresh.db")
    searched = [tuple(sorted(t.params.items())) for t in _study_trials(url, "v") if not t.user_attrs.get("verified")]
    assert len(searched) == len(set(searched)) == fresh.trials_run


def test_a_killed_autoconf_takes_its_ranks_with_it(tmp_path, trial_config):
    """autoconf itself SIGKILLed (no cleanup can run): the parent-death signal ends torchrun, and
    torchrun's death ends the ranks. Only the temp directory can be left (nothing runs to remove it)."""
    cli = Cli(tmp_path, "trial", "--config", trial_config, "--steps", "100000")
    _wait(lambda: len(cli.ranks()) == 2, 60, "both ranks to start")
    time.sleep(1.0)
    os.kill(cli.p.pid, signal.SIGKILL)
    cli.finish()
    _wait(lambda: not _tagged(cli.tag), 10, "torchrun and both ranks to die with autoconf")
