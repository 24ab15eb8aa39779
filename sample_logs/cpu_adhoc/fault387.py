"""A three-hundred-and-eighty-seventh hand-run batch: TRAFFIC SIGN CLASSIFICATION.

Synthetic 16x16 RGB crops of road signs: every rank reads its shard from /tmp/fault387_work/signs/shard_R.pt
(uint8 images, a sign name per crop and the crop's GTSRB id), maps each sign name to one of 10 classes through
a sign table, normalises every crop by its own mean and std, and trains a small CNN (two conv blocks, global
average pool, a 10-way head) on cross-entropy, wrapped in DDP over gloo (or with gradients all_reduced by hand,
--ddp 0).  The model starts from ckpt/signnet_10.pt.  The per-class histogram of each rank's shard is
all_gathered at start-up, loss and accuracy are all_reduced every step, the per-rank validation accuracy is
all_gathered at the end, and rank 0 saves export/signnet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  signcode   - rank N's annotations contain "speed_130", missing from the sign table (KeyError at start-up)
  labelrange - rank N takes the GTSRB id column (0-42) as the target of a 10-way head (IndexError, first step)
  nosplit    - rank N reads its shard from signs/night/ which does not exist (FileNotFoundError)
  ckpthead   - rank N initialises from ckpt/signnet_43.pt, a 43-class head (size mismatch)
  ckptpickle - rank N initialises from ckpt/signnet_10_meta.pt, which pickles a SignConfig object (weights_only)
  histgather - rank N all_gathers its class histogram with an extra "unknown" bin (11 vs 10 entries)
  augment    - rank N applies a per-pixel motion-blur augmentation in Python before the step-2 all_reduce
  nanbright  - rank N's step-3 batch holds a blank (constant) crop: std 0, NaN pixels, the program's check
  sigsegv    - rank N sends itself SIGSEGV after step 4
  exit5      - after training rank N finds stop-sign recall 0, prints its own error line and sys.exit(5)
  chanwidth  - every rank loads its crops as RGBA (4 channels); the first conv expects 3 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  signcode   - KeyError: 'speed_130' in the sign-table lookup at start-up; peers Connection closed by peer in the all_gather (np4 r2 ranklabel), spawn ProcessRaisedException (np3 r0 spawn)
  labelrange - IndexError 'Target 14 is out of bounds.' in the first step; peers closed in backward (np3 r1 srunlabel; np6 r4 mpitag, a peer Aborted, exit 134)
  nosplit    - FileNotFoundError for signs/night/shard_N.pt at start-up; peers closed (np4 r3 mpitag, np3 r1 legacy)
  ckpthead   - load_state_dict size mismatch head.weight [43,16] vs [10,16] (np3 r2 tee, np4 r3 pdsh2; np4 r1 pdsh2 dropped: rendezvous never formed)
  ckptpickle - weights_only UnpicklingError, Unsupported global __main__.SignConfig; Root Cause rank 0 (np6 r0 logfmt)
  histgather - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (11), got (10))'; peers closed (np3 r1 bashloop, np6 r5 files)
  augment    - 12 s: peers 'Timed out waiting 12000ms' (np3 r2 ranklabel); 300 s + 200 s blur: silent, killed at 60 s, exit 124 (np4 r0 ranklabel); 300 s + 40 s blur finished, rank 0 aborted at exit, 134 (np4 r1 srunlabel)
  nanbright  - the check logs 768 non-finite pixels at step 3, FloatingPointError (np4 r2 logfmt; np3 r0 tee, then SIGABRT at exit)
  sigsegv    - no traceback after step 4; bash 'Segmentation fault' exit 139 (np4 r3 bashloop); ProcessExitedException SIGSEGV (np3 r1 spawn)
  exit5      - rank 2's stop-sign recall ERROR line and exit 5; peers closed in the final all_gather; Root Cause rank 2 exitcode 5 (np3 r2 legacy)
  chanwidth  - every rank: 'expected input[32, 4, 16, 16] to have 3 channels, but got 4 channels instead' (np3 files)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/signnet.pt, exit 0 (np3 bashloop)
"""
import argparse
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault387_work"
SIGNS = {"stop": 0, "yield": 1, "speed_30": 2, "speed_50": 3, "speed_80": 4, "no_entry": 5,
         "priority_road": 6, "pedestrian": 7, "roundabout": 8, "no_overtaking": 9}
GTSRB = {"stop": 14, "yield": 13, "speed_30": 1, "speed_50": 2, "speed_80": 5, "no_entry": 17,
         "priority_road": 12, "pedestrian": 27, "roundabout": 40, "no_overtaking": 9}
NCLS = 10
BATCH = 32
log = None


@dataclass
class SignConfig:
    classes: int = 10
    crop: int = 16
    mean_normalise: bool = True


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    log = logging.getLogger("signs")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class SignNet(nn.Module):
    def __init__(self, ncls=NCLS, chans=3):
        super().__init__()
        self.c1 = nn.Conv2d(chans, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16, ncls)

    def forward(self, x):
        h = F.max_pool2d(torch.relu(self.c1(x)), 2)
        h = torch.relu(self.c2(h))
        return self.head(h.mean(dim=(2, 3)))


def make_shard(n, seed):
    g = torch.Generator().manual_seed(seed)
    names = list(SIGNS)
    signs = [names[int(i)] for i in torch.randint(0, NCLS, (n,), generator=g)]
    imgs = torch.randint(0, 256, (n, 3, 16, 16), generator=g, dtype=torch.uint8)
    for k, s in enumerate(signs):
        c = SIGNS[s]
        imgs[k, c % 3, 4:12, 4:12] = 40 + 20 * c
    return {"images": imgs, "signs": signs, "gtsrb": [GTSRB[s] for s in signs]}


def prepare():
    os.makedirs(f"{WORK}/signs", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_shard(256, 700 + r), f"{WORK}/signs/shard_{r}.pt")
    torch.manual_seed(0)
    torch.save(SignNet(10).state_dict(), f"{WORK}/ckpt/signnet_10.pt")
    torch.save(SignNet(43).state_dict(), f"{WORK}/ckpt/signnet_43.pt")
    torch.save({"state_dict": SignNet(10).state_dict(), "config": SignConfig()}, f"{WORK}/ckpt/signnet_10_meta.pt")
    print("prepared", WORK)


def normalise(imgs):
    x = imgs.float() / 255.0
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    std = x.std(dim=(1, 2, 3), keepdim=True)
    return (x - mean) / std


def motion_blur(imgs, budget):
    # per-pixel horizontal blur written in plain Python (slow on purpose: it is the fault)
    t0 = time.time()
    out = imgs.tolist()
    passes = 0
    while time.time() - t0 < budget:
        for img in out:
            for ch in img:
                for row in ch:
                    for j in range(len(row) - 1, 0, -1):
                        row[j] = (row[j] + row[j - 1]) // 2
        passes += 1
    return torch.tensor(out, dtype=torch.uint8), passes


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4242 + rank)
    say(f"rank {rank}/{world} up, loading sign crops")
    split = "night/" if bad and a.fault == "nosplit" else ""
    shard = torch.load(f"{WORK}/signs/{split}shard_{rank}.pt")
    if bad and a.fault == "signcode":
        shard["signs"][37] = "speed_130"
    imgs = shard["images"]
    if a.fault == "chanwidth":
        alpha = torch.full((imgs.shape[0], 1, 16, 16), 255, dtype=torch.uint8)
        imgs = torch.cat([imgs, alpha], dim=1)
    if bad and a.fault == "labelrange":
        y = torch.tensor(shard["gtsrb"])
    else:
        y = torch.tensor([SIGNS[s] for s in shard["signs"]])
    hist = torch.bincount(y.clamp(max=NCLS - 1), minlength=NCLS).float()
    if bad and a.fault == "histgather":
        hist = torch.cat([hist, torch.tensor([3.0])])
    allh = [torch.zeros(NCLS) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} crops {imgs.shape[0]} global {int(sum(h.sum() for h in allh))}")
    model = SignNet()
    if bad and a.fault == "ckpthead":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/signnet_43.pt"))
    elif bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/signnet_10_meta.pt")["state_dict"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/signnet_10.pt"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    n = imgs.shape[0]
    for step in range(a.steps):
        lo = (step * BATCH) % n
        xb, yb = imgs[lo:lo + BATCH].clone(), y[lo:lo + BATCH]
        if bad and a.fault == "nanbright" and step == 3:
            xb[5] = 128
        x = normalise(xb)
        if not torch.isfinite(x).all():
            nbad = int((~torch.isfinite(x)).sum())
            say(f"rank {rank} step {step}: {nbad} non-finite pixels after normalisation "
                f"(crop std min {float(xb.float().std(dim=(1, 2, 3)).min()):.3f})", err=True)
            raise FloatingPointError(f"non-finite input batch on rank {rank} at step {step}")
        out = net(x)
        loss = F.cross_entropy(out, yb)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "augment" and step == 2:
            blurred, passes = motion_blur(imgs[:64], a.aug_budget)
            say(f"rank {rank} motion-blur augmentation: {passes} passes over {blurred.shape[0]} crops")
        acc = (out.argmax(1) == yb).float().mean()
        stats = torch.stack([loss.detach(), acc]).reshape(2)
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} acc {stats[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        val = normalise(imgs[-64:])
        pred = model(val).argmax(1)
    vacc = (pred == y[-64:]).float().mean().reshape(1)
    if bad and a.fault == "exit5":
        nstop = int((y[-64:] == 0).sum())
        say(f"rank {rank}: ERROR validation recall for 'stop' is 0.00 on {nstop} stop signs; "
            f"refusing to export a classifier that misses stop signs", err=True)
        sys.exit(5)
    accs = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(accs, vacc)
    say(f"rank {rank} val acc {vacc.item():.3f} mean {sum(x.item() for x in accs) / world:.3f}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/signnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/signnet.pt")
    dist.destroy_process_group()


def main_guarded(a, rank, world):
    setup_log(rank, a.logfmt)
    try:
        run(a, rank, world)
    except Exception as e:
        if log is not None:
            say(f"training failed: {type(e).__name__}: {e}", err=True)
        raise


def worker(rank, a):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(a.spawn)
    os.environ["LOCAL_RANK"] = str(rank)
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--aug-budget", type=int, default=40)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    if a.spawn:
        mp.spawn(worker, args=(a,), nprocs=a.spawn)
        return
    main_guarded(a, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


if __name__ == "__main__":
    main()
