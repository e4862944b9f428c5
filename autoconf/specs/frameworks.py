"""The runtime that runs the plan: what each training framework does by default, and which knobs it has.

The same (dp, pp, tp, schedule, ZeRO, recompute) costs different time and memory in different
stacks. What differs, and is modelled here from each framework's own code and documentation:

- **pipeline buffers**: ``torch.distributed.pipelining`` (the reference trainer, torchtitan)
  allocates a receive buffer for every micro-batch's activation and gradient up front
  (``PipelineStage._setup_forward_recv_info`` / ``_setup_backward_recv_info``); Megatron-LM and
  DeepSpeed receive into tensors allocated per transfer, so only the micro-batches in flight hold
  one (already counted as their activations);
- **gradient buffer precision**: Megatron-LM accumulates into an fp32 ``main_grad`` buffer when
  training in bf16 (``accumulate_allreduce_grads_in_fp32`` is forced on for bf16 in its argument
  checks), and in the parameters' precision for fp16;
- **ZeRO**: which stages exist (Megatron's distributed optimizer is ZeRO-1; torchtitan's FSDP2 is
  ZeRO-3, or ZeRO-2-like without resharding after forward; DeepSpeed has 0-3, and 0-1 with its
  pipeline engine);
- **schedules**: what each can run (Megatron: 1F1B and interleaved; DeepSpeed's pipeline engine:
  1F1B; torchtitan: GPipe, 1F1B, Interleaved1F1B, LoopedBFS; the reference trainer: all, plus
  layered gradient accumulation);
- **overlap**: whether the data-parallel reduction overlaps the backward
  (``overlap_grad_reduce``; off by default in Megatron and in DeepSpeed (``overlap_comm``), on
  in DDP / FSDP2), whether ZeRO's parameter gathers are prefetched (``overlap_param_gather``) and whether
  tensor-parallel communication overlaps the GEMMs (``tp_comm_overlap``; Megatron with Transformer
  Engine userbuffers, torchtitan's asynchronous TP), and whether a mixture of experts'
  all-to-alls run under another micro-batch's computation (``ep_comm_overlap``: Megatron-Core's
  ``--overlap-moe-expert-parallel-comm``, off by default, ``cost.moe.paired_layer_s``);
- **tensor-parallel backward**: Megatron-LM launches a column-parallel layer's backward
  collectives asynchronously beside its GEMMs (``tp_backward_overlap``,
  ``tensor_parallel.overlapped``); the others run them in turn, unless ``tp_comm_overlap``
  pipelines them (torchtitan's async TP);
- **gated activation**: Megatron-LM's fused SwiGLU / GeGLU keeps its input only, 3 f-wide
  tensors per token against eager's 4 (``fused_glu``);
- **gradient buffer**: Megatron-Core allocates every gradient in one buffer when it wraps the
  model, so a stage's whole gradient counts at its activation peak (``grad_buffer_up_front``);
  autograd's ``.grad`` (the others) appears at each chunk's first backward;
- **what selective recomputation recomputes**: the attention core everywhere; Megatron-LM also
  takes ``--recompute-modules`` (``recompute_modules``: the norms before a mixture of experts or
  MLA's down-projections, the experts' activation, MLA's up-projections; its output-discarding
  recomputation frees their outputs);
- **expert outputs**: the reference trainer and torchtitan weight the experts' outputs by the
  router's scores in fp32 at the combine and keep that copy; Megatron-Core weights the experts'
  activation instead and keeps none (``moe_output_weighted``);
- **gradient accumulation**: eager autograd adds each micro-batch's gradients into ``.grad``
  (the reference trainer, DeepSpeed ZeRO-0/1: ``grad_accumulation_kernel``); DeepSpeed's BF16
  optimizer (bf16, pipeline, no ZeRO) also adds them into a second copy it keeps and shards its
  fp32 states over dp (``bf16_optimizer_with_pp``); Megatron-LM fuses it into the
  weight-gradient GEMM;
- **host cost**: eager PyTorch issues every operation from Python (about 5-20 us each on a server
  CPU) and every backward node from the autograd engine; small layers are host-bound;
- **host syncs**: Megatron-LM synchronises the device at every pipeline transfer (1F1B) and
  after each loss, DeepSpeed before every micro-batch's forward, the reference trainer after
  every micro-batch without pipelining; a pass that ends so cannot hide device-heavy work late
  in it (the last stage's output layer) behind the host's lead over the layers before it
  (``host_syncs``);
- **vocabulary padding**: Megatron pads the vocabulary to a multiple of 128 x tp;
- **softmax kernel**: Megatron's fused scale-mask-softmax kernel (eager attention) takes only
  some shapes (``cost.attention.fused_softmax_available``: keys 17-4096 and a multiple of 4, micro-batch
  x local heads a multiple of 4, of 8 up to 128 keys); elsewhere it falls back to torch's softmax
  in fp32, with more kernels and host operations (``megatron_softmax``);
- **all-reduce algorithms**: which algorithms the runtime's all-reduce really runs, so the cost
  model credits no other (``Framework.all_reduce_algorithms``): NCCL (Megatron-LM, torchtitan,
  DeepSpeed, and the reference trainer on GPUs) picks ring or tree per call and has no
  hierarchical mode those frameworks use; gloo's ``all_reduce`` (CPU processes) is a ring; the
  reference trainer's own two-level all-reduce
  (``trainer/collectives.py``) runs where a configuration sets ``dp_all_reduce="hierarchical"``.

- **context parallelism**: how keys and values move (``cp_comm``): Megatron-LM / Transformer
  Engine's ring (``--cp-comm-type p2p``, its default), torch's ``context_parallel`` (torchtitan)
  all-gathering them (its default rotation), the reference trainer's ring over gloo; DeepSpeed's
  engine has none (Ulysses is another scheme, not modelled);
- **FP8**: the recipes each runs (Transformer Engine in Megatron: tensorwise, delayed, MXFP8;
  torchao in torchtitan: rowwise, tensorwise (0.2), MXFP8; the reference trainer's
  ``autoconf.trainer.fp8``: tensorwise, rowwise), what they keep (Transformer Engine caches FP8 weights
  and transposes and saves linear inputs in FP8; torchao keeps the high-precision tensors and
  gathers FSDP weights in FP8), and the host operations the scaling costs per linear;
- **torch.compile** (torchtitan's ``compile.enable``, a knob): fused element-wise kernels, fewer
  host dispatches;
- **mixtures of experts**: expert parallelism (Megatron-LM's ``--expert-model-parallel-size``,
  torchtitan's ``expert_parallel_degree``, the reference trainer); token dropping by a capacity
  factor (Megatron-LM, the reference trainer; torchtitan routes dropless); DeepEP's deduplicating
  dispatch (Megatron-LM's flex dispatcher, torchtitan 0.3; ``moe_dispatchers``). DeepSpeed's MoE layer
  is configured in the model code, which the emitted files cannot set: not offered.

A knob set to None in a :class:`~autoconf.space.config.ParallelConfig` takes the framework's default.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from autoconf.errors import UserError
from autoconf.specs.recipes import RECIPES, default_recipe


@dataclass(frozen=True)
class HostCost:
    """Seconds the host needs to issue one operation: from Python in the forward (and recomputed
    forward), from the autograd engine in the backward. From the framework model."""

    forward_op_s: float = 0.0
    backward_op_s: float = 0.0
    dispatch_counts: bool = False
    """Count the operations as the reference trainer's block dispatches them (``dispatch_op_counts``:
    every ATen call, the backward's several per autograd node); else ``block_op_counts``' structural
    count, one per forward op and one per autograd node."""
    checkpoint_s: float = 0.0
    """Host seconds of one checkpointed region (``torch.utils.checkpoint``: saving and restoring the
    RNG states, the saved-tensor hooks, re-entering the region in the backward), forward and
    backward together; charged once per block under selective or full recomputation."""

FRAMEWORK_NAMES = ("reference", "megatron", "torchtitan", "deepspeed")
KNOBS = ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "ep_comm_overlap", "torch_compile")


@dataclass(frozen=True)
class Framework:
    name: str
    """reference, megatron, torchtitan or deepspeed."""
    schedules: tuple
    """Pipeline schedules it can run (autoconf spellings)."""
    zero_stages: tuple
    """ZeRO stages it offers without pipelining."""
    zero_stages_with_pp: tuple
    """ZeRO stages it offers together with pipeline parallelism."""
    layered_grad_accum: bool
    """Whether it can run layered gradient accumulation outside breadth-first."""
    per_micro_batch_pipeline_buffers: bool
    """Receive buffers for every micro-batch allocated up front (torch.distributed.pipelining)."""
    fp32_grad_buffer_bf16: bool
    """Gradients accumulate in an fp32 buffer when training in bf16 (Megatron's main_grad)."""
    host: HostCost
    """Seconds per operation the host needs to issue (Python forward, autograd backward)."""
    defaults: dict
    """Default value of each knob in KNOBS."""
    knobs: tuple
    """The knobs a user can switch in this framework (the search tries both values)."""
    master_weights: bool = True
    """16-bit training keeps fp32 master parameters and Adam moments (Megatron-LM's and DeepSpeed's
    mixed precision: 12 bytes per parameter). False: ``torch.optim.AdamW`` steps the 16-bit
    parameters, its moments in their dtype (4 bytes), as the reference trainer does."""
    grad_buffer_up_front: bool = False
    """Every gradient lives in one buffer allocated when the model is wrapped, zeroed, not freed,
    between steps (Megatron-Core's ``_ParamAndGradBuffer``, viewed by each ``main_grad``): the
    stage's gradients count at the activation peak. False: autograd creates each ``.grad`` at its
    first backward and ``zero_grad(set_to_none=True)`` frees it, so a peak before a chunk's first
    backward holds none of its."""
    moe_output_weighted: bool = True
    """Its mixture-of-experts combine weights the experts' outputs by the router's scores in fp32
    (``(y.float() * w).to(dtype)``: the reference trainer's ``autoconf.trainer.moe``, torchtitan's token
    dispatcher), which keeps an fp32 copy of every expert output for the scores' gradient. False:
    the scores multiply the experts' activation instead (Megatron-Core's
    ``activation_func_with_probs``; its combine is an unweighted scatter-add that keeps nothing)."""
    recompute_modules: tuple = ()
    """What its selective recomputation can be told to recompute (``config.RECOMPUTE_MODULES``:
    Megatron-LM's ``--recompute-modules``). Empty: its selective recomputation is the attention
    core, not configurable."""
    optimizer_foreach: bool = False
    """Its AdamW is torch's multi-tensor (foreach) implementation, torch's default on CUDA, which
    allocates a moment-sized temporary for every local parameter during the step
    (``memory.optimizer_temporary_bytes``). False: a fused kernel (Apex / Transformer Engine
    FusedAdam in Megatron-LM and DeepSpeed, torchtitan's default ``fused``) with no temporaries."""
    loss_backward_fp32_tensors: int = 1
    """Logits-sized fp32 tensors the cross entropy's backward allocates next to the saved fp32
    softmax (``stage_memory.loss_grad_bytes``): 1, the reference trainer, which computes the
    gradient in a clone of the saved softmax; 2, torch's ``F.cross_entropy`` on ``logits.float()``
    (torchtitan), whose log-softmax backward holds the nll loss's gradient and writes its own
    (measured on CPU, tests/test_memory_terms.py); 0, in place in the saved softmax (Megatron-LM's
    vocab-parallel cross entropy, which Megatron-DeepSpeed shares)."""
    megatron_softmax: bool = False
    """Eager (unflashed) attention in 16-bit runs Megatron's ``FusedScaleMaskSoftmax``: one fused
    CUDA kernel where that kernel takes the shape (``cost.attention.fused_softmax_available``), else
    torch's path in fp32 (cast, scale, mask fill, softmax, cast back: five kernels and five host
    operations, and the fp32 softmax output kept for the backward). False: the softmax as this
    model otherwise prices it."""
    vocab_multiple: int = 1
    """The vocabulary is padded to a multiple of this times tp."""
    memory_fragmentation: float = 0.05
    """Fraction of device memory the caching allocator loses to fragmentation (memory margin)."""
    all_reduce_algorithms: dict = field(default_factory=lambda: {"flat": ("ring", "tree")})
    """For each ``dp_all_reduce`` mode it offers, the all-reduce algorithms (``cost.comm``: ring,
    tree, hierarchical) that mode really runs; the cost model takes the fastest of those only."""
    cp_comm: str | None = None
    """How its context parallelism exchanges keys and values (``cost.context_parallel``): "ring"
    (point-to-point, chunk by chunk, overlapped with the attention of the chunk in hand:
    Megatron-LM / Transformer Engine's default ``--cp-comm-type p2p``, the reference trainer),
    "all_gather" (keys and values gathered once per layer, gradients reduce-scattered: torch's
    ``context_parallel``, which torchtitan uses, rotates with ``allgather`` by default); None:
    no context parallelism."""
    ring_math: bool = False
    """Its ring attention is tensor operations recomputed in the backward, not a fused kernel."""
    fp8_recipes: tuple = ()
    """The FP8 scaling recipes it runs (``config.FP8_RECIPES``); empty: no FP8."""
    fp8_host_ops: tuple = (0, 0)
    """Operations issued from Python per linear layer to scale and cast its FP8 operands
    (forward, backward): a handful of eager ops each (amax, scale, clamp, cast) in torchao and the
    reference trainer, one fused extension call in Transformer Engine."""
    fp8_weight_copy_bytes: float = 0.0
    """Bytes per linear-layer parameter of FP8 weight copies kept from the first micro-batch to
    the end of the step: Transformer Engine caches the FP8 weight and its transpose (2 bytes);
    torchao casts per use and keeps nothing."""
    fp8_saves_inputs: bool = False
    """Whether a linear layer keeps its input for the backward in FP8 (Transformer Engine saves
    the quantised input); else in the model's dtype (torchao saves the high-precision tensors)."""
    expert_parallel: bool = False
    """Whether it splits a mixture of experts' experts over ranks (``config.ParallelConfig.ep``)."""
    capacity_factor: bool = False
    """Whether its router can drop tokens beyond an expert capacity (else dropless only)."""
    moe_dispatchers: tuple = ("alltoall",)
    """The token dispatchers it can run (``config.MOE_DISPATCHERS``): DeepEP in Megatron-LM's flex
    dispatcher and torchtitan 0.3's DeepEPTokenDispatcher, where the DeepEP library is installed."""
    expert_tensor_parallel: bool = True
    """Whether its experts are split over the tp ranks like the dense MLP (Megatron-LM's default
    expert tensor-parallel size is tp); else every tp rank holds whole experts and routes its own
    tokens (its sequence shard under sequence parallelism, all of them otherwise): torchtitan 0.3
    under expert parallelism, the reference trainer."""
    expert_zero_stages: tuple = (0, 1, 2, 3)
    """The ZeRO stages it runs together with expert parallelism."""
    fp8_all_gather: bool = False
    """ZeRO-3 / FSDP gathers linear weights in FP8 (torchao's float8 all-gather with tensorwise
    scaling, which the emitted torchtitan files switch on): half the bytes."""
    grad_norm_traffic: float = 0.0
    """Memory traffic of the step's global gradient-norm pass, per local gradient element, in
    multiples of the gradient's bytes: the norm reads every gradient once (Megatron-LM's
    ``clip_grad_norm_fp32`` with its default ``--clip-grad 1.0``, over the main gradients, the
    distributed optimizer's shard only; DeepSpeed's BF16 optimizer's global norm, over the whole
    stage's gradients; its emitted configuration clips nothing), and torch's
    ``clip_grad_norm_`` (torchtitan's default ``max_norm`` 1.0) then multiplies every gradient by
    the clamped coefficient (read and write): 3. Megatron scales only when the norm exceeds the
    limit, which is not priced. 0: no such pass (the reference trainer does not clip)."""
    tied_pair_all_reduce: bool = False
    """Tied embeddings under pp: the first and last stage all-reduce their copies' gradients after
    the pipeline (Megatron-LM's ``_allreduce_word_embedding_grads``, DeepSpeed's
    ``ReduceTiedGrads``; ``compression.embedding_sync_s``). torch.distributed.pipelining
    (torchtitan) has no such step."""
    grad_reduce_overlap_needs_zero_without_pp: bool = False
    """``overlap_grad_reduce`` takes effect only with ZeRO and without pipeline parallelism
    (DeepSpeed, read in 0.19.8: its pipeline engine turns the backward's reduction off and reduces
    after the flush, ``ReduceGrads``; ZeRO-0 reduces after the backward,
    ``buffered_allreduce_fallback``; ``overlap_comm`` only moves ZeRO-1/2/3's bucket reductions
    into the backward). Elsewhere the knob is read as it is (:meth:`overlaps_grad_reduce`)."""
    tied_sync_after_pipeline: bool = False
    """Tied embeddings under pp: its first and last stage sum their copies' gradients after the
    pipeline, then reduce that sum over the replicas on its own, after the chunks' reductions
    (the reference trainer). Elsewhere the copies go in the chunks' data-parallel buckets, and the
    first and last stage all-reduce them once more after the pipeline where the framework does
    (``tied_pair_all_reduce``)."""
    fp8_eager_quantize: bool = False
    """Its FP8 linears quantise every operand with eager torch operations before each GEMM
    (``autoconf.trainer.fp8``; ``cost.fp8.EAGER_QUANT_BYTES``), not with fused cast kernels (Transformer
    Engine, torchao under torch.compile as torchtitan runs it)."""
    eager_elementwise: bool = False
    """Its norms, rotary embedding, gated activation and QKV split run as eager torch operations
    (the reference trainer's ``autoconf.trainer.layers``: RMSNorm as 8 kernels forward and 14
    backward, mostly fp32, the rotary embedding as five per tensor; torchtitan's eager PyTorch;
    ``compute.eager_elementwise_bytes``), not as the fused kernels of Megatron-LM and DeepSpeed
    (Transformer Engine / Apex). Not under ``torch_compile``."""
    grad_accumulation_kernel: bool = False
    """Every micro-batch's weight gradients are added into ``.grad`` by a separate kernel per
    parameter (eager torch autograd; the reference trainer, measured on an H100; DeepSpeed, whose
    ZeRO-0/1 leave the accumulation to autograd until the boundary, read in DeepSpeed 0.19.8
    ``stage_1_and_2.py``; its BF16 optimizer adds a pass of its own, ``bf16_optimizer_with_pp``).
    Megatron-LM fuses the accumulation into the weight-gradient GEMM
    (``gradient_accumulation_fusion``, its default). torchtitan is left without it: FSDP2's
    gradients are reduced and sharded in ways not measured here."""
    tp_backward_overlap: bool = False
    """A column-parallel linear's backward launches its tensor-parallel collectives asynchronously
    beside its GEMMs (Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``, which
    Megatron-DeepSpeed shares; ``tensor_parallel.overlapped``). Elsewhere they run in turn:
    torchtitan's DTensor redistributions, the reference trainer, DeepSpeed's AutoTP layers (what
    the emitted DeepSpeed files use)."""
    step_gather_overlaps: bool = True
    """Under ``overlap_param_gather`` the parameter gather after a ZeRO-1/2 step runs layer by
    layer under the next forward (Megatron-LM's distributed optimizer). False: the step gathers
    them before it returns (DeepSpeed: ``all_gather_dp_groups`` inside ``step``; its
    ``overlap_param_gather`` default stands for ZeRO-3's prefetching only)."""
    early_receive_schedules: tuple = ()
    """Schedules under which the framework posts its pipeline receives ahead of the op before them,
    so a transfer overlaps the receiver's compute (Megatron-LM's interleaved schedule:
    ``overlap_p2p_comm``, on by default with virtual stages, posts ``irecv``s one step early).
    Elsewhere a receive waits for the op before it (``schedule_time.posted_receives``)."""
    host_syncs: tuple = ()
    """Where the runtime makes the host wait for the device inside a step (``synced_passes``). A
    pass that ends so cannot hide device work late in it behind the host's lead over the layers
    before it: the device runs the operations in the order the host issues them, and nothing
    after the pass is issued until the device is done (``chunk_time.issue_bound_s``); the output
    layer's forward, device-heavy, is last in the last stage's forward.

    - ``"p2p"``: every pipeline transfer (Megatron-Core's batched p2p: ``torch.cuda.synchronize()``
      after ``batch_isend_irecv`` under ``batch_p2p_sync``, its default whenever
      ``overlap_p2p_comm`` is off, i.e. without virtual stages: pp > 1 outside
      ``early_receive_schedules``). It ends each forward but the last stage's (which sends
      nothing) and each backward but the first stage's (likewise);
    - ``"loss"``: the forward that computes a micro-batch's loss (Megatron-LM's GPT loss function,
      in its training scripts outside the megatron-core package, validates the loss under
      ``check_for_nan_in_loss_and_grad``, on by default, through megatron-core's
      ``RerunStateMachine.validate_result``, which evaluates ``torch.isnan(loss)`` on the host
      even with reruns disabled);
    - ``"forward"``: before every micro-batch's forward, so every backward ends synchronised
      (DeepSpeed: the engine's ``ThroughputTimer.start()`` synchronises at every forward, both
      engines, 0.9 to 0.16);
    - ``"loss_read"``: every backward without pipelining or layered accumulation (the reference
      trainer's ``float(loss)`` after it, ``accumulation.standard_step``).

    Empty: none (torchtitan; torch.distributed.pipelining waits on its transfers on the stream)."""
    param_gather_in_place: bool = False
    """ZeRO-1/2's parameter gather after the step lands in the flat buffer the parameters are views
    of (``all_gather_into_tensor``): no flatten and copy back around it, the optimizer's 16-bit
    write being the only copy (Megatron-LM's distributed optimizer, DeepSpeed's
    ``all_gather_dp_groups``). False: the reference trainer flattens each owner's shard, sends it
    and copies it back into the parameters (``data_parallel.post_all_gather_s``)."""
    bf16_optimizer_with_pp: bool = False
    """bf16 without ZeRO under pipeline parallelism runs DeepSpeed's ``BF16_Optimizer``, which
    keeps a second copy of every gradient (in bf16 unless ``grad_accum_dtype`` says otherwise),
    adds each micro-batch's gradients into it and shards its fp32 master weights and moments over
    dp (``Policy.bf16_optimizer``, ``compute.BF16_OPTIMIZER_UPDATE``): DeepSpeed."""
    fused_glu: bool = False
    """A gated MLP's activation is one autograd function that keeps only its input and recomputes
    act(gate) in the backward: Megatron-LM's ``bias_swiglu_impl`` (``bias_swiglu_fusion``, on
    unless ``--no-bias-swiglu-fusion``; its experts too; ``bias_geglu_impl`` for GeGLU in
    megatron-core, though ``pretrain_gpt.py`` has no GeGLU flag). Three f-wide tensors per token
    instead of eager's four (``activations.mlp_hidden_rows``)."""
    recipe: str = ""
    """The release or recipe preset whose defaults this model follows (``RECIPES``)."""
    fp8_param_gather: bool = False
    """FP8 training keeps the linear layers' parameters in FP8 (Transformer Engine's FP8 tensors,
    Megatron-LM's ``--fp8-param-gather``): 1 byte per such parameter instead of 2, the cached FP8
    transpose the only copy beside it, and the distributed optimizer's parameter all-gather in FP8
    (``stage_memory``, ``data_parallel.post_all_gather_s``)."""
    attention_kernel: str = ""
    """Its fused attention kernel where not the device's (``DeviceType.attention_kernels``; why in
    ``specs.recipes``: "flash2" under ``torchtitan:torch-2.6``)."""
    op_selective_checkpoint: bool = False
    """recompute="selective" is per-operation selective checkpointing (torchtitan's default
    ``SelectiveAC`` policy, 0.3.0 ``distributed/activation_checkpoint.py``): a dense block keeps
    its input, the outputs of its attention kernel and of every other matmul (the 1st, 3rd, ...
    in call order), and its reduce-scatter outputs; the rest is recomputed in the backward
    (``activations.op_checkpoint_parts``, ``compute.op_checkpoint_recompute_s``). False: the
    attention core alone is recomputed (Megatron-LM's selective recomputation)."""
    moe_parallel_folding: bool = False
    """Whether the experts' tensor-parallel split is a setting (``ParallelConfig.expert_tp``:
    Megatron-Core's ``expert_tensor_parallel_size``, 1 folding the expert-parallel group over tp
    as well)."""
    fsdp_reduce_bytes: int = 0
    """Bytes per gradient element of FSDP's (ZeRO-2/3's) reduce-scatter where they differ from the
    gradients' own: torchtitan reduces in fp32 (``training.mixed_precision_reduce = "float32"``,
    torchtitan 0.3.0 ``config/configs.py``, passed as FSDP2's ``reduce_dtype``), 4. 0: the
    gradients' bytes (``Policy.grad_bytes``)."""
    fsdp_step_gather_under_pp: bool = False
    """Under pipeline parallelism FSDP (ZeRO-2/3) gathers each stage's parameters once per step and
    reduce-scatters its gradients once, after the last micro-batch: torchtitan runs
    ``reshard_after_forward=False`` with pipelining (``fsdp_reshard_after_forward = "default"``,
    0.3.0 ``distributed/fsdp.py``), and ``torch.distributed.pipelining``'s stage turns off
    resharding after backward and gradient sync for every micro-batch but the last
    (``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``; torch 2.13
    ``distributed/pipelining/stage.py``, ``backward_maybe_with_nosync`` and
    ``perform_reduce_grad``). The stage then holds its parameters and their gradients, accumulated
    at the reduce dtype, unsharded through the step (``stage_memory``)."""
    compression: bool = False
    """Whether it runs Optimus-CC's compressed traffic (``pp_compression``, ``dp_compression_stages``,
    ``fused_embedding_sync``): the reference trainer only. Megatron-LM, torchtitan and DeepSpeed
    have no low-rank pipeline-gradient compression and no PowerSGD hook for their own gradient
    buffers."""

    def dp_all_reduce_algorithms(self, config, g, gloo: bool = False) -> tuple:
        """The algorithms the data-parallel all-reduce of ``config`` runs over a group with links
        ``g`` (a ``topology.GroupLinks``): a hierarchical one falls back to flat where the group's
        hosts do not split evenly (:func:`hierarchical_runs`), as the trainer does. ``gloo``: CPU
        processes, whose flat all-reduce is gloo's ring (NCCL on GPUs picks ring or tree)."""
        mode = getattr(config, "dp_all_reduce", "flat")
        if mode != "flat" and not hierarchical_runs(g):
            mode = "flat"
        return self.flat_all_reduce_algorithms(gloo) if mode == "flat" else self.all_reduce_algorithms[mode]

    def flat_all_reduce_algorithms(self, gloo: bool = False) -> tuple:
        """The algorithms of the collective library's own all-reduce (tensor parallelism, and the
        data-parallel one unless the configuration asks for another): gloo's ring on CPU
        processes, else the framework's (NCCL's ring or tree)."""
        return GLOO_ALL_REDUCE if gloo else self.all_reduce_algorithms["flat"]

    def expert_split(self, config) -> int:
        """How many ways each routed expert is split: ``expert_tp`` where set, else its own."""
        etp = getattr(config, "expert_tp", None)
        return self.own_expert_split(config) if etp is None else etp

    def own_expert_split(self, config) -> int:
        """Its own split of a routed expert: tp where ``expert_tensor_parallel`` (Megatron-LM), else 1."""
        return config.tp if self.expert_tensor_parallel else 1

    def knob(self, config, name: str) -> bool:
        """The knob's value for a configuration: its own if set, else this framework's default."""
        v = getattr(config, name, None)
        return self.defaults[name] if v is None else bool(v)

    def can_overlap_grad_reduce(self, config) -> bool:
        """Whether ``overlap_grad_reduce`` takes effect in this configuration
        (``grad_reduce_overlap_needs_zero_without_pp``)."""
        return not (self.grad_reduce_overlap_needs_zero_without_pp and (config.pp > 1 or config.zero_stage == 0))

    def overlaps_grad_reduce(self, config) -> bool:
        """Whether the data-parallel reduction runs under the backward for this configuration:
        the ``overlap_grad_reduce`` knob where it takes effect (:meth:`can_overlap_grad_reduce`)."""
        return self.can_overlap_grad_reduce(config) and self.knob(config, "overlap_grad_reduce")

    def synced_passes(self, pp: int, schedule: str, layered: bool, first_chunk: bool,
                      last_chunk: bool) -> tuple:
        """(forward, backward): whether a chunk's forward, and its backward, end at a host-device
        synchronisation (``host_syncs``) in a configuration of ``pp`` stages, ``schedule`` and
        layered gradient accumulation or not; ``first_chunk`` / ``last_chunk``: the chunk on the
        first stage, and the one that computes the loss."""
        syncs = self.host_syncs
        p2p = "p2p" in syncs and pp > 1 and schedule not in self.early_receive_schedules
        fwd = (p2p and not last_chunk) or ("loss" in syncs and last_chunk)
        bwd = ((p2p and not first_chunk) or "forward" in syncs
               or ("loss_read" in syncs and pp == 1 and not layered))
        return fwd, bwd

    def padded_vocab(self, vocab: int, tp: int) -> int:
        mult = self.vocab_multiple * tp
        return -(-vocab // mult) * mult if self.vocab_multiple > 1 else vocab

    def check(self, config) -> str | None:
        """Why this framework cannot run the configuration, or None."""
        c = config
        if c.pp > 1 and c.schedule not in self.schedules:
            return f"framework {self.name} has no {c.schedule} schedule; valid: {', '.join(self.schedules)}"
        zs = self.zero_stages_with_pp if c.pp > 1 else self.zero_stages
        if c.zero_stage not in zs:
            return (f"framework {self.name} has no ZeRO-{c.zero_stage}"
                    f"{' with pipelining' if c.pp > 1 else ''}; valid: {', '.join(map(str, zs))}")
        if c.layered_grad_accum and c.schedule != "breadth_first" and not self.layered_grad_accum:
            return f"framework {self.name} has no layered gradient accumulation"
        for k in KNOBS:
            if getattr(c, k, None) is not None and k not in self.knobs and bool(getattr(c, k)) != self.defaults[k]:
                return f"framework {self.name} cannot switch {k} (always {self.defaults[k]})"
        mods = tuple(getattr(c, "recompute_modules", ()) or ())
        if mods and not set(mods) <= set(self.recompute_modules):
            return (f"framework {self.name} cannot choose what selective recomputation recomputes "
                    f"(recompute_modules={list(mods)}); its selective recomputation is the attention core"
                    + (f"; valid: {', '.join(self.recompute_modules)}" if self.recompute_modules else ""))
        if ({"moe_act", "layernorm"} & set(mods) and getattr(c, "precision", "bf16") == "fp8"
                and c.fp8_recipe == "delayed"):
            return (f"framework {self.name} cannot recompute moe_act or layernorm under FP8 delayed scaling; "
                    "valid: another FP8 recipe, or leave them out of recompute_modules")
        if getattr(c, "ep", 1) > 1 and not self.expert_parallel:
            return f"framework {self.name} has no expert parallelism (ep={c.ep})"
        etp = getattr(c, "expert_tp", None)
        if etp is not None and getattr(c, "ep", 1) > 1 and not self.moe_parallel_folding:
            if etp != (own := self.own_expert_split(c)) or (etp == 1 and c.tp > 1):  # groups inside dp x cp
                return (f"framework {self.name} cannot set expert_tp={etp} (its experts are split {own} ways "
                        "inside dp x cp); Megatron's MoE parallel folding can")
        if getattr(c, "ep", 1) > 1 and c.zero_stage not in self.expert_zero_stages:
            return (f"framework {self.name} has no ZeRO-{c.zero_stage} with expert parallelism; valid: "
                    f"{', '.join(map(str, self.expert_zero_stages))}")
        if getattr(c, "moe_dispatcher", "alltoall") not in self.moe_dispatchers:
            return (f"framework {self.name} has no {c.moe_dispatcher} token dispatcher; valid: "
                    f"{', '.join(self.moe_dispatchers)}")
        if getattr(c, "moe_capacity_factor", None) is not None and not self.capacity_factor:
            return f"framework {self.name} routes dropless only (moe_capacity_factor={c.moe_capacity_factor})"
        if getattr(c, "cp", 1) > 1 and self.cp_comm is None:
            return f"framework {self.name} has no context parallelism (cp={c.cp})"
        if getattr(c, "precision", "bf16") == "fp8" and c.fp8_recipe not in self.fp8_recipes:
            return (f"framework {self.name} has no FP8 recipe {c.fp8_recipe}"
                    + (f"; valid: {', '.join(self.fp8_recipes)}" if self.fp8_recipes else " (no FP8 at all)"))
        if not self.compression:
            for k, what in (("pp_compression", "compressed pipeline gradients"),
                            ("dp_compression_stages", "PowerSGD on data-parallel gradients"),
                            ("fused_embedding_sync", "fused embedding synchronisation")):
                v = getattr(c, k, None)
                if v not in (None, "none", 0, False):
                    return f"framework {self.name} has no {what} ({k}={v!r}); the reference trainer runs it"
        mode = getattr(c, "dp_all_reduce", "flat")
        if mode not in self.all_reduce_algorithms:
            return (f"framework {self.name} has no dp_all_reduce={mode}; valid: "
                    f"{', '.join(self.all_reduce_algorithms)}")
        return None


def hierarchical_runs(g) -> bool:
    """Whether a hierarchical all-reduce runs over a group with links ``g`` (a
    ``topology.GroupLinks``): at least two hosts, at least two members on each, the same number on
    every host. Elsewhere the reference trainer keeps the flat one (the same rule as
    ``space.allreduce.host_layout``)."""
    return g.num_hosts >= 2 and g.local_size >= 2 and g.size == g.num_hosts * g.local_size



# Host cost per eager operation. Measured where it shows: on the GPU development set (Megatron-
# DeepSpeed, 8 x A100, bench/gpu_devset.py) every layer pass at micro-batch 1 takes the same
# 3.3-3.8 ms whatever its hidden size (1024 or 2048) or tp (1-4): the host's time to issue it,
# with the TP collectives running inside it (``chunk_time``).
# Divided by the block's counted operations (``compute.block_op_counts``, which counts one op per
# layer-level operation, not every view and bookkeeping call around it) that is 50 us per
# Python-issued counted op and 20 us per autograd node: Megatron's model-parallel RNG tracker,
# DeepSpeed's checkpointing wrappers and fp16 loss scaling add Python work around each. This is
# the one figure of the model set from the development set, and the only place it shows. torch
# eager without those wrappers (torchtitan) is taken at the commonly measured ~10 us per op and
# ~5 us per node.
#
# The reference trainer was measured on one H100 SXM host (2026-11-24, torch 2.11, 16-core VM;
# bench/gpu_host_device.py, bench/gpu_single.py): its ATen dispatches counted on the real block
# (``compute.dispatch_op_counts``: 34 forward and 69 backward for a GPT-3 block) and 18 us each,
# from a host-bound GPT-3 1.3B block at micro-batch 1 (forward 0.69 ms back to back for 34
# dispatches: 20 us; backward at most 1.21 ms for 69: 17.6 us); 0.55 ms of host time per
# torch.utils.checkpoint region, from the same model's steps (selective recomputation added
# 0.69 ms per layer pass at micro-batch 1, of which 8 dispatches). Held out, GPT-2 large (36
# layers of hidden 1280, host-bound up to micro-batch 2) then lands at a median 4% over 6 rows
# (was 47%), 9% over an earlier run's 9 rows with selective recomputation.
# A faster host CPU issues faster: a profile measures the layers as they run.
_EAGER = HostCost(forward_op_s=10e-6, backward_op_s=5e-6)
_REFERENCE_HOST = HostCost(forward_op_s=18e-6, backward_op_s=18e-6, dispatch_counts=True, checkpoint_s=0.55e-3)
_MEGATRON_HOST = HostCost(forward_op_s=50e-6, backward_op_s=20e-6)

# NCCL chooses ring or tree per call (NCCL_ALGO unset); gloo's all-reduce is a ring.
_NCCL_ALL_REDUCE = {"flat": ("ring", "tree")}
GLOO_ALL_REDUCE = ("ring",)

FRAMEWORKS = {
    "reference": Framework(
        name="reference", schedules=("gpipe", "1f1b", "interleaved", "breadth_first"),
        zero_stages=(0, 1, 2, 3), zero_stages_with_pp=(0, 1, 2, 3), layered_grad_accum=True,
        per_micro_batch_pipeline_buffers=True, fp32_grad_buffer_bf16=False, host=_REFERENCE_HOST,
        master_weights=False, optimizer_foreach=True,
        defaults={"overlap_grad_reduce": True, "overlap_param_gather": True, "tp_comm_overlap": False,
                  "ep_comm_overlap": False, "torch_compile": False},
        knobs=(), all_reduce_algorithms={"flat": ("ring", "tree"), "hierarchical": ("hierarchical",)},
        cp_comm="ring", ring_math=True, fp8_recipes=("tensorwise", "rowwise"), fp8_host_ops=(16, 16),
        expert_parallel=True, expert_zero_stages=(0, 1), expert_tensor_parallel=False,
        capacity_factor=True, compression=True, tied_sync_after_pipeline=True,
        eager_elementwise=True, grad_accumulation_kernel=True, fp8_eager_quantize=True, host_syncs=("loss_read",)),
    # ZeRO-3 without pipelining is Megatron FSDP (megatron-core 0.16.1 distributed/fsdp:
    # data_parallel_sharding_strategy "optim_grads_params": parameters gathered before each
    # module's forward and backward, gradients reduce-scattered in every backward)
    "megatron": Framework(
        name="megatron", schedules=("1f1b", "interleaved"),
        zero_stages=(0, 1, 3), zero_stages_with_pp=(0, 1), layered_grad_accum=False,
        per_micro_batch_pipeline_buffers=False, fp32_grad_buffer_bf16=True, host=_MEGATRON_HOST,
        defaults={"overlap_grad_reduce": False, "overlap_param_gather": False, "tp_comm_overlap": False,
                  "ep_comm_overlap": False, "torch_compile": False},
        knobs=("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "ep_comm_overlap"),
        vocab_multiple=128, loss_backward_fp32_tensors=0, megatron_softmax=True, grad_buffer_up_front=True,
        all_reduce_algorithms=_NCCL_ALL_REDUCE, cp_comm="ring", fp8_recipes=("tensorwise", "delayed", "mxfp8"),
        fp8_host_ops=(1, 1), fp8_weight_copy_bytes=2.0, fp8_saves_inputs=True, expert_parallel=True,
        capacity_factor=True, moe_dispatchers=("alltoall", "deepep"), fused_glu=True, tp_backward_overlap=True,
        moe_parallel_folding=True,
        recompute_modules=("core_attn", "layernorm", "moe_act", "mla_up_proj"), moe_output_weighted=False,
        param_gather_in_place=True, early_receive_schedules=("interleaved",), tied_pair_all_reduce=True,
        grad_norm_traffic=1.0, host_syncs=("p2p", "loss")),
    "torchtitan": Framework(
        name="torchtitan", schedules=("gpipe", "1f1b", "interleaved", "breadth_first"),
        zero_stages=(0, 2, 3), zero_stages_with_pp=(0, 2, 3), layered_grad_accum=False,
        per_micro_batch_pipeline_buffers=True, fp32_grad_buffer_bf16=False, host=_EAGER,
        defaults={"overlap_grad_reduce": True, "overlap_param_gather": True, "tp_comm_overlap": False,
                  "ep_comm_overlap": False, "torch_compile": False},
        knobs=("tp_comm_overlap", "torch_compile"), all_reduce_algorithms=_NCCL_ALL_REDUCE, loss_backward_fp32_tensors=2,
        cp_comm="all_gather", fp8_recipes=("rowwise", "tensorwise", "mxfp8"), fp8_host_ops=(16, 16),
        fp8_all_gather=True, expert_parallel=True, expert_tensor_parallel=False, grad_norm_traffic=3.0,
        moe_dispatchers=("alltoall", "deepep"), fsdp_reduce_bytes=4, fsdp_step_gather_under_pp=True,
        op_selective_checkpoint=True, eager_elementwise=True),
    "deepspeed": Framework(
        name="deepspeed", schedules=("1f1b",),
        zero_stages=(0, 1, 2, 3), zero_stages_with_pp=(0, 1), layered_grad_accum=False,
        per_micro_batch_pipeline_buffers=False, fp32_grad_buffer_bf16=False, host=_MEGATRON_HOST,
        defaults={"overlap_grad_reduce": False, "overlap_param_gather": True, "tp_comm_overlap": False,
                  "ep_comm_overlap": False, "torch_compile": False},
        knobs=("overlap_grad_reduce",), all_reduce_algorithms=_NCCL_ALL_REDUCE,
        loss_backward_fp32_tensors=0, grad_accumulation_kernel=True, bf16_optimizer_with_pp=True,
        step_gather_overlaps=False, grad_reduce_overlap_needs_zero_without_pp=True, param_gather_in_place=True,
        tied_pair_all_reduce=True, grad_norm_traffic=1.0, host_syncs=("forward",)),
}


def framework(name: str | None) -> Framework:
    """The framework model by name, ``name`` or ``name:recipe`` (``RECIPES``; the framework's
    first recipe by default; None: the reference trainer)."""
    base, _, recipe = (name or "reference").partition(":")
    if base not in FRAMEWORKS:
        raise UserError(f"unknown framework {base!r}; valid: {', '.join(FRAMEWORK_NAMES)}")
    recipes = RECIPES[base]
    recipe = recipe or default_recipe(base)
    if recipe not in recipes:
        raise UserError(f"framework {base} has no recipe {recipe!r}; valid: "
                        f"{', '.join(f'{base}:{r}' for r in recipes)}")
    return _with_recipe(base, recipe)


@functools.lru_cache(maxsize=None)
def _with_recipe(base: str, recipe: str) -> Framework:
    fw = FRAMEWORKS[base]
    changes = dict(RECIPES[base][recipe][1])
    if "defaults" in changes:
        changes["defaults"] = {**fw.defaults, **changes["defaults"]}
    return dataclasses.replace(fw, recipe=recipe, **changes)
