"""The planner against public training runs of known size, hardware, batch and duration.

    python bench/public_runs.py

Given each run's GPU count, batch and tokens (``--batch-law fixed``), the planner's days -- with
restarts and checkpoints from a per-GPU failure rate -- against the published duration. Two
numbers per run: the configuration the team published, estimated as is (``estimate``), and the
planner's best configuration at that GPU count and batch (what autoconf would have run).

Published figures used (nothing here is fitted to them):

- BLOOM-176B (BigScience, arXiv 2211.05100, sec. 3.4-3.5 and the model card): 384 A100-80GB in 48
  nodes (8 per node, NVLink; 4 x 100 Gbit/s Omni-Path per node), Megatron-DeepSpeed with tp 4,
  pp 12, dp 8, micro-batch 2, ZeRO-1, activation checkpointing (BigScience's training script ran
  DeepSpeed at ZeRO stage 0 with bf16, which selects DeepSpeed's BF16 optimizer, its own ZeRO-1
  equivalent: the second row prices that with ``--framework deepspeed``, whose layers are AutoTP's,
  not Megatron's; the first prices Megatron-LM's runtime); global batch 2048 x 2048 tokens
  (after a ramp-up from 16 sequences, not modelled); 366B tokens; 11 March to 6 July 2022,
  about 3.5 months; 1,082,990 GPU-hours (= 117.5 days on 384 GPUs).
  Model: 70 layers, hidden 14336, 112 heads, vocabulary 250,880, ALiBi (no position parameters),
  LayerNorm, GeLU, tied embeddings, biases, no dropout. Attention as the paper's sec. 3.4.3 runs
  it: Megatron's fused scale-mask-softmax kernel over materialised scores (``attention="eager"``;
  training began in March 2022, before FlashAttention).
- Llama-2-70B (Touvron et al., arXiv 2307.09288, table 2 and sec. 2.2): 1,720,320 A100-80GB
  GPU-hours for 2T tokens, global batch 4M tokens (1,024 x 4,096), Meta's Research SuperCluster
  (InfiniBand, 200 Gbit/s per GPU). The GPU count is not published; 2,048 is assumed here, so the
  comparison is in GPU-hours (which barely depend on it).

- DeepSeek-V3 (DeepSeek-AI, arXiv 2412.19437, sec. 3.1-3.3 and table 1): 2,048 H800 GPUs, 8 per
  node on NVLink / NVSwitch, InfiniBand across nodes; 2,664K GPU-hours of pre-training on 14.8T
  tokens (= 54.2 days on 2,048 GPUs); sequence 4,096, batch 15,360 sequences (after a ramp from
  3,072 over the first 469B tokens, not modelled); FP8 mixed precision (their fine-grained 1x128 /
  128x128 scaling; priced here with the framework's FP8 recipe); pp 16, ep 64 over 8 nodes,
  ZeRO-1 data parallelism, no tensor parallelism, their DualPipe schedule, which hides the
  all-to-alls under computation, and their own all-to-all kernels (DeepEP's: a token crosses the
  NICs once per host holding its experts, at most 4 hosts by the model's node-limited routing).
  Priced with Megatron-LM's runtime: as 1F1B with the all-to-alls exposed, Megatron's all-to-all
  dispatcher (every token-expert pair on its own) or DeepEP (its flex dispatcher); and as
  Megatron-Core's combined 1F1B with DeepEP (``ep_comm_overlap``: the interleaved schedule, two
  chunks per rank, one micro-batch's all-to-alls under another's computation, DualPipe's idea),
  which needs the micro-batches per replica in multiples of pp (128: 16,384 sequences, priced per
  token) and cannot recompute in full. Each published-layout row takes the lightest recomputation
  that fits: none, Megatron-LM's recompute modules for the norms, MLA's up-projections and the
  experts' activation (what DeepSeek's framework recomputes, secs. 3.2.3 and 3.3.3), the attention
  core, everything (where none fits, the one needing the least memory). Tokens are dispatched in
  16 bits (DeepSeek's in FP8: not modelled). The H800 is an H100 SXM with NVLink cut to 400 GB/s
  (200 GB/s each way), the same compute and HBM; one 400 Gbit/s InfiniBand NIC per GPU. The model is the ``deepseek-v3`` preset
  (MLA, 1 shared + 256 routed experts, 8 active, 3 dense blocks first; without the
  multi-token-prediction module, about 2% of the compute).

Failures: 50,000 h mean time between failures per GPU, from Llama 3's 419 unexpected interruptions
in 54 days on 16,384 H100s (Dubey et al., arXiv 2407.21783, sec. 3.3.4: 54 x 24 x 16384 / 419 =
50,700 h); a checkpoint every Young/Daly interval taking 5 min to write, 30 min to restart.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autoconf.cost.estimate import estimate  # noqa: E402
from autoconf.output.plan_report import compact
from autoconf.space.config import ParallelConfig  # noqa: E402
from autoconf.specs.cluster import cluster_from_mapping  # noqa: E402
from autoconf.specs.devices import stated_accuracy  # noqa: E402
from autoconf.specs.model import ModelSpec, preset  # noqa: E402
from autoconf.timetotrain import laws as scaling  # noqa: E402
from autoconf.timetotrain.planner import plan
from autoconf.timetotrain.synthetic import synthetic_cluster  # noqa: E402

BLOOM = ModelSpec(name="bloom-176b", num_layers=70, hidden_size=14336, num_attention_heads=112, num_kv_heads=112,
                  ffn_hidden_size=4 * 14336, vocab_size=250880, seq_length=2048, activation="gelu",
                  tied_embeddings=True, dtype="bf16", norm="layernorm", position_embedding="rope", bias=True,
                  attention="eager")
JEAN_ZAY = cluster_from_mapping({"name": "jean-zay-a100", "node_groups": [
    {"count": 48, "device": "a100-80gb", "gpus_per_node": 8, "intra_node_bandwidth": "300 GB/s",
     "nics": {"count": 4, "bandwidth": "100 Gbit/s", "kind": "omnipath"}}]})
H800 = cluster_from_mapping({"name": "h800-256x8", "node_groups": [
    {"count": 256, "device": "h100-sxm", "gpus_per_node": 8, "intra_node_bandwidth": "200 GB/s",
     "nics": {"count": 8, "bandwidth": "400 Gbit/s", "kind": "infiniband"}}]})
MTBF_H, CKPT_S, RESTART_S = 50_000.0, 300.0, 1800.0
_ACC = stated_accuracy()
STATED = (f"median |error| {100 * _ACC['median_abs_error']:.1f}%, max {100 * _ACC['max_abs_error']:.0f}% "
          f"({_ACC['bench']}, {_ACC['date']})" if _ACC else "none stated (autoconf/data/accuracy.json is missing)")


def restarts(work_s: float, gpus: int) -> float:
    return scaling.expected_wall_time(work_s, MTBF_H * 3600 / gpus, CKPT_S, RESTART_S).wall_s


def main() -> None:
    t0 = time.perf_counter()
    out = Table(title="predicted against published (fixed batch, the run's GPUs; restarts included)")
    for col in ("run", "configuration", "s/step", "steps", "days", "GPU-h", "published", "ratio"):
        out.add_column(col, justify="left" if col in ("run", "configuration") else "right")

    # BLOOM-176B: the published configuration, and the planner's best at 384 GPUs, batch 2048
    steps = 366e9 / (2048 * 2048)
    pub_days = 1_082_990 / 384 / 24
    cfg = ParallelConfig(dp=8, pp=12, tp=4, micro_batch_size=2, num_micro_batches=2048 // (8 * 2), schedule="1f1b",
                         zero_stage=1, recompute="full")
    e = estimate(cfg, BLOOM, JEAN_ZAY, framework="megatron")
    days = restarts(steps * e.step_time_s, 384) / 86400
    out.add_row("BLOOM-176B, as run", compact(cfg) + f" ({'fits' if e.fits else 'OOM'})", f"{e.step_time_s:.3g}",
                f"{steps:,.0f}", f"{days:.1f}", f"{days * 24 * 384:,.0f}", f"{pub_days:.1f} d",
                f"{days / pub_days:.2f}")
    # the same run with DeepSpeed's engine as it ran BLOOM: bf16 under its pipeline engine with
    # ZeRO stage 0 selects its BF16 optimizer, which shards the fp32 states as ZeRO-1 does and adds
    # every micro-batch's gradients into its own copy (Policy.bf16_optimizer); but this framework's
    # layers are DeepSpeed's AutoTP ones, not the Megatron layers BLOOM ran, so the two rows
    # bracket Megatron-DeepSpeed rather than model it
    cfg_ds = dataclasses.replace(cfg, zero_stage=0)
    e_ds = estimate(cfg_ds, BLOOM, JEAN_ZAY, framework="deepspeed")
    days_ds = restarts(steps * e_ds.step_time_s, 384) / 86400
    out.add_row("BLOOM-176B, as run, --framework deepspeed", compact(cfg_ds) + " BF16 optimizer"
                + f" ({'fits' if e_ds.fits else 'OOM'})", f"{e_ds.step_time_s:.3g}", f"{steps:,.0f}",
                f"{days_ds:.1f}", f"{days_ds * 24 * 384:,.0f}", f"{pub_days:.1f} d", f"{days_ds / pub_days:.2f}")
    r = plan(BLOOM, cluster=JEAN_ZAY, max_gpus=384, framework="megatron", tokens=366e9, batch_law="fixed",
             global_batch=2048, mtbf_per_gpu_h=MTBF_H, checkpoint_s=CKPT_S, restart_s=RESTART_S, max_days=10_000)
    best = [x for x in r.select(method="all") if x.gpus == 384][0]
    out.add_row("BLOOM-176B, planner's best", compact(best.estimate.config), f"{best.step_time_s:.3g}",
                f"{best.steps:,.0f}", f"{best.days:.1f}", f"{best.gpu_hours:,.0f}", f"{pub_days:.1f} d",
                f"{best.days / pub_days:.2f}")
    tflops = BLOOM.model_flops_per_token() * 2048 * 2048 / e.step_time_s / 384 / 1e12
    hw = tflops * 4 / 3  # with full recomputation the hardware does 4 passes of 3
    notes = [f"BLOOM as run: predicted {tflops:.0f} model TFLOP/s per GPU ({hw:.0f} with recomputation); "
             "the BLOOM paper reports about 150 TFLOP/s (156 at best, hardware FLOPs)"]

    # Llama-2-70B: 2,048 GPUs assumed, compared in GPU-hours
    ll = preset("llama-2-70b")
    cl = synthetic_cluster("a100-80gb", 2048, "ib")
    r2 = plan(ll, cluster=cl, max_gpus=2048, framework="megatron", tokens=2e12, batch_law="fixed", global_batch=1024,
              mtbf_per_gpu_h=MTBF_H, checkpoint_s=CKPT_S, restart_s=RESTART_S, max_days=10_000)
    b2 = [x for x in r2.select(method="all") if x.gpus == 2048][0]
    pub_h = 1_720_320
    out.add_row("Llama-2-70B, planner's best (2,048 GPUs assumed)", compact(b2.estimate.config),
                f"{b2.step_time_s:.3g}", f"{b2.steps:,.0f}", f"{b2.days:.1f}", f"{b2.gpu_hours:,.0f}",
                f"{pub_h:,} GPU-h", f"{b2.gpu_hours / pub_h:.2f}")
    m2 = 6 * ll.num_params() * 2e12 / (pub_h * 3600) / 312e12
    notes.append(f"Llama-2-70B: the published GPU-hours mean {100 * m2:.0f}% of peak (6ND model FLOPs); the planner's "
                 f"best runs at {100 * b2.estimate.mfu:.0f}% MFU")

    # DeepSeek-V3: the published layout estimated as is, and the planner's best on 2,048 H800s, with
    # Megatron-LM's all-to-all dispatcher and with DeepEP (DeepSeek's own, with node-limited routing)
    ds = preset("deepseek-v3")
    ds_steps = 14.8e12 / (15360 * 4096)
    ds_pub = 2_664_000
    judged = []

    def ds_row(name, c, steps):
        e_ = estimate(c, ds, H800, framework="megatron")
        d_ = restarts(steps * e_.step_time_s, 2048) / 86400
        out.add_row(f"DeepSeek-V3, {name}", compact(c) + f" ({'fits' if e_.fits else 'OOM'})", f"{e_.step_time_s:.3g}",
                    f"{steps:,.0f}", f"{d_:.1f}", f"{d_ * 24 * 2048:,.0f}", f"{ds_pub:,} GPU-h",
                    f"{d_ * 24 * 2048 / ds_pub:.2f}")
        judged.append((name, e_, d_))
        return e_

    # Megatron-LM's recomputation, lightest first: none; selective with the modules that free
    # what DeepSeek's own framework frees (the norms and MLA's up-projections, its sec. 3.2.3; the
    # SwiGLU output, sec. 3.3.3), without the attention core; selective as Megatron-LM's default
    # (the core); full. Where none fits, the one with the least memory
    mods = ("layernorm", "moe_act", "mla_up_proj")
    light = (("none", ()), ("selective", mods), ("selective", ()), ("full", ()))

    def first_fit(make, options=light):
        least = None
        for rc, md in options:
            c = dataclasses.replace(make(rc), recompute_modules=md)
            e_ = estimate(c, ds, H800, framework="megatron")
            if e_.fits:
                return c
            if least is None or e_.peak_memory_bytes < least[0]:
                least = (e_.peak_memory_bytes, c)
        return least[1]

    for disp in ("alltoall", "deepep"):
        cfg3 = first_fit(lambda rc: ParallelConfig(
            dp=128, pp=16, tp=1, micro_batch_size=1, num_micro_batches=15360 // 128, schedule="1f1b", zero_stage=1,
            recompute=rc, ep=64, precision="fp8", fp8_recipe="tensorwise", moe_dispatcher=disp))
        ds_row(f"published layout, 1F1B, {disp}", cfg3, ds_steps)
    # DualPipe pairs one micro-batch's forward with another's backward and runs the all-to-alls of
    # each under the other's computation, two chunks per rank: the same idea as Megatron-Core's
    # combined 1F1B (ep_comm_overlap), which needs the interleaved schedule, and that needs the
    # micro-batches in multiples of pp: 128 per replica (16,384 sequences), priced per token. It
    # cannot run with full recomputation: the first that fits of the lighter ones
    cfg4 = first_fit(lambda rc: dataclasses.replace(cfg3, num_micro_batches=128, schedule="interleaved",
                                                    virtual_stages=2, recompute=rc, ep_comm_overlap=True),
                     light[:3])
    ds_row("published layout, paired, deepep (16,384 sequences)", cfg4, 14.8e12 / (128 * 128 * 4096))
    for disp in ("alltoall", "deepep"):
        r3 = plan(ds, cluster=H800, max_gpus=2048, framework="megatron", tokens=14.8e12, batch_law="fixed",
                  global_batch=15360, precision="fp8", mtbf_per_gpu_h=MTBF_H, checkpoint_s=CKPT_S,
                  restart_s=RESTART_S, max_days=10_000, moe_dispatcher=disp)
        b3 = [x for x in r3.select(method="all") if x.gpus == 2048][0]
        out.add_row(f"DeepSeek-V3, planner's best, {disp}", compact(b3.estimate.config), f"{b3.step_time_s:.3g}",
                    f"{b3.steps:,.0f}", f"{b3.days:.1f}", f"{b3.gpu_hours:,.0f}", f"{ds_pub:,} GPU-h",
                    f"{b3.gpu_hours / ds_pub:.2f}")
        judged.append((f"planner's best, {disp}", b3.estimate, b3.days))
    for name, e_, days in judged:
        a2a = e_.breakdown_s.get("ep_comm", 0.0)
        without = (e_.step_time_s - a2a) / e_.step_time_s * days * 24 * 2048 / ds_pub
        notes.append(f"DeepSeek-V3, {name}: all-to-alls exposed {100 * a2a / e_.step_time_s:.0f}% of the step; "
                     f"without them {without:.2f} of the published GPU-hours; peak "
                     f"{e_.peak_memory_bytes / 2**30:.0f} GiB of {e_.memory_by_stage[0].capacity / 2**30:.0f}")
    con = Console(width=140)
    con.print(out)
    for n in notes:
        con.print(n)
    con.print(f"restarts: MTBF {MTBF_H:,.0f} h per GPU, {CKPT_S:g} s per checkpoint, {RESTART_S:g} s per restart; "
              f"the cost model's stated step-time accuracy: {STATED}")
    con.print(f"wall {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
