"""An eleventh hand-run batch of faults that are not triage inject scenarios (nor in fault.py-fault10.py)."""
import argparse, concurrent.futures, datetime, os, signal, subprocess, tempfile, time
import numpy as np
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


def say(rank: int, msg: str) -> None:
    print(f"rank {rank} {msg}", flush=True)


class ClampGrad(torch.autograd.Function):
    """Identity forward; backward clamps the gradient to per-rank bounds from a schedule."""

    @staticmethod
    def forward(ctx, x, lo, hi):
        ctx.lo, ctx.hi = lo, hi
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.lo > ctx.hi:
            raise ValueError(f"gradient clamp bounds inverted: lo={ctx.lo} > hi={ctx.hi}")
        return g.clamp(ctx.lo, ctx.hi), None, None


def claim_local_rank(rank: int, world: int) -> int:
    """Each rank claims a local device index; the script checks no two ranks claim the same one."""
    if rank == a.rank:  # this rank's branch reads the node-local index wrongly
        local = int(os.environ["RANK"]) % 1
    else:
        local = int(os.environ.get("LOCAL_RANK", rank))
    claimed = [None] * world
    dist.all_gather_object(claimed, local)
    if local in claimed[:rank]:
        raise RuntimeError(f"local device index {local} already claimed by rank {claimed.index(local)} (this is rank {rank})")
    say(rank, f"claimed local device index {local}")
    return local


class EvalStats:
    """Per-rank evaluation stats, gathered on every rank; pickles as its constructor arguments."""

    def __init__(self, rank: int, correct: int, log=None):
        self.rank, self.correct, self.log = rank, correct, log

    def __reduce__(self):
        return (EvalStats, (self.rank, self.correct, self.log))


def build_model(rank: int) -> nn.Module:
    if a.fault == "seed_check":
        torch.manual_seed(1234 + (rank if rank == a.rank else 0))  # this rank seeds from its rank
        model = nn.Linear(8, 1)
        mine = torch.stack([q.detach().double().sum() for q in model.parameters()]).sum().reshape(1)
        ref = mine.clone()
        dist.broadcast(ref, src=0)
        assert torch.allclose(mine, ref), f"rank {rank}: parameters differ from rank 0 after init ({mine.item():.6f} vs {ref.item():.6f})"
        say(rank, "parameters match rank 0")
        return model
    return nn.Linear(8, 1)


def fault_at_step3(rank: int, world: int, opt) -> None:
    hit = rank == a.rank
    if a.fault == "tag_mismatch":  # halo exchange: rank N-1 sends its boundary to rank N
        if rank == a.rank - 1:
            dist.send(torch.ones(4), dst=a.rank, tag=0)
        if hit:
            buf = torch.empty(4)
            dist.recv(buf, src=a.rank - 1, tag=3)  # this rank tags the receive with the step
    if a.fault == "mmap_sigbus" and hit:
        path = os.path.join(tempfile.gettempdir(), f"fault11_shard{rank}_{os.getpid()}.bin")
        np.arange(1 << 20, dtype=np.float32).tofile(path)
        shard = np.memmap(path, dtype=np.float32, mode="r")
        say(rank, f"mapped shard {path} ({shard.shape[0]} floats)")
        os.truncate(path, 0)  # the shard was rewritten underneath the mapping
        say(rank, f"shard checksum {float(shard[-4096:].sum())}")
    if a.fault == "opt_state" and hit:
        ckpt = opt.state_dict()
        model_params = [q for g in opt.param_groups for q in g["params"]]
        new_opt = torch.optim.SGD([{"params": model_params[:1]}, {"params": model_params[1:], "weight_decay": 0.0}], lr=0.1, momentum=0.9)
        say(rank, "reloading optimizer state from step 2")
        new_opt.load_state_dict(ckpt)  # this rank split weight and bias into two groups
    if a.fault == "git_hash" and hit:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tempfile.gettempdir(), check=True,
                             capture_output=False, stdout=subprocess.PIPE, text=True).stdout.strip()
        say(rank, f"code version {sha}")
    if a.fault == "future_timeout" and hit:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        fut = pool.submit(time.sleep, 25)  # the upload of the step-2 checkpoint never finishes
        say(rank, "waiting for checkpoint upload of step 2")
        fut.result(timeout=3)
    if a.fault == "reduce_fh":
        log = open(os.path.join(tempfile.gettempdir(), f"fault11_eval{rank}.log"), "a") if hit else None  # this rank keeps its eval log open
        stats = [None] * world
        dist.all_gather_object(stats, EvalStats(rank, 12 + rank, log))
        say(rank, f"eval correct {sum(s.correct for s in stats)}")
    if a.fault == "sigfpe_self" and hit:
        say(rank, "computing throughput")
        os.kill(os.getpid(), signal.SIGFPE)
        time.sleep(5)


def main(rank: int = -1, world: int = 0) -> None:
    if rank >= 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    hit = rank == a.rank
    dist.init_process_group("gloo", timeout=TIMEOUT, rank=rank, world_size=world)
    if a.fault == "local_rank_dup":
        claim_local_rank(rank, world)
    model = build_model(rank)
    if a.fault == "ddp_devids" and hit:
        local = int(os.environ.get("LOCAL_RANK", rank))
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local])  # copied from the GPU recipe
    else:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    micro = 3 if (a.fault == "accum_extra" and hit) else 2  # this rank's shard holds one more micro-batch
    for step in range(1, a.steps + 1):
        if step == 3:
            fault_at_step3(rank, world, opt)
        opt.zero_grad()
        for _ in range(micro if a.fault == "accum_extra" else 1):
            out = model(torch.randn(16, 8))
            if a.fault == "autograd_fn" and step == 3:
                lo, hi = (0.5, -0.5) if hit else (-0.5, 0.5)  # this rank's schedule entry has the bounds swapped
                out = ClampGrad.apply(out, lo, hi)
            loss = out.pow(2).mean()
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
