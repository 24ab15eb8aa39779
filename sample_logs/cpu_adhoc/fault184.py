"""A hundred-and-eighty-fourth hand-run batch: GAUSSIAN-PROCESS AND KERNEL REGRESSION.

Every rank writes its synthetic regression shard (data/gp_shard_rR.npz: 4-dim inputs, a smooth target plus
noise) and reads it back.  The model is an exact GP with an ARD RBF kernel: log length-scales (one per input
dim), a log output scale and a log noise variance.  The loss is the negative log marginal likelihood of the
local shard (torch.linalg.cholesky, cholesky_solve, logdet from the Cholesky diagonal) plus a log-normal prior
on the length-scales.  The hyperparameters are shared: gradients are averaged by DDP on gloo (or --ddp 0: by a
hand-written all_reduce); the loss is all_reduced for logging.  After training every rank predicts at a few
inducing/test points (a Nystrom mean through torch.linalg.solve on K_uu), the predictive variances are
all_gathered for logging and rank 0 saves the hyperparameters to --save.

Faults:
  notpd     - rank N's shard is loaded without de-duplication and its kernel built with jitter 0 (not PD)
  inddim    - every rank's config builds the inducing points with 5 dims against the 4-dim inputs (cdist)
  neglen    - rank N's config holds the length-scale init with a sign typo (-0.5); the prior gives NaN
  datamiss  - rank N reads its shard from a node-local cache dir that was never synced (FileNotFoundError)
  noisestr  - every rank's config holds the noise variance as the string "0.01" (TypeError)
  slowsolve - rank N falls back to an iterative solve for --busy seconds before the first collective
  varlen    - rank N all_gathers its predictive variances with one extra test point (M+1 against M)
  ckptard   - rank N resumes hyperparameters from a checkpoint with 6 ARD length-scales (size mismatch)
  singular  - rank N's inducing points are all drawn from one seed row (K_uu singular in linalg.solve)
  sigsegv   - rank N gets SIGSEGV (sent to itself) at step 2
  exit5     - rank N prints its own 'predictive variance negative' error line and exits with code 5
  none      - control, clean run

What happened (filled in after the runs):
  notpd     - no run kept: jitter 0 on the 4x-repeated shard still factorised (np4 run exit 0); see README
  inddim    - every rank: RuntimeError The size of tensor a (5) must match the size of tensor b (4) (a / ls)
  neglen    - rank N: FloatingPointError log marginal likelihood is nan at step 0; DETAIL: monitoredBarrier
  datamiss  - rank N: FileNotFoundError data/cache/gp_shard_rN.npz; restart run dies in connectFullMesh
  noisestr  - every rank: TypeError log(): argument 'input' (position 1) must be Tensor, not str
  slowsolve - busy 40 s: peers gloo timeout 12000ms (a peer SIGABRT); busy 1000 s / PG 300 s: timeout 60, exit 124
  varlen    - a receiving rank aborts on gloo EnforceNotMet 'Received data size doesn't match' (SIGABRT)
  ckptard   - rank N: RuntimeError loading state_dict: size mismatch for log_ls [6] vs [4]
  singular  - rank N: torch._C._LinAlgError linalg.solve: the input matrix is singular; peers Connection closed
  sigsegv   - rank N: exitcode -11 (SIGSEGV) at step 2; peers Connection closed/reset by peer
  exit5     - rank N: prints its ERROR predictive variance negative line, exitcode 5
  none      - clean, exit 0, rank 0 saved ckpt/gp_hypers.pt
"""
import argparse
import math
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
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--n", type=int, default=48)
    p.add_argument("--dim", type=int, default=4)
    p.add_argument("--m", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--busy", type=float, default=40.0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--resume", default="")
    p.add_argument("--save", default="/tmp/fault184_work/ckpt/gp_hypers.pt")
    return p.parse_args()


class ExactGP(nn.Module):
    def __init__(self, dim, ls_init=0.5, sf_init=1.0, sn_init=0.01):
        super().__init__()
        self.log_ls = nn.Parameter(torch.full((dim,), math.log(abs(ls_init))))
        self.log_sf = nn.Parameter(torch.tensor(math.log(sf_init)))
        self.log_sn = nn.Parameter(torch.log(torch.tensor(sn_init)) if not isinstance(sn_init, str)
                                   else torch.log(sn_init))
        self.raw_ls = ls_init < 0  # a sign typo keeps the config value as-is (no exp)

    def lengthscale(self):
        return self.log_ls.clone() if self.raw_ls else self.log_ls.exp()

    def kernel(self, a, b):
        ls = self.lengthscale()
        d = torch.cdist(a / ls, b / ls)
        return self.log_sf.exp() * torch.exp(-0.5 * d ** 2)

    def forward(self, x, y, jitter=1e-4):
        n = x.shape[0]
        k = self.kernel(x, x) + (self.log_sn.exp() + jitter) * torch.eye(n)
        chol = torch.linalg.cholesky(k)
        alpha = torch.cholesky_solve(y[:, None], chol)
        logdet = 2.0 * torch.log(torch.diagonal(chol)).sum()
        nll = 0.5 * (y[:, None] * alpha).sum() + 0.5 * logdet + 0.5 * n * math.log(2 * math.pi)
        prior = (torch.log(self.lengthscale()) ** 2).sum() * 0.5
        return nll / n + prior / n


def make_shard(rank, n, dim):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.rand(n, dim, generator=g) * 2 - 1 + 0.1 * rank
    y = torch.sin(3 * x[:, 0]) + 0.5 * x[:, 1] ** 2 + 0.05 * torch.randn(n, generator=g)
    os.makedirs("data", exist_ok=True)
    np.savez(f"data/gp_shard_r{rank}.npz", x=x.numpy(), y=y.numpy())


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    hit = a.rank in (-1, rank)
    f = a.fault
    make_shard(rank, a.n, a.dim)
    cfg = {"ls_init": 0.5, "sf_init": 1.0, "sn_init": 0.01, "jitter": 1e-4, "m_dim": a.dim, "dedup": True}
    if f == "neglen" and hit:
        cfg["ls_init"] = -0.5
    if f == "noisestr" and hit:
        cfg["sn_init"] = "0.01"
    if f == "inddim" and hit:
        cfg["m_dim"] = a.dim + 1
    if f == "notpd" and hit:
        cfg["jitter"], cfg["sn_init"], cfg["dedup"] = 0.0, 1e-12, False
    shard_dir = "data/cache" if f == "datamiss" and hit else "data"
    z = np.load(os.path.join(shard_dir, f"gp_shard_r{rank}.npz"))
    x, y = torch.from_numpy(z["x"]), torch.from_numpy(z["y"])
    if not cfg["dedup"]:
        x, y = x.repeat(4, 1), y.repeat(4)  # augmented copies kept twice over
    print(f"rank {rank}: shard {tuple(x.shape)} y_mean {y.mean():.4f} jitter {cfg['jitter']}", flush=True)
    model = ExactGP(a.dim, cfg["ls_init"], cfg["sf_init"], cfg["sn_init"])
    if a.resume or (f == "ckptard" and hit):
        path = "/tmp/fault184_work/ckpt/gp_hypers_ard6.pt" if f == "ckptard" and hit else a.resume
        model.load_state_dict(torch.load(path, map_location="cpu"))
        print(f"rank {rank}: resumed hyperparameters from {path}", flush=True)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    for step in range(a.steps):
        if f == "slowsolve" and hit and step == 0:
            print(f"rank {rank}: cholesky unstable, falling back to CG solve (tol 1e-10, 20000 iters)", flush=True)
            t0 = time.time()
            while time.time() - t0 < a.busy:
                time.sleep(0.5)
        if f == "sigsegv" and hit and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        opt.zero_grad()
        loss = net(x, y, cfg["jitter"])
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: log marginal likelihood is {loss.item()} at step {step} "
                                     f"(lengthscale min {model.lengthscale().min().item():.3f})")
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        tot = loss.detach().clone()
        dist.all_reduce(tot)
        print(f"rank {rank} step {step} loss {tot.item() / world:.4f} "
              f"ls {model.lengthscale().mean().item():.3f} noise {model.log_sn.exp().item():.4f}", flush=True)
    # prediction at inducing points drawn from the shard
    g = torch.Generator().manual_seed(7 + rank)
    idx = torch.randperm(x.shape[0], generator=g)[: a.m]
    if f == "singular" and hit:
        idx = idx[:1].repeat(a.m)
    zu = x[idx] if cfg["m_dim"] == a.dim else torch.cat([x[idx], torch.zeros(a.m, 1)], 1)
    with torch.no_grad():
        kuu = model.kernel(zu, zu)
        kux = model.kernel(zu, x)
        w = torch.linalg.solve(kuu, kux @ y[:, None])
        mean = model.kernel(zu, zu) @ w
        var = model.log_sf.exp() - torch.diagonal(kux @ kux.T) / kux.shape[1] + model.log_sn.exp()
    if f == "exit5" and hit:
        print(f"ERROR rank {rank}: predictive variance negative at 3 of {a.m} test points "
              f"(min -0.0132); refusing to log an invalid posterior", flush=True)
        sys.exit(5)
    if f == "varlen" and hit:
        var = torch.cat([var, var[-1:]])
    gathered = [torch.zeros_like(var) for _ in range(world)]
    dist.all_gather(gathered, var.contiguous())
    if rank == 0:
        allv = torch.stack(gathered)
        print(f"rank 0: predictive var mean {allv.mean():.4f} max {allv.max():.4f} "
              f"mean-pred rms {mean.pow(2).mean().sqrt():.4f}", flush=True)
        os.makedirs(os.path.dirname(a.save), exist_ok=True)
        torch.save(model.state_dict(), a.save)
        print(f"rank 0: saved {a.save}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
