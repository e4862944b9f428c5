"""Trial runs: a configuration trained for a few real steps under torchrun by the reference trainer.

``run_trial`` launches ``python -m torch.distributed.run --standalone --nproc-per-node=<world>
-m autoconf.trainer ...`` with one thread per process, waits at most ``timeout_s`` (then kills the
whole process group) and reads the per-rank JSON the trainer wrote. A crash, a timeout or an
out-of-memory becomes ``TrialResult(ok=False, reason=...)``: a failed trial never raises.

What runs is a launch plan (``autoconf.launch.plan.LaunchPlan``, the ``config.json`` that ``autoconf
search --emit`` writes and the trainer reads). No torch here: this module runs in the planner's process.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from autoconf import procs
from autoconf.cost.measured import block_times
from autoconf.errors import UserError
from autoconf.launch.hosts import node_plan
from autoconf.launch.plan import LaunchPlan, load
from autoconf.launch.shell import python_torchrun, torchrun_argv
from autoconf.runs.testbed import attached, node_commands
from autoconf.space.config import ParallelConfig, check
from autoconf.specs.model import ModelSpec

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class TrialResult:
    """What a short real run measured (or why it failed)."""

    ok: bool
    reason: str = ""
    """Empty when ok; otherwise one line: the exception, 'timed out after N s', 'out of memory', ..."""
    step_time_s: float | None = None
    """Median step time after warm-up, slowest rank (the step ends when every rank is done)."""
    peak_memory_bytes: int | None = None
    """Largest per-rank peak over all ranks."""
    per_rank: list = field(default_factory=list)
    """The trainer's per-rank result documents."""
    losses: list = field(default_factory=list)
    """Training loss per step (mean over the global batch)."""
    wall_s: float = 0.0
    """Wall-clock time of the whole launch, start-up included."""
    config: dict | None = None
    """The ParallelConfig that ran, as a dict."""
    memory_method: str = ""
    """How peak memory was measured."""
    speed_probe_s: float | None = None
    """With ``speed_probe``: the median over ranks of each rank's median probe (one block's
    forward+backward at micro-batch size 1), to compare with the profile's (``speed_vs_profile``)."""

    def to_dict(self) -> dict:
        return {"ok": self.ok, "reason": self.reason, "step_time_s": self.step_time_s,
                "peak_memory_bytes": self.peak_memory_bytes, "losses": list(self.losses),
                "wall_s": self.wall_s, "config": self.config, "memory_method": self.memory_method,
                "speed_probe_s": self.speed_probe_s,
                "per_rank": list(self.per_rank)}


def check_seconds(value, what: str) -> float:
    """A time limit must be a finite number of seconds above zero; UserError otherwise."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise UserError(f"{what} {value!r}: expected a number of seconds") from None
    if not math.isfinite(v) or v <= 0:
        raise UserError(f"{what} {value!r}: expected a finite number of seconds above 0")
    return v



# -- running -------------------------------------------------------------------------------------

def _plan(plan_or_path) -> LaunchPlan:
    return plan_or_path if isinstance(plan_or_path, LaunchPlan) else load(plan_or_path)


def run_trial(plan_or_path, steps: int = 6, warmup: int = 2, timeout_s: float = 300.0,
              nproc: int | None = None, env_extra: dict | None = None, step_timeout_s: float | None = None,
              out_dir: str | None = None, keep: bool = False, speed_probe: bool = False,
              data_file: str | None = None) -> TrialResult:
    """Run the configuration for ``steps`` steps (``warmup`` of them untimed) under torchrun.

    ``nproc`` defaults to the configuration's world size. ``step_timeout_s`` (default: ``timeout_s``)
    bounds each step and every collective inside the trainer. Output goes to ``out_dir`` (a
    temporary directory, removed unless ``keep``, when not given). ``speed_probe``: time the
    profile's reference block after every timed step (see ``speed_vs_profile``). ``data_file``:
    train on that file's bytes as tokens (the trainer's ``--data-file``).
    """
    plan = _plan(plan_or_path)
    config = plan.config
    check_seconds(timeout_s, "timeout")
    if step_timeout_s is not None:
        check_seconds(step_timeout_s, "step timeout")
    nproc = nproc or config.world_size
    step_timeout_s = step_timeout_s or timeout_s
    tmp = None
    if out_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="autoconf-trial-")
        out_dir = tmp.name
    os.makedirs(out_dir, exist_ok=True)
    try:
        return _launch(plan, config, out_dir, steps, warmup, timeout_s, nproc, env_extra, step_timeout_s, speed_probe,
                       data_file)
    finally:
        with procs.deferred_signals():  # a second Ctrl-C cannot leave the directory behind
            if tmp is not None and not keep:
                tmp.cleanup()


def _launch(plan, config, out_dir, steps, warmup, timeout_s, nproc, env_extra, step_timeout_s,
            speed_probe=False, data_file=None) -> TrialResult:
    cfg_path = plan.write(os.path.join(out_dir, "config.json"))
    script = (["-m", "autoconf.trainer", "--config", cfg_path, "--out", out_dir, "--steps", str(steps),
               "--warmup", str(warmup), "--step-timeout", str(step_timeout_s)]
              + (["--speed-probe"] if speed_probe else [])
              + (["--data-file", os.path.abspath(data_file)] if data_file else []))
    cmd = torchrun_argv(script, nproc, launcher=python_torchrun())
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH", "")) if p)})
    env.update(env_extra or {})
    oom_before = procs.oom_kills()
    t0 = time.perf_counter()
    tb = attached()
    with open(os.path.join(out_dir, "torchrun.log"), "w") as log:
        if tb is not None:  # under `autoconf testbed --driver`: one torchrun per emulated node
            returncode, timed_out = _launch_nodes(node_commands(tb, _host_counts(plan, nproc, tb), script, env),
                                                  log, timeout_s)
        else:
            with procs.ProcessTree(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, private_tmp=True) as tree:
                returncode = tree.wait(timeout=timeout_s)
                timed_out = returncode is None
                # on a timeout, an interrupt or an error: the whole tree, stopped ranks included (__exit__)
    wall = time.perf_counter() - t0
    oom_after = procs.oom_kills()
    kernel_oom = oom_before is not None and oom_after is not None and oom_after > oom_before
    return collect(out_dir, nproc, returncode, timed_out, timeout_s, wall, config, kernel_oom=kernel_oom)


def _host_counts(plan: LaunchPlan, nproc: int, tb: dict) -> list[int]:
    """Processes per host as the plan was priced: the first ``nproc`` devices of the plan's
    cluster, host by host; without a cluster, spread evenly over the testbed's nodes."""
    if plan.cluster is not None:
        return [p["nproc"] for p in node_plan(plan.cluster, nproc)]
    n = len(tb["nodes"])
    if nproc % n:
        raise UserError(f"{nproc} processes cannot be spread evenly over the testbed's {n} nodes")
    return [nproc // n] * n


def _launch_nodes(commands, log, timeout_s: float) -> tuple[int | None, bool]:
    """Start one process tree per node, wait for all (a failed node ends the others, as a
    single torchrun would); (exit code: the first failure's or 0, timed out)."""
    import contextlib
    deadline = time.monotonic() + timeout_s
    with contextlib.ExitStack() as stack:
        trees = [stack.enter_context(procs.ProcessTree(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                       private_tmp=True))
                 for argv, env in commands]
        while True:
            codes = [t.proc.poll() for t in trees]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return failed[0], False
            if all(c == 0 for c in codes):
                return 0, False
            if time.monotonic() > deadline:
                return None, True
            time.sleep(0.05)


_PEER_GONE = ("read error", "connection closed", "connection reset", "broken pipe", "connection refused",
              "socket closed", "remote worker")


def _symptom(reason: str) -> bool:
    """Whether a rank's failure is only the echo of another rank's (its peer vanished): when one
    rank times out or runs out of memory, the others see their connections drop. The root cause
    is reported, not the echo."""
    low = reason.lower()
    return any(s in low for s in _PEER_GONE)


_EXIT_RE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
_OOM_MARKS = ("memoryerror", "out of memory", "outofmemoryerror", "oom-kill", "cannot allocate memory")


def rank_exits(log_text: str) -> dict:
    """rank -> exit code of each failed rank in torchrun's failure report (negative: the signal
    that killed it)."""
    return {int(r): int(c) for r, c in _EXIT_RE.findall(log_text)}


def _describe_exit(rank: int, code: int, oom: bool) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        what = f"rank {rank}: killed by {name}"
        if oom and -code == signal.SIGKILL:
            what = f"rank {rank}: out of memory (killed by SIGKILL)"
        return what
    return f"rank {rank}: exited with code {code} without writing a result"


def collect(out_dir: str, nproc: int, returncode, timed_out: bool, timeout_s: float, wall_s: float,
            config: ParallelConfig, kernel_oom: bool = False) -> TrialResult:
    """Turn the trainer's per-rank files (and the launcher's exit) into one TrialResult.

    The reason names the root cause: a rank's own failure (out of memory, an exception), else the
    timeout, else the rank that died without a result and how (signal or exit code, from
    torchrun's failure report; SIGKILL with the kernel's OOM kill count rising or an out-of-memory
    mark in the log is labelled out of memory), and only then a rank that merely saw its peer go."""
    per_rank = []
    for r in range(nproc):
        path = os.path.join(out_dir, f"rank_{r}.json")
        try:
            with open(path) as f:
                per_rank.append(json.load(f))
        except (OSError, json.JSONDecodeError):
            pass
    base = {"per_rank": per_rank, "wall_s": wall_s, "config": config.to_dict()}
    failed = sorted((r for r in per_rank if not r.get("ok")), key=lambda r: r.get("rank", 0))
    roots = [r for r in failed if not _symptom(r.get("reason", ""))]
    if roots:
        return TrialResult(ok=False, reason=f"rank {roots[0].get('rank')}: {roots[0].get('reason', 'failed')}", **base)
    if timed_out:
        return TrialResult(ok=False, reason=f"timed out after {timeout_s:g} s (every process killed)", **base)
    log = _read_log(out_dir)
    wrote = {r.get("rank") for r in per_rank}
    echoed = {r.get("rank") for r in failed}  # these wrote why they failed: their peer went away
    dead = {k: c for k, c in rank_exits(log).items() if c != 0 and k not in echoed}
    if dead:
        oom = kernel_oom or any(m in log.lower() for m in _OOM_MARKS)
        root = rank_exits(log.rpartition("Root Cause")[2]) if "Root Cause" in log else {}
        # torchrun's first observed failure, then killed by a signal (its own closing SIGTERM last)
        rank, code = min(dead.items(), key=lambda kc: (kc[0] not in root, kc[1] >= 0,
                                                       kc[1] == -signal.SIGTERM, kc[0]))
        return TrialResult(ok=False, reason=_describe_exit(rank, code, oom), **base)
    if failed:
        return TrialResult(ok=False, reason=f"rank {failed[0].get('rank')}: {failed[0].get('reason', 'failed')}", **base)
    if len(per_rank) < nproc or returncode != 0:
        missing = sorted(set(range(nproc)) - wrote)
        return TrialResult(ok=False, reason=f"torchrun exited with code {returncode}; no result from rank(s) "
                           f"{', '.join(map(str, missing)) or '-'}: {_log_tail(out_dir)}", **base)
    times = [r["step_time_s"] for r in per_rank if r.get("step_time_s") is not None]
    peaks = [r["peak_memory_bytes"] for r in per_rank if r.get("peak_memory_bytes") is not None]
    losses = next((r["losses"] for r in per_rank if r.get("rank") == 0), [])
    probes = [r["speed_probe_s"] for r in per_rank if r.get("speed_probe_s") is not None]
    return TrialResult(ok=True, step_time_s=max(times) if times else None,
                       speed_probe_s=statistics.median(probes) if probes else None,
                       peak_memory_bytes=max(peaks) if peaks else None, losses=losses,
                       memory_method=per_rank[0].get("memory_method", ""), **base)


def speed_vs_profile(result: TrialResult, profile, model: ModelSpec) -> float | None:
    """How much slower (> 1) or faster the machine ran during the trial than when ``profile`` was
    measured: the trial's speed probe over the profile's time for the same block (micro-batch
    size 1, tp 1, no recomputation). None without a probe or without that profile row. A shared
    or throttled machine drifts; this separates that drift from the cost model's own error."""
    if result.speed_probe_s is None or profile is None:
        return None

    got = block_times(profile, model, 1, 1, "none")
    return result.speed_probe_s / (got[0] + got[1]) if got and got[0] + got[1] > 0 else None


def _read_log(out_dir: str) -> str:
    try:
        with open(os.path.join(out_dir, "torchrun.log"), errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _log_tail(out_dir: str, lines: int = 3) -> str:
    text = [ln.strip() for ln in _read_log(out_dir).splitlines() if ln.strip()]
    if not text:
        return "(no log)"
    errors = [ln for ln in text if "Error" in ln or "error" in ln]
    return " | ".join((errors or text)[-lines:])[-500:]


def verify(candidates, model: ModelSpec, cluster=None, steps: int = 6, warmup: int = 2,
           timeout_s: float = 300.0, seed: int = 0, progress=None, speed_probe: bool = False,
           on_result=None) -> list[TrialResult]:
    """Run each ParallelConfig in turn (one torchrun at a time); a failure is a result, not an error.
    ``speed_probe``: each trial also times the profile's reference block (``speed_vs_profile``).
    ``on_result(i, result)`` is called as each trial finishes (to store it at once)."""
    check_seconds(timeout_s, "trial timeout")
    results = []
    for i, config in enumerate(candidates):
        if progress is not None:
            progress(i, config)
        reason = check(config, model)
        if reason:
            result = TrialResult(ok=False, reason=f"invalid configuration: {reason}", config=config.to_dict())
        else:
            result = run_trial(LaunchPlan(config, model, cluster, seed=seed), steps=steps, warmup=warmup,
                               timeout_s=timeout_s, speed_probe=speed_probe)
        results.append(result)
        if on_result is not None:
            on_result(i, result)
    return results


def local_device_kind() -> str:
    """'cuda' when this machine has a GPU the trainer would use, else 'cpu' (no torch import:
    CUDA_VISIBLE_DEVICES, then the NVIDIA driver's list)."""
    return "cuda" if local_gpu_count() else "cpu"


def local_gpu_count() -> int:
    """GPUs the trainer would use here (CUDA_VISIBLE_DEVICES, else the NVIDIA driver's list)."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return len([d for d in vis.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


# -- CLI ---------------------------------------------------------------------------------------------

