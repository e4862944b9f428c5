"""Context parallelism: the key/value exchange of attention over a sequence split across cp ranks.

With the load-balanced causal split (Megatron-LM / Transformer Engine, torch's
``context_parallel``; Liu et al., "Ring Attention", arXiv 2310.01889; Brandon et al., "Striped
Attention", arXiv 2311.09431) each of the cp ranks holds two of 2 x cp sequence chunks, so every
rank has 1/cp of the causal attention work (``cost.attention.attention_core_times``) and of every other
layer's tokens. What attention needs from the others are their keys and values; the frameworks
move them in one of two ways (``Framework.cp_comm``):

- **ring** (point-to-point): cp - 1 steps; in each, a rank computes attention against the
  key/value chunk in hand while it sends that chunk on and receives the next. The exchange is
  hidden where a step's attention outlasts its transfer; a layer exposes
  (cp - 1) x max(0, transfer - step). The backward passes the keys and values again and the
  partial key/value gradients with them (twice the bytes), against steps of the backward's
  attention, and one last hop brings each chunk's key/value gradients home (exposed).
- **all_gather**: every rank's keys and values are gathered once per layer before the first step
  (issued asynchronously, hidden behind the attention of the rank's own chunk), and in the
  backward gathered again and their gradients reduce-scattered (hidden behind the local chunk's
  backward only).

Bytes per rank and layer: its s/cp tokens x (K and V: 2 x kv width / tp) x the activation's bytes.
The links are those of the configuration's cp groups (``cost.groups.axis_links``), at the
collective library's efficiency.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoconf.cost import comm
from autoconf.cost.attention import attention_core_times
from autoconf.cost.groups import axis_links, collective_s
from autoconf.cost.system import System
from autoconf.space.config import ParallelConfig


@dataclass(frozen=True)
class CpTimes:
    """Exposed context-parallel communication per layer and micro-batch."""

    forward_per_layer_s: float = 0.0
    backward_per_layer_s: float = 0.0
    """Including the forward's exchange again under full recomputation."""
    transfer_s: float = 0.0
    """One ring step's transfer (K and V of one chunk) on the slowest cp group (0 without cp)."""


def kv_chunk_bytes(system: System, c: ParallelConfig) -> float:
    """Bytes of the keys and values of one rank's s/cp tokens, per micro-batch and TP rank."""
    m = system.model
    return c.micro_batch_size * (m.seq_length / c.cp) * (m.k_size + m.v_size) / c.tp * m.dtype_bytes


def ring_step_s(system: System, c: ParallelConfig, nbytes: float) -> float:
    """One ring step: every rank sends ``nbytes`` to its successor in its cp group at once, as a
    ring collective's step does (the slowest group; across hosts one flow per group leaves each
    host, NIC sharing among groups as ``axis_links`` counts it), with the library's fixed cost."""
    tune = system.collective_tuning
    worst = 0.0
    for g in axis_links(system, c, "cp"):
        bw, lat = comm._ring_link(g, tune)
        worst = max(worst, tune.base_latency_s + lat + nbytes / bw)
    return worst


def cp_times(system: System, c: ParallelConfig, stage_kinds) -> CpTimes:
    """Per-layer exposed exchange of context parallelism on the slowest device kind of the
    stages (0 for cp = 1)."""
    if c.cp == 1:
        return CpTimes()
    kinds = sorted({k for ks in stage_kinds for k in ks})
    att_f = att_b = float("inf")
    for kind in kinds:  # the fastest attention hides the least
        f, b = attention_core_times(system.model, c.micro_batch_size, c.tp, system.roofline(kind), c.cp,
                                    system.framework.ring_math)
        att_f, att_b = min(att_f, f), min(att_b, b)
    kv = kv_chunk_bytes(system, c)
    mode = system.framework.cp_comm or "ring"
    overlaps = not any(k == "cpu" for k in kinds)  # CPU processes compute and communicate on one core
    if mode == "ring":
        step_f, step_b = att_f / c.cp, att_b / c.cp
        t_f, t_b = ring_step_s(system, c, kv), ring_step_s(system, c, 2 * kv)
        # the backward's last hop returns each chunk's key/value gradients to their owner (kv bytes)
        t_home = ring_step_s(system, c, kv)
        if overlaps:
            fwd = (c.cp - 1) * max(0.0, t_f - step_f)
            bwd = (c.cp - 1) * max(0.0, t_b - step_b) + t_home
        else:
            fwd, bwd = (c.cp - 1) * t_f, (c.cp - 1) * t_b + t_home
        one = t_f
    else:
        links = axis_links(system, c, "cp")
        gathered = kv * c.cp  # all_gather_s takes the gathered size
        ag = collective_s(system, links, comm.all_gather_s, c.cp, gathered)
        rs = collective_s(system, links, comm.reduce_scatter_s, c.cp, gathered)
        if overlaps:
            fwd = max(0.0, ag - att_f / c.cp)
            bwd = max(0.0, ag + rs - att_b / c.cp)
        else:
            fwd, bwd = ag, ag + rs
        one = ag
    if c.recompute == "full":
        bwd += fwd
    return CpTimes(fwd, bwd, one)
