"""ModelSpec: a decoder-only transformer, and where it comes from (presets, YAML, HF config.json).

Parameter counts and per-token FLOPs are derived here, from the shapes alone, so every other stage
(cost model, profiler, trainer) agrees on them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from .errors import UserError
from .schema import Bool, Dict, Int, List, Null, Num, Str, check_kind, parse_json, parse_yaml, read_text

ACTIVATIONS = ("gelu", "swiglu", "geglu")
GATED_ACTIVATIONS = ("swiglu", "geglu")
DTYPES = ("bf16", "fp16", "fp32")
NORMS = ("layernorm", "rmsnorm")
POSITION_EMBEDDINGS = ("learned", "rope")
ATTENTIONS = ("flash", "eager")

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# Shape limits: generous for any real model (Llama-3-405B: 126 layers, h=16384, V=128256), small
# enough that no count, table or simulation built from them runs out of memory.
LIMITS = {"num_layers": (1, 4096), "hidden_size": (1, 1 << 18), "num_attention_heads": (1, 1 << 14),
          "num_kv_heads": (1, 1 << 14), "ffn_hidden_size": (1, 1 << 20), "vocab_size": (1, 1 << 24),
          "seq_length": (1, 1 << 22)}
HEAD_DIM_LIMITS = (1, 1 << 14)
LORA_RANK_LIMITS = (1, 1 << 20)
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")

# Fields added after the first model documents (presets, YAML files, profiles, trial documents): their
# defaults are the block every earlier document described, and to_dict leaves them out at their
# defaults, so that those documents (and the search's cache signatures) are unchanged.
LATER_FIELDS = {"head_dim": None, "qkv_bias": False, "parallel_attention": False, "shared_norm": False,
                "rotary_fraction": 1.0, "num_experts": 0, "experts_per_token": 0, "expert_ffn_hidden_size": None,
                "num_shared_experts": 0, "shared_expert_ffn_hidden_size": None, "first_dense_layers": 0,
                "moe_layer_freq": 1, "router": "softmax", "router_bias": False, "shared_expert_gate": False,
                "qk_norm": False, "q_lora_rank": None, "kv_lora_rank": None, "qk_rope_head_dim": None,
                "qk_nope_head_dim": None, "v_head_dim": None, "sliding_window": None, "full_attention_every": 0,
                "attention_sinks": False, "router_groups": 0, "router_group_topk": 0}
ROUTERS = ("softmax", "sigmoid")
"""How a mixture-of-experts layer scores its experts: softmax over the experts, then the top k
(Mixtral, Qwen-MoE, GPT-OSS), or a sigmoid per expert, top k, renormalised (DeepSeek-V3)."""

MODEL_SCHEMA = Dict(
    required={k: Int(lo, hi) for k, (lo, hi) in LIMITS.items()},
    optional={"activation": Str(ACTIVATIONS), "tied_embeddings": Bool(), "dtype": Str(DTYPES),
              "norm": Str(NORMS), "position_embedding": Str(POSITION_EMBEDDINGS), "bias": Bool(),
              "dropout": Num(0.0, 1.0, hi_open=True), "attention": Str(ATTENTIONS),
              "head_dim": Null(Int(*HEAD_DIM_LIMITS)), "qkv_bias": Bool(), "parallel_attention": Bool(),
              "shared_norm": Bool(), "rotary_fraction": Num(0.0, 1.0, lo_open=True), "name": Str(max_len=200),
              "num_experts": Int(0, 1 << 14), "experts_per_token": Int(0, 1 << 10),
              "expert_ffn_hidden_size": Null(Int(1, 1 << 20)), "num_shared_experts": Int(0, 1 << 10),
              "shared_expert_ffn_hidden_size": Null(Int(1, 1 << 20)), "first_dense_layers": Int(0, 4096),
              "moe_layer_freq": Int(1, 4096), "router": Str(ROUTERS), "router_bias": Bool(),
              "shared_expert_gate": Bool(), "qk_norm": Bool(), "q_lora_rank": Null(Int(*LORA_RANK_LIMITS)),
              "kv_lora_rank": Null(Int(*LORA_RANK_LIMITS)), "qk_rope_head_dim": Null(Int(*HEAD_DIM_LIMITS)),
              "qk_nope_head_dim": Null(Int(*HEAD_DIM_LIMITS)), "v_head_dim": Null(Int(*HEAD_DIM_LIMITS)),
              "sliding_window": Null(Int(*LIMITS["seq_length"])), "full_attention_every": Int(0, 4096),
              "attention_sinks": Bool(), "router_groups": Int(0, 1 << 14), "router_group_topk": Int(0, 1 << 14)},
    what="a model")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, described by its shapes."""

    num_layers: int
    """Transformer blocks."""
    hidden_size: int
    """Width of the residual stream, h."""
    num_attention_heads: int
    """Query heads, a."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention when fewer than the query heads)."""
    ffn_hidden_size: int
    """Inner width of the MLP, f (per branch for the gated SwiGLU / GeGLU)."""
    vocab_size: int
    """Vocabulary size, V."""
    seq_length: int
    """Training sequence length, s."""
    activation: str = "gelu"
    """'gelu' (two-matrix MLP: fc2(gelu(fc1 x))), or gated with three matrices, down(act(gate x) * up x):
    'swiglu' (act = SiLU: Llama, Mistral, Qwen2) or 'geglu' (act = GELU: Gemma)."""
    tied_embeddings: bool = False
    """Whether the output layer reuses the input embedding matrix."""
    dtype: str = "bf16"
    """Training precision of parameters and activations: bf16, fp16 (mixed precision) or fp32."""
    norm: str = "layernorm"
    """'layernorm' (weight and bias) or 'rmsnorm' (weight only)."""
    position_embedding: str = "learned"
    """'learned' (a seq_length x hidden table) or 'rope' (no parameters)."""
    bias: bool = False
    """Whether every linear layer of a block carries a bias (GPT-2/3, GPT-NeoX do, Llama does not)."""
    dropout: float = 0.0
    """Dropout probability on attention probabilities and block outputs (0 disables it)."""
    attention: str = "flash"
    """'flash' (fused attention, no s x s tensors kept) or 'eager' (explicit softmax, as in
    Megatron-LM's unfused path and Korthikanti et al.)."""
    head_dim: int | None = None
    """Width of one attention head, when it is not hidden_size / num_attention_heads (Gemma-7B: 16
    heads of 256 on a 3072-wide stream). Q is then num_attention_heads x head_dim wide and the
    attention's output projection maps that back to hidden_size. None: hidden_size / heads
    (see :attr:`head_size` for the width in use)."""
    qkv_bias: bool = False
    """Biases on the Q, K and V projections only (Qwen2); implied by ``bias``."""
    parallel_attention: bool = False
    """Attention and MLP both read the block's input and are added to it together,
    x + attn(norm1(x)) + mlp(norm2(x)) (GPT-J, GPT-NeoX's use_parallel_residual, Falcon's
    parallel_attn), instead of the sequential x + attn(norm1(x)), then + mlp(norm2(.))."""
    shared_norm: bool = False
    """With ``parallel_attention``: one norm feeds both, x + attn(norm(x)) + mlp(norm(x)) (Falcon-7B)."""
    rotary_fraction: float = 1.0
    """Share of each head's dimensions that the rotary embedding rotates (GPT-NeoX's rotary_pct,
    0.25); the others pass through. Rotated: int(head_size x rotary_fraction), even, at least 2."""
    num_experts: int = 0
    """Routed experts of each mixture-of-experts layer (0: a dense model)."""
    experts_per_token: int = 0
    """Experts each token is routed to, the top k."""
    expert_ffn_hidden_size: int | None = None
    """Inner width of one expert's MLP (gated like ``activation``); None: ``ffn_hidden_size``."""
    num_shared_experts: int = 0
    """Experts every token goes through besides its routed ones (DeepSeek, Qwen2-MoE)."""
    shared_expert_ffn_hidden_size: int | None = None
    """Inner width of one shared expert; None: ``expert_ffn_hidden_size``."""
    first_dense_layers: int = 0
    """The first k blocks are dense, with an MLP of ``ffn_hidden_size`` (DeepSeek-V3: 3)."""
    moe_layer_freq: int = 1
    """After the dense ones, every n-th block is a mixture of experts (the others dense)."""
    router: str = "softmax"
    """'softmax' or 'sigmoid' scoring (``ROUTERS``); the router is an h x E matrix."""
    router_bias: bool = False
    """The router carries E more parameters per mixture-of-experts block: a bias on its logits (GPT-OSS)
    or DeepSeek-V3's e_score_correction_bias (added to the scores for the top-k choice only)."""
    router_groups: int = 0
    """Group-limited routing (DeepSeek-V3's ``n_group``; Megatron-LM's ``--moe-router-num-groups``):
    the experts form this many equal groups, and each token picks its top-k experts inside its
    ``router_group_topk`` best groups (a group's score: the sum of its top k / router_group_topk
    expert scores). 0: no groups. With a group per host the routing is node-limited: a token's
    experts lie on at most router_group_topk hosts, which a deduplicating dispatcher exploits
    (``cost.moe``)."""
    router_group_topk: int = 0
    """Groups each token may route to (DeepSeek-V3's ``topk_group``: 4 of 8)."""

    @property
    def group_limited(self) -> bool:
        """Whether group-limited routing limits anything (more than one group, not all allowed)."""
        return self.router_groups > 1 and self.router_group_topk < self.router_groups
    shared_expert_gate: bool = False
    """Each mixture-of-experts block scales its shared experts' output by sigmoid(x . g), g an h-vector
    (Qwen2-MoE's shared_expert_gate): h parameters, counted in :meth:`shared_expert_params`."""
    qk_norm: bool = False
    """A norm of one head's width on each query head and each key head (Qwen3): 2 x head_size weights
    per block (twice that for LayerNorm), counted in :meth:`attention_params`."""
    q_lora_rank: int | None = None
    """Multi-head latent attention (DeepSeek-V2/V3; set with ``kv_lora_rank``): queries go through a
    low-rank h -> q_lora_rank projection, a norm and q_lora_rank -> heads x (nope + rope). None: one
    h -> heads x (nope + rope) projection."""
    kv_lora_rank: int | None = None
    """Multi-head latent attention: width of the compressed key/value latent (h -> kv_lora_rank + rope,
    a norm, then kv_lora_rank -> heads x (nope + v)). None: standard attention. With it set, the
    three head widths below are required, num_kv_heads equals num_attention_heads, and :attr:`head_size`
    is qk_nope_head_dim + qk_rope_head_dim."""
    qk_rope_head_dim: int | None = None
    """MLA: the rotary part of each query/key head (the key's is shared by all heads)."""
    qk_nope_head_dim: int | None = None
    """MLA: the part of each query/key head without positions."""
    v_head_dim: int | None = None
    """MLA: width of each value head (and of each head of the attention's output)."""
    sliding_window: int | None = None
    """Windowed blocks attend to the last ``sliding_window`` positions only (GPT-OSS: 128). None: every
    block attends to the whole sequence. Which blocks are windowed: ``full_attention_every``."""
    full_attention_every: int = 0
    """With ``sliding_window``: every n-th block (blocks n-1, 2n-1, ... 0-based) attends to the whole
    sequence, the others are windowed (GPT-OSS alternates: 2). 0: every block is windowed."""
    attention_sinks: bool = False
    """One learned logit per query head and block that joins each softmax (GPT-OSS's sinks):
    num_attention_heads parameters per block."""
    name: str = "custom"
    """A label for tables and files."""

    def __post_init__(self) -> None:
        self.validate()

    # -- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        for field, (lo, hi) in LIMITS.items():
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise UserError(f"model {self.name}: {field}={v!r} must be a positive integer")
            if not lo <= v <= hi:
                raise UserError(f"model {self.name}: {field}={v!r} is out of range; expected {lo} to {hi}")
        hd = self.head_dim
        if hd is not None and (isinstance(hd, bool) or not isinstance(hd, int)
                               or not HEAD_DIM_LIMITS[0] <= hd <= HEAD_DIM_LIMITS[1]):
            raise UserError(f"model {self.name}: head_dim={hd!r} must be null or an integer in "
                            f"[{HEAD_DIM_LIMITS[0]}, {HEAD_DIM_LIMITS[1]}]")
        if hd is None and self.kv_lora_rank is None and self.hidden_size % self.num_attention_heads:
            raise UserError(f"model {self.name}: hidden_size({self.hidden_size}) is not divisible by "
                            f"num_attention_heads({self.num_attention_heads}) (set head_dim for heads of "
                            "another width)")
        if self.num_attention_heads % self.num_kv_heads:
            raise UserError(f"model {self.name}: num_attention_heads({self.num_attention_heads}) is not "
                            f"divisible by num_kv_heads({self.num_kv_heads})")
        for field, allowed in (("activation", ACTIVATIONS), ("dtype", DTYPES), ("norm", NORMS),
                               ("position_embedding", POSITION_EMBEDDINGS), ("attention", ATTENTIONS)):
            if getattr(self, field) not in allowed:
                raise UserError(f"model {self.name}: {field}={getattr(self, field)!r}; "
                                f"valid: {', '.join(allowed)}")
        for field in ("tied_embeddings", "bias", "qkv_bias", "parallel_attention", "shared_norm", "router_bias",
                      "shared_expert_gate", "qk_norm", "attention_sinks"):
            if not isinstance(getattr(self, field), bool):
                raise UserError(f"model {self.name}: {field}={getattr(self, field)!r} must be true or false")
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not (0.0 <= d < 1.0):
            raise UserError(f"model {self.name}: dropout={d!r} must be a number in [0, 1)")
        if self.shared_norm and not self.parallel_attention:
            raise UserError(f"model {self.name}: shared_norm=true needs parallel_attention=true (a sequential "
                            "block's second norm reads the attention's output)")
        self._validate_moe()
        self._validate_attention()
        r = self.rotary_fraction
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not (0.0 < r <= 1.0):
            raise UserError(f"model {self.name}: rotary_fraction={r!r} must be a number in (0, 1]")
        if r != 1.0 and self.position_embedding != "rope":
            raise UserError(f"model {self.name}: rotary_fraction={r!r} needs position_embedding 'rope' "
                            f"(it is {self.position_embedding!r}); valid: 1.0")
        if self.position_embedding == "rope" and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise UserError(f"model {self.name}: rotary_fraction={r!r} rotates {self.rotary_dim} of the "
                            f"{self.head_size} dimensions of a head; valid: an even count of at least 2")

    def _validate_moe(self) -> None:
        e, k = self.num_experts, self.experts_per_token
        for field in ("num_experts", "experts_per_token", "num_shared_experts", "first_dense_layers",
                      "moe_layer_freq"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if field == "moe_layer_freq" else 0):
                raise UserError(f"model {self.name}: {field}={v!r} must be a "
                                f"{'positive' if field == 'moe_layer_freq' else 'non-negative'} integer")
        for field in ("expert_ffn_hidden_size", "shared_expert_ffn_hidden_size"):
            v = getattr(self, field)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise UserError(f"model {self.name}: {field}={v!r} must be null or a positive integer")
        if self.router not in ROUTERS:
            raise UserError(f"model {self.name}: router={self.router!r}; valid: {', '.join(ROUTERS)}")
        if e == 0:
            if k or self.num_shared_experts or self.expert_ffn_hidden_size or self.first_dense_layers:
                raise UserError(f"model {self.name}: experts_per_token, num_shared_experts, expert_ffn_hidden_size "
                                "and first_dense_layers describe a mixture of experts: set num_experts too")
            if self.router_bias:
                raise UserError(f"model {self.name}: router_bias=true needs a router: set num_experts too; "
                                "valid: false")
        for field in ("router_groups", "router_group_topk"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise UserError(f"model {self.name}: {field}={v!r} must be a non-negative integer")
        if (self.router_groups or self.router_group_topk) and e == 0:
            raise UserError(f"model {self.name}: router_groups and router_group_topk group a router's experts: set "
                            "num_experts too; valid: 0")
        if self.shared_expert_gate and not self.num_shared_experts:
            raise UserError(f"model {self.name}: shared_expert_gate=true gates shared experts: set "
                            "num_shared_experts too; valid: false")
        if e == 0:
            return
        if not 1 <= k <= e:
            raise UserError(f"model {self.name}: experts_per_token={k} must be in 1..num_experts ({e})")
        if self.first_dense_layers >= self.num_layers:
            raise UserError(f"model {self.name}: first_dense_layers={self.first_dense_layers} leaves no "
                            f"mixture-of-experts block of {self.num_layers}")
        g, gk = self.router_groups, self.router_group_topk
        if g or gk:
            if not g or e % g:
                raise UserError(f"model {self.name}: router_groups={g} must divide num_experts ({e}) into equal "
                                "groups (0: no groups)")
            if not 1 <= gk <= min(g, k):
                raise UserError(f"model {self.name}: router_group_topk={gk} must be in 1..{min(g, k)} (at most "
                                "router_groups and experts_per_token)")
            if not groups_hold_experts(e, k, g, gk):
                raise UserError(f"model {self.name}: router_groups={g} of {e // g} experts: a group is scored by its "
                                f"top {k // gk} and {gk} groups must hold the {k} experts per token; valid: fewer "
                                "groups or a larger router_group_topk")

    def _validate_attention(self) -> None:
        """Multi-head latent attention, Q/K norms, sliding windows and sinks."""
        for field in MLA_FIELDS:
            v = getattr(self, field)
            lo, hi = LORA_RANK_LIMITS if field.endswith("rank") else HEAD_DIM_LIMITS
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
                raise UserError(f"model {self.name}: {field}={v!r} must be null or an integer in [{lo}, {hi}]")
        if self.kv_lora_rank is None:
            for field in MLA_FIELDS:
                if getattr(self, field) is not None:
                    raise UserError(f"model {self.name}: {field}={getattr(self, field)!r} describes multi-head "
                                    "latent attention: set kv_lora_rank too (or leave it null)")
        else:
            for field in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
                if getattr(self, field) is None:
                    raise UserError(f"model {self.name}: {field}=null; multi-head latent attention (kv_lora_rank="
                                    f"{self.kv_lora_rank}) needs it: a positive integer")
            for field, ok, valid in (("head_dim", self.head_dim is None, "null (MLA heads are qk_nope_head_dim + "
                                      "qk_rope_head_dim wide)"),
                                     ("num_kv_heads", self.num_kv_heads == self.num_attention_heads,
                                      f"num_attention_heads ({self.num_attention_heads})"),
                                     ("bias", not self.bias, "false"), ("qkv_bias", not self.qkv_bias, "false"),
                                     ("qk_norm", not self.qk_norm, "false"),
                                     ("position_embedding", self.position_embedding == "rope", "'rope'"),
                                     ("rotary_fraction", self.rotary_fraction == 1.0,
                                      "1.0 (qk_rope_head_dim sets the rotary part)")):
                if not ok:
                    raise UserError(f"model {self.name}: {field}={getattr(self, field)!r} with multi-head latent "
                                    f"attention (kv_lora_rank={self.kv_lora_rank}); valid: {valid}")
        w, n = self.sliding_window, self.full_attention_every
        lo, hi = LIMITS["seq_length"]
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or not lo <= w <= hi):
            raise UserError(f"model {self.name}: sliding_window={w!r} must be null or an integer in [{lo}, {hi}]")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise UserError(f"model {self.name}: full_attention_every={n!r} must be a non-negative integer")
        if n and w is None:
            raise UserError(f"model {self.name}: full_attention_every={n} picks the full-attention blocks among "
                            "windowed ones: set sliding_window too; valid: 0")

    # -- mixture of experts -------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """Whether block ``i`` (0-based) is a mixture of experts."""
        return (self.is_moe and i >= self.first_dense_layers
                and (i - self.first_dense_layers) % self.moe_layer_freq == 0)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def expert_ffn(self) -> int:
        """Inner width of one routed expert."""
        return self.expert_ffn_hidden_size or self.ffn_hidden_size

    @property
    def shared_expert_ffn(self) -> int:
        """Inner width of one shared expert."""
        return self.shared_expert_ffn_hidden_size or self.expert_ffn

    def expert_params(self) -> int:
        """Parameters of one routed expert (its gated or two-matrix MLP, biases with ``bias``)."""
        h, f = self.hidden_size, self.expert_ffn
        return self.mlp_matrices * h * f + (((self.mlp_matrices - 1) * f + h) if self.bias else 0)

    def shared_expert_params(self) -> int:
        h, f = self.hidden_size, self.shared_expert_ffn
        return self.num_shared_experts * (self.mlp_matrices * h * f + (((self.mlp_matrices - 1) * f + h)
                                                                        if self.bias else 0)) + \
            (h if self.shared_expert_gate else 0)

    def router_params(self) -> int:
        """The h x E router, and its E biases with ``router_bias``."""
        return self.hidden_size * self.num_experts + (self.num_experts if self.router_bias else 0)

    # -- derived shapes -----------------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (``kv_lora_rank`` set)."""
        return self.kv_lora_rank is not None

    @property
    def head_size(self) -> int:
        """Width of one attention head as the scores see it (Q and K): ``head_dim``, or hidden_size /
        num_attention_heads; with multi-head latent attention qk_nope_head_dim + qk_rope_head_dim."""
        if self.kv_lora_rank is not None:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def q_size(self) -> int:
        """Width of Q as the attention core sees it: num_attention_heads x head_size (hidden_size unless
        ``head_dim`` or MLA says otherwise). Without MLA also the width of the attention's output
        (:attr:`attn_out_size`)."""
        return self.num_attention_heads * self.head_size

    @property
    def kv_size(self) -> int:
        """Width of K (and, without MLA, of V): num_kv_heads x head_size. With MLA the core's K is
        heads x (nope + rope) wide and V heads x v_head_dim: use :attr:`k_size` and :attr:`v_size` where
        K and V are priced apart (2 x kv_size is k_size + v_size only without MLA)."""
        return self.num_kv_heads * self.head_size

    @property
    def k_size(self) -> int:
        """Width of K as the attention core sees it (= :attr:`kv_size`)."""
        return self.kv_size

    @property
    def v_size(self) -> int:
        """Width of V as the attention core sees it: :attr:`kv_size`, or with MLA heads x v_head_dim."""
        return self.num_attention_heads * self.v_head_dim if self.kv_lora_rank is not None else self.kv_size

    @property
    def attn_out_size(self) -> int:
        """Width of the attention core's output, the input of the output projection: :attr:`q_size`, or
        with MLA heads x v_head_dim."""
        return self.num_attention_heads * self.v_head_dim if self.kv_lora_rank is not None else self.q_size

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head the rotary embedding rotates (0 without rope), as Hugging Face
        computes them: int(head_size x rotary_fraction); with MLA qk_rope_head_dim."""
        if self.position_embedding != "rope":
            return 0
        if self.kv_lora_rank is not None:
            return self.qk_rope_head_dim
        return int(self.head_size * self.rotary_fraction)

    def is_windowed_layer(self, i: int) -> bool:
        """Whether block ``i`` (0-based) attends to the last ``sliding_window`` positions only."""
        if self.sliding_window is None:
            return False
        n = self.full_attention_every
        return n == 0 or (i + 1) % n != 0

    @property
    def num_windowed_layers(self) -> int:
        return sum(self.is_windowed_layer(i) for i in range(self.num_layers))

    def attention_span(self, i: int | None = None) -> int:
        """Keys each query of block ``i`` attends to, as the FLOPs count them: the sequence, or
        min(sequence, window) in a windowed block. None: a full-attention block."""
        if i is not None and self.is_windowed_layer(i):
            return min(self.seq_length, self.sliding_window)
        return self.seq_length

    @property
    def gated_mlp(self) -> bool:
        return self.activation in GATED_ACTIVATIONS

    @property
    def norms_per_block(self) -> int:
        return 1 if self.shared_norm else 2

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    # -- parameter counts ---------------------------------------------------------------------
    def norm_params(self) -> int:
        return 2 * self.hidden_size if self.norm == "layernorm" else self.hidden_size

    def _norm_of(self, width: int) -> int:
        return 2 * width if self.norm == "layernorm" else width

    def attention_matmul_params(self) -> int:
        """Weights of one block's attention projections (no biases, norms or sinks): the matrices
        each token multiplies by, 2 FLOPs per weight.

        Without MLA: h x (q + 2 kv) + q x h. With MLA (DeepSeek-V2/V3): queries h x q_lora_rank +
        q_lora_rank x heads x (nope + rope), or h x heads x (nope + rope) without q_lora_rank; keys
        and values h x (kv_lora_rank + rope) + kv_lora_rank x heads x (nope + v); output heads x v x h.
        """
        h = self.hidden_size
        if self.kv_lora_rank is None:
            q, kv = self.q_size, self.kv_size
            return h * (q + 2 * kv) + q * h
        a, qk, r, v = self.num_attention_heads, self.head_size, self.kv_lora_rank, self.v_head_dim
        ql = self.q_lora_rank
        q = h * a * qk if ql is None else h * ql + ql * a * qk
        return q + h * (r + self.qk_rope_head_dim) + r * a * (self.qk_nope_head_dim + v) + a * v * h

    def attention_params(self) -> int:
        """Parameters of one block's attention: projections and their biases; with MLA the norms of
        its latents; with ``qk_norm`` the Q and K head norms; with ``attention_sinks`` a logit per head."""
        h, q, kv = self.hidden_size, self.q_size, self.kv_size
        if self.kv_lora_rank is not None:
            attn = self.attention_matmul_params() + self._norm_of(self.kv_lora_rank) + \
                (self._norm_of(self.q_lora_rank) if self.q_lora_rank is not None else 0)
        else:
            attn = h * (q + 2 * kv) + q * h
            if self.bias:
                attn += (q + 2 * kv) + h
            elif self.qkv_bias:
                attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * self._norm_of(self.head_size)
        if self.attention_sinks:
            attn += self.num_attention_heads
        return attn

    def layer_params(self, i: int | None = None) -> int:
        """Parameters of block ``i`` (None: a dense block, the shape of every block of a dense model).
        A mixture-of-experts block holds its router, every routed expert and the shared ones."""
        h, f = self.hidden_size, self.ffn_hidden_size
        norms = self.norms_per_block * self.norm_params()
        if i is not None and self.is_moe_layer(i):
            return (self.attention_params() + self.router_params() + self.num_experts * self.expert_params()
                    + self.shared_expert_params() + norms)
        mlp = self.mlp_matrices * h * f + (((self.mlp_matrices - 1) * f + h) if self.bias else 0)
        return self.attention_params() + mlp + norms

    def active_layer_params(self, i: int | None = None) -> int:
        """Parameters of block ``i`` one token goes through (its top-k experts, not all of them)."""
        if i is None or not self.is_moe_layer(i):
            return self.layer_params(i)
        return (self.attention_params() + self.router_params() + self.experts_per_token * self.expert_params()
                + self.shared_expert_params() + self.norms_per_block * self.norm_params())

    def blocks_params(self) -> int:
        """Parameters of all blocks."""
        if not self.is_moe:
            return self.num_layers * self.layer_params()
        return sum(self.layer_params(i) for i in range(self.num_layers))

    def active_params(self) -> int:
        """Parameters one token goes through (a dense model: all of them)."""
        blocks = sum(self.active_layer_params(i) for i in range(self.num_layers)) if self.is_moe else \
            self.num_layers * self.layer_params()
        return self.embedding_params() + blocks + self.output_params()

    def embedding_params(self) -> int:
        pos = self.seq_length * self.hidden_size if self.position_embedding == "learned" else 0
        return self.vocab_size * self.hidden_size + pos

    def output_params(self) -> int:
        """Final norm plus, if untied, the output projection."""
        return self.norm_params() + (0 if self.tied_embeddings else self.vocab_size * self.hidden_size)

    def num_params(self) -> int:
        """Total parameters (every expert of a mixture of experts; see :meth:`active_params`)."""
        return self.embedding_params() + self.blocks_params() + self.output_params()

    # -- FLOPs ----------------------------------------------------------------------------------
    def layer_forward_flops_per_token(self, i: int | None = None) -> float:
        """Matrix-multiply FLOPs of one dense block's forward, per token (2 per multiply-add).

        Attention scores and weighted sum count 2*s*q each (q = heads x head width, h unless
        ``head_dim`` says otherwise), without exploiting causality, as in Narayanan et al. (arXiv
        2104.04473, eq. 3) so that MFU matches published numbers. In a windowed block (``i`` given,
        see :meth:`is_windowed_layer`) s is min(s, sliding_window); None: a full-attention block.
        With MLA the projections are :meth:`attention_matmul_params` and the core
        :meth:`attention_core_flops`.
        """
        h, f, q, kv = self.hidden_size, self.ffn_hidden_size, self.q_size, self.kv_size
        s = self.attention_span(i)
        if self.kv_lora_rank is not None:
            return 2.0 * (self.attention_matmul_params() + self.mlp_matrices * h * f) + self.attention_core_flops(i)
        return 2.0 * (h * (q + 2 * kv) + q * h + self.mlp_matrices * h * f) + 4.0 * s * q

    def attention_core_flops(self, i: int | None = None) -> float:
        """Forward FLOPs per token of block ``i``'s attention core (None: a full-attention block):
        scores 2 x span x q_size and the weighted sum 2 x span x attn_out_size, span the sequence or
        min(sequence, window) in a windowed block (:meth:`attention_span`); 4 x span x q without MLA."""
        s = self.attention_span(i)
        if self.kv_lora_rank is not None:
            return 2.0 * s * (self.q_size + self.attn_out_size)
        return 4.0 * s * self.q_size

    def moe_layer_forward_flops_per_token(self, i: int | None = None) -> float:
        """A mixture-of-experts block's forward FLOPs per token: attention, the router, its top-k
        experts and the shared ones (active work only), and the shared experts' gate. ``i``: the
        block, for its attention span (None: a full-attention block)."""
        h, q, kv, s = self.hidden_size, self.q_size, self.kv_size, self.attention_span(i)
        experts = (self.experts_per_token * self.expert_ffn + self.num_shared_experts * self.shared_expert_ffn)
        gate = h if self.shared_expert_gate else 0
        if self.kv_lora_rank is not None:
            return (2.0 * (self.attention_matmul_params() + self.mlp_matrices * h * experts + h * self.num_experts
                           + gate) + self.attention_core_flops(i))
        return (2.0 * (h * (q + 2 * kv) + q * h + self.mlp_matrices * h * experts + h * self.num_experts + gate)
                + 4.0 * s * q)

    def model_flops_per_token(self) -> float:
        """Forward + backward model FLOPs per token (no recomputation): 3x the forward; a mixture of
        experts counts the active experts only.

        For GPT shapes this is 72*l*h^2*(1 + s/6h + V/12hl) per token (arXiv 2104.04473).
        """
        if self.sliding_window is not None:  # block by block: windowed blocks attend to fewer keys
            blocks = sum(self.moe_layer_forward_flops_per_token(i) if self.is_moe_layer(i)
                         else self.layer_forward_flops_per_token(i) for i in range(self.num_layers))
            return 3.0 * (blocks + 2.0 * self.vocab_size * self.hidden_size)
        moe = self.num_moe_layers
        fwd = ((self.num_layers - moe) * self.layer_forward_flops_per_token()
               + moe * (self.moe_layer_forward_flops_per_token() if moe else 0.0)
               + 2.0 * self.vocab_size * self.hidden_size)
        return 3.0 * fwd

    # -- (de)serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Every field, except those of :data:`LATER_FIELDS` that hold their default."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if not (k in LATER_FIELDS and v == LATER_FIELDS[k])}

    @classmethod
    def from_dict(cls, d: dict, name: str | None = None) -> "ModelSpec":
        """Build from a mapping checked against :data:`MODEL_SCHEMA` (exact types, ranges, known keys)."""
        label = name or (d.get("name") if isinstance(d, dict) and isinstance(d.get("name"), str) else "custom")
        label = label if len(label) <= 60 else label[:57] + "..."
        try:
            kwargs = MODEL_SCHEMA(d)
        except UserError as e:
            raise UserError(f"model {label}: {e}") from None
        if name is not None:
            kwargs["name"] = name
        return cls(**kwargs)


@lru_cache(maxsize=1)
def _presets() -> dict:
    text = resources.files("autoconf").joinpath("data/models.json").read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def preset_names() -> list[str]:
    return list(_presets())


def preset(name: str) -> ModelSpec:
    presets = _presets()
    if name not in presets:
        raise UserError(f"unknown model preset {name!r}; valid: {', '.join(presets)} "
                        "(or a path to a .yaml/.json file)")
    return ModelSpec.from_dict(presets[name], name=name)


_HF_GELU = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python", "gelu_accurate", "quick_gelu")
_HF_SILU = ("silu", "swish", "swiglu")
_HF_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_HF_INT = Null(Int(1, 1 << 24))
# The keys read from a Hugging Face config, with their exact types. A config.json holds many more
# (architectures, rope_scaling, token ids...), so other keys pass, except near-misses of these.
HF_KEYS = {
    **{k: _HF_INT for k in ("hidden_size", "n_embd", "d_model", "num_attention_heads", "n_head",
                             "num_hidden_layers", "n_layer", "num_layers", "num_key_value_heads", "n_head_kv",
                             "num_kv_heads", "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size",
                             "vocab_size", "max_position_embeddings", "n_positions", "n_ctx", "seq_length",
                             "head_dim", "sliding_window", "num_ln_in_parallel_attn")},
    **{k: Null(Int(0, 1 << 24)) for k in ("num_local_experts", "num_experts", "n_routed_experts",
                                           "num_experts_per_tok", "experts_per_token", "n_shared_experts",
                                           "shared_expert_intermediate_size", "first_k_dense_replace",
                                           "num_nextn_predict_layers")},
    **{k: _HF_INT for k in ("moe_intermediate_size", "decoder_sparse_step", "moe_layer_freq", "q_lora_rank",
                             "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")},
    "mlp_only_layers": Null(List(Int(0, 1 << 24), max_len=1 << 16)),
    "layer_types": Null(List(Str(max_len=100), max_len=1 << 16)), "scoring_func": Null(Str(max_len=100)),
    "qkv_bias": Null(Bool()),
    **{k: Null(Str(max_len=100)) for k in ("hidden_act", "hidden_activation", "activation_function", "activation",
                                           "model_type")},
    **{k: Null(Bool()) for k in ("tie_word_embeddings", "attention_bias", "mlp_bias", "bias", "alibi",
                                 "multi_query", "parallel_attn", "new_decoder_architecture", "use_parallel_residual",
                                 "use_sliding_window", "apply_residual_connection_post_layernorm",
                                 "is_encoder_decoder")},
    **{k: Null(Num(0.0, 1.0, lo_open=True)) for k in ("rotary_pct", "partial_rotary_factor")},
    "torch_dtype": Null(Str(_HF_DTYPE)), "dtype": Null(Str(_HF_DTYPE)),
}

# model_type -> family. Llama, Mistral, Qwen2 and Gemma (and any model_type not listed here) are read
# as Llama-like: RMSNorm, rotary positions, a gated MLP, sequential pre-norm blocks.
HF_FAMILIES = {"gpt2": "gpt2", "gpt_bigcode": "gpt2", "gpt_neox": "gpt_neox",
               "falcon": "falcon", "RefinedWeb": "falcon", "RefinedWebModel": "falcon"}
_FAMILY_NAMES = {"llama": "Llama-like", "gpt2": "GPT-2", "gpt_neox": "GPT-NeoX", "falcon": "Falcon"}
HF_SUPPORTED = ("llama, mistral, qwen2, qwen3, gemma, gpt2, gpt_bigcode, gpt_neox, falcon, mixtral, qwen2_moe, "
                "qwen3_moe, deepseek_v3, gpt_oss (or another Llama-like model_type)")
# Mixture-of-experts model_types read (each with its own keys); experts in any other type are refused.
HF_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")
# model_types (substrings) with state-space (Mamba) layers beside or instead of attention: refused.
HF_STATE_SPACE = ("mamba", "jamba", "nemotron_h", "zamba", "bamba", "falcon_h1", "granitemoehybrid")
HF_LAYER_TYPES = ("full_attention", "sliding_attention")
# model_types that look Llama-like enough to load but are not: refused rather than mispriced.
HF_REFUSED = {
    "gptj": "its MLP has biases but its attention has none, and its output layer has a bias",
    "opt": "its learned positions have 2 extra rows and its MLP is ReLU",
    "bloom": "ALiBi attention biases are not modelled", "mpt": "ALiBi attention biases are not modelled",
    "gemma2": "its blocks have four norms and soft-capped logits",
    "gemma3": "its blocks have four norms and Q/K norms", "gemma3_text": "its blocks have four norms and Q/K norms",
    "phi": "its output layer has a bias",
    "stablelm": "its norms are LayerNorms, with optional Q/K norms",
    "starcoder2": "its MLP is not gated and its norms are LayerNorms",
}


def _check_hf(cfg: dict, name: str) -> None:
    import difflib

    for k, v in cfg.items():
        if not isinstance(k, str):
            raise UserError(f"model {name}: config.json key {k!r} is not a string")
        if k in HF_KEYS:
            try:
                HF_KEYS[k](v, k)
            except UserError as e:
                raise UserError(f"model {name}: {e}") from None
            continue
        close = difflib.get_close_matches(k, list(HF_KEYS), n=1, cutoff=0.88)
        if close:
            raise UserError(f"model {name}: unknown key {k!r} in config.json (did you mean {close[0]!r}?)")


def from_hf_config(cfg: dict, name: str = "hf", seq_length: int | None = None) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (as a dict) without importing transformers.

    Families (``model_type``): Llama, Mistral, Qwen2 (biases on Q, K, V), Gemma (GeGLU, explicit
    ``head_dim``, tied embeddings), any other Llama-like type; GPT-2 and GPT-BigCode (multi-query);
    GPT-NeoX / Pythia (parallel residual, partial rotary ``rotary_pct``, untied); Falcon (multi-query or
    ``num_kv_heads`` with ``new_decoder_architecture``, ``parallel_attn`` with one or two norms,
    ``bias``). Mixtures of experts: Mixtral, Qwen2-MoE (one shared expert with a sigmoid gate,
    ``decoder_sparse_step`` / ``mlp_only_layers``), Qwen3-MoE (and dense Qwen3: per-head Q/K norms),
    DeepSeek-V3 (multi-head latent attention, sigmoid scores with e_score_correction_bias,
    ``first_k_dense_replace`` / ``moe_layer_freq``; the multi-token-prediction module of
    ``num_nextn_predict_layers`` is left out, as in the published 671B), GPT-OSS (biases everywhere,
    a router bias, attention sinks, ``sliding_window`` in the ``layer_types`` marked so). Absent keys
    take the defaults of the family's transformers config class.

    The training sequence is ``seq_length`` when given, else ``max_position_embeddings`` (Falcon
    without it: 2048). Except for GPT-OSS, whose windows are a field of the spec, a model with a
    ``sliding_window`` shorter than that trains at the window: the sliding-window attention is then the
    full causal attention that autoconf models and builds, and a longer ``seq_length`` is refused.
    Experts in other model types, hybrid state-space layers (Mamba, Jamba, Nemotron-H...), ALiBi and
    encoder-decoder configs are refused. The keys read are type-checked (:data:`HF_KEYS`); near-misses
    of them are refused.
    """
    if not isinstance(cfg, dict):
        raise UserError(f"model {name}: a config.json must hold a JSON object")
    _check_hf(cfg, name)

    def get(key, default=None):
        return cfg[key] if cfg.get(key) is not None else default

    def pick(*keys, default=None):
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        if default is None:
            raise UserError(f"model {name}: config.json lacks {' / '.join(keys)} (model_type "
                            f"{model_type or '(absent)'}, read as {_FAMILY_NAMES[family]})")
        return default

    def refuse(key, why, valid):
        raise UserError(f"model {name}: {key}={json.dumps(cfg.get(key))}: {why}; valid: {valid}")

    model_type = cfg.get("model_type") or ""
    family = HF_FAMILIES.get(model_type, "llama")
    if model_type in HF_REFUSED:
        refuse("model_type", f"{model_type} is not supported ({HF_REFUSED[model_type]})", HF_SUPPORTED)
    if get("is_encoder_decoder"):
        refuse("is_encoder_decoder", "encoder-decoder models are not modelled (decoder-only transformers)", "false")
    if any(t in model_type.lower() for t in HF_STATE_SPACE):
        refuse("model_type", "hybrid state-space (Mamba) layers are out of scope (attention blocks only)",
               HF_SUPPORTED)
    for j, t in enumerate(get("layer_types", [])):
        if t not in HF_LAYER_TYPES:
            why = ("hybrid state-space (Mamba) layers are out of scope (attention blocks only)" if "mamba" in t
                   else "only attention blocks are modelled")
            raise UserError(f"model {name}: layer_types[{j}]={json.dumps(t)}: {why}; valid: "
                            f"{', '.join(HF_LAYER_TYPES)}")
    if model_type not in HF_MOE:
        for key in ("num_local_experts", "num_experts", "n_routed_experts"):
            if get(key, 0) > 1:
                refuse(key, f"mixture-of-experts layers are not modelled for model_type {model_type or '(absent)'}",
                       f"absent, 0 or 1 (experts are read for {', '.join(HF_MOE)})")
    if get("alibi"):
        refuse("alibi", "ALiBi attention biases are not modelled", "false (rotary positions)")
    if get("apply_residual_connection_post_layernorm"):
        refuse("apply_residual_connection_post_layernorm", "post-norm residuals are not modelled", "false")

    hidden = pick("hidden_size", "n_embd") if family in ("gpt2", "falcon") else pick("hidden_size")
    heads = pick("num_attention_heads", "n_head") if family in ("gpt2", "falcon") else pick("num_attention_heads")
    layers = pick("num_hidden_layers", "n_layer") if family in ("gpt2", "falcon") else pick("num_hidden_layers")
    spec = dict(name=name, hidden_size=hidden, num_attention_heads=heads, num_layers=layers,
                vocab_size=pick("vocab_size"), dtype=_HF_DTYPE[pick("torch_dtype", "dtype", default="bfloat16")])
    seq = None
    if family == "gpt2":
        act = get("activation_function", "gelu_new")
        if act not in _HF_GELU:
            refuse("activation_function", "a GPT-2 MLP is fc2(act(fc1 x))", ", ".join(_HF_GELU))
        mqa = model_type == "gpt_bigcode" and get("multi_query", True)
        spec.update(num_kv_heads=1 if mqa else heads, ffn_hidden_size=get("n_inner", 4 * hidden),
                    activation="gelu", tied_embeddings=get("tie_word_embeddings", True), norm="layernorm",
                    position_embedding="learned", bias=True)
        seq = pick("n_positions", "n_ctx", "max_position_embeddings")
    elif family == "gpt_neox":
        act = get("hidden_act", "gelu")
        if act not in _HF_GELU:
            refuse("hidden_act", "a GPT-NeoX MLP is fc2(act(fc1 x))", ", ".join(_HF_GELU))
        if get("attention_bias", True) is False:
            refuse("attention_bias", "a GPT-NeoX MLP keeps its biases; biases on the MLP alone are not modelled",
                   "true")
        spec.update(num_kv_heads=heads, ffn_hidden_size=pick("intermediate_size"), activation="gelu",
                    tied_embeddings=get("tie_word_embeddings", False), norm="layernorm", position_embedding="rope",
                    bias=True, parallel_attention=get("use_parallel_residual", True),
                    rotary_fraction=pick("rotary_pct", "partial_rotary_factor", default=0.25))
        seq = pick("max_position_embeddings")
    elif family == "falcon":
        act = get("activation", "gelu")
        if act not in _HF_GELU:
            refuse("activation", "a Falcon MLP is fc2(act(fc1 x))", ", ".join(_HF_GELU))
        new_arch = get("new_decoder_architecture", model_type == "RefinedWeb")
        if new_arch:
            kv = pick("num_kv_heads", "n_head_kv", default=heads)
        else:
            kv = 1 if get("multi_query", True) else heads
        parallel = bool(new_arch or get("parallel_attn", True))
        norms = get("num_ln_in_parallel_attn", 2 if new_arch else 1) if parallel else 2
        if norms not in (1, 2):
            refuse("num_ln_in_parallel_attn", "a parallel block has one or two norms", "1, 2")
        spec.update(num_kv_heads=kv, ffn_hidden_size=get("ffn_hidden_size", 4 * hidden), activation="gelu",
                    tied_embeddings=get("tie_word_embeddings", True), norm="layernorm", position_embedding="rope",
                    bias=get("bias", False), parallel_attention=parallel, shared_norm=parallel and norms == 1)
        seq = get("max_position_embeddings", 2048)
    else:
        gemma = model_type == "gemma"
        act_key = "hidden_activation" if gemma and get("hidden_activation") else "hidden_act"
        act = get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
        activation = "swiglu" if act in _HF_SILU else "geglu" if act in _HF_GELU else None
        if activation is None:
            refuse(act_key, "the gated MLP down(act(gate x) * up x) is modelled with SiLU or GELU",
                   ", ".join(_HF_SILU + _HF_GELU))
        head_dim = get("head_dim")
        if head_dim is not None and not (hidden % heads == 0 and head_dim == hidden // heads):
            spec["head_dim"] = head_dim
        attn_bias = get("attention_bias", model_type == "gpt_oss")
        mlp_bias = get("mlp_bias", attn_bias if model_type == "gpt_oss" else False)
        if attn_bias != mlp_bias:
            refuse("attention_bias" if attn_bias else "mlp_bias",
                   "biases on the attention or on the MLP alone are not modelled", "attention_bias and mlp_bias "
                   "both false, or both true")
        qkv_bias = (model_type == "qwen2" or (model_type == "qwen2_moe" and get("qkv_bias", True))) and not attn_bias
        spec.update(num_kv_heads=pick("num_key_value_heads", default=heads), ffn_hidden_size=pick("intermediate_size"),
                    activation=activation, tied_embeddings=get("tie_word_embeddings", gemma), norm="rmsnorm",
                    position_embedding="rope", bias=attn_bias, qkv_bias=qkv_bias,
                    rotary_fraction=get("partial_rotary_factor", 1.0), qk_norm=model_type in ("qwen3", "qwen3_moe"))
        if model_type in HF_MOE:
            spec.update(_hf_moe(cfg, model_type, layers, get, pick, refuse))
        seq = pick("max_position_embeddings")
    if model_type == "gpt_oss":  # sliding windows in alternate blocks: a field of the spec, not a bound on s
        spec.update(_hf_windows(get("sliding_window", 128), get("layer_types"), layers, refuse))
        window = None
    else:
        window = get("sliding_window") if get("use_sliding_window", True) else None
    if seq_length is not None:
        if window is not None and seq_length > window:
            raise UserError(f"model {name}: sequence length {seq_length} exceeds sliding_window={window}: "
                            f"sliding-window attention is not modelled; valid: a sequence length up to {window}")
        seq = seq_length
    elif window is not None:
        seq = min(seq, window)
    # through the model schema: the same ranges as a model file (an expert count of 1e7 is refused)
    return ModelSpec.from_dict({**spec, "seq_length": seq})


def _fit_moe_layers(moe: list[bool], key: str, refuse) -> dict:
    """first_dense_layers and moe_layer_freq that mark exactly the blocks ``moe`` marks."""
    idx = [i for i, m in enumerate(moe) if m]
    if not idx:
        refuse(key, "no block is a mixture of experts", "a layout with at least one mixture-of-experts block")
    first = idx[0]
    freq = idx[1] - idx[0] if len(idx) > 1 else 1
    if any(m != (i >= first and (i - first) % freq == 0) for i, m in enumerate(moe)):
        refuse(key, "the mixture-of-experts blocks are not every n-th block after the first dense ones",
               "a leading run of dense blocks, then a mixture of experts every n-th block")
    return dict(first_dense_layers=first, moe_layer_freq=freq)


def groups_hold_experts(experts: int, k: int, groups: int, group_topk: int) -> bool:
    """Whether ``groups`` equal groups of ``experts``, ``group_topk`` allowed per token, can be
    scored (each group has its top k / group_topk) and hold a token's ``k`` experts."""
    per = experts // groups
    return per >= k // group_topk and group_topk * per >= k


def _hf_moe(cfg: dict, model_type: str, layers: int, get, pick, refuse) -> dict:
    """The mixture-of-experts fields of a Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 or GPT-OSS config,
    with the defaults of transformers' config classes."""
    if model_type in ("mixtral", "gpt_oss"):
        experts = pick("num_local_experts", default=8 if model_type == "mixtral" else 128)
        k = pick("num_experts_per_tok", "experts_per_token", default=2 if model_type == "mixtral" else 4)
        # every block; the experts' inner width is intermediate_size (ffn_hidden_size)
        return dict(num_experts=experts, experts_per_token=k, router_bias=model_type == "gpt_oss",
                    attention_sinks=model_type == "gpt_oss")
    if model_type in ("qwen2_moe", "qwen3_moe"):
        qwen2 = model_type == "qwen2_moe"
        experts = pick("num_experts", default=60 if qwen2 else 128)
        k = pick("num_experts_per_tok", default=4 if qwen2 else 8)
        step = get("decoder_sparse_step", 1)
        dense = set(get("mlp_only_layers", []))
        # transformers: block i is sparse when i is not in mlp_only_layers and (i + 1) % step == 0
        fit = _fit_moe_layers([i not in dense and (i + 1) % step == 0 for i in range(layers)],
                              "mlp_only_layers" if dense else "decoder_sparse_step", refuse)
        out = dict(num_experts=experts, experts_per_token=k,
                   expert_ffn_hidden_size=pick("moe_intermediate_size", default=1408 if qwen2 else 768), **fit)
        shared = get("shared_expert_intermediate_size", 5632) if qwen2 else 0
        if shared:  # one shared expert, scaled by sigmoid(x . g)
            out.update(num_shared_experts=1, shared_expert_ffn_hidden_size=shared, shared_expert_gate=True)
        return out
    # deepseek_v3: multi-head latent attention; sigmoid scores with a correction bias (selection only).
    # The multi-token-prediction module (num_nextn_predict_layers) is not part of the model counted.
    scoring = get("scoring_func", "sigmoid")
    if scoring not in ROUTERS:
        refuse("scoring_func", "routers score experts with a softmax or a sigmoid", ", ".join(ROUTERS))
    freq, first_k = get("moe_layer_freq", 1), get("first_k_dense_replace", 3)
    # transformers: block i is sparse when i >= first_k_dense_replace and i % moe_layer_freq == 0
    fit = _fit_moe_layers([i >= first_k and i % freq == 0 for i in range(layers)], "first_k_dense_replace", refuse)
    shared = get("n_shared_experts", 1)
    # group-limited routing: transformers' DeepseekV3Config defaults, 8 groups, the best 4; one
    # group, or every group allowed, limits nothing
    groups, allowed = get("n_group", 8), get("topk_group", 4)
    for key, v in (("n_group", groups), ("topk_group", allowed)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            refuse(key, "group-limited routing counts groups", "a positive integer")
    if groups > 1 and allowed < groups:
        experts, k = get("n_routed_experts", 256), get("num_experts_per_tok", 8)
        if experts % groups or not groups_hold_experts(experts, k, groups, allowed):
            refuse("n_group", f"{groups} groups of the {experts} experts, the best {allowed} per token, cannot "
                   f"hold its {k} experts", "a divisor of n_routed_experts leaving topk_group groups room for them")
    else:
        groups = allowed = 0
    out = dict(num_experts=pick("n_routed_experts", default=256), experts_per_token=pick("num_experts_per_tok",
                                                                                         default=8),
               expert_ffn_hidden_size=pick("moe_intermediate_size", default=2048), num_shared_experts=shared,
               router=scoring, router_bias=True, **fit,
               router_groups=groups, router_group_topk=allowed,
               # q_lora_rank null: one query projection (DeepSeek-V2-Lite); absent: transformers' 1536
               q_lora_rank=cfg["q_lora_rank"] if "q_lora_rank" in cfg else 1536,
               kv_lora_rank=pick("kv_lora_rank", default=512), qk_rope_head_dim=pick("qk_rope_head_dim", default=64),
               qk_nope_head_dim=pick("qk_nope_head_dim", default=128), v_head_dim=pick("v_head_dim", default=128))
    return out


def _hf_windows(window: int, layer_types, layers: int, refuse) -> dict:
    """sliding_window and full_attention_every from a window and a list of 'sliding_attention' /
    'full_attention' blocks (None: transformers' GPT-OSS default, alternating from a windowed one)."""
    if layer_types is None:
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if len(layer_types) != layers:
        refuse("layer_types", f"{len(layer_types)} entries for {layers} blocks", f"{layers} entries")
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    if not full:
        return dict(sliding_window=window, full_attention_every=0)
    if len(full) == layers:
        return {}
    n = full[0] + 1
    if any((t == "full_attention") != ((i + 1) % n == 0) for i, t in enumerate(layer_types)):
        refuse("layer_types", "the full-attention blocks are not every n-th block", "every n-th block full "
               "(blocks n-1, 2n-1, ...), the others sliding_attention")
    return dict(sliding_window=window, full_attention_every=n)


def load_model(ref: str, seq_length: int | None = None) -> ModelSpec:
    """A preset name, a YAML model file, or a Hugging Face config.json; optional seq override."""
    if not isinstance(ref, str) or not ref:
        raise UserError(f"--model {ref!r}: give a preset name or a model file")
    if os.path.exists(ref):
        spec = _load_model_file(ref, seq_length)
    elif ref.endswith((".yaml", ".yml", ".json")) or os.sep in ref:
        raise UserError(f"model file {ref!r} does not exist")
    else:
        spec = preset(ref)
    if seq_length is not None:
        spec = dataclasses.replace(spec, seq_length=seq_length)
    return spec


def _load_model_file(path: str, seq_length: int | None = None) -> ModelSpec:
    name = os.path.splitext(os.path.basename(path))[0][:200] or "custom"
    text = read_text(path, "model file")
    if path.endswith(".json"):
        data = parse_json(text, path, "model file", ("model", "hf"))
        if not isinstance(data, dict):
            raise UserError(f"model file {path!r} must hold a JSON object")
        check_kind(data, path, ("model", "hf"))
        if "num_layers" in data and "hidden_size" in data:
            return ModelSpec.from_dict({"name": name, **data})
        return from_hf_config(data, name=name, seq_length=seq_length)
    data = parse_yaml(text, path, "model file")
    if not isinstance(data, dict):
        raise UserError(f"model file {path!r} must hold a mapping of field names to values")
    check_kind(data, path, ("model",))
    return ModelSpec.from_dict({"name": name, **data})


def load_yaml(path: str, what: str = "file"):
    """A YAML file's data: size-bounded, text only, aliases bounded (see :mod:`autoconf.schema`)."""
    return parse_yaml(read_text(path, what), path, what)
