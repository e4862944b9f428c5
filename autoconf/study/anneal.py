"""Simulated annealing over a configuration's placement: the alternative to ``Placer.improve``'s
hill climb, compared with it in ``bench/placement_methods.py``.

Pipette ("Pipette: Automatic Fine-grained LLM Training Configurator for Real-World Clusters",
arXiv, May 2024) anneals over the assignment of GPUs to ranks with its
latency model as the energy. Here the moves are the hill climb's own (``Placer._device_moves``:
two stages' devices swapped, or one tensor-parallel group swapped between two differently built
stages, each with the current layer split or the heuristic's split for the new stages; one layer
shifted between adjacent chunks), drawn at random with a seeded generator, and priced by the same
cost model (``cost.estimate.estimate_on``).

Acceptance is Metropolis on the relative change of the step time: a move from t to t' is taken
when (t' - t) / t < -T ln u, u uniform in (0, 1], drawn before the move is priced so that the
threshold becomes the estimate's bound (a move whose least possible work is already past it is
skipped unpriced). The temperature falls geometrically from ``t_start`` to ``t_end`` over the
budget (the evaluations, or the time to the deadline where that is nearer). The best plan seen is
returned, so the result is never worse than the start.

Not the default: on mixed-1024 (llama-2-70b, the search's best three configurations, 200
estimates each) one seed gained at most 1.5% over the hill climb, another lost 2%, and each run
took 2.5 to 5 times the hill climb's wall time (fewer moves are cut by the bound).
"""

from __future__ import annotations

import math
import random
import time

from autoconf.cost.estimate import estimate_on


def anneal(placer, c, max_evaluations: int = 200, deadline: float | None = None, seed: int = 0,
           t_start: float = 0.02, t_end: float = 0.0005):
    """Anneal ``c``'s placement with ``placer``'s moves (a ``study.placer.Placer``).
    Returns (best estimate, estimates evaluated), as ``Placer.improve`` does."""
    ctx = placer.system
    rng = random.Random(seed)
    start_clock = time.perf_counter()
    cur = estimate_on(c, ctx)
    if not cur.fits:
        return cur, 1
    seq = placer._sequence_of(c)
    best = cur
    evals = 1

    def progress() -> float:
        done = evals / max(max_evaluations, 1)
        if deadline is not None:
            span = deadline - start_clock
            done = max(done, (time.perf_counter() - start_clock) / span if span > 0 else 1.0)
        return min(done, 1.0)

    stale = 0
    while evals < max_evaluations and (deadline is None or time.perf_counter() <= deadline):
        moves = _moves(placer, cur.config, seq)
        if not moves:
            break
        cand, new_seq = moves[rng.randrange(len(moves))]
        temperature = t_start * (t_end / t_start) ** progress()
        threshold = -temperature * math.log(1.0 - rng.random())  # accept a relative slowdown below it
        limit = cur.step_time_s * (1.0 + threshold)
        evals += 1
        e = estimate_on(cand, ctx, bound=limit, time_if_oom=False)
        if e is None or not e.fits or e.step_time_s >= limit or cand == cur.config:
            stale += 1
            if stale > 4 * len(moves):  # frozen: nothing near is accepted any more
                break
            continue
        stale = 0
        cur, seq = e, (new_seq if new_seq is not None else seq)
        if e.step_time_s < best.step_time_s:
            best = e
    return best, evals


def _moves(placer, c, seq) -> list:
    """(candidate configuration, its canonical sequence or None where unchanged) for every move the
    hill climb would try from ``c``."""
    out = list(placer.device_candidates(c, seq))
    if placer.layers and c.pp > 1:
        out += [(cand, None) for cand in placer.layer_shifts(c)]
    return out
