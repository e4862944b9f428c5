"""An emit writes every launch file or none: a full disk half-way through leaves the previous
launch directory complete (its config.json, node scripts, sbatch.sh, PLAN.md and framework files
all of one plan) and no temp file behind; the next emit that can write replaces them all."""

from __future__ import annotations

import errno
import os

import pytest

from autoconf.cost.estimate import estimate
from autoconf.errors import UserError
from autoconf.launch.emit import emit
from autoconf.space.config import ParallelConfig
from autoconf.specs.cluster import load_cluster
from autoconf.specs.model import preset

A100 = load_cluster("examples/clusters/a100-4x8.yaml")
LLAMA = preset("llama-3-8b")
OLD = ParallelConfig(dp=8, pp=2, tp=2, micro_batch_size=1, num_micro_batches=16)
NEW = ParallelConfig(dp=4, pp=2, tp=4, micro_batch_size=1, num_micro_batches=32)


def _contents(d) -> dict:
    return {p.name: p.read_text() for p in d.iterdir()}


def _emit(config, d):
    return emit(estimate(config, LLAMA, A100, framework="megatron"), LLAMA, A100, str(d))


@pytest.mark.parametrize("fail_at", [1, 3, 6])
def test_a_full_disk_half_way_leaves_the_previous_launch_files_whole(tmp_path, monkeypatch, fail_at):
    d = tmp_path / "launch"
    _emit(OLD, d)
    before = _contents(d)
    assert {"config.json", "sbatch.sh", "PLAN.md", "megatron_args.sh", "node-0.sh"} <= set(before)
    real, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(UserError, match="cannot write the launch files \\(No space left on device\\)"):
        _emit(NEW, d)
    assert len(calls) == fail_at  # it failed while staging, before any file was replaced
    assert _contents(d) == before  # every old file whole, nothing new, no temp file left
    monkeypatch.setattr(os, "fsync", real)
    _emit(NEW, d)
    after = _contents(d)
    assert set(after) == set(before) and all(after[n] != before[n] for n in ("config.json", "megatron_args.sh"))
    assert not [n for n in after if n.startswith(".")]
