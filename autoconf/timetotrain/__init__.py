"""``autoconf plan``'s library: the shortest time to train, by scaling laws (``laws``), budgets,
the per-point optimiser and the sweep (``planner``).
"""
