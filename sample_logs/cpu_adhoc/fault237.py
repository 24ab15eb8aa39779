"""A two-hundred-and-thirty-seventh hand-run batch: IMAGE SUPER-RESOLUTION WITH A PERCEPTUAL LOSS.

A small sub-pixel convolution network (ESPCN-like: conv 5x5 -> conv 3x3 -> conv 3x3 to r*r channels ->
pixel_shuffle(r)) upscales synthetic low-resolution grayscale patches by 2x (or 3x). Rank 0 writes the
synthetic high-resolution patch file (data/hr_patches.pt) and the frozen feature net checkpoint
(ckpt/featnet_c8.pt, plus an older ckpt/featnet_c16.pt); every rank takes its shard of the train split,
makes the low-resolution inputs by average pooling, and trains with an L1 loss plus a feature loss from
the frozen tiny conv net, wrapped in DDP over gloo (or with gradients all_reduced by hand with --ddp 0).
After 4 steps every rank upscales its validation patches, PSNR is all_reduced, the validation patches are
all_gathered for rank 0's mosaic, and rank 0 saves espcn_final.pt.

Faults:
  scale      - every rank builds the model with upscale factor 3 while the data is made for 2 (loss shape).
  patchgather- rank N all_gathers one validation patch more than the others (gloo size mismatch).
  hrfile     - rank N reads data/hr_patch.pt (missing 'es'): FileNotFoundError.
  psnrinf    - rank N's reference falls back to its own prediction: mse 0, PSNR inf, the program's check.
  shuffle    - rank N reads the shuffle factor 3 for a 4-channel output: pixel_shuffle RuntimeError.
  featckpt   - rank N loads ckpt/featnet_c16.pt into the 8-channel feature net: size mismatch.
  split      - rank N asks the config for the split 'valid' (the config names it 'val'): KeyError.
  slowsave   - rank N writes every upscaled validation image to disk before the PSNR all_reduce (others wait).
  segv       - rank N sends itself SIGSEGV after step 2.
  exit3      - rank N prints its own error line after step 1 and calls os._exit(3).
  patchsize  - rank N crops its patches to 23 pixels (31 - 8, an old crop): the patch size assertion fails.
  none       - control.

What happened (filled in after the runs):
  scale      - every rank: RuntimeError: The size of tensor a (36) must match the size of tensor b (24) in the L1 loss.
  patchgather- rank N: gloo 'allgather: invalid tensor size' (np4); DETAIL: 'Detected mismatch between collectives' on all.
  hrfile     - FileNotFoundError .../sr/data/hr_patch.pt on rank N after the barrier; the others SIGTERMed.
  psnrinf    - FloatingPointError 'rank N: validation PSNR is inf (mse 0.0)' after step 4; peers Connection closed.
  shuffle    - RuntimeError pixel_shuffle ... input.size(-3)=4 is not divisible by 9 on rank N at step 1.
  featckpt   - RuntimeError size mismatch for f1.weight [16, 1, 3, 3] vs [8, 1, 3, 3] on rank N (restart: connectFullMesh).
  split      - KeyError: 'valid' on rank N after the barrier; peers Connection closed by peer / SIGTERM.
  slowsave   - PG 12 s: peers 'Timed out waiting 12000ms for send/recv' in the PSNR all_reduce; PG 300 s: killed at 60 s.
  segv       - rank N dies after step 2; Root Cause exitcode -11 (SIGSEGV).
  exit3      - 'ERROR rank N: LR batch has 0 textured patches ...; abort' then Root Cause exitcode 3.
  patchsize  - AssertionError: HR patch size 23 is not divisible by the upscale factor 2 on rank N.
  none       - exit 0; 'rank 0 validation PSNR 8.86 dB over 3 ranks', espcn_final.pt saved.
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

CONFIG = {
    "splits": {"train": (0, 96), "val": (96, 128)},
    "patch": 24,
    "shuffle_factor": {"x2": 2, "x3": 3},
}


class ESPCN(nn.Module):
    def __init__(self, r, shuffle_r=None):
        super().__init__()
        self.r = r
        self.shuffle_r = shuffle_r or r
        self.c1 = nn.Conv2d(1, 16, 5, padding=2)
        self.c2 = nn.Conv2d(16, 8, 3, padding=1)
        self.c3 = nn.Conv2d(8, r * r, 3, padding=1)

    def forward(self, x):
        x = torch.tanh(self.c1(x))
        x = torch.tanh(self.c2(x))
        return F.pixel_shuffle(self.c3(x), self.shuffle_r)


class FeatNet(nn.Module):
    def __init__(self, ch=8):
        super().__init__()
        self.f1 = nn.Conv2d(1, ch, 3, padding=1)
        self.f2 = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x):
        return self.f2(F.relu(self.f1(x)))


def make_patches(n, p, seed=0):
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, p), torch.linspace(0, 1, p), indexing="ij")
    out = []
    for _ in range(n):
        fx, fy, ph = (torch.rand(3, generator=g) * torch.tensor([8.0, 8.0, 6.28])).tolist()
        img = 0.5 + 0.3 * torch.sin(fx * xx * 6.28 + ph) * torch.cos(fy * yy * 6.28)
        img = img + 0.05 * torch.randn(p, p, generator=g)
        out.append(img.clamp(0, 1))
    return torch.stack(out).unsqueeze(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--scale", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--ddp", type=int, default=1)
    ap.add_argument("--pg-timeout", type=int, default=12)
    ap.add_argument("--work", default="/tmp/fault237_work/sr")
    a = ap.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.rank == -1 or a.rank == rank
    torch.manual_seed(1234)
    os.makedirs(os.path.join(a.work, "data"), exist_ok=True)
    os.makedirs(os.path.join(a.work, "ckpt"), exist_ok=True)
    if rank == 0:
        torch.save(make_patches(128, CONFIG["patch"]), os.path.join(a.work, "data", "hr_patches.pt"))
        torch.save(FeatNet(8).state_dict(), os.path.join(a.work, "ckpt", "featnet_c8.pt"))
        torch.save(FeatNet(16).state_dict(), os.path.join(a.work, "ckpt", "featnet_c16.pt"))
        print(f"rank 0 wrote 128 HR patches and the feature net to {a.work}", flush=True)
    dist.barrier()

    hr_name = "hr_patch.pt" if (a.fault == "hrfile" and me) else "hr_patches.pt"
    hr_all = torch.load(os.path.join(a.work, "data", hr_name))
    split_val = "valid" if (a.fault == "split" and me) else "val"
    t0, t1 = CONFIG["splits"]["train"]
    v0, v1 = CONFIG["splits"][split_val]
    train = hr_all[t0:t1][rank::world]
    val = hr_all[v0:v1][rank::world][: (v1 - v0) // world]
    if a.fault == "patchsize" and me:
        train = train[..., :31 - 8, :31 - 8]  # centre crop from the old 31-pixel pipeline
    p = train.shape[-1]
    assert p % a.scale == 0, f"HR patch size {p} is not divisible by the upscale factor {a.scale}"
    print(f"rank {rank} train {len(train)} patches {p}x{p}, val {len(val)}, scale x{a.scale}", flush=True)

    model_r = 3 if a.fault == "scale" else a.scale
    key = "x3" if (a.fault == "shuffle" and me) else f"x{model_r}"
    model = ESPCN(model_r, shuffle_r=CONFIG["shuffle_factor"][key])
    feat = FeatNet(8)
    feat_ck = "featnet_c16.pt" if (a.fault == "featckpt" and me) else "featnet_c8.pt"
    feat.load_state_dict(torch.load(os.path.join(a.work, "ckpt", feat_ck)))
    for q in feat.parameters():
        q.requires_grad_(False)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for q in model.parameters():
            dist.broadcast(q.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)

    for step in range(1, a.steps + 1):
        idx = torch.randint(0, len(train), (8,))
        hr = train[idx]
        lr = F.avg_pool2d(hr, a.scale)
        sr = net(lr)
        l1 = F.l1_loss(sr, hr)
        perc = F.mse_loss(feat(sr), feat(hr))
        loss = l1 + 0.1 * perc
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for q in model.parameters():
                dist.all_reduce(q.grad)
                q.grad /= world
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f} (l1 {l1.item():.4f} feat {perc.item():.4f})", flush=True)
        if a.fault == "exit3" and me and step == 1:
            print(f"ERROR rank {rank}: LR batch has 0 textured patches after the variance filter; abort", flush=True)
            os._exit(3)
        if a.fault == "segv" and me and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)

    with torch.no_grad():
        sr_val = model(F.avg_pool2d(val, a.scale)).clamp(0, 1)
        cache = {} if (a.fault == "psnrinf" and me) else {"ref": val}
        ref = cache.get("ref", sr_val)
        mse = F.mse_loss(sr_val, ref)
        psnr = 10 * torch.log10(1.0 / mse)
    if not math.isfinite(psnr.item()):
        raise FloatingPointError(f"rank {rank}: validation PSNR is {psnr.item()} (mse {mse.item()})")
    if a.fault == "slowsave" and me:
        os.makedirs(os.path.join(a.work, "val_png"), exist_ok=True)
        for i in range(len(sr_val)):
            torch.save(sr_val[i], os.path.join(a.work, "val_png", f"sr_{rank}_{i:04d}.pt"))
            time.sleep(9.0)
    t = torch.tensor([psnr.item(), 1.0])
    dist.all_reduce(t)
    if rank == 0:
        print(f"rank 0 validation PSNR {t[0].item() / t[1].item():.2f} dB over {int(t[1].item())} ranks", flush=True)
    n_val = len(val) + 1 if (a.fault == "patchgather" and me) else len(val)
    mine = sr_val[:n_val] if n_val <= len(sr_val) else torch.cat([sr_val, sr_val[:1]])
    gathered = [torch.zeros_like(sr_val) for _ in range(world)]
    dist.all_gather(gathered, mine.contiguous())
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(a.work, "espcn_final.pt"))
        print(f"rank 0 mosaic of {sum(len(g) for g in gathered)} val patches; saved espcn_final.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
