"""Policy: the training framework's rules, applied to a configuration. Build once, ask many.

Where :class:`~autoconf.cost.system.System` answers "how fast" (the devices' and links' rates,
measured or from the datasheet), a Policy answers "what does the framework do" with a given
configuration of a given model: which ZeRO stage lays out the optimizer state, in what precision
gradients are kept and reduced, whether micro-batches accumulate into ``.grad``, whether FSDP
gathers once per step under pipelining, how the vocabulary is padded. Every answer is a function of
the model, the framework's data (``specs.frameworks.Framework``) and the configuration alone: no
device, no link, no profile. The System holds one (``System.policy``).

Pure: no torch, no I/O; the only state is a cache of the padded models.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from autoconf.cost.attention import fused_softmax_available
from autoconf.cost.memory import bytes_per_param
from autoconf.errors import UserError
from autoconf.specs.devices import device_type
from autoconf.specs.model import ModelSpec


def check_moe_options(model: ModelSpec, framework, moe_imbalance: float, moe_dispatcher: str) -> None:
    """A one-line error for a mixture-of-experts option the model or the framework cannot take:
    an imbalance outside [1, 64] (the busiest expert rank's tokens over the balanced share), a
    token dispatcher on a dense model or one the framework does not run."""
    f = moe_imbalance
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 1.0 <= f <= 64.0:
        raise UserError(f"--moe-imbalance {f!r}: the busiest expert rank's tokens over the balanced share, "
                        "a number from 1.0 (balanced) to 64")
    if moe_dispatcher != "alltoall" and not model.is_moe:
        raise UserError(f"--moe-dispatcher {moe_dispatcher}: model {model.name} has no experts to "
                        "dispatch to; valid: alltoall")
    if moe_dispatcher not in framework.moe_dispatchers:
        valid = ", ".join(framework.moe_dispatchers)
        raise UserError(f"--moe-dispatcher {moe_dispatcher}: framework {framework.name} has no "
                        f"{moe_dispatcher} token dispatcher; valid: {valid}")


@dataclass(frozen=True)
class Policy:
    """The framework's rules for ``model``: what it does with a configuration (not how fast)."""

    model: ModelSpec
    framework: object
    """The training framework's behaviour (``specs.frameworks.Framework``)."""
    _models: dict = field(default_factory=dict, compare=False, repr=False)

    def model_at(self, tp: int, cp: int = 1) -> ModelSpec:
        """The model as the framework builds it at tensor-parallel degree ``tp``: Megatron pads the
        vocabulary to a multiple of 128 x tp (``Framework.padded_vocab``), which changes the
        embedding and output layer's parameters, time and memory. With ``cp`` > 1, as one
        context-parallel rank sees it: ``seq_length`` is its s/cp tokens (for what scales with the
        rank's tokens: embedding, output layer, loss, boundary tensors; not for parameters)."""
        vocab = self.framework.padded_vocab(self.model.vocab_size, tp)
        if vocab == self.model.vocab_size and cp == 1:
            return self.model
        hit = self._models.get((tp, cp))
        if hit is None:
            hit = self._models[(tp, cp)] = dataclasses.replace(
                self.model, vocab_size=vocab, seq_length=self.model.seq_length // cp)
        return hit

    def mask_bytes(self, kind: str) -> int:
        # PyTorch keeps dropout masks as bool (1 byte) on CUDA, at the activation's precision on CPU.
        return self.model.dtype_bytes if kind == "cpu" else 1

    def unfused_softmax(self, b: int, tp: int, cp: int = 1) -> bool:
        """Whether this framework's eager attention falls back from its fused softmax kernel to
        torch's fp32 path at micro-batch ``b`` on tp ranks (``Framework.megatron_softmax``,
        ``cost.attention.fused_softmax_available``)."""
        m = self.model
        return (self.framework.megatron_softmax and m.attention == "eager" and m.dtype != "fp32"
                and not fused_softmax_available(b, m.num_attention_heads / tp, m.seq_length / cp, m.seq_length / cp))

    def accumulates(self, c) -> bool:
        """Whether autograd adds micro-batches' weight gradients into ``.grad``: more than one
        micro-batch, or DeepSpeed's BF16 optimizer, which zeroes the gradients before each
        backward instead of freeing them (``clear_lp_grads``); not where ZeRO-2/3 with data
        parallelism reduce each micro-batch's gradients and drop them (outside layered
        accumulation)."""
        return ((c.num_micro_batches > 1 or self.bf16_optimizer(c))
                and (c.zero_stage <= 1 or c.dp * c.cp == 1 or c.layered_grad_accum))

    def bf16_optimizer(self, c) -> bool:
        """Whether configuration ``c`` runs DeepSpeed's ``BF16_Optimizer``: bf16 training without
        ZeRO under its pipeline engine (``Framework.bf16_optimizer_with_pp``; DeepSpeed's engine
        picks it there, ``_do_optimizer_sanity_check``). It keeps a second copy of every gradient
        in the model's dtype (``stage_memory``), adds each micro-batch's gradients into it
        (``compute.BF16_OPTIMIZER_UPDATE``), all-reduces those copies, and shards its fp32 master
        weights and moments over dp, gathering the updated parameters inside the step, as ZeRO-1
        does (``data_parallel``)."""
        return (self.framework.bf16_optimizer_with_pp and self.model.dtype == "bf16" and c.pp > 1
                and c.zero_stage == 0)

    def state_zero_stage(self, c) -> int:
        """The ZeRO stage by which configuration ``c`` lays out its fp32 master weights and
        optimizer moments (memory, the optimizer step, the gather after it): its own, or 1 where
        DeepSpeed's BF16 optimizer shards them over dp without ZeRO (:meth:`bf16_optimizer`)."""
        return 1 if self.bf16_optimizer(c) else c.zero_stage

    def supports(self, kind: str, c) -> str | None:
        """Why devices of ``kind`` cannot run configuration ``c`` (FP8 without FP8 tensor cores),
        or None."""
        if c.precision == "tf32":
            return None if "tf32" in device_type(kind).peak_flop_per_s else f"device {kind} has no TF32 tensor cores"
        if c.precision != "fp8":
            return None
        dtype = "mxfp8" if c.fp8_recipe == "mxfp8" else "fp8"
        if not device_type(kind).supports(dtype):
            return f"device {kind} has no {dtype.upper()} tensor cores (precision fp8, recipe {c.fp8_recipe})"
        return None

    def host_cost(self, kind: str):
        """The framework's host cost per operation on an accelerator; None on CPU processes,
        where the host is the device (its dispatch cost is inside the measured or roofline time)."""
        return None if kind == "cpu" else self.framework.host

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element as the framework keeps and reduces them: the parameters'
        precision, or fp32 where it accumulates bf16 gradients in an fp32 buffer (Megatron)."""
        if self.framework.fp32_grad_buffer_bf16 and self.model.dtype == "bf16":
            return 4
        return bytes_per_param(self.model.dtype, self.framework.master_weights)[1]

    def reduce_bytes(self, c) -> int:
        """Bytes per gradient element the data-parallel reduction moves: ``grad_bytes``, or the
        framework's FSDP reduce dtype under ZeRO-2/3 (``Framework.fsdp_reduce_bytes``)."""
        if c.zero_stage >= 2 and self.framework.fsdp_reduce_bytes:
            return self.framework.fsdp_reduce_bytes
        return self.grad_bytes

    def fsdp_step_gather(self, zero_stage: int, pp: int, dp_cp: int) -> bool:
        """FSDP (ZeRO-2/3) under pipelining gathers once per step and reduces once after the last
        micro-batch (``Framework.fsdp_step_gather_under_pp``: torchtitan over
        ``torch.distributed.pipelining``, which turns gradient sync off for every other one)."""
        return zero_stage >= 2 and pp > 1 and self.framework.fsdp_step_gather_under_pp and dp_cp > 1

    def fsdp_per_pass(self, zero_stage: int, pp: int, dp_cp: int) -> bool:
        """ZeRO-3 under pipelining that gathers per pass over a chunk and reduce-scatters once,
        after the chunk's last backward: FSDP2 over ``torch.distributed.pipelining`` as the
        reference trainer runs it (``space.schedules.fsdp_gathers``; its stage turns gradient sync
        off before every backward but the last, torch 2.13 ``pipelining/stage.py``). A framework
        that runs ZeRO-3 with pp > 1 does this or gathers once per step
        (:meth:`fsdp_step_gather`); the others refuse it (``Framework.check``)."""
        return zero_stage == 3 and pp > 1 and dp_cp > 1 and not self.fsdp_step_gather(zero_stage, pp, dp_cp)
