"""What ``plan`` is asked: one frozen dataclass, a docstring per field (``autoconf plan``'s flags
fill it; ``plan(model, PlanOptions(...))`` or ``plan(model, device=..., ...)`` from Python)."""

from __future__ import annotations

from dataclasses import dataclass

from autoconf.timetotrain.budget import DEFAULT_FACTORS
from autoconf.timetotrain.synthetic import METHODS

MAX_MICRO_BATCH = 64
"""The largest micro-batch tried by default (``--max-micro-batch``, as ``search``'s)."""


@dataclass(frozen=True)
class PlanOptions:
    """The question ``plan`` answers: on what, how much training, at what price, with which methods."""

    device: str | None = None
    """GPU kind of a synthetic DGX-style cluster (``synthetic.NODES``); or give ``cluster``."""
    max_gpus: int | None = None
    """The largest GPU count worth considering (None: with ``device``, GPU counts double until more
    stop paying, ``counts.stops_paying``, up to ``cluster.MAX_DEVICES``; with ``cluster``, its size)."""
    network: str = "ib"
    """The main network: ib (a NIC per GPU), 100gbe or 25gbe (one Ethernet NIC per node)."""
    cluster: object = None
    """A ``ClusterSpec`` instead of ``device``: GPU counts up to its size."""
    framework: str | None = None
    """The runtime that will run the plan (None: the reference trainer)."""
    tokens: float | None = None
    """Tokens to train on (None: 20 per parameter, Chinchilla)."""
    batch_law: str = "kaplan"
    """kaplan (the critical batch), deepseek (B_opt(C)) or fixed (``global_batch``)."""
    loss_law: str = "kaplan"
    """The loss law B_crit is read at: kaplan or chinchilla."""
    global_batch: int | None = None
    """Sequences per step, with ``batch_law="fixed"``."""
    batch_factors: tuple = DEFAULT_FACTORS
    """The batches swept, as multiples of B_crit (kaplan)."""
    price_per_gpu_hour: float | None = None
    """Price of one GPU-hour (costs in that currency)."""
    deadline_days: float | None = None
    """The cheapest plan finishing within this many days is reported."""
    budget: float | None = None
    """The fastest plan costing at most this is reported (needs ``price_per_gpu_hour``)."""
    compare_networks: tuple = ("25gbe",)
    """Slower networks the same sweep runs on."""
    methods: tuple = METHODS
    """The methods switched off in turn (``synthetic.METHODS``)."""
    mtbf_per_gpu_h: float | None = None
    """Mean time between failures of one GPU, hours: restarts and checkpoints enter the days."""
    checkpoint_s: float = 120.0
    """Seconds to write a checkpoint."""
    restart_s: float = 600.0
    """Seconds to restart after a failure."""
    max_days: float = 365.0
    """GPU counts that would take longer even at the datasheet peak are left out."""
    max_micro_batch: int = MAX_MICRO_BATCH
    """The largest micro-batch tried."""
    max_virtual: int | None = 8
    """The most chunks per device (virtual stages) tried, as ``search``'s; None: up to one layer
    per chunk (fully modular, Lamy-Poirier's setting)."""
    profile: object = None
    """A profile taken on the cluster's device kind (``planning_system``)."""
    precision: str = "bf16"
    """Matmul precision of every plan: bf16 (the model's dtype) or fp8."""
    fp8_recipe: str | None = None
    """FP8 scaling with ``precision="fp8"`` (None: the framework's first recipe the device runs)."""
    max_cp: int | None = None
    """The largest context-parallel degree (None: by sequence length, as ``search``)."""
    place: bool = False
    """After the sweep, ``search``'s placement on the fastest plan of each GPU count, method, network."""
    place_budget_s: float = 30.0
    """Seconds the placement may take in all."""
    moe_imbalance: float = 1.0
    """A mixture of experts' load imbalance (``System.moe_imbalance``)."""
    moe_dispatcher: str = "alltoall"
    """A mixture of experts' token dispatcher (``System.moe_dispatcher``)."""
