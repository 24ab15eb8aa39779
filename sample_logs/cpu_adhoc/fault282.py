"""A two-hundred-and-eighty-second hand-run batch: MEDICAL IMAGE SEGMENTATION WITH A SMALL 2-D U-NET.

Synthetic CT-like slices with blob-shaped lesions (3 classes: background, organ, lesion), prepared once with
--prep under /tmp/fault282_work/data (one volume per case, case_RRR.npy, plus a metadata json with the scanner
vendor).  Every rank loads its case, normalises the intensities with the vendor table, and trains a small
2-D U-Net (depth 3, skip connections, base width 8) wrapped in DDP (gloo) with Dice plus cross-entropy.  The
decoder starts from ckpt/decoder_w8.pt.  The per-class hard Dice (inside the body mask) is all_reduced for the
log each step; at the end per-slice lesion counts are all_gathered.  Launchers: torchrun, a bash loop (env://),
mp.spawn (--spawn N) or torch.distributed.launch; --logfmt 1 logs through Python logging with the rank.

Faults:
  labelval - rank N's label map was exported with the lesion as 3 (class count 3): IndexError in the CE weights
  dicenan  - rank N's slices lie outside the body (empty mask) and Dice eps is 0: 0/0 NaN, the program's check
  lesgather - rank N counts lesions on one slice more than the others: all_gather size mismatch (gloo)
  novol    - rank N reads its case as case_RRR.npz, which does not exist (FileNotFoundError)
  vendor   - rank N's case comes from a 'Canon' scanner missing in the intensity table (KeyError)
  oddsize  - every rank: crop size 36, not divisible by 8: skip connection cat shape error (RuntimeError)
  ckptw    - rank N builds the U-Net with base width 16 and loads ckpt/decoder_w8.pt (size mismatch)
  flood    - rank N counts connected components with a Python flood fill for --stall s before the Dice all_reduce
  sigkill  - rank N sends itself SIGKILL after step 2
  exit6    - rank N logs its own error line about a non-isotropic spacing and calls sys.exit(6)
  none     - control, clean run

What happened (filled in after the runs):
  labelval - rank N: IndexError index 3 is out of bounds for dimension 0 with size 3 (ce_w[y]), step 0; peers closed
  dicenan  - rank N: the program's FloatingPointError non-finite Dice [nan, nan] at step 0 (body voxels 0); peers closed
  lesgather - rank N sent 7 flags: another rank aborted (gloo EnforceNotMet 14 vs 12, SIGABRT); others reset
  novol    - rank N: FileNotFoundError .../data/case_00N.npz after init; peers closed in DDP construction
  vendor   - rank N: KeyError 'Canon' at the intensity table before DDP (spawn: ProcessRaisedException)
  oddsize  - every rank: RuntimeError Sizes of tensors must match ... Expected size 8 but got size 9 (skip cat)
  ckptw    - rank N: RuntimeError size mismatch for up.0.weight [64, 32, 2, 2] vs [128, 64, 2, 2] in Decoder
  flood    - rank N in its flood fill: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout (124)
  sigkill  - rank N: exitcode -9 (SIGKILL) after step 2 (bash loop: Killed, exit 137); peers closed/reset
  exit6    - rank N logs its ERROR non-isotropic spacing line after step 1 and exits 6; peers closed
  none     - clean, exit 0, rank 0 saved ckpt/unet_final.pt
"""
import argparse
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault282_work"
VENDOR = {"GE": (40.0, 350.0), "Siemens": (35.0, 400.0), "Philips": (45.0, 380.0)}
LOG = None


def log(msg, level=logging.INFO):
    if LOG is not None:
        LOG.log(level, msg)
    else:
        print(msg, file=sys.stderr if level >= logging.ERROR else sys.stdout, flush=True)


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())


class Decoder(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.up = nn.ModuleList([nn.ConvTranspose2d(w * 8, w * 4, 2, 2), nn.ConvTranspose2d(w * 4, w * 2, 2, 2),
                                 nn.ConvTranspose2d(w * 2, w, 2, 2)])
        self.dec = nn.ModuleList([block(w * 8, w * 4), block(w * 4, w * 2), block(w * 2, w)])

    def forward(self, x, skips):
        for up, dec, s in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([up(x), s], dim=1))
        return x


class UNet(nn.Module):
    def __init__(self, w=8, classes=3):
        super().__init__()
        self.enc = nn.ModuleList([block(1, w), block(w, w * 2), block(w * 2, w * 4)])
        self.mid = block(w * 4, w * 8)
        self.decoder = Decoder(w)
        self.head = nn.Conv2d(w, classes, 1)

    def forward(self, x):
        skips = []
        for e in self.enc:
            x = e(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        return self.head(self.decoder(self.mid(x), skips))


def prep():
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:48, 0:48]
    meta = {}
    for r in range(8):
        img = np.full((6, 48, 48), -900.0, dtype=np.float32)
        lab = np.zeros((6, 48, 48), dtype=np.int64)
        for s in range(6):
            body = (yy - 24) ** 2 / 20 ** 2 + (xx - 24) ** 2 / 16 ** 2 < 1
            organ = (yy - 22) ** 2 / 9 ** 2 + (xx - 26) ** 2 / 7 ** 2 < 1
            img[s][body] = 40.0
            img[s][organ] = 90.0
            lab[s][organ] = 1
            for _ in range(rng.integers(1, 4)):
                cy, cx, rr = rng.integers(16, 30), rng.integers(18, 32), rng.integers(2, 4)
                blob = (yy - cy) ** 2 + (xx - cx) ** 2 < rr ** 2
                img[s][blob] = 160.0
                lab[s][blob] = 2
            img[s] += rng.normal(0, 15, (48, 48)).astype(np.float32)
        np.save(f"{WORK}/data/case_{r:03d}.npy", np.stack([img, lab.astype(np.float32)]))
        meta[f"case_{r:03d}"] = {"vendor": ["GE", "Siemens", "Philips"][r % 3], "spacing": [1.0, 1.0, 2.5]}
    meta["case_005"]["vendor_alt"] = "Canon"
    json.dump(meta, open(f"{WORK}/data/meta.json", "w"), indent=1)
    torch.manual_seed(1)
    torch.save(UNet(8).decoder.state_dict(), f"{WORK}/ckpt/decoder_w8.pt")
    print("prepared", WORK)


def hard_dice(pred, target, mask, eps, classes=3):
    out = []
    for c in range(1, classes):
        p = ((pred == c) & mask).float()
        t = ((target == c) & mask).float()
        out.append((2 * (p * t).sum() + eps) / (p.sum() + t.sum() + eps))
    return torch.stack(out)


def flood_components(m):
    m = m.copy()
    n = 0
    for y in range(m.shape[0]):
        for x in range(m.shape[1]):
            if m[y, x]:
                n += 1
                stack = [(y, x)]
                while stack:
                    cy, cx = stack.pop()
                    if 0 <= cy < m.shape[0] and 0 <= cx < m.shape[1] and m[cy, cx]:
                        m[cy, cx] = False
                        stack += [(cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)]
    return n


def train(rank, world, a):
    global LOG
    if a.logfmt:
        logging.basicConfig(format="%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s", level=logging.INFO)
        LOG = logging.LoggerAdapter(logging.getLogger("mseg"), {"rank": rank})
    bad = a.rank in (-1, rank)
    f = a.fault if bad else "none"
    crop = 36 if f == "oddsize" else a.crop
    width = 16 if f == "ckptw" else 8
    eps = 0.0 if f == "dicenan" else 1e-5
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    log(f"rank {rank}/{world} up, crop {crop} base width {width} dice eps {eps:g}")
    case = f"case_{rank:03d}"
    meta = json.load(open(f"{WORK}/data/meta.json"))[case]
    path = f"{WORK}/data/{case}.npz" if f == "novol" else f"{WORK}/data/{case}.npy"
    vol = torch.from_numpy(np.load(path))
    vendor = "Canon" if f == "vendor" else meta["vendor"]
    if f == "exit6":
        meta["spacing"] = [1.0, 0.7, 2.5]
    level, window = VENDOR[vendor]
    img = ((vol[0] - level) / window).clamp(-1, 1).unsqueeze(1)
    lab = vol[1].long()
    if f == "labelval":
        lab[lab == 2] = 3
    body = vol[0] > -500
    if f == "dicenan":
        body = torch.zeros_like(body)
    log(f"rank {rank}: {case} vendor {vendor} spacing {meta['spacing']} slices {img.shape[0]}")
    model = UNet(width)
    model.decoder.load_state_dict(torch.load(f"{WORK}/ckpt/decoder_w8.pt"))
    net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    ce_w = torch.tensor([0.2, 1.0, 3.0])
    g = torch.Generator().manual_seed(rank)
    o = (48 - crop) // 2
    for step in range(a.steps):
        idx = torch.randint(0, img.shape[0], (2,), generator=g)
        x, y, m = img[idx, :, o:o + crop, o:o + crop], lab[idx, o:o + crop, o:o + crop], body[idx, o:o + crop, o:o + crop]
        logits = net(x)
        prob = logits.softmax(1)
        w = ce_w[y]
        ce = (F.cross_entropy(logits, y.clamp(max=2), reduction="none") * w).sum() / w.sum()
        oh = F.one_hot(y, 3).permute(0, 3, 1, 2).float()
        soft = 1 - (2 * (prob * oh).sum((0, 2, 3)) + 1) / (prob.sum((0, 2, 3)) + oh.sum((0, 2, 3)) + 1)
        loss = ce + soft[1:].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if f == "flood" and step == 2:
            log(f"rank {rank}: counting connected lesion components for the step-{step} stats")
            t0 = time.time()
            while time.time() - t0 < a.stall:
                flood_components((y[0] == 2).numpy())
                time.sleep(0.2)
        dice = hard_dice(logits.argmax(1), y, m, eps)
        if not torch.isfinite(dice).all():
            raise FloatingPointError(f"rank {rank}: non-finite Dice {dice.tolist()} at step {step} "
                                     f"(body voxels {int(m.sum())}, eps {eps:g})")
        stats = torch.cat([loss.detach().view(1), dice])
        dist.all_reduce(stats)
        stats /= world
        log(f"rank {rank} step {step} loss {stats[0]:.4f} dice organ {stats[1]:.3f} lesion {stats[2]:.3f}")
        if f == "exit6" and step == 1:
            log(f"ERROR rank {rank}: {case} has non-isotropic in-plane spacing {meta['spacing'][:2]}; "
                f"refusing to train on resampled slices", logging.ERROR)
            sys.exit(6)
        if f == "sigkill" and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    n = img.shape[0] + (1 if f == "lesgather" else 0)
    counts = torch.tensor([int((lab[i % img.shape[0]] == 2).sum() > 0) for i in range(n)], dtype=torch.float32)
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    if rank == 0:
        log(f"slices with lesions per rank: {[int(c.sum()) for c in gathered]}")
        torch.save(model.state_dict(), f"{WORK}/ckpt/unet_final.pt")
        log(f"rank 0 done: {a.steps} steps, saved {WORK}/ckpt/unet_final.pt")
    dist.destroy_process_group()


def spawn_entry(rank, world, a):
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    os.environ["LOCAL_RANK"] = str(rank)
    train(rank, world, a)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--crop", type=int, default=40)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--prep", action="store_true")
    a = p.parse_args()
    if a.prep:
        return prep()
    if a.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(a.port)
        mp.spawn(spawn_entry, args=(a.spawn, a), nprocs=a.spawn)
        return
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)


if __name__ == "__main__":
    main()
