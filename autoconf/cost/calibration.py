"""Calibration: per-term multipliers that pull the cost model toward measured trial runs.

A trial measures one step time and one peak memory; the cost model predicts both as sums of
terms. The multipliers are fitted by non-negative least squares on *relative* residuals (so a
1 s step and a 10 ms step weigh the same), with a ridge toward 1: a term that no trial exercised
(say ``pp_comm`` when every trial had pp = 1) is not identifiable and keeps its factor of 1.

    time:    measured_step_s  ~  sum_k factor_k * breakdown_s[k]
    memory:  measured_peak_b  ~  model_states + factor_activations * activations
                                 + factor_other * other          (on the predicted peak stage)

Parameters, gradients and optimizer state are counted exactly by the model, so they are not
scaled. Pure Python + numpy: no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from autoconf.errors import UserError
from autoconf.files import write_text
from autoconf.specs.schema import Dict, Int, List, Num, Str, check_kind, parse_json, read_text

TIME_TERMS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "dp_comm", "bubble", "optimizer")
MEMORY_TERMS = ("activations", "other")
MODEL_STATE_PARTS = ("parameters", "gradients", "optimizer")


@dataclass(frozen=True)
class Calibration:
    """Multipliers per cost term (1.0 = the uncalibrated model)."""

    factors: dict = field(default_factory=lambda: {k: 1.0 for k in TIME_TERMS + MEMORY_TERMS})
    """Term name -> multiplier; time terms as in ``Estimate.breakdown_s``, memory terms as in
    ``Estimate.memory_by_stage``."""
    num_trials: int = 0
    """Trials the fit used."""
    devices: tuple | None = None
    """The device kinds the trials ran on (catalog names, e.g. ('cpu',)); a calibration applies to
    clusters of those devices only. None: unknown (written before it was recorded)."""

    def factor(self, term: str) -> float:
        return float(self.factors.get(term, 1.0))

    def apply_breakdown(self, breakdown_s: dict) -> dict:
        """Each step-time term scaled by its factor."""
        return {k: float(v) * self.factor(k) for k, v in breakdown_s.items()}

    def apply_memory(self, stage):
        """A stage's memory parts with activations and other scaled (model states exact): a
        ``StageMemory`` for a StageMemory, a dict for a dict (an estimate read from JSON)."""
        if not isinstance(stage, dict):
            return dataclasses.replace(stage, **{k: float(getattr(stage, k)) * self.factor(k) for k in MEMORY_TERMS})
        out = dict(stage)
        for k in MEMORY_TERMS:
            out[k] = float(stage.get(k, 0.0)) * self.factor(k)
        out["total"] = sum(float(out.get(k, 0.0)) for k in MODEL_STATE_PARTS + MEMORY_TERMS)
        return out

    def to_dict(self) -> dict:
        d = {"factors": dict(self.factors), "num_trials": self.num_trials}
        if self.devices is not None:
            d["devices"] = list(self.devices)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        factors = {k: 1.0 for k in TIME_TERMS + MEMORY_TERMS}
        factors.update({k: float(v) for k, v in d.get("factors", {}).items()})
        devices = d.get("devices")
        return cls(factors=factors, num_trials=int(d.get("num_trials", 0)),
                   devices=tuple(devices) if devices is not None else None)


# -- reading the lead's Estimate and the TrialResult by duck typing -----------------------------

def _get(obj, name, default=None):
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _peak_stage(estimate):
    """The stage with the most memory: a StageMemory, or a dict from JSON; {} when none."""
    stages = _get(estimate, "memory_by_stage") or []
    if not stages:
        return {}
    return max(stages, key=lambda s: _get(s, "total", 0.0))


def calibrated_step_time_s(estimate, calibration: Calibration | None) -> float:
    """The estimate's step time with each breakdown term scaled by its factor."""
    if calibration is None:
        return float(_get(estimate, "step_time_s"))
    return float(sum(calibration.apply_breakdown(_get(estimate, "breakdown_s") or {}).values()))


def calibrated_peak_memory_bytes(estimate, calibration: Calibration | None) -> float:
    """The peak stage's memory with activations and other scaled (model states as predicted)."""
    if calibration is None:
        return float(_get(estimate, "peak_memory_bytes"))
    stage = _peak_stage(estimate)
    if not stage:
        return float(_get(estimate, "peak_memory_bytes"))
    return _get(calibration.apply_memory(stage), "total")


# -- fitting --------------------------------------------------------------------------------------

def _ridge_nnls(a: np.ndarray, b: np.ndarray, ridge: float) -> np.ndarray:
    """argmin_x ||a x - b||^2 + ridge ||x - 1||^2 subject to x >= 0 (active-set on the ridge fit).

    Columns that are all zero get exactly 1 (only the ridge speaks for them).
    """
    n = a.shape[1]
    x = np.ones(n)
    free = [j for j in range(n) if np.any(a[:, j] != 0.0)]
    fixed_zero: set[int] = set()
    for _ in range(n + 1):
        cols = [j for j in free if j not in fixed_zero]
        if not cols:
            break
        sub = a[:, cols]
        lhs = sub.T @ sub + ridge * np.eye(len(cols))
        rhs = sub.T @ b + ridge * np.ones(len(cols))
        sol = np.linalg.solve(lhs, rhs)
        negative = [cols[i] for i, v in enumerate(sol) if v < 0.0]
        for i, j in enumerate(cols):
            x[j] = max(sol[i], 0.0)
        if not negative:
            break
        fixed_zero.update(negative)
    for j in fixed_zero:
        x[j] = 0.0
    return x


def fit_calibration(pairs, ridge: float = 1e-2, memory_ridge: float = 1.0) -> Calibration:
    """Fit multipliers from ``(Estimate, TrialResult)`` pairs; failed trials are skipped.

    Rows are divided by the measured value, so the fit minimises squared *relative* error.
    ``ridge`` (relative to one trial's weight) pulls every time factor toward 1; ``memory_ridge``
    does the same for the memory factors, harder: activations and the rest move together across a
    few trials (nearly collinear), and a weak pull let three trials swing them by 30-50%.
    """
    good = [(e, t) for e, t in pairs if _get(t, "ok") and _get(t, "step_time_s")]
    factors = {k: 1.0 for k in TIME_TERMS + MEMORY_TERMS}
    if not good:
        return Calibration(factors=factors, num_trials=0)

    rows, target = [], []
    for e, t in good:
        bd = _get(e, "breakdown_s") or {}
        measured = float(_get(t, "step_time_s"))
        rows.append([float(bd.get(k, 0.0)) / measured for k in TIME_TERMS])
        target.append(1.0)
    x = _ridge_nnls(np.array(rows), np.array(target), ridge)
    factors.update({k: float(v) for k, v in zip(TIME_TERMS, x)})

    rows, target = [], []
    for e, t in good:
        measured = _get(t, "peak_memory_bytes")
        stage = _peak_stage(e)
        if not measured or not stage:
            continue
        measured = float(measured)
        states = sum(float(_get(stage, k, 0.0)) for k in MODEL_STATE_PARTS)
        rows.append([float(_get(stage, k, 0.0)) / measured for k in MEMORY_TERMS])
        target.append(1.0 - states / measured)
    if rows:
        x = _ridge_nnls(np.array(rows), np.array(target), memory_ridge)
        factors.update({k: float(v) for k, v in zip(MEMORY_TERMS, x)})
    return Calibration(factors=factors, num_trials=len(good))


# -- how good is it -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ErrorStats:
    """Relative prediction error |predicted - measured| / measured over a set of trials."""

    n: int
    time_median: float
    time_max: float
    memory_median: float
    memory_max: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def relative_errors(pairs, calibration: Calibration | None = None) -> tuple[list[float], list[float]]:
    """(time errors, memory errors) for the successful trials among ``pairs``."""
    time_err, mem_err = [], []
    for e, t in pairs:
        if not _get(t, "ok"):
            continue
        measured_t = _get(t, "step_time_s")
        if measured_t:
            time_err.append(abs(calibrated_step_time_s(e, calibration) - measured_t) / measured_t)
        measured_m = _get(t, "peak_memory_bytes")
        if measured_m:
            mem_err.append(abs(calibrated_peak_memory_bytes(e, calibration) - measured_m) / measured_m)
    return time_err, mem_err


def error_stats(pairs, calibration: Calibration | None = None) -> ErrorStats:
    t, m = relative_errors(pairs, calibration)
    med = lambda xs: float(np.median(xs)) if xs else float("nan")  # noqa: E731
    mx = lambda xs: float(max(xs)) if xs else float("nan")  # noqa: E731
    return ErrorStats(n=len(t), time_median=med(t), time_max=mx(t), memory_median=med(m), memory_max=mx(m))


def calibration_report(pairs, calibration: Calibration) -> dict:
    """Prediction error before and after calibration, for tables and JSON."""
    return {"before": error_stats(pairs, None).to_dict(),
            "after": error_stats(pairs, calibration).to_dict(),
            "calibration": calibration.to_dict()}


# -- files ----------------------------------------------------------------------------------------

def save_calibration(calibration: Calibration, path: str) -> None:
    """Write atomically: a failure leaves the previous file (or none) and no temp file."""
    import json


    write_text(path, json.dumps({"version": 1, **calibration.to_dict()}, indent=1))


MAX_FACTOR = 1000.0
"""A factor beyond this means the model or the trials are broken. Small factors, 0 included, are
what the non-negative fit gives a term the trials show no sign of, and are read as they are."""


def calibration_schema():

    factor = Num(0.0, MAX_FACTOR)
    return Dict(required={"factors": Dict(optional={k: factor for k in TIME_TERMS + MEMORY_TERMS},
                                          what="factors, one per cost term")},
                optional={"version": Int(1, 1), "num_trials": Int(0, 1 << 30),
                          "devices": List(Str(max_len=64), min_len=1, max_len=64)},
                what="a calibration")


def load_calibration(path: str) -> Calibration:
    """Read a calibration JSON written by :func:`save_calibration`; UserError if unreadable."""
    import os


    data = parse_json(read_text(path, "calibration file"), path, "calibration file", ("calibration",))
    check_kind(data, path, ("calibration",))
    if not isinstance(data, dict) or "factors" not in data:
        raise UserError(f"calibration file {path!r} must hold an object with 'factors' "
                        "(written by `autoconf search --verify K --calibrate FILE`)")
    try:
        d = calibration_schema()(data)
    except UserError as e:
        raise UserError(f"calibration file {os.path.basename(path)}: {e}") from None
    return Calibration.from_dict(d)
