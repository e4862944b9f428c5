"""autoconf: choose data-, pipeline- and tensor-parallel training configurations by measurement.

``import autoconf`` never imports torch: the planner (specs, space, cost model, search) runs
anywhere. The profiler and the trainer import torch when they run.
"""

from .cluster import ClusterSpec, load_cluster
from .config import ParallelConfig
from .errors import UserError
from .model import ModelSpec, load_model, preset

__version__ = "0.1.0"

__all__ = ["ClusterSpec", "ModelSpec", "ParallelConfig", "UserError", "load_cluster", "load_model",
           "preset", "__version__"]
