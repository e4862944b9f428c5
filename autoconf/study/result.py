"""What a search returns (:class:`SearchResult`) and the outer point's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autoconf.cost.estimate import Estimate
from autoconf.space.config import ParallelConfig


@dataclass(frozen=True)
class SearchResult:
    top: tuple
    """The best Estimates that fit, fastest first (at most ``top`` of them)."""
    rejected: dict
    """Why configurations were rejected: reason -> count (invalid ones, and out of memory)."""
    space_size: int
    """Configurations in the whole space (valid and invalid)."""
    valid: int
    outer_points: int
    trials_run: int
    """Trials this run added to the study (dominated points of the sweep are counted, not stored)."""
    trials_total: int
    """Trials in the study after this run (including earlier runs)."""
    estimates: int
    sampler: str
    study_name: str
    storage: str | None
    elapsed_s: float
    smallest_memory: Estimate | None = None
    """When nothing fits: the configuration needing the least memory."""
    notes: tuple = field(default_factory=tuple)
    placement: tuple = ()
    """With placement search: one dict per entry of ``top`` (``study.placer.Placer.outcome``): the step
    time in the default order with the even split, after the heuristic and after the local search,
    and each stage's hosts, devices and layers."""
    placement_s: float = 0.0
    """Seconds of ``elapsed_s`` the placement's local search took."""
    evaluated: tuple = ()
    """Every configuration this run estimated, as ``(config, step time, peak memory bytes, fits)``
    (the step time is inf where it does not fit: its schedule was not simulated), then the
    configuration each earlier run's trial recorded (its memory rounded to 1 MiB). Not in
    ``to_dict``; for the time-versus-memory picture (``plots``)."""
    resumed: bool = False
    """Whether the study existed before this run (same inputs: its trials were reused)."""
    earlier_trials: int = 0
    """Trials of earlier runs this one reused (not evaluated again)."""

    def to_dict(self) -> dict:
        return {"top": [e.to_dict() for e in self.top], "rejected": dict(self.rejected),
                "space_size": self.space_size, "valid": self.valid, "outer_points": self.outer_points,
                "trials_run": self.trials_run, "trials_total": self.trials_total,
                "estimates": self.estimates, "sampler": self.sampler, "study_name": self.study_name,
                "storage": self.storage, "elapsed_s": self.elapsed_s,
                "smallest_memory": self.smallest_memory.to_dict() if self.smallest_memory else None,
                "notes": list(self.notes), "placement": list(self.placement), "placement_s": self.placement_s,
                "resumed": self.resumed, "earlier_trials": self.earlier_trials}


def _pipeline_label(sched: str, v: int, layered: bool) -> str:
    s = sched if v == 1 else f"{sched}-v{v}"
    return s + "-layered" if layered and sched != "breadth_first" else s


def outer_params(c: ParallelConfig) -> dict:
    """The study parameters of the outer point a configuration belongs to (its trial's ``params``)."""
    return {"tp": c.tp, "pp": c.pp, "dp": c.dp, "micro_batch_size": c.micro_batch_size,
            "pipeline": _pipeline_label(c.schedule, c.virtual_stages, c.layered_grad_accum), "cp": c.cp}


def _parse_pipeline(label: str) -> tuple[str, int, bool]:
    layered = label.endswith("-layered")
    label = label.removesuffix("-layered")
    sched, _, v = label.partition("-v")
    return sched, int(v) if v else 1, layered or sched == "breadth_first"
