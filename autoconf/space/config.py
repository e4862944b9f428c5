"""ParallelConfig: one way to split training over devices, its validity rules, and the space of them.

Every rejection carries a reason that names the values involved; ``reason_key`` groups them for the
search's "rejected because" table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autoconf.errors import UserError
from autoconf.space.degrees import Degrees, folds_experts, order_reason
from autoconf.space.placement import check_placement, even_layers
from autoconf.specs.cluster import MAX_DEVICES
from autoconf.specs.model import ModelSpec
from autoconf.specs.schema import Bool, Int, List, Null, Num, Str, checked, defaults_of, schema_of

SCHEDULES = ("gpipe", "1f1b", "interleaved", "breadth_first")
RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_MODULES = ("core_attn", "layernorm", "moe_act", "mla_up_proj")
"""What ``recompute="selective"`` can recompute, in Megatron-LM's names (those of its
``--recompute-modules`` that autoconf prices; it also has mlp, moe and shared_experts):
the attention core; the norms whose outputs a separate linear reads (a mixture of experts' norm
before its router and experts, multi-head latent attention's input norm: elsewhere Transformer
Engine fuses the norm into the linear); the routed experts' activation function (its output,
the down projection's input, dropped); MLA's up-projections and rotary embedding (the heads'
queries, keys and values dropped, rebuilt from the latents)."""
DP_ALL_REDUCE = ("flat", "hierarchical")
PP_COMPRESSION = ("none", "epilogue", "all")
"""Low-rank compression of the activation gradients sent backwards between pipeline stages
(Optimus-CC, arXiv 2301.09830): none; epilogue (only the sends nothing overlaps: those a device
makes after its last forward, e.g. stage s's last p - s under 1F1B); all (every backward send).
Forward activations are never compressed."""
MOE_DISPATCHERS = ("alltoall", "deepep")
"""How a mixture of experts' tokens reach their experts' ranks (``ParallelConfig.moe_dispatcher``)."""
PRECISIONS = ("bf16", "fp8", "tf32")
FP8_RECIPES = ("tensorwise", "delayed", "rowwise", "mxfp8")
"""Scaling of FP8 operands: one scale per tensor computed from the current amax (tensorwise,
"current scaling"), one per tensor from an amax history (delayed: Transformer Engine's original
recipe), one per row (rowwise: torchao), one per 32-element block (mxfp8: Blackwell's
microscaling format, MX-compliant E8M0 scales)."""

_DEGREE = Int(1, MAX_DEVICES)
PLACEMENT_FIELDS = ("device_order", "stage_layers")
"""Written by :meth:`ParallelConfig.to_dict` only when set, so documents without a placement read
as before."""


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees, batching, schedule and memory savers for one training run."""

    dp: int = checked(_DEGREE)
    """Data-parallel degree (replicas, or ZeRO shards)."""
    pp: int = checked(_DEGREE)
    """Pipeline-parallel degree (stages)."""
    tp: int = checked(_DEGREE)
    """Tensor-parallel degree (Megatron-style column/row sharding of each block)."""
    micro_batch_size: int = checked(Int(1, 1 << 20))
    """Sequences per micro-batch on one data-parallel replica."""
    num_micro_batches: int = checked(Int(1, 1 << 20))
    """Micro-batches per step per replica; global batch = dp x micro_batch_size x num_micro_batches."""
    schedule: str = checked(Str(SCHEDULES), "1f1b")
    """gpipe, 1f1b, interleaved (modular pipeline: v round-robin chunks per device), breadth_first
    (looped breadth-first: modular placement with layered gradient accumulation)."""
    virtual_stages: int = checked(Int(1, 1 << 10), 1)
    """Chunks per device, v (interleaved / breadth_first); 1 otherwise."""
    layered_grad_accum: bool = checked(Bool(), False)
    """Run each layer (or chunk) for all micro-batches before the next (arXiv 2106.02679)."""
    zero_stage: int = checked(Int(0, 3), 0)
    """0: replicated; 1: optimizer state sharded; 2: + gradients; 3: + parameters."""
    recompute: str = checked(Str(RECOMPUTE), "none")
    """none, selective (attention core recomputed, or ``recompute_modules``), full (only each
    block's input kept)."""
    sequence_parallel: bool = checked(Bool(), False)
    """Shard norms/dropout along the sequence over the TP group (all-gather/reduce-scatter)."""
    rank_order: str = checked(Str(max_len=32), "tp-dp-pp")
    """Axes from innermost (consecutive ranks) to outermost, as Megatron's RankGenerator."""
    overlap_grad_reduce: bool | None = checked(Null(Bool()), None)
    """Overlap the data-parallel gradient reduction with the backward pass (Megatron
    ``--overlap-grad-reduce``, DeepSpeed ``overlap_comm``). None: the framework's default."""
    overlap_param_gather: bool | None = checked(Null(Bool()), None)
    """Prefetch ZeRO's parameter all-gathers behind compute (Megatron ``--overlap-param-gather``,
    FSDP2 prefetch). None: the framework's default."""
    tp_comm_overlap: bool | None = checked(Null(Bool()), None)
    """Overlap tensor-parallel communication with the GEMMs (Megatron ``--tp-comm-overlap`` with
    sequence parallelism, torchtitan's asynchronous TP). None: the framework's default."""
    ep_comm_overlap: bool | None = checked(Null(Bool()), None)
    """Overlap a mixture of experts' token all-to-alls with another micro-batch's computation
    (Megatron ``--overlap-moe-expert-parallel-comm``: forward and backward of two micro-batches run
    together layer by layer on two streams, ``cost.moe.paired_layer_s``). Needs ep > 1, no full
    recomputation, and the interleaved schedule when pp > 1. None: the framework's default."""
    moe_dispatcher: str = checked(Str(MOE_DISPATCHERS), "alltoall")
    """How tokens reach their experts' ranks with ep > 1 (``MOE_DISPATCHERS``): "alltoall", one
    all-to-all of every (token, expert) pair (Megatron-LM's alltoall dispatcher, torchtitan's,
    the reference trainer's); "deepep", DeepSeek's DeepEP kernels (Megatron-LM's flex dispatcher,
    torchtitan 0.3's DeepEPTokenDispatcher), which send a token once to each host holding any of
    its experts, over the NICs, and forward it inside the host over NVLink, once per GPU
    (``cost.moe.deepep_bytes``)."""
    dp_all_reduce: str = checked(Str(DP_ALL_REDUCE), "flat")
    """ZeRO-0/1's gradient all-reduce: "flat" (the collective library's own: gloo's ring in the
    reference trainer, NCCL's ring or tree elsewhere) or "hierarchical" (reduce-scatter inside each
    host, all-reduce across hosts, all-gather inside each host; the reference trainer only,
    ``trainer/collectives.py``)."""
    device_order: tuple | None = checked(Null(List(Int(0, MAX_DEVICES - 1), min_len=1, max_len=MAX_DEVICES)), None)
    """The device each rank runs on (rank r on device ``device_order[r]``; a permutation of
    0..world-1 in the cluster's device numbering). None: rank r on device r. See ``placement``."""
    stage_layers: tuple | None = checked(Null(List(Int(1, 1 << 20), min_len=1, max_len=1 << 16)), None)
    """Transformer blocks of each pipeline chunk (pp x virtual_stages entries, each >= 1, summing
    to the model's layers). None: as even as possible. See ``placement``."""
    cp: int = checked(_DEGREE, 1)
    """Context-parallel degree: each sequence is split over cp ranks (load-balanced causal split:
    2 x cp chunks, rank i holding chunks i and 2cp-1-i); attention exchanges keys and values over
    the group, every other layer works on the rank's tokens only. Gradients are reduced, and ZeRO
    shards, over dp x cp."""
    precision: str = checked(Str(PRECISIONS), "bf16")
    """Matmul precision. bf16: every GEMM in the model's dtype (bf16, fp16 or fp32). fp8: the
    linear layers' GEMMs in FP8 (E4M3 forward, E4M3/E5M2 backward) with ``fp8_recipe``'s scaling;
    the attention core and the output layer stay in the model's dtype. tf32: an fp32 model whose
    GEMMs run on TF32 tensor cores (PyTorch's ``allow_tf32``; storage and every other kernel in
    fp32)."""
    fp8_recipe: str = checked(Str(FP8_RECIPES), "tensorwise")
    """With precision fp8: tensorwise, delayed, rowwise or mxfp8 (see ``FP8_RECIPES``)."""
    torch_compile: bool | None = checked(Null(Bool()), None)
    """Compile each block with ``torch.compile`` (torchtitan ``--compile.enable``): element-wise
    kernels fused, Python dispatch gone. None: the framework's default."""
    ep: int = checked(_DEGREE, 1)
    """Expert-parallel degree (mixture-of-experts models): the routed experts of each MoE layer are
    split over ep ranks, which exchange tokens twice per layer (dispatch, combine: all-to-alls, or
    DeepEP's kernels, ``moe_dispatcher``).
    As Megatron-LM folds it, the expert-parallel group lies inside the dp x cp ranks (ep divides
    dp x cp; the ranks of a pipeline stage and tensor-parallel rank that hold different tokens):
    attention is replicated over them as usual, the experts are not. Expert weights are reduced,
    and ZeRO-sharded, over the dp x cp / ep ranks holding the same experts."""
    moe_capacity_factor: float | None = checked(Null(Num(0.0, 64.0, lo_open=True)), None)
    """Token dropping: each expert takes at most capacity_factor x (tokens x top-k / experts)
    tokens per micro-batch, the rest skip it. None: dropless routing (every token reaches its
    top-k experts; an expert's load is what the router gives it)."""
    pp_compression: str = checked(Str(PP_COMPRESSION), "none")
    """Compressed backpropagation between pipeline stages (``PP_COMPRESSION``): the activation
    gradient [b, s, h] a stage sends backwards goes as a rank-``pp_compression_rank`` product
    P Q^T (one power iteration, warm-started from the previous Q); the residual is added to the
    next gradient the chunk sends (lazy error propagation): the next micro-batch's, and after a
    step's last compressed send the next step's first (with the epilogue mode, always). Lossy: it
    changes the numerics."""
    pp_compression_rank: int = checked(Int(1, 1 << 16), 16)
    """Rank r of the pipeline-gradient factors: n x m -> (n + m) x r values."""
    dp_compression_stages: int = checked(Int(0, 1 << 16), 0)
    """PowerSGD with error feedback on the data-parallel gradients of pipeline ranks
    0 .. k-1 (those whose gradients are final last, so whose reduction the pipeline cannot
    hide); 0: none. Only ZeRO-0/1's all-reduce is compressed. Lossy."""
    dp_compression_rank: int = checked(Int(1, 1 << 16), 128)
    """PowerSGD's rank on the data-parallel gradients (a matrix is compressed only where its
    factors are less than half of it, as torch's ``powerSGD_hook`` decides)."""
    recompute_modules: tuple = checked(List(Str(RECOMPUTE_MODULES), max_len=len(RECOMPUTE_MODULES)), ())
    """With recompute="selective": what is recomputed (``RECOMPUTE_MODULES``; Megatron-LM's
    ``--recompute-modules``). Empty: the attention core alone, as every framework's selective
    recomputation does. Megatron-LM only."""
    fused_embedding_sync: bool = checked(Bool(), False)
    """Tied embeddings under pp: sum the embedding gradient over the first and last stage and over
    the data-parallel replicas in one all-reduce, instead of a first/last all-reduce then the
    data-parallel one."""
    expert_tp: int | None = checked(Null(_DEGREE), None)
    """How many ways each routed expert is split (Megatron's ``--expert-tensor-parallel-size``).
    None: the framework's own (Megatron-LM: tp; torchtitan and the reference trainer: whole
    experts on every tp rank). 1 with tp > 1: whole experts, and the expert-parallel group folded
    over the tp x cp x dp ranks of a stage (Megatron-Core's MoE parallel folding; every
    Megatron-Bridge MoE recipe sets it): ep divides tp x dp x cp and may span tensor-parallel
    ranks (:func:`expert_span`)."""

    def __post_init__(self):
        if isinstance(self.recompute_modules, list):  # a JSON-style list reads as the tuple it means
            object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules))

    @property
    def degrees(self) -> Degrees:
        """The parallel degrees and rank order, with their ranks and groups (``space.degrees``):
        the arithmetic the cost model and the trainer share."""
        return Degrees(self.dp, self.pp, self.tp, self.rank_order, cp=self.cp, ep=self.ep,
                       expert_fold=folds_experts(self))

    @property
    def modules_label(self) -> str:
        """The recompute modules as labels show them after the recomputation mode: "(a,b)", or ""."""
        return "(" + ",".join(self.recompute_modules) + ")" if self.recompute_modules else ""

    @property
    def compressed(self) -> bool:
        """Whether any communication is lossy (pipeline or data-parallel gradient compression)."""
        return self.pp_compression != "none" or self.dp_compression_stages > 0

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch_size * self.num_micro_batches

    @property
    def num_chunks(self) -> int:
        """Pipeline chunks in total: pp x v."""
        return self.pp * self.virtual_stages

    def short(self) -> str:
        s = f"dp{self.dp} pp{self.pp} tp{self.tp}"
        if self.cp > 1:
            s += f" cp{self.cp}"
        s += f" mbs{self.micro_batch_size} m{self.num_micro_batches} {self.schedule}"
        if self.virtual_stages > 1:
            s += f" v{self.virtual_stages}"
        if self.layered_grad_accum and self.schedule != "breadth_first":
            s += " layered"
        if self.zero_stage:
            s += f" zero{self.zero_stage}"
        if self.recompute != "none":
            s += f" rc-{self.recompute}"
        s += self.modules_label
        if self.sequence_parallel:
            s += " sp"
        if self.dp_all_reduce != "flat":
            s += " hier-ar"
        if self.ep > 1:
            s += f" ep{self.ep}"
        if self.moe_dispatcher != "alltoall":
            s += f" {self.moe_dispatcher}"
        if self.expert_tp is not None and self.ep > 1:
            s += f" etp{self.expert_tp}"
        if self.moe_capacity_factor is not None:
            s += f" cf{self.moe_capacity_factor:g}"
        if self.precision == "fp8":
            s += f" fp8-{self.fp8_recipe}"
        elif self.precision == "tf32":
            s += " tf32"
        if self.pp_compression != "none":
            s += f" ppc-{self.pp_compression}{self.pp_compression_rank}"
        if self.dp_compression_stages:
            s += f" dpc{self.dp_compression_stages}r{self.dp_compression_rank}"
        if self.fused_embedding_sync:
            s += " fused-emb"
        for knob, tag in (("overlap_grad_reduce", "ogr"), ("overlap_param_gather", "opg"), ("tp_comm_overlap", "tpo"),
                          ("ep_comm_overlap", "epo"), ("torch_compile", "compile")):
            v = getattr(self, knob)
            if v is not None:
                s += f" {tag}" if v else f" no-{tag}"
        if self.stage_layers is not None:
            s += " layers " + ("/".join(map(str, self.stage_layers)) if len(self.stage_layers) <= 16 else "uneven")
        if self.device_order is not None:
            s += " placed"
        return s

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if self.precision != "fp8":
            del d["fp8_recipe"]
        for k, default in {**COMPRESSION_FIELDS, **DEFAULTED_FIELDS}.items():
            if d[k] == default:
                del d[k]
        for k in PLACEMENT_FIELDS:
            if d[k] is None:
                del d[k]
            else:
                d[k] = list(d[k])
        if "recompute_modules" in d:
            d["recompute_modules"] = list(d["recompute_modules"])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ParallelConfig":
        """From :meth:`to_dict`'s form, checked against ``CONFIG_SCHEMA`` (exact types, known keys)."""
        try:
            d = CONFIG_SCHEMA(d)
        except UserError as e:
            raise UserError(f"config: {e}") from None
        for k in PLACEMENT_FIELDS + ("recompute_modules",):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        return cls(**d)


CONFIG_SCHEMA = schema_of(
    ParallelConfig, "a parallel configuration",
    # the order messages have always listed the keys in (device_order, stage_layers follow)
    order=("cp", "precision", "fp8_recipe", "torch_compile", "ep", "moe_capacity_factor", "schedule", "virtual_stages",
           "layered_grad_accum", "zero_stage", "recompute", "sequence_parallel", "rank_order", "overlap_grad_reduce",
           "overlap_param_gather", "tp_comm_overlap", "ep_comm_overlap", "moe_dispatcher", "expert_tp",
           "recompute_modules", "dp_all_reduce", "pp_compression", "pp_compression_rank", "dp_compression_stages",
           "dp_compression_rank", "fused_embedding_sync"))
DEFAULTED_FIELDS = defaults_of(ParallelConfig, ("moe_dispatcher", "ep_comm_overlap", "recompute_modules", "expert_tp"))
"""Written by :meth:`ParallelConfig.to_dict` only when not the default (later fields: earlier
documents read as before)."""
COMPRESSION_FIELDS = defaults_of(ParallelConfig, ("pp_compression", "pp_compression_rank", "dp_compression_stages",
                                                  "dp_compression_rank", "fused_embedding_sync"))
"""Lossy communication and its defaults: written by :meth:`ParallelConfig.to_dict` only when not
the default, so documents without compression read as before."""


layers_per_chunk = even_layers
"""Split layers as evenly as possible over chunks (``placement.even_layers``)."""


def expert_span(c) -> int:
    """The ranks of a stage the expert-parallel groups are cut from: dp x cp, or tp x dp x cp
    where :func:`folds_experts`."""
    return (c.tp if folds_experts(c) else 1) * c.dp * c.cp


def expert_dp(c) -> int:
    """Ranks holding the same experts (they reduce the experts' gradients together)."""
    return expert_span(c) // c.ep


def check(config: ParallelConfig, model: ModelSpec) -> str | None:
    """The reason this configuration is invalid for the model, or None if it is valid."""
    c = config
    for name in ("dp", "pp", "tp", "cp", "ep", "micro_batch_size", "num_micro_batches", "virtual_stages"):
        v = getattr(c, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return f"{name}={v!r} must be a positive integer"
    if c.schedule not in SCHEDULES:
        return f"schedule={c.schedule!r}; valid: {', '.join(SCHEDULES)}"
    if c.recompute not in RECOMPUTE:
        return f"recompute={c.recompute!r}; valid: {', '.join(RECOMPUTE)}"
    if c.zero_stage not in (0, 1, 2, 3):
        return f"zero_stage={c.zero_stage!r}; valid: 0, 1, 2, 3"
    if c.recompute_modules:
        why = recompute_modules_reason(c, model)
        if why:
            return why
    why = order_reason(c.rank_order)
    if why:
        return why
    if c.precision not in PRECISIONS:
        return f"precision={c.precision!r}; valid: {', '.join(PRECISIONS)}"
    if c.fp8_recipe not in FP8_RECIPES:
        return f"fp8_recipe={c.fp8_recipe!r}; valid: {', '.join(FP8_RECIPES)}"
    why = tf32_reason(c, model) or expert_group_reason(c, model)
    if why:
        return why
    cf = c.moe_capacity_factor
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not 0 < cf <= 64):
        return f"moe_capacity_factor={cf!r} must be a number above 0 and at most 64, or absent (dropless)"
    if c.cp > 1 and model.seq_length % (2 * c.cp):
        return (f"cp({c.cp}): seq_length({model.seq_length}) must be divisible by 2 x cp = {2 * c.cp} "
                "(the load-balanced causal split gives each rank two of 2 x cp chunks)")
    if model.num_attention_heads % c.tp:
        return f"tp({c.tp}) does not divide num_attention_heads({model.num_attention_heads})"
    if model.num_kv_heads % c.tp:
        return f"tp({c.tp}) does not divide num_kv_heads({model.num_kv_heads})"
    if model.ffn_hidden_size % c.tp:
        return f"tp({c.tp}) does not divide ffn_hidden_size({model.ffn_hidden_size})"
    if c.sequence_parallel and c.tp == 1:
        return "sequence_parallel needs tp > 1"
    if c.sequence_parallel and (model.seq_length // c.cp) % c.tp:
        return (f"sequence_parallel: tp({c.tp}) does not divide seq_length({model.seq_length})"
                + (f" / cp({c.cp}) = {model.seq_length // c.cp}" if c.cp > 1 else ""))
    if c.pp == 1 and (c.schedule != "1f1b" or c.virtual_stages != 1):
        return f"pp=1 has no pipeline: schedule={c.schedule!r} v={c.virtual_stages} must be 1f1b with v=1"
    if c.schedule in ("gpipe", "1f1b") and c.virtual_stages != 1:
        return f"schedule {c.schedule} has one chunk per device; virtual_stages={c.virtual_stages} must be 1"
    if c.schedule == "interleaved":
        if c.virtual_stages < 2:
            return f"interleaved needs virtual_stages >= 2, got {c.virtual_stages}"
        if c.num_micro_batches % c.pp:
            return f"interleaved: pp({c.pp}) does not divide num_micro_batches({c.num_micro_batches})"
    if c.schedule == "breadth_first" and not c.layered_grad_accum:
        return "breadth_first is layered by definition: set layered_grad_accum"
    if c.layered_grad_accum and c.pp > 1 and c.schedule not in ("gpipe", "breadth_first"):
        return f"layered_grad_accum runs every micro-batch through a chunk before the next; schedule {c.schedule} interleaves them (use gpipe or breadth_first)"
    if c.num_chunks > model.num_layers:
        return f"pp({c.pp}) x virtual_stages({c.virtual_stages}) = {c.num_chunks} chunks exceeds num_layers({model.num_layers})"
    if c.zero_stage and c.dp * c.cp == 1:
        return f"zero_stage={c.zero_stage} with dp=1 shards nothing"
    if c.layered_grad_accum and c.num_micro_batches == 1:
        return "layered_grad_accum with one micro-batch is plain accumulation"
    for knob in ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "ep_comm_overlap", "torch_compile"):
        v = getattr(c, knob)
        if v is not None and not isinstance(v, bool):
            return f"{knob}={v!r} must be true, false or absent (the framework's default)"
    if c.dp_all_reduce not in DP_ALL_REDUCE:
        return f"dp_all_reduce={c.dp_all_reduce!r}; valid: {', '.join(DP_ALL_REDUCE)}"
    if c.dp_all_reduce == "hierarchical" and c.dp == 1:
        return "dp_all_reduce=hierarchical with dp=1 reduces nothing"
    if c.dp_all_reduce == "hierarchical" and c.zero_stage >= 2:
        return (f"dp_all_reduce=hierarchical is ZeRO-0/1's all-reduce; zero_stage={c.zero_stage} has none "
                "(it reduces each gradient to its owner's shard): use flat")
    why = compression_reason(c, model)
    if why:
        return why
    if c.tp_comm_overlap and not c.sequence_parallel:
        return "tp_comm_overlap needs sequence_parallel (it overlaps the all-gather / reduce-scatter pairs)"
    if c.moe_dispatcher not in MOE_DISPATCHERS:
        return f"moe_dispatcher={c.moe_dispatcher!r}; valid: {', '.join(MOE_DISPATCHERS)}"
    if c.moe_dispatcher != "alltoall" and c.ep == 1:
        return f"moe_dispatcher={c.moe_dispatcher} dispatches tokens to other expert-parallel ranks: it needs ep > 1"
    if c.moe_dispatcher == "deepep" and c.tp > 1 and not folds_experts(c):
        return (f"moe_dispatcher=deepep with tp={c.tp}: autoconf prices DeepEP over the expert-parallel group "
                "alone (Megatron's flex dispatcher spans expert-tp x ep); valid: tp 1, expert_tp 1 (the group "
                "folded over tp), or moe_dispatcher alltoall")
    if c.ep_comm_overlap:
        why = ep_overlap_reason(c, model)
        if why:
            return why
    if c.device_order is not None or c.stage_layers is not None:
        return check_placement(c.device_order, c.stage_layers, c.world_size, c.num_chunks, model.num_layers)
    return None


def tf32_reason(c: ParallelConfig, model: ModelSpec) -> str | None:
    """Why precision tf32 cannot be (a model that is not fp32), or None."""
    if c.precision == "tf32" and model.dtype != "fp32":
        return (f"precision tf32 runs an fp32 model's matmuls on TF32 tensor cores; model {model.name} is "
                f"{model.dtype}: use precision bf16 (or fp8), or an fp32 model")
    return None


def expert_group_reason(c: ParallelConfig, model: ModelSpec) -> str | None:
    """Why the expert-parallel degree and the experts' split cannot be, or None."""
    if c.ep > 1 and not model.is_moe:
        return f"ep({c.ep}) splits experts: model {model.name} has none (num_experts = 0)"
    if c.expert_tp not in (None, 1, c.tp):
        return f"expert_tp={c.expert_tp}: each expert is split over tp ({c.tp}) ranks or none (1)"
    if c.ep > 1 and folds_experts(c) and expert_span(c) % c.ep:
        return (f"ep({c.ep}) must divide tp x dp x cp ({c.tp} x {c.dp} x {c.cp} = {expert_span(c)}): with "
                "expert_tp 1 the expert group is folded over them")
    if c.ep > 1 and (c.dp * c.cp) % c.ep and not folds_experts(c):
        return (f"ep({c.ep}) must divide dp x cp ({c.dp} x {c.cp} = {c.dp * c.cp}): the expert group lies inside them"
                + ("; or fold it over tp too with expert_tp 1 (Megatron)" if (c.tp * c.dp * c.cp) % c.ep == 0 else ""))
    if c.ep > 1 and model.num_experts % c.ep:
        return f"ep({c.ep}) does not divide num_experts({model.num_experts})"
    return None


def recomputed_modules(c: ParallelConfig) -> frozenset:
    """What the configuration's recomputation re-runs, by ``RECOMPUTE_MODULES`` name: with
    recompute="selective" its ``recompute_modules`` (the attention core alone when empty); nothing
    otherwise (full recomputation re-runs whole blocks)."""
    if c.recompute != "selective":
        return frozenset()
    return frozenset(c.recompute_modules or ("core_attn",))


def module_key(c: ParallelConfig) -> tuple:
    """What selective recomputation recomputes beyond the default, as a cache key: () for the
    attention core alone (``recompute_modules`` empty or ("core_attn",)) and for no selective
    recomputation, else the sorted modules."""
    mods = recomputed_modules(c)
    return () if mods <= {"core_attn"} else tuple(sorted(mods))


def recompute_modules_reason(c: ParallelConfig, model: ModelSpec) -> str | None:
    """Why ``recompute_modules`` cannot be set so for this model, or None. A module the model does
    not have would recompute nothing: refused, as Megatron-LM refuses moe_act without grouped experts
    and mla_up_proj without MLA; the norms of a block with neither experts nor MLA are fused into
    the linear that reads them (Transformer Engine's LayerNormLinear), so layernorm finds none."""
    mods = c.recompute_modules
    if not isinstance(mods, tuple) or any(m not in RECOMPUTE_MODULES for m in mods):
        return f"recompute_modules={list(mods) if isinstance(mods, tuple) else mods!r}; valid: names among " + \
            ", ".join(RECOMPUTE_MODULES)
    if len(set(mods)) != len(mods):
        return f"recompute_modules={list(mods)} names a module twice"
    if c.recompute != "selective":
        return (f"recompute_modules={list(mods)} with recompute={c.recompute}: the modules are what selective "
                "recomputation recomputes (set recompute to selective, or leave recompute_modules empty)")
    if "moe_act" in mods and not model.is_moe:
        return f"recompute_modules: moe_act recomputes the experts' activation; model {model.name} has no experts"
    if "mla_up_proj" in mods and not model.is_mla:
        return (f"recompute_modules: mla_up_proj recomputes multi-head latent attention's up-projections; "
                f"model {model.name} has no MLA (kv_lora_rank is null)")
    if "layernorm" in mods and not (model.is_moe or model.is_mla):
        return (f"recompute_modules: layernorm finds no separate norm in model {model.name}: each norm is fused "
                "into the linear layer that reads it (valid with experts or MLA)")
    return None


def ep_overlap_reason(c: ParallelConfig, model: ModelSpec | None = None) -> str | None:
    """Why the all-to-all overlap (``ep_comm_overlap``) cannot run with this configuration, or None
    (Megatron-Core's own checks: expert parallelism, no full recomputation, virtual stages when
    pipelining, a 16-bit model: not checked without ``model``)."""
    if c.ep == 1:
        return "ep_comm_overlap overlaps expert-parallel all-to-alls: it needs ep > 1"
    if c.recompute == "full":
        return "ep_comm_overlap runs forward and backward layer by layer: it cannot run with recompute=full"
    if c.pp > 1 and (c.schedule != "interleaved" or c.virtual_stages < 2):
        return (f"ep_comm_overlap with pp={c.pp} pairs micro-batches in the interleaved schedule: "
                f"schedule {c.schedule} with virtual_stages={c.virtual_stages} has none (use interleaved, 2+ stages)")
    if model is not None and model.dtype == "fp32":
        return "ep_comm_overlap needs a 16-bit model (bf16 or fp16); this model is fp32"
    return None


def compression_reason(c: ParallelConfig, model: ModelSpec) -> str | None:
    """Why the compression fields do not apply to this configuration, or None."""
    if c.pp_compression not in PP_COMPRESSION:
        return f"pp_compression={c.pp_compression!r}; valid: {', '.join(PP_COMPRESSION)}"
    for name in ("pp_compression_rank", "dp_compression_rank"):
        v = getattr(c, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return f"{name}={v!r} must be a positive integer"
    k = c.dp_compression_stages
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= c.pp:
        return f"dp_compression_stages={k!r} must be an integer from 0 to pp ({c.pp})"
    if c.pp_compression != "none" and c.pp == 1:
        return f"pp_compression={c.pp_compression!r} compresses pipeline sends: pp=1 has none"
    if k:
        if c.dp * c.cp == 1:
            return f"dp_compression_stages={k} with dp=1 has no data-parallel reduction to compress"
        if c.zero_stage >= 2:
            return (f"dp_compression_stages={k} compresses ZeRO-0/1's all-reduce; zero_stage={c.zero_stage} "
                    "reduce-scatters (use zero_stage 0 or 1)")
        if c.dp_all_reduce != "flat":
            return f"dp_compression_stages={k} replaces the all-reduce: dp_all_reduce must be flat"
        if c.ep > 1:
            return f"dp_compression_stages={k} with ep={c.ep}: expert gradients are not compressed (use ep 1)"
    if not isinstance(c.fused_embedding_sync, bool):
        return f"fused_embedding_sync={c.fused_embedding_sync!r} must be true or false"
    if c.fused_embedding_sync and not (model.tied_embeddings and c.pp > 1):
        return "fused_embedding_sync needs tied embeddings split over pp > 1 stages (nothing to fuse otherwise)"
    return None


def reason_key(reason: str) -> str:
    """A short category for a rejection reason (for the search's counts); most specific first."""
    for needle, key in (("does not divide num_micro_batches", "interleaved needs m divisible by pp"),
                        ("does not divide num_", "tp does not divide the model"),
                        ("does not divide ffn", "tp does not divide the model"),
                        ("sequence_parallel", "sequence parallel indivisible"),
                        ("exceeds num_layers", "more chunks than layers"),
                        ("load-balanced causal split", "cp does not divide the sequence"),
                        ("the expert group lies inside", "ep does not divide dp x cp"),
                        ("does not divide num_experts", "ep does not divide the experts"),
                        ("with dp=1 shards nothing", "zero with dp=1"),
                        ("dp_all_reduce=", "hierarchical all-reduce inapplicable"),
                        ("one micro-batch", "layered with one micro-batch")):
        if needle in reason:
            return key
    return reason.split(":")[0][:60]


def validate(config: ParallelConfig, model: ModelSpec) -> None:
    reason = check(config, model)
    if reason:
        raise UserError(f"invalid configuration ({config.short()}): {reason}")
