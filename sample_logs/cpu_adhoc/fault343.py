"""Batch 343 hand-run faults: RETINAL VESSEL SEGMENTATION WITH A SMALL U-NET.

Synthetic fundus crops (3x32x32, a dark red background with a few bright-green-contrast vessel curves) and
their binary vessel masks are written once by --prepare under /tmp/fault343_work: images/fundus_R.pt per
rank (images, masks, the annotators' class name per image, the camera id per image), fov/templates.pt (4
field-of-view masks, one per camera), ckpt/unet_c3.pt (the pretrained U-Net), ckpt/unet_c4.pt (a 4-channel
variant, RGB + CLAHE green) and ckpt/unet_meta.pt (weights plus a TrainState object).  Each rank standardises
its images per crop, all_gathers a 16-bin histogram of its green channel, loads unet_c3.pt into a two-level
U-Net (8/16/32 channels, skip concatenations) and trains it on BCE + soft dice under DDP over gloo (or, with
--ddp 0, with gradients all_reduced by hand).  The dice is all_reduced each step; at the end the per-rank
vessel fraction is all_gathered and rank 0 saves export/unet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  vesselkey  - rank N's annotations name a class "capillary", missing from the class table (KeyError, start-up)
  fovidx     - rank N's crops of step 1 come from camera 4; only 4 FOV templates exist (IndexError, step 1)
  nomasks    - rank N reads its images from images/val/, which does not exist (FileNotFoundError, start-up)
  ckptchan   - rank N initialises from ckpt/unet_c4.pt (4 input channels): load_state_dict size mismatch
  ckptpickle - rank N loads ckpt/unet_meta.pt, which pickles a TrainState object (weights_only refusal)
  histgather - rank N all_gathers a 17-bin green histogram (an overflow bin) where the others send 16
  slowclahe  - rank N runs a pure-Python CLAHE over its crops before the step-2 all_reduce (--clahe-budget s)
  nandice    - rank N's step-3 batch is blank crops: per-crop std 0, NaN inputs, the program's loss check
  sigsegv    - rank N sends itself SIGSEGV after step 4
  exit5      - after training rank N prints its own error line about an empty FOV mask and calls sys.exit(5)
  skipconcat - every rank: the decoder concatenates the 8-channel skip where the 16-channel one belongs
  none       - control, clean run

What happened (filled in after the runs):
  vesselkey  - KeyError: 'capillary' at start-up; peers Connection closed by peer in the first all_gather (np4 r2 ranklabel)
  fovidx     - IndexError 'index 4 is out of bounds for dimension 0 with size 4' at step 1; peers closed (np3 r1 srunlabel)
  nomasks    - FileNotFoundError for images/val/fundus_3.pt at start-up; peers closed (np4 r3 mpitag)
  ckptchan   - size mismatch for enc1.0.weight [8,4,3,3] vs [8,3,3,3]; node 0 Root Cause rank 1 (np4 r1 pdsh2)
  ckptpickle - not run (time limit)
  histgather - rank 0: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (17), got (16))' (np3 r0 files)
  slowclahe  - not run (time limit)
  nandice    - not run (time limit)
  sigsegv    - silent after step 4; ProcessExitedException 'process 2 terminated with signal SIGSEGV' (np3 r2 spawn)
  exit5      - not run (time limit)
  skipconcat - not run (time limit)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/unet.pt, exit 0 (np3 bashloop)
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

WORK = "/tmp/fault343_work"
CLASSES = {"artery": 1, "vein": 1, "artery_vein_crossing": 1, "background": 0}
NCAM = 4
HW = 32
BATCH = 8
log = None


@dataclass
class TrainState:
    epoch: int
    best_dice: float


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
    log = logging.getLogger("retina")
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


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())


class UNet(nn.Module):
    def __init__(self, cin=3, wrong_skip=False):
        super().__init__()
        self.wrong_skip = wrong_skip
        self.enc1 = block(cin, 8)
        self.enc2 = block(8, 16)
        self.mid = block(16, 32)
        self.up2 = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.dec2 = block(32, 16)
        self.up1 = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.dec1 = block(16, 8)
        self.out = nn.Conv2d(8, 1, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        m = self.mid(F.max_pool2d(e2, 2))
        u2 = self.up2(m)
        skip2 = F.max_pool2d(e1, 2) if self.wrong_skip else e2
        d2 = self.dec2(torch.cat([u2, skip2], 1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], 1))
        return self.out(d1).squeeze(1)


def make_crops(n, seed):
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(HW).float(), torch.arange(HW).float(), indexing="ij")
    imgs, masks = [], []
    for _ in range(n):
        m = torch.zeros(HW, HW)
        for _v in range(int(torch.randint(2, 5, (1,), generator=g))):
            a, b, c = (torch.rand(3, generator=g) * torch.tensor([0.04, 1.0, HW])).tolist()
            curve = a * (xx - HW / 2) ** 2 * (b - 0.5) + c
            m = torch.maximum(m, ((yy - curve).abs() < 1.2).float())
        img = torch.stack([0.6 + 0.1 * torch.rand(HW, HW, generator=g), 0.3 - 0.15 * m, 0.1 + 0.02 * m])
        imgs.append(img + 0.03 * torch.randn(3, HW, HW, generator=g))
        masks.append(m)
    names = [["artery", "vein", "background"][int(i)] for i in torch.randint(0, 3, (n,), generator=g)]
    cams = torch.randint(0, NCAM, (n,), generator=g)
    return {"img": torch.stack(imgs), "mask": torch.stack(masks), "cls": names, "cam": cams}


def prepare():
    for d in ("images", "fov", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_crops(64, 700 + r), f"{WORK}/images/fundus_{r}.pt")
    yy, xx = torch.meshgrid(torch.arange(HW).float(), torch.arange(HW).float(), indexing="ij")
    fov = torch.stack([(((yy - 16) ** 2 + (xx - 16) ** 2) < (14 + k) ** 2).float() for k in range(NCAM)])
    torch.save(fov, f"{WORK}/fov/templates.pt")
    torch.manual_seed(0)
    sd = UNet(3).state_dict()
    torch.save(sd, f"{WORK}/ckpt/unet_c3.pt")
    torch.save(UNet(4).state_dict(), f"{WORK}/ckpt/unet_c4.pt")
    torch.save({"model": sd, "state": TrainState(epoch=40, best_dice=0.781)}, f"{WORK}/ckpt/unet_meta.pt")
    print("prepared", WORK)


def clahe_python(img, tiles=4, clip=3.0):
    """Contrast-limited adaptive histogram equalisation of one green channel, pixel by pixel in Python."""
    g = img.tolist()
    out = [[0.0] * HW for _ in range(HW)]
    t = HW // tiles
    for ty in range(tiles):
        for tx in range(tiles):
            vals = [g[y][x] for y in range(ty * t, ty * t + t) for x in range(tx * t, tx * t + t)]
            hist = [0] * 64
            for v in vals:
                hist[min(63, max(0, int(v * 64)))] += 1
            limit = clip * len(vals) / 64
            excess = sum(max(0, h - limit) for h in hist)
            hist = [min(h, limit) + excess / 64 for h in hist]
            cdf = [sum(hist[: i + 1]) / len(vals) for i in range(64)]
            for y in range(ty * t, ty * t + t):
                for x in range(tx * t, tx * t + t):
                    out[y][x] = cdf[min(63, max(0, int(g[y][x] * 64)))]
    return out


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading fundus crops")
    split = "val/" if bad and a.fault == "nomasks" else ""
    data = torch.load(f"{WORK}/images/{split}fundus_{rank}.pt")
    if bad and a.fault == "vesselkey":
        data["cls"][11] = "capillary"
    has_vessel = torch.tensor([CLASSES[c] for c in data["cls"]], dtype=torch.float32)
    if bad and a.fault == "fovidx":
        data["cam"][BATCH:2 * BATCH] = NCAM
    fov = torch.load(f"{WORK}/fov/templates.pt")
    img = data["img"]
    mean = img.mean((2, 3), keepdim=True)
    std = img.std((2, 3), keepdim=True)
    if bad and a.fault == "nandice":
        img[3 * BATCH:4 * BATCH] = 0.5
        std = img.std((2, 3), keepdim=True)
        mean = img.mean((2, 3), keepdim=True)
    x_all = (img - mean) / std
    mask = data["mask"]
    green = img[:, 1]
    hist = torch.histc(green, bins=16, min=0.0, max=0.5)
    if bad and a.fault == "histgather":
        hist = torch.cat([hist, (green > 0.5).sum().reshape(1).float()])
    hists = [torch.zeros(16) for _ in range(world)]
    dist.all_gather(hists, hist)
    say(f"rank {rank} crops {img.shape[0]} vessel-labelled {int(has_vessel.sum())} "
        f"green hist peak bin {int(torch.stack(hists).sum(0).argmax())}")
    model = UNet(3, wrong_skip=(a.fault == "skipconcat" and bad))
    if bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/unet_meta.pt")["model"])
    else:
        ck = "unet_c4.pt" if bad and a.fault == "ckptchan" else "unet_c3.pt"
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    n = img.shape[0]
    for step in range(a.steps):
        idx = torch.arange(step * BATCH, step * BATCH + BATCH) % n
        xb, yb = x_all[idx], mask[idx]
        fmask = fov[data["cam"][idx]]
        logits = net(xb)
        prob = torch.sigmoid(logits) * fmask
        inter = (prob * yb).sum()
        dice = 2 * inter / (prob.sum() + yb.sum() + 1e-6)
        loss = F.binary_cross_entropy_with_logits(logits, yb, weight=fmask) + (1 - dice)
        if not torch.isfinite(loss):
            say(f"rank {rank}: loss is {loss.item()} at step {step} (input min {xb.min().item()}, "
                f"max {xb.max().item()})", err=True)
            raise FloatingPointError(f"non-finite segmentation loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowclahe" and step == 2:
            t0 = time.time()
            k = 0
            while time.time() - t0 < a.clahe_budget:
                clahe_python(green[k % n])
                k += 1
            say(f"rank {rank} CLAHE done on {k} crops")
        d = dice.detach().reshape(1)
        dist.all_reduce(d)
        say(f"rank {rank} step {step} loss {loss.item():.4f} dice {d.item() / world:.4f}")
        if bad and a.fault == "sigsegv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR FOV mask of crop 7 (camera {int(data['cam'][7])}) is empty after erosion, "
            f"refusing to report vessel fraction", err=True)
        sys.exit(5)
    frac = (mask.mean() * has_vessel.mean()).reshape(1)
    fracs = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(fracs, frac)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/unet.pt")
        say(f"rank 0 done: {a.steps} steps, vessel fraction {float(torch.cat(fracs).mean()):.4f}, "
            f"saved export/unet.pt")
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
    p.add_argument("--clahe-budget", type=int, default=25)
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
