"""A two-hundred-and-twenty-second hand-run batch: OPTICAL FLOW ESTIMATION.

A small RAFT-like model trained on synthetic image pairs: every rank builds procedural textures (sums of
sines), warps them with smooth flow fields read from /tmp/fault222_work/flows/flow_R.pt, and trains a feature
encoder (initialised from ckpt/encoder_init.pt), an all-pairs correlation volume looked up in a window of
radius r around the current flow, and a small update block applied for a few refinement iterations.  The
sequence loss is the end-point error (EPE) computed by hand; the encoder and update block are wrapped in DDP
(gloo) or, with --ddp 0, their gradients are all_reduced by hand.  The step loss is all_reduced for the log; at
the end the per-iteration EPE is all_gathered and rank 0 saves the model to export/raft_small.pt.

Faults:
  radius   - every rank: config corr_radius 4 while the update block was built for radius 3 (conv shape error)
  noflow   - rank N reads its flow field from flows_v2/ which does not exist (FileNotFoundError)
  diverge  - rank N reads flow_momentum 1e20: the flow blows up to inf over the iterations (program's check)
  grid     - rank N builds homogeneous (x, y, 1) sampling coords: grid_sample grid with last dim 3 (RuntimeError)
  epelen   - rank N all_gathers its per-iteration EPE with one extra entry (gloo size mismatch)
  ckpt     - rank N loads ckpt/encoder_c24.pt saved with 24 channels instead of 16 (size mismatch)
  itersstr - every rank: the number of iterations comes from OFLOW_ITERS as a string (TypeError)
  visual   - rank N renders every flow field as an image for --stall seconds before step 2 (peers time out)
  sigbus   - rank N sends itself SIGBUS after step 2
  exit6    - rank N logs its own error line about an empty validity mask and exits with code 6
  crop     - rank N uses crop size 40 on 32x32 images (the program's assert)
  none     - control, clean run

What happened (filled in after the runs):
  radius   - every rank: RuntimeError weight [32, 51, 3, 3] expected 51 channels, got 83 (update block), step 0
  noflow   - rank N: FileNotFoundError .../flows_v2/flow_N.pt before any step; peers SIGTERMed
  diverge  - rank N: FloatingPointError flow diverged to inf at refinement iteration 2, step 0; peers closed
  grid     - rank N: RuntimeError grid_sampler() expected grid size 2 in last dim, got [576, 1, 1, 3]; peers closed
  epelen   - rank N itself: RuntimeError ProcessGroupGloo::allgather invalid tensor size (expected (5), got (4))
  ckpt     - rank N: RuntimeError size mismatch for conv1.weight [24, 3, 3, 3] vs [16, 3, 3, 3]; peers SIGTERMed
  itersstr - every rank: TypeError 'str' object cannot be interpreted as an integer at range(iters), step 0
  visual   - rank N slept: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout 60 (exit 124)
  sigbus   - rank N: exitcode -7 (SIGBUS) after step 2; peers reset/closed; restart attempt died in connectFullMesh
  exit6    - rank N logs ERROR validity mask ... empty, exitcode 6 at eval; peers closed by peer
  crop     - rank N: AssertionError crop size 40 is larger than the 32x32 image pair, step 0; peers closed
  none     - clean, exit 0, rank 0 printed the eval EPE and saved export/raft_small.pt
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

WORK = "/tmp/fault222_work"
IMG = 32
FEAT = 16


class Encoder(nn.Module):
    def __init__(self, ch=FEAT):
        super().__init__()
        self.conv1 = nn.Conv2d(3, ch, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x):
        return self.conv2(F.relu(self.conv1(x)))


class UpdateBlock(nn.Module):
    def __init__(self, radius):
        super().__init__()
        cin = (2 * radius + 1) ** 2 + 2
        self.conv1 = nn.Conv2d(cin, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 2, 3, padding=1)

    def forward(self, corr, flow):
        return self.conv2(F.relu(self.conv1(torch.cat([corr, flow], 1))))


class RAFTSmall(nn.Module):
    def __init__(self, radius):
        super().__init__()
        self.encoder = Encoder()
        self.update = UpdateBlock(radius)


def base_coords(b, h, w, homogeneous=False):
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij")
    parts = [xs, ys] + ([torch.ones_like(xs)] if homogeneous else [])
    return torch.stack(parts, -1).unsqueeze(0).expand(b, h, w, len(parts))


def to_grid(coords, h, w):
    g = coords.clone()
    g[..., 0] = 2 * g[..., 0] / (w - 1) - 1
    g[..., 1] = 2 * g[..., 1] / (h - 1) - 1
    return g


def corr_lookup(corr, coords, radius):
    # corr: (B*H*W, 1, H, W); coords: (B, H, W, 2) in pixels of the second feature map
    b, h, w, _ = coords.shape
    d = torch.arange(-radius, radius + 1, dtype=torch.float32)
    dy, dx = torch.meshgrid(d, d, indexing="ij")
    delta = torch.stack([dx, dy], -1).view(1, 2 * radius + 1, 2 * radius + 1, 2)
    centre = coords.reshape(b * h * w, 1, 1, coords.shape[-1])
    win = centre + delta if coords.shape[-1] == 2 else centre
    out = F.grid_sample(corr, to_grid(win, h, w), align_corners=True)
    return out.view(b, h, w, -1).permute(0, 3, 1, 2)


def texture(b, gen):
    ys, xs = torch.meshgrid(torch.linspace(0, 1, IMG), torch.linspace(0, 1, IMG), indexing="ij")
    img = torch.zeros(b, 3, IMG, IMG)
    for _ in range(4):
        f = torch.rand(b, 3, 1, 1, generator=gen) * 12 + 2
        ph = torch.rand(b, 3, 1, 1, generator=gen) * 6.28
        a = torch.rand(b, 3, 1, 1, generator=gen)
        img += a * torch.sin(f * xs + ph) * torch.cos(f * ys - ph)
    return img


def warp(img, flow):
    b = img.shape[0]
    coords = base_coords(b, IMG, IMG) + flow.permute(0, 2, 3, 1)
    return F.grid_sample(img, to_grid(coords, IMG, IMG), align_corners=True, padding_mode="border")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--ddp", type=int, default=1)
    a = p.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(100 + rank)

    cfg = {"corr_radius": 3, "iters": 4, "flow_momentum": 1.0, "crop": 24, "flow_dir": "flows"}
    if me and a.fault == "radius":
        cfg["corr_radius"] = 4
    if me and a.fault == "itersstr":
        os.environ["OFLOW_ITERS"] = "4"
    if "OFLOW_ITERS" in os.environ:
        cfg["iters"] = os.environ["OFLOW_ITERS"]
    if me and a.fault == "diverge":
        cfg["flow_momentum"] = 1e20
    if me and a.fault == "crop":
        cfg["crop"] = 40
    if me and a.fault == "noflow":
        cfg["flow_dir"] = "flows_v2"

    os.makedirs(f"{WORK}/flows", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    fg = torch.Generator().manual_seed(7 + rank)
    lowres = torch.randn(64, 2, 4, 4, generator=fg) * 1.5
    torch.save(F.interpolate(lowres, size=(IMG, IMG), mode="bilinear", align_corners=True), f"{WORK}/flows/flow_{rank}.pt")
    if rank == 0:
        torch.save(Encoder().state_dict(), f"{WORK}/ckpt/encoder_init.pt")
        torch.save(Encoder(24).state_dict(), f"{WORK}/ckpt/encoder_c24.pt")
    dist.barrier()

    flows = torch.load(f"{WORK}/{cfg['flow_dir']}/flow_{rank}.pt")
    print(f"rank {rank}: loaded {flows.shape[0]} flow fields from {WORK}/{cfg['flow_dir']}/flow_{rank}.pt", flush=True)

    model = RAFTSmall(radius=3)
    enc_path = f"{WORK}/ckpt/encoder_c24.pt" if (me and a.fault == "ckpt") else f"{WORK}/ckpt/encoder_init.pt"
    model.encoder.load_state_dict(torch.load(enc_path))
    if a.ddp:
        net = DDP(model)
        params = net.parameters()
    else:
        net = model
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
        params = model.parameters()
    opt = torch.optim.Adam(params, lr=1e-3)
    radius = cfg["corr_radius"]

    def forward(img1, img2):
        f1, f2 = model.encoder(img1), model.encoder(img2)
        b, c, h, w = f1.shape
        corr = torch.einsum("bchw,bcuv->bhwuv", f1, f2) / math.sqrt(c)
        corr = corr.reshape(b * h * w, 1, h, w)
        homog = me and a.fault == "grid"
        coords0 = base_coords(b, h, w, homogeneous=homog)
        flow = torch.zeros(b, 2, h, w)
        preds = []
        for it in range(cfg["iters"]):
            coords = coords0.clone()
            coords[..., :2] = coords[..., :2] + flow.permute(0, 2, 3, 1)
            feats = corr_lookup(corr, coords, radius)
            delta = model.update(feats, flow)
            flow = flow * cfg["flow_momentum"] + delta
            if not torch.isfinite(flow).all():
                raise FloatingPointError(f"flow diverged to inf at refinement iteration {it} on rank {rank} "
                                         f"(max |flow| {flow.abs().max().item():.3g}, momentum {cfg['flow_momentum']})")
            preds.append(flow)
        return preds

    def batch(step):
        idx = torch.randint(0, flows.shape[0], (a.batch,), generator=gen)
        img1 = texture(a.batch, gen)
        flow = flows[idx]
        img2 = warp(img1, -flow)
        crop = cfg["crop"]
        assert crop <= IMG, f"crop size {crop} is larger than the {IMG}x{IMG} image pair"
        y0 = int(torch.randint(0, IMG - crop + 1, (1,), generator=gen))
        x0 = int(torch.randint(0, IMG - crop + 1, (1,), generator=gen))
        sl = (slice(None), slice(None), slice(y0, y0 + crop), slice(x0, x0 + crop))
        img1, img2, flow = img1[sl], img2[sl], flow[sl]
        return img1, img2, F.avg_pool2d(flow, 2) / 2

    for step in range(a.steps):
        if me and a.fault == "visual" and step == 2:
            print(f"rank {rank}: writing flow visualisations for {flows.shape[0]} fields to {WORK}/vis/", flush=True)
            time.sleep(a.stall)
        img1, img2, gt = batch(step)
        preds = forward(img1, img2)
        n = len(preds)
        loss = sum(0.8 ** (n - 1 - i) * (p_ - gt).pow(2).sum(1).sqrt().mean() for i, p_ in enumerate(preds))
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        print(f"rank {rank} step {step} loss {lt.item() / world:.4f} epe {(preds[-1] - gt).pow(2).sum(1).sqrt().mean().item():.3f}", flush=True)
        if me and a.fault == "sigbus" and step == 2:
            os.kill(os.getpid(), signal.SIGBUS)

    with torch.no_grad():
        img1, img2, gt = batch(99)
        preds = forward(img1, img2)
        epe = torch.stack([(p_ - gt).pow(2).sum(1).sqrt().mean() for p_ in preds])
        valid = (gt.abs().sum(1) < 1e3).float()
        if me and a.fault == "exit6":
            valid.zero_()
        if valid.sum() == 0:
            print(f"ERROR rank {rank}: validity mask of the eval flow field is empty (0 of {valid.numel()} pixels); "
                  f"refusing to report EPE", flush=True)
            sys.exit(6)
    if me and a.fault == "epelen":
        epe = torch.cat([epe, epe[-1:]])
    gathered = [torch.zeros(len(preds)) for _ in range(world)]
    dist.all_gather(gathered, epe)
    tot = epe[-1:].clone()
    dist.all_reduce(tot)
    if rank == 0:
        per_iter = torch.stack(gathered).mean(0)
        print("eval EPE per iteration " + " ".join(f"{v:.3f}" for v in per_iter.tolist())
              + f" final {tot.item() / world:.3f}", flush=True)
        torch.save(model.state_dict(), f"{WORK}/export/raft_small.pt")
        print(f"saved flow model to {WORK}/export/raft_small.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
