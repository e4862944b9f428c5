"""The launch plan: the one ``config.json`` format, written by :meth:`LaunchPlan.write` and read by
:func:`load`.

Everything that runs a plan reads it through this module: ``autoconf trial`` and ``search
--verify``, the reference trainer (``python -m autoconf.trainer --config config.json``) and a
user's own training script::

    import autoconf.launch.plan

    plan = autoconf.launch.plan.load()          # $AUTOCONF_PLAN (the emitted launch sets it), else ./config.json
    dp, pp, tp = plan.dp, plan.pp, plan.tp
    me = plan.coords()                   # {"dp": i, "pp": j, "tp": k} of this process (torchrun's RANK)
    for ranks in plan.groups("dp"):      # every data-parallel group, as torchrun ranks
        group = torch.distributed.new_group(list(ranks))
    my_blocks = plan.layers(me["pp"])    # the transformer blocks of this pipeline stage

Ranks: torchrun gives the process on device d (hosts in the cluster's order, each host's devices in
order) ``RANK`` = d. The plan's rank order may put another rank there (``device_order``, a
placement): that process plays rank :meth:`LaunchPlan.rank_on` (d). :meth:`coords` and
:meth:`groups` take care of it; coordinates come from the project's one rank-order
implementation, ``autoconf.space.degrees``.

The document (version 2)::

    {"version": 2, "created_by": "autoconf 0.1.0", "framework": "reference", "seed": 0,
     "model": ModelSpec.to_dict(), "config": ParallelConfig.to_dict(),
     "cluster": ClusterSpec.to_dict() or null, "profile": "profile.json" or null,
     "expected": {"step_time_s": ..., "peak_memory_bytes": ..., "tokens_per_s": ..., "mfu": ...,
                  "breakdown_s": {"compute": ..., ...}, "memory_bytes": {"parameters": ..., ...}} or null}

Version 1 documents (older ``--emit`` and trial files) are read too; their ``estimate`` is dropped.
Importing this module never imports torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from autoconf.errors import UserError
from autoconf.files import write_text
from autoconf.space.config import CONFIG_SCHEMA, ParallelConfig, check
from autoconf.space.degrees import AXES, full_order
from autoconf.space.placement import Placement
from autoconf.specs.cluster import SI_CLUSTER_SCHEMA, ClusterSpec
from autoconf.specs.frameworks import framework
from autoconf.specs.model import ModelSpec
from autoconf.specs.recipes import base_name
from autoconf.specs.schema import Dict, Int, Map, Null, Num, Opaque, Str, check_kind, parse_json, read_text, show_value
from autoconf.version import __version__

PLAN_VERSION = 2
READABLE_VERSIONS = (1, 2)
PLAN_ENV = "AUTOCONF_PLAN"
"""The environment variable the emitted launch sets to the plan's path."""
DEFAULT_PATH = "config.json"
_SEED_RANGE = (-(1 << 63), (1 << 64) - 1)


@dataclass(frozen=True)
class Expected:
    """What the cost model predicted for the plan (for people and for comparing with a run)."""

    step_time_s: float
    peak_memory_bytes: float
    tokens_per_s: float | None = None
    mfu: float | None = None
    breakdown_s: dict = field(default_factory=dict)
    """compute, recompute, tp_comm, bubble, pp_comm, dp_comm, optimizer: they add up to the step."""
    memory_bytes: dict = field(default_factory=dict)
    """The most loaded stage: parameters, gradients, optimizer, activations, other, capacity."""

    @classmethod
    def of(cls, estimate) -> "Expected":
        """From a cost-model Estimate."""
        worst = max(estimate.memory_by_stage, key=lambda m: m.total) if estimate.memory_by_stage else None
        memory = {} if worst is None else {k: float(getattr(worst, k)) for k in
                                           ("parameters", "gradients", "optimizer", "activations", "other",
                                            "capacity")}
        return cls(step_time_s=float(estimate.step_time_s), peak_memory_bytes=float(estimate.peak_memory_bytes),
                   tokens_per_s=float(estimate.tokens_per_s), mfu=float(estimate.mfu),
                   breakdown_s={k: float(v) for k, v in estimate.breakdown_s.items()}, memory_bytes=memory)

    def to_dict(self) -> dict:
        return {"step_time_s": self.step_time_s, "peak_memory_bytes": self.peak_memory_bytes,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "breakdown_s": dict(self.breakdown_s),
                "memory_bytes": dict(self.memory_bytes)}


def _schema():

    expected = Dict(required={"step_time_s": Num(0, 1e12), "peak_memory_bytes": Num(0, 1e18)},
                    optional={"tokens_per_s": Null(Num(0, 1e18)), "mfu": Null(Num(0, 1e3)),
                              "breakdown_s": Map(Num(0, 1e12), max_len=64),
                              "memory_bytes": Map(Num(0, 1e18), max_len=64)},
                    what="the expected step time and memory")
    return Dict(required={"model": Opaque(), "config": CONFIG_SCHEMA},  # model: ModelSpec.from_dict checks it
                optional={"version": Int(min(READABLE_VERSIONS), max(READABLE_VERSIONS)),
                          "created_by": Str(max_len=200), "cluster": Null(SI_CLUSTER_SCHEMA),
                          "profile": Null(Str(max_len=4096)), "expected": Null(expected),
                          "framework": Str(max_len=64), "seed": Int(*_SEED_RANGE)},
                what="a launch plan")


@dataclass(frozen=True)
class LaunchPlan:
    """A configuration to run, with everything needed to run it; always valid (checked on creation:
    a :class:`UserError` names what is wrong)."""

    config: ParallelConfig
    model: ModelSpec
    cluster: ClusterSpec | None = None
    """The cluster the plan was made for (hosts and devices of the launch); None: this machine."""
    framework: str = "reference"
    """The runtime it was priced for (``frameworks.FRAMEWORK_NAMES``), ``name:recipe`` where it
    follows another recipe than the framework's default (``frameworks.RECIPES``)."""
    seed: int = 0
    expected: Expected | None = None
    profile: str | None = None
    """The profile the prediction used (a path), if any."""
    created_by: str = f"autoconf {__version__}"
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:

        framework(self.framework)  # a UserError naming the valid frameworks and recipes
        if self.version not in READABLE_VERSIONS:
            raise UserError(f"version={self.version!r}; this autoconf reads version "
                            f"{' or '.join(map(str, READABLE_VERSIONS))}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1]:
            raise UserError(f"seed={self.seed!r}: expected an integer in {_SEED_RANGE[0]}..{_SEED_RANGE[1]}")
        reason = check(self.config, self.model) or framework(self.framework).check(self.config)
        if reason:
            raise UserError(f"invalid configuration ({self.config.short()}): {reason}")
        if self.cluster is not None and self.cluster.num_devices < self.config.world_size:
            raise UserError(f"the cluster has {self.cluster.num_devices} devices, the configuration needs "
                            f"{self.config.world_size}")

    # -- making one --------------------------------------------------------------------------------
    @classmethod
    def of_estimate(cls, estimate, model: ModelSpec, cluster: ClusterSpec | None = None,
                    profile: str | None = None, seed: int = 0) -> "LaunchPlan":
        """The plan of a cost-model Estimate (its configuration, framework and prediction)."""
        return cls(config=estimate.config, model=model, cluster=cluster, framework=estimate.framework,
                   seed=seed, expected=Expected.of(estimate), profile=profile)

    # -- the document -----------------------------------------------------------------------------
    @property
    def framework_name(self) -> str:
        """The framework, without its recipe (what picks the emitter)."""
        return base_name(self.framework)

    def to_dict(self) -> dict:
        return {"version": PLAN_VERSION, "created_by": self.created_by, "framework": self.framework,
                "seed": self.seed, "model": self.model.to_dict(), "config": self.config.to_dict(),
                "cluster": self.cluster.to_dict() if self.cluster is not None else None,
                "profile": self.profile, "expected": self.expected.to_dict() if self.expected else None}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def write(self, path: str) -> str:
        """Write the plan to ``path`` atomically; returns the path."""

        write_text(path, self.to_json())
        return path

    @classmethod
    def from_dict(cls, doc, where: str = "launch plan") -> "LaunchPlan":
        """Check and read a plan document; a UserError names ``where`` and the offending value."""

        if not isinstance(doc, dict):
            raise UserError(f"{where} must hold a JSON object with 'model' and 'config'")
        version = doc.get("version", 1)
        if version not in READABLE_VERSIONS:
            raise UserError(f"{where}: version={show_value(version)}; this autoconf reads version "
                            f"{' or '.join(map(str, READABLE_VERSIONS))}")
        if version == 1:  # version 1 kept the whole estimate, for people only
            doc = {k: v for k, v in doc.items() if k != "estimate"}
        for key in ("model", "config"):
            if not isinstance(doc.get(key), dict):
                raise UserError(f"{where}: missing or non-object '{key}'")
        try:
            d = _schema()(doc)
            e = d.get("expected")
            return cls(config=ParallelConfig.from_dict(d["config"]), model=ModelSpec.from_dict(d["model"]),
                       cluster=ClusterSpec.from_dict(d["cluster"]) if d.get("cluster") else None,
                       framework=d.get("framework", "reference"), seed=d.get("seed", 0),
                       expected=Expected(**e) if e else None, profile=d.get("profile"),
                       created_by=d.get("created_by", "unknown"), version=PLAN_VERSION)
        except UserError as err:
            raise UserError(f"{where}: {err}") from None

    # -- the mesh ----------------------------------------------------------------------------------
    @property
    def placement(self) -> Placement:
        return Placement.of(self.config, self.model.num_layers)

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def dp(self) -> int:
        return self.config.dp

    @property
    def pp(self) -> int:
        return self.config.pp

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def cp(self) -> int:
        return self.config.cp

    @property
    def rank_order(self) -> tuple:
        """The axes from innermost (consecutive ranks) to outermost, e.g. ("tp", "cp", "dp", "pp")."""
        return tuple(full_order(self.config.rank_order))

    @property
    def mesh(self) -> dict:
        """{"tp": .., "cp": .., "dp": .., "pp": ..}: the degree of every axis."""
        return {a: getattr(self.config, a) for a in AXES}

    @property
    def mesh_dim_names(self) -> tuple:
        """The axes from outermost to innermost: with :attr:`mesh_shape`, the arguments of
        ``torch.distributed.device_mesh.init_device_mesh`` for the plan's rank order (valid as a
        mesh of torchrun ranks when :attr:`device_order` is None)."""
        return tuple(reversed(self.rank_order))

    @property
    def mesh_shape(self) -> tuple:
        return tuple(getattr(self.config, a) for a in self.mesh_dim_names)

    @property
    def device_order(self) -> tuple | None:
        """The device (torchrun rank) each plan rank runs on; None: rank r on device r."""
        return self.config.device_order

    def rank_on(self, process_rank: int) -> int:
        """The plan rank the process with torchrun's ``RANK`` = ``process_rank`` plays."""
        self._check_rank(process_rank, "process rank")
        return self.placement.rank_on(process_rank)

    def coords(self, rank: int | None = None) -> dict:
        """{"tp": i, "cp": j, "dp": k, "pp": l} of plan rank ``rank``; None: of this process (the rank it
        plays, from torchrun's ``RANK``)."""
        if rank is None:
            rank = self.rank_on(_env_rank())
        self._check_rank(rank, "rank")
        return self.placement.coords(rank)

    def groups(self, axis: str) -> list[tuple]:
        """Every group along ``axis`` ("tp", "cp", "dp" or "pp") as torchrun ranks (the processes that
        play its ranks), each ordered by its coordinate on the axis: the ``ranks`` to give
        ``torch.distributed.new_group`` (every process must create every group, in this order)."""
        if axis not in AXES:
            raise UserError(f"axis {axis!r}; valid: {', '.join(AXES)}")
        return self.placement.device_groups(axis)

    def _check_rank(self, rank, what: str) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise UserError(f"{what} {rank!r}: expected 0..{self.world_size - 1} (the plan has "
                            f"{self.world_size} ranks)")

    # -- batching, schedule, memory savers ----------------------------------------------------------
    @property
    def schedule(self) -> str:
        """gpipe, 1f1b, interleaved or breadth_first (1f1b when pp = 1)."""
        return self.config.schedule

    @property
    def virtual_stages(self) -> int:
        return self.config.virtual_stages

    @property
    def micro_batch_size(self) -> int:
        return self.config.micro_batch_size

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step on each data-parallel replica."""
        return self.config.num_micro_batches

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: dp x micro_batch_size x num_micro_batches."""
        return self.config.global_batch

    @property
    def zero_stage(self) -> int:
        return self.config.zero_stage

    @property
    def recompute(self) -> str:
        """none, selective or full."""
        return self.config.recompute

    @property
    def sequence_parallel(self) -> bool:
        return self.config.sequence_parallel

    # -- layers ------------------------------------------------------------------------------------
    def chunks(self, stage: int) -> list[list[int]]:
        """The transformer blocks of each pipeline chunk pipeline stage ``stage`` holds (one list
        per virtual stage, in chunk order)."""
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < self.pp:
            raise UserError(f"stage {stage!r}: expected 0..{self.pp - 1}")
        pl = self.placement
        layers = pl.chunk_layers()
        return [layers[c] for c in pl.chunks_of_stage(stage)]

    def layers(self, stage: int) -> list[int]:
        """The transformer blocks (global indices) pipeline stage ``stage`` holds."""
        return [b for chunk in self.chunks(stage) for b in chunk]


def _env_rank() -> int:
    text = os.environ.get("RANK")
    if text is None:
        raise UserError("RANK is not set: run under torchrun, or pass the rank, e.g. plan.coords(0)")
    try:
        return int(text)
    except ValueError:
        raise UserError(f"RANK={text!r} is not an integer") from None


def default_path() -> str:
    """Where :func:`load` reads without a path: ``$AUTOCONF_PLAN``, else ``config.json``."""
    return os.environ.get(PLAN_ENV) or DEFAULT_PATH


def load(path: str | None = None) -> LaunchPlan:
    """Read and check a plan file (default: :func:`default_path`); UserError names what is wrong."""

    path = str(path) if path is not None else default_path()
    what = "launch plan"
    if not os.path.exists(path):
        hint = f" (from ${PLAN_ENV})" if path == os.environ.get(PLAN_ENV) else ""
        raise UserError(f"{what} {path!r}{hint} does not exist")
    doc = parse_json(read_text(path, what, 64 << 20), path, what, ("plan",))
    check_kind(doc, path, ("plan",))
    return LaunchPlan.from_dict(doc, repr(path))
