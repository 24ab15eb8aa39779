"""A hundred-and-twenty-sixth hand-run batch: HAND-ROLLED LAUNCHERS AND WRAPPERS. A small DDP regression job.

The program reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from the environment, so it can be
started by torchrun, by a bash loop, by the deprecated torch.distributed.launch --use-env, by a Popen
supervisor, or by itself through torch.multiprocessing.spawn (`--spawn N`). Each rank builds a tiny MLP
(8-16-1), loads a shared init checkpoint written by rank 0, wraps it in DDP (`--ddp 0`: gradients all-reduced
by hand), trains `--steps` steps on its own synthetic shard (`rank R step S loss L`), all-reduces the loss for
a log line on rank 0, all-reduces eval metrics at the end, rank 0 saves a checkpoint, then barrier and
destroy_process_group().

Faults:
- keyerr: rank N's optimizer override dict names the key warmup_steps; the lr lookup raises KeyError at step 0.
- parse: every rank parses the grad-accumulation setting "2.0" with int(): ValueError before training.
- exit3: rank N's process exits with os._exit(3) in step 2, printing nothing.
- segv: rank N gets SIGSEGV in step 3.
- sigkill: rank N gets SIGKILL in step 2.
- abort: rank N gets SIGABRT in step 1.
- hang: rank N sleeps (a stuck read) in step 3 before its forward; the others wait in DDP's all_reduce.
- shape: rank N's eval metrics tensor has 4 entries against 3; the final all_reduce sizes differ.
- port: rank N takes MASTER_PORT+1 (a stale job file) before init_process_group; rendezvous times out.
- worldsize: rank N takes WORLD_SIZE+1 before init_process_group.
- nan: rank N's shard has an inf feature at step 2; the program's finiteness check raises FloatingPointError.
- ckpt: rank N loads the init checkpoint as model_init.pth (missing file): FileNotFoundError.
What happened (filled in after the runs):
- keyerr: KeyError 'warmup' (line 111) on rank N at step 0; peers Connection closed by peer in backward.
- parse: ValueError int('2.0') (line 88) on every rank; spawn reports process 0, torchrun Root Cause rank 0.
- exit3: rank N exits 3 silently in step 2; peers Connection reset by peer; the launcher's exit is 3.
- segv: rank N dies silently in step 3 (bash loop: no trace; torch.distributed.run: Root Cause -11).
- sigkill: rank 2 SIGKILLed in step 2; mp.spawn: ProcessExitedException ... signal SIGKILL.
- abort: rank 4 SIGABRT in step 1; rank 0 Connection closed by peer; Root Cause exitcode -6.
- hang: pg 12 s: peers gloo recv/send timeouts, bash loop held to timeout 124; pg 300: hung, 124.
- shape: plain gloo: ranks 0-2 pass the all_reduce, all time out; DETAIL: Detected mismatch 3 vs 4.
- port: rank N's TCPStore client times out connecting to port+1; peers DistStoreError wait timeout.
- worldsize: rank 1 DistStoreError wait for key /4; ranks 0, 2, 3 Gloo connectFullMesh Connect timeout.
- nan: FloatingPointError: rank N step 2: loss nan is not finite (line 132).
- ckpt: FileNotFoundError .../init/model_init.pth from torch.load (line 97) on rank N.
"""
import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--work", default="/tmp/fault126_work")
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    return p.parse_args()


def hit(a, rank):
    return a.rank == -1 or a.rank == rank


def make_shard(rank, n=64):
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(n, 8, generator=g)
    w = torch.linspace(-1, 1, 8)
    y = (x @ w).unsqueeze(1) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def train(a):
    rank = int(os.environ["RANK"])
    if a.fault == "port" and hit(a, rank):
        os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
    if a.fault == "worldsize" and hit(a, rank):
        os.environ["WORLD_SIZE"] = str(int(os.environ["WORLD_SIZE"]) + 1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    world = dist.get_world_size()
    torch.manual_seed(0)
    print(f"rank {rank}/{world} up (local_rank {os.environ.get('LOCAL_RANK')}, pid {os.getpid()})", flush=True)

    accum_setting = "2.0" if a.fault == "parse" else "2"
    accum = int(accum_setting)

    init_dir = os.path.join(a.work, "init")
    os.makedirs(init_dir, exist_ok=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(init_dir, "model_init.pt"))
    dist.barrier()
    name = "model_init.pth" if (a.fault == "ckpt" and hit(a, rank)) else "model_init.pt"
    model.load_state_dict(torch.load(os.path.join(init_dir, name)))
    print(f"rank {rank}: loaded {name}", flush=True)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)

    sched = {"lr": 0.05, "warmup": 2}
    if a.fault == "keyerr" and hit(a, rank):
        sched = {"lr": 0.05, "warmup_steps": 2}
    opt = torch.optim.SGD(model.parameters(), lr=sched["lr"])
    x, y = make_shard(rank)
    bs = 16
    for step in range(a.steps):
        lr = sched["lr"] * min(1.0, (step + 1) / sched["warmup"])
        for gp in opt.param_groups:
            gp["lr"] = lr
        i = (step * bs) % x.shape[0]
        xb, yb = x[i:i + bs].clone(), y[i:i + bs]
        if a.fault == "nan" and hit(a, rank) and step == 2:
            xb[3, 5] = float("inf")
        if hit(a, rank):
            if a.fault == "exit3" and step == 2:
                os._exit(3)
            if a.fault == "segv" and step == 3:
                os.kill(os.getpid(), signal.SIGSEGV)
            if a.fault == "sigkill" and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            if a.fault == "abort" and step == 1:
                os.kill(os.getpid(), signal.SIGABRT)
            if a.fault == "hang" and step == 3:
                time.sleep(3600)
        out = net(xb)
        loss = nn.functional.mse_loss(out, yb) / accum * accum
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank} step {step}: loss {loss.item()} is not finite")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        t = loss.detach().clone()
        dist.all_reduce(t)
        if rank == 0:
            print(f"step {step} mean loss {t.item() / world:.4f} lr {lr:.3f}", flush=True)

    with torch.no_grad():
        pred = model(x)
        err = (pred - y).abs()
        metrics = [err.sum(), (err ** 2).sum(), torch.tensor(float(x.shape[0]))]
        if a.fault == "shape" and hit(a, rank):
            metrics.append(err.max())
        m = torch.stack(metrics)
    print(f"rank {rank} eval metrics {m.numel()} values", flush=True)
    dist.all_reduce(m)
    if rank == 0:
        print(f"eval mae {m[0].item() / m[2].item():.4f} mse {m[1].item() / m[2].item():.4f}", flush=True)
        os.makedirs(os.path.join(a.work, "ckpt"), exist_ok=True)
        torch.save(model.state_dict(), os.path.join(a.work, "ckpt", "final.pt"))
        print(f"saved {os.path.join(a.work, 'ckpt', 'final.pt')}", flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


def spawn_worker(local_rank, a, world):
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    train(a)


if __name__ == "__main__":
    args = parse_args()
    if args.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_worker, args=(args, args.spawn), nprocs=args.spawn, join=True)
    else:
        train(args)
