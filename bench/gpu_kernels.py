"""Kernel rates on a CUDA device that the cost model prices from the catalog: fused attention per
SDPA backend and sequence length, torch's fp32 softmax (Megatron's fallback when its fused kernel
refuses the shape), and memory-bound element-wise kernels by size.

    python bench/gpu_kernels.py --json out.json          # measure (needs a CUDA device)
    python bench/gpu_kernels.py --compare out.json       # the model against stored rows (any machine):
                                                         # attention, element-wise, the GEMM sweep

Attention: ``torch.nn.functional.scaled_dot_product_attention``, bf16, causal, [b, s, h, d] inputs
transposed to [b, h, s, d] as a model passes them, for every backend that takes the shape (flash,
cuDNN, memory-efficient) and the one SDPA picks by default. Forward and forward+backward are timed
with CUDA events over back-to-back repeats (median of rounds); the backward is their difference.
FLOPs are the causal count, 2 * b * h * s^2 * d forward (half of the full 4 b h s^2 d) and 2.5x that
backward, the convention of Dao's FlashAttention-2 paper.

Softmax: Megatron's ``FusedScaleMaskSoftmax.forward_torch_softmax`` on bf16 scores [b, h, s, s]:
``float()``, scale, ``masked_fill`` with a causal mask, ``softmax``, cast back, and its backward.

Element-wise: ``torch.mul(x, 2, out=y)`` in bf16 from 256 KiB to 2 GiB (bytes read + written), and
an empty back-to-back kernel's time.

GEMMs: nn.Linear's three GEMMs of a layer's four projections over hidden sizes, tp and token
counts (``--gemm-*``); one GEMM under different data and duty cycles (``conditions``). Blocks:
``--breakdown MODELS`` times every kernel of one block's forward and backward with torch.profiler
and sums them by class (GEMM, attention, other). The softmax, conditions and breakdown rows are
read from the JSON (printed when measured); ``--compare`` holds the model against the attention,
element-wise and GEMM-sweep rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _timed(fn, repeats: int, rounds: int = 3) -> float:
    """Median over ``rounds`` of the mean device time of ``repeats`` back-to-back calls (seconds)."""
    import torch

    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(repeats):
            fn()
        e1.record()
        torch.cuda.synchronize()
        out.append(e0.elapsed_time(e1) / 1e3 / repeats)
    return statistics.median(out)


def _repeats_for(fn, budget_s: float = 0.05) -> int:
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    return max(3, min(200, int(budget_s / one)))


def measure_attention(out: dict, seqs, dims, tokens: int, heads: int, kv_groups: int = 1) -> None:
    """``kv_groups`` > 1: grouped-query attention (``enable_gqa``), that many query heads per key /
    value head, as a Llama-style model calls SDPA."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    print(f"{'backend':<10} {'d':>4} {'s':>6} {'b':>3} {'h':>3} | {'fwd ms':>8} {'bwd ms':>8} | "
          f"{'fwd TF/s':>8} {'bwd TF/s':>8}")
    for d in dims:
        h = heads * 128 // d  # the same hidden width per layer at every head dimension
        for s in seqs:
            b = max(1, tokens // s)
            hk = h // kv_groups
            gqa = kv_groups > 1
            q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                       .requires_grad_(True) for n in (h, hk, hk))
            g = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
            try:
                default = int(torch._fused_sdp_choice(q, k, v, None, 0.0, True, enable_gqa=gqa))
                default_name = SDPBackend(default).name
            except Exception as exc:  # the private API moved
                default_name = f"unknown ({type(exc).__name__})"
            flops_f = 2.0 * b * h * s * s * d
            for name, be in [("default", None)] + list(backends.items()):
                def fwd():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

                def fwdbwd():
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
                    torch.autograd.grad(o, (q, k, v), g)

                try:
                    if be is None:
                        r = _repeats_for(fwdbwd)
                        tf, tfb = _timed(fwd, r), _timed(fwdbwd, r)
                    else:
                        with sdpa_kernel([be]):
                            r = _repeats_for(fwdbwd)
                            tf, tfb = _timed(fwd, r), _timed(fwdbwd, r)
                except RuntimeError as exc:
                    out["attention"].append({"backend": name, "kv_groups": kv_groups, "head_dim": d, "seq": s, "batch": b, "heads": h,
                                             "error": str(exc).splitlines()[0][:200]})
                    print(f"{name:<10} {d:>4} {s:>6} {b:>3} {h:>3}/{hk} | not taken: {str(exc).splitlines()[0][:60]}")
                    continue
                tb = tfb - tf
                row = {"backend": name, "default_is": default_name if name == "default" else None,
                       "kv_groups": kv_groups, "head_dim": d, "seq": s, "batch": b, "heads": h, "causal": True,
                       "fwd_s": tf, "bwd_s": tb, "flops_fwd": flops_f, "flops_bwd": 2.5 * flops_f}
                out["attention"].append(row)
                print(f"{name:<10} {d:>4} {s:>6} {b:>3} {h:>3}/{hk} | {tf * 1e3:8.3f} {tb * 1e3:8.3f} | "
                      f"{flops_f / tf / 1e12:8.1f} {2.5 * flops_f / tb / 1e12:8.1f}"
                      + (f"   (default: {default_name})" if name == "default" else ""), flush=True)
            q = k = v = g = None
            torch.cuda.empty_cache()


def measure_softmax(out: dict, seqs, heads: int) -> None:
    import torch

    print(f"{'softmax s':>9} {'b*h':>5} | {'fwd ms':>8} {'bwd ms':>8} | {'fwd GB/s@37':>11} {'bwd GB/s@41':>11}")
    for s in seqs:
        bh = max(1, (1 << 28) // (s * s))  # 256 Mi scores: 1 GiB in fp32
        bh = min(bh, heads * 8)
        x = torch.randn(1, bh, s, s, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        mask = torch.triu(torch.ones(s, s, device="cuda", dtype=torch.bool), 1)[None, None]
        g = torch.randn(1, bh, s, s, device="cuda", dtype=torch.bfloat16)
        scale = 0.125

        def fwd():  # Megatron's forward_torch_softmax with softmax_in_fp32 and a scale
            y = x.float()
            y = y * scale
            y = y.masked_fill(mask, -10000.0)
            p = torch.nn.Softmax(dim=-1)(y)
            return p.bfloat16()

        def fwdbwd():
            p = fwd()
            torch.autograd.grad(p, x, g)

        r = _repeats_for(fwdbwd)
        tf, tfb = _timed(fwd, r), _timed(fwdbwd, r)
        scores = bh * s * s
        row = {"seq": s, "bh": bh, "scores": scores, "fwd_s": tf, "bwd_s": tfb - tf}
        out["softmax"].append(row)
        print(f"{s:>9} {bh:>5} | {tf * 1e3:8.3f} {(tfb - tf) * 1e3:8.3f} | {37 * scores / tf / 1e9:11.0f} "
              f"{41 * scores / (tfb - tf) / 1e9:11.0f}", flush=True)
        x = g = mask = None
        torch.cuda.empty_cache()


def measure_elementwise(out: dict) -> None:
    import torch

    print(f"{'bytes moved':>12} | {'us':>9} | {'GB/s':>7}")
    for p in range(18, 32):
        n = (1 << p) // 2 // 2  # elements: read + write of bf16 = 2 ** p bytes
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)

        def op():
            torch.mul(x, 2.0, out=y)

        r = max(10, min(2000, int(2e9 / (1 << p))))
        t = _timed(op, r)
        out["elementwise"].append({"bytes": 1 << p, "time_s": t})
        print(f"{1 << p:>12} | {t * 1e6:9.2f} | {(1 << p) / t / 1e9:7.0f}", flush=True)
        x = y = None
    z = torch.empty(1, device="cuda")
    t = _timed(lambda: z.add_(0.0), 2000)
    out["empty_kernel_s"] = t
    print(f"empty kernel back to back: {t * 1e6:.2f} us", flush=True)


def measure_gemms(out: dict, hiddens, tps, tokens_list) -> None:
    """nn.Linear's three GEMMs (forward x @ W^T, input gradient dy @ W, weight gradient dy^T @ x) of
    a transformer layer's four projections at every (hidden, tp, tokens), bf16."""
    import torch

    seen = set()
    print(f"{'gemm':<14} {'m':>6} {'n':>6} {'k':>6} | {'us':>9} {'TF/s':>6}")
    for h in hiddens:
        for tp in tps:
            for T in tokens_list:
                for name, n_out, n_in in (("qkv", 3 * h // tp, h), ("proj", h, h // tp),
                                          ("fc1", 4 * h // tp, h), ("fc2", h, 4 * h // tp)):
                    x = torch.randn(T, n_in, device="cuda", dtype=torch.bfloat16)
                    w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16)
                    dy = torch.randn(T, n_out, device="cuda", dtype=torch.bfloat16)
                    for kind, fn, (m, n, k) in (
                            ("fwd", lambda: torch.nn.functional.linear(x, w), (T, n_out, n_in)),
                            ("dgrad", lambda: dy @ w, (T, n_in, n_out)),
                            ("wgrad", lambda: dy.t() @ x, (n_out, n_in, T))):
                        if (kind, m, n, k) in seen:
                            continue
                        seen.add((kind, m, n, k))
                        t = _timed(fn, _repeats_for(fn, 0.01))
                        out["gemm"].append({"op": f"{name}.{kind}", "m": m, "n": n, "k": k, "time_s": t})
                        print(f"{name + '.' + kind:<14} {m:>6} {n:>6} {k:>6} | {t * 1e6:9.1f} "
                              f"{2.0 * m * n * k / t / 1e12:6.0f}", flush=True)
                    x = w = dy = None
            torch.cuda.empty_cache()


def measure_gemm_conditions(out: dict, repeats: int = 20) -> None:
    """The same GEMM under different data and duty cycles: weights N(0, 1) or N(0, 0.02) (as a
    trained network's), inputs N(0, 1), all zeros; back to back, or each GEMM followed by a
    memory-bound kernel of about the same duration (as inside a layer), timed by CUDA events
    around the GEMM alone."""
    import torch

    big = torch.empty(1 << 28, device="cuda", dtype=torch.bfloat16)
    print(f"{'m':>6} {'n':>6} {'k':>6} {'data':<8} {'duty':<11} | {'us':>8} {'frac':>6}")
    for m, n, k in ((4096, 28672, 4096), (4096, 4096, 14336), (8192, 8192, 8192), (2048, 8192, 2048)):
        for data in ("std1", "std0.02", "zeros"):
            if data == "zeros":
                x = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)
                w = torch.zeros(n, k, device="cuda", dtype=torch.bfloat16)
            else:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * (1.0 if data == "std1" else 0.02)
            for duty in ("sustained", "interleaved"):
                for _ in range(5):
                    torch.nn.functional.linear(x, w)
                ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(repeats)]
                torch.cuda.synchronize()
                for e0, e1 in ev:
                    e0.record()
                    torch.nn.functional.linear(x, w)
                    e1.record()
                    if duty == "interleaved":
                        big.mul_(1.0)
                torch.cuda.synchronize()
                t = statistics.median(e0.elapsed_time(e1) / 1e3 for e0, e1 in ev)
                frac = 2.0 * m * n * k / t / 989e12
                out["gemm_conditions"].append({"m": m, "n": n, "k": k, "data": data, "duty": duty, "time_s": t})
                print(f"{m:>6} {n:>6} {k:>6} {data:<8} {duty:<11} | {t * 1e6:8.1f} {frac:6.3f}", flush=True)
            x = w = None
    big = None
    torch.cuda.empty_cache()


def _kernel_class(name: str) -> str:
    n = name.lower()
    if any(t in n for t in ("fmha", "flash", "attention", "cudnn_generated", "sdpa")):
        return "attention"
    if any(t in n for t in ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "sm80_", "ampere_", "cublas")):
        return "gemm"
    return "other"


def measure_breakdown(out: dict, models, mbs_list, repeats: int = 5) -> None:
    """Every kernel of one block's forward and backward (``torch.profiler``), as the profiler builds
    the block: device time per kernel name, and the class it falls in (GEMM, attention, other)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from autoconf.specs.hf import load_model
    from profiler import compute

    for name in models:
        model = load_model(name)
        for mbs in mbs_list:
            mod, inputs = compute.build(model, "block", mbs, 1, "none", False, torch.device("cuda", 0))
            mod.train()
            cache: dict = {}
            for _ in range(3):
                compute._backward(mod(*inputs), cache)
            torch.cuda.synchronize()
            rows = {}
            for phase in ("fwd", "bwd"):
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(repeats):
                        o = mod(*inputs)
                        if phase == "bwd":  # forward and backward: the backward is the difference
                            compute._backward(o, cache)
                    torch.cuda.synchronize()
                for ev in prof.key_averages():
                    t = getattr(ev, "device_time_total", None)
                    if t is None:
                        t = ev.cuda_time_total
                    if t <= 0 or ev.key.startswith("ProfilerStep"):
                        continue
                    r = rows.setdefault(ev.key, {"kernel": ev.key, "class": _kernel_class(ev.key),
                                                 "fwd_us": 0.0, "fwdbwd_us": 0.0, "count_fwdbwd": 0})
                    r["fwd_us" if phase == "fwd" else "fwdbwd_us"] += t / repeats
                    if phase == "bwd":
                        r["count_fwdbwd"] += ev.count // repeats
            kernels = [r for r in rows.values() if r["fwdbwd_us"] > 0 or r["fwd_us"] > 0]
            kernels = [r for r in kernels if not r["kernel"].startswith(("aten::", "autograd::", "cuda"))]
            tot = {c: [sum(r["fwd_us"] for r in kernels if r["class"] == c),
                       sum(r["fwdbwd_us"] - r["fwd_us"] for r in kernels if r["class"] == c)]
                   for c in ("gemm", "attention", "other")}
            out["breakdown"].append({"model": name, "micro_batch_size": mbs, "kernels": kernels, "totals_us": tot})
            print(f"{name} mbs {mbs}: " + ", ".join(f"{c} {v[0]:.0f}/{v[1]:.0f} us" for c, v in tot.items()),
                  flush=True)
            for r in sorted(kernels, key=lambda r: -r["fwdbwd_us"])[:25]:
                print(f"   {r['class']:<9} {r['fwd_us']:9.1f} {r['fwdbwd_us'] - r['fwd_us']:9.1f} "
                      f"x{r['count_fwdbwd']:<3} {r['kernel'][:110]}")
            mod = inputs = o = None
            compute.release()
            torch.cuda.empty_cache()


def compare(path: str) -> int:
    """The catalog's H100 roofline against stored rows."""
    from autoconf.cost.attention import attention_shape_efficiency
    from autoconf.cost.roofline import Roofline
    from autoconf.specs.devices import device_type

    data = json.load(open(path))
    dev = device_type("h100-sxm")
    rf = Roofline.of(dev, "bf16")
    peak = rf.peak_flop_per_s
    ef, eb = rf.attention_efficiency
    print(f"attention (catalog h100-sxm: forward {ef:.2f}, backward {eb:.2f} of {peak / 1e12:.0f} TFLOP/s at head "
          f"dim 128 on long sequences; the model's column scales it by shape, for the default backend)")
    print(f"{'backend':<10} {'d':>4} {'s':>6} | {'fwd frac':>8} {'bwd frac':>8} | {'model fwd':>9} {'model bwd':>9}")
    for r in data["attention"]:
        if "error" in r:
            continue
        mf, mb = attention_shape_efficiency(rf, ef, eb, r["head_dim"], r["seq"])
        print(f"{r['backend']:<10} {r['head_dim']:>4} {r['seq']:>6} | {r['flops_fwd'] / r['fwd_s'] / peak:8.3f} "
              f"{r['flops_bwd'] / r['bwd_s'] / peak:8.3f} | {mf:9.3f} {mb:9.3f}")
    if data.get("gemm"):
        print("\nGEMM sweep against the catalog's tile model (signed error of predicted time), by measured time")
        buckets: dict = {}
        for r in data["gemm"]:
            e = rf.gemm(r["m"], r["n"], r["k"], 2) / r["time_s"] - 1
            t = r["time_s"]
            key = "< 40 us (host-bound)" if t < 40e-6 else "40-200 us" if t < 200e-6 else "0.2-1 ms" if t < 1e-3 else ">= 1 ms"
            buckets.setdefault(key, []).append(e)
        for key, es in buckets.items():
            print(f"  {key:<22} n={len(es):4d} median {statistics.median(es):+6.1%} "
                  f"mean |e| {statistics.mean(abs(x) for x in es):5.1%}")
    bw = rf.memory_bandwidth_bytes_per_s * rf.memory_efficiency
    print(f"\nelement-wise (catalog: {bw / 1e9:.0f} GB/s + {rf.kernel_launch_s * 1e6:.0f} us per kernel)")
    for r in data["elementwise"]:
        pred = rf.elementwise(r["bytes"])
        print(f"{r['bytes']:>12} | measured {r['time_s'] * 1e6:9.2f} us | model {pred * 1e6:9.2f} us | "
              f"{(pred / r['time_s'] - 1) * 100:+6.1f}%")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write the measured rows here")
    ap.add_argument("--compare", default=None, help="stored rows to hold the model against (no GPU needed)")
    ap.add_argument("--seqs", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--tokens", type=int, default=16384, help="b * s per attention call")
    ap.add_argument("--heads", type=int, default=16, help="heads at head dimension 128")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: attention,softmax,elementwise,gemm,conditions")
    ap.add_argument("--kv-groups", type=int, default=1, help="query heads per key/value head (GQA)")
    ap.add_argument("--breakdown", default="", help="models whose block to break down by kernel, e.g. gpt3-1.3b")
    ap.add_argument("--breakdown-mbs", default="1,2")
    ap.add_argument("--gemm-hiddens", default="2048,4096,5120,8192,12288,16384")
    ap.add_argument("--gemm-tps", default="1,2,4,8")
    ap.add_argument("--gemm-tokens", default="2048,4096,8192,16384")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(args.compare)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
           "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "attention": [], "softmax": [], "elementwise": [], "gemm": [], "breakdown": [], "gemm_conditions": []}
    skip = set(args.skip.split(","))
    seqs = [int(x) for x in args.seqs.split(",")]
    def save():
        if args.json:
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(out, f, indent=1)
            os.replace(tmp, args.json)

    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    if "elementwise" not in skip:
        measure_elementwise(out)
        save()
    if "softmax" not in skip:
        measure_softmax(out, [s for s in seqs if s <= 8192], args.heads)
        save()
    if "attention" not in skip:
        measure_attention(out, seqs, ints(args.head_dims), args.tokens, args.heads, args.kv_groups)
        save()
    if "gemm" not in skip:
        measure_gemms(out, ints(args.gemm_hiddens), ints(args.gemm_tps), ints(args.gemm_tokens))
        save()
    if "conditions" not in skip:
        measure_gemm_conditions(out)
        save()
    if args.breakdown:
        measure_breakdown(out, args.breakdown.split(","), ints(args.breakdown_mbs))
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
