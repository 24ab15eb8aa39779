"""A fifty-third hand-run batch: JOB WRAPPER SCRIPTS around torchrun. One plain fault per run in a small DDP loop on
gloo (4-8 ranks, Linear(8,16)-ReLU-Linear(16,4), SGD, batch 16, 6 steps, a progress line `[rank R] step S/6 loss L`
per step, rank 0 adds `step S done in T s`). The job scripts around torchrun are the fault53_*.sh wrappers.

Faults (--rank N: the rank at fault; the fault fires at step 3 unless said otherwise):
  exc      ValueError from a label check on rank N's batch
  shape    rank N's batch has 9 features (RuntimeError: mat1 and mat2 shapes cannot be multiplied)
  nan      rank N's batch holds a NaN feature; the finite-loss check raises FloatingPointError
  nodata   rank N opens its data shard <data-dir>/shard-0000N.bin at start, which does not exist (FileNotFoundError)
  osexit   rank N calls os._exit(3) (no traceback)
  segv     rank N reads address 0 with ctypes.string_at(0) (SIGSEGV)
  sigkill  a sidecar process (started by rank N at step 2) SIGKILLs rank N 0.5 s later
  hang     rank N sleeps --hang-s seconds before its step-3 forward; the others wait in DDP's all-reduce until the
           gloo timeout (--pg-timeout) or until an outer `timeout` ends the job
  none     no fault (control run)
"""
import argparse, ctypes, datetime, math, os, subprocess, sys, time
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True, choices=["exc", "shape", "nan", "nodata", "osexit", "segv", "sigkill",
                                                  "hang", "none"])
p.add_argument("--rank", type=int, default=1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--pg-timeout", type=int, default=15)
p.add_argument("--hang-s", type=int, default=60)
p.add_argument("--data-dir", default="/tmp/fault53/data")
p.add_argument("--ckpt-dir", default="")
a = p.parse_args()
BATCH = 16


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
    if rank == 0:
        print(f"world_size={world} backend=gloo torch={torch.__version__} steps={a.steps}", flush=True)
    shard = os.path.join(a.data_dir, f"shard-{rank:05d}.bin")
    if bad and a.fault == "nodata":
        shard = os.path.join(a.data_dir, "train", f"shard-{rank:05d}.bin")
    if bad and a.fault == "nodata" or os.path.exists(shard):
        with open(shard, "rb") as f:
            f.read(16)
    print(f"[rank {rank}] data shard {shard} ready", flush=True)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, a.steps + 1):
        t0 = time.time()
        x, y = batch(rank, step, bad)
        if bad and step == 2 and a.fault == "sigkill":
            subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -9 {os.getpid()}"], stdin=subprocess.DEVNULL)
        if bad and step == 3:
            if a.fault == "osexit":
                os._exit(3)
            if a.fault == "segv":
                ctypes.string_at(0)
            if a.fault == "hang":
                print(f"[rank {rank}] fetching batch {step} from the data service", flush=True)
                time.sleep(a.hang_s)
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
        print(f"[rank {rank}] step {step}/{a.steps} loss {loss.item():.4f}", flush=True)
        if rank == 0:
            print(f"step {step} done in {time.time() - t0:.2f} s", flush=True)
        time.sleep(0.05)
    dist.barrier()
    if rank == 0 and a.ckpt_dir:
        os.makedirs(a.ckpt_dir, exist_ok=True)
        torch.save(net.state_dict(), os.path.join(a.ckpt_dir, "last.pt"))
        print(f"saved checkpoint {os.path.join(a.ckpt_dir, 'last.pt')}", flush=True)
    dist.destroy_process_group()
    print(f"[rank {rank}] training finished", flush=True)


if __name__ == "__main__":
    main()
