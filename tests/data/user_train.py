"""A user's own training script, as the emitted node scripts run it (``--emit DIR --script
user_train.py -- --steps 3``): it reads the launch plan with ``autoconf.load_plan()`` (the node
script sets AUTOCONF_PLAN), builds a tiny model, trains it data-parallel with gloo over the plan's
data-parallel groups and the plan's micro-batching, and writes ``user-results/rank_<RANK>.json``
with its coordinates, losses and final weights."""

import argparse
import json
import os

import torch
import torch.distributed as dist

import autoconf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", default="user-results")
    args = ap.parse_args()

    plan = autoconf.load_plan()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert world == plan.world_size, (world, plan.world_size)
    dist.init_process_group("gloo")
    me = plan.coords()  # the coordinates of the rank this process plays
    dp_group = None
    for ranks in plan.groups("dp"):  # every process creates every group, in the same order
        group = dist.new_group(list(ranks))
        if rank in ranks:
            dp_group, dp_ranks = group, ranks

    torch.manual_seed(plan.seed)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    per_replica = plan.global_batch // plan.dp
    losses = []
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(plan.global_batch, 8, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        opt.zero_grad()
        total = torch.zeros(())
        for mb in range(plan.num_micro_batches):  # this replica's share, micro-batch by micro-batch
            lo = me["dp"] * per_replica + mb * plan.micro_batch_size
            loss = ((model(x[lo:lo + plan.micro_batch_size]) - y[lo:lo + plan.micro_batch_size]) ** 2).mean()
            (loss / plan.num_micro_batches).backward()
            total += loss.detach() / plan.num_micro_batches
        for p in model.parameters():
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= plan.dp
        dist.all_reduce(total, group=dp_group)
        losses.append(float(total) / plan.dp)
        opt.step()

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank_{rank}.json"), "w") as f:
        json.dump({"rank": rank, "plays": plan.rank_on(rank), "coords": me, "dp_ranks": list(dp_ranks),
                   "world": world, "losses": losses,
                   "weights": [float(v) for p in model.parameters() for v in p.detach().flatten()],
                   "plan": os.environ["AUTOCONF_PLAN"], "steps": args.steps}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
