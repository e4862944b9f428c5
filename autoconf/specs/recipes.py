"""Framework releases and recipe presets: per framework, the named defaults it can follow
(``framework("megatron:bridge-0.3")``); data only, applied by ``specs.frameworks.framework``."""

from __future__ import annotations

RECIPES = {
    "reference": {"autoconf": ("autoconf's reference trainer, as this autoconf runs it", {})},
    "megatron": {
        "core-0.16": ("Megatron-LM pretrain_gpt.py at its argument defaults (megatron-core 0.16.1): no "
                      "communication overlap unless asked, BF16 parameters with FP8 weight copies", {}),
        # Megatron-Bridge 0.3.1: recipes/llama/llama3.py sets cfg.ddp.overlap_grad_reduce and
        # overlap_param_gather (distributed optimizer, grad_reduce_in_fp32), and its 70B and 405B
        # pretrain recipes CommOverlapConfig(tp_comm_overlap=True) (userbuffers; its MoE recipes,
        # e.g. recipes/deepseek/deepseek_v3.py, turn it off: set tp_comm_overlap there); every FP8
        # preset of training/mixed_precision.py sets fp8_param_gather = True
        "bridge-0.3": ("Megatron-Bridge 0.3.1 recipes: gradient reduction, parameter gather and "
                       "tensor-parallel communication overlapped, FP8 parameters (fp8_param_gather) under FP8",
                       {"defaults": {"overlap_grad_reduce": True, "overlap_param_gather": True,
                                     "tp_comm_overlap": True},
                        "fp8_param_gather": True}),
    },
    "torchtitan": {
        "0.3": ("torchtitan 0.3.0 defaults (FSDP2 with fp32 reduce, per-op selective checkpointing)", {}),
        # torch's SDPA tries its backends in a static order, FLASH_ATTENTION first and
        # CUDNN_ATTENTION fourth (torch 2.13: torch._C._get_sdp_priority_order() == [1, 2, 0, 3, 4]);
        # torch 2.11 on an H100 picked cuDNN's kernel by default (measured, `default_is` in
        # bench/data/h100-2026-11-24/kernels.json), a preference for Hopper that the late-2024
        # nightlies torchtitan's published H100 runs used did not have (cuDNN attention was opt-in
        # there): their attention ran FlashAttention-2, about half cuDNN's rate on an H100
        "torch-2.6": ("torchtitan on PyTorch 2.4-2.7 (its 2024 to mid-2025 runs): as 0.3, with SDPA "
                      "running FlashAttention-2 on Hopper, cuDNN's attention opt-in", {"attention_kernel": "flash2"}),
    },
    "deepspeed": {"0.19": ("DeepSpeed 0.19 engine defaults", {})},
}
"""Per framework, its named releases or recipe presets: (what it is, the Framework fields it sets).
The first is the default; ``framework("megatron:bridge-0.3")`` names another."""


def base_name(spec: str | None) -> str:
    """The framework of ``name`` or ``name:recipe`` (None: the reference trainer)."""
    return (spec or "reference").partition(":")[0]


def default_recipe(name: str) -> str:
    """The recipe a framework follows unless one is named: its first."""
    return next(iter(RECIPES[name]))


def framework_spec(fw) -> str:
    """``name`` where ``fw`` follows its framework's default recipe, else ``name:recipe``."""
    return fw.name if fw.recipe in ("", default_recipe(fw.name)) else f"{fw.name}:{fw.recipe}"


def recipe_text(fw) -> str:
    """One line naming the release or recipe whose defaults ``fw`` follows."""
    recipe = fw.recipe or default_recipe(fw.name)
    return f"{fw.name}:{recipe}: {RECIPES[fw.name][recipe][0]}"
