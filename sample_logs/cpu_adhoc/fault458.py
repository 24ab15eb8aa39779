"""A four-hundred-and-fifty-eighth hand-run batch: CORAL REEF PHOTO-QUADRAT CLASSIFICATION.

Synthetic benthic photo-quadrats: every rank reads its quadrats from /tmp/fault458_work/quadrats/site_R.pt, a
stack of 3x32x32 image patches cut around point annotations (a 5x5 point grid per quadrat), each point
carrying a benthic label code (looked up in an 8-entry class table: branching and massive hard coral, soft
coral, turf, macroalgae, CCA, sand, rubble).  A small CNN (two conv blocks, a linear head) classifies the
patches with cross-entropy, wrapped in DDP over gloo (or with gradients all_reduced by hand, --ddp 0).  The
model is initialised from ckpt/reefnet_c8.pt.  Per-rank cover fractions are all_gathered at the start, the
accuracy is all_reduced every step, and rank 0 saves export/reefnet.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  badlabel    - rank N's annotations contain the code "BLCH" (bleached coral), missing from the class table (KeyError)
  noquadrat   - rank N reads its quadrats from quadrats/2019/ which does not exist (FileNotFoundError)
  ckptsize    - rank N initialises from ckpt/reefnet_c9.pt, saved with 9 classes (size mismatch)
  ckptpickle  - rank N loads the quadrat metadata ckpt/reef_meta.pt (a pickled class) with weights_only (refused)
  covergather - rank N all_gathers its cover fractions plus an "unknown" class (9 vs 8 entries)
  pointidx    - rank N looks up point 25 of the 5x5 point grid at step 1 (IndexError)
  slowcolor   - rank N colour-corrects every patch pixel by pixel in Python before the step-2 all_reduce
  nancover    - rank N weights its loss by coral cover over a zero live-tissue count at step 3 (NaN, own check)
  sigsegv     - rank N sends itself SIGSEGV after step 3
  exit5       - rank N prints its own error line about a mis-registered quadrat frame and calls sys.exit(5) at step 4
  patchshape  - every rank: patches are cut 36x36, the head expects 32x32 features (shape error)
  none        - control, clean run

What happened (filled in after the runs):
  badlabel    - KeyError: 'BLCH' in encode_labels before the first all_gather; peers 'Connection closed by peer' (np4 r2 ranklabel, np6 r0 logfmt, Root Cause rank 0)
  noquadrat   - FileNotFoundError for quadrats/2019/site_N.pt at start-up; peers closed in the all_gather (np4 r1 srunlabel, np3 r2 files)
  ckptsize    - load_state_dict size mismatch for head.weight [9, 1024] vs [8, 1024] and head.bias (np4 r3 mpitag; np4 r1 pdsh2, Root Cause rank 1 on node 0, node 1's agent loses the store)
  ckptpickle  - UnpicklingError 'Weights only load failed ... GLOBAL __main__.QuadratMeta' after the all_gather; Root Cause rank 1 (np3 r1 tee)
  covergather - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (9), got (8))' on rank N (np3 r0 spawn, np6 r4 legacy)
  pointidx    - IndexError 'index 25 is out of bounds for dimension 0 with size 25' at step 1; five peers closed (np6 r3 bashloop)
  slowcolor   - 20 s budget, 12 s PG timeout: ranks 0/2 'Timed out waiting 12000ms' in the step-2 all_reduce (np3 r1 bashloop);
                200 s budget, 300 s PG timeout: silent after step 1, killed at 60 s, exit 124 (np4 r1 srunlabel).  A first try with
                the 45 s budget (np4 r2 srunlabel, port 22311) finished its six steps just as timeout struck at 60 s: dropped
  nancover    - 'non-finite loss nan at step 3' and FloatingPointError from the program's check (np3 r1 mpitag, np6 r5 tee)
  sigsegv     - no message from rank N after step 3; peers reset/closed, one aborts ('terminate called'); loop exit 139 (np4 r3 ranklabel);
                'ProcessExitedException: process 1 terminated with signal SIGSEGV' (np3 r1 spawn)
  exit5       - rank N's frame ERROR line after step 4; Root Cause rank 2 exitcode 5 (np3 r2 legacy); rank 0 (the store host)
                instead ends with 'terminate called without an active exception', loop exit 134 (np4 r0 files)
  patchshape  - every rank: 'mat1 and mat2 shapes cannot be multiplied (48x1296 and 1024x8)' in the first forward (np3 logfmt, --ddp 0)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/reefnet.pt, exit 0 (np3 bashloop)
"""
import argparse
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault458_work"
CLASSES = {"HC_BR": 0, "HC_MA": 1, "SC": 2, "TURF": 3, "MACRO": 4, "CCA": 5, "SAND": 6, "RUB": 7}
NCLS = len(CLASSES)
GRID = 5
PATCH = 32
log = None


class QuadratMeta:
    def __init__(self, site, depth_m, transect):
        self.site = site
        self.depth_m = depth_m
        self.transect = transect


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
    log = logging.getLogger("reefnet")
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


class ReefNet(nn.Module):
    def __init__(self, ncls=NCLS, patch=PATCH):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16 * (patch // 4) ** 2, ncls)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.head(x.flatten(1))


def make_site(n, seed, patch=PATCH):
    g = torch.Generator().manual_seed(seed)
    codes = list(CLASSES)
    lab = torch.randint(0, NCLS, (n,), generator=g)
    tint = torch.rand(NCLS, 3, 1, 1, generator=g)
    x = torch.rand(n, 3, patch, patch, generator=g) * 0.5 + tint[lab]
    points = torch.randint(0, GRID * GRID, (n,), generator=g)
    return {"patches": x, "codes": [codes[int(i)] for i in lab], "points": points,
            "live_tissue": torch.randint(3, 20, (n,), generator=g).float()}


def prepare():
    os.makedirs(f"{WORK}/quadrats", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_site(48, 300 + r), f"{WORK}/quadrats/site_{r}.pt")
        torch.save(make_site(48, 300 + r, 36), f"{WORK}/quadrats/site36_{r}.pt")
    torch.manual_seed(0)
    torch.save(ReefNet(8).state_dict(), f"{WORK}/ckpt/reefnet_c8.pt")
    torch.save(ReefNet(9).state_dict(), f"{WORK}/ckpt/reefnet_c9.pt")
    torch.save({"meta": QuadratMeta("Heron-N", 6.5, "T2"), "grid": GRID}, f"{WORK}/ckpt/reef_meta.pt")
    print("prepared", WORK)


def encode_labels(codes):
    return torch.tensor([CLASSES[c] for c in codes])


def colour_correct(patches, budget):
    t0 = time.time()
    n = 0
    while time.time() - t0 < budget:
        for p in patches[:4]:
            for c in range(3):
                for i in range(p.shape[1]):
                    for j in range(p.shape[2]):
                        v = float(p[c, i, j])
                        n += v > 0.5
    return n


def point_weights(points, idx):
    w = torch.linspace(0.8, 1.2, GRID * GRID)
    return w[idx] * torch.ones(len(points))


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4580 + rank)
    say(f"rank {rank}/{world} up, loading quadrats")
    year = "2019/" if bad and a.fault == "noquadrat" else ""
    name = "site36" if a.fault == "patchshape" else "site"
    site = torch.load(f"{WORK}/quadrats/{year}{name}_{rank}.pt")
    if bad and a.fault == "badlabel":
        site["codes"][11] = "BLCH"
    y = encode_labels(site["codes"])
    x = site["patches"]
    cover = torch.bincount(y, minlength=NCLS).float() / len(y)
    if bad and a.fault == "covergather":
        cover = torch.cat([cover, torch.tensor([0.02])])
    allc = [torch.zeros(NCLS) for _ in range(world)]
    dist.all_gather(allc, cover)
    hc = float(sum(c[:2].sum() for c in allc) / world)
    say(f"rank {rank} patches {len(y)} hard coral cover {float(cover[:2].sum()):.3f} global {hc:.3f}")
    if bad and a.fault == "ckptpickle":
        meta = torch.load(f"{WORK}/ckpt/reef_meta.pt", weights_only=True)
        say(f"rank {rank} site {meta['meta'].site}")
    model = ReefNet()
    ck = "reefnet_c9.pt" if bad and a.fault == "ckptsize" else "reefnet_c8.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(a.steps):
        idx = 25 if bad and a.fault == "pointidx" and step == 1 else 12
        w = point_weights(site["points"], idx)
        logits = net(x)
        loss = (F.cross_entropy(logits, y, reduction="none") * w).mean()
        if bad and a.fault == "nancover" and step == 3:
            dead = site["live_tissue"] * 0.0
            loss = loss * (cover[:2].sum() * len(y) / dead.sum())
            loss = loss * (dead.sum() / dead.sum())
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} (coral-cover weighting)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowcolor" and step == 2:
            n = colour_correct(x, a.slow_budget)
            say(f"rank {rank} colour correction: {n} bright pixels")
        acc = (logits.argmax(1) == y).float().mean().reshape(1)
        dist.all_reduce(acc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc.item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        if bad and a.fault == "exit5" and step == 4:
            say(f"rank {rank}: ERROR quadrat Q{17 + rank} frame corners mis-registered (offset 41 px > 8 px); "
                f"point labels cannot be trusted, stopping", err=True)
            sys.exit(5)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/reefnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/reefnet.pt")
    dist.barrier()
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
    p.add_argument("--slow-budget", type=int, default=45)
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
