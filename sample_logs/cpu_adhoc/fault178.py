"""A hundred-and-seventy-eighth hand-run batch: VECTOR-QUANTIZED AUTOENCODERS.

Every rank writes its synthetic data (data/x_rR.npy: 16-dim points around a few rank-shifted centres) and reads
it back; rank 0 writes the codebook init (codebook/init_K16_D8.npy) that every rank loads.  The model is a small
VQ-VAE: an MLP encoder to an 8-dim latent, a codebook of K embeddings with nearest-neighbour lookup (cdist +
argmin + embedding) and a straight-through estimator, an MLP decoder; the loss is MSE reconstruction plus a
commitment loss (weight beta).  The codebook is updated by EMA: the per-code counts and sums are all_reduced
across ranks, Laplace-smoothed and divided.  Training runs under DDP on gloo (or --ddp 0: gradients all-reduced
by hand); each step the loss and the code counts are all_reduced for the codebook perplexity; rank 0 saves --save.

Faults:
  embdim      - every rank's config gives the codebook 12 dims against the 8-dim latent (cdist fails)
  codeidx     - rank N's code ids are exported 1-based and used for the lookup (index K out of range)
  deadcode    - rank N's EMA drops the Laplace smoothing (eps 0); dead codes give 0/0, the codebook check raises
  cbmissing   - rank N reads the codebook init from a node-local cache that was never synced (FileNotFoundError)
  ckptk       - rank N resumes a checkpoint saved with a 32-code codebook into the 16-code model (size mismatch)
  emalen      - rank N all_reduces its EMA counts with an extra 'unused' slot (K+1 against K)
  commitstr   - every rank's config holds the commitment weight as the string "0.25" (TypeError)
  perplexzero - rank N computes its local usage with a count threshold above the batch size (ZeroDivisionError)
  sigkill     - rank N gets SIGKILL (sent to itself) at step 2
  collapse    - rank N prints its own 'codebook collapse' error line and exits with code 4
  kmeans      - rank N re-runs a k-means codebook init for --busy seconds before the first collective
  none        - control, clean run

What happened (filled in after the runs):
  embdim      - every rank: RuntimeError X1 and X2 must have the same number of columns. X1: 8 X2: 12 (cdist)
  codeidx     - rank N: IndexError: index out of range in self (F.embedding); peers Connection closed by peer
  deadcode    - rank N: FloatingPointError codebook non-finite at step 0 (13 of 16 codes with zero cluster size)
  cbmissing   - rank N: FileNotFoundError .../local_cache/init_K16_D8.npy; restart run dies in connectFullMesh
  ckptk       - rank N: RuntimeError loading state_dict: size mismatch for codebook [32, 8] vs [16, 8]
  emalen      - rank 0 aborts on gloo EnforceNotMet 'Received data size doesn't match' (SIGABRT); see README
  commitstr   - every rank: TypeError only integer tensors of a single element can be converted to an index
  perplexzero - rank N: ZeroDivisionError: division by zero at step 0; peers Connection closed by peer
  sigkill     - rank N: exitcode -9 (SIGKILL) at step 2; peers Connection closed/reset by peer
  collapse    - rank N: prints its ERROR codebook collapse line at step 1, exitcode 4
  kmeans      - busy 40 s: peers gloo timeout 12000ms; busy 1000 s / PG 300 s: killed by timeout 60, exit 124
  none        - clean, exit 0, rank 0 saved ckpt/vqvae.pt
"""
import argparse
import json
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--codes", type=int, default=16)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--decay", type=float, default=0.9)
    p.add_argument("--busy", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--workdir", default="/tmp/fault178_work")
    p.add_argument("--save", default="ckpt/vqvae.pt")
    p.add_argument("--resume", default="")
    return p.parse_args()


class VQVAE(nn.Module):
    def __init__(self, din, dim, codes):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(din, 32), nn.ReLU(), nn.Linear(32, dim))
        self.dec = nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, din))
        self.register_buffer("codebook", torch.zeros(codes, dim))
        self.register_buffer("cluster_size", torch.zeros(codes))
        self.register_buffer("embed_sum", torch.zeros(codes, dim))

    def forward(self, x, one_based=False):
        z = self.enc(x)
        idx = torch.cdist(z, self.codebook).argmin(1)
        if one_based:
            idx = idx + 1
        q = F.embedding(idx, self.codebook)
        zq = z + (q - z).detach()
        return self.dec(zq), z, q, idx


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    for d in ("data", "ckpt", "codebook"):
        os.makedirs(os.path.join(a.workdir, d), exist_ok=True)
    cfg = {"codebook_size": a.codes, "code_dim": a.dim, "beta": 0.25, "ema_decay": a.decay, "ema_eps": 1e-5,
           "usage_min_count": 1}
    if bad and a.fault == "embdim":
        cfg["code_dim"] = 12
    if bad and a.fault == "commitstr":
        cfg["beta"] = "0.25"
    if bad and a.fault == "deadcode":
        cfg["ema_eps"] = 0.0
    if bad and a.fault == "perplexzero":
        cfg["usage_min_count"] = a.batch + 1
    cfg_path = os.path.join(a.workdir, f"vq_r{rank}.json")
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    K, D = cfg["codebook_size"], cfg["code_dim"]
    g = np.random.default_rng(500 + rank)
    centres = np.random.default_rng(7).normal(0, 2, size=(4, 16)) + 0.1 * rank
    x = centres[g.integers(0, 4, size=256)] + g.normal(0, 0.3, size=(256, 16))
    x_path = os.path.join(a.workdir, "data", f"x_r{rank}.npy")
    np.save(x_path, x.astype(np.float32))
    data = torch.from_numpy(np.load(x_path))
    init_path = os.path.join(a.workdir, "codebook", f"init_K{a.codes}_D{a.dim}.npy")
    if rank == 0:
        np.save(init_path, np.random.default_rng(11).normal(0, 1, size=(a.codes, a.dim)).astype(np.float32))
    dist.barrier()
    if bad and a.fault == "kmeans":
        print(f"rank {rank}: codebook usage low in init, re-running k-means init on {len(data)} points", flush=True)
        t0 = time.time()
        while time.time() - t0 < a.busy:
            time.sleep(0.5)
    if bad and a.fault == "cbmissing":
        init_path = os.path.join(a.workdir, "local_cache", os.path.basename(init_path))
    init = torch.from_numpy(np.load(init_path))
    model = VQVAE(16, a.dim, a.codes)
    model.codebook.copy_(init)
    model.codebook = model.codebook if D == a.dim else torch.randn(K, D) * init.std()
    if bad and a.fault == "ckptk":
        a.resume = os.path.join(a.workdir, "ckpt/vqvae_k32.pt")
    if a.resume:
        model.load_state_dict(torch.load(a.resume, map_location="cpu"))
        print(f"rank {rank} resumed from {a.resume}", flush=True)
    net = DDP(model, broadcast_buffers=False) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    print(f"rank {rank}/{world} vq-vae codes={K} dim={D} beta={cfg['beta']} samples={len(data)}", flush=True)
    gen = torch.Generator().manual_seed(rank)
    for step in range(a.steps):
        xb = data[torch.randperm(len(data), generator=gen)[:a.batch]]
        recon, z, q, idx = net(xb, one_based=bad and a.fault == "codeidx")
        commit = F.mse_loss(z, q)
        loss = F.mse_loss(recon, xb) + cfg["beta"] * commit
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "sigkill" and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        with torch.no_grad():
            onehot = F.one_hot(idx, K).float()
            counts = onehot.sum(0)
            sums = onehot.t() @ z.detach()
            if bad and a.fault == "emalen":
                counts = torch.cat([counts, torch.zeros(1)])
            dist.all_reduce(counts)
            dist.all_reduce(sums)
            decay, eps = cfg["ema_decay"], cfg["ema_eps"]
            model.cluster_size.mul_(decay).add_(counts[:K], alpha=1 - decay)
            model.embed_sum.mul_(decay).add_(sums, alpha=1 - decay)
            n = model.cluster_size.sum()
            smoothed = (model.cluster_size + eps) / (n + K * eps) * n
            model.codebook.copy_(model.embed_sum / smoothed.unsqueeze(1))
            if not torch.isfinite(model.codebook).all():
                dead = int((model.cluster_size == 0).sum())
                raise FloatingPointError(f"codebook has non-finite entries after EMA update at step {step} on rank {rank} "
                                         f"({dead} of {K} codes with zero cluster size)")
            local = [int(c) for c in onehot.sum(0).tolist() if c >= cfg["usage_min_count"]]
            total = sum(local)
            local_used = len(local) / total * len(xb)
            p = counts[:K] / counts[:K].sum()
            perplexity = float(torch.exp(-(p * torch.log(p + 1e-10)).sum()))
            stats = torch.tensor([loss.item(), commit.item()])
            dist.all_reduce(stats)
        if bad and a.fault == "collapse" and step == 1:
            print(f"ERROR rank {rank}: codebook collapse: only 1 of {K} codes used by the last {a.batch} samples "
                  f"(perplexity {perplexity:.2f}); refusing to continue, restart from a k-means init", flush=True)
            sys.exit(4)
        print(f"rank {rank} step {step} loss {loss.item():.4f} mean_loss {stats[0] / world:.4f} commit {stats[1] / world:.4f} "
              f"perplexity {perplexity:.2f} local_usage {local_used:.2f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(a.workdir, a.save))
        print(f"saved {a.save}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
