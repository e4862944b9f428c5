"""ModelSpec: a decoder-only transformer, and where it comes from (presets, YAML, HF config.json).

Parameter counts and per-token FLOPs are derived here, from the shapes alone, so every other stage
(cost model, profiler, trainer) agrees on them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from autoconf.errors import UserError
from autoconf.specs.schema import Bool, Int, Null, Num, Str, checked, defaults_of, schema_of

ACTIVATIONS = ("gelu", "swiglu", "geglu")
GATED_ACTIVATIONS = ("swiglu", "geglu")
DTYPES = ("bf16", "fp16", "fp32")
NORMS = ("layernorm", "rmsnorm")
POSITION_EMBEDDINGS = ("learned", "rope")
ATTENTIONS = ("flash", "eager")

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

HEAD_DIM_LIMITS = (1, 1 << 14)
LORA_RANK_LIMITS = (1, 1 << 20)
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
_SEQ = Int(1, 1 << 22)
ROUTERS = ("softmax", "sigmoid")
"""How a mixture-of-experts layer scores its experts: softmax over the experts, then the top k
(Mixtral, Qwen-MoE, GPT-OSS), or a sigmoid per expert, top k, renormalised (DeepSeek-V3)."""


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, described by its shapes."""

    num_layers: int = checked(Int(1, 4096))
    """Transformer blocks."""
    hidden_size: int = checked(Int(1, 1 << 18))
    """Width of the residual stream, h."""
    num_attention_heads: int = checked(Int(1, 1 << 14))
    """Query heads, a."""
    num_kv_heads: int = checked(Int(1, 1 << 14))
    """Key/value heads (grouped-query attention when fewer than the query heads)."""
    ffn_hidden_size: int = checked(Int(1, 1 << 20))
    """Inner width of the MLP, f (per branch for the gated SwiGLU / GeGLU)."""
    vocab_size: int = checked(Int(1, 1 << 24))
    """Vocabulary size, V."""
    seq_length: int = checked(_SEQ)
    """Training sequence length, s."""
    activation: str = checked(Str(ACTIVATIONS), "gelu")
    """'gelu' (two-matrix MLP: fc2(gelu(fc1 x))), or gated with three matrices, down(act(gate x) * up x):
    'swiglu' (act = SiLU: Llama, Mistral, Qwen2) or 'geglu' (act = GELU: Gemma)."""
    tied_embeddings: bool = checked(Bool(), False)
    """Whether the output layer reuses the input embedding matrix."""
    dtype: str = checked(Str(DTYPES), "bf16")
    """Training precision of parameters and activations: bf16, fp16 (mixed precision) or fp32."""
    norm: str = checked(Str(NORMS), "layernorm")
    """'layernorm' (weight and bias) or 'rmsnorm' (weight only)."""
    position_embedding: str = checked(Str(POSITION_EMBEDDINGS), "learned")
    """'learned' (a seq_length x hidden table) or 'rope' (no parameters)."""
    bias: bool = checked(Bool(), False)
    """Whether every linear layer of a block carries a bias (GPT-2/3, GPT-NeoX do, Llama does not)."""
    dropout: float = checked(Num(0.0, 1.0, hi_open=True), 0.0)
    """Dropout probability on attention probabilities and block outputs (0 disables it)."""
    attention: str = checked(Str(ATTENTIONS), "flash")
    """'flash' (fused attention, no s x s tensors kept) or 'eager' (explicit softmax, as in
    Megatron-LM's unfused path and Korthikanti et al.)."""
    head_dim: int | None = checked(Null(Int(*HEAD_DIM_LIMITS)), None)
    """Width of one attention head, when it is not hidden_size / num_attention_heads (Gemma-7B: 16
    heads of 256 on a 3072-wide stream). Q is then num_attention_heads x head_dim wide and the
    attention's output projection maps that back to hidden_size. None: hidden_size / heads
    (see :attr:`head_size` for the width in use)."""
    qkv_bias: bool = checked(Bool(), False)
    """Biases on the Q, K and V projections only (Qwen2); implied by ``bias``."""
    parallel_attention: bool = checked(Bool(), False)
    """Attention and MLP both read the block's input and are added to it together,
    x + attn(norm1(x)) + mlp(norm2(x)) (GPT-J, GPT-NeoX's use_parallel_residual, Falcon's
    parallel_attn), instead of the sequential x + attn(norm1(x)), then + mlp(norm2(.))."""
    shared_norm: bool = checked(Bool(), False)
    """With ``parallel_attention``: one norm feeds both, x + attn(norm(x)) + mlp(norm(x)) (Falcon-7B)."""
    rotary_fraction: float = checked(Num(0.0, 1.0, lo_open=True), 1.0)
    """Share of each head's dimensions that the rotary embedding rotates (GPT-NeoX's rotary_pct,
    0.25); the others pass through. Rotated: int(head_size x rotary_fraction), even, at least 2."""
    num_experts: int = checked(Int(0, 1 << 14), 0)
    """Routed experts of each mixture-of-experts layer (0: a dense model)."""
    experts_per_token: int = checked(Int(0, 1 << 10), 0)
    """Experts each token is routed to, the top k."""
    expert_ffn_hidden_size: int | None = checked(Null(Int(1, 1 << 20)), None)
    """Inner width of one expert's MLP (gated like ``activation``); None: ``ffn_hidden_size``."""
    num_shared_experts: int = checked(Int(0, 1 << 10), 0)
    """Experts every token goes through besides its routed ones (DeepSeek, Qwen2-MoE)."""
    shared_expert_ffn_hidden_size: int | None = checked(Null(Int(1, 1 << 20)), None)
    """Inner width of one shared expert; None: ``expert_ffn_hidden_size``."""
    first_dense_layers: int = checked(Int(0, 4096), 0)
    """The first k blocks are dense, with an MLP of ``ffn_hidden_size`` (DeepSeek-V3: 3)."""
    moe_layer_freq: int = checked(Int(1, 4096), 1)
    """After the dense ones, every n-th block is a mixture of experts (the others dense)."""
    router: str = checked(Str(ROUTERS), "softmax")
    """'softmax' or 'sigmoid' scoring (``ROUTERS``); the router is an h x E matrix."""
    router_bias: bool = checked(Bool(), False)
    """The router carries E more parameters per mixture-of-experts block: a bias on its logits (GPT-OSS)
    or DeepSeek-V3's e_score_correction_bias (added to the scores for the top-k choice only)."""
    router_groups: int = checked(Int(0, 1 << 14), 0)
    """Group-limited routing (DeepSeek-V3's ``n_group``; Megatron-LM's ``--moe-router-num-groups``):
    the experts form this many equal groups, and each token picks its top-k experts inside its
    ``router_group_topk`` best groups (a group's score: the sum of its top k / router_group_topk
    expert scores). 0: no groups. With a group per host the routing is node-limited: a token's
    experts lie on at most router_group_topk hosts, which a deduplicating dispatcher exploits
    (``cost.moe``)."""
    router_group_topk: int = checked(Int(0, 1 << 14), 0)
    """Groups each token may route to (DeepSeek-V3's ``topk_group``: 4 of 8)."""

    @property
    def group_limited(self) -> bool:
        """Whether group-limited routing limits anything (more than one group, not all allowed)."""
        return self.router_groups > 1 and self.router_group_topk < self.router_groups
    shared_expert_gate: bool = checked(Bool(), False)
    """Each mixture-of-experts block scales its shared experts' output by sigmoid(x . g), g an h-vector
    (Qwen2-MoE's shared_expert_gate): h parameters, counted in :meth:`shared_expert_params`."""
    qk_norm: bool = checked(Bool(), False)
    """A norm of one head's width on each query head and each key head (Qwen3): 2 x head_size weights
    per block (twice that for LayerNorm), counted in :meth:`attention_params`."""
    q_lora_rank: int | None = checked(Null(Int(*LORA_RANK_LIMITS)), None)
    """Multi-head latent attention (DeepSeek-V2/V3; set with ``kv_lora_rank``): queries go through a
    low-rank h -> q_lora_rank projection, a norm and q_lora_rank -> heads x (nope + rope). None: one
    h -> heads x (nope + rope) projection."""
    kv_lora_rank: int | None = checked(Null(Int(*LORA_RANK_LIMITS)), None)
    """Multi-head latent attention: width of the compressed key/value latent (h -> kv_lora_rank + rope,
    a norm, then kv_lora_rank -> heads x (nope + v)). None: standard attention. With it set, the
    three head widths below are required, num_kv_heads equals num_attention_heads, and :attr:`head_size`
    is qk_nope_head_dim + qk_rope_head_dim."""
    qk_rope_head_dim: int | None = checked(Null(Int(*HEAD_DIM_LIMITS)), None)
    """MLA: the rotary part of each query/key head (the key's is shared by all heads)."""
    qk_nope_head_dim: int | None = checked(Null(Int(*HEAD_DIM_LIMITS)), None)
    """MLA: the part of each query/key head without positions."""
    v_head_dim: int | None = checked(Null(Int(*HEAD_DIM_LIMITS)), None)
    """MLA: width of each value head (and of each head of the attention's output)."""
    sliding_window: int | None = checked(Null(_SEQ), None)
    """Windowed blocks attend to the last ``sliding_window`` positions only (GPT-OSS: 128). None: every
    block attends to the whole sequence. Which blocks are windowed: ``full_attention_every``."""
    full_attention_every: int = checked(Int(0, 4096), 0)
    """With ``sliding_window``: every n-th block (blocks n-1, 2n-1, ... 0-based) attends to the whole
    sequence, the others are windowed (GPT-OSS alternates: 2). 0: every block is windowed."""
    attention_sinks: bool = checked(Bool(), False)
    """One learned logit per query head and block that joins each softmax (GPT-OSS's sinks):
    num_attention_heads parameters per block."""
    name: str = checked(Str(max_len=200), "custom")
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


MODEL_SCHEMA = schema_of(
    ModelSpec, "a model",
    # the order messages have always listed the keys in (router_groups, router_group_topk follow)
    order=("activation", "tied_embeddings", "dtype", "norm", "position_embedding", "bias", "dropout", "attention",
           "head_dim", "qkv_bias", "parallel_attention", "shared_norm", "rotary_fraction", "name", "num_experts",
           "experts_per_token", "expert_ffn_hidden_size", "num_shared_experts", "shared_expert_ffn_hidden_size",
           "first_dense_layers", "moe_layer_freq", "router", "router_bias", "shared_expert_gate", "qk_norm",
           "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "sliding_window",
           "full_attention_every", "attention_sinks"))
LIMITS = {k: (spec.lo, spec.hi) for k, spec in MODEL_SCHEMA.required.items()}
"""Shape limits, the required fields' ranges (name -> (lo, hi)): generous for any real model
(Llama-3-405B: 126 layers, h=16384, V=128256), small enough that no count, table or simulation
built from them runs out of memory."""

# Fields added after the first model documents (presets, YAML files, profiles, trial documents): their
# defaults are the block every earlier document described, and to_dict leaves them out at their
# defaults, so that those documents (and the search's cache signatures) are unchanged.
LATER_FIELDS = defaults_of(ModelSpec, (
    "head_dim", "qkv_bias", "parallel_attention", "shared_norm", "rotary_fraction", "num_experts", "experts_per_token",
    "expert_ffn_hidden_size", "num_shared_experts", "shared_expert_ffn_hidden_size", "first_dense_layers",
    "moe_layer_freq", "router", "router_bias", "shared_expert_gate", "qk_norm", "q_lora_rank", "kv_lora_rank",
    "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "sliding_window", "full_attention_every",
    "attention_sinks", "router_groups", "router_group_topk"))


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



def groups_hold_experts(experts: int, k: int, groups: int, group_topk: int) -> bool:
    """Whether ``groups`` equal groups of ``experts``, ``group_topk`` allowed per token, can be
    scored (each group has its top k / group_topk) and hold a token's ``k`` experts."""
    per = experts // groups
    return per >= k // group_topk and group_topk * per >= k



