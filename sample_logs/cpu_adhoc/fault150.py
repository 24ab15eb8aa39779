"""A hundred-and-fiftieth hand-run batch: VARIATIONAL AUTOENCODERS AND GENERATIVE LOSSES.

A small MLP VAE on synthetic 8x8 blob images: encoder Linear(64,64)-ReLU-Linear(64,2*Z) (mu and log-variance),
reparameterisation z = mu + exp(0.5*logvar)*eps, decoder Linear(Z,64)-ReLU-Linear(64,H*H)-sigmoid. The loss is
BCE reconstruction plus beta*KL with a linear beta warm-up read from a config dict. Wrapped in DDP (or, with
--ddp 0, gradients all_reduced by hand). Per-rank recon/KL terms are all_reduced for logging; every 2 steps each
rank decodes a few samples and writes them to samples/. Prints `rank R step S loss L recon X kl K beta B`.
Rank 0 saves vae_last.pt at the end; the latent size Z comes from the LATENT_DIM environment variable.
Faults:
- logvar: rank N's encoder log-variance is scaled by 1e3 (a stale init gain): exp() overflows; finite check fires.
- decsize: the decoder's output side is cfg img_size - 1 on every rank: recon and input sizes differ in the loss.
- betakey: the beta schedule reads cfg["beta_warmup_step"] (misspelled key) on every rank: KeyError.
- latent: rank N reads LATENT_DIM=6 from a stale env override; the others use 4 (shape mismatch across ranks).
- samples: rank N writes its decoded samples to samples_rankN/ which was never created (torch.save fails).
- waitlock: rank N waits for a samples/.lock file before sampling at step 2 that nobody writes; others time out.
- ckpt: every rank resumes from vae_last.pt written by a LATENT_DIM=6 run: size mismatch in load_state_dict.
- bce: rank N's targets are normalised to [-1, 1] instead of [0, 1]: binary_cross_entropy rejects them.
- klcollapse: rank N reads kl_floor 50.0 from its config; it logs a "KL collapsed" error and sys.exit(1).
- sigbus: rank N is killed by SIGBUS at step 2 while filling its sample buffer.
What happened (filled in after the runs):
- logvar: rank N FloatingPointError 'non-finite loss terms ... kl inf' at step 0 (line 139); peers closed.
- decsize: every rank ValueError 'Using a target size ([32, 1, 8, 8]) ... input size ([32, 1, 7, 7])'.
- betakey: every rank KeyError: 'beta_warmup_step' in beta_at at step 0.
- latent: DDP: rank N 'params[2] ... [12, 64] appears not to match'; DETAIL --ddp 0: collectives mismatch.
- samples: rank N RuntimeError 'Parent directory .../samples_rankN does not exist.' after step 0.
- waitlock: PG 12 s: peers 'Timed out waiting 12000ms', rank 0 SIGABRT; PG 300 s: timeout 60, exit 124.
- ckpt: every rank RuntimeError loading state_dict: size mismatch for enc.2.weight [12, 64] vs [8, 64].
- bce: rank N RuntimeError 'all elements of target should be between 0 and 1' at step 0; peers closed.
- klcollapse: rank N logs 'ERROR rank N: KL collapsed ... at step 1, aborting', exit 1; peers closed.
- sigbus: rank N exitcode -7 (SIGBUS) after step 2; with --max-restarts 1 rank 0 SIGABRT, connectFullMesh.
"""
import argparse
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

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--batch", type=int, default=32)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--out", default="/tmp/fault150_work")
a = p.parse_args()

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
torch.set_num_threads(1)


def hit():
    return a.rank == -1 or a.rank == RANK


CFG = {"img_size": 8, "beta_max": 1.0, "beta_warmup_steps": 4, "kl_floor": 1e-4, "lr": 2e-3}


class VAE(nn.Module):
    def __init__(self, z, side):
        super().__init__()
        self.side = side
        self.enc = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2 * z))
        self.dec = nn.Sequential(nn.Linear(z, 64), nn.ReLU(), nn.Linear(64, side * side))
        self.gain = 1e3 if (a.fault == "logvar" and hit()) else 1.0

    def forward(self, x):
        mu, logvar = self.enc(x.flatten(1)).chunk(2, dim=1)
        logvar = logvar * self.gain
        std = torch.exp(0.5 * logvar)
        z = mu + std * torch.randn_like(std)
        recon = torch.sigmoid(self.dec(z)).view(-1, 1, self.side, self.side)
        return recon, mu, logvar, std


def make_batch(g, n):
    yy, xx = torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij")
    c = torch.rand(n, 2, generator=g) * 6 + 1
    img = torch.exp(-((xx - c[:, 0, None, None]) ** 2 + (yy - c[:, 1, None, None]) ** 2) / 3.0)
    if a.fault == "bce" and hit():
        img = img * 2 - 1
    return img.unsqueeze(1)


def beta_at(step):
    key = "beta_warmup_step" if a.fault == "betakey" else "beta_warmup_steps"
    return CFG["beta_max"] * min(1.0, (step + 1) / CFG[key])


def write_samples(model, step):
    if a.fault == "waitlock" and hit() and step == 2:
        while not os.path.exists(os.path.join(a.out, "samples", ".lock")):
            time.sleep(0.5)
    if a.fault == "sigbus" and hit() and step == 2:
        os.kill(os.getpid(), signal.SIGBUS)
    sub = f"samples_rank{RANK}" if (a.fault == "samples" and hit()) else "samples"
    with torch.no_grad():
        z = torch.randn(4, model.dec[0].in_features)
        imgs = torch.sigmoid(model.dec(z))
    torch.save(imgs, os.path.join(a.out, sub, f"step{step}_rank{RANK}.pt"))


def main():
    os.makedirs(os.path.join(a.out, "samples"), exist_ok=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    zdim = int(os.environ.get("LATENT_DIM", "4"))
    if a.fault == "latent" and hit():
        zdim = 6
    side = CFG["img_size"] - 1 if a.fault == "decsize" else CFG["img_size"]
    kl_floor = 50.0 if (a.fault == "klcollapse" and hit()) else CFG["kl_floor"]
    print(f"rank {RANK}/{WORLD} vae training starting: latent {zdim} img {side}x{side} ddp {a.ddp}", flush=True)
    torch.manual_seed(0)
    model = VAE(zdim, side)
    if a.fault == "ckpt":
        model.load_state_dict(torch.load(os.path.join(a.out, "vae_last.pt")))
        print(f"rank {RANK} resumed from vae_last.pt", flush=True)
    if a.ddp:
        net = DDP(model)
    else:
        net = model
        for prm in model.parameters():
            dist.broadcast(prm.data, src=0)
    opt = torch.optim.Adam(net.parameters(), lr=CFG["lr"])
    g = torch.Generator().manual_seed(1000 + RANK)
    for step in range(a.steps):
        x = make_batch(g, a.batch)
        recon, mu, logvar, std = net(x)
        rec = F.binary_cross_entropy(recon, x, reduction="sum") / a.batch
        kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / a.batch
        if not (torch.isfinite(rec) and torch.isfinite(kl)):
            raise FloatingPointError(f"rank {RANK} step {step}: non-finite loss terms recon {rec.item():.4f} kl {kl.item()} (max logvar {logvar.max().item():.1f})")
        beta = beta_at(step)
        loss = rec + beta * kl
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= WORLD
        opt.step()
        if step >= 1 and kl.item() < kl_floor:
            print(f"ERROR rank {RANK}: KL collapsed to {kl.item():.4f} < floor {kl_floor} at step {step}, aborting", file=sys.stderr, flush=True)
            sys.exit(1)
        terms = torch.tensor([rec.item(), kl.item()])
        dist.all_reduce(terms)
        terms /= WORLD
        print(f"rank {RANK} step {step} loss {loss.item():.4f} recon {terms[0]:.4f} kl {terms[1]:.4f} beta {beta:.2f}", flush=True)
        if step % 2 == 0:
            write_samples(model, step)
    dist.barrier()
    if RANK == 0:
        torch.save(model.state_dict(), os.path.join(a.out, "vae_last.pt"))
        print(f"rank 0 saved vae_last.pt (latent {zdim})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
