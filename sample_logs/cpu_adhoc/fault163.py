"""A hundred-and-sixty-third hand-run batch: IMAGE SUPER-RESOLUTION WITH A PERCEPTUAL LOSS.

A tiny super-resolution network (two convs, a conv to 3*r*r channels and PixelShuffle(r), r=2) trained with DDP
on gloo (or --ddp 0: gradients all-reduced by hand) on synthetic low/high-resolution pairs (8x8 -> 16x16 crops of
smooth random images).  The loss is L1 plus a perceptual loss from a small frozen feature extractor (a random
conv net that rank 0 writes to a checkpoint at start and every rank loads).  PSNR is computed per rank and
all_reduced for a `rank R step S loss L psnr P` progress line; every --val-every steps validation images are saved.

Faults:
  pixshuf     - SR_UPSCALE is 3 on rank N: PixelShuffle(3) on 12 channels (RuntimeError from pixel_shuffle)
  hrsize      - rank N's data shard gives 18x18 high-resolution targets at step 2 (size mismatch in the L1 loss)
  psnrinf     - rank N computes PSNR of the prediction against itself at step 2 (mse 0, inf); the check raises
  featmissing - rank N loads the extractor from a misspelled path (FileNotFoundError from torch.load)
  featextra   - every rank builds the extractor with an extra layer; strict load_state_dict: missing keys
  unfrozen    - rank N forgets to freeze the extractor attached to the model (DDP sees more parameters there)
  valwait     - rank N sleeps in "writing validation images" before the step-3 PSNR all_reduce; others time out
  oddcrop     - SR_CROP is 15 on rank N; the program's check raises ValueError (crop must be even)
  gpuonly     - rank N prints an error line 'GPU-only kernel requested' at step 1 and exits with code 1
  sigterm     - rank N sends itself SIGTERM after step 2
  psnrgather  - rank N all_reduces a 2-element [psnr, count] tensor at step 1 (collective size mismatch)
  none        - control, clean run

What happened (filled in after the runs):
  pixshuf     - rank N 'srnet x3': RuntimeError pixel_shuffle ... input.size(-3)=12 is not divisible by 9 in step 0's forward; Root Cause rank N
  hrsize      - rank N UserWarning 'Using a target size ([8, 3, 18, 18])' then RuntimeError 'size of tensor a (16) must match ... b (18)' at step 2
  psnrinf     - rank N FloatingPointError 'PSNR is inf at step 2 (mse 0 ...)'; peers Connection closed by peer; Root Cause rank N
  featmissing - rank N FileNotFoundError '/tmp/job_work/feat_extracter.pt' from torch.load; peers SIGTERM (restart: same error again)
  featextra   - every rank RuntimeError 'Error(s) in loading state_dict for FeatNet' Missing features.4.*; only in per-rank stderr.log
  unfrozen    - every rank RuntimeError 'DDP expects same model across all ranks ... rank N has inconsistent 10 params'; Root Cause rank 0
  valwait     - pg 12 s: others 'Timed out waiting 12000ms for recv/send', rank N SIGTERM; pg 300 s under timeout 60: hung, exit 124
  oddcrop     - rank N ValueError 'SR_CROP=15 is odd; ...' at start-up; rank 0 Connection closed by peer in barrier; Root Cause rank N
  gpuonly     - rank N prints 'ERROR rank N: GPU-only kernel requested ...' and exits 1 (no traceback); peers Connection closed by peer
  sigterm     - rank N killed by its own SIGTERM after step 2 ('failed (exitcode: -15) local_rank: N'); peers Connection reset by peer
  psnrgather  - DETAIL (--ddp 0): every rank 'Detected mismatch between collectives' (rank N TensorShape=[2] vs [1]); Root Cause rank N
  none        - all ranks ran 5 steps; rank 0 saved srnet.pt
"""
import argparse
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as Fn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--val-every", type=int, default=2)
p.add_argument("--perc-weight", type=float, default=0.1)
p.add_argument("--pg-timeout", type=float, default=12)
p.add_argument("--out-dir", default="/tmp/fault163_work")
a = p.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
rank, world = dist.get_rank(), dist.get_world_size()
bad = a.rank == -1 or a.rank == rank
F = a.fault if bad else "none"
torch.manual_seed(1234)
R = 2  # the network is built for x2


class SRNet(nn.Module):
    def __init__(self, upscale):
        super().__init__()
        self.head = nn.Conv2d(3, 16, 3, padding=1)
        self.body = nn.Conv2d(16, 16, 3, padding=1)
        self.tail = nn.Conv2d(16, 3 * R * R, 3, padding=1)
        self.shuffle = nn.PixelShuffle(upscale)

    def forward(self, x):
        h = torch.relu(self.head(x))
        h = h + torch.relu(self.body(h))
        return self.shuffle(self.tail(h))


class FeatNet(nn.Module):
    def __init__(self, extra=False):
        super().__init__()
        layers = [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()]
        if extra:
            layers += [nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()]
        self.features = nn.Sequential(*layers)

    def forward(self, x):
        return self.features(x)


crop = int(os.environ.get("SR_CROP", "15" if F == "oddcrop" else "16"))
if crop % 2 != 0:
    raise ValueError(f"SR_CROP={crop} is odd; the high-resolution crop must be divisible by the upscale factor {R}")
upscale = int(os.environ.get("SR_UPSCALE", "3" if F == "pixshuf" else str(R)))

feat_path = os.path.join(a.out_dir, "feat_extractor.pt")
if rank == 0:
    torch.save(FeatNet().state_dict(), feat_path)
    print(f"rank 0 wrote perceptual feature extractor to {feat_path}", flush=True)
dist.barrier()
feat = FeatNet(extra=(F == "featextra"))
load_path = feat_path.replace("extractor", "extracter") if F == "featmissing" else feat_path
feat.load_state_dict(torch.load(load_path, map_location="cpu"), strict=True)
if F != "unfrozen":
    for q in feat.parameters():
        q.requires_grad_(False)
feat.eval()

net = SRNet(upscale)
net.feat = feat  # kept on the model so checkpoints carry it
model = DDP(net) if a.ddp else net
if not a.ddp:
    for prm in net.parameters():
        dist.broadcast(prm.data, 0)
opt = torch.optim.Adam([q for q in net.parameters() if q.requires_grad], lr=1e-3)
n_train = sum(q.numel() for q in net.parameters() if q.requires_grad)
print(f"rank {rank}/{world} srnet x{upscale}, crop {crop}, {n_train} trainable params", flush=True)

g = torch.Generator().manual_seed(200 + rank)


def make_batch(step):
    hr_size = 18 if (F == "hrsize" and step == 2) else crop
    hr = torch.rand(a.batch, 3, hr_size // 4, hr_size // 4, generator=g)
    hr = Fn.interpolate(hr, size=(hr_size, hr_size), mode="bilinear", align_corners=False)
    lr = Fn.avg_pool2d(hr[:, :, :crop, :crop], R)
    return lr, hr


def psnr(pred, target):
    mse = Fn.mse_loss(pred.clamp(0, 1), target).item()
    return 10 * math.log10(1.0 / mse) if mse > 0 else float("inf")


for step in range(a.steps):
    lr, hr = make_batch(step)
    pred = model(lr)
    l1 = Fn.l1_loss(pred, hr)
    perc = Fn.mse_loss(feat(pred), feat(hr))
    loss = l1 + a.perc_weight * perc
    opt.zero_grad()
    loss.backward()
    if not a.ddp:
        for prm in net.parameters():
            if prm.grad is not None:
                dist.all_reduce(prm.grad)
                prm.grad /= world
    opt.step()
    if F == "gpuonly" and step == 1:
        print(f"ERROR rank {rank}: GPU-only kernel requested (fused_pixel_shuffle_bicubic) but device is cpu", flush=True)
        sys.exit(1)
    val = psnr(pred.detach(), pred.detach().clamp(0, 1) if (F == "psnrinf" and step == 2) else hr)
    if not math.isfinite(val):
        raise FloatingPointError(f"PSNR is {val} at step {step} (mse 0 between prediction and target)")
    if (step + 1) % a.val_every == 0:
        if F == "valwait" and step == 3:
            print(f"rank {rank} writing validation images for step {step}", flush=True)
            while True:
                time.sleep(5)
        torch.save(pred.detach()[:2], os.path.join(a.out_dir, f"val_step{step}_rank{rank}.pt"))
    t = torch.tensor([val, 1.0]) if (F == "psnrgather" and step == 1) else torch.tensor([val])
    dist.all_reduce(t)
    print(f"rank {rank} step {step} loss {loss.item():.4f} psnr {t[0].item() / world:.2f}", flush=True)
    if F == "sigterm" and step == 2:
        os.kill(os.getpid(), signal.SIGTERM)

dist.barrier()
if rank == 0:
    torch.save(net.state_dict(), os.path.join(a.out_dir, "srnet.pt"))
    print(f"rank 0 saved {a.out_dir}/srnet.pt", flush=True)
dist.destroy_process_group()
