"""A hundred-and-seventy-seventh hand-run batch: UNET SEGMENTATION WITH DICE LOSS.

Every rank writes its synthetic images and masks (data/img_rR.npy: 3-channel noise with bright discs;
data/mask_rR.npy: the disc class per pixel) and reads them back.  The model is a small UNet (two down blocks,
a bottleneck, two up blocks with transposed convs and skip connections concatenated on the channel dim, a 1x1
head).  The loss is a hand-written soft Dice (over one-hot masks) plus cross-entropy.  Training runs under DDP
on gloo (or --ddp 0: gradients all-reduced by hand); each step the loss and per-class intersections/unions are
all_reduced; at the end the per-class IoU is all_gathered and rank 0 saves --save.

Faults:
  skipsize    - every rank's config sets img_size 18 (odd after one pool); the skip concat sizes differ
  badclass    - rank N's masks carry the annotation tool's boundary label (= num_classes); one_hot fails
  dicezero    - rank N's foreground filter drops every sample; Dice 0/0 and the program's finite check raises
  maskmissing - rank N reads its masks from a node-local cache dir that was never written (FileNotFoundError)
  channels    - rank N's images are saved grayscale (1 channel); the first conv fails
  slowaug     - rank N's crop augmentation retries until an unreachable foreground fraction; late collective
  ioucls      - rank N counts an extra 'ignore' class in its IoU vector; the all_gather sizes differ
  ckptcls     - rank N resumes a checkpoint saved with 4 classes into a 3-class head (size mismatch)
  cfgkey      - every rank's config spells the class count 'n_classes' (KeyError 'num_classes')
  sigbus      - rank N gets SIGBUS (sent to itself) at step 2
  invalidmask - rank N prints its own 'invalid mask' error line and exits with code 3
  none        - control, clean run

What happened (filled in after the runs):
  skipsize    - every rank RuntimeError 'Sizes of tensors must match except in dimension 1. Expected size 8 but got size 9'
  badclass    - rank N RuntimeError 'Class values must be smaller than num_classes.' (one_hot); Root Cause rank N
  dicezero    - rank N samples=0, FloatingPointError 'non-finite Dice+CE loss at step 0'; DETAIL: monitoredBarrier
  maskmissing - rank N FileNotFoundError mask_cache/mask_rN.npy; the --max-restarts retry died in connectFullMesh
  channels    - rank N RuntimeError 'expected input[8, 1, 16, 16] to have 3 channels, but got 1 channels'
  slowaug     - PG 12 s: the others 'Timed out waiting 12000ms' (Root Cause rank 0); PG 300 s + timeout 60: exit 124
  ioucls      - rank N 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (4), got (3))'
  ckptcls     - rank N RuntimeError 'size mismatch for head.weight ... [4, 8, 1, 1] ... [3, 8, 1, 1]'; Root Cause rank N
  cfgkey      - every rank KeyError 'num_classes'
  sigbus      - rank N killed at step 2 (exitcode -7, SIGBUS); peers Connection reset/closed by peer
  invalidmask - rank N 'ERROR rank N: invalid mask in .../mask_rN.npy: shape (16, 15) ...' then exit 3
  none        - 3 ranks ran 5 steps, rank 0 saved ckpt/unet.pt (a 4-class trial saved ckpt/unet_c4.pt)
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--classes", type=int, default=3)
    p.add_argument("--img-size", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--base", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--min-fg", type=float, default=0.02)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--workdir", default="/tmp/fault177_work")
    p.add_argument("--save", default="ckpt/unet.pt")
    p.add_argument("--resume", default="")
    return p.parse_args()


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())


class UNet(nn.Module):
    def __init__(self, cin, classes, base):
        super().__init__()
        self.down1, self.down2 = block(cin, base), block(base, 2 * base)
        self.mid = block(2 * base, 4 * base)
        self.up2, self.dec2 = nn.ConvTranspose2d(4 * base, 2 * base, 2, stride=2), block(4 * base, 2 * base)
        self.up1, self.dec1 = nn.ConvTranspose2d(2 * base, base, 2, stride=2), block(2 * base, base)
        self.head = nn.Conv2d(base, classes, 1)

    def forward(self, x):
        s1 = self.down1(x)
        s2 = self.down2(F.max_pool2d(s1, 2))
        m = self.mid(F.max_pool2d(s2, 2))
        d2 = self.dec2(torch.cat([self.up2(m), s2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), s1], dim=1))
        return self.head(d1)


def dice_ce(logits, mask, classes, eps):
    probs = logits.softmax(1)
    onehot = F.one_hot(mask, classes).permute(0, 3, 1, 2).float()
    inter = (probs * onehot).sum((0, 2, 3))
    denom = probs.sum((0, 2, 3)) + onehot.sum((0, 2, 3))
    dice = (2 * inter + eps) / (denom + eps)
    return 1 - dice.mean() + F.cross_entropy(logits, mask)


def make_data(rank, n, size, classes, img_path, mask_path, channels):
    g = np.random.default_rng(300 + rank)
    imgs = g.normal(0, 0.3, size=(n, channels, size, size)).astype(np.float32)
    masks = np.zeros((n, size, size), dtype=np.int64)
    yy, xx = np.mgrid[:size, :size]
    for i in range(n):
        for c in range(1, classes):
            cy, cx, r = g.integers(3, size - 3), g.integers(3, size - 3), g.integers(2, 4)
            disc = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
            masks[i][disc] = c
            imgs[i, :, disc] += c
    np.save(img_path, imgs)
    np.save(mask_path, masks)


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    for d in ("data", "ckpt"):
        os.makedirs(os.path.join(a.workdir, d), exist_ok=True)
    cfg = {"num_classes": a.classes, "img_size": a.img_size, "batch": a.batch, "eps": 1.0, "aug_tries": 20}
    if bad and a.fault == "skipsize":
        cfg["img_size"] = 18
    if bad and a.fault == "cfgkey":
        cfg["n_classes"] = cfg.pop("num_classes")
    cfg_path = os.path.join(a.workdir, f"seg_r{rank}.json")
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    classes, size = cfg["num_classes"], cfg["img_size"]
    img_path = os.path.join(a.workdir, "data", f"img_r{rank}.npy")
    mask_dir = os.path.join(a.workdir, "data")
    make_data(rank, 2 * cfg["batch"], size, classes, img_path, os.path.join(mask_dir, f"mask_r{rank}.npy"),
              1 if (bad and a.fault == "channels") else 3)
    if bad and a.fault == "maskmissing":
        mask_dir = os.path.join(a.workdir, "mask_cache")
    imgs = torch.from_numpy(np.load(img_path))
    masks = torch.from_numpy(np.load(os.path.join(mask_dir, f"mask_r{rank}.npy")))
    if bad and a.fault == "badclass":
        masks[:, 0, :] = classes
    if bad and a.fault == "invalidmask":
        print(f"ERROR rank {rank}: invalid mask in {mask_dir}/mask_r{rank}.npy: shape (16, 15) does not match "
              f"image {tuple(imgs.shape[2:])} for sample 5; refusing to resize labels", flush=True)
        sys.exit(3)
    min_fg = 1.01 if (bad and a.fault == "dicezero") else a.min_fg
    if bad and a.fault == "dicezero":
        cfg["eps"] = 0.0
    keep = (masks > 0).float().mean((1, 2)) >= min_fg
    imgs, masks = imgs[keep], masks[keep]
    model = UNet(3, classes, a.base)
    if bad and a.fault == "ckptcls":
        a.resume = os.path.join(a.workdir, "ckpt/unet_c4.pt")
    if a.resume:
        model.load_state_dict(torch.load(a.resume, map_location="cpu"))
        print(f"rank {rank} resumed from {a.resume}", flush=True)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    print(f"rank {rank}/{world} unet base={a.base} classes={classes} img={size} samples={len(imgs)}", flush=True)
    g = torch.Generator().manual_seed(rank)
    for step in range(a.steps):
        idx = torch.randperm(len(imgs), generator=g)[:cfg["batch"]]
        x, y = imgs[idx], masks[idx]
        tries, max_tries = 0, cfg["aug_tries"]
        target_fg = 0.99 if (bad and a.fault == "slowaug") else a.min_fg
        if bad and a.fault == "slowaug":
            max_tries = 100000
        while tries < max_tries:
            sh = int(torch.randint(-2, 3, (1,), generator=g))
            xa, ya = torch.roll(x, sh, dims=3), torch.roll(y, sh, dims=2)
            tries += 1
            if (ya > 0).float().mean() >= target_fg:
                break
            if bad and a.fault == "slowaug":
                time.sleep(0.01)
        x, y = xa, ya
        loss = dice_ce(net(x), y, classes, cfg["eps"])
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite Dice+CE loss at step {step} on rank {rank} (batch of {len(x)})")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "sigbus" and step == 2:
            os.kill(os.getpid(), signal.SIGBUS)
        with torch.no_grad():
            pred = net(x).argmax(1)
            iu = torch.stack([torch.tensor([float(((pred == c) & (y == c)).sum()), float(((pred == c) | (y == c)).sum())])
                              for c in range(classes)])
        stats = torch.cat([torch.tensor([loss.item()]), iu.flatten()])
        dist.all_reduce(stats)
        miou = float((stats[1::2] / stats[2::2].clamp(min=1)).mean())
        print(f"rank {rank} step {step} loss {loss.item():.4f} mean_loss {stats[0] / world:.4f} mIoU {miou:.3f} aug_tries {tries}", flush=True)
    iou = iu[:, 0] / iu[:, 1].clamp(min=1)
    if bad and a.fault == "ioucls":
        iou = torch.cat([iou, torch.zeros(1)])
    out = [torch.zeros(classes) for _ in range(world)]
    dist.all_gather(out, iou)
    if rank == 0:
        print("per-rank IoU: " + " ".join(f"r{i}=" + ",".join(f"{v:.2f}" for v in o.tolist()) for i, o in enumerate(out)), flush=True)
        torch.save(model.state_dict(), os.path.join(a.workdir, a.save))
        print(f"saved {a.save}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
