"""A hundred-and-seventy-fourth hand-run batch: NEURAL ODES WITH A HAND-WRITTEN SOLVER.

Every rank writes its synthetic spiral trajectories (data/traj_rR.npy: the damped linear spiral dy/dt = A y
sampled at --points times over [0, --t-end]) and reads them back.  The model is a neural ODE: a learned linear
term plus an MLP vector field (2 -> --hidden -> 2), integrated by a hand-written fixed-step RK4 or an adaptive
Dormand-Prince (dopri5) solver with step-size control.  Training runs under DDP on gloo (or --ddp 0: gradients
all-reduced by hand); each step the trajectory loss and the number of function evaluations (NFE) are
all_reduced; at the end the per-step NFE history is all_gathered and rank 0 saves --save.

Faults:
  stepunder   - rank N's vector field gets a time scale of 1e9 (stiff); dopri5 step underflows (RuntimeError)
  statedim    - every rank integrates an augmented state of dim 3 into the 2-d vector field (matmul error)
  nanloss     - rank N's time grid is in ms (x1000); RK4 explodes and the program's finite check raises
  tgrid       - rank N's time grid has two points swapped (the program's ValueError: not increasing)
  trajmissing - rank N reads its trajectories from a node-local dir that was never synced (FileNotFoundError)
  nfegather   - rank N keeps one extra entry in its NFE history; the all_gather lengths differ
  slowsolve   - rank N's step controller never grows the step (max factor 1.0): millions of steps, late collective
  ckpthidden  - rank N resumes a checkpoint saved with hidden 64 into a hidden-32 field (size mismatch)
  tolstr      - every rank reads rtol from the solver config as the string "1e-5" (TypeError in a comparison)
  diverged    - rank N prints its own 'solver diverged' error line and exits with code 5
  sigkill     - rank N is killed by SIGKILL (sent to itself) at step 2
  none        - control, clean run

What happened (filled in after the runs):
  stepunder   - rank N RuntimeError 'dopri5: step size too small (h=3.200e-09 < 1.0e-08) at t=0.000000'; Root Cause rank N
  statedim    - every rank RuntimeError 'mat1 and mat2 shapes cannot be multiplied (16x3 and 2x2)'
  nanloss     - rank N FloatingPointError 'non-finite trajectory loss at step 0 (... max |y| = inf)'; DETAIL: monitoredBarrier
  tgrid       - rank N ValueError 'time grid must be strictly increasing: t[4]=1.1111 >= t[5]=0.8889'; Root Cause rank N
  trajmissing - rank N FileNotFoundError data_local/traj_rN.npy; the --max-restarts run's retry died in connectFullMesh
  nfegather   - rank N 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (7), got (6))'
  slowsolve   - PG 12 s: the others 'Timed out waiting 12000ms' in DDP backward; PG 300 s + timeout 60: hung, exit 124
  ckpthidden  - RuntimeError 'size mismatch for field.fc1.weight ... [64, 2] ... [32, 2]' (every rank, or rank N)
  tolstr      - every rank TypeError "'<' not supported between instances of 'str' and 'float'"
  diverged    - rank N 'ERROR rank N: solver diverged at t=1.5556 ...' then exit 5; Root Cause rank N exitcode 5
  sigkill     - rank N killed at step 2 (exitcode -9, SIGKILL); peers Connection closed/reset by peer
  none        - 3 ranks ran 6 dopri5 steps (nfe 70 each), rank 0 saved ckpt/ode_prev.pt (hidden 64)
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
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--solver", default="dopri5", choices=["dopri5", "rk4"])
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--points", type=int, default=10)
    p.add_argument("--t-end", type=float, default=2.0)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--workdir", default="/tmp/fault174_work")
    p.add_argument("--save", default="ckpt/ode.pt")
    p.add_argument("--resume", default="")
    return p.parse_args()


class Field(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.lin = nn.Linear(2, 2, bias=False)
        self.fc1 = nn.Linear(2, hidden)
        self.fc2 = nn.Linear(hidden, 2)
        self.scale = 1.0
        self.nfe = 0

    def forward(self, t, y):
        self.nfe += 1
        return self.scale * (self.lin(y) + self.fc2(torch.tanh(self.fc1(y))))


def rk4(f, y0, ts, cfg):
    ys = [y0]
    y = y0
    for i in range(len(ts) - 1):
        t0, t1 = ts[i], ts[i + 1]
        n = cfg["substeps"]
        h = (t1 - t0) / n
        for k in range(n):
            t = t0 + k * h
            k1 = f(t, y)
            k2 = f(t + h / 2, y + h / 2 * k1)
            k3 = f(t + h / 2, y + h / 2 * k2)
            k4 = f(t + h, y + h * k3)
            y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        ys.append(y)
    return torch.stack(ys)


C = [1 / 5, 3 / 10, 4 / 5, 8 / 9, 1.0, 1.0]
A = [[1 / 5], [3 / 40, 9 / 40], [44 / 45, -56 / 15, 32 / 9],
     [19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729],
     [9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656],
     [35 / 384, 0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84]]
B = [35 / 384, 0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84, 0]
E = [71 / 57600, 0, -71 / 16695, 71 / 1920, -17253 / 339200, 22 / 525, -1 / 40]


def dopri5(f, y0, ts, cfg):
    rtol, atol, h = cfg["rtol"], cfg["atol"], cfg["h0"]
    ys = [y0]
    y, t = y0, float(ts[0])
    for i in range(1, len(ts)):
        t_out = float(ts[i])
        while t < t_out:
            h = min(h, t_out - t)
            if h < cfg["min_step"]:
                raise RuntimeError(f"dopri5: step size too small (h={h:.3e} < {cfg['min_step']:.1e}) at t={t:.6f}")
            ks = [f(t, y)]
            for j in range(6):
                yj = y + h * sum(a * k for a, k in zip(A[j], ks))
                ks.append(f(t + C[j] * h, yj))
            y_new = y + h * sum(b * k for b, k in zip(B, ks))
            err = h * sum(e * k for e, k in zip(E, ks))
            tol = atol + rtol * torch.maximum(y.abs(), y_new.abs())
            ratio = float((err / tol).pow(2).mean().sqrt().detach())
            if not np.isfinite(ratio):
                h *= 0.1
                continue
            if ratio <= 1.0:
                t, y = t + h, y_new
            factor = 0.9 * ratio ** -0.2 if ratio > 0 else cfg["max_factor"]
            h *= min(cfg["max_factor"], max(0.2, factor))
        ys.append(y)
    return torch.stack(ys)


class NeuralODE(nn.Module):
    def __init__(self, hidden, solver, cfg):
        super().__init__()
        self.field = Field(hidden)
        self.solver = solver
        self.cfg = cfg

    def forward(self, y0, ts):
        solve = dopri5 if self.solver == "dopri5" else rk4
        return solve(self.field, y0, ts, self.cfg)


def make_data(rank, path, points, t_end):
    g = np.random.default_rng(100 + rank)
    Atrue = np.array([[-0.1, 2.0], [-2.0, -0.1]])
    ts = np.linspace(0, t_end, points)
    y0 = g.normal(size=(16, 2)) * 0.5 + np.array([1.5, 0.0])
    w, V = np.linalg.eig(Atrue)
    traj = np.stack([np.real((V @ np.diag(np.exp(w * t)) @ np.linalg.inv(V)) @ y0.T).T for t in ts])
    np.save(path, np.concatenate([ts[:, None, None].repeat(16, 1), traj], axis=2).astype(np.float32))


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    os.makedirs(os.path.join(a.workdir, "data"), exist_ok=True)
    os.makedirs(os.path.join(a.workdir, "ckpt"), exist_ok=True)
    cfg_path = os.path.join(a.workdir, f"solver_r{rank}.json")
    cfg = {"rtol": 1e-5, "atol": 1e-6, "h0": 0.05, "min_step": 1e-8, "max_factor": 5.0, "substeps": 2}
    if bad and a.fault == "tolstr":
        cfg["rtol"] = "1e-5"
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    if cfg["rtol"] < 1e-10 or cfg["atol"] < 1e-12:
        print(f"rank {rank} warning: very tight tolerances, expect many steps", flush=True)
    if bad and a.fault == "slowsolve":
        cfg["max_factor"], cfg["h0"] = 1.0, 1e-6
    data_dir = os.path.join(a.workdir, "data")
    make_data(rank, os.path.join(data_dir, f"traj_r{rank}.npy"), a.points, a.t_end)
    if bad and a.fault == "trajmissing":
        data_dir = os.path.join(a.workdir, "data_local")
    arr = torch.from_numpy(np.load(os.path.join(data_dir, f"traj_r{rank}.npy")))
    ts, traj = arr[:, 0, 0].clone(), arr[:, :, 1:].clone()
    if bad and a.fault == "nanloss":
        ts = ts * 1000.0
    if bad and a.fault == "tgrid":
        ts[4], ts[5] = ts[5].clone(), ts[4].clone()
    if not bool((ts[1:] > ts[:-1]).all()):
        i = int(torch.nonzero(ts[1:] <= ts[:-1])[0])
        raise ValueError(f"time grid must be strictly increasing: t[{i}]={ts[i]:.4f} >= t[{i + 1}]={ts[i + 1]:.4f}")
    model = NeuralODE(a.hidden, a.solver, cfg)
    if bad and a.fault == "ckpthidden":
        a.resume = os.path.join(a.workdir, "ckpt/ode_prev.pt")
    if a.resume:
        model.load_state_dict(torch.load(a.resume, map_location="cpu"))
        print(f"rank {rank} resumed from {a.resume}", flush=True)
    if bad and a.fault == "stepunder":
        model.field.scale = 1e9
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    nfe_hist = []
    print(f"rank {rank}/{world} solver={a.solver} hidden={a.hidden} points={len(ts)} t_end={float(ts[-1]):.2f}", flush=True)
    for step in range(a.steps):
        model.field.nfe = 0
        y0 = traj[0]
        if bad and a.fault == "statedim":
            y0 = torch.cat([y0, torch.zeros(y0.shape[0], 1)], dim=1)
        pred = net(y0, ts)
        loss = (pred - traj).abs().mean()
        if not torch.isfinite(loss):
            mx = float(pred.detach().abs().nan_to_num(float("inf")).max())
            raise FloatingPointError(f"non-finite trajectory loss at step {step} (rank {rank}, max |y| = {mx:.3e})")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "diverged" and step == 3:
            print(f"ERROR rank {rank}: solver diverged at t={float(ts[-3]):.4f}: |y| = 4.1e+12 after 512 rejected steps", flush=True)
            sys.exit(5)
        if bad and a.fault == "sigkill" and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        stats = torch.tensor([loss.item(), float(model.field.nfe)])
        dist.all_reduce(stats)
        nfe_hist.append(model.field.nfe)
        print(f"rank {rank} step {step} loss {loss.item():.5f} nfe {model.field.nfe} mean_loss {stats[0] / world:.5f} total_nfe {int(stats[1])}", flush=True)
    if bad and a.fault == "nfegather":
        nfe_hist.append(model.field.nfe)
    hist = torch.tensor(nfe_hist, dtype=torch.float32)
    out = [torch.zeros(a.steps) for _ in range(world)]
    dist.all_gather(out, hist)
    if rank == 0:
        print(f"nfe per rank: {[int(o.sum()) for o in out]}", flush=True)
        torch.save(model.state_dict(), os.path.join(a.workdir, a.save))
        print(f"saved {a.save}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
