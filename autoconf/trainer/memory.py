"""Peak memory of one training step, per rank.

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (the allocator's own
  count; the caching allocator's reserve is not included).
- CPU: ``torch.distributed._tools.mem_tracker.MemTracker``, an exact count of tensor storages
  (parameters, gradients, optimizer state, activations, temporaries) through a dispatch mode.
  Tensors created before the step other than model and optimizer state (e.g. pipeline receive
  buffers from the first step) are not counted. The tracked step runs slower and is excluded from
  the timing.

  MemTracker's module tracker (ModTracker) registers a multi-grad hook (mode "all") on every
  module call's inputs that require grad. In torch 2.13 that hook's closure holds the inputs'
  grad_fns, and for a leaf input the grad_fn is its AccumulateGrad node, which owns the leaf: a
  reference cycle through C++ that Python's gc cannot see, so every leaf input (and its .grad)
  stays alive for the rest of the process. The trainer feeds leaves to modules wherever it cuts the
  graph -- every unit of layered gradient accumulation, every pipeline stage -- so the tracked step
  kept all of them alive and measured memory no untracked run ever holds (with layered accumulation:
  every unit's input and input gradient for every micro-batch, to the end of the step). The hooks
  are therefore removed once they have fired (``_release_after_firing``), which breaks the cycle.
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


def _release_after_firing(register):
    """Wrap ``register_multi_grad_hook`` so that each hook removes itself (at the end of the
    backward call that fired it: a hook must not change the hook dict it is called from). Without
    this, mode "all" on a leaf tensor is a reference cycle that keeps the leaf alive (see above)."""
    import torch

    def register_multi_grad_hook(tensors, fn, *, mode="all"):
        box = []

        def once(*args):
            fn(*args)
            if box:
                torch.autograd.Variable._execution_engine.queue_callback(box.pop().remove)

        handle = register(tensors, once, mode=mode)
        box.append(handle)
        return handle

    return register_multi_grad_hook


def _tracker_class():
    from torch.distributed._tools import mod_tracker
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        """MemTracker that allows one module to run forward several times in the tracked region
        (micro-batches), and whose module hooks release what they hold once fired (see the module
        docstring). Only the per-module statistics of repeated calls are skipped; the global peak
        and its breakdown are unaffected."""

        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                return
            super()._pre_fw_hook(module, inputs)

        def __enter__(self):
            self._register = mod_tracker.register_multi_grad_hook
            mod_tracker.register_multi_grad_hook = _release_after_firing(self._register)
            try:
                return super().__enter__()
            except BaseException:
                mod_tracker.register_multi_grad_hook = self._register
                raise

        def __exit__(self, *exc):
            try:
                return super().__exit__(*exc)
            finally:
                mod_tracker.register_multi_grad_hook = self._register

    return StepTracker
