"""The search: an Optuna study over the configuration space (``search``), the evaluator of one
point, the choices per axis, the storage, and the placement search (``placer``).
"""
