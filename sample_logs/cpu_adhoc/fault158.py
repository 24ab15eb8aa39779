"""A hundred-and-fifty-eighth hand-run batch: NORMALIZING FLOWS AND LOG-DETERMINANTS.

A small RealNVP-style flow (affine coupling layers with alternating binary masks, the scale clamped by tanh)
over 8-D synthetic data (a correlated Gaussian mixture) trained by maximum likelihood with DDP on gloo (or
--ddp 0: gradients all-reduced by hand).  The log-det Jacobian is summed per batch, every --sample-every steps
the inverse pass draws samples (saved per rank), and bits-per-dim is all_reduced for the progress line.
Can resume from --resume (a state_dict saved by rank 0 at the end).

Faults:
  maskones   - rank N's coupling masks are all ones: log-det 0 and the inverse pass divides by 0 (inf); check raises
  invshape   - every rank: the inverse pass views its output with the wrong width (RuntimeError in view)
  neglogdet  - rank N takes log of a negative determinant at step 2 (NaN); the program's likelihood check raises
  basescale  - every rank builds the base Normal with scale 0 (ValueError from distributions argument validation)
  layersenv  - FLOW_LAYERS is 6 instead of 4 on rank N (DDP finds mismatched parameters across ranks)
  bpdgather  - rank N all_reduces a bits-per-dim vector with one extra element (gloo size mismatch)
  writerwait - rank N waits for a "sample writer" event before the step-3 all_reduce; the others time out
  ckptrename - resume on every rank with the coupling list renamed to "layers": missing/unexpected keys
  samplesdir - rank N writes samples into a folder that does not exist (FileNotFoundError)
  notinv     - rank N prints an error 'flow not invertible' line and sys.exit(1) at step 3
  sigterm    - rank N sends itself SIGTERM after step 2
  none       - control, clean run

What happened (filled in after the runs):
  maskones   - rank N FloatingPointError 'inverse pass produced 128 non-finite sample values at step 2'; Root Cause rank N
  invshape   - every rank RuntimeError shape '[16, 10]' is invalid in view at step 2's sampling; Root Cause rank 0
  neglogdet  - rank N RuntimeError 'non-finite log-likelihood at step 2: loss=nan'; Root Cause rank N exitcode 1
  basescale  - every rank ValueError from Normal(..., scale 0) argument validation before step 0; Root Cause rank 0
  layersenv  - every rank RuntimeError 'DDP expects same model ... rank N has inconsistent 48 params'; Root Cause rank 0
  bpdgather  - DETAIL: every rank 'Detected mismatch between collectives' (rank N TensorShape=[2]); plain: no size error, ranks 1/2 'Timed out waiting 12000ms', wrong bpd on rank 1
  writerwait - pg 12 s: ranks 0/2 'Timed out waiting 12000ms', rank 1 SIGTERM; pg 300 s under timeout 60: hung after step 2, exit 124
  ckptrename - every rank RuntimeError 'Error(s) in loading state_dict for Flow' (missing layers.*, unexpected couplings.*); only in per-rank stderr.log
  samplesdir - rank N RuntimeError 'Parent directory /tmp/job_work/samples_rN does not exist.' from torch.save at step 2 (not FileNotFoundError)
  notinv     - rank N prints 'ERROR rank N: flow not invertible ...' and exits 1 (no traceback); peers SIGTERM / exit 1
  sigterm    - rank N killed by its own SIGTERM after step 2 ('failed (exitcode: -15) local_rank: N'); peers Connection reset by peer
  none       - all ranks ran 6 steps, rank 0 saved flow.pt
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
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--dim", type=int, default=8)
p.add_argument("--hidden", type=int, default=32)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--sample-every", type=int, default=3)
p.add_argument("--pg-timeout", type=float, default=12)
p.add_argument("--out-dir", default="/tmp/fault158_work")
p.add_argument("--resume", default="")
a = p.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
rank, world = dist.get_rank(), dist.get_world_size()
bad = a.rank == -1 or a.rank == rank
F = a.fault if bad else "none"
torch.manual_seed(1234)
D = a.dim


class Coupling(nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.mask = mask  # plain tensor (not a buffer)
        self.s = nn.Sequential(nn.Linear(D, a.hidden), nn.ReLU(), nn.Linear(a.hidden, D))
        self.t = nn.Sequential(nn.Linear(D, a.hidden), nn.ReLU(), nn.Linear(a.hidden, D))
        self.sign = 1.0

    def forward(self, x):
        xm = x * self.mask
        s = torch.tanh(self.s(xm)) * (1 - self.mask)
        t = self.t(xm) * (1 - self.mask)
        z = xm + (1 - self.mask) * (x * torch.exp(s) + t)
        logdet = torch.log(self.sign * torch.exp(s.sum(1)))
        return z, logdet

    def inverse(self, z):
        zm = z * self.mask
        s = torch.tanh(self.s(zm)) * (1 - self.mask)
        t = self.t(zm) * (1 - self.mask)
        active = (1 - self.mask).sum() / (D // 2)
        return zm + (1 - self.mask) * (z - t) * torch.exp(-s) / active


class Flow(nn.Module):
    def __init__(self, n_layers):
        super().__init__()
        masks = [torch.tensor([(i + k) % 2 for i in range(D)], dtype=torch.float32) for k in range(n_layers)]
        if F == "maskones":
            masks = [torch.ones(D) for _ in range(n_layers)]
        mods = nn.ModuleList(Coupling(m) for m in masks)
        if F == "ckptrename":
            self.layers = mods
        else:
            self.couplings = mods

    def blocks(self):
        return self.layers if hasattr(self, "layers") else self.couplings

    def forward(self, x):
        ld = torch.zeros(x.shape[0])
        for c in self.blocks():
            x, l = c(x)
            ld = ld + l
        return x, ld

    def inverse(self, z):
        for c in reversed(self.blocks()):
            z = c.inverse(z)
        if F == "invshape":
            z = z.view(z.shape[0], D + 2)
        return z


n_layers = int(os.environ.get("FLOW_LAYERS", "6" if F == "layersenv" else "4"))
flow = Flow(n_layers)
if a.resume:
    sd = torch.load(a.resume, map_location="cpu")
    flow.load_state_dict(sd)
    print(f"rank {rank} resumed flow from {a.resume}", flush=True)
model = DDP(flow) if a.ddp else flow
if not a.ddp:
    for prm in flow.parameters():
        dist.broadcast(prm.data, 0)
base_scale = torch.zeros(D) if F == "basescale" else torch.ones(D)
base = torch.distributions.Normal(torch.zeros(D), base_scale, validate_args=True)
opt = torch.optim.Adam(flow.parameters(), lr=1e-3)
print(f"rank {rank}/{world} flow: {n_layers} affine couplings, dim {D}, {sum(q.numel() for q in flow.parameters())} params", flush=True)

g = torch.Generator().manual_seed(100 + rank)
A = torch.randn(D, D, generator=torch.Generator().manual_seed(7)) * 0.5
samples_dir = os.path.join(a.out_dir, "samples" if F != "samplesdir" else "samples_r%d" % rank)
os.makedirs(os.path.join(a.out_dir, "samples"), exist_ok=True)

for step in range(a.steps):
    x = torch.randn(64, D, generator=g) @ A + torch.sign(torch.randn(64, 1, generator=g)) * 2.0
    if F == "neglogdet" and step == 2:
        flow.blocks()[1].sign = -1.0
    z, logdet = model(x)
    loglik = base.log_prob(z).sum(1) + logdet
    loss = -loglik.mean()
    if not torch.isfinite(loss):
        raise RuntimeError(f"non-finite log-likelihood at step {step}: loss={loss.item()} (log|det J| mean {logdet.mean().item()})")
    opt.zero_grad()
    loss.backward()
    if not a.ddp:
        for prm in flow.parameters():
            dist.all_reduce(prm.grad)
            prm.grad /= world
    opt.step()
    bpd = torch.tensor([loss.item() / (D * math.log(2)) + 8.0])
    if F == "bpdgather" and step == 1:
        bpd = torch.tensor([bpd.item(), float(step)])
    if F == "writerwait" and step == 3:
        print(f"rank {rank} waiting for sample writer to flush step {step}", flush=True)
        while True:
            time.sleep(5)
    dist.all_reduce(bpd)
    print(f"rank {rank} step {step} loss {loss.item():.4f} bpd {bpd[0].item() / world:.4f}", flush=True)
    if F == "sigterm" and step == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    if F == "notinv" and step == 3:
        print(f"ERROR rank {rank}: flow not invertible: coupling 2 scale saturated (tanh=1.0) at step {step}", flush=True)
        sys.exit(1)
    if (step + 1) % a.sample_every == 0:
        with torch.no_grad():
            smp = flow.inverse(base.sample((16,)))
        if not torch.isfinite(smp).all():
            raise FloatingPointError(f"inverse pass produced {int((~torch.isfinite(smp)).sum())} non-finite sample values at step {step}")
        torch.save(smp, os.path.join(samples_dir, f"samples_step{step}_rank{rank}.pt"))
        print(f"rank {rank} wrote 16 samples at step {step} (mean |x| {smp.abs().mean().item():.3f})", flush=True)

dist.barrier()
if rank == 0:
    torch.save(flow.state_dict(), os.path.join(a.out_dir, "flow.pt"))
    print(f"rank 0 saved {a.out_dir}/flow.pt", flush=True)
dist.destroy_process_group()
