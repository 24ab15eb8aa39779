"""A hundred-and-fifty-seventh hand-run batch: PHYSICS-INFORMED NEURAL NETWORKS (SCIENTIFIC ML).

A small MLP u(x, t) trained on the gloo backend to satisfy the 1-D heat equation u_t = alpha * u_xx on
per-rank collocation points.  u_t, u_x, u_xx come from torch.autograd.grad with create_graph=True; the loss
is the PDE residual plus initial-condition (u(x,0) = sin(pi x), values read from a per-rank bc file) and
boundary terms.  Gradients are all-reduced by hand, residual norms are all_reduced and all_gathered for the
log, then an L-BFGS phase (max_iter 1, closure all-reduces gradients) polishes the fit.  Can resume.

Faults:
  nograd    - rank N's collocation points are built without requires_grad, autograd.grad raises
  nonscalar - every rank takes u_xx = grad(u_x, x) without grad_outputs (u_x is not a scalar)
  coef0     - rank N's diffusivity alpha is 0 and is used as a divisor; the finite check raises
  bcfile    - rank N opens bc_<world>.npy instead of bc_<rank>.npy (off by one), FileNotFoundError
  gather    - rank N has 8 more collocation points, the all_gather of per-point residuals mismatches
  lock      - rank N polls for an L-BFGS ready file that never appears (the others wait in all_reduce)
  key       - the domain string says tmax= instead of t_max= on every rank, KeyError
  ckpt      - resume: rank N loads the checkpoint of a wider network (width 48), size mismatch
  exit3     - rank N calls os._exit(3) when its residual "stalls" at step 2
  sigbus    - rank N gets SIGBUS at step 1
  none      - control, clean run

What happened (filled in after the runs):
  nograd    - rank N RuntimeError 'One of the differentiated Tensors does not require grad' (line 80) at step 0
  nonscalar - every rank RuntimeError 'grad can be implicitly created only for scalar outputs' at step 0
  coef0     - rank N FloatingPointError 'non-finite PDE residual on 128 of 128 points' (line 131) at step 0
  bcfile    - rank N FileNotFoundError for /tmp/job_work/bc/bc_<world>.npy in np.load before step 0 (bc dir emptied first)
  gather    - a peer aborts in the step-2 all_gather: gloo EnforceNotMet '272 vs 256' (exitcode -6)
  lock      - pg 12 s + DETAIL: 'Ranks N failed to pass monitoredBarrier'; pg 300 s under timeout 60: hung, exit 124
  key       - every rank KeyError: 't_max' before step 0
  ckpt      - rank N load_state_dict RuntimeError: Missing key(s) / Unexpected key(s) (w48 file lacks 'net.' prefix)
  exit3     - rank N prints 'residual stalled, aborting solver' after step 2's all_gather, exitcode 3
  sigbus    - rank N exitcode -7 (SIGBUS) at step 1; peers Connection reset by peer
  none      - clean, exit 0 (one earlier try aborted at exit: 'terminate called without an active exception', dropped)
"""
import argparse
import math
import os
import signal
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--lbfgs-steps", type=int, default=2)
p.add_argument("--width", type=int, default=32)
p.add_argument("--n-col", type=int, default=128)
p.add_argument("--alpha", type=float, default=0.1)
p.add_argument("--domain", default="x_min=-1,x_max=1,t_max=1")
p.add_argument("--pg-timeout", type=float, default=12)
p.add_argument("--work", default="/tmp/fault157_work")
p.add_argument("--resume", default="")
a = p.parse_args()


def hit(rank):
    return a.rank == -1 or a.rank == rank


class PINN(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, w), nn.Tanh(), nn.Linear(w, w), nn.Tanh(), nn.Linear(w, 1))
    def forward(self, x, t):
        return self.net(torch.cat([x, t], dim=1))


def parse_domain(s):
    return {k: float(v) for k, v in (kv.split("=") for kv in s.split(","))}


def derivatives(model, x, t, scalar_fix=True):
    u = model(x, t)
    u_x, u_t = torch.autograd.grad(u.sum(), (x, t), create_graph=True)
    if scalar_fix:
        u_xx = torch.autograd.grad(u_x.sum(), x, create_graph=True)[0]
    else:
        u_xx = torch.autograd.grad(u_x, x, create_graph=True)[0]
    return u, u_t, u_xx


def allreduce_grads(model, world):
    for q in model.parameters():
        dist.all_reduce(q.grad)
        q.grad /= world


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    domain = a.domain.replace("t_max", "tmax") if a.fault == "key" else a.domain
    cfg = parse_domain(domain)
    x_min, x_max, t_max = cfg["x_min"], cfg["x_max"], cfg["t_max"]
    alpha = 0.0 if a.fault == "coef0" and hit(rank) else a.alpha
    n_col = a.n_col + (8 if a.fault == "gather" and hit(rank) else 0)
    bc_dir = os.path.join(a.work, "bc")
    if rank == 0:
        os.makedirs(bc_dir, exist_ok=True)
        for r in range(world):
            xs = np.linspace(x_min, x_max, 64, dtype=np.float32)
            np.save(os.path.join(bc_dir, f"bc_{r}.npy"), np.stack([xs, np.sin(math.pi * xs)]))
    dist.barrier()
    shard = world if a.fault == "bcfile" and hit(rank) else rank
    bc = torch.from_numpy(np.load(os.path.join(bc_dir, f"bc_{shard}.npy")))
    x0, u0 = bc[0].unsqueeze(1), bc[1].unsqueeze(1)
    torch.manual_seed(0)
    model = PINN(a.width)
    if a.resume:
        width = 48 if a.fault == "ckpt" and hit(rank) else a.width
        sd = torch.load(os.path.join(a.resume, f"pinn_w{width}.pt"), map_location="cpu")
        model.load_state_dict(sd)
        print(f"rank {rank} resumed from {a.resume}", flush=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + rank)
    print(f"rank {rank}/{world} collocation points {n_col} alpha {alpha} domain {cfg}", flush=True)

    def pinn_loss():
        x = (x_min + (x_max - x_min) * torch.rand(n_col, 1, generator=g)).requires_grad_(True)
        t = (t_max * torch.rand(n_col, 1, generator=g)).requires_grad_(True)
        if a.fault == "nograd" and hit(rank):
            x = x.detach()  # normalised copy for the sampler's stats
        u, u_t, u_xx = derivatives(model, x, t, scalar_fix=(a.fault != "nonscalar"))
        res = u_t / alpha - u_xx
        if not torch.isfinite(res).all():
            raise FloatingPointError(f"non-finite PDE residual on {int((~torch.isfinite(res)).sum())} of {n_col} points")
        ic = model(x0, torch.zeros_like(x0)) - u0
        tb = t_max * torch.rand(16, 1, generator=g)
        bl = model(torch.full_like(tb, x_min), tb)
        br = model(torch.full_like(tb, x_max), tb)
        return (res ** 2).mean() + (ic ** 2).mean() + (bl ** 2).mean() + (br ** 2).mean(), res

    for step in range(a.steps):
        if a.fault == "sigbus" and hit(rank) and step == 1:
            os.kill(os.getpid(), signal.SIGBUS)
        opt.zero_grad()
        loss, res = pinn_loss()
        loss.backward()
        allreduce_grads(model, world)
        opt.step()
        if a.fault == "lock" and hit(rank) and step == 2:
            while not os.path.exists(os.path.join(a.work, "lbfgs.ready")):
                time.sleep(0.5)
        rn = res.detach().pow(2).mean().reshape(1)
        dist.all_reduce(rn)
        if step == 2:
            parts = [torch.zeros(n_col) for _ in range(world)]
            dist.all_gather(parts, res.detach().abs().reshape(-1))
            worst = max(float(q.max()) for q in parts)
            print(f"rank {rank} step {step} worst point residual {worst:.4f}", flush=True)
            if a.fault == "exit3" and hit(rank):
                print(f"rank {rank} residual stalled, aborting solver", flush=True)
                os._exit(3)
        print(f"rank {rank} step {step} loss {loss.item():.5f} residual {math.sqrt(rn.item() / world):.5f}", flush=True)

    lb = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=1, line_search_fn=None)

    def closure():
        lb.zero_grad()
        loss, _ = pinn_loss()
        loss.backward()
        allreduce_grads(model, world)
        return loss

    for it in range(a.lbfgs_steps):
        loss = lb.step(closure)
        print(f"rank {rank} lbfgs {it} loss {float(loss.detach()):.5f}", flush=True)
    if rank == 0:
        os.makedirs(os.path.join(a.work, "ckpt"), exist_ok=True)
        torch.save(model.state_dict(), os.path.join(a.work, "ckpt", f"pinn_w{a.width}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
