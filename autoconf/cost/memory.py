"""Memory per device: model states under each ZeRO stage, activations, and the rest.

Model states follow the ZeRO paper (Rajbhandari et al., arXiv 1910.02054, section 3.1): mixed-
precision Adam keeps 2 bytes of 16-bit parameters, 2 of 16-bit gradients and K = 12 bytes of
optimizer state (fp32 master copy, momentum, variance) per parameter: 16 in all. ZeRO-1 shards the
12 over dp, ZeRO-2 also the gradients, ZeRO-3 also the parameters: 16, 4 + 12/d, 2 + 14/d, 16/d.
Plain fp32 training keeps 4 + 4 + 8 (no master copy). 16-bit training without a master copy
(``torch.optim.AdamW`` on bf16 parameters, as the reference trainer runs it) keeps its moments in
the parameters' dtype: 2 + 2 + 4. Activations come from
``activations.layer_activation_bytes`` (Korthikanti et al., arXiv 2205.05198, generalised to what
this project's block really saves) times the live micro-batches the schedule simulation found.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoconf.specs.model import ModelSpec

BUCKET_BYTES = 25 * 2**20
"""Gradient bucket size: PyTorch DDP's default (bucket_cap_mb=25; Li et al., VLDB 2020)."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter held by one device for parameters, gradients and optimizer state."""

    parameters: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer


def bytes_per_param(dtype: str, master_copy: bool = True) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes per parameter for AdamW in this precision.

    ``master_copy``: 16-bit training keeps an fp32 copy of the parameters and fp32 moments (mixed
    precision as Megatron-LM, DeepSpeed and the ZeRO paper run it); without one the moments are in
    the parameters' dtype (``torch.optim.AdamW`` creates them with ``zeros_like(param)``)."""
    if dtype == "fp32":
        return 4, 4, 8
    return (2, 2, 12) if master_copy else (2, 2, 4)


def optimizer_temporary_bytes(optimizer_bytes: float, dtype: str, master_copy: bool = True) -> float:
    """What ``torch.optim.AdamW``'s multi-tensor (foreach) step allocates at once over the
    ``optimizer_bytes`` of state it updates: ``torch._foreach_sqrt(exp_avg_sqs)``, one tensor the
    size of a moment for every parameter (torch/optim/adam.py, ``_multi_tensor_adam``). One moment
    is a third of the state with an fp32 master copy (master, m, v), else half (m, v)."""
    return optimizer_bytes / (3 if master_copy and dtype != "fp32" else 2)


def state_bytes_per_param(dtype: str, zero_stage: int, dp: int, fp32_grads: bool = False,
                          master_copy: bool = True) -> StateBytes:
    """Model-state bytes per parameter on one device under ZeRO stage 0-3 with dp shards.

    ``fp32_grads``: gradients accumulate in an fp32 buffer (Megatron-LM's ``main_grad`` in bf16
    training): 4 bytes instead of 2, which gives Megatron's documented 18 bytes per parameter
    without, and 6 + 12/dp with, its distributed optimizer."""
    p, g, o = bytes_per_param(dtype, master_copy)
    if fp32_grads:
        g = 4
    return StateBytes(parameters=p / dp if zero_stage >= 3 else p,
                      gradients=g / dp if zero_stage >= 2 else g,
                      optimizer=o / dp if zero_stage >= 1 else o)


def zero3_working_bytes(model: ModelSpec, tp: int, layers_gathered: int = 2) -> float:
    """ZeRO-3 gathers full layer parameters before use: the one in use plus one prefetched."""
    return layers_gathered * model.layer_params() / tp * model.dtype_bytes
