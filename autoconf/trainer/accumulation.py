"""Gradient accumulation without a pipeline (pp = 1): standard and layered.

- *Standard*: micro-batch j runs forward and backward through the whole model before j + 1.
- *Layered* (Lamy-Poirier, arXiv 2106.02679): the model is a list of units (embedding, each block,
  head); unit k runs forward for every micro-batch before unit k + 1, then backward goes unit by
  unit in reverse, every micro-batch through unit k before unit k - 1. A unit's gradient is final
  as soon as its last micro-batch is through, and ``hooks.grads_final(unit)`` launches its
  data-parallel reduction right then, overlapping the backward of every earlier unit.

Both scale each micro-batch's loss by 1/m, so gradients are the mean over the replica's batch.
"""

from __future__ import annotations


class Hooks:
    """Callbacks around units (ZeRO-3 uses them to gather/reshard and to time gradient syncs)."""

    def after_forward(self, unit) -> None:
        pass

    def before_backward(self, unit, micro_batch: int, last: bool) -> None:
        pass

    def grads_final(self, unit) -> None:
        pass


def standard_step(model, xs, ys, hooks: Hooks) -> list[float]:
    """Micro-batch by micro-batch through ``model(x, y) -> loss``; returns the micro-batch losses."""
    m = len(xs)
    losses = []
    for j, (x, y) in enumerate(zip(xs, ys)):
        hooks.before_backward(model, j, j == m - 1)
        loss = model(x, y)
        (loss / m).backward()
        losses.append(float(loss.detach()))
    hooks.grads_final(model)
    return losses


def layered_step(units, xs, ys, hooks: Hooks) -> list[float]:
    """Unit by unit over all micro-batches; the last unit is called as ``unit(h, y) -> loss``."""
    import torch

    m, last = len(xs), len(units) - 1
    saved = []
    h = list(xs)
    for k, unit in enumerate(units):
        ins, outs = [], []
        for j in range(m):
            inp = h[j].detach().requires_grad_(True) if h[j].is_floating_point() else h[j]
            outs.append(unit(inp, ys[j]) if k == last else unit(inp))
            ins.append(inp)
        saved.append((ins, outs))
        h = [o.detach() for o in outs]
        hooks.after_forward(unit)
    losses = [float(o.detach()) for o in saved[last][1]]

    grads = [None] * m
    for k in range(last, -1, -1):
        ins, outs = saved[k]
        for j in range(m):
            hooks.before_backward(units[k], j, j == m - 1)
            if k == last:
                torch.autograd.backward(outs[j] / m)
            else:
                torch.autograd.backward(outs[j], grads[j])
            grads[j] = ins[j].grad if ins[j].requires_grad else None
        saved[k] = None
        hooks.grads_final(units[k])
    return losses
