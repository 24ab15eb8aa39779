"""A twelfth hand-run batch of faults that are not triage inject scenarios (nor in fault.py-fault11.py)."""
import argparse, datetime, logging, os, pdb, resource, sys, time, warnings
import torch, torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--spawn", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=15)
a = p.parse_args()
TIMEOUT = datetime.timedelta(seconds=a.pg_timeout)


def say(rank: int, msg: str) -> None:
    print(f"rank {rank} {msg}", flush=True)


class NoisyBlock(nn.Module):
    """A block whose forward draws its noise from a per-call cache that is consumed when read."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.noise = {}

    def forward(self, x):
        key = x.shape[0]
        noise = self.noise.pop(key) if self.pop_noise else self.noise[key]  # recomputation reads it again
        return torch.relu(self.lin(x) + noise)


class Net(nn.Module):
    def __init__(self, ckpt: bool):
        super().__init__()
        self.block = NoisyBlock()
        self.head = nn.Linear(8, 1)
        self.ckpt = ckpt

    def forward(self, x):
        self.block.noise[x.shape[0]] = torch.randn(x.shape[0], 8) * 0.01
        h = checkpoint(self.block, x, use_reentrant=False) if self.ckpt else self.block(x)
        return self.head(h)


def seed_worker(worker_id: int) -> None:
    if int(os.environ.get("RANK", "-1")) == a.rank and worker_id == 1:
        sys.exit(1)  # this worker's shard list is empty on this rank, and the init function bails out


def feature_scale(x: torch.Tensor) -> torch.Tensor:
    return x / x.std()


def fault_at_step3(rank: int, world: int, model, hit: bool) -> None:
    if a.fault == "stdin_eof" and hit:
        say(rank, "loss plateaued; asking whether to lower the learning rate")
        ans = input("lower lr? [y/N] ")
        say(rank, f"answer {ans!r}")
    if a.fault == "pdb_left" and hit:
        say(rank, "checking gradient norms")
        pdb.set_trace()  # left in from a debugging session
        say(rank, "resumed")
    if a.fault == "profiler_nested" and hit:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as outer:
            say(rank, "profiling step 3")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as inner:  # a helper profiles itself too
                torch.randn(64, 64) @ torch.randn(64, 64)
    if a.fault == "log_handler" and hit:
        log = logging.getLogger("metrics")
        log.addHandler(logging.FileHandler(f"/sys/fault12_metrics_rank{rank}.log"))  # the run folder is mounted read-only on this rank's node
        log.warning("step 3 metrics")
    if a.fault == "infer_allreduce" and hit:
        with torch.inference_mode():
            say(rank, "averaging weights for evaluation")
            w = model.module.head.weight
            dist.all_reduce(w)  # the parameter itself, not a copy
            w /= world
    if a.fault == "infer_allreduce" and not hit:
        with torch.inference_mode():
            w = model.module.head.weight.detach().clone()
            dist.all_reduce(w)
    if a.fault == "monitored_all":
        if rank in (a.rank, a.rank - 1):
            say(rank, "writing eval shard")
            time.sleep(30)  # two ranks' eval shards are slow to write
        dist.monitored_barrier(timeout=TIMEOUT, wait_all_ranks=True)
    if a.fault == "jit_rank" and hit:
        say(rank, "scripting the feature transform")
        scripted = torch.jit.script(lambda x: x / x.std())  # this rank's fast path scripts a lambda
        scripted(torch.randn(4))
    if a.fault == "warn_error" and hit:
        warnings.simplefilter("error")  # this rank runs with -W error from its debug profile
        base = torch.randn(8)
        t = torch.tensor(base)
        say(rank, f"copied stats {t.sum().item():.3f}")
    if a.fault == "detail_op":
        stats = torch.tensor([float(rank), 1.0])
        if hit:  # this rank gathers its eval stats where the others sum them
            out = [torch.empty(2) for _ in range(world)]
            dist.all_gather(out, stats)
        else:
            dist.all_reduce(stats)
        say(rank, "eval stats synced")
    if a.fault == "stdout_closed" and hit:
        say(rank, "switching progress output to the dashboard")
        sys.stdout.close()  # meant to close the dashboard's pipe, closes the real stdout
    if a.fault == "fsize_save" and hit:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # the node's job wrapper caps file size at 1 MiB
        path = f"/tmp/fault12_step2_rank{rank}.pt"
        say(rank, f"saving step-2 checkpoint to {path}")
        torch.save({"model": model.state_dict(), "buffer": torch.zeros(1 << 20)}, path)
    if a.fault == "cpu_limit" and hit:
        used = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(used.ru_utime + used.ru_stime) + 2
        resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 30))  # the node's job wrapper caps CPU seconds
        say(rank, f"CPU seconds capped at {soft}; computing the eval metric")
        x = torch.randn(512, 512)
        while True:
            x = torch.tanh(x @ x) 


def main(rank: int = -1, world: int = 0) -> None:
    if rank >= 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    hit = rank == a.rank
    dist.init_process_group("gloo", timeout=TIMEOUT, rank=rank, world_size=world)
    if a.fault == "default_dtype" and hit:
        torch.set_default_dtype(torch.float64)  # this rank's config enables double precision
    ckpt = a.fault == "ckpt_recompute"
    model = Net(ckpt)
    model.block.pop_noise = ckpt and hit  # this rank's copy of the block consumes its noise on first read
    model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = None
    if a.fault == "worker_init_exit":
        data = torch.utils.data.TensorDataset(torch.randn(64, 8))
        loader = iter(torch.utils.data.DataLoader(data, batch_size=16, num_workers=2, worker_init_fn=seed_worker))
    for step in range(1, a.steps + 1):
        if step == 3:
            fault_at_step3(rank, world, model, hit)
        opt.zero_grad()
        x = next(loader)[0] if (loader is not None and step <= 4) else torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        say(rank, f"step {step} loss {loss.item():.4f}")
    dist.barrier()
    dist.destroy_process_group()
    say(rank, "done")


if __name__ == "__main__":
    if a.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_PORT"] = str(29900 + os.getpid() % 90)
        mp.spawn(main, args=(a.spawn,), nprocs=a.spawn)
    else:
        main()
