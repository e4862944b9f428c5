"""Data-parallel communication: gradient reductions, ZeRO's extra traffic, bucket copies.

- Gradient reduction (all-reduce for ZeRO-0, reduce-scatter for ZeRO-1/2/3; ZeRO paper,
  Rajbhandari et al., arXiv 1910.02054) is queued per device as each chunk's gradients become
  final, in 25 MiB buckets as PyTorch DDP (Li et al., VLDB 2020), overlapped with the rest of the
  backward where a copy engine / NIC does the work (:func:`reduction_tail_s`).
- ZeRO-1/2 (and DeepSpeed's BF16 optimizer) gather the updated parameter shards after the
  optimizer step (:func:`post_all_gather_s`).
- ZeRO-2/3 reduce-scatter every micro-batch's gradients, ZeRO-3 gathers parameters before each
  pass over a chunk (FSDP's prefetching hides all but the first layer's gather):
  :func:`per_micro_batch_s`.
- Every bucket is copied through memory (:func:`bucket_traffic`).
- An all-reduce is credited only with the algorithms the framework's runtime runs
  (:func:`all_reduce_algorithms`).
"""

from __future__ import annotations

import math

from autoconf.cost import comm
from autoconf.cost.groups import (
    all_reduce_algorithms,
    axis_links,
    collective_s,
    grad_group,
    reduction_collective,
    tied_params,
)
from autoconf.cost.layout import Layout, fp8_linear_params
from autoconf.cost.memory import BUCKET_BYTES
from autoconf.cost.powersgd import dp_compressed, exact_dp_links, powersgd_reduction_s
from autoconf.cost.system import System
from autoconf.space.config import ParallelConfig, expert_dp
from autoconf.space.schedules import fsdp_gathers


def bucket_traffic(c: ParallelConfig) -> float:
    """Memory traffic of one gradient-bucket reduction, in multiples of the bucket's bytes.

    ZeRO-0/1 (as DDP without gradient views): copy the gradients into the flat bucket (read +
    write), average in place, copy back: 6. ZeRO-2: copy in, then the owner adds its 1/dp share
    into its accumulator: 2 + 3/dp. ZeRO-3 (FSDP2): reduce-scatter copy-in, then the shard is
    averaged: 2 + 2/dp.
    """
    if c.zero_stage <= 1:
        return 6.0
    return 2.0 + (3.0 if c.zero_stage == 2 else 2.0) / grad_group(c)[0]



def dp_reduction_s(system: System, c: ParallelConfig, lay: Layout, fn, ci: int, kinds, dev: int = 0) -> float:
    """One chunk's gradient reduction with ``fn`` plus its buckets' memory traffic (PowerSGD's
    three all-reduces per bucket where pipeline rank ``dev`` compresses its gradients), at the
    framework's reduce dtype (``Policy.reduce_bytes``)."""
    g_bytes = system.policy.reduce_bytes(c)
    n, axis = grad_group(c)
    if dp_compressed(c, dev):
        return (powersgd_reduction_s(system, c, lay, ci, kinds, axis_links(system, c, axis), n)
                + system.copy_time(kinds, bucket_traffic(c) * (lay.chunk_params[ci] - tied_params(system, c, ci))
                                   * g_bytes))
    experts = lay.chunk_expert_params[ci] if lay.chunk_expert_params else 0.0
    dense = lay.chunk_params[ci] - experts - tied_params(system, c, ci)
    links = exact_dp_links(system, c, axis) if c.dp_compression_stages else axis_links(system, c, axis)
    t = (collective_s(system, links, fn, n, dense * g_bytes,
                      all_reduce_algorithms(system, c, fn))
         + system.copy_time(kinds, bucket_traffic(c) * lay.chunk_params[ci] * g_bytes))
    edp = expert_dp(c)
    if experts and edp > 1:  # the routed experts: over the ranks holding the same experts
        t += collective_s(system, axis_links(system, c, "edp"), fn, edp, experts * g_bytes,
                          all_reduce_algorithms(system, c, fn))
    return t


def gather_bytes(system: System, c: ParallelConfig) -> float:
    """Bytes per parameter ZeRO-3 gathers: the model's dtype, or FP8 (1 byte) where the framework
    gathers FP8 weights (``Framework.fp8_all_gather``; tensorwise scaling, the linear layers
    being almost all of a block's parameters)."""
    fw = system.framework
    if c.precision == "fp8" and fw.fp8_all_gather and c.fp8_recipe == "tensorwise":
        return 1.0
    return float(system.model.dtype_bytes)


def reduce_calls(c: ParallelConfig, grads: float, layers: int) -> int:
    """Reduce-scatter calls over a chunk's ``grads`` bytes: ZeRO-3 (FSDP2) reduces each unit's
    gradients, one layer, in one call (torch 2.13 ``_fsdp_param_group.post_backward`` ->
    ``_fsdp_collectives.foreach_reduce``: one reduce-scatter of the group's flattened
    gradients); ZeRO-2 in DDP-style buckets of at most 25 MiB."""
    if c.zero_stage == 3:
        return max(1, layers)
    return max(1, math.ceil(grads / BUCKET_BYTES))


def per_micro_batch_s(system: System, c: ParallelConfig, lay: Layout, ci: int, f: float, b: float):
    """(forward, backward) seconds per micro-batch that ZeRO-2/3's data-parallel traffic adds to
    chunk ``ci`` (compute f, b per micro-batch), averaged over the step's micro-batches.

    Layer by layer, as FSDP / DeepSpeed run it (Zhao et al., "PyTorch FSDP", VLDB 2023):

    - ZeRO-3 gathers each layer's parameters once per pass over the chunk: every micro-batch
      (standard accumulation), or once per step (layered: all micro-batches go through a chunk
      together), in the forward and again in the backward. Under pipelining (FSDP2 over
      ``torch.distributed.pipelining``, the reference trainer: ``Policy.fsdp_per_pass``) as often
      as the schedule finds the chunk resharded (``space.schedules.fsdp_gathers``: a forward
      reshards, a backward but the last does not; with layered accumulation the chunk stays
      gathered through its forwards: once per pass), and each chunk reduce-scatters once,
      after its last backward (:func:`reduction_spans`). With prefetching
      (``overlap_param_gather``) the next layer's gather runs during this layer's compute, so a
      layer exposes max(0, gather - compute); the first layer's gather of each pass over the
      device's chunks is exposed. Without it every gather is exposed.
    - ZeRO-2 reduce-scatters the gradients every micro-batch but the last (the step's
      reduction, :func:`reduction_tail_s`, covers that one), in buckets of at most 25 MiB.
      ZeRO-3 (FSDP2, DeepSpeed stage 3) reduce-scatters each layer's gradients in every
      micro-batch's backward, the last one's too, right after the layer's backward: only the
      last layer's waits past the backward (:func:`reduction_spans`). In the backward the
      reduce-scatter and the next layer's gather share the links: a layer exposes
      max(0, gather + its share of the reduce-scatter - compute) when overlapped
      (``overlap_grad_reduce``), all of it otherwise.
    - Under pipelining where the framework gathers once per step (``Policy.fsdp_step_gather``:
      torchtitan over ``torch.distributed.pipelining``), the gather runs in the first
      micro-batch's forward only and the reduce-scatter after the last backward.
    """
    n_mb, nl = c.num_micro_batches, max(lay.chunk_layers[ci], 1)
    n, axis = grad_group(c)
    if n == 1 or c.zero_stage < 2:
        return 0.0, 0.0
    kinds = lay.stage_kinds[ci % c.pp]
    links = axis_links(system, c, axis)
    step_gather = system.policy.fsdp_step_gather(c.zero_stage, c.pp, c.dp * c.cp)
    if step_gather:  # gathered once, in the first forward: kept through every backward
        if c.zero_stage < 3:
            return 0.0, 0.0
        f_l = f / nl
        ag_l = collective_s(system, links, comm.all_gather_s, n, lay.chunk_params[ci] / nl * gather_bytes(system, c))
        first_f = ag_l if ci < c.pp else 0.0
        fwd = first_f + nl * max(0.0, ag_l - f_l) if lay.overlap_param_gather else nl * ag_l
        return fwd / n_mb, 0.0
    per_pass = system.policy.fsdp_per_pass(c.zero_stage, c.pp, c.dp * c.cp)
    if per_pass:  # FSDP2 under torch.distributed.pipelining: as often as the schedule finds it resharded
        passes_f, passes_b = fsdp_gathers(c.schedule, c.pp, n_mb, c.virtual_stages, lay.layered)[ci]
    else:
        passes_f = passes_b = 1 if lay.layered and c.pp == 1 else n_mb
    f_l, b_l = f / nl * n_mb / passes_f, b / nl * n_mb / max(passes_b, 1)  # one layer's compute in one pass
    g_bytes = system.policy.reduce_bytes(c)
    rs_l = 0.0
    if not lay.layered and not per_pass:  # standard accumulation: every micro-batch's gradients (ZeRO-2: but the last)
        grads = lay.chunk_params[ci] * g_bytes
        buckets = reduce_calls(c, grads, nl)
        rs = (buckets * collective_s(system, links, comm.reduce_scatter_s, n, grads / buckets)
              + system.copy_time(kinds, bucket_traffic(c) * grads))
        rs_l = rs / nl * (1.0 if reduces_in_backward(system, c, lay) else (n_mb - 1) / n_mb)
    ag_l = 0.0
    if c.zero_stage == 3:
        ag_l = collective_s(system, links, comm.all_gather_s, n, lay.chunk_params[ci] / nl * gather_bytes(system, c))
    first_f = ag_l if ci < c.pp else 0.0  # the first layer of a device's first pass
    first_b = ag_l if ci >= lay.num_chunks - c.pp else 0.0
    fwd = first_f + nl * max(0.0, ag_l - f_l) if lay.overlap_param_gather else nl * ag_l
    if lay.overlap_param_gather and lay.overlap_grad_reduce:
        bwd = first_b + nl * max(0.0, ag_l + rs_l - b_l)
    elif lay.overlap_param_gather:
        bwd = first_b + nl * (max(0.0, ag_l - b_l) + rs_l)
    elif lay.overlap_grad_reduce:
        bwd = nl * (ag_l + max(0.0, rs_l - b_l))
    else:
        bwd = nl * (ag_l + rs_l)
    return fwd * passes_f / n_mb, bwd * passes_b / n_mb


def reduces_in_backward(system: System, c: ParallelConfig, lay: Layout) -> bool:
    """Whether ZeRO-3 reduce-scatters each layer's gradients inside every micro-batch's backward,
    the last one's too (``per_micro_batch_s`` prices them there; past the chunk's last backward
    only its last layer's is left, :func:`reduction_spans`): standard accumulation, overlapped,
    uncompressed, and not gathered once per step (``Policy.fsdp_step_gather``)."""
    return (c.zero_stage == 3 and not lay.layered and lay.overlap_grad_reduce and not c.dp_compression_stages
            and not system.policy.fsdp_step_gather(c.zero_stage, c.pp, c.dp * c.cp)
            and not system.policy.fsdp_per_pass(c.zero_stage, c.pp, c.dp * c.cp))


def reduction_tail_s(system: System, c: ParallelConfig, lay: Layout, sim, makespan: float, bwd) -> float:
    """Seconds the gradient reductions run past the pipeline's makespan (0 without dp)."""
    ends = [span[1] for spans in reduction_spans(system, c, lay, sim, makespan, bwd) for span in spans]
    return max([makespan, *ends]) - makespan


def reduction_spans(system: System, c: ParallelConfig, lay: Layout, sim, makespan: float, bwd) -> list:
    """Per pipeline device, its chunks' gradient reductions as ``(start, end, chunk)``, in the
    order they run (empty without dp).

    Per device, each chunk's reduction queues once its gradients are final: the last
    micro-batch's backward (standard accumulation; the buckets of all but the last layer go
    during that backward) or progressively (layered / breadth-first). The last bucket (one
    layer, at most 25 MiB) can only go once its gradient exists. Without overlap every
    reduction adds its whole time to the step.
    """
    n, axis = grad_group(c)
    if n == 1:
        return [[] for _ in range(c.pp)]
    m = system.model
    red = reduction_collective(c.zero_stage)
    links = axis_links(system, c, axis)
    layer_grads = m.layer_params() / c.tp * system.policy.reduce_bytes(c)
    last_bucket = layer_grads if c.zero_stage == 3 else min(BUCKET_BYTES, layer_grads)
    ends = sim.last_backward_end_s
    # torch.distributed.pipelining's REDUCE_GRAD: after the stage's last backward
    reduce_once = (system.policy.fsdp_step_gather(c.zero_stage, c.pp, c.dp * c.cp)
                   or system.policy.fsdp_per_pass(c.zero_stage, c.pp, c.dp * c.cp))
    in_backward = reduces_in_backward(system, c, lay)
    out = []
    for dev in range(c.pp):
        t_free = 0.0
        spans = []
        for ci in sorted(lay.chunks_of(c, dev), key=lambda ci: ends[ci]):
            if in_backward:
                start = max(t_free, ends[ci])
                t_free = start + collective_s(system, links, red, n, last_bucket, all_reduce_algorithms(system, c, red))
                spans.append((start, t_free, ci))
                continue
            t = dp_reduction_s(system, c, lay, red, ci, lay.stage_kinds[dev], dev)
            if reduce_once:
                start = max(t_free, ends[ci])
                t_free = start + t
            elif dp_compressed(c, dev):  # one bucket per chunk (the trainer's PowerSGD), once it is final
                start = max(t_free, ends[ci] if lay.overlap_grad_reduce else makespan)
                t_free = start + t
            elif lay.overlap_grad_reduce:
                start = max(t_free, ends[ci] - bwd[ci] * (1 - 1 / max(lay.chunk_layers[ci], 1)))
                t_free = max(start + t, ends[ci] + collective_s(system, links, red, n, last_bucket,
                                                                all_reduce_algorithms(system, c, red)))
            else:
                start = max(t_free, makespan)
                t_free = start + t
            spans.append((start, t_free, ci))
        out.append(spans)
    return out


def post_all_gather_s(system: System, c: ParallelConfig, lay: Layout) -> float:
    """ZeRO-1/2, and DeepSpeed's BF16 optimizer (which shards its fp32 master weights and moments
    as ZeRO-1 does, ``Policy.bf16_optimizer``): the updated parameter shards gathered back after
    the optimizer step (each owner's shard is flattened, sent and copied back into the
    parameters, unless the framework gathers in place: ``Framework.param_gather_in_place``); 0
    otherwise. With ``overlap_param_gather`` (Megatron's distributed optimizer)
    each layer's gather runs under the next step's forward, layer by layer: only the first
    layer's share waits; not where the framework gathers inside the step
    (``Framework.step_gather_overlaps``: DeepSpeed)."""
    n, axis = grad_group(c)
    if n == 1 or system.policy.state_zero_stage(c) not in (1, 2):
        return 0.0
    links = axis_links(system, c, axis)
    post_ag = 0.0
    copies = 0.0 if system.framework.param_gather_in_place else 4 - 2 / n  # Framework.param_gather_in_place
    fp8_params = c.precision == "fp8" and system.framework.fp8_param_gather
    for dev in range(c.pp):
        nbytes = sum(lay.chunk_params[ci] for ci in lay.chunks_of(c, dev)) * system.model.dtype_bytes
        if fp8_params:  # the linear weights gathered as FP8 (``Framework.fp8_param_gather``)
            nbytes -= (system.model.dtype_bytes - 1) * sum(fp8_linear_params(system, c, lay, ci)
                                                           for ci in lay.chunks_of(c, dev))
        post_ag = max(post_ag, collective_s(system, links, comm.all_gather_s, n, nbytes)
                      + system.copy_time(lay.stage_kinds[dev], copies * nbytes))
    if lay.overlap_param_gather and system.framework.step_gather_overlaps:
        return post_ag / max(1, system.model.num_layers // c.pp)
    return post_ag
