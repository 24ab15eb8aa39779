"""A hundred-and-eighty-sixth hand-run batch: DATALOADER WORKERS.

Every rank writes a per-sample cache at start-up (data/rR/s0000.npy ... one 16-feature vector per file, plus
data/rR/labels.json mapping sample ids to one of 5 classes) and trains a small MLP classifier on it with DDP on
gloo (or --ddp 0: gradients all_reduced by hand).  The data comes through torch.utils.data.DataLoader with
num_workers 2, persistent workers, a custom Dataset reading one file per sample, a custom collate_fn that stacks
the samples, a worker_init_fn seeding numpy per worker, a DistributedSampler with set_epoch, and a DataLoader
timeout.  Progress lines are 'rank R step S loss L'; after each epoch the loss and accuracy are all_reduced for
logging, and rank 0 saves the model to --save at the end.

Faults:
  keyerr    - rank N's labels.json lacks one sample id (KeyError inside __getitem__ in a worker)
  ragged    - every rank's config enables a random feature crop, so samples differ in length (collate stack)
  wkill     - on rank N a worker is SIGKILLed inside __getitem__ (as by the kernel OOM killer) at one sample
  winit     - rank N's worker_init_fn derives a negative numpy seed (rank offset sign typo) -> ValueError
  filemiss  - rank N's cache writer skips one sample file (partial sync): FileNotFoundError in a worker
  replicas  - rank N builds its DistributedSampler with num_replicas = world-1, so it runs more batches
  nan       - one sample file on rank N is corrupted with NaN features; the program's loss check raises
  dltimeout - rank N's worker stalls --slow seconds on one sample read, over the DataLoader timeout
  ckpt      - rank N warm-starts from the older checkpoint ckpt/warm_start_v1.pt that lacks head.bias
  exit2     - rank N finds a label outside the class range, prints its own ERROR line and exits with code 2
  stall     - rank N waits --busy seconds for a cache warm-up before its first step (peers wait in a collective)
  segv      - rank N gets SIGSEGV (sent to itself) at step 2
  none      - control, clean run

What happened (filled in after the runs):
  keyerr    - rank N: KeyError 's00NN' re-raised as 'Caught KeyError in DataLoader worker process 1'; peers Connection closed
  ragged    - every rank: RuntimeError stack expects each tensor to be equal size (collate_fn, worker process 0)
  wkill     - rank N: RuntimeError DataLoader worker (pid N) is killed by signal: Killed.; rank exits 1, peers closed
  winit     - rank N: ValueError Seed must be between 0 and 2**32 - 1 (worker_init_fn; in the per-rank file)
  filemiss  - rank N: FileNotFoundError data/rN/s00NN.npy in a worker; restart run dies in connectFullMesh
  replicas  - rank N runs 6 batches against 4; rank 0 aborts on gloo 'Received data size doesn't match' (SIGABRT)
  nan       - rank N: FloatingPointError loss is nan at step 1 (the program's check); peers Connection closed
  dltimeout - rank N: RuntimeError DataLoader timed out after 5.0 seconds; peers Connection closed by peer
  ckpt      - rank N: RuntimeError Error(s) in loading state_dict for Net: Missing key(s) "head.bias"
  exit2     - rank N: ERROR label out of range line, exitcode 2; DETAIL: rank 0 monitoredBarrier error
  stall     - busy 40 s: peers gloo Timed out waiting 12000ms; busy 1000 s / PG 300 s: timeout 60, exit 124
  segv      - rank N: exitcode -11 (SIGSEGV) after step 2; pdsh2: other agent loses the C10d store
  none      - clean, exit 0, rank 0 saved ckpt/clf.pt
"""
import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--n", type=int, default=48)
    p.add_argument("--feat", type=int, default=16)
    p.add_argument("--classes", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--dl-timeout", type=float, default=5.0)
    p.add_argument("--slow", type=float, default=20.0)
    p.add_argument("--busy", type=float, default=40.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--save", default="/tmp/fault186_work/ckpt/clf.pt")
    return p.parse_args()


def hit(a, rank):
    return a.rank == -1 or a.rank == rank


class Net(nn.Module):
    def __init__(self, feat, classes):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(feat, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        return self.head(self.body(x))


def write_cache(root, a, rank, skip=None, corrupt=None, drop_label=None):
    os.makedirs(root, exist_ok=True)
    g = np.random.default_rng(a.seed)
    centers = g.normal(size=(a.classes, a.feat)).astype(np.float32)
    labels = {}
    for i in range(a.n):
        y = int(i % a.classes)
        x = centers[y] + 0.5 * g.normal(size=a.feat).astype(np.float32)
        if i == corrupt:
            x[3:7] = np.nan
        labels[f"s{i:04d}"] = y
        if i != skip:
            np.save(os.path.join(root, f"s{i:04d}.npy"), x)
    if drop_label is not None:
        labels.pop(f"s{drop_label:04d}")
    with open(os.path.join(root, "labels.json"), "w") as f:
        json.dump(labels, f)


class SampleFiles(Dataset):
    def __init__(self, root, n, crop=False, kill_at=None, slow_at=None, slow=0.0):
        self.root, self.n, self.crop = root, n, crop
        self.kill_at, self.slow_at, self.slow = kill_at, slow_at, slow
        with open(os.path.join(root, "labels.json")) as f:
            self.labels = json.load(f)

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        sid = f"s{idx:04d}"
        if idx == self.slow_at:
            time.sleep(self.slow)
        if idx == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.from_numpy(np.load(os.path.join(self.root, sid + ".npy")))
        if self.crop:
            x = x[: len(x) - int(np.random.randint(0, 3))]
        return {"x": x, "y": self.labels[sid], "id": sid}


def collate(samples):
    x = torch.stack([s["x"] for s in samples])
    y = torch.tensor([s["y"] for s in samples], dtype=torch.long)
    return x, y, [s["id"] for s in samples]


def make_init_fn(base, rank, offset):
    def init(worker_id):
        seed = base + offset * (rank + 1) + worker_id
        np.random.seed(seed)
        torch.manual_seed(seed)
    return init


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(a.seed)
    work = "/tmp/fault186_work"
    root = os.path.join(work, "data", f"r{rank}")
    replicas = world - 1 if a.fault == "replicas" and hit(a, rank) else world
    sampler = DistributedSampler(range(a.n), num_replicas=replicas, rank=rank, shuffle=True, seed=a.seed)
    bad = list(sampler)[6]
    write_cache(root, a, rank,
                skip=bad if a.fault == "filemiss" and hit(a, rank) else None,
                corrupt=bad if a.fault == "nan" and hit(a, rank) else None,
                drop_label=bad if a.fault == "keyerr" and hit(a, rank) else None)
    print(f"rank {rank}: wrote {a.n} samples to {root}", flush=True)
    os.makedirs(os.path.join(work, "ckpt"), exist_ok=True)
    model = Net(a.feat, a.classes)
    if rank == 0:
        sd = model.state_dict()
        torch.save(sd, os.path.join(work, "ckpt", "warm_start_v2.pt"))
        torch.save({k: v for k, v in sd.items() if k != "head.bias"}, os.path.join(work, "ckpt", "warm_start_v1.pt"))
    dist.barrier()
    ws = "warm_start_v1.pt" if a.fault == "ckpt" and hit(a, rank) else "warm_start_v2.pt"
    model.load_state_dict(torch.load(os.path.join(work, "ckpt", ws)))
    if a.ddp:
        net = DDP(model)
    else:
        net = model
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    ds = SampleFiles(root, a.n, crop=(a.fault == "ragged" and hit(a, rank)),
                     kill_at=bad if a.fault == "wkill" and hit(a, rank) else None,
                     slow_at=bad if a.fault == "dltimeout" and hit(a, rank) else None, slow=a.slow)
    offset = -1000 if a.fault == "winit" and hit(a, rank) else 1000
    loader = DataLoader(ds, batch_size=a.batch, sampler=sampler, num_workers=a.workers, collate_fn=collate,
                        persistent_workers=True, worker_init_fn=make_init_fn(a.seed, rank, offset),
                        timeout=a.dl_timeout)
    print(f"rank {rank}: {len(loader)} batches per epoch, {a.workers} workers", flush=True)
    if a.fault == "stall" and hit(a, rank):
        time.sleep(a.busy)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    lossf = nn.CrossEntropyLoss()
    step = 0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        tot, correct, seen = 0.0, 0, 0
        for x, y, ids in loader:
            if a.fault == "exit2" and hit(a, rank) and step == 2:
                y = y + a.classes - 1
            if int(y.max()) >= a.classes:
                print(f"ERROR rank {rank}: label {int(y.max())} out of range for {a.classes} classes in batch {ids}",
                      flush=True)
                sys.exit(2)
            out = net(x)
            loss = lossf(out, y)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank} (samples {ids})")
            opt.zero_grad()
            loss.backward()
            if not a.ddp:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            opt.step()
            if a.fault == "segv" and hit(a, rank) and step == 2:
                os.kill(os.getpid(), signal.SIGSEGV)
            print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
            tot += loss.item() * len(y)
            correct += int((out.argmax(1) == y).sum())
            seen += len(y)
            step += 1
        stats = torch.tensor([tot, float(correct), float(seen)])
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch} mean loss {stats[0] / stats[2]:.4f} acc {stats[1] / stats[2]:.3f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), a.save)
        print(f"saved {a.save}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
