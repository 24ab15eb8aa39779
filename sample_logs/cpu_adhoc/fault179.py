"""A hundred-and-seventy-ninth hand-run batch: NEURAL RADIANCE FIELDS ON SYNTHETIC SCENES.

Every rank writes its camera poses (data/poses_rR.npy: 4x4 camera-to-world matrices on a circle around the
origin) and reads them back, generates rays by hand (pinhole camera, one ray per pixel of a tiny image), samples
points along each ray between near and far, applies a positional encoding (sin/cos at L frequencies), and runs a
small MLP giving a density (exp activation) and an RGB colour; volume rendering is done by hand (alpha,
exclusive-cumsum transmittance, weights).  The target colours come from a synthetic scene (a coloured sphere).
Rays are sharded across ranks; training runs under DDP on gloo (or --ddp 0: gradients all-reduced by hand);
each step the loss and PSNR are all_reduced; the per-image ray counts are all_gathered at the end and rank 0
saves the model.  Every rank starts from a pretrained export (ckpt/nerf_w32.pt, written by rank 0).

Faults:
  posedim     - every rank's pose writer saves 3x3 rotations instead of 4x4 matrices; the ray matmul fails
  posemissing - rank N reads its poses from a node-local cache dir that was never written (FileNotFoundError)
  nearfar     - rank N's scene config has near == far; the program's ValueError
  densinf     - rank N's density scale is 1e4; exp overflows to inf, the transmittance is NaN (program check)
  pefreq      - every rank encodes with 6 frequencies while the MLP expects 4 (mat1 and mat2 shapes)
  valrender   - rank N renders a full-resolution validation image before the PSNR all_reduce (late)
  raycount    - rank N counts an extra image in its ray-count vector; the all_gather lengths differ
  ckptwidth   - rank N resumes the width-64 export into a width-32 MLP (size mismatch)
  psnrzero    - rank N's validation split starts at its ray count; PSNR of an empty batch (ZeroDivisionError)
  sigterm     - rank N sends itself SIGTERM at step 2
  exit6       - rank N calls os._exit(6) at step 2 (a native library giving up)
  none        - control, clean run

What happened (filled in after the runs):
  posedim     - RuntimeError mat1 and mat2 shapes cannot be multiplied (64x4 and 3x3) on every rank (np3 tee, np4 pymodule)
  posemissing - FileNotFoundError pose_cache/poses_rN.npy on rank 1 (np3 tee trainer) and rank 2 (np4 redirects)
  nearfar     - ValueError invalid ray bounds near=2.0 must be < far=2.0 on rank 3 (np4 loglevel), rank 1 (np3 wrapper)
  densinf     - FloatingPointError transmittance not finite (max density inf) on rank 1 (np4 prefix, np4 detail)
  pefreq      - RuntimeError mat1 and mat2 shapes (1024x39 and 27x32) on every rank (np3 filter 0,2)
  valrender   - np3 r1: peers gloo Timed out 12000ms, Root Cause rank 0; np4 r2 PG 300 s: killed, exit 124
  raycount    - rank 1 allgather: invalid tensor size at index 0 (expected (4), got (3)) (np3 filter 0,1)
  ckptwidth   - size mismatch for net.0.weight [64, 27] vs [32, 27] on rank 3 (np4 pdsh2), rank 2 (np3 restart)
  psnrzero    - ZeroDivisionError division by zero in psnr on rank 1 (np4 tee), rank 2 (np3 loglevel)
  sigterm     - rank 1 exitcode -15, Root Cause Signal 15 (SIGTERM) on rank 1 (np3 prefix)
  exit6       - rank 2 (np4 plain) and rank 1 (np3 tee trainer) exitcode 6 without a traceback
  none        - clean, exit 0, rank 0 saved ckpt/nerf.pt (np3 plain)
"""
import argparse
import json
import math
import os
import signal
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--img", type=int, default=8)
    p.add_argument("--views", type=int, default=3)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--freqs", type=int, default=4)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--rays", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--val-rows", type=int, default=800)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--workdir", default="/tmp/fault179_work")
    p.add_argument("--save", default="ckpt/nerf.pt")
    return p.parse_args()


class NeRF(nn.Module):
    def __init__(self, freqs, width):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3 + 6 * freqs, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, 4))

    def forward(self, x):
        return self.net(x)


def encode(x, freqs):
    out = [x]
    for k in range(freqs):
        out += [torch.sin((2.0 ** k) * math.pi * x), torch.cos((2.0 ** k) * math.pi * x)]
    return torch.cat(out, -1)


def pose_on_circle(theta, radius=4.0):
    eye = np.array([radius * math.cos(theta), radius * math.sin(theta), 1.0])
    fwd = -eye / np.linalg.norm(eye)
    right = np.cross(fwd, [0.0, 0.0, 1.0])
    right /= np.linalg.norm(right)
    up = np.cross(right, fwd)
    c2w = np.eye(4)
    c2w[:3, 0], c2w[:3, 1], c2w[:3, 2], c2w[:3, 3] = right, up, -fwd, eye
    return c2w


def make_rays(c2w, img, focal):
    j, i = torch.meshgrid(torch.arange(img, dtype=torch.float32), torch.arange(img, dtype=torch.float32), indexing="ij")
    dirs = torch.stack([(i - img / 2) / focal, -(j - img / 2) / focal, -torch.ones_like(i), torch.zeros_like(i)], -1)
    world = dirs.reshape(-1, 4) @ c2w.T
    d = world[:, :3] / world[:, :3].norm(dim=-1, keepdim=True)
    o = c2w[:3, 3].expand_as(d)
    return o, d


def scene_colour(o, d):
    b = (o * d).sum(-1)
    c = (o * o).sum(-1) - 1.0
    hit = (b * b - c) > 0
    rgb = torch.stack([0.5 + 0.5 * d[:, 0], 0.5 + 0.5 * d[:, 1], 0.5 + 0.5 * d[:, 2]], -1)
    return torch.where(hit[:, None], rgb, torch.full_like(rgb, 0.1))


def render(model, o, d, near, far, n_samples, freqs, density_scale):
    t = torch.linspace(near, far, n_samples)
    pts = o[:, None, :] + d[:, None, :] * t[None, :, None]
    raw = model(encode(pts, freqs))
    sigma = torch.exp(raw[..., 0] * density_scale)
    rgb = torch.sigmoid(raw[..., 1:])
    delta = torch.cat([t[1:] - t[:-1], torch.tensor([1e3])])
    sd = sigma * delta
    alpha = 1.0 - torch.exp(-sd)
    trans = torch.exp(-(torch.cumsum(sd, -1) - sd))
    if not torch.isfinite(trans).all():
        bad = int((~torch.isfinite(trans)).sum())
        raise FloatingPointError(f"transmittance is not finite for {bad} samples (max density {sigma.max().item()})")
    w = trans * alpha
    return (w[..., None] * rgb).sum(1)


def psnr(pred, target):
    err = ((pred - target) ** 2).flatten().tolist()
    mse = sum(err) / len(err)
    return -10.0 * math.log10(max(mse, 1e-10))


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    for d in ("data", "ckpt"):
        os.makedirs(os.path.join(a.workdir, d), exist_ok=True)
    cfg = {"near": 2.0, "far": 6.0, "freqs": a.freqs, "density_scale": 1.0, "focal": 8.0, "val_start": a.rays // 2,
           "resume": "ckpt/nerf_w32.pt"}
    if bad and a.fault == "nearfar":
        cfg["far"] = 2.0
    if bad and a.fault == "densinf":
        cfg["density_scale"] = 10000.0
    if bad and a.fault == "psnrzero":
        cfg["val_start"] = a.rays
    if bad and a.fault == "ckptwidth":
        cfg["resume"] = "ckpt/nerf_w64.pt"
    cfg_path = os.path.join(a.workdir, f"scene_r{rank}.json")
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    if cfg["near"] >= cfg["far"]:
        raise ValueError(f"invalid ray bounds in {cfg_path}: near={cfg['near']} must be < far={cfg['far']}")
    if rank == 0:
        torch.save(NeRF(a.freqs, a.width).state_dict(), os.path.join(a.workdir, "ckpt/nerf_w32.pt"))
        torch.save(NeRF(a.freqs, 64).state_dict(), os.path.join(a.workdir, "ckpt/nerf_w64.pt"))
    dist.barrier()
    pose_path = os.path.join(a.workdir, "data", f"poses_r{rank}.npy")
    poses = np.stack([pose_on_circle(2 * math.pi * (rank * a.views + v) / (world * a.views)) for v in range(a.views)])
    if a.fault == "posedim" and bad:
        poses = poses[:, :3, :3]
    np.save(pose_path, poses)
    if bad and a.fault == "posemissing":
        pose_path = os.path.join(a.workdir, "pose_cache", f"poses_r{rank}.npy")
    poses = torch.from_numpy(np.load(pose_path)).float()
    os_, ds_ = zip(*[make_rays(c, a.img, cfg["focal"]) for c in poses])
    o, d = torch.cat(os_), torch.cat(ds_)
    target = scene_colour(o, d)
    enc_freqs = 6 if (bad and a.fault == "pefreq") else cfg["freqs"]
    model = NeRF(cfg["freqs"], a.width)
    model.load_state_dict(torch.load(os.path.join(a.workdir, cfg["resume"]), map_location="cpu"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    print(f"rank {rank}/{world} nerf width={a.width} freqs={cfg['freqs']} rays={len(o)} views={len(poses)}", flush=True)
    g = torch.Generator().manual_seed(rank)
    for step in range(a.steps):
        idx = torch.randperm(len(o), generator=g)[:a.rays]
        pred = render(net, o[idx], d[idx], cfg["near"], cfg["far"], a.samples, enc_freqs, cfg["density_scale"])
        loss = ((pred - target[idx]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "sigterm" and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        if bad and a.fault == "exit6" and step == 2:
            os._exit(6)
        if bad and a.fault == "valrender" and step == 2:
            print(f"rank {rank} rendering validation view at full resolution ({a.val_rows} rows)", flush=True)
            with torch.no_grad():
                for row in range(a.val_rows):
                    render(model, o[:a.img], d[:a.img], cfg["near"], cfg["far"], a.samples, enc_freqs, 1.0)
                    time.sleep(0.05)
        val = slice(cfg["val_start"], a.rays)
        stats = torch.tensor([loss.item(), psnr(pred[val].detach(), target[idx][val])])
        dist.all_reduce(stats)
        print(f"rank {rank} step {step} loss {loss.item():.4f} mean_loss {stats[0] / world:.4f} psnr {stats[1] / world:.2f}", flush=True)
    counts = torch.tensor([a.img * a.img] * (len(poses) + (1 if (bad and a.fault == "raycount") else 0)), dtype=torch.float32)
    out = [torch.zeros(len(poses)) for _ in range(world)]
    dist.all_gather(out, counts)
    if rank == 0:
        print("rays per rank: " + " ".join(f"r{i}={int(c.sum())}" for i, c in enumerate(out)), flush=True)
        torch.save(model.state_dict(), os.path.join(a.workdir, a.save))
        print(f"saved {a.save}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
