"""A three-hundred-and-twentieth hand-run batch: ROAD DEFECT SEGMENTATION WITH A SMALL FCN.

Synthetic road-survey tiles (3x32x32 RGB crops from a dash camera) with polygon-free box annotations of
defects: crack, pothole, patch and lane marking (plus background = 5 classes, looked up in CLASSES).  Every
rank reads /tmp/fault320_work/tiles/tiles_R.pt, rasterises its annotations into masks, normalises the images
per batch, and trains a small FCN (two stride-2 conv blocks, a bilinear upsampling decoder with a skip
connection, a 1x1 classifier) on pixel cross-entropy, wrapped in DDP over gloo (or, with --ddp 0, with the
gradients all_reduced by hand).  The model is initialised from ckpt/fcn_w16.pt.  The loss and the defect IoU
are all_reduced every step; at the end every rank all_gathers its per-class pixel histogram and rank 0 saves
export/fcn.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (logging lines).

Faults:
  classmap   - rank N's annotations contain "alligator_crack", not in the class table (KeyError, start-up)
  maskval    - rank N's masks were exported with the ignore label 7 kept (cross_entropy target out of range, step 0)
  notiles    - rank N reads tiles/val/tiles_N.pt which does not exist (FileNotFoundError, start-up)
  ckptwidth  - rank N initialises from ckpt/fcn_w24.pt, a 24-channel model (load_state_dict size mismatch)
  wonly      - rank N initialises from ckpt/fcn_calib.pt which pickles a CalibMeta object (weights_only refusal)
  histgather - rank N's class histogram keeps an "ignore" bin: 6 entries vs 5 in the final all_gather (the end)
  crackwalk  - rank N traces crack skeletons pixel by pixel in Python before the step-3 all_reduce (slow rank)
  dicenan    - rank N's step-3 batch is overexposed (all 1.0): per-batch std 0, NaN inputs, the program's check
  segv       - rank N sends itself SIGSEGV after step 1
  exit4      - rank N prints its own ERROR line about missing camera calibration and calls sys.exit(4)
  tile30     - every rank: tiles cropped to 30x30, the decoder's upsampled map (16) does not match the skip (15)
  none       - control, clean run

What happened (filled in after the runs):
  classmap   - KeyError: 'alligator_crack' in rasterise at start-up; peers Connection closed in DDP's param check (np4 r2 ranklabel); mp.spawn Process 0 (np3 r0 spawn)
  maskval    - IndexError 'Target 7 is out of bounds.' in cross_entropy at step 0; peers Connection closed (np5 r3 srunlabel, np3 r1 logfmt, Root Cause rank 1)
  notiles    - FileNotFoundError for tiles/val/tiles_N.pt at start-up; peers closed (np4 r1 mpitag); Root Cause rank 2 (np3 r2 tee)
  ckptwidth  - load_state_dict size mismatch [24,...] vs [16,...] (np4 r3 pdsh2: worker-0 RendezvousConnectionError after; np3 r0 legacy)
  wonly      - UnpicklingError 'Weights only load failed' (__main__.CalibMeta) (np4 r2 files: rank2.log; np5 r1 tee, Root Cause rank 1)
  histgather - after 6 clean steps 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (6), got (5))' (np3 r1 srunlabel, np4 r0 bashloop)
  crackwalk  - 12 s: peers 'Timed out waiting 12000ms' in the step-3 all_reduce (np3 r1 ranklabel); 300 s: silent after step 2, killed at 60 s, exit 124 (np4 r2 mpitag)
  dicenan    - 'non-finite loss nan at step 3 (24576 non-finite input pixels)' + FloatingPointError (np4 r0 logfmt; np3 r2 spawn --ddp 0)
  segv       - no traceback; bash 'Segmentation fault', peers Read error/closed, exit 139 (np4 r1 bashloop); Root Cause rank 2 exitcode -11 SIGSEGV (np3 legacy)
  exit4      - rank N's calibration ERROR line and exit 4 (np5 r0 files, loop exit 4; np4 r3 pdsh2, worker-0 Root Cause rank 3 exitcode 4, exit 1)
  tile30     - every rank 'Sizes of tensors must match except in dimension 1. Expected size 16 but got size 15' at step 0; Root Cause rank 2 (np5 legacy)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/fcn.pt, exit 0 (np3 bashloop)
"""
import argparse
import dataclasses
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

WORK = "/tmp/fault320_work"
CLASSES = {"background": 0, "crack": 1, "pothole": 2, "patch": 3, "marking": 4}
NCLS = len(CLASSES)
TILE = 32
log = None


@dataclasses.dataclass
class CalibMeta:
    camera: str
    focal_mm: float
    survey: str


class RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        kwargs.setdefault("extra", {})["rank"] = self.extra["rank"]
        return msg, kwargs


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    base = logging.getLogger("roadseg")
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


def block(cin, cout, stride):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class FCN(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.enc1 = block(3, width, 2)
        self.enc2 = block(width, 2 * width, 2)
        self.dec = block(2 * width + width, width, 1)
        self.cls = nn.Conv2d(width, NCLS, 1)

    def forward(self, x):
        s1 = self.enc1(x)
        s2 = self.enc2(s1)
        up = F.interpolate(s2, scale_factor=2, mode="bilinear", align_corners=False)
        h = self.dec(torch.cat([up, s1], dim=1))
        return F.interpolate(self.cls(h), size=x.shape[-2:], mode="bilinear", align_corners=False)


def make_tiles(n, seed):
    g = torch.Generator().manual_seed(seed)
    img = torch.rand(n, 3, TILE, TILE, generator=g) * 0.3 + 0.35
    ann = []
    names = [c for c in CLASSES if c != "background"]
    for i in range(n):
        boxes = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            c = names[int(torch.randint(0, 4, (1,), generator=g))]
            y0, x0 = [int(v) for v in torch.randint(0, TILE - 8, (2,), generator=g)]
            h, w = [int(v) for v in torch.randint(3, 8, (2,), generator=g)]
            boxes.append((c, y0, x0, h, w))
            img[i, :, y0:y0 + h, x0:x0 + w] *= 0.5 + 0.2 * CLASSES[c]
        ann.append(boxes)
    return {"img": img, "ann": ann, "survey": f"A27-km{seed}"}


def prepare():
    for d in ("tiles", "ckpt", "export"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_tiles(48, 300 + r), f"{WORK}/tiles/tiles_{r}.pt")
    torch.manual_seed(0)
    sd = FCN(16).state_dict()
    torch.save(sd, f"{WORK}/ckpt/fcn_w16.pt")
    torch.save(FCN(24).state_dict(), f"{WORK}/ckpt/fcn_w24.pt")
    torch.save({"state": sd, "meta": CalibMeta("dashcam-3", 4.4, "A27")}, f"{WORK}/ckpt/fcn_calib.pt")
    print("prepared", WORK)


def rasterise(tiles, bad, fault):
    n = tiles["img"].shape[0]
    masks = torch.zeros(n, TILE, TILE, dtype=torch.long)
    for i, boxes in enumerate(tiles["ann"]):
        for c, y0, x0, h, w in boxes:
            masks[i, y0:y0 + h, x0:x0 + w] = CLASSES[c]
    if bad and fault == "maskval":
        masks[:, 0:2, :] = 7
    return masks


def trace_cracks(masks, budget):
    t0, steps = time.time(), 0
    while time.time() - t0 < budget:
        for m in masks:
            seen = set()
            for y in range(TILE):
                for x in range(TILE):
                    if int(m[y, x]) == 1 and (y, x) not in seen:
                        stack = [(y, x)]
                        while stack:
                            p = stack.pop()
                            if p in seen:
                                continue
                            seen.add(p)
                            steps += 1
                            for dy, dx in ((0, 1), (1, 0), (0, -1), (-1, 0)):
                                q = (p[0] + dy, p[1] + dx)
                                if 0 <= q[0] < TILE and 0 <= q[1] < TILE and int(m[q]) == 1:
                                    stack.append(q)
            if time.time() - t0 >= budget:
                break
    return steps


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading road tiles")
    split = "val/" if bad and a.fault == "notiles" else ""
    tiles = torch.load(f"{WORK}/tiles/{split}tiles_{rank}.pt")
    if bad and a.fault == "classmap":
        tiles["ann"][11].append(("alligator_crack", 4, 4, 6, 6))
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR camera calibration for survey {tiles['survey']} (dashcam-3) not found in "
            f"calib table, refusing to train on uncalibrated tiles", err=True)
        sys.exit(4)
    masks = rasterise(tiles, bad, a.fault)
    img = tiles["img"]
    if a.fault == "tile30":
        img, masks = img[:, :, 1:31, 1:31], masks[:, 1:31, 1:31]
    model = FCN(16)
    ck = {"ckptwidth": "fcn_w24.pt", "wonly": "fcn_calib.pt"}.get(a.fault, "fcn_w16.pt") if bad else "fcn_w16.pt"
    state = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(state["state"] if "state" in state else state)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    bs = 8
    for step in range(a.steps):
        i0 = (step * bs) % img.shape[0]
        x, y = img[i0:i0 + bs].clone(), masks[i0:i0 + bs]
        if bad and a.fault == "dicenan" and step == 3:
            x.fill_(1.0)
        x = (x - x.mean(dim=(0, 2, 3), keepdim=True)) / x.std(dim=(0, 2, 3), keepdim=True)
        logits = net(x)
        loss = F.cross_entropy(logits, y)
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"({int((~torch.isfinite(x)).sum())} non-finite input pixels)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "crackwalk" and step == 3:
            n = trace_cracks(masks, a.walk_budget)
            say(f"rank {rank} crack skeleton: {n} pixels traced")
        pred = logits.detach().argmax(1)
        inter = ((pred > 0) & (y > 0)).sum().float()
        union = ((pred > 0) | (y > 0)).sum().float()
        stats = torch.stack([loss.detach(), inter / union.clamp(min=1)])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} defect_iou {stats[1].item() / world:.4f}")
        if bad and a.fault == "segv" and step == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
    hist = torch.bincount(masks.flatten(), minlength=NCLS).float()
    if bad and a.fault == "histgather":
        hist = torch.cat([hist, torch.tensor([float(masks.numel() // 50)])])
    allh = [torch.zeros(NCLS) for _ in range(world)]
    dist.all_gather(allh, hist)
    tot = torch.stack(allh).sum(0)
    say(f"rank {rank} class pixels {hist[:NCLS].int().tolist()} global defect share {tot[1:].sum() / tot.sum():.3f}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/fcn.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/fcn.pt")
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
    p.add_argument("--walk-budget", type=int, default=30)
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
