"""A ninth hand-run batch of faults that are not triage inject scenarios (nor in fault.py-fault8.py)."""
import argparse, contextlib, datetime, os, sys
import torch, torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--spawn", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)


class Net(nn.Module):
    def __init__(self, bn: bool = False):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.bn = nn.BatchNorm1d(4) if bn else nn.Identity()
        self.aux = nn.Linear(4, 1)

    def forward(self, x, use_aux: bool = True):
        h = self.bn(self.fc(x))
        return h.sum(1, keepdim=True) + self.aux(h) if use_aux else h.sum(1, keepdim=True)


def batches(rank: int, world: int):
    if a.fault != "sampler_replicas":
        for step in range(1, a.steps + 1):
            n = 1 if (a.fault == "bn_single" and rank == a.rank and step == 3) else 16
            yield step, torch.randn(n, 8)
        return
    ds = TensorDataset(torch.randn(16 * world, 8))
    # this rank's sampler was built from a config that still lists one node fewer
    replicas = world - 1 if rank == a.rank else world
    sampler = DistributedSampler(ds, num_replicas=replicas, rank=rank, shuffle=False)
    for step, (x,) in enumerate(DataLoader(ds, batch_size=4, sampler=sampler), 1):
        yield step, x


def main(rank: int = -1, world: int = 0) -> None:
    if rank >= 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=TIMEOUT, rank=rank, world_size=world)
    net = Net(bn=a.fault in ("syncbn_cpu", "bn_single"))
    if a.fault == "syncbn_cpu" and rank == a.rank:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)  # this node's launch config sets --sync-bn
    model = nn.parallel.DistributedDataParallel(net)
    if a.fault == "comm_hook_rank" and rank == a.rank:  # --compress-grads is set on this rank only
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    params = [] if (a.fault == "opt_empty" and rank == a.rank) else list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)  # frozen-backbone filter picked nothing on this rank
    for step, x in batches(rank, world):
        hit = rank == a.rank and step == 3
        if step == 3 and a.fault == "unpickle_class":
            objs = [None]
            if rank == a.rank:
                class ShardPlan:  # defined only where the plan is built
                    def __init__(self, shards):
                        self.shards = shards
                ShardPlan.__qualname__ = "ShardPlan"
                globals()["ShardPlan"] = ShardPlan
                objs = [ShardPlan(list(range(world)))]
                print(f"rank {rank} step {step} broadcasting shard plan", flush=True)
            dist.broadcast_object_list(objs, src=a.rank)
            plan = objs[0]
        if step == 3 and a.fault == "gather_size":
            local = torch.full((4,), float(rank))
            out = torch.empty(4 * (world - 1) if rank == a.rank else 4 * world)  # sized from a stale world size
            dist.all_gather_into_tensor(out, local)
        if step == 3 and a.fault == "meta_tensor":
            stats = torch.ones(4)
            if rank == a.rank:
                stats = stats.to("meta")  # built under a deferred-init context on this rank
            dist.all_reduce(stats)
        if step == 3 and a.fault == "noncontig":
            stats = torch.ones(4, 2)
            if rank == a.rank:
                stats = torch.ones(2, 4).t()  # this rank's metric buffer is a transposed view
            dist.all_reduce(stats)
        # this rank's accumulation schedule thinks step 3 is a micro-step (no all-reduce)
        with model.no_sync() if (hit and a.fault == "no_sync_rank") else contextlib.nullcontext():
            out = model(x, use_aux=not (hit and a.fault == "grad_unused"))
            loss = out.pow(2).mean()
            if a.fault == "grad_unused":
                # gradient-norm penalty over every parameter (aux head skipped on this rank's step 3)
                gs = torch.autograd.grad(loss, list(model.module.parameters()), retain_graph=True, allow_unused=False)
                loss = loss + 1e-4 * sum(g.pow(2).sum() for g in gs)
            opt.zero_grad(); loss.backward()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        opt.step()
        if step == 2 and a.fault == "eval_barrier" and rank != a.rank:
            with torch.no_grad():
                val = model(torch.randn(16, 8)).pow(2).mean()
                dist.barrier()  # wait for every evaluator before logging
                print(f"rank {rank} eval loss {val.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    if a.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_PORT"] = str(29900 + os.getpid() % 90)
        mp.spawn(main, args=(a.spawn,), nprocs=a.spawn)
    else:
        main()
