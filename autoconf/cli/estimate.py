"""``autoconf estimate``: one configuration's time and memory, term by term.
"""

from __future__ import annotations

from autoconf.cli.common import _load_inputs, _print_json
from autoconf.errors import UserError


def cmd_estimate(args) -> int:
    from autoconf.cost.estimate import estimate
    from autoconf.space.config import ParallelConfig
    model, cluster, profile, calibration = _load_inputs(args)
    if cluster is not None and profile is not None and not args.allow_other_devices:
        from autoconf.specs.profile import check_profile_devices
        check_profile_devices(profile, cluster.device_kinds(), allow="--allow-other-devices")
    if args.plot:
        from autoconf.output.plots import check_plotting
        check_plotting(args.plot)
    per_replica = args.dp * args.micro_batch_size
    if args.global_batch % per_replica:
        raise UserError(f"--global-batch {args.global_batch} is not divisible by dp({args.dp}) x "
                        f"micro-batch-size({args.micro_batch_size}) = {per_replica}")
    schedule = args.schedule or ("breadth_first" if args.virtual_stages > 1 and args.layered_grad_accum
                                 else "interleaved" if args.virtual_stages > 1 else "1f1b")
    config = ParallelConfig(dp=args.dp, pp=args.pp, tp=args.tp, micro_batch_size=args.micro_batch_size,
                            num_micro_batches=args.global_batch // per_replica, schedule=schedule,
                            virtual_stages=args.virtual_stages, layered_grad_accum=args.layered_grad_accum,
                            zero_stage=args.zero, recompute=args.recompute, recompute_modules=args.recompute_modules,
                            sequence_parallel=args.sequence_parallel, rank_order=args.rank_order,
                            overlap_grad_reduce=args.overlap_grad_reduce,
                            overlap_param_gather=args.overlap_param_gather, tp_comm_overlap=args.tp_comm_overlap,
                            ep_comm_overlap=args.ep_comm_overlap,
                            dp_all_reduce=args.dp_all_reduce, device_order=args.device_order,
                            stage_layers=args.stage_layers, cp=args.cp, precision=args.precision,
                            fp8_recipe=args.fp8_recipe, torch_compile=args.torch_compile, ep=args.ep,
                            moe_capacity_factor=args.moe_capacity_factor, pp_compression=args.pp_compression,
                            pp_compression_rank=args.pp_compression_rank,
                            dp_compression_stages=args.dp_compression_stages,
                            dp_compression_rank=args.dp_compression_rank,
                            fused_embedding_sync=args.fused_embedding_sync, moe_dispatcher=args.moe_dispatcher)
    e = estimate(config, model, cluster, profile, calibration, framework=args.framework,
                 moe_imbalance=args.moe_imbalance)
    from autoconf.files import fail_after, side_output
    plots, failed = [], None
    if args.plot:
        from autoconf.output.plots import plot_estimate
        plots, failed = side_output("--plot", args.plot, lambda: plot_estimate(
            args.plot, e, model, cluster, profile, calibration, args.framework), [])
    if args.json:
        _print_json({**e.to_dict(), "plots": plots} if plots else e.to_dict())
    else:
        from autoconf.output.tables import estimate_report, show
        show(estimate_report(e, wide=args.wide))
        if plots:
            print(f"plots: {', '.join(plots)}")
    fail_after([failed])
    return 0
