"""Memory over a pipeline schedule: the activations each device keeps alive at its peak, from the
schedule's own order (``space.schedules``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from autoconf.cost.pipeline import _floats
from autoconf.space.schedules import ORDERS, check_shape


def peak_activation(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int,
                    per_chunk: Sequence[float]) -> tuple[float, ...]:
    """Per device: the peak of sum(per_chunk[c]) over the activation sets alive at once.

    Use when chunks hold different activation sizes (e.g. the first chunk with the embedding, the
    last with the logits), where the moment of the peak count is not the moment of the peak bytes.
    """
    check_shape(schedule, pp, num_micro_batches, virtual_stages)
    return _peak_activation(schedule, pp, num_micro_batches, virtual_stages,
                            _floats("per_chunk", per_chunk, pp * virtual_stages))


def peak_memory(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int,
                per_chunk: Sequence[float], grads_per_chunk: Sequence[float],
                act_scale: float = 1.0, backward_transient: Sequence[float] | None = None,
                input_grads: Sequence[float] | None = None) -> tuple[tuple[float, float], ...]:
    """Per device: (activations, gradients) alive at the moment their sum peaks.

    Gradients are freed after every optimizer step (``zero_grad(set_to_none=True)``), so a chunk's
    gradient (``grads_per_chunk[c]`` bytes) appears at its first backward and stays to the end of
    the step; it is counted before that backward frees the micro-batch's activations. Activations
    are weighted by ``act_scale`` (a schedule simulated with fewer micro-batches than it runs).
    ``backward_transient[c]``: working memory chunk c's backward needs on top (e.g. the loss
    gradient of the logits), counted with the activations at that moment. So GPipe / breadth-first / layered accumulation peak at the end of the forwards with (almost) no
    gradient, and 1F1B with every gradient plus its in-flight micro-batches.
    ``input_grads[c]``: bytes of the gradient w.r.t. chunk c's input, per micro-batch (see
    ``_held_input_grad``), counted with the activations while it is held.
    """
    check_shape(schedule, pp, num_micro_batches, virtual_stages)
    nc = pp * virtual_stages
    bt = _floats("backward_transient", backward_transient, nc) if backward_transient is not None else (0.0,) * nc
    ig = _floats("input_grads", input_grads, nc) if input_grads is not None else (0.0,) * nc
    return _peak_memory(schedule, pp, num_micro_batches, virtual_stages, _floats("per_chunk", per_chunk, nc),
                        _floats("grads_per_chunk", grads_per_chunk, nc), float(act_scale), bt,
                        tuple(_held_input_grad(pp, c, ig[c]) for c in range(nc)))


def _held_input_grad(pp: int, c: int, nbytes: float) -> float:
    """Bytes of chunk c's input gradient its device holds after B(mb, c), per micro-batch.

    ``B(mb, c)`` ends with the gradient w.r.t. the chunk's input; ``B(mb, c-1)`` consumes it. When
    chunk c-1 runs on another device (pp > 1) the gradient is sent and freed at once (the
    receiver's buffer is the pipeline runtime's, counted apart). When it runs on the same device
    (pp = 1: layered accumulation's unit-by-unit order) it stays until ``B(mb, c-1)`` ends, and
    between two units that order runs every micro-batch: all m gradients at that boundary are
    alive at once (Lamy-Poirier, arXiv 2106.02679, sec. 3 -- what layered accumulation trades for
    its single pass over each unit's weights). Chunk 0's input is the token ids: no gradient.
    """
    return nbytes if (c > 0 and (c - 1) % pp == c % pp) else 0.0


@lru_cache(maxsize=4096)
def _peak_memory(schedule: str, pp: int, m: int, v: int, w: tuple[float, ...], g: tuple[float, ...],
                 scale: float, bt: tuple[float, ...], ig: tuple[float, ...]) -> tuple[tuple[float, float], ...]:
    nc = len(w)
    out = []
    for r in range(pp):
        acts = grads = 0.0
        best = (0.0, 0.0)
        seen = set()
        for is_b, _mb, c in ORDERS[schedule](pp, m, v, r):
            if is_b:
                if c not in seen:
                    seen.add(c)
                    grads += g[c]
                if acts + bt[c] + grads > sum(best):
                    best = (acts + bt[c], grads)
                # the activations go; this chunk's input gradient stays (ig), the gradient it
                # received from chunk c+1 (held here when c+1 is local) is consumed
                acts += (ig[c] - w[c] - (ig[c + 1] if c + 1 < nc else 0.0)) * scale
            else:
                acts += w[c] * scale
                if acts + grads > sum(best):
                    best = (acts, grads)
        out.append(best)
    return tuple(out)


@lru_cache(maxsize=4096)
def _peak_activation(schedule: str, pp: int, m: int, v: int, w: tuple[float, ...]) -> tuple[float, ...]:
    out = []
    for r in range(pp):
        live = peak = 0.0
        for is_b, _mb, c in ORDERS[schedule](pp, m, v, r):
            if is_b:
                live -= w[c]
            else:
                live += w[c]
                if live > peak:
                    peak = live
        out.append(peak)
    return tuple(out)
