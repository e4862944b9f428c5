"""autoconf.trainer.layers: measured saved activations against the formula, TP shards, parameter counts, TP runs."""

import os
import socket

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from autoconf.cost.activations import embedding_activation_bytes, head_activation_bytes, layer_activation_bytes  # noqa: E402
from autoconf.specs.model import ModelSpec, preset  # noqa: E402
from autoconf.trainer.layers import GPT, Block, Embedding, Head, build_stage, padded_vocab  # noqa: E402
from autoconf.trainer.tensor_parallel import shard  # noqa: E402
from profiler.memory import live_activation_bytes, model_state_bytes, saved_activation_bytes  # noqa: E402

torch.set_num_threads(1)
DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def spec(s=32, h=64, a=4, kv=4, f=None, act="gelu", att="flash", p=0.0, dtype="fp32", norm="layernorm",
         pos="learned", bias=True, tied=False, vocab=100, layers=2):
    return ModelSpec(num_layers=layers, hidden_size=h, num_attention_heads=a, num_kv_heads=kv,
                     ffn_hidden_size=f or (3 * h if act == "swiglu" else 4 * h), vocab_size=vocab, seq_length=s,
                     activation=act, attention=att, dropout=p, dtype=dtype, norm=norm, position_embedding=pos,
                     bias=bias, tied_embeddings=tied)


# (s, b, h, a, kv, dtype, recompute, activation, attention, dropout, tp, sp, norm, pos)
CASES = [
    (32, 2, 64, 4, 4, "bf16", "none", "gelu", "eager", 0.1, 1, False, "layernorm", "learned"),  # the paper's block
    (32, 2, 64, 4, 4, "fp32", "none", "gelu", "eager", 0.1, 1, False, "layernorm", "learned"),
    (32, 2, 64, 4, 4, "bf16", "selective", "gelu", "eager", 0.1, 1, False, "layernorm", "learned"),
    (32, 2, 64, 4, 4, "bf16", "full", "gelu", "eager", 0.1, 1, False, "layernorm", "learned"),
    (32, 2, 64, 4, 4, "bf16", "none", "gelu", "flash", 0.0, 1, False, "layernorm", "learned"),
    (32, 2, 64, 4, 4, "fp32", "selective", "gelu", "flash", 0.1, 1, False, "layernorm", "learned"),
    (64, 1, 64, 4, 2, "bf16", "none", "swiglu", "flash", 0.0, 1, False, "rmsnorm", "rope"),  # llama-like
    (64, 1, 64, 4, 2, "bf16", "none", "swiglu", "eager", 0.0, 1, False, "rmsnorm", "rope"),
    (64, 1, 64, 4, 2, "fp32", "selective", "swiglu", "eager", 0.1, 1, False, "rmsnorm", "rope"),
    (64, 1, 64, 4, 2, "bf16", "full", "swiglu", "flash", 0.0, 1, False, "rmsnorm", "rope"),
    (16, 3, 96, 6, 2, "fp32", "none", "gelu", "eager", 0.0, 1, False, "rmsnorm", "learned"),
    (16, 3, 96, 6, 2, "bf16", "none", "swiglu", "eager", 0.1, 1, False, "layernorm", "rope"),
    # local-width mode (tp > 1, no group): one rank's shard
    (32, 2, 64, 4, 4, "bf16", "none", "gelu", "eager", 0.1, 2, False, "layernorm", "learned"),
    (32, 2, 64, 4, 4, "bf16", "none", "gelu", "eager", 0.1, 2, True, "layernorm", "learned"),
    (32, 2, 64, 4, 4, "bf16", "selective", "gelu", "eager", 0.1, 4, True, "layernorm", "learned"),
    (32, 2, 64, 4, 4, "fp32", "full", "gelu", "eager", 0.1, 4, True, "layernorm", "learned"),
    (64, 1, 64, 4, 2, "bf16", "none", "swiglu", "flash", 0.0, 2, True, "rmsnorm", "rope"),
    (64, 1, 64, 4, 2, "bf16", "none", "swiglu", "eager", 0.1, 2, False, "rmsnorm", "rope"),
    (64, 2, 64, 4, 2, "fp32", "selective", "swiglu", "flash", 0.1, 2, True, "rmsnorm", "learned"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_block_saved_bytes_match_formula(case):
    s, b, h, a, kv, dtype, rc, act, att, p, tp, sp, norm, pos = case
    m = spec(s=s, h=h, a=a, kv=kv, act=act, att=att, p=p, dtype=dtype, norm=norm, pos=pos)
    dt = DT[dtype]
    block = Block(m, tp_size=tp, sequence_parallel=sp, recompute=rc, dtype=dt)
    x = torch.randn(b, s // tp if sp else s, h, dtype=dt, requires_grad=True)
    got = saved_activation_bytes(block, x)
    want = layer_activation_bytes(m, b, tp, sp, rc, mask_bytes=dt.itemsize)["total"]
    assert got == pytest.approx(want, rel=0.02)
    assert got == want  # in fact exact, term by term


@pytest.mark.parametrize("rc", ["none", "selective", "full"])
def test_live_storages_agree_with_saved_tensors(rc):
    """A memory-difference measurement sees the same bytes, checkpoint regions included."""
    m = spec(att="eager", p=0.1, act="swiglu", kv=2, pos="rope")
    block = Block(m, recompute=rc, dtype=torch.bfloat16)
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    assert live_activation_bytes(block, x) == saved_activation_bytes(block, x)
    # the block's input is kept in every mode (by the first norm, or by checkpoint under "full")
    assert saved_activation_bytes(block, x, exclude_inputs=True) == saved_activation_bytes(block, x) - x.numel() * 2


def test_whole_model_saved_bytes():
    m = spec(att="eager", p=0.1, vocab=101, tied=True)
    tok, y = torch.randint(0, 101, (2, 32)), torch.randint(0, 101, (2, 32))
    got = saved_activation_bytes(GPT(m), tok, y)
    want = (embedding_activation_bytes(m, 2) + head_activation_bytes(m, 2, mask_bytes=4)
            + m.num_layers * layer_activation_bytes(m, 2, mask_bytes=4)["total"])
    assert got == want


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_local_width_shards(sp, act):
    tp, b = 2, 3
    m = spec(kv=2, act=act, pos="rope")
    h, kv, f = m.hidden_size, m.kv_size, m.ffn_hidden_size
    full, blk = Block(m, layer_index=1, seed=7), Block(m, tp_size=tp, sequence_parallel=sp, layer_index=1, seed=7)
    mult = 2 if act == "swiglu" else 1
    assert blk.qkv.weight.shape == ((h + 2 * kv) // tp, h) and blk.qkv.bias.shape == ((h + 2 * kv) // tp,)
    assert blk.proj.weight.shape == (h, h // tp) and blk.proj.bias.shape == (h,)
    assert blk.fc1.weight.shape == (mult * f // tp, h)
    assert blk.fc2.weight.shape == (h, f // tp)
    # rank 0's shards are slices of the full weights: initialisation does not depend on tp
    assert torch.equal(blk.qkv.weight, shard(full.qkv.weight, [h, kv, kv], 0, 0, tp))
    assert torch.equal(blk.fc1.weight, shard(full.fc1.weight, [f] * mult, 0, 0, tp))
    assert torch.equal(blk.fc2.weight, full.fc2.weight[:, : f // tp])
    x = torch.randn(b, m.seq_length // tp if sp else m.seq_length, h)
    assert blk(x).shape == x.shape
    emb = Embedding(m, tp_size=tp, sequence_parallel=sp)
    assert emb.weight.shape == (padded_vocab(m, tp) // tp, h)
    assert emb(torch.randint(0, 100, (b, m.seq_length))).shape == x.shape
    head = Head(m, tp_size=tp, sequence_parallel=sp)
    assert head(x).shape == (b, m.seq_length, padded_vocab(m, tp) // tp)


@pytest.mark.parametrize("m", [
    preset("tiny"),
    spec(act="gelu", bias=True, att="eager", p=0.1),
    spec(act="swiglu", bias=False, norm="rmsnorm", pos="rope", kv=2, tied=True),
    spec(act="swiglu", bias=True, norm="layernorm", pos="learned", kv=1, f=96),
], ids=["tiny", "gelu", "swiglu-gqa-tied", "swiglu-bias"])
def test_param_count(m):
    model = GPT(m)
    assert sum(p.numel() for p in model.parameters()) == m.num_params()
    assert model_state_bytes(model) == 2 * 4 * m.num_params()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_own_only_their_storage(tp):
    """A tp shard's parameters hold 1/tp of the storage (a view of the full table would keep it all,
    and the memory model counts only the shard)."""
    m = spec(vocab=128, tied=False)
    for mod in (Embedding(m, tp_size=tp), Head(m, tp_size=tp), Block(m, tp_size=tp)):
        for name, prm in mod.named_parameters():
            assert prm.untyped_storage().nbytes() == prm.numel() * prm.element_size(), (type(mod).__name__, name)


def test_loss_is_cross_entropy_and_recompute_is_exact():
    m = spec(att="eager", p=0.1, vocab=101)
    tok, y = torch.randint(0, 101, (2, 32)), torch.randint(0, 101, (2, 32))
    ref = GPT(m).eval()
    logits = ref(tok)
    assert logits.shape == (2, 32, 101)
    assert ref(tok, y).item() == pytest.approx(F.cross_entropy(logits.reshape(-1, 101), y.reshape(-1)).item(), rel=1e-6)
    grads = {}
    for rc in ("none", "selective", "full"):
        model = GPT(m, recompute=rc)
        torch.manual_seed(3)
        model(tok, y).backward()
        grads[rc] = {n: p.grad for n, p in model.named_parameters()}
    for rc in ("selective", "full"):
        for n, g in grads["none"].items():
            assert torch.allclose(grads[rc][n], g, atol=1e-6), (rc, n)


def test_stages_compose_to_the_model():
    m = spec(act="swiglu", norm="rmsnorm", pos="rope", kv=2, tied=True, layers=3)
    tok, y = torch.randint(0, 100, (2, 32)), torch.randint(0, 100, (2, 32))
    ref = GPT(m, seed=5)
    s0 = build_stage(m, [0], has_embedding=True, has_head=False, seed=5)
    s1 = build_stage(m, [1, 2], has_embedding=False, has_head=True, seed=5)
    names = set(dict(s0.named_parameters())) | set(dict(s1.named_parameters()))
    assert names == set(dict(ref.named_parameters())) | {"head.weight"}  # tied across stages: a copy
    assert torch.equal(s1.head.weight, s0.embedding.weight)
    hidden = s0(tok)
    assert hidden.shape == (2, 32, 64)
    assert s1(hidden, y).item() == pytest.approx(ref(tok, y).item(), rel=1e-6)
    assert s1(hidden).shape == (2, 32, 100)


# -- a real 2-process gloo tensor-parallel run against the single-process model ---------------------------

TP_MODELS = [
    spec(att="eager", vocab=101),
    spec(act="swiglu", norm="rmsnorm", pos="rope", kv=2, tied=True, bias=False, vocab=101),
]


def _tp_worker(rank, world, port, queue, cases=None):
    """One rank: every (key, model) of ``cases`` (default: TP_MODELS by activation) in TP, TP+SP and
    recompute modes against the single-process model; puts {(key, sp, recompute): worst error}."""
    import torch.distributed as dist

    from autoconf.trainer.tensor_parallel import allreduce_sequence_parallel_grads

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    worst = {}
    for key, m in cases if cases is not None else [(m.activation, m) for m in TP_MODELS]:
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
                        g = shard(g, [m.q_size, m.kv_size, m.kv_size], 0, rank, world)
                    elif n.endswith(("fc1.weight", "fc1.bias")):
                        g = shard(g, [m.ffn_hidden_size] * (2 if m.gated_mlp else 1), 0, rank, world)
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


def run_tp_workers(cases=None, timeout: float = 120) -> list:
    """Two forked gloo ranks running :func:`_tp_worker`; each rank's worst errors."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_tp_worker, args=(r, 2, port, queue, cases)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
    assert all(p.exitcode == 0 for p in procs)
    return results


def test_tensor_parallel_gloo_matches_single_process():
    """2 forked gloo ranks, TP and TP+SP (with recompute): loss and every gradient shard as one process."""
    results = run_tp_workers()
    for _, worst in results:
        assert max(worst.values()) < 1e-5, worst
