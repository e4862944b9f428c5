"""DeepSpeed's launch file: ``ds_config.json`` (batch sizes, ZeRO stage, precision,
``overlap_comm``, AutoTP's degree; ``"_autoconf"`` holds the notes, which DeepSpeed ignores).
Its mixture of experts is a layer of the model code, nothing in ds_config.json: a gap line says
what that layer must be given. No import of DeepSpeed here.
"""

from __future__ import annotations

from autoconf.launch.gaps import _knob, gaps


def ds_config(plan, header: str) -> dict:
    c, m = plan.config, plan.model
    doc = {"train_batch_size": c.global_batch, "train_micro_batch_size_per_gpu": c.micro_batch_size,
           "gradient_accumulation_steps": c.num_micro_batches,
           "zero_optimization": {"stage": c.zero_stage, "overlap_comm": _knob(plan, "deepspeed", "overlap_grad_reduce")}}
    if m.dtype == "bf16":
        doc["bf16"] = {"enabled": True}
    elif m.dtype == "fp16":
        doc["fp16"] = {"enabled": True}
    if c.tp > 1:
        doc["tensor_parallel"] = {"autotp_size": c.tp}
    if c.recompute != "none":
        doc["activation_checkpointing"] = {"partition_activations": c.tp > 1, "contiguous_memory_optimization": False,
                                           "cpu_checkpointing": False}
    notes = [header.strip()]
    if c.pp > 1:
        notes.append(f"pipeline: build the model as deepspeed.pipe.PipelineModule(layers, num_stages={c.pp}, "
                     "partition_method='uniform'"
                     + (", activation_checkpoint_interval=1" if c.recompute == "full" else "") + ")")
    if c.recompute == "full" and c.pp == 1:
        notes.append("recompute: wrap each transformer block in deepspeed.checkpointing.checkpoint")
    notes += [f"cannot express: {g}" for g in gaps(plan, "deepspeed")]
    doc["_autoconf"] = {"notes": notes}
    return doc
