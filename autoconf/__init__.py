"""autoconf: choose data-, pipeline-, tensor-, context- and expert-parallel training
configurations by measurement.

The public API, by stage (each name is loaded from its subpackage on first use, so
``import autoconf`` stays cheap and never imports torch):

- describe: :func:`load_model`, :func:`preset`, :class:`ModelSpec`, :func:`load_cluster`,
  :class:`ClusterSpec`, :func:`load_profile`, :class:`Profile`;
- split: :class:`ParallelConfig`, :class:`Placement`;
- price: :func:`estimate`, :class:`Estimate`, :class:`System`;
- search: :func:`search`, :class:`SearchOptions`, :class:`SearchResult`; plan a whole run:
  :func:`plan`, :class:`PlanOptions`, :class:`PlanResult`;
- launch: :class:`LaunchPlan`, :func:`load_plan`, :func:`emit`;
- run: :func:`run_trial`, :class:`TrialResult`;
- errors: :class:`UserError` (bad input; its message is one line for the user).

The profiler (``profiler``) and the reference trainer (``autoconf.trainer``) import torch when
they run.
"""

from __future__ import annotations

import importlib

from autoconf.version import __version__ as __version__

_API = {
    "ModelSpec": "autoconf.specs.model", "preset": "autoconf.specs.model", "load_model": "autoconf.specs.hf",
    "ClusterSpec": "autoconf.specs.cluster", "load_cluster": "autoconf.specs.cluster",
    "Profile": "autoconf.specs.profile", "load_profile": "autoconf.specs.profile",
    "ParallelConfig": "autoconf.space.config", "Placement": "autoconf.space.placement",
    "estimate": "autoconf.cost.estimate", "Estimate": "autoconf.cost.estimate", "System": "autoconf.cost.system",
    "search": "autoconf.study.search", "SearchOptions": "autoconf.study.options",
    "SearchResult": "autoconf.study.result",
    "plan": "autoconf.timetotrain.planner", "PlanOptions": "autoconf.timetotrain.options",
    "PlanResult": "autoconf.timetotrain.planner",
    "LaunchPlan": "autoconf.launch.plan", "emit": "autoconf.launch.emit",
    "run_trial": "autoconf.runs.trial", "TrialResult": "autoconf.runs.trial",
    "UserError": "autoconf.errors",
}
_RENAMED = {"load_plan": ("autoconf.launch.plan", "load")}

__all__ = sorted([*_API, *_RENAMED, "__version__"])


def __getattr__(name: str):
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
    elif name in _RENAMED:
        module, attr = _RENAMED[name]
        value = getattr(importlib.import_module(module), attr)
    else:
        raise AttributeError(f"module 'autoconf' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return __all__
