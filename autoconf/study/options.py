"""What ``search`` is asked: one frozen dataclass, a docstring per field (``autoconf search``'s
flags fill it; ``search(model, cluster, batch, SearchOptions(...))`` or keyword overrides from
Python)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SearchOptions:
    """How to search: how much of the space, with which framework, precisions and extras."""

    gpus: int | None = None
    """Devices to use (None: all of the cluster's)."""
    top: int = 5
    """How many of the fastest configurations that fit to return."""
    trials: int | None = None
    """Sampled trials before the exhaustive sweep (None: 400; a space of at most that many is
    brute-forced)."""
    storage: str | None = None
    """An Optuna storage URL to keep the trials in (``sqlite:///file.db``, optionally
    ``?timeout=SECONDS``; resumable), or None (or ``sqlite://``, ``sqlite:///:memory:``) to keep
    them in memory only (``storage.check_storage``)."""
    study_name: str | None = None
    """At most 200 printable characters; None: derived from the inputs (``default_study_name``)."""
    profile: object = None
    """A measured profile (``autoconf profile``) that prices compute and links."""
    calibration: object = None
    """A calibration from verified trials (``search --verify K --calibrate``)."""
    max_micro_batch: int = 64
    """The largest micro-batch size tried."""
    max_virtual: int | None = 8
    """The most chunks per device (virtual stages) tried; None: up to one layer per chunk, fully
    modular (``enumeration.MAX_VIRTUAL``: each chunk more costs search time)."""
    seed: int = 0
    """The sampler's seed."""
    exhaustive: bool = True
    """Sweep every point after sampling, so the ``top`` are exactly the model's fastest."""
    framework: str | None = None
    """The runtime that will run the plan: a name or ``name:recipe`` (``frameworks``; None: the
    reference trainer). Only what it can run is offered, its knobs are searched."""
    place: bool = False
    """Search the placement too: every configuration is estimated with the graph heuristics'
    placement and the ``top`` best improved by a local search (reference trainer only)."""
    max_cp: int | None = None
    """The largest context-parallel degree tried (``enumeration.cp_choices``)."""
    precision: str = "auto"
    """The matmul precisions tried: auto, bf16, fp8 or tf32 (``choices.precision_choices``)."""
    fp8_recipe: str | None = None
    """The FP8 scaling tried (None: the framework's first the devices run)."""
    moe_imbalance: float = 1.0
    """A mixture of experts' busiest expert rank's tokens over the balanced share."""
    allow_compression: bool = False
    """Lossy communication may be picked (compressed pipeline gradients, PowerSGD on data-parallel
    gradients, the fused embedding sync: ``choices.compression_variants``)."""
    pp_compression_rank: int = 16
    """With ``allow_compression``: the rank of compressed pipeline gradients."""
    dp_compression_rank: int = 128
    """With ``allow_compression``: PowerSGD's rank on data-parallel gradients."""
    moe_dispatcher: str = "alltoall"
    """A mixture of experts' token dispatcher (``config.MOE_DISPATCHERS``, one the framework runs)."""
