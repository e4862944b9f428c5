"""Pipeline parallelism with ``torch.distributed.pipelining``: hand-built stages, stock schedules.

Chunk ``c`` of ``pp * v`` lives on pipeline rank ``c % pp`` (looped placement), so with v > 1 each
rank holds v non-contiguous chunks (modular pipeline, arXiv 2106.02679). Schedules:

    gpipe -> ScheduleGPipe          1f1b -> Schedule1F1B
    interleaved -> ScheduleInterleaved1F1B   breadth_first -> ScheduleLoopedBFS (arXiv 2211.05953)

Every schedule calls ``perform_reduce_grad`` on a stage once its backward has seen every
micro-batch; :class:`ReducingStage` hooks there to launch that stage's data-parallel gradient
reduction at once, overlapping the rest of the pipeline's backward.
"""

from __future__ import annotations


def chunk_ids(pp_rank: int, pp: int, v: int) -> list[int]:
    """The chunks (pipeline stages) that pipeline rank ``pp_rank`` holds."""
    return [pp_rank + k * pp for k in range(v)]


def _schedule_class(name: str):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleLoopedBFS

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
            "breadth_first": ScheduleLoopedBFS}[name]


def receives_first(p2p_ops: list) -> list:
    """The point-to-point operations with the receives first, each kind in its own order."""
    import torch.distributed as dist
    return sorted(p2p_ops, key=lambda op: op.op is not dist.irecv)


def post_receives_first() -> None:
    """Make the pipelining schedules post a mixed batch's receives before its sends (idempotent).

    Under 1F1B the schedules fuse each backward send with the next forward receive (and each
    forward send with a backward receive) into one ``batch_isend_irecv``, sends first. Over gloo's
    TCP transport that order serialises the two directions of a rank pair: a send whose peer has
    already announced its receive writes its data at once, and this rank's own "ready to
    receive" message then waits behind that data on the same connection, so the peer's send
    starts only after it (measured on the shaped-link testbed: 2 MiB each way took 350 ms against
    175 ms one way; receives first: 186 ms). NCCL groups the operations and runs both directions
    at once, which is what the cost model assumes of a link; posting the receives first gives the
    same on gloo. Receives are non-blocking, so the order cannot deadlock."""
    from torch.distributed.pipelining import schedules

    if getattr(schedules._batch_p2p, "_autoconf_receives_first", False):
        return
    original = schedules._batch_p2p

    def batch_p2p(p2p_ops, desc=None):
        return original(receives_first(p2p_ops), desc)

    batch_p2p._autoconf_receives_first = True
    schedules._batch_p2p = batch_p2p


def make_stage_class():
    from torch.distributed.pipelining import PipelineStage

    class ReducingStage(PipelineStage):
        """A PipelineStage that calls ``on_grads_final(self)`` once its gradients are final, and
        ``on_forwards_done(self)`` after its last micro-batch's forward."""

        on_grads_final = None
        on_forwards_done = None

        def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
            out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            if self.on_forwards_done is not None and fwd_chunk_id == self.chunks - 1:
                self.on_forwards_done(self)
            return out

        def perform_reduce_grad(self, grad_scale_factor: int):
            super().perform_reduce_grad(grad_scale_factor)
            if self.on_grads_final is not None:
                self.on_grads_final(self)

    return ReducingStage


def build_schedule(chunks: dict, schedule: str, num_chunks: int, num_micro_batches: int, pp_group,
                   device, loss_fn, on_grads_final=None, configure=None, on_forwards_done=None):
    """Wrap this rank's chunk modules ({chunk index: module}) in stages and a schedule.

    The stages count their sends and can compress their backward sends
    (``compression.make_compressing_stage``): ``configure(stage)`` sets that up per stage."""
    from autoconf.trainer.compression import make_compressing_stage

    post_receives_first()
    stage_cls = make_compressing_stage(make_stage_class())
    stages = []
    for idx in sorted(chunks):
        st = stage_cls(chunks[idx], idx, num_chunks, device, group=pp_group)
        st.on_grads_final = on_grads_final
        st.on_forwards_done = on_forwards_done
        if configure is not None:
            configure(st)
        stages.append(st)
    cls = _schedule_class(schedule)
    if schedule in ("gpipe", "1f1b"):
        return cls(stages[0], n_microbatches=num_micro_batches, loss_fn=loss_fn), stages
    return cls(stages, n_microbatches=num_micro_batches, loss_fn=loss_fn), stages


def run_step(sched, is_first: bool, is_last: bool, inputs, targets) -> list:
    """One pipelined forward+backward over all micro-batches; the last stage returns the
    per-micro-batch losses (others an empty list)."""
    losses: list = []
    # return_outputs=False: otherwise the last stage keeps every micro-batch's output (the logits,
    # m x b x s x V) until step() returns, only to hand them back; the losses are all we need
    if is_first and is_last:
        sched.step(inputs, target=targets, losses=losses, return_outputs=False)
    elif is_first:
        sched.step(inputs, return_outputs=False)
    elif is_last:
        sched.step(target=targets, losses=losses, return_outputs=False)
    else:
        sched.step(return_outputs=False)
    return losses
