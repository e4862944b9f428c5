"""Compute and memory of one layer shard: forward/backward times, GEMM efficiency, saved bytes.

Layers are built by ``autoconf.trainer.layers`` in local-width mode (``tp_group=None``): a tp-way shard at its
local width, without collectives, which is exactly one tensor-parallel rank's compute. Timing is
warm-up runs, then the median of ``repeats`` runs, with the interquartile range as the spread. On
CPU each forward and backward is timed by the clock; on CUDA the passes run back to back between
CUDA events (``_stream_times``), so a pass costs what it costs inside a step: the larger of the
host's issue time and the device's time, not their sum at the ends. The profiler times every item in several rounds
spread over its compute phase and merges them (``merge_rounds``). Gradients accumulate across repeats, as they do
over the micro-batches of a step.

Compute is timed without sequence parallelism (in local-width mode its gathers are emulated by
copies, which would count communication as compute); activation bytes are measured both ways.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from functools import lru_cache

import torch

from autoconf.specs.model import ModelSpec
from autoconf.trainer import layers as acnn


@dataclass(frozen=True)
class Item:
    """One measurement: a layer kind at a micro-batch size, tp shard and recompute mode."""

    layer: str
    micro_batch_size: int
    tp: int
    recompute: str = "none"


def layer_items(micro_batch_sizes, tps, recompute_modes) -> list[Item]:
    out = []
    for tp in tps:
        for mbs in micro_batch_sizes:
            out.append(Item("embedding", mbs, tp))
            out += [Item("block", mbs, tp, rc) for rc in recompute_modes]
            out.append(Item("head", mbs, tp))
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@lru_cache(maxsize=6)
def _module(model: ModelSpec, layer: str, tp: int, recompute: str, sp: bool, device):
    """One layer shard, built once per (layer, tp, recompute, sp): items loop over micro-batch sizes."""
    dtype = acnn.TORCH_DTYPES[model.dtype]
    common = dict(tp_size=tp, tp_group=None, sequence_parallel=sp, dtype=dtype, device=device)
    if layer == "embedding":
        return acnn.Embedding(model, **common)
    if layer == "block":
        return acnn.Block(model, recompute=recompute, **common)
    return acnn.Head(model, **common)


def build(model: ModelSpec, layer: str, mbs: int, tp: int, recompute: str, sp: bool, device, seed: int = 0):
    """(module, inputs) for one layer shard; module(*inputs) is a tensor to call backward on."""
    dtype = acnn.TORCH_DTYPES[model.dtype]
    s, h = model.seq_length, model.hidden_size
    s_local = s // tp if sp and tp > 1 else s
    gen = torch.Generator(device="cpu").manual_seed(seed)
    mod = _module(model, layer, tp, recompute if layer == "block" else "none", bool(sp and tp > 1), device)
    if layer == "embedding":
        return mod, (torch.randint(0, model.vocab_size, (mbs, s), generator=gen).to(device),)
    x = (torch.randn(mbs, s_local, h, generator=gen) * 0.5).to(device=device, dtype=dtype).requires_grad_(True)
    if layer == "block":
        return mod, (x,)
    return mod, (x, torch.randint(0, model.vocab_size, (mbs, s), generator=gen).to(device))


def release() -> None:
    """Drop the cached layer shards (their parameters and gradients)."""
    _module.cache_clear()


def _step(mod, inputs, device, grad_cache: dict) -> tuple[float, float]:
    _sync(device)
    t0 = time.perf_counter()
    out = mod(*inputs)
    _sync(device)
    t1 = time.perf_counter()
    _backward(out, grad_cache)
    _sync(device)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def _backward(out, grad_cache: dict) -> None:
    """Backward from a loss (a scalar) or from a layer's output with a cached random gradient."""
    if out.dim() == 0:
        out.backward()
    else:
        g = grad_cache.get("g")
        if g is None or g.shape != out.shape:
            g = grad_cache["g"] = torch.randn_like(out)
        out.backward(g)


CHAIN = 4
"""Blocks chained per timed pass on CUDA (``_stream_times``)."""


def _stream_times(mod, inputs, grad_cache: dict, repeats: int, chain: int = 1) -> tuple[list, list]:
    """CUDA: ``repeats`` forward+backward passes back to back, CUDA events between them and one
    synchronisation at the end, as a training step issues them. Each pass then takes the larger of
    the host's issue time and the device's own time (the device waits for a slower host; a faster
    host runs ahead), which a per-call synchronisation would add up instead: on an H100 a
    GPT-3 1.3B block at micro-batch size 1 took 2.9 ms per pass timed call by call and 1.9 ms back
    to back (bench/gpu_host_device.py).

    ``chain`` > 1 (blocks): each pass runs the block that many times in a row, its output the next
    input, and one backward through all of them, and the times are per block. A step calls
    ``backward`` once per micro-batch through every block of a stage; one call per block would
    charge each block the call's fixed cost (handing the graph to autograd's device thread), which
    host-bound blocks feel."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2 * repeats + 1)]
    torch.cuda.synchronize()
    ev[0].record()
    for i in range(repeats):
        out = mod(*inputs)
        for _ in range(chain - 1):
            out = mod(out)
        ev[2 * i + 1].record()
        _backward(out, grad_cache)
        ev[2 * i + 2].record()
    torch.cuda.synchronize()
    fwd = [ev[2 * i].elapsed_time(ev[2 * i + 1]) / 1e3 / chain for i in range(repeats)]
    bwd = [ev[2 * i + 1].elapsed_time(ev[2 * i + 2]) / 1e3 / chain for i in range(repeats)]
    return fwd, bwd


def _iqr(xs: list[float]) -> float:
    if len(xs) < 4:
        return max(xs) - min(xs)
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def time_item(model: ModelSpec, item: Item, device, warmup: int, repeats: int) -> dict:
    """Median forward and backward seconds of one layer shard (fields of LayerTiming)."""
    mod, inputs = build(model, item.layer, item.micro_batch_size, item.tp, item.recompute, False, device)
    mod.train()
    cache: dict = {}
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    for _ in range(warmup):
        _step(mod, inputs, device, cache)
    if device.type == "cuda":
        peak = float(torch.cuda.max_memory_allocated(device) - base)
    if device.type == "cuda":
        chain = 1
        if item.layer == "block" and peak:  # as many copies as fit in half the free memory, at most 4
            chain = max(1, min(CHAIN, int(0.5 * torch.cuda.mem_get_info(device)[0] // peak)))
        fwd, bwd = _stream_times(mod, inputs, cache, repeats, chain)
    else:
        fwd, bwd = [], []
        for _ in range(repeats):
            f, b = _step(mod, inputs, device, cache)
            fwd.append(f)
            bwd.append(b)
    return {"layer": item.layer, "micro_batch_size": item.micro_batch_size, "tp": item.tp,
            "recompute": item.recompute, "forward_s": statistics.median(fwd), "backward_s": statistics.median(bwd),
            "forward_spread_s": _iqr(fwd), "backward_spread_s": _iqr(bwd), "repeats": repeats,
            "step_peak_bytes": peak, "parameter_bytes": parameter_bytes(mod),
            "forward_samples": fwd, "backward_samples": bwd}


def merge_rounds(rounds: list[dict]) -> dict:
    """One item timed in several rounds (``time_item`` results): the median and spread over every
    sample of every round, so a machine that is faster or slower for a few seconds moves only the
    samples of one round. The raw samples are dropped."""
    fwd = [x for r in rounds for x in r["forward_samples"]]
    bwd = [x for r in rounds for x in r["backward_samples"]]
    peaks = [r["step_peak_bytes"] for r in rounds if r["step_peak_bytes"] is not None]
    out = {k: v for k, v in rounds[0].items() if k not in ("forward_samples", "backward_samples")}
    out.update(forward_s=statistics.median(fwd), backward_s=statistics.median(bwd), forward_spread_s=_iqr(fwd),
               backward_spread_s=_iqr(bwd), repeats=len(fwd), step_peak_bytes=max(peaks) if peaks else None)
    return out


def activation_items(micro_batch_sizes, tps, recompute_modes) -> list[tuple]:
    """(layer, mbs, tp, sp, recompute) to measure saved bytes for."""
    out = []
    for tp in tps:
        sps = (False, True) if tp > 1 else (False,)
        for sp in sps:  # sp outside mbs so cached modules are reused across micro-batch sizes
            for mbs in micro_batch_sizes:
                out.append(("embedding", mbs, tp, sp, "none"))
                out += [("block", mbs, tp, sp, rc) for rc in recompute_modes]
                out.append(("head", mbs, tp, sp, "none"))
    return out


def saved_bytes(model: ModelSpec, layer: str, mbs: int, tp: int, sp: bool, recompute: str, device) -> float:
    """Bytes one layer shard saves for backward (profiler.memory.saved_activation_bytes)."""
    from profiler.memory import saved_activation_bytes

    mod, inputs = build(model, layer, mbs, tp, recompute, sp, device)
    mod.train()
    return float(saved_activation_bytes(mod, *inputs))


def parameter_bytes(mod) -> tuple[float, int]:
    """(bytes, count) of a module's parameters (a tied head built alone holds its own copy)."""
    params = list(mod.parameters())
    return float(sum(p.numel() * p.element_size() for p in params)), int(sum(p.numel() for p in params))


# -- GEMM efficiency ---------------------------------------------------------------------------------

def gemm_shapes(model: ModelSpec, micro_batch_sizes, tps, quick: bool, cuda: bool) -> list[tuple[int, int, int]]:
    """The (m, n, k) of the layer GEMMs the search will ask about, plus a few squares for range."""
    h, f, q, kv = model.hidden_size, model.ffn_hidden_size, model.q_size, model.kv_size
    shapes = set()
    for tp in tps:
        vp = acnn.padded_vocab(model, tp) // tp
        for mbs in micro_batch_sizes:
            m = mbs * model.seq_length
            shapes |= {(m, (q + 2 * kv) // tp, h), (m, h, q // tp), (m, (model.mlp_matrices - 1) * f // tp, h),
                       (m, h, f // tp), (m, vp, h)}
    if not quick:
        squares = (1024, 2048, 4096, 8192) if cuda else (256, 512, 1024, 2048)
        shapes |= {(n, n, n) for n in squares}
    return sorted(shapes, key=lambda s: s[0] * s[1] * s[2])


def _time_call(fn, device, repeats: int, min_sample_s: float) -> float:
    """Median seconds of ``fn()`` after one untimed call; each sample loops until min_sample_s."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    first = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, min(1000, int(min_sample_s / first)))
    samples = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def time_gemm(m: int, n: int, k: int, dtype_name: str, device, repeats: int, min_sample_s: float = 0.01) -> float:
    """Median seconds of one (m x k) @ (k x n) matmul; each sample loops until min_sample_s."""
    dtype = acnn.TORCH_DTYPES[dtype_name]
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    return _time_call(lambda: torch.matmul(a, b), device, repeats, min_sample_s)


MEMORY_SIZES = (1 << 12, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26)
"""Operand sizes (bytes) of the memory-bound kernel timed for the profile's ``memory`` curve: from
a launch's worth through what stays in a core's or an SM's cache to what streams from DRAM / HBM.
The operands are reused call after call, so those that fit stay in cache: the curve is the rate of
a chain of element-wise kernels over the same activations, an optimistic one for operands a
kernel meets for the first time (a weight)."""
MEMORY_SIZES_CUDA = MEMORY_SIZES + (1 << 28,)


def memory_sizes(cuda: bool) -> tuple:
    return MEMORY_SIZES_CUDA if cuda else MEMORY_SIZES


def time_memory(nbytes: int, dtype_name: str, device, repeats: int, min_sample_s: float = 0.01) -> float:
    """Median seconds of one element-wise kernel over operands of ``nbytes`` each: ``torch.add``
    into a third tensor (reads two operands, writes one: 3 x ``nbytes`` moved), the pattern of the
    casts, residual adds and scalings the model prices by bytes moved."""
    dtype = acnn.TORCH_DTYPES[dtype_name]
    n = max(1, nbytes // torch.tensor([], dtype=dtype).element_size())
    x, y = torch.randn(n, device=device).to(dtype), torch.randn(n, device=device).to(dtype)
    z = torch.empty_like(x)
    return _time_call(lambda: torch.add(x, y, out=z), device, repeats, min_sample_s)


FP8_RECIPES = ("tensorwise", "rowwise")
"""The FP8 scalings whose GEMMs are measured (profile rows of dtype ``fp8_<recipe>``)."""
FP8_ALIGN = 16


def fp8_gemm_shapes(shapes) -> list[tuple[int, int, int]]:
    """The GEMM shapes to time in FP8: m, n and k all multiples of 16 (cuBLASLt's FP8 kernels need
    K and N so; the same subset everywhere keeps CPU and CUDA tables alike)."""
    return [s for s in shapes if all(x >= FP8_ALIGN and x % FP8_ALIGN == 0 for x in s)]


def fp8_out_dtype(model_dtype: str, recipe: str, device) -> str:
    """The output dtype of a measured FP8 GEMM: the model's when it is bf16 or fp16, else bf16 (the
    frameworks' FP8 layers run in a 16-bit model); rowwise on CUDA always bf16 (its only kernel)."""
    if recipe == "rowwise" and device.type == "cuda":
        return "bf16"
    return model_dtype if model_dtype in ("bf16", "fp16") else "bf16"


def time_fp8_gemm(m: int, n: int, k: int, recipe: str, out_dtype_name: str, device, repeats: int,
                  min_sample_s: float = 0.01) -> float:
    """Median seconds of one FP8 (m x k) @ (k x n) ``torch._scaled_mm`` on float8_e4m3fn operands
    quantised beforehand (the casts are not timed), scaled per ``recipe`` as ``autoconf.trainer.fp8`` does:
    tensorwise one fp32 scale per operand, rowwise (m, 1) and (1, n); A row-major, B column-major."""
    from autoconf.trainer.fp8 import FWD_DTYPE, check_recipe, quantize

    rowwise = check_recipe(recipe) == "rowwise"
    a = torch.randn(m, k, device=device)
    b = torch.randn(k, n, device=device)
    qa, sa = quantize(a, FWD_DTYPE, -1 if rowwise else None)
    qb, sb = quantize(b, FWD_DTYPE, 0 if rowwise else None)
    qa, qb = qa.contiguous(), qb.t().contiguous().t()
    del a, b
    out = acnn.TORCH_DTYPES[out_dtype_name]
    return _time_call(lambda: torch._scaled_mm(qa, qb, scale_a=sa, scale_b=sb, out_dtype=out), device, repeats,
                      min_sample_s)


def time_tp_block(model: ModelSpec, mbs: int, tp: int, sp: bool, group, device, warmup: int, repeats: int) -> dict:
    """Median forward/backward of one block shard with its real collectives over ``group``.

    Every rank of the group must call this with the same arguments (the collectives pair up).
    """
    dtype = acnn.TORCH_DTYPES[model.dtype]
    mod = acnn.Block(model, tp_size=tp, tp_group=group, sequence_parallel=sp, dtype=dtype, device=device)
    mod.train()
    s_local = model.seq_length // tp if sp else model.seq_length
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = (torch.randn(mbs, s_local, model.hidden_size, generator=gen) * 0.5).to(device=device, dtype=dtype)
    x.requires_grad_(True)
    cache: dict = {}
    for _ in range(warmup):
        _step(mod, (x,), device, cache)
    fwd, bwd = [], []
    for _ in range(repeats):
        f, b = _step(mod, (x,), device, cache)
        fwd.append(f)
        bwd.append(b)
    return {"micro_batch_size": mbs, "tp": tp, "sequence_parallel": sp, "forward_s": statistics.median(fwd),
            "backward_s": statistics.median(bwd), "repeats": repeats}


def time_optimizer(model: ModelSpec, tp: int, device, warmup: int, repeats: int) -> dict:
    """Median AdamW step over one block shard's parameters (gradients present, as after backward)."""
    dtype = acnn.TORCH_DTYPES[model.dtype]
    mod = acnn.Block(model, tp_size=tp, tp_group=None, dtype=dtype, device=device)
    params = [p for p in mod.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4)
    times = []
    for i in range(warmup + repeats):
        _sync(device)
        t = time.perf_counter()
        opt.step()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return {"tp": tp, "num_params": sum(p.numel() for p in params), "time_s": statistics.median(times),
            "repeats": repeats}
