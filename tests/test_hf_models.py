"""The block shapes beyond GPT/Llama (explicit head width, GeGLU, Q/K/V-only biases, parallel attention with
one or two norms, partial rotary): ModelSpec's counts, and the trainer's model (autoconf.nn) building, saving
and computing what ModelSpec prices."""

import dataclasses
import os
import socket

import pytest

from autoconf.cost.activations import layer_activation_bytes
from autoconf.cost.compute import Roofline, block_times
from autoconf.errors import UserError
from autoconf.model import ModelSpec, load_model, preset, preset_names

# -- old documents and presets are unchanged ------------------------------------------------------------

def test_presets_write_no_new_fields():
    for n in preset_names():
        d = preset(n).to_dict()
        assert not {"head_dim", "qkv_bias", "parallel_attention", "shared_norm", "rotary_fraction"} & set(d), n
        assert ModelSpec.from_dict(d) == preset(n)


def test_yaml_with_the_new_fields(tmp_path):
    p = tmp_path / "falconish.yaml"
    p.write_text("num_layers: 2\nhidden_size: 96\nnum_attention_heads: 4\nnum_kv_heads: 2\nffn_hidden_size: 128\n"
                 "vocab_size: 100\nseq_length: 16\nactivation: geglu\nnorm: rmsnorm\nposition_embedding: rope\n"
                 "head_dim: 32\nqkv_bias: true\nparallel_attention: true\nshared_norm: true\nrotary_fraction: 0.5\n")
    m = load_model(str(p))
    assert (m.q_size, m.kv_size, m.rotary_dim, m.norms_per_block) == (128, 64, 16, 1)
    assert m.to_dict()["head_dim"] == 32 and ModelSpec.from_dict(m.to_dict()) == m


@pytest.mark.parametrize("kw,needle", [
    (dict(shared_norm=True), "shared_norm=true needs parallel_attention"),
    (dict(rotary_fraction=0.5), "needs position_embedding 'rope'"),
    (dict(position_embedding="rope", rotary_fraction=0.1), "rotary_fraction=0.1 rotates 1 of the 16"),
    (dict(position_embedding="rope", rotary_fraction=0.0), r"rotary_fraction=0.0 must be a number in \(0, 1\]"),
    (dict(head_dim=0), "head_dim=0 must be null or an integer"),
    (dict(hidden_size=66), r"hidden_size\(66\) is not divisible by num_attention_heads\(4\) \(set head_dim"),
    (dict(activation="reglu"), "activation='reglu'; valid: gelu, swiglu, geglu"),
    (dict(qkv_bias=1), "qkv_bias=1 must be true or false"),
])
def test_bad_new_fields(kw, needle):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=4, ffn_hidden_size=8,
                vocab_size=10, seq_length=8)
    with pytest.raises(UserError, match=needle) as e:
        ModelSpec(**{**base, **kw})
    assert "\n" not in str(e.value)


def test_head_dim_lifts_the_divisibility_rule():
    m = ModelSpec(num_layers=1, hidden_size=66, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=8,
                  vocab_size=10, seq_length=8, head_dim=16)
    assert (m.q_size, m.kv_size) == (64, 32)


# -- the trainer's model builds what ModelSpec prices -----------------------------------------------------------

def tiny(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=96,
                vocab_size=101, seq_length=32, norm="rmsnorm", position_embedding="rope", dtype="fp32")
    return ModelSpec(**{**base, **kw})


FEATURES = {  # a tiny model of each shape feature the families need
    "geglu": tiny(activation="geglu"),
    "head_dim": tiny(activation="swiglu", head_dim=24),  # q = 96 on a 64-wide stream, kv = 48
    "qkv_bias": tiny(activation="swiglu", qkv_bias=True, tied_embeddings=True),
    "neox": tiny(activation="gelu", norm="layernorm", bias=True, parallel_attention=True, rotary_fraction=0.25,
                 num_kv_heads=4),
    "falcon7b": tiny(activation="gelu", norm="layernorm", parallel_attention=True, shared_norm=True, num_kv_heads=1,
                     tied_embeddings=True),
    "falcon40b": tiny(activation="gelu", norm="layernorm", parallel_attention=True, bias=True),
    "gemma7b": tiny(activation="geglu", head_dim=32, num_kv_heads=4, tied_embeddings=True),
    "everything": tiny(activation="geglu", head_dim=20, qkv_bias=True, parallel_attention=True, shared_norm=True,
                       rotary_fraction=0.5, dropout=0.1, attention="eager"),
}


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_nn_param_count_is_the_spec(name):
    torch = pytest.importorskip("torch")
    from autoconf.nn import GPT

    m = FEATURES[name]
    model = GPT(m)
    assert sum(p.numel() for p in model.parameters()) == m.num_params()
    blk = model.blocks["0"]
    assert sum(p.numel() for p in blk.parameters()) == m.layer_params()
    assert blk.qkv.weight.shape == (m.q_size + 2 * m.kv_size, m.hidden_size)
    assert blk.proj.weight.shape == (m.hidden_size, m.q_size)
    assert (blk.norm2 is None) == m.shared_norm
    assert model(torch.randint(0, 101, (2, 32))).shape == (2, 32, 101)


# (feature, b, dtype, recompute, attention, dropout, tp, sp)
SAVED_CASES = [(n, 2, "bf16", "none", "flash", 0.0, 1, False) for n in sorted(FEATURES)] + [
    ("neox", 2, "bf16", "none", "eager", 0.1, 1, False),
    ("neox", 2, "fp32", "selective", "eager", 0.1, 2, True),
    ("falcon7b", 2, "bf16", "none", "eager", 0.1, 1, False),
    ("falcon7b", 1, "bf16", "full", "flash", 0.0, 1, False),
    ("falcon40b", 2, "bf16", "none", "flash", 0.0, 2, True),
    ("falcon40b", 2, "bf16", "selective", "eager", 0.1, 2, False),
    ("gemma7b", 2, "bf16", "none", "eager", 0.0, 1, False),
    ("gemma7b", 2, "fp32", "none", "flash", 0.0, 4, True),
    ("head_dim", 1, "bf16", "none", "eager", 0.1, 2, True),
    ("qkv_bias", 2, "bf16", "selective", "flash", 0.1, 2, True),
    ("everything", 2, "bf16", "none", "eager", 0.1, 2, True),
    ("everything", 2, "fp32", "full", "eager", 0.1, 2, True),
]


@pytest.mark.parametrize("case", SAVED_CASES, ids=lambda c: "-".join(map(str, c)))
def test_nn_saved_bytes_match_formula(case):
    """autoconf.nn's block keeps for backward exactly what cost/activations.py prices (term by term)."""
    torch = pytest.importorskip("torch")
    from autoconf.nn import Block
    from profiler.memory import saved_activation_bytes

    name, b, dtype, rc, att, p, tp, sp = case
    m = dataclasses.replace(FEATURES[name], dtype=dtype, attention=att, dropout=p)
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    block = Block(m, tp_size=tp, sequence_parallel=sp, recompute=rc, dtype=dt)
    x = torch.randn(b, m.seq_length // tp if sp else m.seq_length, m.hidden_size, dtype=dt, requires_grad=True)
    got = saved_activation_bytes(block, x)
    assert got == layer_activation_bytes(m, b, tp, sp, rc, mask_bytes=dt.itemsize)["total"]


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_nn_flops_match_the_spec(name):
    """Matrix FLOPs counted on the torch module (eager attention: every score computed) are the spec's
    forward FLOPs per token, 3x that with the backward; and cost/compute.py prices the same FLOPs."""
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    from autoconf.nn import GPT, Block

    m = dataclasses.replace(FEATURES[name], attention="eager", dropout=0.0)
    tokens = 2 * m.seq_length
    block = Block(m)
    x = torch.randn(2, m.seq_length, m.hidden_size, requires_grad=True)
    with FlopCounterMode(display=False) as fwd:
        y = block(x)
    assert fwd.get_total_flops() == tokens * m.layer_forward_flops_per_token()
    with FlopCounterMode(display=False) as bwd:
        y.sum().backward()
    assert bwd.get_total_flops() == 2 * tokens * m.layer_forward_flops_per_token()
    model = GPT(m)
    tok = torch.randint(0, m.vocab_size, (2, m.seq_length))
    with FlopCounterMode(display=False) as whole:
        model(tok, tok).backward()
    assert whole.get_total_flops() == tokens * m.model_flops_per_token()
    # the roofline with every GEMM at peak and free memory traffic: time = FLOPs / peak
    rf = Roofline(1e12, 1e30, 1.0, 1.0, 0.0, gemm_eff=lambda *a: 1.0)
    t = block_times(m, 2, 1, False, "none", rf)
    assert t.forward_s == pytest.approx(tokens * m.layer_forward_flops_per_token() / 1e12, rel=1e-9)
    assert t.backward_s == pytest.approx(2 * t.forward_s, rel=1e-9)


def test_profile_of_a_sequential_block_does_not_apply_to_a_parallel_one():
    from autoconf.profile import COMPUTE_FIELDS

    for field in ("head_dim", "qkv_bias", "parallel_attention", "shared_norm", "rotary_fraction"):
        assert field in COMPUTE_FIELDS["block"]


# -- tensor parallelism over 2 gloo ranks: the new shapes give the single-process loss and gradients -------

TP_FEATURES = ["falcon40b", "gemma7b", "neox"]
TP_EXTRA = tiny(activation="geglu", head_dim=20, qkv_bias=True, parallel_attention=True, shared_norm=True,
                rotary_fraction=0.5, tied_embeddings=True)


def _tp_worker(rank, world, port, queue):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from autoconf.nn import GPT, _shard, allreduce_sequence_parallel_grads, padded_vocab

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    worst = {}
    for key, m in [(n, FEATURES[n]) for n in TP_FEATURES] + [("extra", TP_EXTRA)]:
        torch.manual_seed(0)
        tok, y = torch.randint(0, m.vocab_size, (2, m.seq_length)), torch.randint(0, m.vocab_size, (2, m.seq_length))
        ref = GPT(m)
        ref_loss = ref(tok, y)
        ref_loss.backward()
        ref_params = dict(ref.named_parameters())
        for sp, rc in ((False, "none"), (True, "none"), (True, "selective"), (False, "full")):
            model = GPT(m, tp_size=world, tp_group=dist.group.WORLD, sequence_parallel=sp, recompute=rc)
            loss = model(tok, y)
            loss.backward()
            allreduce_sequence_parallel_grads(model, dist.group.WORLD)
            errs = [abs(loss.item() - ref_loss.item())]
            for n, p in model.named_parameters():
                g = ref_params[n].grad
                if p.shape != g.shape:
                    if n.endswith(("qkv.weight", "qkv.bias")):
                        g = _shard(g, [m.q_size, m.kv_size, m.kv_size], 0, rank, world)
                    elif n.endswith(("fc1.weight", "fc1.bias")):
                        g = _shard(g, [m.ffn_hidden_size] * (2 if m.gated_mlp else 1), 0, rank, world)
                    elif n.endswith(("proj.weight", "fc2.weight")):
                        g = g.chunk(world, 1)[rank]
                    else:  # vocab-parallel tables, padded to a multiple of tp
                        g = F.pad(g, (0, 0, 0, padded_vocab(m, world) - m.vocab_size)).chunk(world, 0)[rank]
                errs.append((p.grad - g).abs().max().item())
            worst[(key, sp, rc)] = max(errs)
    queue.put((rank, worst))
    dist.barrier()
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_tensor_parallel_gloo_matches_single_process():
    pytest.importorskip("torch")
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_tp_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=180) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
    assert all(p.exitcode == 0 for p in procs)
    for _, worst in results:
        assert len(worst) == 16
        assert max(worst.values()) < 1e-5, worst
