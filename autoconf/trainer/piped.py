"""pp > 1: this rank's pipeline chunks as torch.distributed.pipelining stages, ZeRO 0-3, tied
embeddings kept in sync between the first and the last stage.

A stage's gradients are reduced over dp (dp x cp under context parallelism) once its backward has
seen every micro-batch, except ZeRO-2 without layered accumulation, which reduces every unit's
gradients to their owners after each micro-batch's backward (GradSync.reduce_every_backward; the
tied weights still go once, after their sum over the first and last stage); sequence-parallel
gradients are then summed over tp at the end of the step."""

from __future__ import annotations


class Piped:
    def __init__(self, model, config, groups, device, layers, common):
        import torch

        from autoconf.trainer import data_parallel
        from autoconf.trainer import layers as gpt
        from autoconf.trainer.pipeline import build_schedule, chunk_ids
        from autoconf.trainer.tensor_parallel import SequenceParallelGrads

        self.config, self.groups = config, groups
        n = config.num_chunks
        self.chunk_ids = chunk_ids(groups.pp_rank, config.pp, config.virtual_stages)
        self.chunks = {c: gpt.build_stage(model, layers[c], c == 0, c == n - 1, **common) for c in self.chunk_ids}
        self.is_first, self.is_last = 0 in self.chunks, n - 1 in self.chunks
        tp_group = groups.tp if config.tp > 1 else None
        self.sp = {c: SequenceParallelGrads(mod, tp_group) for c, mod in self.chunks.items()}
        self.tied = []
        if model.tied_embeddings:
            if self.is_first:
                self.tied.append(self.chunks[0].embedding.weight)
            if self.is_last:
                self.tied.append(self.chunks[n - 1].head.weight)
        self.tied_ids = {id(p) for p in self.tied}
        self.grad_sync = None
        self.partitioned = False  # ZeRO-2 reducing every micro-batch's gradients
        # ZeRO-3 with layered accumulation: a chunk's units stay gathered through its forwards and
        # are resharded after the last (_forwards_done), one gather per pass (space.schedules.fsdp_gathers)
        self.layered_fsdp = config.zero_stage == 3 and config.layered_grad_accum
        if config.zero_stage == 3:
            for mod in self.chunks.values():
                data_parallel.apply_fsdp(_units(mod), mod, groups.grad, device.type,
                                         reshard_after_forward=not self.layered_fsdp)
        else:
            self.grad_sync = data_parallel.grad_sync(self.parameters(), config, groups)
            if not config.layered_grad_accum:
                buckets = [[p for p in u.parameters() if id(p) not in self.tied_ids]
                           for c in self.chunk_ids for u in _units(self.chunks[c])]
                # the schedules scale p.grad by 1/m after the last micro-batch: do it on the owners
                self.partitioned = self.grad_sync.reduce_every_backward(buckets, config.num_micro_batches)

        def loss_fn(logits, target):
            return gpt.vocab_parallel_cross_entropy(logits, target, model, tp_group)

        from autoconf.trainer.compression import CommCounter, stage_compression

        self.comm = CommCounter()
        self.fused = config.fused_embedding_sync and bool(self.tied)

        def configure(stage):
            if config.pp_compression == "none":
                stage.configure(self.comm)
                return
            send, recv = stage_compression(config.schedule, config.pp, config.num_micro_batches,
                                           config.virtual_stages, config.pp_compression, stage.stage_index)
            # the same seed on every tensor-parallel rank: replicated gradients stay identical
            stage.configure(self.comm, send, recv, config.pp_compression_rank,
                            seed=common.get("seed", 0) * 1_000_003 + stage.stage_index)

        self.sched, self.stages = build_schedule(self.chunks, config.schedule, n, config.num_micro_batches,
                                                 groups.pp, device, loss_fn, self._grads_final, configure,
                                                 self._forwards_done if self.layered_fsdp else None)
        self._torch = torch

    def modules(self):
        return [self.chunks[c] for c in self.chunk_ids]

    def parameters(self):
        return [p for c in self.chunk_ids for p in self.chunks[c].parameters()]

    def _forwards_done(self, stage) -> None:
        """Layered ZeRO-3: every micro-batch went through the chunk's forward; free its gathered
        parameters until its backward gathers them again."""
        for unit in _units(self.chunks[stage.stage_index]):
            unit.reshard()

    def _grads_final(self, stage) -> None:
        """A stage's backward has seen every micro-batch: sum SP grads, launch its dp reduction."""
        if self.partitioned:  # already reduced, micro-batch by micro-batch
            return
        idx = stage.stage_index
        self.sp[idx](self.chunks[idx])
        if self.grad_sync is not None:
            self.grad_sync.launch([p for p in self.chunks[idx].parameters() if id(p) not in self.tied_ids])

    def step(self, x, y) -> list[float]:
        import torch.distributed as dist

        from autoconf.trainer.pipeline import run_step

        losses = run_step(self.sched, self.is_first, self.is_last, x, y)
        for p in self.tied:  # embedding (first stage) + output layer (last stage): one weight
            self.comm.embedding_payload += p.grad.numel() * p.grad.element_size()
            if self.fused:  # over both stages and every dp x cp replica at once: the average
                dist.all_reduce(p.grad, group=self.groups.embedding_fused)
                p.grad.div_(len(self.groups.grad_ranks))
            else:
                dist.all_reduce(p.grad, group=self.groups.embedding)
        if self.grad_sync is not None:
            if not self.fused:  # exactly, also under PowerSGD: both copies of the weight get the same update
                self.grad_sync.launch(self.tied, exact=True)
            self.grad_sync.finish()
            if self.fused and self.config.zero_stage == 2:  # ZeRO-2: only the owner keeps a gradient
                for p in self.tied:
                    if self.grad_sync.owner[id(p)] != self.groups.grad_rank:
                        p.grad = None
        if self.partitioned:
            for c in self.chunk_ids:
                self.sp[c](self.chunks[c])
        return [float(loss) for loss in losses]

    def comm_bytes(self) -> dict:
        """This step's bytes (``compression.CommCounter.take``), then the counts restart."""
        return self.comm.take(self.grad_sync)


def _units(mod) -> list:
    """A stage's units: embedding (first stage), blocks, head (last stage)."""
    return ([mod.embedding] if mod.embedding is not None else []) + list(mod.blocks.values()) \
        + ([mod.head] if mod.head is not None else [])
