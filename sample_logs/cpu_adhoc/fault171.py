"""A hundred-and-seventy-first hand-run batch: AUTOREGRESSIVE IMAGE MODELS WITH MASKED CONVOLUTIONS (PIXELCNN STYLE).

A tiny PixelCNN (a 5x5 masked convolution of type A, --blocks residual blocks of type-B masked 3x3 convolutions, a
1x1 output convolution with one logit per level) over synthetic 8x8 images quantised to 4 levels through a
quantisation table (data/quant.json), trained with DDP on gloo (or --ddp 0: parameters broadcast and gradients
all-reduced by hand) by per-pixel cross-entropy.  At startup the program checks that the model is causal (the
output at a pixel must not depend on that pixel or later ones).  Every --sample-every steps each rank samples
images pixel by pixel and the held-out bits-per-dim is all_reduced into a `bpd` line on rank 0; rank 0 saves
pixelcnn.pt at the end and --resume loads a checkpoint.

Faults:
  maskb        - every rank builds the first layer with mask type B (the program's causality check asserts)
  levelsoob    - rank N quantises its step-2 batch with an off-by-one table: a level equal to the number of classes
  sampleoob    - rank N's sampling loop runs one row past the image (off-by-one in the row range)
  bpdinf       - rank N evaluates with the sampling temperature 1e-3: a zero probability, log 0, bpd inf (check)
  tablemissing - rank N reads quant.json from a node-local data dir that was never synced (FileNotFoundError)
  slowsample   - rank N samples 4000 images instead of 2 before the step-3 bpd all_reduce (others wait)
  blocksdiff   - rank N reads n_blocks 3 from a stale config copy (DDP parameter check at construction)
  ckptlevels   - every rank resumes pixelcnn_l8.pt, a checkpoint trained with 8 levels (size mismatch out conv)
  imgsize      - rank N gets PXL_IMG_SIZE=6 from its environment (the program's power-of-two check)
  palette      - rank N prints an error 'palette mismatch' line and sys.exit(3) after loading its images
  sigabrt      - rank N gets SIGABRT after step 2
  none         - control, clean run

What happened (filled in after the runs):
  maskb        - every rank AssertionError 'PixelCNN is not causal: output at (4, 4) depends on the current/future pixels'
  levelsoob    - rank N IndexError 'Target 4 is out of bounds.' in cross_entropy at step 2; peers Connection closed by peer
  sampleoob    - rank N IndexError 'index 8 is out of bounds for dimension 2 with size 8' in the sampler after step 2
  bpdinf       - rank N FloatingPointError 'bits-per-dim is not finite at step 2: bpd=inf'; DETAIL: monitoredBarrier names N
  tablemissing - rank N FileNotFoundError '/tmp/job/data_local/quant.json'; restart run died in Gloo connectFullMesh
  slowsample   - pg 12 s: peers 'Timed out waiting 12000ms' in the bpd all_reduce, Root Cause rank 0; pg 300 s: exit 124
  blocksdiff   - every rank 'DDP expects same model across all ranks, but Rank N has 16 params, ...' at DDP construction
  ckptlevels   - every rank 'size mismatch for out.weight: copying a param with shape torch.Size([8, 16, 1, 1]) ...'
  imgsize      - rank N ValueError 'rank N: image size 6 (PXL_IMG_SIZE) must be a power of two' at startup
  palette      - rank N prints 'ERROR rank N: palette mismatch: ...' and exits 3 (no traceback); Root Cause exitcode 3
  sigabrt      - rank N killed by SIGABRT after step 2 ('failed (exitcode: -6)'), Root Cause 'Signal 6 (SIGABRT)'
  none         - all ranks ran 6 steps with two sampling/bpd evals, rank 0 saved pixelcnn.pt, exit 0
"""
import argparse
import json
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


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--sample-every", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--data-dir", default="/tmp/fault171/data")
    p.add_argument("--work", default="/tmp/fault171_work")
    p.add_argument("--resume", default="")
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--prepare", action="store_true")
    return p.parse_args()


def hit(a, rank, name):
    return a.fault == name and (a.rank == -1 or a.rank == rank)


class MaskedConv2d(nn.Conv2d):
    def __init__(self, mask_type, cin, cout, k):
        super().__init__(cin, cout, k, padding=k // 2)
        mask = torch.ones_like(self.weight)
        c = k // 2
        mask[:, :, c, c + (mask_type == "B"):] = 0
        mask[:, :, c + 1:, :] = 0
        self.register_buffer("mask", mask)

    def forward(self, x):
        return F.conv2d(x, self.weight * self.mask, self.bias, padding=self.padding)


class ResBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.conv1 = MaskedConv2d("B", ch, ch, 3)
        self.conv2 = MaskedConv2d("B", ch, ch, 1)

    def forward(self, x):
        return x + self.conv2(F.relu(self.conv1(F.relu(x))))


class PixelCNN(nn.Module):
    def __init__(self, levels, ch, n_blocks, first_mask="A"):
        super().__init__()
        self.levels = levels
        self.inp = MaskedConv2d(first_mask, 1, ch, 5)
        self.blocks = nn.Sequential(*[ResBlock(ch) for _ in range(n_blocks)])
        self.out = nn.Conv2d(ch, levels, 1)

    def forward(self, x):
        x = x.float() / (self.levels - 1) - 0.5
        return self.out(F.relu(self.blocks(self.inp(x))))


def check_causal(model, size):
    x = torch.rand(1, 1, size, size, requires_grad=True)
    h = model.inp(x - 0.5)
    h = model.out(F.relu(model.blocks(h)))
    i, j = size // 2, size // 2
    h[0, :, i, j].sum().backward()
    g = x.grad[0, 0].abs()
    leak = g[i, j:].sum() + g[i + 1:, :].sum()
    assert leak.item() == 0.0, f"PixelCNN is not causal: output at ({i}, {j}) depends on the current/future pixels"


def prepare(a):
    os.makedirs(a.data_dir, exist_ok=True)
    with open(os.path.join(a.data_dir, "quant.json"), "w") as f:
        json.dump({"levels": 4, "edges": [0.25, 0.5, 0.75], "channels": 16, "n_blocks": 2,
                   "sample_temp": 1e-3, "n_samples": 2}, f)
    os.makedirs(os.path.join(a.data_dir, "stale"), exist_ok=True)
    with open(os.path.join(a.data_dir, "stale", "quant.json"), "w") as f:
        json.dump({"levels": 4, "edges": [0.25, 0.5, 0.75], "channels": 16, "n_blocks": 3,
                   "sample_temp": 1e-3, "n_samples": 2}, f)
    os.makedirs(a.work, exist_ok=True)
    torch.save(PixelCNN(8, 16, 2).state_dict(), os.path.join(a.work, "pixelcnn_l8.pt"))
    print("prepared", a.data_dir, a.work)


def make_images(n, size, rank):
    g = torch.Generator().manual_seed(500 + rank)
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    cx = torch.rand(n, 1, 1, generator=g) * size
    cy = torch.rand(n, 1, 1, generator=g) * size
    r = 1.5 + torch.rand(n, 1, 1, generator=g) * 2.5
    d = ((xx - cx) ** 2 + (yy - cy) ** 2).sqrt()
    img = torch.sigmoid((r - d) * 2.0) + 0.1 * torch.rand(n, size, size, generator=g)
    return img.clamp(0, 1).unsqueeze(1)


def quantise(img, edges):
    return torch.bucketize(img, torch.tensor(edges))


@torch.no_grad()
def sample(model, n, size, temp, rows):
    img = torch.zeros(n, 1, size, size, dtype=torch.long)
    for i in range(rows):
        for j in range(size):
            logits = model(img)[:, :, i, j]
            img[:, 0, i, j] = torch.multinomial(F.softmax(logits / temp, dim=1), 1).squeeze(1)
    return img


def main():
    a = parse()
    if a.prepare:
        return prepare(a)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data_dir = a.data_dir
    if hit(a, rank, "tablemissing"):
        data_dir = a.data_dir.replace("/data", "/data_local")
    if hit(a, rank, "blocksdiff"):
        data_dir = os.path.join(a.data_dir, "stale")
    with open(os.path.join(data_dir, "quant.json")) as f:
        cfg = json.load(f)
    levels, edges = cfg["levels"], list(cfg["edges"])
    if hit(a, rank, "imgsize"):
        os.environ["PXL_IMG_SIZE"] = "6"
    size = int(os.environ.get("PXL_IMG_SIZE", 8))
    if size & (size - 1):
        raise ValueError(f"rank {rank}: image size {size} (PXL_IMG_SIZE) must be a power of two")
    images = quantise(make_images(256, size, rank), edges)
    if hit(a, rank, "palette"):
        print(f"ERROR rank {rank}: palette mismatch: images quantised with 4-level palette 'grey4' but "
              f"quant.json edges {edges} were fitted for 'grey4-gamma' (max level error 1)",
              file=sys.stderr, flush=True)
        sys.exit(3)
    first = "B" if hit(a, rank, "maskb") else "A"
    model = PixelCNN(levels, cfg["channels"], cfg["n_blocks"], first_mask=first)
    check_causal(model, size)
    resume = a.resume
    if hit(a, rank, "ckptlevels"):
        resume = os.path.join(a.work, "pixelcnn_l8.pt")
    if resume:
        model.load_state_dict(torch.load(resume, map_location="cpu"))
        print(f"rank {rank} resumed from {resume}", flush=True)
    if rank == 0:
        n_par = sum(p.numel() for p in model.parameters())
        print(f"rank 0 pixelcnn levels {levels} blocks {cfg['n_blocks']} params {n_par} image {size}x{size} "
              f"world {world}", flush=True)
    if a.ddp:
        net = DDP(model)
    else:
        net = model
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(rank)
    held = images[-16:]
    for step in range(a.steps):
        idx = torch.randint(0, len(images) - 16, (a.batch,), generator=g)
        x = images[idx]
        if step == 2 and hit(a, rank, "levelsoob"):
            x = quantise(make_images(a.batch, size, rank + 7), [0.0] + edges)
        logits = net(x)
        loss = F.cross_entropy(logits, x.squeeze(1))
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if step == 2 and hit(a, rank, "sigabrt"):
            os.kill(os.getpid(), signal.SIGABRT)
        if (step + 1) % a.sample_every == 0:
            n_samples = 4000 if hit(a, rank, "slowsample") else cfg["n_samples"]
            rows = size + 1 if hit(a, rank, "sampleoob") else size
            t0 = time.time()
            for _ in range(0, n_samples, 2):
                imgs = sample(model, 2, size, 1.0, rows)
            with torch.no_grad():
                temp = cfg["sample_temp"] if hit(a, rank, "bpdinf") else 1.0
                p = F.softmax(model(held) / temp, dim=1).gather(1, held)
                nll = -torch.log(p).sum()
            n_dim = held.numel()
            bpd = nll / (n_dim * math.log(2))
            if not torch.isfinite(bpd):
                raise FloatingPointError(f"rank {rank}: bits-per-dim is not finite at step {step}: bpd={bpd.item()} "
                                         f"(nll_sum={nll.item()}, dims={n_dim})")
            print(f"rank {rank} sampled {n_samples} images in {time.time() - t0:.1f}s mean level "
                  f"{imgs.float().mean():.2f}", flush=True)
            t = torch.tensor([nll.item(), float(n_dim)])
            dist.all_reduce(t)
            if rank == 0:
                print(f"eval step {step} bpd {t[0] / (t[1] * math.log(2)):.3f} dims {int(t[1])}", flush=True)
    if rank == 0:
        os.makedirs(a.work, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(a.work, "pixelcnn.pt"))
        print(f"rank 0 saved {os.path.join(a.work, 'pixelcnn.pt')}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
