"""Host issue time against device time of one transformer layer on a CUDA device, and GEMMs whose
leading dimension is not a multiple of 16 bytes.

An eager framework issues every kernel from Python; the device runs them asynchronously. A layer
pass costs max(host, device) in steady state. This measures, per (layer, micro-batch size,
recompute mode):

- ``sync``: forward and backward each timed between two ``torch.cuda.synchronize`` calls (what a
  per-call timing sees: host and device in series at the ends);
- ``stream``: ``--repeats`` forward+backward passes back to back with CUDA events between them and
  one synchronisation at the end (what a training step sees);
- ``host``: wall time to issue the pass while the device is held busy by a long ``torch.cuda._sleep``
  (nothing waits on the device). An upper bound: on an H100 it read about 1.9x the issue time a
  back-to-back pass shows where it is host-bound (GPT-3 1.3B block, micro-batch 1: 1.30 ms
  against 0.69 ms forward), so the driver issues more slowly behind a busy device;
- ``device``: CUDA events around the same pass queued behind the sleep (no host gaps: the device's
  own time).

and the GEMM rate of the vocabulary projection at the model's vocabulary and at it padded to a
multiple of 8 and of 128 (forward, input gradient, weight gradient).

    python bench/gpu_host_device.py --model gpt3-1.3b --micro-batch-sizes 1,2,4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    import torch

    from autoconf.specs.hf import load_model
    from profiler import compute

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt3-1.3b")
    ap.add_argument("--micro-batch-sizes", default="1,2,4")
    ap.add_argument("--recompute", default="none,selective,full")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model = load_model(args.model)
    mbs_list = [int(x) for x in args.micro_batch_sizes.split(",")]
    modes = [m for m in args.recompute.split(",") if m]
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": model.to_dict(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "layers": [], "gemm": []}

    # cycles per second of torch.cuda._sleep, to hold the device long enough
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    cycles_per_s = 100_000_000 / (time.perf_counter() - t0)

    print(f"{'layer':<6} {'mbs':>3} {'rc':<9} | {'sync f/b ms':>15} | {'stream f/b ms':>15} | "
          f"{'host f/b ms':>15} | {'device f/b ms':>15}")
    items = [("head", m, "none") for m in mbs_list] + [("block", m, rc) for m in mbs_list for rc in modes]
    for layer, mbs, rc in items:
        mod, inputs = compute.build(model, layer, mbs, 1, rc, False, device)
        mod.train()
        cache: dict = {}

        def fwd():
            return mod(*inputs)

        def bwd(o):
            compute._backward(o, cache)

        for _ in range(3):
            bwd(fwd())
        torch.cuda.synchronize()
        # sync per call
        sf, sb = [], []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            o = fwd()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            bwd(o)
            torch.cuda.synchronize()
            sf.append(t1 - t0)
            sb.append(time.perf_counter() - t1)
        # back to back with events, one block per pass (the profiler's own timing)
        stf, stb = compute._stream_times(mod, inputs, cache, args.repeats)
        # host issue time and device time behind a sleep
        hf, hb, df, db = [], [], [], []
        for _ in range(max(3, args.repeats // 2)):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(cycles_per_s * 0.3))
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            t0 = time.perf_counter()
            o = fwd()
            t1 = time.perf_counter()
            e1.record()
            bwd(o)
            t2 = time.perf_counter()
            e2.record()
            busy = torch.cuda.Event()
            busy.record()
            still_busy = not busy.query()
            torch.cuda.synchronize()
            if still_busy:  # the host finished issuing before the device was free: a clean measurement
                hf.append(t1 - t0)
                hb.append(t2 - t1)
                df.append(e0.elapsed_time(e1) / 1e3)
                db.append(e1.elapsed_time(e2) / 1e3)
        med = statistics.median
        row = {"layer": layer, "micro_batch_size": mbs, "recompute": rc,
               "sync_s": [med(sf), med(sb)], "stream_s": [med(stf), med(stb)],
               "host_s": [med(hf), med(hb)] if hf else None, "device_s": [med(df), med(db)] if df else None}
        out["layers"].append(row)

        def fb(p):
            return f"{p[0] * 1e3:7.3f}/{p[1] * 1e3:7.3f}" if p else f"{'-':>15}"

        print(f"{layer:<6} {mbs:>3} {rc:<9} | {fb(row['sync_s'])} | {fb(row['stream_s'])} | "
              f"{fb(row['host_s'])} | {fb(row['device_s'])}", flush=True)
        mod = inputs = o = None
        compute.release()
        torch.cuda.empty_cache()

    # the vocabulary projection: aligned or not
    dtype = torch.bfloat16
    h, v = model.hidden_size, model.vocab_size
    pads = sorted({v, -(-v // 8) * 8, -(-v // 128) * 128})
    print(f"\nvocabulary projection, hidden {h}: TFLOP/s forward / input grad / weight grad")
    for tokens in [model.seq_length * m for m in mbs_list]:
        for vv in pads:
            x = torch.randn(tokens, h, device=device, dtype=dtype)
            w = torch.randn(vv, h, device=device, dtype=dtype)
            gy = torch.randn(tokens, vv, device=device, dtype=dtype)
            ops = {"forward": lambda: x @ w.t(), "input_grad": lambda: gy @ w, "weight_grad": lambda: gy.t() @ x}
            rates = {}
            for name, fn in ops.items():
                for _ in range(3):
                    fn()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(10):
                    fn()
                e1.record()
                torch.cuda.synchronize()
                rates[name] = 2.0 * tokens * vv * h / (e0.elapsed_time(e1) / 1e3 / 10)
            out["gemm"].append({"tokens": tokens, "hidden": h, "vocab": vv, "flop_per_s": rates})
            print(f"  tokens {tokens:6d} vocab {vv:6d} (mod 8 = {vv % 8}): "
                  + " / ".join(f"{r / 1e12:6.0f}" for r in rates.values()), flush=True)
            x = w = gy = None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
