"""Groups and links of a layout, and the tensor-parallel collectives per layer.

Megatron-LM's tensor parallelism (Shoeybi et al., arXiv 1909.08053) all-reduces the block's
activation twice in the forward (after attention and after the MLP) and twice in the backward;
with sequence parallelism (Korthikanti et al., arXiv 2205.05198) each all-reduce becomes an
all-gather plus a reduce-scatter of the same bytes (Megatron-LM's backward re-gathers the saved
input shards too: ``overlapped``). The collectives run on the links the tp groups really span
(``comm``), every group at once: the slowest group sets the time. What a framework hides under
its GEMMs is taken off (``overlapped``).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoconf.cost import comm
from autoconf.cost.compute import linear_gemms
from autoconf.cost.fp8 import fp8_gemm
from autoconf.cost.groups import axis_links, collective_s
from autoconf.cost.system import System
from autoconf.space.config import ParallelConfig


@dataclass(frozen=True)
class TpTimes:
    """Exposed tensor-parallel communication per micro-batch."""

    forward_per_layer_s: float = 0.0
    backward_per_layer_s: float = 0.0
    """Including the forward's collectives again under full recomputation."""
    edge_s: float = 0.0
    """One collective of the embedding forward / the output layer's backward."""


def tp_times(system: System, c: ParallelConfig, stage_kinds) -> TpTimes:
    """Megatron's 2 collectives per block in the forward and 2 in the backward (all-reduce, or
    all-gather + reduce-scatter with sequence parallelism) of one micro-batch's activation, less
    what the framework hides under the GEMMs on accelerators (``overlapped``); the profile's
    in-place measurement replaces them when it has one (``System.measured_tp_comm``)."""
    if c.tp == 1:
        return TpTimes()
    m, tp = system.model, c.tp
    nbytes = c.micro_batch_size * (m.seq_length // c.cp) * m.hidden_size * m.dtype_bytes
    links = axis_links(system, c, "tp")
    ag = rs = ar = 0.0
    if c.sequence_parallel:
        ag = collective_s(system, links, comm.all_gather_s, tp, nbytes)
        rs = collective_s(system, links, comm.reduce_scatter_s, tp, nbytes)
        one = ag + rs
    else:
        flat = system.framework.flat_all_reduce_algorithms(system.gloo)  # tp's all-reduce is always the library's
        ar = one = collective_s(system, links, comm.all_reduce_s, tp, nbytes, lambda g: flat)
    fwd = bwd = 2 * one
    measured = system.measured_tp_comm(c, stage_kinds)
    fw = system.framework
    hides = (not any("cpu" in k for ks in stage_kinds for k in ks)
             and (fw.tp_backward_overlap or fw.knob(c, "tp_comm_overlap")))
    if measured is not None:  # the profile timed the block with its real collectives, in turn
        raw = fwd
        fwd, bwd = measured
        one = fwd / 2
        if hides and raw > 0:  # what the framework hides, as a share of the datasheet's collectives
            hf, hb = overlapped(system, c, stage_kinds, ag, rs, ar)
            fwd, bwd = fwd * hf / raw, bwd * hb / raw
    elif hides:
        fwd, bwd = overlapped(system, c, stage_kinds, ag, rs, ar)
    bwd += fwd if c.recompute == "full" else 0.0
    return TpTimes(fwd, bwd, one)


def pipelined(comm_s: float, chunked_gemm_s: float, k: int) -> float:
    """A collective split into k chunks pipelined with the GEMM it feeds or drains, the GEMM
    split the same way (Transformer Engine's ring-exchange all-gather and pipelined
    reduce-scatter, torch's micro-pipelined async TP): k - 1 steps of the longer of a GEMM chunk
    and a transfer, and one GEMM chunk with nothing beside it."""
    return (k - 1) * max(chunked_gemm_s / k, comm_s / (k - 1)) + chunked_gemm_s / k


def overlapped(system: System, c: ParallelConfig, stage_kinds, ag: float, rs: float, ar: float) -> tuple:
    """Exposed tensor-parallel time per block (forward, backward without recomputation) where the
    framework hides collectives under GEMMs; ``ag`` / ``rs`` (sequence parallelism) or ``ar``:
    one collective of the block's activation. Each collective hides only under the GEMM it is
    issued beside, priced by the roofline (``compute.linear_gemms``); what is left is exposed,
    never less than nothing.

    - ``Framework.tp_backward_overlap`` (Megatron-LM's ``LinearWithGradAccumulationAndAsync
      Communication``, in Megatron-DeepSpeed too, not in DeepSpeed's AutoTP): a column-parallel
      layer's backward (QKV, fc1) launches its collectives asynchronously under
      ``CUDA_DEVICE_MAX_CONNECTIONS=1``: with sequence parallelism the re-gather of its saved
      input shard runs under the input-gradient GEMM and the reduce-scatter of the input gradient
      under the weight-gradient GEMM; without, the all-reduce of the input gradient under the
      weight-gradient GEMM. The row-parallel layer's backward gathers its output gradient
      (sequence parallelism) before it can start: exposed. So the backward moves 3 collectives per
      sub-block under sequence parallelism (one more all-gather than the forward), 1 without, and
      most of it hides.
    - ``tp_comm_overlap`` (Transformer Engine's userbuffers in Megatron-LM, torch's async TP):
      the forward's all-gather and reduce-scatter are split into tp chunks pipelined with the
      GEMM they feed / drain (``pipelined``; the chunked GEMMs at their own efficiency, M / tp
      rows each); in the backward the row-parallel layer's gather pipelines with its
      input-gradient GEMM too (and, without the asynchronous column backward, the column layer's
      reduce-scatter with its input-gradient GEMM).

    Priced on every device kind of the stages, the largest exposure kept (the least that hides).
    A mixture of experts' MLP collectives are left exposed (its dispatcher's, not priced as
    overlapped here)."""
    kinds = sorted({k for ks in stage_kinds for k in ks})
    return max((_overlapped_on(system, c, kind, ag, rs, ar) for kind in kinds), key=lambda t: t[0] + t[1])


def _overlapped_on(system: System, c: ParallelConfig, kind: str, ag: float, rs: float, ar: float) -> tuple:
    """``overlapped`` with every GEMM on devices of ``kind``."""
    m, tp, b = system.model, c.tp, c.micro_batch_size
    fw = system.framework
    tpo = fw.knob(c, "tp_comm_overlap") and c.sequence_parallel
    if c.precision == "fp8":
        rf8 = system.fp8_roofline(kind, c.fp8_recipe)
        g = lambda mm, n, k: fp8_gemm(rf8, mm, n, k)  # noqa: E731
    else:
        rf = system.roofline(kind)
        g = lambda mm, n, k: rf.gemm(mm, n, k, m.dtype_bytes)  # noqa: E731

    def gemm_s(shapes, which: str, chunks: int = 1) -> float:
        if which == "fwd":
            return sum(chunks * g(mm / chunks, n, k) for mm, n, k in shapes)
        if which == "dgrad":
            return sum(chunks * g(mm / chunks, k, n) for mm, n, k in shapes)
        return sum(g(n, k, mm) for mm, n, k in shapes)  # wgrad: (n x k) from the tokens

    def piped(comm_s: float, shapes, which: str) -> float:
        """What a collective pipelined with its GEMM adds to the GEMM alone (a measured GEMM table
        can rate the chunks faster than the whole: then the pipeline costs at least nothing)."""
        return max(0.0, pipelined(comm_s, gemm_s(shapes, which, tp), tp) - gemm_s(shapes, which))

    lin = linear_gemms(m, b, tp, c.cp)
    subs = [("attention_in", "attention_out")] + ([] if m.is_moe else [("mlp_in", "mlp_out")])
    exposed_subs = 2 - len(subs)  # MoE: the MLP's collectives as they are
    fwd = bwd = exposed_subs * (ag + rs + ar)
    for col, row in subs:
        fwd += (piped(ag, lin[col], "fwd") + piped(rs, lin[row], "fwd")) if tpo else ag + rs + ar
        if fw.tp_backward_overlap:
            if c.sequence_parallel:
                gather = piped(ag, lin[row], "dgrad") if tpo else ag
                bwd += (gather + max(0.0, ag - gemm_s(lin[col], "dgrad"))
                        + max(0.0, rs - gemm_s(lin[col], "wgrad")))
            else:
                bwd += max(0.0, ar - gemm_s(lin[col], "wgrad"))
        elif tpo:  # the pair of the backward, pipelined with the input-gradient GEMMs they touch
            bwd += piped(ag, lin[row], "dgrad") + piped(rs, lin[col], "dgrad")
        else:
            bwd += ag + rs + ar
    return fwd, bwd
