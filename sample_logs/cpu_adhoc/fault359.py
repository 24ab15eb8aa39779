"""Batch 359 of hand-run faults: PLANT DISEASE CLASSIFICATION FROM LEAF PHOTOS.

Synthetic leaf photos (3x32x32, a green leaf disc with brown/yellow/white lesion blobs) and one disease label
per photo, stored as names ("healthy", "early_blight", ...) and looked up in an 8-entry disease table.  Every
rank reads its photos from /tmp/fault359_work/leaves/leaves_R.pt, normalises each photo by its own brightness,
takes a centre crop chosen from a crop-box table, and trains a small CNN (two conv blocks, global average pool,
a linear head over the 8 diseases) with cross-entropy, wrapped in DDP over gloo (or, with --ddp 0, gradients
all_reduced by hand).  The model starts from ckpt/leafnet.pt.  The loss and accuracy are all_reduced every step;
at the end every rank all_gathers its per-disease prediction histogram and rank 0 saves export/leafnet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults (--fault NAME --rank R, R = -1 for every rank):
  label      - rank N's annotations carry "leaf_rust_v2", a name missing from the disease table (KeyError, start-up)
  noleaves   - rank N reads its photos from leaves/field_b/, which does not exist (FileNotFoundError, start-up)
  ckptwide   - rank N initialises from ckpt/leafnet_wide.pt, saved with 24 conv channels (size mismatch)
  pickled    - rank N loads ckpt/leafnet_meta.pt, which pickles a LeafMeta object (weights_only refusal)
  cropidx    - rank N picks crop box 9 from the 6-entry crop table in its first step (IndexError)
  lesionscan - rank N counts lesion pixels with a Python flood fill before the step-2 all_reduce (slow rank)
  brightness - rank N's step-3 batch holds an all-black photo: brightness 0, division gives NaN (program's check)
  segv       - rank N sends itself SIGSEGV after step 4
  exit5      - rank N prints its own ERROR line about a corrupt EXIF block and calls sys.exit(5) at step 3
  histgather - rank N all_gathers its histogram with an extra "unknown" bin at the end (9 vs 8 entries)
  chanbug    - every rank keeps the alpha channel: 4-channel photos into a 3-channel conv (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  label      - KeyError: 'leaf_rust_v2' at start-up; peers Connection closed by peer in DDP set-up (np4 r2 ranklabel); SIGTERMed, Root Cause rank 0 (np3 r0 logfmt)
  noleaves   - FileNotFoundError for leaves/field_b/leaves_N.pt at start-up; Root Cause rank 3, others SIGTERMed (np6 r3 tee); peers closed (np4 r1 srunlabel)
  ckptwide   - load_state_dict size mismatch for c1.weight [24,3,3,3] vs [16,3,3,3] and 8 more (np4 r1 pdsh2, np3 r2 legacy)
  pickled    - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.LeafMeta'; peers closed (np3 r1 mpitag, np5 r0 bashloop)
  cropidx    - IndexError 'list index out of range' at CROPS[box] in step 0; peers closed, Root Cause rank 2 (np3 r2 legacy)
  lesionscan - 12 s: peers 'Timed out waiting 12000ms' in the step-2 all_reduce (np3 r1 ranklabel); 300 s: silent after step 1, killed at 60 s, exit 124 (np3 r2 srunlabel)
  brightness - the check prints 3072 non-finite pixels at step 3 and raises FloatingPointError; peers closed (np4 r3 mpitag; np3 r1 files --ddp 0)
  segv       - no traceback from rank 5 after step 4; peers Connection reset by peer; Root Cause rank 5 exitcode -11 (SIGSEGV) (np6 r5 tee)
  exit5      - rank N's EXIF ERROR line and exit 5; Root Cause exitcode 5 (np3 r1 logfmt; np4 r0 pdsh2, other agent RendezvousConnectionError)
  histgather - after 6 steps: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (9), got (8))' (np6 r0 bashloop; np3 r2 spawn, ProcessRaisedException)
  chanbug    - every rank: 'expected input[16, 4, 28, 28] to have 3 channels, but got 4 channels instead' in step 0 (np6 files)
  none       - clean: 6 steps on 3 ranks, histograms gathered, rank 0 saved export/leafnet.pt, exit 0 (np3 bashloop)
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

WORK = "/tmp/fault359_work"
DISEASES = {"healthy": 0, "early_blight": 1, "late_blight": 2, "leaf_rust": 3, "powdery_mildew": 4,
            "septoria_spot": 5, "mosaic_virus": 6, "bacterial_spot": 7}
CROPS = [(0, 0), (2, 2), (4, 4), (2, 4), (4, 2), (3, 3)]
NCLS = len(DISEASES)
SIDE = 28
log = None


class LeafMeta:
    """Field metadata that an old export pickled next to the weights."""

    def __init__(self, field, camera):
        self.field = field
        self.camera = camera


class RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.setdefault("extra", {})["rank"] = self.extra["rank"]
        return msg, kwargs


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    base = logging.getLogger("leafnet")
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


class LeafNet(nn.Module):
    def __init__(self, ch=16, in_ch=3):
        super().__init__()
        self.c1 = nn.Conv2d(in_ch, ch, 3, padding=1)
        self.c2 = nn.Conv2d(ch, ch * 2, 3, padding=1)
        self.bn = nn.BatchNorm2d(ch * 2)
        self.head = nn.Linear(ch * 2, NCLS)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.c1(x)), 2)
        h = F.relu(self.bn(self.c2(h)))
        return self.head(h.mean((2, 3)))


def make_leaves(n, seed):
    g = torch.Generator().manual_seed(seed)
    names = list(DISEASES)
    yy, xx = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    disc = (((yy - 16) ** 2 + (xx - 16) ** 2) < 180).float()
    imgs, labels = [], []
    for _ in range(n):
        c = int(torch.randint(0, NCLS, (1,), generator=g))
        img = torch.stack([0.2 * disc, 0.6 * disc, 0.15 * disc]) + 0.05 * torch.rand(3, 32, 32, generator=g)
        for _ in range(c):
            cy, cx = torch.randint(8, 24, (2,), generator=g).tolist()
            blob = (((yy - cy) ** 2 + (xx - cx) ** 2) < 6).float()
            img[0] += 0.4 * blob * (c % 3 + 1) / 3
            img[1] -= 0.3 * blob
        alpha = disc.unsqueeze(0)
        imgs.append(torch.cat([img.clamp(0, 1), alpha]))
        labels.append(names[c])
    return {"rgba": torch.stack(imgs), "labels": labels, "field": f"plot-{seed % 7}"}


def prepare():
    os.makedirs(f"{WORK}/leaves", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_leaves(48, 500 + r), f"{WORK}/leaves/leaves_{r}.pt")
    torch.manual_seed(0)
    torch.save(LeafNet().state_dict(), f"{WORK}/ckpt/leafnet.pt")
    torch.save(LeafNet(ch=24).state_dict(), f"{WORK}/ckpt/leafnet_wide.pt")
    torch.save({"state_dict": LeafNet().state_dict(), "meta": LeafMeta("plot-3", "rig-2")},
               f"{WORK}/ckpt/leafnet_meta.pt")
    print("prepared", WORK)


def normalise(batch):
    bright = batch.amax(dim=(1, 2, 3), keepdim=True)
    return (batch / bright - 0.5) / 0.25


def lesion_scan(img, budget):
    """Count lesion pixels with a pure-Python flood fill (slow, for the 'lesionscan' fault)."""
    t0 = time.time()
    red = img[0].tolist()
    green = img[1].tolist()
    n = 0
    while time.time() - t0 < budget:
        seen = set()
        for y in range(32):
            for x in range(32):
                if (y, x) in seen or red[y][x] <= green[y][x]:
                    continue
                stack = [(y, x)]
                while stack:
                    p = stack.pop()
                    if p in seen:
                        continue
                    seen.add(p)
                    n += 1
                    py, px = p
                    for q in ((py + 1, px), (py - 1, px), (py, px + 1), (py, px - 1)):
                        if 0 <= q[0] < 32 and 0 <= q[1] < 32 and red[q[0]][q[1]] > green[q[0]][q[1]]:
                            stack.append(q)
    return n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading leaf photos")
    sub = "field_b/" if bad and a.fault == "noleaves" else ""
    data = torch.load(f"{WORK}/leaves/{sub}leaves_{rank}.pt")
    if bad and a.fault == "label":
        data["labels"][11] = "leaf_rust_v2"
    y = torch.tensor([DISEASES[n] for n in data["labels"]])
    imgs = data["rgba"] if a.fault == "chanbug" and bad else data["rgba"][:, :3]
    say(f"rank {rank} field {data['field']}: {len(y)} photos, {int((y == 0).sum())} healthy")
    if bad and a.fault == "pickled":
        model = LeafNet()
        model.load_state_dict(torch.load(f"{WORK}/ckpt/leafnet_meta.pt")["state_dict"])
    else:
        model = LeafNet()
        ck = "leafnet_wide.pt" if bad and a.fault == "ckptwide" else "leafnet.pt"
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    bs = 16
    for step in range(a.steps):
        i0 = (step * bs) % len(y)
        xb = imgs[i0:i0 + bs].clone()
        yb = y[i0:i0 + bs]
        if bad and a.fault == "brightness" and step == 3:
            xb[4] = 0.0
        xb = normalise(xb)
        if not torch.isfinite(xb).all():
            say(f"rank {rank} step {step}: {int((~torch.isfinite(xb)).sum())} non-finite pixels after "
                f"brightness normalisation (min brightness {float(imgs[i0:i0 + bs].amax((1, 2, 3)).min()):.3f})",
                err=True)
            if bad and a.fault == "brightness":
                raise FloatingPointError(f"non-finite input batch on rank {rank} at step {step}")
        box = 9 if bad and a.fault == "cropidx" and step == 0 else (step + rank) % len(CROPS)
        oy, ox = CROPS[box]
        xb = xb[:, :, oy:oy + SIDE, ox:ox + SIDE]
        logits = net(xb)
        loss = F.cross_entropy(logits, yb)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "lesionscan" and step == 2:
            n = lesion_scan(imgs[0], a.scan_budget)
            say(f"rank {rank} lesion scan: {n} lesion pixels")
        if bad and a.fault == "exit5" and step == 3:
            say(f"rank {rank}: ERROR photo {i0 + 7} has a corrupt EXIF block (orientation tag 0x0112 = 97), "
                f"refusing to train on mis-rotated photos", err=True)
            sys.exit(5)
        acc = (logits.argmax(1) == yb).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} acc {stats[1].item() / world:.3f}")
        if bad and a.fault == "segv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        pred = model(normalise(imgs)[:, :, 2:2 + SIDE, 2:2 + SIDE]).argmax(1)
    hist = torch.bincount(pred, minlength=NCLS).float()
    if bad and a.fault == "histgather":
        hist = torch.cat([hist, torch.tensor([float((pred < 0).sum())])])
    allh = [torch.zeros(NCLS) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} predicted per disease {hist.int().tolist()} global {torch.stack(allh).sum(0).int().tolist()}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/leafnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/leafnet.pt")
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
    p = argparse.ArgumentParser(description="leaf disease classifier (fault batch 359)")
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--scan-budget", type=int, default=25)
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
