"""An eighth hand-run batch of faults that are not triage inject scenarios (nor in fault.py-fault7.py)."""
import argparse, datetime, os, signal, sys, time
import torch, torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--spawn", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)


SHARD_INDEX = {f"shard-{i:03d}": i * 1000 for i in range(8)}


def lookup_offset(key: str) -> int:
    """Runs on the worker that owns the shard index (called over RPC)."""
    return SHARD_INDEX[key]


def run_rpc(rank: int, world: int) -> None:
    from torch.distributed import rpc
    opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=a.pg_timeout)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    if rank == a.rank:
        SHARD_INDEX.pop("shard-003")  # this worker's index was built from an older manifest
    for step in range(1, a.steps + 1):
        owner = (rank + 1) % world
        off = rpc.rpc_sync(f"worker{owner}", lookup_offset, args=(f"shard-{step:03d}",))
        print(f"rank {rank} step {step} shard offset {off} from worker{owner}", flush=True)
    rpc.shutdown()
    print(f"rank {rank} done", flush=True)


def main(rank: int = -1, world: int = 0) -> None:
    if rank >= 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if a.fault == "argparse_env":
        if rank == a.rank:
            os.environ["GRAD_ACCUM_STEPS"] = "auto"  # this node's env file sets it for another trainer
        tp = argparse.ArgumentParser(description="trainer options")
        tp.add_argument("--grad-accum", type=int, default=os.environ.get("GRAD_ACCUM_STEPS", "1"))
        tp.parse_args([])
    if a.fault == "rpc_raise":
        return run_rpc(rank, world)
    if a.fault == "addr_dead" and rank == a.rank:
        os.environ["MASTER_ADDR"] = "10.255.255.1"  # a stale address from this node's config
    backend = "nccl" if (a.fault == "nccl_rank" and rank == a.rank) else "gloo"
    dist.init_process_group(backend, timeout=TIMEOUT, rank=rank, world_size=world)
    model = nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, a.steps + 1):
        hit = rank == a.rank and step == 3
        if hit and a.fault == "reinit_port":
            dist.destroy_process_group()  # "switch to the eval group" on a port of its own
            os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
            dist.init_process_group("gloo", timeout=TIMEOUT, rank=rank, world_size=world)
        if step == 3 and a.fault in ("reduce_avg", "premul_sum"):
            t = torch.ones(4)
            dist.all_reduce(t, op=(dist.ReduceOp.AVG if a.fault == "reduce_avg" else dist._make_nccl_premul_sum(0.5)) if rank == a.rank else dist.ReduceOp.SUM)
        if hit and a.fault == "sigusr1_self":
            os.kill(os.getpid(), signal.SIGUSR1)  # a profiler hook that dumps on SIGUSR1, not installed here
        if hit and a.fault == "sighup_self":
            os.kill(os.getpid(), signal.SIGHUP)  # a log-rotation hook that signals its own process
        x = __import__("fault8_extra").batch(rank, step, a) if a.fault in ("loader_timeout", "json_config", "save_full") else torch.randn(16, 8)
        if hit and a.fault == "clip_inf":
            x[0, 0] = float("inf")  # one corrupt sample in this rank's batch
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if a.fault == "clip_inf":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()
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
