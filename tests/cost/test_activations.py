"""The activation-memory formula (pure): Korthikanti et al. closed forms, and its generalisations."""

import dataclasses
import subprocess
import sys

import pytest

from autoconf.cost.activations import (
    embedding_activation_bytes,
    embedding_activation_parts,
    head_activation_bytes,
    head_activation_parts,
    layer_activation_bytes,
)
from autoconf.specs.model import ModelSpec, preset

# The paper's block: eager attention, dropout, GeLU with f = 4h, multi-head, 16-bit, 1-byte masks.
PAPER_MODELS = [
    dataclasses.replace(preset("gpt3-175b"), attention="eager", dropout=0.1),
    dataclasses.replace(preset("gpt3-1.3b"), attention="eager", dropout=0.1),
    ModelSpec(num_layers=2, hidden_size=512, num_attention_heads=8, num_kv_heads=8, ffn_hidden_size=2048,
              vocab_size=1000, seq_length=256, attention="eager", dropout=0.1, dtype="fp16"),
]


def korthikanti(model: ModelSpec, b: int, t: int, sp: bool, recompute: str) -> float:
    """Section 4 and Table 2 of arXiv 2205.05198, bytes per layer per TP rank."""
    s, h, a = model.seq_length, model.hidden_size, model.num_attention_heads
    sbh = s * b * h
    attn = 5 * a * s / h
    if recompute == "full":
        return 2 * sbh / t if sp else 2 * sbh
    if recompute == "selective":
        attn = 0.0
    if sp:
        return sbh / t * (34 + attn)
    return sbh * (10 + 24 / t + attn / t)


def without_small_terms(parts: dict) -> float:
    return parts["total"] - parts.get("norm_statistics", 0.0)


@pytest.mark.parametrize("model", PAPER_MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("b", [1, 4])
def test_korthikanti_closed_forms(model, tp, sp, recompute, b):
    parts = layer_activation_bytes(model, b, tp, sp, recompute, mask_bytes=1)
    want = korthikanti(model, b, tp, sp and tp > 1, recompute)
    assert without_small_terms(parts) == pytest.approx(want, rel=1e-12)
    # the statistics are tiny next to the paper's terms
    assert parts.get("norm_statistics", 0.0) < 0.01 * parts["total"]


def test_paper_table_175b_tp8():
    """GPT-3 175B, s=2048, b=1, t=8 (Table 2 setting): 34sbh/t + 5as^2b/t with SP (~ 0.4 GiB)."""
    m = PAPER_MODELS[0]
    s, h, a = 2048, 12288, 96
    want = s * h / 8 * (34 + 5 * a * s / h)
    assert without_small_terms(layer_activation_bytes(m, 1, 8, True, "none")) == pytest.approx(want)


def test_cpu_masks_testbed_fact():
    """TESTBED: on CPU masks are kept at activation precision: s*b*h*(36 + 6*a*s/h) in 16-bit."""
    m = PAPER_MODELS[2]
    s, h, a, b = m.seq_length, m.hidden_size, m.num_attention_heads, 2
    parts = layer_activation_bytes(m, b, mask_bytes=2)
    assert without_small_terms(parts) == pytest.approx(s * b * h * (36 + 6 * a * s / h))


def test_flash_no_dropout_is_32sbh():
    """TESTBED: SDPA block without dropout keeps 32*s*b*h (16-bit), plus logsumexp and norm statistics."""
    m = dataclasses.replace(PAPER_MODELS[2], attention="flash", dropout=0.0)
    s, h, a, b = m.seq_length, m.hidden_size, m.num_attention_heads, 3
    parts = layer_activation_bytes(m, b, mask_bytes=2)
    assert without_small_terms(parts) - parts["attention_logsumexp"] == 32 * s * b * h
    assert parts["attention_logsumexp"] == 4 * b * a * s


def test_gqa_swiglu_terms():
    m = preset("llama-3-8b")  # swiglu, rmsnorm, GQA 32/8, flash, no dropout
    s, h, kv, f, b, t = m.seq_length, m.hidden_size, m.kv_size, m.ffn_hidden_size, 1, 4
    p = layer_activation_bytes(m, b, t, True, "none")
    assert p["qkv"] == 2 * s * b * (h + 2 * kv) / t
    assert p["mlp_hidden"] == 2 * s * b * 4 * f / t
    assert p["norm_statistics"] == 2 * 4 * s * b / t  # one fp32 1/rms per token and norm
    assert "attention_dropout_mask" not in p and "mlp_dropout_mask" not in p
    eager = layer_activation_bytes(dataclasses.replace(m, attention="eager"), b, t, True, "none")
    assert eager["qkv"] == 2 * s * b * 3 * h / t  # eager expands k and v to all heads
    sel = layer_activation_bytes(dataclasses.replace(m, attention="eager"), b, t, True, "selective")
    assert sel["qkv"] == p["qkv"]


def test_fused_glu_keeps_three_rows():
    """Megatron-LM's fused SwiGLU (``bias_swiglu_impl``: one autograd function saving its 2f input)
    keeps 3 f-wide rows per token where eager keeps 4; a GeLU MLP keeps 2 either way."""
    m = preset("llama-3-8b")
    s, f, b, t = m.seq_length, m.ffn_hidden_size, 2, 4
    for rc in ("none", "selective"):
        eager = layer_activation_bytes(m, b, t, True, rc)
        fused = layer_activation_bytes(m, b, t, True, rc, fused_glu=True)
        assert eager["mlp_hidden"] == 2 * s * b * 4 * f / t
        assert fused["mlp_hidden"] == 2 * s * b * 3 * f / t
        assert eager["total"] - fused["total"] == 2 * s * b * f / t
    gelu = dataclasses.replace(m, activation="gelu")
    assert (layer_activation_bytes(gelu, b, t, True, "none", fused_glu=True)
            == layer_activation_bytes(gelu, b, t, True, "none"))
    # full recomputation keeps the block input only; its working set shrinks the same way
    full_e = layer_activation_bytes(m, b, t, True, "full")
    full_f = layer_activation_bytes(m, b, t, True, "full", fused_glu=True)
    assert full_e["total"] == full_f["total"]
    assert full_e["recompute_working_bytes"] - full_f["recompute_working_bytes"] == 2 * s * b * f / t


def test_fused_glu_rows_as_autograd_saves_them():
    """What torch's autograd really keeps (saved-tensor hooks), per token of f: eager
    ``silu(gate) * up`` after a fused gate_up output, then a down projection; and the same with
    the activation as one autograd function that saves only its input, as Megatron-LM's
    ``SwiGLUFunction`` does."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional

    class SwiGLUFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            g, u = torch.chunk(x, 2, -1)
            return F.silu(g) * u

        @staticmethod
        def backward(ctx, dy):
            (x,) = ctx.saved_tensors
            with torch.enable_grad():
                xx = x.detach().requires_grad_()
                g, u = torch.chunk(xx, 2, -1)
                out = F.silu(g) * u
            return torch.autograd.grad(out, xx, dy)[0]

    T, h, f = 8, 16, 32
    w_up, w_down = torch.randn(2 * f, h, requires_grad=True), torch.randn(h, f, requires_grad=True)
    x = torch.randn(T, h, requires_grad=True)

    def rows(act) -> float:
        seen = {}

        def pack(t):
            if t.dim() == 2 and t.shape[0] == T:  # activations, not weights
                seen[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))] = t.numel()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            F.linear(act(F.linear(x, w_up)), w_down).sum()
        return (sum(seen.values()) - T * h) / (T * f)  # less the up projection's own input

    def eager(y):
        g, u = torch.chunk(y, 2, -1)
        return F.silu(g) * u

    m = preset("llama-3-8b")
    per_row = 2 * m.seq_length * m.ffn_hidden_size  # bf16 bytes of one f-wide tensor per sequence
    assert rows(eager) == layer_activation_bytes(m, 1, 1, False, "none")["mlp_hidden"] / per_row
    assert rows(SwiGLUFunction.apply) == layer_activation_bytes(m, 1, 1, False, "none", fused_glu=True)["mlp_hidden"] / per_row


SHAPES = [
    dict(num_layers=2, hidden_size=h, num_attention_heads=a, num_kv_heads=kv, ffn_hidden_size=f, vocab_size=1000,
         seq_length=s, activation=act, attention=att, dropout=p, dtype=dt, norm=norm)
    for (h, a, kv, f, s) in [(64, 4, 4, 256, 32), (4096, 32, 8, 14336, 4096), (12288, 96, 96, 49152, 2048), (256, 8, 2, 512, 8)]
    for act in ("gelu", "swiglu") for att in ("flash", "eager") for p in (0.0, 0.1)
    for dt in ("bf16", "fp32") for norm in ("layernorm", "rmsnorm")
]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("mask_bytes", [1, 2])
def test_recompute_never_raises_memory(tp, sp, mask_bytes):
    for kw in SHAPES:
        m = ModelSpec(**kw)
        for b in (1, 3):
            none, sel, full = (layer_activation_bytes(m, b, tp, sp, rc, mask_bytes) for rc in ("none", "selective", "full"))
            assert full["total"] <= sel["total"] <= none["total"]
            assert none["recompute_working_bytes"] == 0
            assert full["recompute_working_bytes"] == none["total"]
            assert sel["total"] + sel["recompute_working_bytes"] == pytest.approx(none["total"])
            for p in (none, sel, full):
                parts = {k: v for k, v in p.items() if k not in ("total", "recompute_working_bytes")}
                assert all(v > 0 for v in parts.values())
                assert p["total"] == pytest.approx(sum(parts.values()))
            if sp and tp > 1:  # sequence parallelism never costs memory either
                assert none["total"] <= layer_activation_bytes(m, b, tp, False, "none", mask_bytes)["total"]


def test_head_and_embedding():
    m = preset("gpt2")
    s, h, b = m.seq_length, m.hidden_size, 2
    vp = 50258  # padded to a multiple of 2
    hp = head_activation_parts(m, b, 2, False)
    assert hp["loss_softmax"] == 4 * s * b * vp / 2
    assert hp["output_input"] == 2 * s * b * h
    assert head_activation_parts(m, b, 2, True)["output_input"] == 2 * s * b * h / 2
    assert head_activation_bytes(m, b, 2, False) == hp["total"]
    assert embedding_activation_parts(m, b)["total"] == 8 * s * b
    assert embedding_activation_bytes(m, b, 4, True) == 9 * s * b


def test_bad_recompute():
    with pytest.raises(ValueError, match="recompute"):
        layer_activation_bytes(preset("tiny"), 1, recompute="some")


def test_no_torch_import():
    code = "import sys, autoconf.cost.activations; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_block_backward_temporaries_closed_form():
    from autoconf.cost.activations import block_backward_temporary_bytes

    m = preset("tiny")
    e, s, h, f = m.dtype_bytes, m.seq_length, m.hidden_size, m.ffn_hidden_size
    # GeLU MLP: two f-wide gradients of the hidden and the up projection's h x f weight gradient
    assert block_backward_temporary_bytes(m, 2) == e * s * 2 * 2 * f + e * h * f
    # SwiGLU: the fused gate_up is 2f wide; tensor parallelism shards all of it
    sw = dataclasses.replace(m, activation="swiglu")
    assert block_backward_temporary_bytes(sw, 2, tp=2) == (e * s * 2 * 3 * f + e * h * 2 * f) / 2


def test_torchtitan_per_op_checkpointing_keeps_every_other_matmul_output():
    """torchtitan's SelectiveAC (0.3.0): a Llama-3-8B block keeps its input (h), the outputs of
    wq (q), wv (kv), w1 (f) and w2 (h; the 1st, 3rd, 5th and 7th matmuls), the attention output
    (q) and its fp32 log-sum-exp; wk, wo and w3 are recomputed."""
    from autoconf.cost.activations import layer_activation_bytes
    from autoconf.specs.model import preset
    m = preset("llama-3-8b")
    s, h, f, kv, a = m.seq_length, 4096, 14336, 1024, 32
    got = layer_activation_bytes(m, 1, recompute="selective", op_checkpoint=True)
    assert got["total"] == 2 * s * (h + h + kv + f + h + h) + 4 * s * a
    none = layer_activation_bytes(m, 1)["total"]
    assert got["recompute_working_bytes"] == none - got["total"]
    # under TP with SP: the sharded widths / t, the row-parallel partial sums full, and the two
    # reduce-scatter outputs
    t = 4
    tp = layer_activation_bytes(m, 1, tp=t, sequence_parallel=True, recompute="selective", op_checkpoint=True)
    assert tp["total"] == 2 * s * (h / t + h / t + kv / t + f / t + h + h / t + 2 * h / t) + 4 * s * a / t


def test_torchtitan_per_op_checkpointing_reruns_wk_wo_w3():
    from autoconf.cost.compute import block_times, op_checkpoint_recompute_s
    from autoconf.cost.roofline import Roofline
    from autoconf.specs.devices import device_type
    from autoconf.specs.model import preset
    m = preset("llama-3-8b")
    rf = Roofline.of(device_type("h100-sxm"), "bf16")
    T, h, f, kv = m.seq_length, 4096, 14336, 1024
    gemms = rf.gemm(T, kv, h, 2) + rf.gemm(T, h, h, 2) + rf.gemm(T, f, h, 2)
    assert op_checkpoint_recompute_s(m, T, 1, rf, None) == gemms
    sac = block_times(m, 1, 1, False, "selective", rf, op_checkpoint=True)
    none = block_times(m, 1, 1, False, "none", rf)
    # the three GEMMs and the element-wise work again: more than the GEMMs, less than the forward
    assert gemms < sac.recompute_s < none.forward_s
    assert sac.backward_s == none.backward_s + sac.recompute_s
