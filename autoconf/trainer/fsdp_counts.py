"""How often FSDP2 gathers and reduce-scatters each unit in a step, counted in the trainer (the
cost model's ``space.schedules.fsdp_gathers`` says how often it should)."""

from __future__ import annotations

FSDP_CALLS: dict = {}
"""FSDP2's collectives since the last :func:`take_fsdp_calls`: {unit: [all-gathers, reduce-scatters]},
a unit named by its first parameter's name up to the block ("blocks.3", "embedding", "head")."""


def _unit_of(fsdp_params) -> str:
    fqn = (getattr(fsdp_params[0], "_param_fqn", None) if fsdp_params else None) or "?"
    parts = fqn.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


def count_fsdp_collectives() -> None:
    """Count every FSDP2 all-gather and reduce-scatter by unit (idempotent): wraps the two
    functions FSDP's parameter groups call (torch 2.13 ``fsdp/_fully_shard/_fsdp_param_group.py``
    imports ``foreach_all_gather`` and ``foreach_reduce`` from ``_fsdp_collectives``), so that a
    trial reports how often a step gathers and reduces each unit (the cost model's
    ``space.schedules.fsdp_gathers``)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    if getattr(group.foreach_all_gather, "_autoconf_counted", False):
        return
    gather, reduce = group.foreach_all_gather, group.foreach_reduce

    def counted_gather(fsdp_params, *args, **kwargs):
        FSDP_CALLS.setdefault(_unit_of(fsdp_params), [0, 0])[0] += 1
        return gather(fsdp_params, *args, **kwargs)

    def counted_reduce(fsdp_params, *args, **kwargs):
        FSDP_CALLS.setdefault(_unit_of(fsdp_params), [0, 0])[1] += 1
        return reduce(fsdp_params, *args, **kwargs)

    counted_gather._autoconf_counted = True
    group.foreach_all_gather, group.foreach_reduce = counted_gather, counted_reduce


def take_fsdp_calls() -> dict:
    """:data:`FSDP_CALLS` by unit, then the counts restart."""
    out = {k: list(v) for k, v in sorted(FSDP_CALLS.items())}
    FSDP_CALLS.clear()
    return out
