"""Lower bounds on what ``cost.estimate`` computes, cheaper than an estimate: they let the search
(``estimate_on(..., bound=)``) skip configurations that cannot win without simulating their
schedule.

Each function here is a pure function of the ``System`` and the data of a configuration, and
each docstring says why it is at most what the estimate computes.

- :func:`lower_bound`: one configuration's step, from ``schedule_time.pipeline_floor`` and the
  optimizer step, with the calibration's factors (what ``estimate_on`` prunes with).
"""

from __future__ import annotations

from autoconf.cost.system import System

FLOOR_TERMS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "dp_comm", "bubble", "pp_comm")
"""The step-time terms (``estimate.TIME_TERMS``) the pipeline floor and the data-parallel tail are
made of: all but the optimizer step."""


def lower_bound(ctx: System, floor: float, opt: float) -> float:
    """Lower bound on the step time (to skip dominated configurations in the search): ``floor``,
    the configuration's ``schedule_time.pipeline_floor``, plus ``opt``, its optimizer step.

    The estimate's step is makespan + data-parallel tail + gather + optimizer step, the makespan
    at least the floor (``estimate_on`` takes the larger of both) and the other terms at least 0;
    its breakdown adds up to that step. A calibration scales each term of the breakdown by its
    factor: the terms other than the optimizer step add up to at least the floor, so scaled they
    are at least the floor times the least of their factors."""
    cal = ctx.calibration
    if cal is not None:  # calibration scales the terms the floor is made of
        return floor * min(cal.factor(k) for k in FLOOR_TERMS) + opt * cal.factor("optimizer")
    return floor + opt
