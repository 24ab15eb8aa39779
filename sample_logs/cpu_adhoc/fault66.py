"""A sixty-sixth hand-run batch: OUTPUT PLUMBING. A tiny DDP loop on gloo (Linear(16,32)-ReLU-Linear(32,4), SGD,
batch 8, a 0.1 s sleep per step, PG timeout 15 s, no @record) with ONE plain fault on one rank, run under the pipes,
filters and redirections people put around torchrun (`| tee`, `| head`, `2>/dev/null`, `| grep`, `| cut`, a
stamping filter, `| sort`, `python -u`, `stdbuf -oL`, `script -qc`); the console file is what the plumbing let through.

Every rank prints `rank R step S loss L lr 0.05 ...` (a long progress line, about 150 characters) per step, and
`rank R done` at the end. With --trace DIR each rank also appends its own events to DIR/rankR.txt (the truth the
plumbing may hide: start, steps, the fault, a BrokenPipeError on stdout, the exit), never to the console.

Faults (--rank N):
  exc    rank N raises ValueError at step 3 (a sample with a bad feature count; a long message)
  kill   rank N SIGKILLs itself at step 3 (stands in for the OOM killer)
  hang   rank N sleeps 60 s at step 3 (a stuck storage read); the others time out in DDP's all-reduce after 15 s
  none   no fault (control)
"""
import argparse, datetime, os, signal, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True, choices=["exc", "kill", "hang", "none"])
p.add_argument("--rank", type=int, default=2)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--trace", default="")
a = p.parse_args()
RANK = int(os.environ["RANK"])


def trace(msg: str) -> None:
    if a.trace:
        with open(os.path.join(a.trace, f"rank{RANK}.txt"), "a") as fh:
            fh.write(f"{time.time():.3f} {msg}\n")


def main() -> None:
    world = int(os.environ["WORLD_SIZE"])
    trace("start")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    print(f"rank {RANK} of {world} ready (gloo)")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + RANK)
    for step in range(1, a.steps + 1):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        if step == 3 and RANK == a.rank:
            if a.fault == "exc":
                trace("raising ValueError at step 3")
                raise ValueError(f"rank {RANK}: sample 19 of shard {RANK} has 15 features, expected 16 "
                                 f"(file /data/shards/train-{RANK:05d}-of-{world:05d}.bin, offset 4864); "
                                 f"refusing to pad silently")
            if a.fault == "kill":
                trace("SIGKILL self at step 3")
                os.kill(os.getpid(), signal.SIGKILL)
            if a.fault == "hang":
                trace("sleeping 60 s at step 3")
                time.sleep(60)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        gn = sum(float(q.grad.norm()) ** 2 for q in model.parameters()) ** 0.5
        print(f"rank {RANK} step {step} loss {loss.item():.4f} lr 0.05 grad_norm {gn:.4f} "
              f"samples_seen {8 * step * world} throughput {8 * world / 0.1:.1f} samples/s eta {0.1 * (a.steps - step):.1f} s")
        trace(f"step {step}")
        time.sleep(0.1)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {RANK} done")
    trace("done")


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:
        trace(f"exit by {type(e).__name__}: {str(e)[:200]}")
        raise
