"""``autoconf plan``: its flags, and the command (the planner: ``timetotrain``).
"""

from __future__ import annotations

import math

from autoconf.cli.argtypes import VIRTUAL_STAGES_HELP, virtual_stages
from autoconf.errors import UserError
from autoconf.output.plots import write_plots
from autoconf.space.config import MOE_DISPATCHERS
from autoconf.specs.units import float_list, parse_count, parse_duration
from autoconf.timetotrain.planner import BATCH_FACTORS_DEFAULT, MAX_MICRO_BATCH, plan
from autoconf.timetotrain.synthetic import NETWORKS, NODES, cluster_yaml


def add_plan_parser(sub):
    from autoconf.cli.argtypes import framework_name
    from autoconf.space.config import FP8_RECIPES
    p = sub.add_parser("plan", help="how many GPUs, how long, what cost: the shortest time to train a model")
    p.add_argument("--model", required=True, help="preset name (see `autoconf models`), model YAML, or HF config.json")
    p.add_argument("--seq-length", type=int, help="override the model's sequence length")
    p.add_argument("--device", help=f"GPU kind of a synthetic DGX-style cluster ({', '.join(NODES)})")
    p.add_argument("--max-gpus", type=int, help="the largest GPU count worth considering (default with --device: "
                   "until more GPUs stop paying; with --cluster: its size)")
    p.add_argument("--network", default="ib", help="ib (InfiniBand, a NIC per GPU), 100gbe or 25gbe (one "
                   "Ethernet NIC per node) (default ib)")
    p.add_argument("--compare-networks", default="25gbe",
                   help="slower networks to run the same sweep on, comma-separated, or none (default 25gbe)")
    p.add_argument("--cluster", help="a cluster file instead of --device (GPU counts up to its size)")
    p.add_argument("--framework", default="reference", type=framework_name,
                   help="the runtime that will run the plan (default: reference); name:recipe for a release's or "
                        "recipe's defaults (megatron:bridge-0.3)")
    p.add_argument("--profile", help="a profile from `autoconf profile` taken on the cluster's device kind: its "
                   "measured compute and collective efficiency price the devices, its links the first hosts (as "
                   "`search --profile`)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp8"),
                   help="matmul precision of every plan (default bf16, the model's dtype)")
    p.add_argument("--fp8-recipe", default=None, choices=FP8_RECIPES,
                   help="FP8 scaling with --precision fp8 (default: the framework's first the device runs)")
    p.add_argument("--place", action="store_true",
                   help="search's placement (device order, uneven layer splits) on the fastest plan of each GPU "
                   "count (reference trainer; up to 30 s more)")
    p.add_argument("--max-cp", type=int, default=None,
                   help="largest context-parallel degree (default: seq_length / 4096, at least 1)")
    p.add_argument("--tokens", help="tokens to train on, e.g. 2T (default: 20 per parameter, Chinchilla)")
    p.add_argument("--batch-law", default="kaplan", help="kaplan (critical batch), deepseek (B_opt(C)) or "
                   "fixed (--global-batch) (default kaplan)")
    p.add_argument("--loss-law", default="kaplan", help="kaplan or chinchilla: the loss B_crit is read at "
                   "(default kaplan, the loss B_crit was fitted to)")
    p.add_argument("--global-batch", type=int, help="sequences per step (--batch-law fixed)")
    p.add_argument("--batch-factors", default=BATCH_FACTORS_DEFAULT,
                   help="batches swept, as multiples of B_crit (kaplan; default 0.25,0.5,1,2)")
    p.add_argument("--price-per-gpu-hour", type=float, help="price of one GPU-hour (costs in that currency)")
    p.add_argument("--deadline", help="the cheapest plan finishing within it, e.g. 60d, 8w")
    p.add_argument("--budget", help="the fastest plan costing at most this, e.g. 20M (needs --price-per-gpu-hour)")
    p.add_argument("--mtbf-per-gpu", help="mean time between failures of one GPU (with its share of the node), "
                   "e.g. 50000h: restarts and checkpoints enter the days")
    p.add_argument("--checkpoint-time", default="2min", help="time to write a checkpoint (default 2min)")
    p.add_argument("--restart-time", default="10min", help="time to restart after a failure (default 10min)")
    p.add_argument("--max-days", default="365", help="leave out GPU counts that would take longer even at the "
                   "datasheet peak (default 365 days)")
    p.add_argument("--max-micro-batch", type=int, default=MAX_MICRO_BATCH)
    p.add_argument("--max-virtual-stages", type=virtual_stages, default=8, dest="max_virtual", help=VIRTUAL_STAGES_HELP)
    p.add_argument("--moe-imbalance", type=float, default=1.0,
                   help="mixture of experts: the busiest expert rank's tokens over the balanced share "
                        "(default 1.0, perfectly balanced; as `search`)")
    p.add_argument("--moe-dispatcher", default="alltoall", choices=MOE_DISPATCHERS,
                   help="mixture of experts: the token dispatcher, alltoall or deepep (as `search`)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--plot", metavar="DIR", help="write days_vs_gpus and cost_vs_days as PNG and SVG")
    p.add_argument("--cluster-out", metavar="FILE", help="write the synthetic cluster file of the main network")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _load_profile(path: str, cluster, device):
    """The --profile, measured on the cluster's (or --device's) kind: estimate's check and message."""
    from autoconf.specs.profile import check_profile_devices, load_profile, measured_device_kind
    profile = load_profile(path)
    kinds = cluster.device_kinds() if cluster is not None else [device] if device in NODES else None
    if kinds:
        kind = measured_device_kind(profile)
        check_profile_devices(profile, kinds, f"--device {kind} or a cluster file of it" if kind in NODES
                              else "a cluster file of it")
    return profile


def cmd_plan(args) -> int:
    import json
    import sys

    from autoconf.files import check_file, fail_after, side_output, write_text
    from autoconf.specs.hf import load_model
    if args.seq_length is not None and args.seq_length <= 0:
        raise UserError(f"--seq-length {args.seq_length}: must be a positive integer")
    model = load_model(args.model, seq_length=args.seq_length)
    cluster = None
    if args.cluster:
        from autoconf.specs.cluster import load_cluster
        cluster = load_cluster(args.cluster)
    profile = _load_profile(args.profile, cluster, args.device) if args.profile else None
    if args.max_gpus is not None and args.max_gpus <= 0:
        raise UserError(f"--max-gpus {args.max_gpus}: must be a positive integer")
    if args.global_batch is not None and args.global_batch <= 0:
        raise UserError(f"--global-batch {args.global_batch}: must be a positive integer")
    if args.max_cp is not None and args.max_cp <= 0:
        raise UserError(f"--max-cp {args.max_cp}: must be a positive integer")
    if args.max_micro_batch <= 0:
        raise UserError(f"--max-micro-batch {args.max_micro_batch}: must be a positive integer")
    compare = () if args.compare_networks.strip().lower() in ("", "none") else tuple(
        x.strip() for x in args.compare_networks.split(","))
    for n in (args.network, *compare):
        if n not in NETWORKS:
            raise UserError(f"network {n!r}; valid: {', '.join(NETWORKS)}")
    tokens = parse_count(args.tokens, "--tokens") if args.tokens else None
    price = args.price_per_gpu_hour
    if price is not None and not (math.isfinite(price) and price > 0):
        raise UserError(f"--price-per-gpu-hour {price}: must be a positive number")
    budget = parse_count(args.budget, "--budget") if args.budget else None
    if budget is not None and price is None:
        raise UserError("--budget is in money: give --price-per-gpu-hour too")
    deadline = parse_duration(args.deadline, "--deadline") / 86400 if args.deadline else None
    mtbf = parse_duration(args.mtbf_per_gpu, "--mtbf-per-gpu", "h") / 3600 if args.mtbf_per_gpu else None
    ckpt = parse_duration(args.checkpoint_time, "--checkpoint-time", "s")
    restart = parse_duration(args.restart_time, "--restart-time", "s", allow_zero=True)
    max_days = parse_duration(args.max_days, "--max-days") / 86400
    factors = float_list(args.batch_factors, "--batch-factors")
    if args.batch_factors != BATCH_FACTORS_DEFAULT and args.batch_law != "kaplan":
        raise UserError(f"--batch-factors {args.batch_factors}: they scale the critical batch of --batch-law kaplan; "
                        f"--batch-law {args.batch_law} sets the batch itself")
    if args.plot:
        from autoconf.output.plots import check_plotting
        check_plotting(args.plot)
    if args.cluster_out:
        check_file(args.cluster_out, "--cluster-out")
    bar = None
    if not args.quiet and not args.json and sys.stderr.isatty():
        from rich.progress import Progress
        bar = Progress(transient=True)
        bar.add_task("plan", total=None)
        bar.start()

    def progress(done, total):
        if bar is not None:
            bar.update(bar.task_ids[0], completed=done, total=total)
    try:
        r = plan(model, device=args.device, max_gpus=args.max_gpus, network=args.network, cluster=cluster,
                 framework=args.framework, tokens=tokens, batch_law=args.batch_law, loss_law=args.loss_law,
                 global_batch=args.global_batch, batch_factors=factors, price_per_gpu_hour=price,
                 deadline_days=deadline, budget=budget, compare_networks=compare if cluster is None else (),
                 mtbf_per_gpu_h=mtbf, checkpoint_s=ckpt, restart_s=restart, max_days=max_days,
                 max_micro_batch=args.max_micro_batch, max_virtual=args.max_virtual, progress=progress, profile=profile,
                 precision=args.precision, fp8_recipe=args.fp8_recipe, max_cp=args.max_cp, place=args.place,
                 moe_imbalance=args.moe_imbalance, moe_dispatcher=args.moe_dispatcher)
    finally:
        if bar is not None:
            bar.stop()
    r.model_ref = args.model
    r.cluster_path = args.cluster or args.cluster_out
    r.profile_path = args.profile
    # the plots and the cluster file are written beside the plan: where one cannot be, the plan is
    # still printed, then the reason (exit 2)
    written, failed = [], []
    if args.plot:
        written, why = side_output("--plot", args.plot, lambda: write_plots(r, args.plot), [])
        failed.append(why)
    if args.cluster_out:
        failed.append(side_output("--cluster-out", args.cluster_out,
                                  lambda: write_text(args.cluster_out, cluster_yaml(r.cluster)))[1])
    if args.json:
        doc = r.to_dict()
        doc["plots"] = written
        sys.stdout.write(json.dumps(doc, indent=2, default=float) + "\n")
    else:
        from rich.console import Console
        con = Console(width=min(Console().width, 80))  # the report is laid out for 80 columns
        from autoconf.output.plan_report import plan_report
        plan_report(r, con)
        if written:
            con.print(f"plots: {', '.join(written)}")
        if args.cluster_out and not failed[-1]:
            con.print(f"cluster file: {args.cluster_out} (pass it to `autoconf search --cluster`)")
    fail_after(failed)
    return 0
