"""A forty-eighth hand-run batch: LOG COLLECTORS. One plain fault per run in a small DDP loop on gloo (2-8 ranks,
Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, 5 steps, a progress line `[rank R] step S/5 loss L` per step; the
progress line is coloured with rich when stdout is a terminal, as under `script`). The console is then handed back
the way a cluster's log collector returns it (see fault48_collect.py and the README paragraph).

Faults (--rank N: the rank at fault; the fault fires at step 3 unless said otherwise):
  exc      ValueError from a label check on rank N's batch
  shape    rank N's batch has 9 features (RuntimeError: mat1 and mat2 shapes cannot be multiplied)
  nan      rank N's batch holds a NaN feature; the finite-loss check raises FloatingPointError
  nockpt   after init_process_group, rank N loads its warm-start checkpoint from a path that does not exist
           (FileNotFoundError from torch.load)
  osexit   rank N calls os._exit(3) (no traceback)
  segv     rank N reads address 0 with ctypes.string_at(0) (SIGSEGV)
  sigkill  a sidecar process (a memory watchdog stand-in, started by rank N at step 2) SIGKILLs rank N 0.5 s later
  hang     rank N sleeps 60 s before its step-3 forward; the others time out in DDP's all-reduce (gloo, --pg-timeout)
  none     no fault (control run)
"""
import argparse, ctypes, datetime, math, os, subprocess, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True, choices=["exc", "shape", "nan", "nockpt", "osexit", "segv", "sigkill",
                                                  "hang", "none"])
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--ckpt", default="/tmp/fault48_ckpt/warmstart_rank{rank}.pt")
a = p.parse_args()
BATCH = 16

if sys.stdout.isatty():
    from rich.console import Console
    _con = Console(highlight=False)

    def progress(rank, step, loss):
        _con.print(f"[bold cyan][rank {rank}][/] step [green]{step}/{a.steps}[/] loss [yellow]{loss:.4f}[/]")
else:
    def progress(rank, step, loss):
        print(f"[rank {rank}] step {step}/{a.steps} loss {loss:.4f}", flush=True)


def batch(rank, step, bad):
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(BATCH, 8, generator=g)
    y = torch.randint(0, 4, (BATCH,), generator=g)
    if bad and step == 3:
        if a.fault == "shape":
            x = torch.randn(BATCH, 9, generator=g)
        elif a.fault == "nan":
            x[3, 5] = float("nan")
        elif a.fault == "exc":
            y[7] = 7
    return x, y


def main():
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    bad = rank == a.rank and a.fault != "none"
    print(f"[rank {rank}] world {world} ready", flush=True)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if bad and a.fault == "nockpt":
        net.load_state_dict(torch.load(a.ckpt.format(rank=rank)))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, a.steps + 1):
        x, y = batch(rank, step, bad)
        if bad and step == 2 and a.fault == "sigkill":
            subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -9 {os.getpid()}"], stdin=subprocess.DEVNULL)
        if bad and step == 3:
            if a.fault == "osexit":
                os._exit(3)
            if a.fault == "segv":
                ctypes.string_at(0)
            if a.fault == "hang":
                time.sleep(60)
            if a.fault == "sigkill":
                time.sleep(5)
        if int(y.max()) >= 4:
            raise ValueError(f"label {int(y.max())} out of range for 4 classes in batch {step} of rank {rank}")
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}, stopping")
        loss.backward()
        opt.step()
        progress(rank, step, loss.item())
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()
    print(f"[rank {rank}] training finished", flush=True)


if __name__ == "__main__":
    main()
