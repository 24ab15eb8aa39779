"""Batch 426 of hand-run faults: CRYO-EM PARTICLE PICKING.

Synthetic micrographs: every rank reads its picking set from /tmp/fault426_work/mics/mics_R.pt: 64x64
low-dose micrographs (Gaussian blobs for particles on noisy ice), a per-micrograph detector name (looked up
in a pixel-size table), a gain reference and a list of picked particle boxes.  A small fully convolutional
picker (three conv layers and a 1x1 head) predicts a particle heatmap trained with a BCE loss, wrapped in
DDP (gloo) or with gradients all_reduced by hand (--ddp 0).  The picker is initialised from
ckpt/picker_c16.pt.  Per-rank particle counts per size class are all_gathered at the start, the loss and
the pick precision are all_reduced every step, and rank 0 saves export/picker.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  detector  - rank N's micrographs name the detector "Falcon4i", missing from the pixel-size table (KeyError)
  boxedge   - at step 3 rank N looks up hard-negative box 12 in a list of 12 boxes (IndexError)
  nomics    - rank N reads mics/motioncorr/mics_N.pt, which was never written (FileNotFoundError)
  ckptwide  - rank N initialises from ckpt/picker_c32.pt, saved with 32 channels (size mismatch)
  ctfpickle - rank N loads ckpt/ctf_state.pt holding a pickled CTFParams object (weights_only refusal)
  sizegather- rank N all_gathers 5 size classes (an extra 'aggregate' class) where the others send 4
  slowctf   - rank N fits the CTF of every micrograph in pure Python before the step-2 all_reduce
  gainzero  - from step 2 rank N divides by a gain reference with zero pixels: inf input, NaN loss, own check
  segv      - rank N sends itself SIGSEGV after step 3
  exit4     - at the end rank N prints its own ERROR line (ice too thick) and calls sys.exit(4)
  boxwidth  - every rank: the picker's head is built for 48x48 boxes but the loader crops 64x64 (shape error)
  none      - control, clean run

What happened (filled in after the runs):
  detector  - KeyError: 'Falcon4i' in the pixel-size lookup at start-up; peers Connection closed in all_gather (np4 r2 ranklabel); spawn ProcessRaisedException, Process 0 (np6 r0 spawn)
  boxedge   - IndexError 'list index out of range' at step 3 after three good steps; peers Connection closed (np3 r1 srunlabel, np4 r3 logfmt)
  nomics    - FileNotFoundError for mics/motioncorr/mics_N.pt at start-up; peers Connection closed in all_gather (np4 r1 mpitag, np3 r2 files)
  ckptwide  - load_state_dict size mismatch [32,...] vs [16,...]; Root Cause rank N (np4 r3 legacy, np4 r2 pdsh2: other agent lost the c10d store)
  ctfpickle - UnpicklingError 'Weights only load failed ... GLOBAL __main__.CTFParams' (np3 r0 tee, np5 r4 bashloop --ddp 0)
  sizegather- rank N 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))'; 7 peers closed (np8 r5 srunlabel)
  slowctf   - 12 s: peers 'Timed out waiting 12000ms' recv/send at step 2, rank N closed 45 s later (np3 r1 bashloop); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r2 ranklabel)
  gainzero  - own check at step 2 'loss is nan (24 non-finite input pixels ...)', FloatingPointError; peers closed (np6 r4 tee, np3 r1 files --ddp 0)
  segv      - no line from rank N after step 3; loop exit 139 (np4 r1 mpitag); ProcessExitedException 'process 2 terminated with signal SIGSEGV' (np3 r2 spawn)
  exit4     - rank N's ice-thickness ERROR line and exit 4 before the final all_gather; Root Cause exitcode 4 (np5 r3 legacy, np4 r0 pdsh2)
  boxwidth  - every rank 'mat1 and mat2 shapes cannot be multiplied (8x256 and 144x4)' in the first forward; Root Cause rank 0 (np3 logfmt)
  none      - clean: 6 steps on 3 ranks, rank 0 saved export/picker.pt, exit 0 (np3 bashloop)
"""
import argparse
import logging
import math
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

WORK = "/tmp/fault426_work"
PIXEL_SIZE = {"K3": 0.83, "Falcon4": 0.74, "K2": 1.06, "DE64": 0.91}
NCLASS = 4
MIC = 64
log = None


class CTFParams:
    def __init__(self, defocus, astig, cs):
        self.defocus, self.astig, self.cs = defocus, astig, cs


class RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.setdefault("extra", {})["rank"] = self.extra["rank"]
        return msg, kwargs


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    base = logging.getLogger("picker")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    base.addHandler(h)
    base.setLevel(logging.INFO)
    log = RankAdapter(base, {"rank": rank})


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class Picker(nn.Module):
    def __init__(self, ch=16, box=MIC):
        super().__init__()
        self.c1 = nn.Conv2d(1, ch, 3, padding=1)
        self.c2 = nn.Conv2d(ch, ch, 3, padding=1)
        self.c3 = nn.Conv2d(ch, ch, 3, padding=1)
        self.head = nn.Conv2d(ch, 1, 1)
        self.box = box
        self.size_head = nn.Linear((box // 4) * (box // 4), NCLASS)

    def forward(self, x):
        h = F.relu(self.c1(x))
        h = F.relu(self.c2(h))
        h = F.relu(self.c3(h))
        heat = self.head(h)
        pooled = F.avg_pool2d(heat, 4).flatten(1)
        return heat, self.size_head(pooled)


def make_mics(n, seed):
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(MIC), torch.arange(MIC), indexing="ij")
    imgs, heats, sizes, boxes = [], [], [], []
    for _ in range(n):
        img = torch.randn(MIC, MIC, generator=g) * 0.8
        heat = torch.zeros(MIC, MIC)
        k = int(torch.randint(3, 8, (1,), generator=g))
        cls = int(torch.randint(0, NCLASS, (1,), generator=g))
        for _ in range(k):
            cy, cx = (int(v) for v in torch.randint(6, MIC - 6, (2,), generator=g))
            r = 1.5 + cls
            blob = torch.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r))
            img += blob * 2.0
            heat = torch.maximum(heat, (blob > 0.5).float())
            boxes.append((cy, cx, int(2 * r + 2)))
        imgs.append(img)
        heats.append(heat)
        sizes.append(cls)
    dets = ["K3", "Falcon4", "K2", "DE64"]
    return {"images": torch.stack(imgs).unsqueeze(1), "heat": torch.stack(heats).unsqueeze(1),
            "size_class": torch.tensor(sizes), "boxes": boxes, "gain": torch.ones(MIC, MIC),
            "detector": [dets[int(i)] for i in torch.randint(0, 4, (n,), generator=g)],
            "defocus": (torch.rand(n, generator=g) * 2.0 + 0.8).tolist()}


def prepare():
    os.makedirs(f"{WORK}/mics", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_mics(24, 426 + r), f"{WORK}/mics/mics_{r}.pt")
    torch.manual_seed(0)
    torch.save(Picker(16).state_dict(), f"{WORK}/ckpt/picker_c16.pt")
    torch.save(Picker(32).state_dict(), f"{WORK}/ckpt/picker_c32.pt")
    torch.save({"ctf": [CTFParams(1.2, 0.05, 2.7) for _ in range(4)], "epoch": 3}, f"{WORK}/ckpt/ctf_state.pt")
    print("prepared", WORK)


def fit_ctf(img, defocus):
    """A deliberately slow pure-Python radial power spectrum fit."""
    best, arg = 1e9, 0.0
    for trial in range(40):
        d = defocus * (0.8 + trial * 0.01)
        err = 0.0
        for y in range(0, MIC, 2):
            for x in range(0, MIC, 2):
                k = math.hypot(y - MIC / 2, x - MIC / 2) / MIC
                err += (float(img[y, x]) - math.sin(math.pi * d * k * k)) ** 2
        if err < best:
            best, arg = err, d
    return arg


def allreduce_grads(model, world):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(426 + rank)
    say(f"rank {rank}/{world} up, loading micrographs")
    sub = "motioncorr/" if bad and a.fault == "nomics" else ""
    d = torch.load(f"{WORK}/mics/{sub}mics_{rank}.pt")
    if bad and a.fault == "detector":
        d["detector"][7] = "Falcon4i"
    apix = torch.tensor([PIXEL_SIZE[det] for det in d["detector"]])
    imgs = d["images"] * apix.view(-1, 1, 1, 1) / apix.mean()
    imgs = (imgs - imgs.mean()) / imgs.std()
    heat, size_class = d["heat"], d["size_class"]
    counts = torch.bincount(size_class, minlength=NCLASS).float()
    if bad and a.fault == "sizegather":
        counts = torch.cat([counts, counts.sum().reshape(1)])
    allc = [torch.zeros(NCLASS) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} micrographs {len(imgs)} particles {len(d['boxes'])} "
        f"global per size class {[int(v) for v in sum(allc)]}")
    box = 48 if a.fault == "boxwidth" else MIC
    model = Picker(16, box=box)
    ck = "picker_c32.pt" if bad and a.fault == "ckptwide" else "picker_c16.pt"
    sd = torch.load(f"{WORK}/ckpt/{ck}")
    if a.fault != "boxwidth":
        model.load_state_dict(sd)
    if bad and a.fault == "ctfpickle":
        ctf = torch.load(f"{WORK}/ckpt/ctf_state.pt")
        say(f"rank {rank} resumed CTF state from epoch {ctf['epoch']}")
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    gain = d["gain"].clone()
    if bad and a.fault == "gainzero":
        gain[10, 10:13] = 0.0
    negatives = d["boxes"][:12]
    for step in range(a.steps):
        sel = torch.arange(step * 4, step * 4 + 8) % len(imgs)
        x = imgs[sel]
        if step >= 2:
            x = x / gain
        if bad and a.fault == "boxedge" and step == 3:
            cy, cx, s = negatives[len(negatives)]
            x[:, :, cy - s:cy + s, cx - s:cx + s] = 0.0
        pred, logits = net(x)
        loss = F.binary_cross_entropy_with_logits(pred, heat[sel]) + 0.1 * F.cross_entropy(logits, size_class[sel])
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(x)).sum())
            say(f"rank {rank} step {step}: loss is {loss.item()} ({nbad} non-finite input pixels after gain "
                f"correction)", err=True)
            raise FloatingPointError(f"non-finite picking loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            allreduce_grads(model, world)
        opt.step()
        if bad and a.fault == "slowctf" and step == 2:
            t0, fitted = time.time(), 0
            while time.time() - t0 < a.ctf_budget:
                fit_ctf(imgs[fitted % len(imgs), 0], d["defocus"][fitted % len(imgs)])
                fitted += 1
            say(f"rank {rank} CTF refit of {fitted} micrographs done")
        with torch.no_grad():
            hit = (pred > 0).float()
            prec = ((hit * heat[sel]).sum() / hit.sum().clamp(min=1)).reshape(1)
            stats = torch.cat([loss.detach().reshape(1), prec])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} precision {stats[1].item() / world:.3f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR micrograph 9: estimated ice thickness 142 nm > 100 nm limit, "
            f"picks from this rank are unusable", err=True)
        sys.exit(4)
    npicks = torch.tensor([float((pred > 0).sum())])
    allp = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(allp, npicks)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/picker.pt")
        say(f"rank 0 done: {a.steps} steps, {int(sum(allp).item())} picked pixels, saved export/picker.pt")
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
    p.add_argument("--ctf-budget", type=int, default=45)
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
