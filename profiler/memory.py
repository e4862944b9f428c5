"""Saved-tensor accounting: how many activation bytes a module keeps for its backward pass.

Two independent measurements, which agree on every block of autoconf.trainer.layers (tests/test_nn.py):

- ``saved_activation_bytes`` packs every tensor autograd saves (``saved_tensors_hooks``), takes its
  storage (``untyped_storage()``: views of one buffer count once, by ``data_ptr``), and sums the
  storages' bytes, leaving out parameters and buffers. Non-reentrant checkpointing
  (``torch.utils.checkpoint``, ``use_reentrant=False``) stores the region's inputs as saved tensors
  *outside* its own hooks, so they are seen here, while the tensors saved inside the region go to
  checkpoint's inner hooks (which keep only placeholders) and are not: the count is what is really
  kept after forward.
- ``live_activation_bytes`` is a memory-difference measurement that needs no knowledge of autograd:
  it records every storage allocated during the forward (a ``TorchDispatchMode`` sees each op's
  outputs), then, with the output still holding the graph, counts those that are still alive
  (weak storage references), minus the output's own storage.

Inputs: the module's inputs are allocated by the caller, and are counted only when the module
saves them (e.g. a pre-norm block's input is the first norm's input, which Korthikanti et al. count
as the block's activation). ``exclude_inputs=True`` leaves them out. Not counted: the CPU random
generator state that checkpoint keeps (a few KiB per region, not a tensor of the graph).
"""

from __future__ import annotations

import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _module_storages(module: torch.nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in list(module.parameters()) + list(module.buffers())}


def _tensors(obj) -> list[torch.Tensor]:
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


def saved_activation_bytes(module: torch.nn.Module, *inputs, exclude_inputs: bool = False,
                           detail: bool = False):
    """Bytes of the distinct storages autograd keeps for backward after ``module(*inputs)``.

    Parameters and buffers of ``module`` are excluded; inputs are counted when saved unless
    ``exclude_inputs``. With ``detail=True`` returns (bytes, list of (nbytes, shape, dtype)) for
    inspection. The forward runs with grad enabled; the graph is freed before returning.
    """
    skip = _module_storages(module)
    if exclude_inputs:
        skip |= {t.untyped_storage().data_ptr() for t in _tensors(inputs)}
    seen: dict[int, tuple] = {}

    def pack(t):
        ptr, nbytes = _storage_key(t)
        if ptr not in skip and nbytes > 0:
            prev = seen.get(ptr)
            if prev is None or prev[0] < nbytes:
                seen[ptr] = (nbytes, tuple(t.shape), t.dtype)
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*inputs)
    del out
    total = sum(v[0] for v in seen.values())
    return (total, sorted(seen.values(), key=lambda v: -v[0])) if detail else total


class _AllocationRecorder(TorchDispatchMode):
    """Weak references to the storage of every tensor produced by an op while active."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            if t.device.type != "meta":
                s = t.untyped_storage()
                if s.nbytes():  # the newest storage at an address wins (freed memory gets reused)
                    self.storages[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        return out


def live_activation_bytes(module: torch.nn.Module, *inputs, exclude_inputs: bool = False) -> int:
    """Bytes allocated during ``module(*inputs)`` that stay alive while its output (and graph) lives.

    The output's own storage is not counted; inputs (allocated before) are added when the graph keeps
    them (saved by an op, or stored by checkpoint), unless ``exclude_inputs``.
    """
    skip = _module_storages(module)
    rec = _AllocationRecorder()
    gc.collect()
    with torch.enable_grad(), rec:
        out = module(*inputs)
    out_ptrs = {t.untyped_storage().data_ptr() for t in _tensors(out)}
    gc.collect()
    total = sum(nbytes for ptr, (ref, nbytes) in rec.storages.items()
                if not ref.expired() and ptr not in out_ptrs and ptr not in skip)
    if not exclude_inputs:
        # inputs kept by the graph: measured as saved tensors (they were not allocated during forward)
        in_ptrs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(inputs)}
        kept: set[int] = set()

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr in in_ptrs:
                kept.add(ptr)
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(*inputs)  # the output (and its graph) is dropped at once: only the packing matters
        total += sum(in_ptrs[p] for p in kept if p not in skip)
    del out
    return total


def model_state_bytes(module: torch.nn.Module, grads: bool = True) -> int:
    """Bytes of the module's distinct parameters (plus, if ``grads``, one gradient of the same size each)."""
    params = {p.untyped_storage().data_ptr(): p for p in module.parameters()}
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    return nbytes * 2 if grads else nbytes
