"""How often FSDP2 gathers a pipeline chunk's units per step (``space.schedules.fsdp_gathers``)
and what it holds unsharded at once (``fsdp_unsharded_peak``), against closed forms; the trainer
counts the same (tests/trainer/test_fsdp_pipelined.py)."""

from __future__ import annotations

import pytest

from autoconf.space.schedules import fsdp_gathers, fsdp_unsharded_peak


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 3)])
def test_layered_breadth_first_gathers_once_per_pass(pp, m, v):
    g = fsdp_gathers("breadth_first", pp, m, v, layered=True)
    assert sorted(g) == list(range(pp * v)) and set(g.values()) == {(1, 1)}


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 12)])
def test_gpipe_gathers_every_forward_and_one_backward_sweep(pp, m):
    assert set(fsdp_gathers("gpipe", pp, m).values()) == {(m, 1)}
    assert set(fsdp_gathers("gpipe", pp, m, layered=True).values()) == {(1, 1)}


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 8), (4, 16)])
def test_1f1b_gathers_m_plus_one_times(pp, m):
    # stage s: w = pp - s - 1 warm-up forwards, each gathering; the first steady forward gathers,
    # then every backward that follows a forward: w + 1 forward gathers, m - w backward ones
    g = fsdp_gathers("1f1b", pp, m)
    for s in range(pp):
        w = min(pp - s - 1, m)
        assert g[s] == (w + 1, m - w)
        assert sum(g[s]) == m + 1


def test_unsharded_peak_is_one_chunk_in_breadth_first_and_all_chunks_interleaved():
    pp, m, v = 2, 4, 2
    pb = {c: 10.0 * (c + 1) for c in range(pp * v)}  # chunk c's gathered parameter bytes
    gb = {c: 1.0 * (c + 1) for c in range(pp * v)}
    for d in range(pp):
        mine = list(range(d, pp * v, pp))
        bfs = fsdp_unsharded_peak("breadth_first", pp, m, v, True, d, pb, gb)
        assert bfs == max(pb[c] + gb[c] for c in mine)  # one chunk at a time, its gradients with it
        il = fsdp_unsharded_peak("interleaved", pp, m, v, False, d, pb, gb)
        assert max(pb[c] + gb[c] for c in mine) <= il <= sum(pb[c] + gb[c] for c in mine)
    # 1F1B: the stage's one chunk, parameters and gradients, while its backwards run
    assert fsdp_unsharded_peak("1f1b", 2, 4, 1, False, 0, {0: 8.0}, {0: 2.0}) == 10.0
