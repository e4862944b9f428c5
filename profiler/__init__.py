"""The profiler: measures a model and the links between ranks on the real devices, under torchrun.

Locally (one host; launches torchrun for you, OMP_NUM_THREADS=1 per process)::

    autoconf profile --model gpt2 --nproc-per-node 8 --out profile.json

Under a launch you already have (every host runs the same command)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint head:29500 \\
        -m profiler --model gpt2 --out profile.json
    # or with Slurm: one task per GPU, torch.distributed's env:// variables set from Slurm's
    srun --ntasks-per-node 8 bash -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS \\
        LOCAL_RANK=$SLURM_LOCALID LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE MASTER_ADDR=head MASTER_PORT=29500 \\
        python -m profiler --model gpt2 --out profile.json'

Rank 0 writes the file (on its host). NCCL is used when CUDA is available, gloo otherwise.
Flags: ``--micro-batch-sizes 1,2,4 --tp 1,2 --repeats N --quick`` and more (``python -m profiler -h``).

Modules: ``run`` (phases and orchestration), ``compute`` (layer timings, GEMM table, saved bytes),
``links`` (point-to-point tournament, collectives), ``env`` (hosts, devices, interfaces, memory),
``assemble`` (gathered results -> Profile), ``report`` (progress bars, summary tables), ``cli``
(the ``autoconf profile`` command), ``memory`` (saved-tensor accounting).
Importing this package does not import torch.
"""
