"""Memory per pipeline stage (its most loaded device): model states, activations, the rest.

Model states follow ZeRO (``memory.state_bytes_per_param``; Rajbhandari et al., arXiv
1910.02054). Activations and gradients peak together over the schedule's order
(``cost.pipeline_memory.peak_memory``): gradients exist from each chunk's first backward (they are set to None
after each step; a framework's buffer allocated up front, Megatron-Core's, holds them all the
time), the loss gradient and ZeRO-2/3's bucket in flight sit on top during a backward.
The rest: the framework's overhead, ZeRO-3's gathered layers, the pipeline runtime's receive
buffers and DDP's bucket copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autoconf.cost import schedule_time
from autoconf.cost.activations import block_backward_temporary_bytes, embedding_activation_bytes, head_activation_bytes
from autoconf.cost.compression import memory_parts
from autoconf.cost.context_parallel import kv_chunk_bytes
from autoconf.cost.data_parallel import gather_bytes
from autoconf.cost.layout import Layout, chunk_params, fp8_linear_params
from autoconf.cost.memory import BUCKET_BYTES, optimizer_temporary_bytes, state_bytes_per_param, zero3_working_bytes
from autoconf.cost.moe import moe_activation_bytes, paired_fraction
from autoconf.cost.pipeline_memory import peak_memory
from autoconf.cost.system import System
from autoconf.space.config import ParallelConfig, expert_dp, module_key
from autoconf.space.schedules import fsdp_unsharded_peak
from autoconf.specs.devices import device_type


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one pipeline stage's most loaded device."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    other: float
    capacity: float
    """The smallest usable device memory of the stage (memory less the fragmentation margin)."""
    other_parts: tuple = ()
    """(name, bytes) of what ``other`` holds, for the explanation."""

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.other

    def to_dict(self) -> dict:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "other": self.other, "total": self.total,
                "capacity": self.capacity, "other_parts": dict(self.other_parts)}


def stage_memory(system: System, c: ParallelConfig, lay: Layout) -> list[StageMemory]:
    """Memory of every pipeline stage for configuration ``c``."""
    m = system.model
    master = system.framework.master_weights
    zero = system.policy.state_zero_stage(c)  # DeepSpeed's BF16 optimizer: ZeRO-1's layout without ZeRO
    st = state_bytes_per_param(m.dtype, zero, c.dp * c.cp,
                               fp32_grads=system.policy.grad_bytes == 4 and m.dtype != "fp32", master_copy=master)
    act_layer = system.layer_activations(c, mask_bytes(system, lay))
    layered_pp1 = c.pp == 1 and c.layered_grad_accum
    # a gradient buffer allocated up front (Megatron-Core) is there at every moment: the peak is
    # the activations' own, with every gradient beside it
    up_front = system.framework.grad_buffer_up_front
    if layered_pp1:
        peaks = _layered_peak(system, c, lay, act_layer, 0.0 if up_front else st.gradients)
    else:
        peaks = activation_peaks(system, c, lay, act_layer["total"], 0.0 if up_front else st.gradients)
    # a mixture of experts' routed experts: sharded by ZeRO over the ranks holding the same experts
    st_e = state_bytes_per_param(m.dtype, zero, max(1, expert_dp(c)),
                                 fp32_grads=system.policy.grad_bytes == 4 and m.dtype != "fp32", master_copy=master)
    # one block's recomputed tensors, alive during its backward (layered: inside _layered_peak):
    # (a dense block's, an MoE block's), each stage taking those of the blocks it holds
    working = None
    if not layered_pp1 and c.recompute == "full":
        working = (act_layer.get("recompute_working_bytes", 0.0), _moe_working(system, c, lay))
    elif not layered_pp1 and module_key(c):
        working = _module_working(system, c, lay)
    out = []
    for s in range(c.pp):
        params = sum(lay.chunk_params[ci] for ci in lay.chunks_of(c, s))
        experts = sum(lay.chunk_expert_params[ci] for ci in lay.chunks_of(c, s)) if lay.chunk_expert_params else 0.0
        dense = params - experts
        acts, grads = peaks[s]
        if up_front:
            grads = dense * st.gradients + experts * st_e.gradients
        elif experts:  # the peak's gradients were counted at the dense sharding: the experts' differ
            grads += experts * (st_e.gradients - st.gradients)
        if working is not None:
            dense_here, moe_here = _block_kinds(c, lay, s)
            acts += max(working[0] if dense_here else 0.0, working[1] if moe_here else 0.0)
        optimizer = dense * st.optimizer + experts * st_e.optimizer
        # the step holds every gradient; the activation peak may come before the last ones exist
        # (layered accumulation, interleaved schedules)
        shortfall = max(0.0, dense * st.gradients + experts * st_e.gradients - grads)
        if system.policy.bf16_optimizer(c):  # DeepSpeed's BF16 optimizer: a second copy of every gradient
            grads += m.dtype_bytes * params
        other = _other_bytes(system, c, lay, s, acts, optimizer, shortfall)
        parameters = dense * st.parameters + experts * st_e.parameters
        if c.precision == "fp8" and system.framework.fp8_param_gather and c.zero_stage < 3:
            # FP8 parameters (``Framework.fp8_param_gather``): the linear weights at 1 byte
            parameters -= (m.dtype_bytes - 1) * sum(fp8_linear_params(system, c, lay, ci) for ci in lay.chunks_of(c, s))
        out.append(StageMemory(parameters=parameters, gradients=grads,
                               optimizer=optimizer, activations=acts,
                               other=sum(v for _, v in other), other_parts=other,
                               capacity=_capacity(system, lay.stage_devices[s])))
    return out


def _capacity(system: System, devices) -> float:
    """The smallest usable memory of a stage's devices (``System.capacity_bytes``, a function of
    the device's memory and kind): one device of each (memory, kind), not every device."""
    topo = system.topology
    alike = {(topo.memory_of[d], topo.kind_of[d]): d for d in devices}
    return min(system.capacity_bytes(d) for d in alike.values())


def _moe_working(system: System, c: ParallelConfig, lay: Layout) -> float:
    """Under full recomputation, what one recomputed MoE block materialises (0 for dense models)."""
    if not lay.chunk_moe_layers or not any(lay.chunk_moe_layers):
        return 0.0
    return moe_activation_bytes(system, dataclasses.replace(c, recompute="none"), mask_bytes(system, lay))["total"]


def _block_kinds(c: ParallelConfig, lay: Layout, s: int) -> tuple[bool, bool]:
    """(whether stage ``s`` holds a dense block, whether it holds a mixture-of-experts block)."""
    chunks = lay.chunks_of(c, s)
    moe = sum(lay.chunk_moe_layers[ci] for ci in chunks) if lay.chunk_moe_layers else 0
    return sum(lay.chunk_layers[ci] for ci in chunks) > moe, moe > 0


_ATTENTION_SIDE = ("qkv", "mla_latents", "qkv_input")
_MLP_SIDE = ("mlp_input", "mlp_hidden")


def _module_working(system: System, c: ParallelConfig, lay: Layout) -> tuple:
    """(dense block, MoE block): what Megatron-LM's recompute modules rebuild during one block's
    backward, beyond the attention core (whose recomputation is not counted for selective
    recomputation without modules either). Its output-discarding checkpoint copies the rebuilt
    outputs back into their storage and keeps the recomputed tensors too until its own backward
    (``CheckpointWithoutOutput._recompute``): twice the freed outputs, of the attention side (the
    input norm, the up-projections) or of the MLP side (the norm before the experts, their
    activation), whichever is larger, since their hooks fire in different parts of the backward.
    The rebuilt outputs are the 16-bit originals, also under FP8 (the linears reading them keep
    the original, ``set_save_original_input``)."""
    mask = mask_bytes(system, lay)
    core = dataclasses.replace(c, recompute_modules=(), precision="bf16")
    mods = dataclasses.replace(c, precision="bf16")

    def side(before: dict, after: dict) -> float:
        freed = [sum(before.get(k, 0.0) - after.get(k, 0.0) for k in keys) for keys in (_ATTENTION_SIDE, _MLP_SIDE)]
        return 2 * max(freed)

    out_dense = side(system.layer_activations(core, mask), system.layer_activations(mods, mask))
    out_moe = 0.0
    if lay.chunk_moe_layers and any(lay.chunk_moe_layers):
        out_moe = side(moe_activation_bytes(system, core, mask), moe_activation_bytes(system, mods, mask))
    return out_dense, out_moe


def _pairs(system: System, c: ParallelConfig) -> bool:
    """Whether Megatron-Core's combined 1F1B pairs any passes (``moe.paired_fraction``)."""
    return any(paired_fraction(system, c, r) > 0 for r in range(c.pp))


def _paired_extra_bytes(system: System, c: ParallelConfig, lay: Layout, s: int) -> float:
    """What Megatron-Core's combined 1F1B (``ep_comm_overlap``) holds above the plain schedule on
    stage ``s``: with pipelining, the extra warm-up forward it runs first (one more micro-batch of
    the stage's largest chunk in flight); without, the forward of one MoE block running beside the
    backward that has not yet freed its own (forward and backward walk the layers in opposite
    directions, so the two micro-batches together hold one block more than one does)."""
    mask = mask_bytes(system, lay)
    if c.pp > 1:
        per_chunk = _chunk_activation_bytes(system, c, lay, system.layer_activations(c, mask)["total"])
        return max(per_chunk[ci] for ci in lay.chunks_of(c, s))
    return moe_activation_bytes(system, c, mask)["total"]


def mask_bytes(system: System, lay: Layout) -> int:
    """Dropout mask bytes per element: the widest among the devices of the layout."""
    kinds = sorted({k for ks in lay.stage_kinds for k in ks})
    return max(system.policy.mask_bytes(k) for k in kinds)


def _chunk_activation_bytes(system: System, c: ParallelConfig, lay: Layout, layer_bytes: float) -> list[float]:
    """Activations each chunk saves per micro-batch: its blocks (``System.layer_activations``),
    plus the embedding's on the first chunk and the output layer's on the last (``activations``)."""
    m, mask, n_chunks = system.policy.model_at(c.tp, c.cp), mask_bytes(system, lay), lay.num_chunks
    moe_bytes = 0.0
    if lay.chunk_moe_layers and any(lay.chunk_moe_layers):
        moe_bytes = moe_activation_bytes(system, c, mask)["total"]
    per_chunk = []
    for ci in range(n_chunks):
        n_moe = lay.chunk_moe_layers[ci] if lay.chunk_moe_layers else 0
        per_mb = (lay.chunk_layers[ci] - n_moe) * layer_bytes + n_moe * moe_bytes
        if ci == 0:
            per_mb += embedding_activation_bytes(m, c.micro_batch_size, c.tp, c.sequence_parallel, mask)
        if ci == n_chunks - 1:
            per_mb += head_activation_bytes(m, c.micro_batch_size, c.tp, c.sequence_parallel, mask)
        per_chunk.append(per_mb)
    return per_chunk


def activation_peaks(system: System, c: ParallelConfig, lay: Layout, layer_bytes: float, grad_bytes: float):
    """(activations, gradients) at each stage's peak over the schedule's order.

    Liveness is structural (independent of durations): the steady-state size is simulated and
    scaled for the schedules that keep every micro-batch alive (gpipe, breadth-first, layered).
    The last chunk's backward starts from the loss gradient of one micro-batch's logits
    (``loss_grad_bytes``: fp32 and its 16-bit cast, vocabulary-parallel), alive next to its saved
    activations. ZeRO-2/3 reduce (and drop) each
    layer's full gradient during the backward of every micro-batch: one layer's worth is in
    flight next to the activations. Gradients coexist with the activations only from each chunk's
    first backward on (so GPipe / layered peak with almost none).
    """
    m, n_chunks, sched = system.policy.model_at(c.tp), lay.num_chunks, lay.schedule
    m_sim = schedule_time.sim_size(sched, c.pp, c.num_micro_batches)
    grows = sched in ("gpipe", "breadth_first")
    ce_grad = loss_grad_bytes(system, c)
    in_flight = 0.0
    if c.dp * c.cp > 1 and c.zero_stage >= 2 and not c.layered_grad_accum:
        in_flight = min(BUCKET_BYTES, m.layer_params() / c.tp * system.policy.grad_bytes)
    return peak_memory(sched, c.pp, m_sim, lay.virtual_stages,
                       tuple(_chunk_activation_bytes(system, c, lay, layer_bytes)),
                       tuple(p * grad_bytes for p in lay.chunk_params),
                       c.num_micro_batches / m_sim if grows else 1.0,
                       tuple(in_flight + (ce_grad if ci == n_chunks - 1 else 0.0) for ci in range(n_chunks)))


def loss_grad_bytes(system: System, c: ParallelConfig) -> float:
    """What the loss's backward allocates per logit of one micro-batch (vocabulary-parallel, padded
    vocabulary) at its peak, next to the saved fp32 softmax (``Framework.loss_backward_fp32_tensors``):

    - 0 (Megatron-LM's cross entropy writes the gradient into the saved softmax in place): the
      gradient cast back to the logits' 16-bit dtype (autograd's cast of ``logits.float()``);
    - 1 (the reference trainer computes it in a copy of the softmax): that copy and its 16-bit cast
      (``g.to(logits_dtype)``); an H100 run of GPT-3 1.3B peaked one 16-bit logits tensor per
      sequence above the fp32 copy alone;
    - 2 (torch's ``F.cross_entropy``): the nll loss's fp32 gradient and the log-softmax's, both
      alive while the saved softmax is; the cast that follows holds one fp32 and one 16-bit tensor
      after the saved softmax is freed, less than that."""
    m = system.policy.model_at(c.tp, c.cp)
    n = system.framework.loss_backward_fp32_tensors
    cast = m.dtype_bytes if m.dtype != "fp32" else 0.0
    per_logit = 8.0 if n >= 2 else 4.0 * n + cast
    return c.micro_batch_size * m.seq_length * (-(-m.vocab_size // c.tp)) * per_logit


def _layered_units(system: System, c: ParallelConfig, lay: Layout, act_layer: dict, grad_bytes: float):
    """Per unit of layered accumulation (pp = 1): (saved activations per micro-batch, gradient
    bytes, backward transient, input gradient per micro-batch), units in model order.

    The units are the ones the order runs over (arXiv 2106.02679, sec. 3; autoconf.trainer.
    accumulation.layered_step): the embedding, each block, the head. The head is its own unit:
    its activations (the fp32 softmax over the vocabulary, for every micro-batch) are gone once
    its backward is through, before any block is recomputed. A block's backward transient is the
    activations its recompute materialises again for one micro-batch (``recompute_working_bytes``,
    one block at a time) plus the gradients its backward holds between nodes
    (``activations.block_backward_temporary_bytes``); the head's is the loss gradient of one
    micro-batch's logits (``loss_grad_bytes``).
    Block and head inputs have a gradient (``schedule_time.boundary_bytes``), the token ids do not.
    """
    m, mask = system.policy.model_at(c.tp), mask_bytes(system, lay)
    local = system.policy.model_at(c.tp, c.cp)  # the rank's s/cp tokens
    b, t, sp = c.micro_batch_size, c.tp, c.sequence_parallel
    ce_grad = loss_grad_bytes(system, c)
    dx = schedule_time.boundary_bytes(system, c)
    units = [(embedding_activation_bytes(local, b, t, sp, mask), m.embedding_params() / t * grad_bytes, 0.0, 0.0)]
    block_transient = act_layer.get("recompute_working_bytes", 0.0) + block_backward_temporary_bytes(local, b, t)
    if m.is_moe:  # its MoE blocks: their own activations, working set and E/ep experts' gradients
        moe_act = moe_activation_bytes(system, c, mask)
        moe_transient = (max(act_layer.get("recompute_working_bytes", 0.0), _moe_working(system, c, lay))
                         if c.recompute == "full" else moe_act.get("recompute_working_bytes", 0.0))
        moe_transient += block_backward_temporary_bytes(local, b, t)
        blocks = block_params(system, c)
        units += [(moe_act["total"], p * grad_bytes, moe_transient, dx) if m.is_moe_layer(i)
                  else (act_layer["total"], p * grad_bytes, block_transient, dx) for i, p in enumerate(blocks)]
    else:
        units += [(act_layer["total"], m.layer_params() / t * grad_bytes, block_transient, dx)
                  for _ in range(m.num_layers)]
    units.append((head_activation_bytes(local, b, t, sp, mask), m.output_params() / t * grad_bytes, ce_grad, dx))
    return _with_reduction_in_flight(system, c, units)


def block_params(system: System, c: ParallelConfig) -> list:
    """Each block's parameters on a rank (its tp shard; a mixture of experts' E/ep routed experts
    per MoE block), as ``layout.chunk_params`` counts them one block per chunk."""
    m = system.policy.model_at(c.tp)
    per = chunk_params(system, c, [1] * m.num_layers)
    per[0] -= m.embedding_params() / c.tp
    per[-1] -= m.output_params() / c.tp
    return per


def _with_reduction_in_flight(system: System, c: ParallelConfig, units: list) -> list:
    """Layered accumulation reduces a unit's gradients as soon as they are final (after its last
    micro-batch), overlapping the backward of the unit below: the gradient reduction's copy of
    unit k+1 (the whole unit, flattened by the reference trainer's GradSync) is in flight during
    unit k's backward, next to its activations -- not after them, as with standard
    accumulation (``_other_bytes``). ZeRO-3 (FSDP) reduce-scatters into its own shards."""
    if c.dp * c.cp == 1 or c.zero_stage == 3:
        return units
    m = system.policy.model_at(c.tp)
    blocks = block_params(system, c) if m.is_moe else [m.layer_params() / c.tp] * m.num_layers
    copy = [p * system.policy.grad_bytes for p in [m.embedding_params() / c.tp] + blocks + [m.output_params() / c.tp]]
    return [(a, g, bt + (copy[i + 1] if i + 1 < len(units) else 0.0), ig)
            for i, (a, g, bt, ig) in enumerate(units)]


def _layered_peak(system: System, c: ParallelConfig, lay: Layout, act_layer: dict, grad_bytes: float):
    """(activations, gradients) at the peak of layered accumulation with pp = 1.

    ``cost.pipeline_memory.peak_memory`` over the units of ``_layered_units`` in breadth-first order (every
    micro-batch through a unit, unit by unit): all micro-batches' saved activations at the end of
    the forwards; during the backward of a block, the checkpoints of the blocks below for every
    micro-batch, the recompute working set of one micro-batch, every micro-batch's gradient at the
    unit boundary (``cost.pipeline_memory._held_input_grad``) and the parameter gradients of the units done.
    """
    units = _layered_units(system, c, lay, act_layer, grad_bytes)
    m_sim = schedule_time.sim_size("breadth_first", 1, c.num_micro_batches)
    acts, grads, transient, input_grads = zip(*units)
    return peak_memory("breadth_first", 1, m_sim, len(units), acts, grads, c.num_micro_batches / m_sim,
                       transient, input_grads)


def _other_bytes(system: System, c: ParallelConfig, lay: Layout, s: int, acts: float,
                 optimizer: float = 0.0, grad_shortfall: float = 0.0) -> tuple:
    """Everything but model states and activations on stage ``s``.

    The framework's own overhead (catalog), ZeRO-3's gathered layers (``memory.zero3_working_bytes``),
    torch.distributed.pipelining's receive buffers (frameworks built on it: the reference trainer,
    torchtitan; Megatron and DeepSpeed receive into per-transfer tensors of the micro-batches in
    flight, which their activations already count): its PipelineStage allocates, for every
    micro-batch, a buffer for the activation it receives (all chunks but the first) and one for
    the gradient it receives (all but the last), up front (stage._setup_forward_recv_info /
    _setup_backward_recv_info): a replica's whole batch of boundary activations, twice (the
    trainer passes return_outputs=False, so the last stage's outputs are not kept). And the
    gradient reduction's copy of one bucket (at most 25 MiB, as DDP) after the backward has freed
    the activations: it raises the peak only where it exceeds them. Likewise the optimizer step's
    temporaries (``memory.optimizer_temporary_bytes`` of the stage's ``optimizer`` state; a
    framework stepping with torch's foreach AdamW, on a GPU: on CPU torch steps one parameter at a
    time), after the bucket's: the step's peak is the larger of the two. The step holds every
    gradient, ``grad_shortfall`` more than the activation peak did.
    """
    m, chunks = system.model, lay.chunks_of(c, s)
    parts = [("runtime context", max(device_type(k).framework_overhead_bytes for k in lay.stage_kinds[s]))]
    if system.policy.fsdp_step_gather(c.zero_stage, c.pp, c.dp * c.cp):  # gathered once per step: the
        # stage's parameters (ZeRO-3; ZeRO-2's are never resharded) and their gradients stay unsharded through it, the
        # gradients accumulated at the reduce dtype (FSDP2's ``unsharded_accumulated_grad``,
        # torch 2.13 ``_fsdp_param.py`` ``to_accumulated_grad_if_needed``)
        params = sum(lay.chunk_params[ci] for ci in chunks)
        if c.zero_stage == 3:
            parts.append(("fsdp unsharded parameters", params * m.dtype_bytes))
        parts.append(("fsdp unsharded gradients", params * system.policy.reduce_bytes(c)))
    elif system.policy.fsdp_per_pass(c.zero_stage, c.pp, c.dp * c.cp):  # FSDP2 under torch.distributed.pipelining: a chunk's units
        # stay gathered after every backward but its last, its gradients unsharded until then
        # (space.schedules.fsdp_gathers; torch 2.13 pipelining/stage.py, backward_one_chunk)
        pb = {ci: lay.chunk_params[ci] * gather_bytes(system, c) for ci in chunks}
        gb = {ci: lay.chunk_params[ci] * system.policy.reduce_bytes(c) for ci in chunks}
        parts.append(("fsdp unsharded chunks", fsdp_unsharded_peak(c.schedule, c.pp, c.num_micro_batches,
                                                                   c.virtual_stages, lay.layered, s, pb, gb)))
    elif c.zero_stage == 3 and c.dp * c.cp > 1:
        gathered = zero3_working_bytes(m, c.tp)
        if m.is_moe:  # an MoE block gathers its E/ep experts too: the largest block, twice
            gathered = max(gathered, 2 * max(block_params(system, c)) * m.dtype_bytes)
        parts.append(("zero-3 gathered layers", gathered))
    fw = system.framework
    if c.precision == "fp8" and fw.fp8_weight_copy_bytes:
        linear = sum(fp8_linear_params(system, c, lay, ci) for ci in chunks)
        # with FP8 parameters the parameter is the FP8 weight: only its transpose is a copy
        copies = fw.fp8_weight_copy_bytes - (1.0 if fw.fp8_param_gather else 0.0)
        parts.append(("fp8 weight copies", linear * copies))
    if c.cp > 1:
        kv = kv_chunk_bytes(system, c)
        # ring: the chunk in hand and the one arriving, keys/values and (backward) their
        # gradients; all-gather: every rank's keys and values, and their gradients
        parts.append(("context-parallel exchange", (4 * kv) if fw.cp_comm != "all_gather" else 2 * c.cp * kv))
    if c.pp > 1 and system.framework.per_micro_batch_pipeline_buffers:
        act = schedule_time.boundary_bytes(system, c)  # an activation and its gradient have one shape
        buffers = sum((ci > 0) + (ci < lay.num_chunks - 1) for ci in chunks)
        parts.append(("pipeline receive buffers", buffers * c.num_micro_batches * act))
    if _pairs(system, c):  # (none without ep > 1 and the framework's ep_comm_overlap)
        parts.append(("ep-overlap paired micro-batch", _paired_extra_bytes(system, c, lay, s)))
    if c.compressed:
        parts += memory_parts(system, c, lay, s)
    layered_pp1 = c.pp == 1 and c.layered_grad_accum  # its units carry their copies already
    after_backward = 0.0  # what the bucket copy already adds above the activations
    if c.dp * c.cp > 1 and c.zero_stage < 3 and not layered_pp1:
        bucket = min(BUCKET_BYTES, max(lay.chunk_params[ci] for ci in chunks) * system.policy.grad_bytes)
        after_backward = max(0.0, bucket - acts)
        parts.append(("gradient bucket copy", after_backward))
    if fw.optimizer_foreach and any(k != "cpu" for k in lay.stage_kinds[s]):
        temp = optimizer_temporary_bytes(optimizer, m.dtype, fw.master_weights)
        parts.append(("optimizer step temporaries", max(0.0, temp + grad_shortfall - acts - after_backward)))
    return tuple((k, v) for k, v in parts if v > 0)
