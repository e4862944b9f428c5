"""PLAN.md: what ``--emit`` chose, why (the estimate's terms), the runners-up, and how to run it."""

from __future__ import annotations

import re

from autoconf.launch.gaps import gaps
from autoconf.launch.hosts import host_roles
from autoconf.launch.shell import comment

_TERMS = (("compute", "compute (forward + backward)"), ("recompute", "recomputation"),
          ("bubble", "pipeline bubble"), ("tp_comm", "tensor-parallel communication (exposed)"),
          ("cp_comm", "context-parallel key/value exchange (exposed)"),
          ("ep_comm", "mixture-of-experts dispatch and combine (exposed)"),
          ("pp_comm", "pipeline transfers (exposed)"), ("dp_comm", "data-parallel communication (exposed)"),
          ("optimizer", "optimizer step"))
_MEMORY = ("parameters", "gradients", "optimizer", "activations", "other")
_FRAMEWORK_RUNS = {
    "reference": "autoconf's reference trainer (`python -m autoconf.trainer`), which runs every part of the plan",
    "megatron": "Megatron-LM's `pretrain_gpt.py` with the arguments of `megatron_args.sh` (set `MEGATRON_LM` to "
                "your checkout; give your data, tokenizer and optimizer arguments after the script)",
    "torchtitan": "torchtitan 0.3's `torchtitan.train` with the overrides of `torchtitan_args.sh` (set "
                  "`TORCHTITAN_CONFIG` to a config function with this model's shape, `TORCHTITAN_MODULE` if not "
                  "llama3); `torchtitan.toml` holds the same settings for torchtitan 0.2 (`--job.config_file`)",
    "deepspeed": "your DeepSpeed training script (`DEEPSPEED_SCRIPT`) with `--deepspeed --deepspeed_config "
                 "ds_config.json`",
}


def _code(text) -> str:
    """``text`` as one Markdown code span that shows it whole: control characters escaped
    (:func:`comment`), fenced by more backticks than its longest run of them, and padded with a
    space where it starts or ends with a backtick or a space (CommonMark strips one such space)."""
    t = comment(text)
    fence = "`" * (max(map(len, re.findall("`+", t)), default=0) + 1)
    pad = " " if t[:1] in ("`", " ") or t[-1:] in ("`", " ") else ""
    return f"{fence}{pad}{t}{pad}{fence}"


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def _why(estimate) -> list[str]:
    total = estimate.step_time_s
    out = ["## Why", "", "The cost model's step time, term by term (they add up to the step):", "",
           "| term | seconds | share |", "|---|---:|---:|"]
    for key, label in _TERMS:
        v = estimate.breakdown_s.get(key, 0.0)
        if v:
            out.append(f"| {label} | {v:.4g} | {v / total:.0%} |")
    out.append(f"| **step** | **{total:.4g}** | |")
    worst = max(estimate.memory_by_stage, key=lambda m: m.total)
    stage = list(estimate.memory_by_stage).index(worst)
    out += ["", f"Memory of the most loaded device (pipeline stage {stage}), of {_gib(worst.capacity)} usable:", "",
            "| part | bytes |", "|---|---:|"]
    out += [f"| {k} | {_gib(getattr(worst, k))} |" for k in _MEMORY]
    out.append(f"| **total** | **{_gib(worst.total)}** |")
    if estimate.notes:
        out += ["", "Notes of the estimate:", ""] + [f"- {comment(n)}" for n in estimate.notes]
    return out


def _runners_up(best, runners_up) -> list[str]:
    if not runners_up:
        return []
    out = ["", "## Runners-up", "", "| # | configuration | step time | vs the choice | peak memory |",
           "|---:|---|---:|---:|---:|"]
    for i, e in enumerate(runners_up, start=2):
        out.append(f"| {i} | `{e.config.short()}` | {e.step_time_s:.4g} s | "
                   f"{e.step_time_s / best.step_time_s - 1:+.1%} | {_gib(e.peak_memory_bytes)} |")
    return out


def _run(plan, hosts, visible, script) -> list[str]:
    nnodes = len(hosts)
    named = bool(plan.cluster.node_groups[0].hosts)
    what = (f"your script {_code(script)} (it reads the plan with `autoconf.load_plan()`; `AUTOCONF_PLAN` "
            "points to `config.json`)" if script else _FRAMEWORK_RUNS[plan.framework_name])
    out = ["", "## Run", "", f"Each node script starts this host's processes under torchrun and runs {what}. "
           "Arguments given to a node script are passed on."]
    if nnodes == 1:
        out.append("")
    elif named:
        out += ["", f"Run each script on its host (any order; each waits for the others). MASTER_ADDR defaults to "
                    f"{_code(hosts[0]['host'])} (host 0); set it where that name does not resolve to host 0 on "
                    "every host. The static rendezvous gives each host the ranks below, so every host runs the "
                    "stages the plan gave it:", ""]
    else:
        out += ["", "Set MASTER_ADDR to node 0's address on every host, then run each script on its host (the "
                    "static rendezvous gives each host the ranks below, so every host runs the stages the plan "
                    "gave it):", ""]
    for k, (p, vis) in enumerate(zip(hosts, visible)):
        roles = host_roles(plan.config, plan.model.num_layers, p["first_rank"], p["nproc"])
        gpus = f", GPUs {vis}" if vis is not None else ""
        out.append(f"- host {_code(p['host'])} (processes {p['first_rank']}..{p['first_rank'] + p['nproc'] - 1}"
                   f"{roles}{gpus}): `bash node-{k}.sh`")
    out += ["", "Under SLURM: `sbatch sbatch.sh` (one task per node, each running its node script; the launch "
                "directory must be on a file system the nodes share, or set `AUTOCONF_LAUNCH_DIR`).",
            "", "Check the plan against a real run of the reference trainer: `autoconf trial --config config.json`."]
    if plan.framework_name == "reference" and not script:
        out.append("Each rank writes its results under `results/`.")
    missing = gaps(plan, plan.framework_name)
    if missing and not script:
        out += ["", f"{plan.framework} cannot express these parts of the plan, so its run will differ there:", ""]
        out += [f"- {comment(g)}" for g in missing]
    return out


def _shape(plan) -> str:
    """The parallel shape: every axis's degree, and the matmul precision."""
    c = plan.config
    axes = " x ".join(f"{a} {getattr(c, a)}" for a in ("dp", "pp", "tp", "cp"))
    seq = (f"; context parallelism splits each {plan.model.seq_length}-token sequence over {c.cp} ranks "
           f"({plan.model.seq_length // c.cp} tokens each)" if c.cp > 1 else "")
    precision = (f"linear layers' matmuls in FP8 with {c.fp8_recipe} scaling (attention and the output layer in "
                 f"{plan.model.dtype})" if c.precision == "fp8" else f"matmuls in {plan.model.dtype}")
    return f"Parallel shape: {axes} = {plan.world_size} ranks{seq}; precision: {precision}."


def _moe(plan) -> str:
    """The mixture-of-experts shape: experts, top-k, shared experts, expert parallelism, routing."""
    c, m = plan.config, plan.model
    shared = f" + {m.num_shared_experts} shared" if m.num_shared_experts else ""
    blocks = (f"in all {m.num_layers} blocks" if m.num_moe_layers == m.num_layers
              else f"in {m.num_moe_layers} of {m.num_layers} blocks")
    ep = (f"expert parallelism ep {c.ep} ({m.num_experts // c.ep} experts per rank)" if c.ep > 1
          else "no expert parallelism (every rank holds all experts)")
    routing = ("dropless routing" if c.moe_capacity_factor is None
               else f"capacity factor {c.moe_capacity_factor:g} (tokens beyond an expert's capacity skip it)")
    if m.group_limited:
        routing += f", each token inside its best {m.router_group_topk} of {m.router_groups} expert groups"
    if c.ep > 1:
        ep += ("; tokens dispatched by DeepEP (once per host over the NICs)" if c.moe_dispatcher == "deepep"
               else "; tokens dispatched by all-to-alls")
        if c.ep_comm_overlap:
            ep += ", under another micro-batch's computation (combined 1F1B)"
    return (f"Mixture of experts: {m.num_experts} experts{shared}, top-{m.experts_per_token} ({m.router} router), "
            f"{blocks}; {ep}; {routing}.")


def plan_markdown(plan, estimate, hosts, visible, script, runners_up) -> str:
    e = plan.expected
    lines = [f"# Plan: {comment(plan.model.name)} on {comment(plan.cluster.name)}", "",
             f"**`{plan.config.short()}`** for {plan.framework}: {plan.world_size} processes on {len(hosts)} "
             f"host{'s' if len(hosts) > 1 else ''}, global batch {plan.global_batch} "
             f"({plan.dp} replicas x {plan.micro_batch_size} sequences x {plan.num_micro_batches} micro-batches).", "",
             _shape(plan), "",
             *([_moe(plan), ""] if plan.model.is_moe else []),
             f"Predicted: {e.step_time_s:.4g} s per step, {e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu:.1%}, peak "
             f"memory {_gib(e.peak_memory_bytes)} per device.", ""]
    lines += _why(estimate)
    lines += _runners_up(estimate, runners_up)
    lines += _run(plan, hosts, visible, script)
    return "\n".join(lines) + "\n"
