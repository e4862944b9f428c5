"""Compressed 3D-parallel traffic in the reference trainer (Optimus-CC, arXiv 2301.09830), run for real.

- :class:`LowRankSender`: a pipeline chunk's compressor of the activation gradient it sends
  backwards. The gradient ``[b, s, h]`` is an ``n x m`` matrix M (n = b x local tokens, m = h);
  the residual of the last compressed send is added to the next gradient this chunk sends (lazy
  error propagation), then ONE power iteration warm-started from the chunk's last Q (first time: a
  seeded random Q, the same seed on every tensor-parallel rank): ``P = M Q``, P orthonormalised
  (``torch.linalg.qr``), ``Q = M^T P``; the residual becomes ``M - P Q^T``. P and Q go in the
  gradient's dtype (the power iteration itself runs in fp32 for 16-bit gradients: CPU QR has no
  bf16).
- :func:`make_compressing_stage`: a ``PipelineStage`` subclass (of the trainer's reducing stage)
  that sends P and Q (two isends) for the micro-batches ``space.compression.compressed_sends``
  names, receives them into buffers of the shapes :func:`factor_shapes` gives, and multiplies
  ``P Q^T`` back into the gradient buffer before the backward; every isend's bytes are counted per
  peer global rank and direction (:class:`CommCounter`).
- :class:`PowerSGDBucket` / :func:`powersgd_state`: torch's own ``powerSGD_hook`` on the
  trainer's hand-made gradient buckets (ZeRO-0/1 ``GradSync.launch``).

The rules (which sends are compressed, ranks, PowerSGD's split) are ``autoconf.cost.compression``'s,
so the trainer runs what the cost model prices.
"""

from __future__ import annotations

from autoconf.space.compression import compressed_sends, effective_rank

START_POWERSGD_ITER = 2
"""torch's PowerSGD runs plain all-reduces for this many steps first (it requires > 1 with error
feedback and warm start)."""


# -- pipeline: low-rank backward sends -------------------------------------------------------------

def as_matrix(t):
    """The n x m view of a gradient [..., m] (n = product of the leading dimensions)."""
    return t.reshape(-1, t.shape[-1])


def factor_shapes(shape, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of P (n x r) and Q (m x r) for a gradient of this shape at this rank."""
    m = int(shape[-1])
    n = 1
    for d in shape[:-1]:
        n *= int(d)
    r = effective_rank(n, m, rank)
    return (n, r), (m, r)


def reconstruct(p, q):
    """P Q^T in the factors' dtype: the same operation on sender (its residual) and receiver."""
    return p @ q.t()


class LowRankSender:
    """One chunk's compressor state: the warm-start Q and the carried residual (lazy error
    propagation). Memory: the residual (n x m, gradient dtype) and Q (m x r) between sends."""

    def __init__(self, rank: int, seed: int = 0):
        self.rank = rank
        self.seed = seed
        self.q = None
        self.residual = None

    def exact(self, grad):
        """The gradient to send exactly: with the carried residual added (which is then cleared)."""
        if self.residual is None:
            return grad
        out = grad + self.residual.view_as(grad)
        self.residual = None
        return out

    def compress(self, grad):
        """(P, Q), contiguous, in ``grad``'s dtype, for this gradient plus the carried residual;
        the new residual is kept."""
        import torch

        mat = as_matrix(grad)
        if self.residual is not None:
            mat = mat + self.residual
        n, m = mat.shape
        r = effective_rank(n, m, self.rank)
        work = torch.float32 if mat.dtype in (torch.float16, torch.bfloat16) else mat.dtype
        mw = mat.to(work)
        if self.q is None or self.q.shape != (m, r):
            g = torch.Generator(device="cpu").manual_seed(self.seed)
            self.q = torch.randn(m, r, generator=g, dtype=work).to(mat.device)
        p = mw @ self.q
        p, _ = torch.linalg.qr(p)  # reduced: n x r, orthonormal columns
        q = mw.t() @ p
        self.q = q
        p, q = p.to(mat.dtype).contiguous(), q.to(mat.dtype).contiguous()
        self.residual = mat - reconstruct(p, q)
        return p, q


class CommCounter:
    """Bytes this rank handed to communication in one step: pipeline isends per peer global rank
    and direction, the tied-embedding sync's (the data-parallel payload is the GradSync's own
    count, taken with :meth:`take`)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.pp_send: dict = {}
        self.embedding_payload = 0

    def add_ops(self, ops, direction: str) -> None:
        for op in ops:
            per = self.pp_send.setdefault(str(op.peer), {"forward": 0, "backward": 0})
            per[direction] += op.tensor.numel() * op.tensor.element_size()

    def take(self, grad_sync) -> dict:
        """This step's bytes, the data-parallel payload taken from ``grad_sync`` (None without one:
        ZeRO-3, whose FSDP collectives are counted instead), then the counts restart."""
        snap = {"pp_send": {k: dict(v) for k, v in sorted(self.pp_send.items(), key=lambda kv: int(kv[0]))},
                "dp_payload": grad_sync.take_payload() if grad_sync is not None else None,
                "embedding_payload": int(self.embedding_payload)}
        if grad_sync is None:  # ZeRO-3: FSDP2's gathers and reduce-scatters this step, by unit
            from autoconf.trainer.fsdp_counts import take_fsdp_calls

            snap["fsdp_calls"] = take_fsdp_calls()
        self.reset()
        return snap


def stage_compression(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int, mode: str,
                      stage_index: int) -> tuple[frozenset, frozenset]:
    """(micro-batches whose gradient this chunk sends compressed, micro-batches whose gradient it
    receives compressed from chunk + 1)."""
    pairs = compressed_sends(schedule, pp, num_micro_batches, virtual_stages, mode)
    return (frozenset(mb for mb, c in pairs if c == stage_index),
            frozenset(mb for mb, c in pairs if c == stage_index + 1))


def make_compressing_stage(base):
    """A subclass of the stage class ``base`` that counts its sends and, when configured
    (:meth:`configure`), compresses its backward sends as the schedule's set says."""
    import torch
    import torch.distributed as dist

    class CompressingStage(base):
        counter: CommCounter | None = None
        sender: LowRankSender | None = None
        send_compressed: frozenset = frozenset()
        recv_compressed: frozenset = frozenset()
        factor_rank: int = 0

        def configure(self, counter, send_compressed=frozenset(), recv_compressed=frozenset(), rank: int = 0,
                      seed: int = 0) -> None:
            self.counter = counter
            self.send_compressed, self.recv_compressed = frozenset(send_compressed), frozenset(recv_compressed)
            self.factor_rank = rank
            self.sender = LowRankSender(rank, seed) if rank else None
            self._factors: dict = {}  # mb -> (P, Q) receive buffers until the backward
            self._sent: dict = {}  # mb -> (P, Q) being sent (kept alive until the next step)

        def _count(self, ops, direction):
            if self.counter is not None:
                self.counter.add_ops(ops, direction)
            return ops

        def get_fwd_send_ops(self, fwd_chunk_id: int):
            return self._count(super().get_fwd_send_ops(fwd_chunk_id), "forward")

        def get_bwd_send_ops(self, bwd_chunk_id: int):
            if self.sender is None or not self.has_backward or self.is_first:
                return self._count(super().get_bwd_send_ops(bwd_chunk_id), "backward")
            grads = self.bwd_cache[bwd_chunk_id]
            if len(grads) != 1 or not isinstance(grads[0], torch.Tensor):
                raise RuntimeError(f"stage {self.stage_index}: pipeline compression needs one input gradient, "
                                   f"got {len(grads)}")
            grad = grads[0]
            if bwd_chunk_id not in self.send_compressed:
                self.bwd_cache[bwd_chunk_id] = (self.sender.exact(grad),)
                return self._count(super().get_bwd_send_ops(bwd_chunk_id), "backward")
            self.bwd_cache.pop(bwd_chunk_id)
            if self.grad_send_info is None:
                self.grad_send_info = self._create_grad_send_info(self.args_recv_info[0])
            p, q = self.sender.compress(grad)
            self._sent[bwd_chunk_id] = (p, q)
            peer = self._resolve_peer_global_rank(self.grad_send_info[0])
            ops = [dist.P2POp(dist.isend, p, peer, self.group), dist.P2POp(dist.isend, q, peer, self.group)]
            return self._count(ops, "backward")

        def get_bwd_recv_ops(self, bwd_chunk_id: int):
            if (bwd_chunk_id not in self.recv_compressed or not self.has_backward or self.is_last):
                return super().get_bwd_recv_ops(bwd_chunk_id)
            infos = self.grad_recv_info[bwd_chunk_id]
            if len(infos) != 1 or infos[0].buffer is None:
                raise RuntimeError(f"stage {self.stage_index}: pipeline compression needs one output gradient")
            info = infos[0]
            buf = info.buffer
            (n, r), (m, _) = factor_shapes(buf.shape, self.factor_rank)
            p = torch.empty(n, r, dtype=buf.dtype, device=buf.device)
            q = torch.empty(m, r, dtype=buf.dtype, device=buf.device)
            self._factors[bwd_chunk_id] = (p, q)
            peer = self._resolve_peer_global_rank(info.source)
            return [dist.P2POp(dist.irecv, p, peer, self.group), dist.P2POp(dist.irecv, q, peer, self.group)]

        def _retrieve_recv_grads(self, bwd_chunk_id: int):
            factors = self._factors.pop(bwd_chunk_id, None) if self.recv_compressed else None
            if factors is not None:
                buf = self.grad_recv_info[bwd_chunk_id][0].buffer
                buf.copy_(reconstruct(*factors).view_as(buf))
            return super()._retrieve_recv_grads(bwd_chunk_id)

        def clear_runtime_states(self) -> None:
            super().clear_runtime_states()
            if hasattr(self, "_sent"):
                self._sent.clear()

    return CompressingStage


# -- data parallel: torch's PowerSGD hook on the trainer's buckets -----------------------------------

def powersgd_state(group, rank: int, seed: int = 0):
    """torch's ``PowerSGDState`` as the trainer uses it: error feedback, warm start, plain
    all-reduces for the first ``START_POWERSGD_ITER`` steps, compression only where it at least
    halves a matrix."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    return PowerSGDState(process_group=group, matrix_approximation_rank=rank, start_powerSGD_iter=START_POWERSGD_ITER,
                         min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=seed)


class PowerSGDBucket:
    """The part of torch's ``GradBucket`` that ``powerSGD_hook`` uses, for a flat gradient buffer.

    ``is_last()`` is always False: the trainer counts steps itself (:func:`end_step`, once every
    bucket of the step has landed), which is when DDP's last bucket would count it."""

    def __init__(self, index: int, flat, params):
        from torch._utils import _unflatten_dense_tensors

        self._index, self._flat, self._params = index, flat, list(params)
        self._grads = list(_unflatten_dense_tensors(flat, [p.grad for p in self._params]))

    def index(self) -> int:
        return self._index

    def buffer(self):
        return self._flat

    def gradients(self) -> list:
        return self._grads

    def parameters(self) -> list:
        return self._params

    def is_last(self) -> bool:
        return False


class _StepEnd:
    @staticmethod
    def is_last() -> bool:
        return True


def end_step(state) -> None:
    """One step's buckets have all landed: count the step (``PowerSGDState.maybe_increase_iter``)."""
    state.maybe_increase_iter(_StepEnd())
