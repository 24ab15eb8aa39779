"""A two-hundred-and-twenty-ninth hand-run batch: PHYSICS SURROGATE FOR HEAT DIFFUSION.

A small U-Net-like convolutional surrogate is trained to predict the next field of a 2-D heat equation.  The
training pairs come from a hand-written explicit finite-difference (FTCS) solver on a --grid x --grid mesh with
Dirichlet boundary temperatures read from /tmp/fault229_work/config/boundary.json (rank 0 writes it, every rank
reads it).  The diffusivity comes from the HEAT_ALPHA environment variable.  The surrogate starts from
ckpt/surrogate_init_w8.pt.  The loss is an MSE data loss plus a physics residual loss (implicit-step residual
of the predicted field); the model is wrapped in DDP (gloo), or with --ddp 0 the gradients are all_reduced by
hand.  Data and residual losses are all_reduced for the log; at the end the per-step residual norms are
all_gathered and rank 0 saves the surrogate to surrogate_final.pt.

Faults:
  unstable  - rank N uses a time step 4x the stability limit: its solver field overflows (the program's check)
  grid      - every rank: --grid 33 fields into a U-Net whose pool/upsample needs even sizes (shape error)
  bcfile    - rank N reads the boundary config from boundary.yaml, which does not exist (FileNotFoundError)
  bcname    - rank N's config section lacks the 'north' boundary (KeyError)
  resgather - rank N all_gathers its residual norms with one extra entry (gloo size mismatch)
  ckpt      - rank N loads ckpt/surrogate_init_w16.pt, saved with base width 16 (size mismatch)
  alpha     - every rank: HEAT_ALPHA is set to a string that is not a number (ValueError) [set by the command]
  refsolve  - rank N runs a high-resolution reference solve for --stall seconds before step 2's all_reduce
  sigbus    - rank N sends itself SIGBUS after step 2
  exit6     - rank N prints its own error line about an empty initial-condition file and exits with code 6
  zerodx    - rank N uses multigrid level 6, so its coarse grid has 0 cells and dx divides by zero
  none      - control, clean run

What happened (filled in after the runs):
  unstable  - rank N: FloatingPointError solver field is not finite (r=1.000, limit 0.25); DETAIL: monitoredBarrier
  grid      - every rank: RuntimeError Sizes of tensors must match ... Expected size 33 but got size 32
  bcfile    - rank N: FileNotFoundError .../config/boundary.yaml; peers SIGTERMed
  bcname    - rank N: KeyError 'north' (plate_b spells it 'nrth'); peers SIGTERMed
  resgather - rank N: RuntimeError ProcessGroupGloo::allgather: invalid tensor size (expected (5), got (4))
  ckpt      - rank N: RuntimeError size mismatch for enc.0.weight [16, 1, 3, 3] vs [8, 1, 3, 3]
  alpha     - every rank: ValueError could not convert string to float: '0.1 m2/s'
  refsolve  - rank N slept: a peer gloo Timed out waiting 12000ms; with PG 300 s killed by timeout (124)
  sigbus    - rank N: exitcode -7 (SIGBUS) after step 2; peers reset/closed; restart: connectFullMesh
  exit6     - rank N logs its ERROR line about an empty initial-condition file, exitcode 6
  zerodx    - rank N: ZeroDivisionError float division by zero computing dx; peers SIGTERMed
  none      - clean, exit 0, rank 0 saved surrogate_final.pt
"""
import argparse
import json
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

WORK = "/tmp/fault229_work"
CFG_DIR = os.path.join(WORK, "config")
CKPT_DIR = os.path.join(WORK, "ckpt")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--grid", type=int, default=32)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--substeps", type=int, default=60)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    return p.parse_args()


class UNetSurrogate(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.GELU())
        self.mid = nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.GELU())
        self.dec = nn.Sequential(nn.Conv2d(3 * width, width, 3, padding=1), nn.GELU())
        self.out = nn.Conv2d(width, 1, 1)

    def forward(self, u):
        e = self.enc(u)
        m = self.mid(F.avg_pool2d(e, 2))
        up = F.interpolate(m, scale_factor=2, mode="nearest")
        return u + self.out(self.dec(torch.cat([e, up], dim=1)))


def laplacian(u):
    lap = torch.zeros_like(u)
    lap[..., 1:-1, 1:-1] = (u[..., 2:, 1:-1] + u[..., :-2, 1:-1] + u[..., 1:-1, 2:] + u[..., 1:-1, :-2]
                            - 4 * u[..., 1:-1, 1:-1])
    return lap


def apply_bc(u, bc):
    u[..., 0, :] = bc["north"]
    u[..., -1, :] = bc["south"]
    u[..., :, 0] = bc["west"]
    u[..., :, -1] = bc["east"]
    return u


def solve(u, bc, r, substeps, rank, dt):
    for k in range(substeps):
        u = apply_bc(u + r * laplacian(u), bc)
    if not torch.isfinite(u).all():
        raise FloatingPointError(f"rank {rank}: solver field is not finite after {substeps} steps "
                                 f"(dt={dt:.3e}, r=alpha*dt/dx^2={r:.3f}, stability limit 0.25)")
    return u


def load_boundary(rank, a):
    name = "boundary.json"
    if a.fault == "bcfile" and rank == a.rank:
        name = "boundary.yaml"
    with open(os.path.join(CFG_DIR, name)) as f:
        cfg = json.load(f)
    section = "plate_b" if (a.fault == "bcname" and rank == a.rank) else "plate_a"
    raw = cfg[section]
    return {side: float(raw[side]) for side in ("north", "south", "west", "east")}


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)
    if rank == 0:
        os.makedirs(CFG_DIR, exist_ok=True)
        os.makedirs(CKPT_DIR, exist_ok=True)
        cfg = {"plate_a": {"north": 1.0, "south": 0.0, "west": 0.25, "east": 0.25},
               "plate_b": {"south": 0.5, "west": 0.0, "east": 0.0, "nrth": 1.0}}
        with open(os.path.join(CFG_DIR, "boundary.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        torch.manual_seed(7)
        torch.save(UNetSurrogate(8).state_dict(), os.path.join(CKPT_DIR, "surrogate_init_w8.pt"))
        torch.save(UNetSurrogate(16).state_dict(), os.path.join(CKPT_DIR, "surrogate_init_w16.pt"))
    dist.barrier()

    alpha = float(os.environ.get("HEAT_ALPHA", "0.1"))
    level = 6 if (a.fault == "zerodx" and rank == a.rank) else 0
    cells = (a.grid - 1) >> level
    dx = 1.0 / cells
    dt_limit = 0.25 * dx * dx / alpha
    dt = 0.8 * dt_limit
    if a.fault == "unstable" and rank == a.rank:
        dt = 4.0 * dt_limit
    r = alpha * dt / (dx * dx)
    bc = load_boundary(rank, a)
    print(f"rank {rank}: grid {a.grid}x{a.grid} dx={dx:.4f} alpha={alpha} dt={dt:.3e} r={r:.3f} bc={bc}", flush=True)

    ck = "surrogate_init_w16.pt" if (a.fault == "ckpt" and rank == a.rank) else "surrogate_init_w8.pt"
    model = UNetSurrogate(a.width)
    model.load_state_dict(torch.load(os.path.join(CKPT_DIR, ck), map_location="cpu"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    res_norms = []

    for step in range(1, a.steps + 1):
        yy, xx = torch.meshgrid(torch.linspace(0, 1, a.grid), torch.linspace(0, 1, a.grid), indexing="ij")
        cx, cy = torch.rand(a.batch, 1, 1, 1), torch.rand(a.batch, 1, 1, 1)
        u0 = apply_bc(torch.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / 0.02), bc)
        u1 = solve(u0.clone(), bc, r, a.substeps, rank, dt)
        if a.fault == "exit6" and rank == a.rank and step == 2:
            print(f"ERROR rank {rank}: initial-condition file {WORK}/ic/ic_{rank:03d}.npy is empty (0 bytes); "
                  f"cannot build the training set", file=sys.stderr, flush=True)
            sys.exit(6)
        pred = net(u0)
        data_loss = F.mse_loss(pred, u1)
        resid = (pred - u0) - r * a.substeps * laplacian(pred)
        phys_loss = resid[..., 1:-1, 1:-1].pow(2).mean()
        loss = data_loss + 0.1 * phys_loss
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if a.fault == "refsolve" and rank == a.rank and step == 2:
            print(f"rank {rank}: running reference solver at 512x512 for validation", flush=True)
            time.sleep(a.stall)
        stats = torch.tensor([data_loss.item(), phys_loss.item()])
        dist.all_reduce(stats)
        stats /= world
        res_norms.append(resid.norm().item())
        print(f"rank {rank} step {step} loss {loss.item():.5f} data {stats[0]:.5f} residual {stats[1]:.5f}", flush=True)
        if a.fault == "sigbus" and rank == a.rank and step == 2:
            os.kill(os.getpid(), signal.SIGBUS)

    if a.fault == "resgather" and rank == a.rank:
        res_norms.append(resid.norm().item())
    mine = torch.tensor(res_norms)
    gathered = [torch.zeros(a.steps) for _ in range(world)]
    dist.all_gather(gathered, mine)
    if rank == 0:
        allres = torch.stack(gathered)
        print(f"residual norms over {world} ranks: mean {allres.mean():.4f} max {allres.max():.4f}", flush=True)
        torch.save(model.state_dict(), os.path.join(WORK, "surrogate_final.pt"))
        print(f"saved surrogate to {WORK}/surrogate_final.pt", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
