"""The command line: thin wrappers that load inputs, call one library function, print.

Every command takes ``--json`` and then prints exactly one JSON document on stdout. Bad input is
one line on stderr and exit code 2. The tables are built in ``report``, verification lives in
``verify``, progress bars (stderr only) in ``progress``. Subcommands are registered here, from
the modules that define them; none of them imports torch until it runs.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading

from autoconf.cli.argtypes import (
    VIRTUAL_STAGES_HELP,
    framework_name,
    int_list,
    port,
    positive_int,
    recompute_modules,
    virtual_stages,
)
from autoconf.cli.catalog import cmd_devices, cmd_models
from autoconf.cli.estimate import cmd_estimate
from autoconf.cli.plan import add_plan_parser, cmd_plan
from autoconf.cli.search import cmd_search
from autoconf.cli.testbed import add_testbed_parser, cmd_testbed
from autoconf.cli.trial import add_trial_parser
from autoconf.cli.verify import add_verify_arguments
from autoconf.errors import UserError
from autoconf.space.config import DP_ALL_REDUCE, FP8_RECIPES, MOE_DISPATCHERS, PP_COMPRESSION
from autoconf.specs.frameworks import FRAMEWORK_NAMES
from autoconf.version import __version__
from profiler.cli import add_profile_parser

EPILOG = "This is autoconf-parallel (training-parallelism planner), not GNU Autoconf."


class _Parser(argparse.ArgumentParser):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        # a value that starts like a negative number (-1T, -5d, -1gbit, -1,25) is a value to check,
        # not an option: argparse's own matcher takes plain numbers only, and said "expected one
        # argument" without naming the value
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message):  # one line, exit 2 (argparse's default prints the usage too)
        sys.stderr.write(f"autoconf: error: {message} (see `autoconf {self.prog.split()[-1]} --help`)\n"
                         if " " in self.prog else f"autoconf: error: {message}\n")
        sys.exit(2)


def _add_target(p, cluster_required: bool = False):
    p.add_argument("--model", required=True, help="preset name (see `autoconf models`), model YAML, or HF config.json")
    p.add_argument("--cluster", required=cluster_required, help="cluster YAML (see examples/clusters/)")
    p.add_argument("--profile", help="a profile from `autoconf profile` (measured compute, memory, links)")
    p.add_argument("--calibration", help="calibration JSON from `autoconf search --verify K --calibrate`")
    p.add_argument("--seq-length", type=positive_int, help="override the model's sequence length")
    p.add_argument("--global-batch", type=positive_int, required=True, help="sequences per optimizer step")
    p.add_argument("--framework", default="reference", type=framework_name,
                   help=f"the runtime that will run the plan ({', '.join(FRAMEWORK_NAMES)}; name:recipe for a "
                        "release's or recipe's defaults, megatron:bridge-0.3): its defaults, buffers, overlap and knobs "
                        "are modelled, and search offers only what it can run (default: reference, this project's trainer)")
    p.add_argument("--moe-imbalance", type=float, default=1.0,
                   help="mixture of experts: the busiest expert rank's tokens over the balanced share "
                        "(default 1.0, perfectly balanced)")
    p.add_argument("--moe-dispatcher", default="alltoall", choices=MOE_DISPATCHERS,
                   help="mixture of experts: how tokens reach their experts' ranks: alltoall (every token-expert "
                        "pair) or deepep (DeepEP: once per host over the NICs, once per GPU over NVLink; Megatron's "
                        "flex dispatcher, torchtitan 0.3) (default: alltoall)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--allow-other-devices", action="store_true",
                   help="with --profile and --cluster: accept a profile measured on a device kind the cluster "
                   "lacks (refused by default, as `plan` refuses it): its measured links then replace the "
                   "cluster's between the devices it measured (a CPU profile's loopback for NVLink) and its "
                   "compute prices none of them")


def _add_plot(p, what: str):
    p.add_argument("--plot", metavar="DIR", help=f"draw {what} into DIR as PNG and SVG (needs matplotlib: "
                   "pip install 'autoconf-parallel[plot]')")


def _add_estimate_views(p):
    p.add_argument("--wide", action="store_true",
                   help="every memory term and the formula of each time term (needs more than 80 columns)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="autoconf", description="Plan data/pipeline/tensor-parallel training: "
                 "measure, search, verify, launch.", epilog=EPILOG)
    ap.add_argument("--version", action="version", version=f"autoconf (autoconf-parallel) {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("models", help="list the built-in model presets")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("devices", help="list the device catalog")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_devices)

    p = sub.add_parser("estimate", help="explain the time and memory of one configuration")
    _add_target(p)
    p.set_defaults(func=cmd_estimate)
    _add_estimate_views(p)
    p.add_argument("--dp", type=positive_int, required=True)
    p.add_argument("--pp", type=positive_int, default=1)
    p.add_argument("--tp", type=positive_int, default=1)
    p.add_argument("--micro-batch-size", type=positive_int, default=1)
    p.add_argument("--schedule", default=None, help="gpipe, 1f1b, interleaved, breadth_first (default 1f1b)")
    p.add_argument("--virtual-stages", type=positive_int, default=1)
    p.add_argument("--layered-grad-accum", action="store_true")
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3")
    p.add_argument("--recompute", default="none", help="none, selective, full")
    p.add_argument("--recompute-modules", type=recompute_modules, default=(), metavar="M,M,...",
                   help="with --recompute selective, what it recomputes (of Megatron-LM's --recompute-modules): "
                        "core_attn, layernorm, moe_act, mla_up_proj (default: the attention core)")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--cp", type=positive_int, default=1,
                   help="context-parallel degree: each sequence split over cp ranks (default 1)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp8", "tf32"),
                   help="GEMMs in the model's dtype (bf16), the linear layers' in FP8, or TF32 tensor cores (default bf16)")
    p.add_argument("--fp8-recipe", default="tensorwise", choices=FP8_RECIPES,
                   help="FP8 scaling with --precision fp8 (default tensorwise)")
    p.add_argument("--ep", type=positive_int, default=1,
                   help="expert-parallel degree of a mixture of experts (divides dp x cp and the experts)")
    p.add_argument("--moe-capacity-factor", type=float, default=None,
                   help="drop tokens beyond this multiple of an expert's balanced share (default: dropless)")
    p.add_argument("--rank-order", default="tp-dp-pp")
    p.add_argument("--stage-layers", type=int_list, metavar="N,N,...",
                   help="transformer blocks of each pipeline chunk (pp x virtual stages numbers; default: even)")
    p.add_argument("--device-order", type=int_list, metavar="D,D,...",
                   help="the device each rank runs on (a permutation of 0..world-1; default: rank r on device r)")
    for knob, what in (("overlap-grad-reduce", "overlap the data-parallel gradient reduction with the backward"),
                       ("overlap-param-gather", "prefetch ZeRO's parameter gathers behind compute"),
                       ("tp-comm-overlap", "overlap tensor-parallel communication with the GEMMs (needs SP)"),
                       ("ep-comm-overlap", "overlap expert-parallel all-to-alls with another micro-batch's "
                                           "computation (Megatron; needs ep > 1)"),
                       ("torch-compile", "compile each block with torch.compile (torchtitan)")):
        p.add_argument(f"--{knob}", action=argparse.BooleanOptionalAction, default=None,
                       help=f"{what} (default: the framework's)")
    p.add_argument("--dp-all-reduce", default="flat", choices=DP_ALL_REDUCE,
                   help="ZeRO-0/1's gradient all-reduce: flat (the collective library's) or hierarchical "
                        "(reduce-scatter inside hosts, all-reduce across, all-gather inside; reference trainer "
                        "only) (default: flat)")
    p.add_argument("--pp-compression", default="none", choices=PP_COMPRESSION,
                   help="low-rank compression of the gradients sent back between pipeline stages: none, "
                        "epilogue (only the sends after a stage's last forward), all (lossy; default: none)")
    p.add_argument("--pp-compression-rank", type=positive_int, default=16, help="rank of those factors (default 16)")
    p.add_argument("--dp-compression-stages", type=int, default=0,
                   help="PowerSGD with error feedback on the data-parallel gradients of pipeline ranks 0..K-1 "
                        "(lossy; default 0: none)")
    p.add_argument("--dp-compression-rank", type=positive_int, default=128, help="PowerSGD's rank (default 128)")
    p.add_argument("--fused-embedding-sync", action="store_true",
                   help="tied embeddings under pp: one all-reduce over the first and last stages of every replica")
    _add_plot(p, "the simulated step (timeline.*)")

    p = sub.add_parser("search", help="search the space for the fastest configuration that fits")
    _add_target(p)
    p.set_defaults(func=cmd_search)
    p.add_argument("--gpus", type=positive_int, help="use this many devices (default: all in the cluster)")
    p.add_argument("--top", type=positive_int, default=5,
                   help="show the model's K fastest configurations (exactly those: the search bounds by the K-th "
                   "best; default 5)")
    p.add_argument("--trials", type=positive_int, default=400,
                   help="sampled trials before the exhaustive branch-and-bound sweep (default 400)")
    p.add_argument("--sample-only", action="store_true",
                   help="stop after the sampled trials (no exhaustive sweep)")
    p.add_argument("--storage", default="sqlite:///autoconf-study.db",
                   help="Optuna storage URL where the trials are kept, so the same command resumes (default: "
                   "sqlite:///autoconf-study.db); 'none', `sqlite://` or `sqlite:///:memory:` keep them in memory only; "
                   "the one URL option is ?timeout=SECONDS")
    p.add_argument("--study-name", help="resume or share a study by name (default: one named after the inputs, "
                   "with a fingerprint of them: the same inputs resume it, changed ones start a new study)")
    p.add_argument("--max-micro-batch", type=positive_int, default=64)
    p.add_argument("--max-virtual-stages", type=virtual_stages, default=8, dest="max_virtual", help=VIRTUAL_STAGES_HELP)
    p.add_argument("--allow-compression", action="store_true",
                   help="let the search pick lossy communication: low-rank pipeline gradients, PowerSGD on "
                        "data-parallel gradients (Optimus-CC), and the fused embedding sync; it changes the "
                        "numerics of training (reference trainer only; default: off)")
    p.add_argument("--pp-compression-rank", type=positive_int, default=None,
                   help="with --allow-compression: rank of the pipeline-gradient factors (default 16)")
    p.add_argument("--dp-compression-rank", type=positive_int, default=None,
                   help="with --allow-compression: PowerSGD's rank on data-parallel gradients (default 128)")
    p.add_argument("--max-cp", type=positive_int, default=None,
                   help="largest context-parallel degree searched (default: seq_length / 4096, at least 1)")
    p.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp8", "tf32"),
                   help="matmul precisions searched: auto tries FP8 too where every device and the framework "
                        "run it, and TF32 tensor cores for an fp32 model (default auto)")
    p.add_argument("--fp8-recipe", default=None, choices=FP8_RECIPES,
                   help="the FP8 scaling searched (default: the framework's first that the devices run)")
    p.add_argument("--no-place", action="store_true",
                   help="no placement search: rank r on device r and layers split evenly (the default searches "
                   "which devices run each stage and group, and the layers per stage)")
    p.add_argument("--emit", metavar="DIR", help="write launch files for the best configuration: config.json (the "
                   "launch plan), node-K.sh per host, the --framework's own files, sbatch.sh and PLAN.md")
    p.add_argument("--script", metavar="FILE", help="with --emit: the node scripts run this training script under "
                   "torchrun (with the arguments after --), AUTOCONF_PLAN pointing to config.json")
    p.add_argument("script_args", nargs="*", metavar="-- ARGS", help="arguments for --script (after --)")
    add_verify_arguments(p)
    p.add_argument("--master-port", type=port, default=None,
                   help="rendezvous port written into the --emit launch files (default 29500; one host: torchrun "
                   "--standalone picks a free one)")
    p.add_argument("--wide", action="store_true",
                   help="every field in its own column, tokens/s and the time split (needs more than 80 columns)")
    p.add_argument("--quiet", action="store_true", help="no progress bars (they are drawn on stderr, when it is a "
                   "terminal)")
    _add_plot(p, "the chosen configuration's simulated step (timeline.*) and every estimated configuration's "
              "time versus memory (time-memory.*)")

    add_trial_parser(sub)  # sets func=cmd_trial
    add_profile_parser(sub)  # sets func=cmd_profile
    add_testbed_parser(sub).set_defaults(func=cmd_testbed)
    add_plan_parser(sub).set_defaults(func=cmd_plan)
    return ap



_PATH_FLAGS = ("emit", "plot", "cluster_out", "out", "calibrate", "model", "cluster", "profile",
               "calibration", "config", "script")


def _no_empty_paths(args) -> None:
    """A path flag given as '' (an unset shell variable) is refused, not read as absent."""
    for name in _PATH_FLAGS:
        if getattr(args, name, None) == "":
            raise UserError(f"--{name.replace('_', '-')} '': expected a path")


_INPUT_FLAGS = ("model", "cluster", "profile", "calibration", "config")


def _inputs_are_files(args) -> None:
    """Every input path given (a --model that names a path, not a preset) is a file to read: a
    FIFO, a device, a socket, a directory or a symlink loop is one line naming the flag, before
    anything runs (the loaders check again on the descriptor they read)."""
    from autoconf.files import check_input
    for name in _INPUT_FLAGS:
        path = getattr(args, name, None)
        if isinstance(path, str) and os.path.lexists(path):
            check_input(path, f"--{name}")


def main(argv=None) -> int:
    from autoconf import procs

    parser = build_parser()
    args = parser.parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        procs.install_terminate_handler()  # SIGTERM / SIGHUP clean up like Ctrl-C
    try:
        _no_empty_paths(args)
        _inputs_are_files(args)
        return args.func(args) or 0
    except UserError as e:
        sys.stderr.write(f"autoconf: error: {' '.join(str(e).split())}\n")  # always one line
        return 2
    except KeyboardInterrupt as e:
        with procs.deferred_signals(reraise=False):
            procs.kill_all()
            kept = getattr(e, "autoconf_kept", None)
            what = "terminated" if isinstance(e, procs.Terminated) else "interrupted"
            sys.stderr.write(f"autoconf: {what}" + (f" ({kept})" if kept else "") + "\n")
        return 128 + e.signum if isinstance(e, procs.Terminated) else 130
    finally:
        with procs.deferred_signals(reraise=False):
            procs.kill_all()


if __name__ == "__main__":
    sys.exit(main())
