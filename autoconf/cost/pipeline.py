"""Event simulation of pipeline schedules, with activation liveness.

The step of a pipeline-parallel run is simulated as the schedule really runs it, not by a closed-form
bubble formula: every device executes its forward (F) and backward (B) ops in exactly the order
its schedule prescribes, and an op starts when the device is free and its inputs have arrived:

- ``F(mb, c)`` needs ``F(mb, c-1)`` finished plus the transfer ``p2p_s[c-1]``;
- ``B(mb, c)`` needs ``B(mb, c+1)`` finished plus the transfer ``p2p_s[c]``, and ``F(mb, c)``.

Chunks are global indices ``0 .. pp*v-1`` in model order; chunk ``c`` runs on device ``c % pp``
(looped / modular placement, arXiv 2106.02679; for v = 1 chunk c is stage c). Transfers are async
sends: they delay the dependent op but do not occupy either device.

Per-device orders follow ``torch.distributed.pipelining.schedules`` (torch 2.13):

- ``gpipe``: ScheduleGPipe, all forwards of mb 0..m-1, then all backwards of mb 0..m-1.
- ``1f1b``: Schedule1F1B, ``min(pp - stage - 1, m)`` warm-up forwards, then F/B pairs, then the
  remaining backwards (equal to torch's runtime loop with ``min(pp - stage, m)`` warm-up then B/F).
- ``interleaved``: ScheduleInterleaved1F1B (Megatron's interleaved 1F1B, arXiv 2104.04473):
  warm-up ``min((v-1)*pp + 2*(pp-1-rank), m*v)`` forwards, chunks switched every ``pp``
  micro-batches; needs ``m % pp == 0``.
- ``breadth_first``: ScheduleLoopedBFS (arXiv 2211.05953): for each local chunk ascending the
  forwards of mb 0..m-1, then for each local chunk descending the backwards of mb m-1..0.

With pp = 1, ``1f1b`` is standard gradient accumulation (F0 B0 F1 B1 ...), ``gpipe`` and
``breadth_first`` are layered accumulation (all F, then all B).

Activation liveness: the activations of ``(mb, c)`` are alive from the start of ``F(mb, c)`` to the
end of ``B(mb, c)``. A device runs its ops one after another, so the set alive at each moment depends
only on the device's order, not on the durations: liveness is computed once per schedule shape.

CPU ranks that share a machine's cores (an oversubscribed CPU testbed) are simulated under
processor sharing (:class:`Sharing`): event by event, each computing rank at its machine's cores
over the ranks computing at that moment, at most one core. Stages that take turns (one computes
while another waits on a link) then each compute at a full core, as the operating system runs them.

Speed: the schedule shape ``(schedule, pp, m, v)`` is compiled once (cached) into flat integer lists in
a topological order of the whole dependency graph; a simulation is then one pass over those lists
with no readiness checks (O(ops), a few list reads per op; under processor sharing an event loop,
O(ops x pp), run only for CPU testbeds). ``simulate`` is cached on its arguments.
``timeline`` returns the ops and transfers of that same pass, each with its start and end (what
``autoconf ... --plot`` draws).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from autoconf.space.compression import compressed_sends
from autoconf.space.schedules import ORDERS, check_shape

__all__ = ["PipelineResult", "simulate", "Sharing"]


@dataclass(frozen=True)
class PipelineResult:
    """Timing and activation liveness of one pipeline step."""

    makespan_s: float
    """Time from the first op's start to the last op's end."""
    busy_s: tuple[float, ...]
    """Per device: sum of its op durations (under processor sharing: the time its ops took,
    compression kernels included)."""
    bubble_s: tuple[float, ...]
    """Per device: makespan - busy (idle time inside the step)."""
    peak_live: tuple[tuple[int, ...], ...]
    """Per device, per local chunk (ascending chunk index): activation sets of that chunk alive at the
    device's activation peak (the first moment the peak count is reached)."""
    peak_live_count: tuple[int, ...]
    """Per device: the most (micro-batch, chunk) activation sets alive at once."""
    last_backward_end_s: tuple[float, ...]
    """Per global chunk: end of its last backward op (its gradients are final then)."""
    first_backward_start_s: tuple[float, ...]
    """Per global chunk: start of its first backward op."""


@dataclass(frozen=True)
class Compression:
    """Low-rank compression of backward sends (``cost.compression``) as the simulation charges
    it: the sends of ``compression.compressed_sends(schedule, pp, m, v, mode)`` (for the m simulated)
    take ``p2p_s[c]`` on link c (pp*v - 1 entries) instead of the exact transfer; the sending
    chunk's backward takes ``send_s[c]`` longer (the power iteration and the residual), the
    receiving chunk's ``recv_s[c]`` longer (P Q^T multiplied back), per chunk (pp*v entries)."""

    mode: str
    p2p_s: tuple
    send_s: tuple
    recv_s: tuple


@dataclass(frozen=True)
class Sharing:
    """CPU ranks that share a machine's cores (an oversubscribed CPU testbed), simulated as the
    operating system runs them: processor sharing. A computing rank runs one thread, so at most one
    core, and a machine's busy ranks split its cores: a rank's rate at each moment is
    min(1, cores / ranks computing on its machine then). A rank that waits on a link leaves its core
    to the others, so stages that take turns compute faster than a fixed share says.

    ``share[d]``: the fixed share pipeline device d's compute was priced at (``System.cpu_share``;
    1.0: not shared), so an op's compute is ``(duration - fixed) / share[d]`` core-seconds.
    ``fixed_forward[c]`` / ``fixed_backward[c]``: the part of chunk c's forward / backward that
    was not priced at the share (its collectives and inline traffic, ``schedule_time.sharing``):
    it takes its time whatever the others do, and the rank does not compute meanwhile (empty: none).
    ``weights[M][d]``: ranks of pipeline device d (its dp x tp x cp ranks, in lockstep) on
    machine M; ``cores[M]``: that machine's cores. A device on no machine computes at its
    durations."""

    share: tuple
    weights: tuple
    cores: tuple
    fixed_forward: tuple = ()
    fixed_backward: tuple = ()


# ---------------------------------------------------------------------------------------------
# Per-device orders. An op is (is_backward, micro_batch, global_chunk).



# ---------------------------------------------------------------------------------------------
# Compiled shape: a topological order of all ops with flat dependency indices.


@dataclass(frozen=True)
class _Compiled:
    ops: list[tuple[int, int, int, int, int]]
    """Per op in topological order: (1 + topo index of the previous op on its device or 0 for none,
    1 + topo index of its cross-chunk dependency or 0, 1 + index into p2p_s of the transfer before
    it or 0, index into forward_s + backward_s, the directed device link (src * pp + dst) that
    transfer crosses)."""
    dev_last: tuple[int, ...]  # per device: 1 + topo index of its last op
    first_b: tuple[int, ...]  # per chunk: 1 + topo index of its first backward (device order)
    last_b: tuple[int, ...]   # per chunk: 1 + topo index of its last backward
    peak_live: tuple[tuple[int, ...], ...]
    peak_live_count: tuple[int, ...]
    codes: list[int]
    """Per op in topological order: its op id (F(mb, c) = c*m + mb, B(mb, c) = pp*v*m + c*m + mb)."""
    devs: tuple[int, ...] = ()
    """Per op in topological order: the device that runs it."""


def _liveness(order: list[tuple[bool, int, int]], local_chunks: list[int]) -> tuple[int, tuple[int, ...]]:
    """Peak number of live activation sets on a device, and the per-chunk split at the first peak."""
    live = peak = peak_pos = 0
    for pos, (is_b, _mb, _c) in enumerate(order):
        if is_b:
            live -= 1
        else:
            live += 1
            if live > peak:
                peak, peak_pos = live, pos
    counts = dict.fromkeys(local_chunks, 0)
    for is_b, _mb, c in order[:peak_pos + 1] if peak else ():
        counts[c] += -1 if is_b else 1
    return peak, tuple(counts[c] for c in local_chunks)


@lru_cache(maxsize=64)
def _compile(schedule: str, pp: int, m: int, v: int, compressed: frozenset = frozenset()) -> _Compiled:
    """``compressed``: the (micro_batch, sending chunk) backward sends that go compressed: the
    backward receiving one reads its transfer from the compressed slots of p2p_s (index
    pp*v + c for link c) and its duration from the backward variants (``_durations``)."""
    nc = pp * v
    n_f = nc * m
    n = 2 * n_f
    orders = [ORDERS[schedule](pp, m, v, r) for r in range(pp)]
    # Op id: F(mb, c) = c*m + mb; B(mb, c) = n_f + c*m + mb.
    codes = [[(n_f if b else 0) + c * m + mb for b, mb, c in order] for order in orders]
    seen = bytearray(n)
    for r, order in enumerate(codes):
        if len(order) != 2 * m * v:
            raise RuntimeError(f"{schedule}: device {r} has {len(order)} ops, expected {2 * m * v}")
        for code in order:
            c = (code % n_f) // m
            if seen[code] or c % pp != r:
                raise RuntimeError(f"{schedule}: device {r} order has a duplicate or misplaced op {code}")
            seen[code] = 1

    done = bytearray(n)
    topo_pos = [0] * n  # 1 + topo index, per op id
    topo_codes: list[int] = []
    dev_prev: list[int] = []
    cross: list[int] = []
    p2p_idx: list[int] = []
    link_idx: list[int] = []
    dur_idx: list[int] = []
    op_dev: list[int] = []
    ptr = [0] * pp
    last = [0] * pp
    remaining = n
    last_c = nc - 1
    while remaining:
        progress = False
        for r in range(pp):
            order = codes[r]
            i = ptr[r]
            ln = len(order)
            while i < ln:
                code = order[i]
                if code < n_f:
                    c = code // m
                    if c:
                        dep = code - m
                        if not done[dep]:
                            break
                        cross.append(topo_pos[dep])
                        p2p_idx.append(c)  # p2p_s[c-1], shifted by the leading 0 slot
                        link_idx.append(((c - 1) % pp) * pp + r)
                    else:
                        cross.append(0)
                        p2p_idx.append(0)
                        link_idx.append(0)
                    dur_idx.append(c)
                else:
                    c = (code - n_f) // m
                    if not done[code - n_f]:
                        break
                    mb = code % m
                    k = 1 if (mb, c) in compressed else 0
                    if c < last_c:
                        dep = code + m
                        if not done[dep]:
                            break
                        cross.append(topo_pos[dep])
                        if (mb, c + 1) in compressed:
                            p2p_idx.append(nc + c)  # the compressed p2p_s[c]
                            k += 2
                        else:
                            p2p_idx.append(c + 1)  # p2p_s[c]
                        link_idx.append(((c + 1) % pp) * pp + r)
                    else:
                        cross.append(0)
                        p2p_idx.append(0)
                        link_idx.append(0)
                    dur_idx.append(nc * (1 + k) + c)
                dev_prev.append(last[r])
                op_dev.append(r)
                topo_codes.append(code)
                done[code] = 1
                topo_pos[code] = last[r] = len(dev_prev)
                i += 1
            if i != ptr[r]:
                progress = True
                remaining -= i - ptr[r]
                ptr[r] = i
        if not progress:
            raise RuntimeError(_deadlock_message(schedule, pp, m, v, orders, ptr, done))

    first_b = [0] * nc
    last_b = [0] * nc
    for order in codes:
        for code in order:
            if code >= n_f:
                c = (code - n_f) // m
                if not first_b[c]:
                    first_b[c] = topo_pos[code]
                last_b[c] = topo_pos[code]

    lives = [_liveness(orders[r], list(range(r, nc, pp))) for r in range(pp)]
    return _Compiled(list(zip(dev_prev, cross, p2p_idx, dur_idx, link_idx)), tuple(last), tuple(first_b), tuple(last_b),
                     tuple(x[1] for x in lives), tuple(x[0] for x in lives), topo_codes, tuple(op_dev))


def _deadlock_message(schedule: str, pp: int, m: int, v: int, orders, ptr: list[int], done: bytearray) -> str:
    """Name the stuck device: preferably one waiting on an op later in its own order (the cause)."""
    waits = []
    for r in range(pp):
        if ptr[r] == len(orders[r]):
            continue
        is_b, mb, c = orders[r][ptr[r]]
        if not is_b:
            need = ("F", mb, c - 1)
        elif not done[c * m + mb]:
            need = ("F", mb, c)
        else:
            need = ("B", mb, c + 1)
        waits.append((need[2] % pp == r, r, f"{'B' if is_b else 'F'}(mb={mb}, chunk={c})",
                      f"{need[0]}(mb={need[1]}, chunk={need[2]}) on device {need[2] % pp}"))
    own, r, op, need = max(waits, key=lambda w: (w[0], -w[1]))
    others = ", ".join(str(w[1]) for w in waits if w[1] != r)
    return (f"pipeline schedule {schedule!r} (pp={pp}, m={m}, v={v}) deadlocks: device {r} is stuck at {op}, "
            f"waiting for {need}{' which comes later in its own order' if own else ''}"
            f"{f'; also stuck: devices {others}' if others else ''}")


# ---------------------------------------------------------------------------------------------
# Simulation.


def _run(comp: _Compiled, dur: tuple[float, ...], P: tuple[float, ...],
         posted: bool = False) -> tuple[list[float], list[float]]:
    """The simulation: ``E[k]`` = end time of the op at topo index k-1 (``E[0] = 0`` stands for "no
    dependency"); and the start of every transfer that takes time, in topological order of the ops
    waiting for them. An op starts when its device is free and its input has arrived.

    ``posted``: a transfer also waits until its receiver has posted the receive, which
    ``torch.distributed.pipelining`` does right before the op that consumes it, so when the
    receiver's previous op has ended. That is what happens when the process computes
    synchronously and the transport hands data over only to a posted receive (gloo's TCP pairs
    send once the peer says it is ready to receive); a GPU process enqueues its receive ahead of
    the kernels still running, so there the transfer overlaps the receiver's previous op."""
    pp = len(comp.dev_last)
    E = [0.0]
    append = E.append
    sends: list[float] = []
    send = sends.append
    # A link carries one transfer at a time: transfers from one device to the next go in the
    # order they are sent, each starting when both the data and the link are ready.
    free = [0.0] * (pp * pp)
    for pv, dp, pi, di, li in comp.ops:
        s = E[pv]
        if pi and P[pi]:
            r = E[dp]
            f = free[li]
            r = r if r > f else f
            if posted and s > r:
                r = s
            send(r)
            r += P[pi]
            free[li] = r
        else:
            r = E[dp]
        append((r if r > s else s) + dur[di])
    return E, sends


def _run_shared(comp: _Compiled, dur: tuple[float, ...], P: tuple[float, ...], posted: bool,
                sh: Sharing) -> tuple[list[float], list[float], list[float], list[float]]:
    """``_run`` under processor sharing (:class:`Sharing`): the same dependencies, link order and
    posted-receive rule, simulated event by event because an op's duration now depends on what
    the other devices compute meanwhile. An op computes first (at its processor-sharing rate),
    then spends its fixed part. Returns what ``_run`` returns, per device the time its ops took
    (their elapsed busy time, compression kernels included) and per op (``E``'s indexing) its start."""
    ops, devs = comp.ops, comp.devs
    n, pp, nc = len(ops), len(comp.dev_last), len(comp.first_b)
    fixed = (sh.fixed_forward or (0.0,) * nc) + (sh.fixed_backward or (0.0,) * nc)
    seq: list[list[int]] = [[] for _ in range(pp)]
    for k in range(1, n + 1):
        seq[devs[k - 1]].append(k)
    # a link's transfers all go to one device, so they are claimed in that device's order: the
    # topological order ``_run`` claims them in
    free = [0.0] * (pp * pp)
    machines = [(row, c) for row, c in zip(sh.weights, sh.cores) if any(row)]
    E = [0.0] * (n + 1)
    S = [0.0] * (n + 1)
    known = bytearray(n + 1)
    known[0] = 1
    sent: dict = {}
    nxt = [0] * pp
    start: list = [None] * pp   # the resolved start of the device's next op
    phase = [0] * pp            # 0 idle, 1 computing, 2 in its fixed part
    rem = [0.0] * pp            # core-seconds of compute left
    fix = [0.0] * pp            # seconds of the fixed part left
    busy = [0.0] * pp
    t, left = 0.0, n

    def done(r):
        k = seq[r][nxt[r]]
        E[k], known[k] = t, 1
        busy[r] += t - S[k]
        phase[r], start[r] = 0, None
        nxt[r] += 1

    while left:
        # resolve what can be: a device's next op, once its inputs' ends are known
        for r in range(pp):
            if phase[r] or start[r] is not None or nxt[r] >= len(seq[r]):
                continue
            k = seq[r][nxt[r]]
            pv, dp, pi, _di, li = ops[k - 1]
            if not (known[pv] and known[dp]):
                continue
            s = E[pv]
            if pi and P[pi]:
                a = E[dp] if E[dp] > free[li] else free[li]
                if posted and s > a:
                    a = s
                sent[k] = a
                a += P[pi]
                free[li] = a
            else:
                a = E[dp]
            start[r] = max(a, s, t)
        # start what starts now; an op without compute goes straight to its fixed part
        instant = False
        for r in range(pp):
            if not phase[r] and start[r] is not None and start[r] <= t:
                k = seq[r][nxt[r]]
                di = ops[k - 1][3]
                d = dur[di]
                x = min(d, fixed[(nc if di >= nc else 0) + di % nc])
                S[k], phase[r], rem[r], fix[r] = t, 1, (d - x) / sh.share[r], x
                if rem[r] <= 0.0:
                    phase[r] = 2
                    if fix[r] <= 0.0:
                        done(r)
                        left -= 1
                        instant = True
        if instant:  # an op took no time: what waits on it may start now
            continue
        rate = [1.0] * pp
        for row, cores in machines:
            active = sum(w for w, ph in zip(row, phase) if ph == 1)
            if active > cores:
                for r in range(pp):
                    if row[r] and phase[r] == 1:
                        rate[r] = min(rate[r], cores / active)
        ends = [(t + rem[r] / rate[r]) if phase[r] == 1 else t + fix[r] for r in range(pp) if phase[r]]
        t_next = min([start[r] for r in range(pp) if not phase[r] and start[r] is not None] + ends, default=None)
        if t_next is None:
            raise RuntimeError("pipeline simulation under processor sharing made no progress")
        dt = t_next - t
        t = t_next
        tol = 1e-12 * max(1.0, t)
        for r in range(pp):
            if phase[r] == 1:
                rem[r] -= rate[r] * dt
                if rem[r] <= tol:
                    phase[r] = 2  # its fixed part starts now
            elif phase[r] == 2:
                fix[r] -= dt
            if phase[r] == 2 and fix[r] <= tol and rem[r] <= tol:
                done(r)
                left -= 1
    return E, [sent[k] for k in sorted(sent)], busy, S


def _durations(forward_s: tuple, backward_s: tuple, p2p_s: tuple, z: Compression | None) -> tuple[tuple, tuple]:
    """(op durations, transfer times) as ``_compile``'s indices read them: forwards, backwards,
    then the backwards that send compressed, that receive compressed, that do both; exact
    transfers, then compressed ones."""
    if z is None:
        return forward_s + backward_s, (0.0,) + p2p_s
    b, snd, rcv = backward_s, z.send_s, z.recv_s
    return (forward_s + b + tuple(x + y for x, y in zip(b, snd)) + tuple(x + y for x, y in zip(b, rcv))
            + tuple(x + y + w for x, y, w in zip(b, snd, rcv))), (0.0,) + p2p_s + z.p2p_s


def _compiled(schedule: str, pp: int, m: int, v: int, z: Compression | None) -> _Compiled:
    if z is None or z.mode == "none":
        return _compile(schedule, pp, m, v)
    return _compile(schedule, pp, m, v, compressed_sends(schedule, pp, m, v, z.mode))


@lru_cache(maxsize=16384)
def _simulate(schedule: str, pp: int, m: int, v: int, forward_s: tuple[float, ...],
              backward_s: tuple[float, ...], p2p_s: tuple[float, ...], posted: bool = False,
              compression: Compression | None = None, sharing: Sharing | None = None) -> PipelineResult:
    comp = _compiled(schedule, pp, m, v, compression)
    nc = pp * v
    E, _sends, elapsed, starts = _pass(comp, *_durations(forward_s, backward_s, p2p_s, compression), posted, sharing)
    makespan = max(E[k] for k in comp.dev_last)
    busy = tuple(m * sum(forward_s[c] + backward_s[c] for c in range(r, nc, pp)) for r in range(pp))
    first_b = tuple(E[k] - backward_s[c] for c, k in enumerate(comp.first_b))
    if elapsed is not None:  # what the ops took at their processor-sharing rates (kernels included)
        busy = tuple(elapsed)
        first_b = tuple(starts[k] for k in comp.first_b)
    return PipelineResult(
        makespan_s=makespan,
        busy_s=busy,
        bubble_s=tuple(makespan - b for b in busy),
        peak_live=comp.peak_live,
        peak_live_count=comp.peak_live_count,
        last_backward_end_s=tuple(E[k] for k in comp.last_b),
        first_backward_start_s=first_b,
    )


def _pass(comp: _Compiled, dur: tuple, P: tuple, posted: bool, sharing: Sharing | None):
    """(op ends, transfer starts, per device busy time and per op start, or None for both: the
    durations and what ``timeline`` reads back) of one run."""
    return (*_run(comp, dur, P, posted), None, None) if sharing is None else _run_shared(comp, dur, P, posted, sharing)


def _sharing(sh: Sharing | None, pp: int, nc: int) -> Sharing | None:
    if sh is None:
        return None
    share = _floats("sharing.share", sh.share, pp)
    fixed = tuple(_floats(f"sharing.{name}", xs, nc) if xs else () for name, xs in
                  (("fixed_forward", sh.fixed_forward), ("fixed_backward", sh.fixed_backward)))
    if min(share) < 1.0:
        raise ValueError(f"sharing.share entries must be >= 1, got {share!r}")
    weights = tuple(tuple(int(w) for w in row) for row in sh.weights)
    cores = tuple(float(c) for c in sh.cores)
    if len(weights) != len(cores) or any(len(row) != pp or min(row) < 0 for row in weights) or \
            not all(c > 0 and math.isfinite(c) for c in cores):
        raise ValueError(f"sharing needs one row of {pp} rank counts >= 0 per machine and one core count > 0 "
                         f"per machine, got weights={sh.weights!r}, cores={sh.cores!r}")
    return Sharing(share, weights, cores, *fixed)


def _floats(name: str, xs: Sequence[float], n: int) -> tuple[float, ...]:
    t = tuple(map(float, xs))
    if len(t) != n:
        raise ValueError(f"{name} has {len(t)} entries, expected {n} (one per {'link' if name == 'p2p_s' else 'chunk'})")
    if t and not (min(t) >= 0.0 and math.isfinite(sum(t))):
        raise ValueError(f"{name} entries must be finite and >= 0, got {t!r}")
    return t


def simulate(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int,
             forward_s: Sequence[float], backward_s: Sequence[float], p2p_s: Sequence[float],
             posted: bool = False, compression: Compression | None = None,
             sharing: Sharing | None = None) -> PipelineResult:
    """Simulate one step of ``schedule`` and return its timing and activation liveness.

    ``forward_s[c]`` / ``backward_s[c]``: per-micro-batch duration of global chunk c (pp*v entries);
    ``p2p_s[c]``: transfer time between chunk c and c+1 (pp*v - 1 entries), for the activation going
    forward and the gradient coming back; a link carries one transfer at a time. ``posted``: a
    transfer starts only once its receiver has posted the receive (CPU processes: see ``_run``).
    ``compression``: compressed backward sends (:class:`Compression`); ``busy_s`` stays the ops'
    own work, without the compression kernels. ``sharing``: CPU ranks sharing cores, at
    processor-sharing rates (:class:`Sharing`; ``busy_s`` is then the time each device's ops
    took). Raises ValueError for an invalid shape and RuntimeError if the schedule's order can
    never progress. Results are cached on the arguments.
    """
    check_shape(schedule, pp, num_micro_batches, virtual_stages)
    nc = pp * virtual_stages
    return _simulate(schedule, pp, num_micro_batches, virtual_stages,
                     _floats("forward_s", forward_s, nc), _floats("backward_s", backward_s, nc),
                     _floats("p2p_s", p2p_s, nc - 1), bool(posted), _checked(compression, nc),
                     _sharing(sharing, pp, nc))


def _checked(z: Compression | None, nc: int) -> Compression | None:
    if z is None or z.mode == "none":
        return None
    return Compression(z.mode, _floats("p2p_s", z.p2p_s, nc - 1), _floats("send_s", z.send_s, nc),
                       _floats("recv_s", z.recv_s, nc))


