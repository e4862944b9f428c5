"""Peak memory of one training step, per rank.

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (the allocator's own
  count; the caching allocator's reserve is not included).
- CPU: ``torch.distributed._tools.mem_tracker.MemTracker``, an exact count of tensor storages
  (parameters, gradients, optimizer state, activations, temporaries) through a dispatch mode.
  Tensors created before the step other than model and optimizer state (e.g. pipeline receive
  buffers from the first step) are not counted. The tracked step runs slower and is excluded from
  the timing.
"""

from __future__ import annotations

CPU_METHOD = "MemTracker (torch.distributed._tools.mem_tracker): exact tensor-storage accounting of one step"
CUDA_METHOD = "torch.cuda.max_memory_allocated over one step"

# MemTracker's categories -> the cost model's memory parts.
_PARTS = {"Parameter": "parameters", "Buffer": "other", "Gradient": "gradients", "Optstate": "optimizer",
          "Activation": "activations", "Temp": "other"}


def measure(step_fn, device, modules, optimizers):
    """Run ``step_fn()`` once and return (its result, peak bytes, breakdown dict, method)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = step_fn()
        torch.cuda.synchronize(device)
        return result, int(torch.cuda.max_memory_allocated(device)), {}, CUDA_METHOD

    mt = _tracker_class()()
    mt.track_external(*modules, *[o for o in optimizers if o is not None])
    with mt:
        result = step_fn()
    snap = mt.get_tracker_snapshot("peak")
    peak, breakdown = 0, {}
    for dev, parts in snap.items():
        if torch.device(dev).type != "cpu":
            continue
        peak = int(parts.get("Total", 0))
        for key, value in parts.items():
            name = _PARTS.get(str(getattr(key, "value", key)))
            if name:
                breakdown[name] = breakdown.get(name, 0) + int(value)
    return result, peak, breakdown, CPU_METHOD


def _tracker_class():
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        """MemTracker that allows one module to run forward several times in the tracked region
        (micro-batches). Only the per-module statistics of repeated calls are skipped; the
        global peak and its breakdown are unaffected."""

        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                return
            super()._pre_fw_hook(module, inputs)

    return StepTracker
