"""autoconf/cost/schedule_time.py: the extrapolated makespan, the pipeline floor, the stage transfers.

Expected numbers come from the closed forms of the schedules (GPipe, Huang et al. 2019; 1F1B,
Narayanan et al. 2021, arXiv 2104.04473 sec. 2.2) with equal stages and free transfers, and from
Hockney's alpha-beta for the point-to-point transfer, with the link figures read off the cluster
file and the device catalog.
"""

from __future__ import annotations

import dataclasses

import pytest

from autoconf.cost import schedule_time as st
from autoconf.cost.pipeline import simulate
from autoconf.cost.system import System
from autoconf.space.config import ParallelConfig
from autoconf.specs.cluster import load_cluster
from autoconf.specs.devices import device_type
from autoconf.specs.model import ModelSpec

A100 = load_cluster("examples/clusters/a100-4x8.yaml")
TUNE = device_type("a100-80gb").collective_tuning()
MODEL = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, num_kv_heads=16, ffn_hidden_size=4096,
                  vocab_size=32000, seq_length=2048)


def _cluster(nodes: int, nics: int | None = None):
    g = A100.node_groups[0]
    g = dataclasses.replace(g, count=nodes, **({} if nics is None else {"nic_count": nics}))
    return dataclasses.replace(A100, node_groups=(g,))


def _cfg(pp: int, m: int, **kw) -> ParallelConfig:
    return ParallelConfig(**{"dp": 1, "pp": pp, "tp": 1, "micro_batch_size": 1, "num_micro_batches": m, **kw})


# --- the extrapolated makespan against the closed forms ----------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(2, 3), (4, 8), (4, 64), (8, 1000), (16, 4096)])
def test_equal_stages_take_m_plus_p_minus_1_slots(schedule, pp, m):
    f, b = 1.5e-3, 3.1e-3
    r = st.run_schedule(schedule, pp, m, 1, [f] * pp, [b] * pp, [0.0] * (pp - 1))
    assert r.makespan_s == pytest.approx((m + pp - 1) * (f + b), rel=1e-9)
    # every stage does its own m (f + b), extrapolated or not
    assert r.busy_s == pytest.approx([m * (f + b)] * pp, rel=1e-9)


def test_many_micro_batches_are_extrapolated_not_simulated():
    pp, m, f, b = 8, 5000, 1e-3, 2e-3
    r = st.run_schedule("1f1b", pp, m, 1, [f] * pp, [b] * pp, [0.0] * (pp - 1))
    assert r.m_sim < m and r.m_sim % pp == 0
    assert r.makespan_s == pytest.approx((m + pp - 1) * (f + b), rel=1e-9)


@pytest.mark.parametrize("pp,v,m", [(2, 2, 64), (4, 2, 400), (4, 4, 800), (8, 3, 1024)])
def test_interleaved_bubble_shrinks_by_v(pp, v, m):
    """Each device's v chunks of (f + b) / v each: the bubble is (p - 1)(f + b) / v, 1F1B's over v."""
    f, b = 2e-3, 4e-3  # per stage (all v chunks)
    nc = pp * v
    r = st.run_schedule("interleaved", pp, m, v, [f / v] * nc, [b / v] * nc, [0.0] * (nc - 1))
    one = st.run_schedule("1f1b", pp, m, 1, [f] * pp, [b] * pp, [0.0] * (pp - 1))
    ideal = m * (f + b)
    assert r.makespan_s - ideal == pytest.approx((pp - 1) * (f + b) / v, rel=1e-6)
    assert one.makespan_s - ideal == pytest.approx((pp - 1) * (f + b), rel=1e-6)
    assert (r.makespan_s - ideal) * v == pytest.approx(one.makespan_s - ideal, rel=1e-6)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_extrapolation_matches_the_whole_simulation_with_unequal_stages_and_links(schedule, v):
    pp, m = 4, 96
    nc = pp * v
    fwd = [1.0e-3 * (1 + 0.37 * (ci % 3)) for ci in range(nc)]
    bwd = [2.1e-3 * (1 + 0.21 * (ci % 4)) for ci in range(nc)]
    p2p = [0.15e-3 * (1 + ci % 2) for ci in range(nc - 1)]
    whole = simulate(schedule, pp, m, v, fwd, bwd, p2p)
    r = st.run_schedule(schedule, pp, m, v, fwd, bwd, p2p)
    assert r.m_sim < m
    assert r.makespan_s == pytest.approx(whole.makespan_s, rel=1e-3)
    assert r.busy_s == pytest.approx(whole.busy_s, rel=1e-9)


def test_sim_size_simulates_few_micro_batches_whole_and_many_as_a_multiple_of_pp():
    assert st.sim_size("1f1b", 4, 10) == 10  # at most cap + pp = 8 + 4: all of them
    assert st.sim_size("1f1b", 4, 12) == 12
    assert st.sim_size("1f1b", 4, 13) == 8
    assert st.sim_size("interleaved", 3, 1000) == 9  # cap 8 rounded up to a multiple of 3
    assert st.sim_size("1f1b", 8, 10_000) == 16  # cap 2 pp


# --- the floor ---------------------------------------------------------------------------------


@pytest.mark.parametrize("pp,m", [(1, 5), (2, 4), (4, 16), (8, 33)])
def test_floor_of_equal_stages_is_the_1f1b_makespan(pp, m):
    f, b = 0.7e-3, 1.6e-3
    c = _cfg(pp, m)
    floor = st.pipeline_floor(c, [f] * pp, [b] * pp, pp)
    assert floor == pytest.approx((m + pp - 1) * (f + b), rel=1e-12)
    sim = simulate("1f1b", pp, m, 1, [f] * pp, [b] * pp, [0.0] * (pp - 1))
    assert floor == pytest.approx(sim.makespan_s, rel=1e-12)


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 12)])
def test_floor_of_equal_interleaved_chunks(pp, v, m):
    """(m v + p - 1)(f + b) / v with f + b a stage's work, i.e. (m v + p - 1) chunk slots."""
    fc, bc = 0.5e-3, 1.1e-3
    nc = pp * v
    c = _cfg(pp, m, schedule="interleaved", virtual_stages=v)
    floor = st.pipeline_floor(c, [fc] * nc, [bc] * nc, nc)
    assert floor == pytest.approx((m * v + pp - 1) * (fc + bc), rel=1e-12)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("breadth_first", 2)])
def test_no_schedule_beats_the_floor(schedule, v):
    pp, m = 4, 8
    nc = pp * v
    fwd = [1e-3 * (1 + (ci * 7) % 5 / 4) for ci in range(nc)]
    bwd = [2e-3 * (1 + (ci * 3) % 4 / 3) for ci in range(nc)]
    c = _cfg(pp, m, schedule=schedule, virtual_stages=v)
    floor = st.pipeline_floor(c, fwd, bwd, nc)
    sim = simulate(schedule, pp, m, v, fwd, bwd, [0.0] * (nc - 1))
    assert floor <= sim.makespan_s * (1 + 1e-12)
    # and it is no weaker than the slowest device's own work
    busiest = max(sum(fwd[ci] + bwd[ci] for ci in range(d, nc, pp)) * m for d in range(pp))
    assert floor >= busiest


def test_floor_with_a_slow_last_stage_waits_for_the_first_micro_batch():
    # device 2 does 3 x its neighbours' work: it cannot start before the first forward crossed 0, 1
    c = _cfg(3, 10)
    fwd, bwd = [1.0, 1.0, 3.0], [2.0, 2.0, 6.0]
    assert st.pipeline_floor(c, fwd, bwd, 3) == pytest.approx((1 + 2) * 2 + 10 * 9)


# --- simulate_step: the bubble and the pipeline communication apart ------------------------------


def test_simulate_step_runs_without_transfers_for_the_bubble():
    pp, m, f, b, p = 4, 8, 1e-3, 2e-3, 0.5e-3
    c = _cfg(pp, m)
    sim, sim0 = st.simulate_step("1f1b", c, 1, (f,) * pp, (b,) * pp, (p,) * (pp - 1))
    assert sim0.makespan_s == pytest.approx((m + pp - 1) * (f + b), rel=1e-12)
    assert sim.makespan_s > sim0.makespan_s
    same, same0 = st.simulate_step("1f1b", c, 1, (f,) * pp, (b,) * pp, (0.0,) * (pp - 1))
    assert same is same0


# --- what crosses a stage boundary, and how long it takes ---------------------------------------


@pytest.mark.parametrize("b,tp,sp,cp,want_tokens", [(1, 1, False, 1, 2048), (4, 2, False, 1, 8192),
                                                    (4, 4, True, 1, 2048), (2, 2, True, 2, 1024)])
def test_boundary_tensor_is_b_s_h_at_the_activation_precision(b, tp, sp, cp, want_tokens):
    system = System(MODEL, _cluster(1))
    c = ParallelConfig(dp=1, pp=2, tp=tp, cp=cp, micro_batch_size=b, num_micro_batches=4, sequence_parallel=sp)
    assert st.boundary_tokens(system, c) == want_tokens
    assert st.boundary_bytes(system, c) == want_tokens * 1024 * 2  # bf16


def test_p2p_inside_a_host_is_alpha_plus_bytes_over_nvlink():
    system = System(MODEL, _cluster(1))
    c = _cfg(2, 4)
    nbytes = 2048 * 1024 * 2
    bw = A100.node_groups[0].intra_node_bandwidth_bytes_per_s * TUNE.intra(2)
    want = TUNE.base_latency_s + A100.intra_node_latency_s + nbytes / bw
    # stage 0 -> 1 and the wrap-around pair 1 -> 0 both stay inside the host
    assert st.p2p_times(system, c, nbytes) == pytest.approx([want, want], rel=1e-12)
    assert st.chunk_p2p_times(system, c, 2) == pytest.approx((want,), rel=1e-12)


@pytest.mark.parametrize("nics", [8, 1])
def test_p2p_across_hosts_shares_each_host_s_nics_among_the_replicas(nics):
    """tp 8 x pp 2 on two hosts: each of the 8 tp ranks sends to the next host at once. With 8
    NICs each flow has its own; with one, the 8 flows split it."""
    system = System(MODEL, _cluster(2, nics=nics))
    c = ParallelConfig(dp=1, pp=2, tp=8, micro_batch_size=1, num_micro_batches=4)
    nbytes = 64 * 2**20
    nic = A100.node_groups[0].nic_bandwidth_bytes_per_s
    per_flow = min(nic, nic * nics / 8)
    want = TUNE.base_latency_s + A100.inter_node_latency_s + nbytes / (per_flow * TUNE.inter_efficiency)
    assert st.p2p_times(system, c, nbytes) == pytest.approx([want, want], rel=1e-12)


def test_no_transfers_without_pipelining():
    system = System(MODEL, _cluster(1))
    assert st.chunk_p2p_times(system, _cfg(1, 4), 3) == (0.0, 0.0)
