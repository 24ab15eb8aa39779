"""A seventh hand-run batch of faults that are not triage inject scenarios (nor in fault.py-fault6.py)."""
import argparse, datetime, os, sys, time
import torch, torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--spawn", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()

WORK = "/tmp/fault7_work"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)


def main(rank: int = -1, world: int = 0) -> None:
    if rank >= 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    os.makedirs(WORK, exist_ok=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout), rank=rank, world_size=world)
    net = Net()
    if a.fault == "compile_fail":
        if rank == a.rank:
            os.environ["CXX"] = "/opt/toolchain/bin/g++"  # this rank's image points at a compiler it lacks
        net = torch.compile(net)
    model = nn.parallel.DistributedDataParallel(net) if a.fault != "fsdp_frozen" else __import__("fault7_fsdp").wrap(net, rank, a.rank)
    if a.fault == "zero_params":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        params = list(model.parameters())
        if rank == a.rank:
            params = [model.module.fc.weight]  # this rank's config freezes the bias
        opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, a.steps + 1):
        hit = rank == a.rank and step == 3
        if hit and a.fault == "save_perm":
            # a folder this rank cannot write (the shared checkpoint mount is not writable here)
            torch.save(model.state_dict(), "/sys/fault7_step3.pt")
        if hit and a.fault == "load_cuda":
            path = f"{WORK}/ema_rank{rank}.pt"
            torch.save(model.module.state_dict(), path)
            ema = torch.load(path, map_location="cuda")  # resume the EMA weights onto the GPU
        if hit and a.fault == "nofile":
            import resource
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
            shards = []
            for i in range(200):  # a shard index that opens every file and never closes them
                shards.append(open(f"{WORK}/shard-{rank}-{i:05d}.idx", "w"))
        if step == 3 and a.fault == "scatter_list":
            out = torch.zeros(4)
            lst = None
            if rank == a.rank:
                lst = [torch.full((4,), float(r)) for r in range(world - 1)]  # built for world-1 ranks
            dist.scatter(out, lst, src=a.rank)
        if hit and a.fault == "recv_never":
            t = torch.zeros(4)
            dist.recv(t, src=(a.rank + 1) % world)  # waits for a tensor its neighbour never sends
        if hit and a.fault == "store_get":
            store = dist.distributed_c10d._get_default_store()
            store.get("ckpt/step2/ready")  # a key no rank sets
        if hit and a.fault == "import_rank":
            import fault7_rank_profiler  # a plugin only this rank's config asks for
        if hit and a.fault == "os_exit3":
            os._exit(3)
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if step == 2 and a.fault == "slow_save" and rank == a.rank:
            print(f"rank {rank}: saving checkpoint step 2", flush=True)
            torch.save(model.module.state_dict(), f"{WORK}/step2.pt")
            time.sleep(25)  # a slow shared file system; the others do not wait for it
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
