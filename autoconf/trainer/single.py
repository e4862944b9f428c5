"""pp = 1: the whole model on every rank, standard or layered gradient accumulation, ZeRO 0-3.

Gradients are reduced over dp (dp x cp under context parallelism) once they are final (after the
last micro-batch; per unit when layered), except ZeRO-2 with standard accumulation, which reduces
every unit's gradients to their owners after each micro-batch (GradSync.reduce_every_backward);
sequence-parallel gradients are then summed over tp on the owners' averaged gradients, at the end
of the step."""

from __future__ import annotations

from autoconf.trainer.accumulation import Hooks, layered_step, standard_step


class SingleStage:
    """One stage holding embedding, every block and the head."""

    def __init__(self, model, config, groups, device, layers, common):
        from autoconf.trainer import data_parallel
        from autoconf.trainer import layers as gpt
        from autoconf.trainer.tensor_parallel import SequenceParallelGrads

        self.config = config
        self.chunk_ids, self.is_first, self.is_last = [0], True, True
        self.stage = gpt.build_stage(model, layers[0], True, True, **common)
        s = self.stage
        self.units = [("embedding", s.embedding)] + [(f"blocks.{i}", b) for i, b in s.blocks.items()] + [("head", s.head)]
        self.sp = SequenceParallelGrads(s, groups.tp if config.tp > 1 else None)
        self.grad_sync = None
        self.partitioned = False  # ZeRO-2 reducing every micro-batch's gradients
        if config.zero_stage == 3:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            if config.layered_grad_accum:
                # each unit its own FSDP root: gathered once for all micro-batches' forward,
                # once for their backward (arXiv 2106.02679, sec. 3)
                mesh = DeviceMesh.from_group(groups.grad, device.type, mesh_dim_names=("dp",))
                for _, u in self.units:
                    fully_shard(u, mesh=mesh, reshard_after_forward=False)
            else:
                data_parallel.apply_fsdp([u for _, u in self.units], s, groups.grad, device.type)
        else:
            self.grad_sync = data_parallel.grad_sync(self.parameters(), config, groups)
            if not config.layered_grad_accum:
                self.partitioned = self.grad_sync.reduce_every_backward([list(u.parameters()) for _, u in self.units])

    def modules(self):
        return [self.stage]

    def parameters(self):
        return list(self.stage.parameters())

    def step(self, x, y) -> list[float]:
        m = self.config.num_micro_batches
        xs, ys = x.chunk(m), y.chunk(m)
        hooks = _Hooks(self)
        if self.config.layered_grad_accum:
            losses = layered_step([u for _, u in self.units], xs, ys, hooks)
        else:
            losses = standard_step(self.stage, xs, ys, hooks)
        if self.grad_sync is not None:
            self.grad_sync.finish()
        if self.partitioned:
            self.sp(self.stage)
        return losses

    def comm_bytes(self) -> dict:
        """This step's bytes (``compression.CommCounter.take``: no pipeline sends, no embedding
        sync here), then the counts restart."""
        from autoconf.trainer.compression import CommCounter

        return CommCounter().take(self.grad_sync)


class _Hooks(Hooks):
    def __init__(self, runner: SingleStage):
        self.r = runner
        self.prefix = {id(u): p for p, u in runner.units}
        self.prefix[id(runner.stage)] = ""
        self.fsdp = runner.config.zero_stage == 3

    def after_forward(self, unit) -> None:
        if self.fsdp and self.r.config.layered_grad_accum:
            unit.reshard()

    def before_backward(self, unit, micro_batch: int, last: bool) -> None:
        if self.fsdp:
            unit.set_requires_gradient_sync(last)
            if self.r.config.layered_grad_accum:
                unit.set_reshard_after_backward(last)

    def grads_final(self, unit) -> None:
        if self.r.partitioned:  # already reduced, micro-batch by micro-batch
            return
        self.r.sp(unit, self.prefix[id(unit)])
        if self.r.grad_sync is not None:
            self.r.grad_sync.launch(list(unit.parameters()))
