"""A two-hundred-and-ninety-second hand-run batch: IMAGE COLOURISATION WITH A CONDITIONAL GAN.

A pix2pix-style colouriser trained on synthetic greyscale/colour image pairs in Lab space: every rank reads
its pairs (L channel and ab channels, 16x16) from /tmp/fault292_work/pairs/pairs_R.pt, a small U-Net
generator predicts ab from L, and a PatchGAN discriminator judges (L, ab) patches; both networks are wrapped
in DDP (gloo).  The generator is initialised from ckpt/gen_w8.pt.  Each step takes a discriminator step on
real and generated pairs, then a generator step on L1 plus adversarial loss; the loss is all_reduced for the
log.  The ab targets are quantised into a 6x6 colour-bin table for a palette prior.  At the end the
colourfulness is all_reduced, per-rank ab histograms are all_gathered, and rank 0 saves export/gen.pt.

Faults:
  binidx    - rank N quantises ab with a 7-wide grid: a colour-bin index beyond the 36-entry table (IndexError)
  chroma    - rank N's config gives saturation 0.0: zero chroma, colourfulness 0/0 = NaN, the program's check
  histlen   - rank N computes its ab histogram with 33 bins, the others 32; all_gather sizes differ
  nopairs   - rank N reads its image pairs from pairs/val_split/ which does not exist (FileNotFoundError)
  palette   - rank N's palette name is "Sepia", missing from the palette table (KeyError)
  dchan     - every rank: the discriminator takes 2 input channels, but gets L plus ab = 3 (shape error)
  ckptwidth - rank N initialises the generator from ckpt/gen_w12.pt, saved with base width 12 (size mismatch)
  fidloop   - rank N computes the FID-like statistic with a Python loop over pixels before the step-2 all_reduce
  abort     - rank N sends itself SIGABRT after step 2
  exit2     - rank N prints its own error line about an L channel out of range and calls sys.exit(2)
  none      - control, clean run

What happened (filled in after the runs):
  binidx    - rank N: IndexError index 37 is out of bounds for dimension 0 with size 36 at step 0; peers closed
  chroma    - rank N: FloatingPointError colourfulness is nan (mean chroma 0.0) after 5 steps; peers closed
  histlen   - one rank (not the injected one) aborted: gloo EnforceNotMet 66 vs 64 size mismatch; others reset
  nopairs   - rank N: FileNotFoundError .../pairs/val_split/pairs_N.pt before DDP; peers closed in DDP init
  palette   - rank N: KeyError 'Sepia' at the palette lookup before DDP; spawn/agents stopped the others
  dchan     - every rank: RuntimeError weight [16, 2, 4, 4] expected input to have 2 channels, but got 3
  ckptwidth - rank N: RuntimeError size mismatch for down1.weight [12, 1, 3, 3] vs [8, 1, 3, 3]; peers closed
  fidloop   - rank N looped: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout (exit 124)
  abort     - rank N: SIGABRT after step 2 (spawn ProcessExitedException; bash loop exit 134); peers closed
  exit2     - rank N printed its ERROR line and exited 2 at step 2; peers closed; under torchrun a peer aborted
  none      - clean, exit 0, rank 0 saved the generator to export/gen.pt
"""
import argparse
import logging
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

WORK = "/tmp/fault292_work"
GRID = 6
PALETTES = {"natural": (1.0, 0.0), "vivid": (1.4, 0.05), "sepia": (0.5, 0.2)}


class UNet(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.down1 = nn.Conv2d(1, width, 3, padding=1)
        self.down2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(2 * width, width, 4, stride=2, padding=1)
        self.out = nn.Conv2d(2 * width, 2, 3, padding=1)

    def forward(self, L):
        h1 = F.leaky_relu(self.down1(L), 0.2)
        h2 = F.leaky_relu(self.down2(h1), 0.2)
        u = F.relu(self.up(h2))
        return torch.tanh(self.out(torch.cat([u, h1], 1)))


class PatchGAN(nn.Module):
    def __init__(self, in_ch):
        super().__init__()
        self.c1 = nn.Conv2d(in_ch, 16, 4, stride=2, padding=1)
        self.c2 = nn.Conv2d(16, 1, 3, padding=1)

    def forward(self, x):
        return self.c2(F.leaky_relu(self.c1(x), 0.2))


def prepare():
    torch.manual_seed(0)
    os.makedirs(os.path.join(WORK, "pairs"), exist_ok=True)
    os.makedirs(os.path.join(WORK, "ckpt"), exist_ok=True)
    for r in range(8):
        base = torch.rand(64, 3, 4, 4)
        rgb = F.interpolate(base, size=16, mode="bilinear", align_corners=False)
        L = rgb.mean(1, keepdim=True) * 2 - 1
        ab = torch.stack([rgb[:, 0] - rgb[:, 1], rgb[:, 1] - rgb[:, 2]], 1).clamp(-1, 1)
        torch.save({"L": L, "ab": ab}, os.path.join(WORK, "pairs", f"pairs_{r}.pt"))
    for w in (8, 12):
        torch.save(UNet(w).state_dict(), os.path.join(WORK, "ckpt", f"gen_w{w}.pt"))


def get_logger(rank, use_logging):
    if not use_logging:
        return None
    class RankFilter(logging.Filter):
        def filter(self, record):
            record.rank = rank
            return True
    log = logging.getLogger("colourise")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter())
    log.addHandler(h)
    log.setLevel(logging.INFO)
    return log


def train(a):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.rank in (-1, rank)
    logger = get_logger(rank, a.logfmt)

    def say(msg, err=False):
        if logger is None:
            print(msg, file=sys.stderr if err else sys.stdout, flush=True)
        elif err:
            logger.error(msg)
        else:
            logger.info(msg)

    torch.manual_seed(292 + rank)
    split = "val_split" if (a.fault == "nopairs" and bad) else ""
    data = torch.load(os.path.join(WORK, "pairs", split, f"pairs_{rank}.pt"))
    L, ab = data["L"], data["ab"]
    saturation = 0.0 if (a.fault == "chroma" and bad) else 1.0
    ab = ab * saturation
    palette = "Sepia" if (a.fault == "palette" and bad) else a.palette
    gain, shift = PALETTES[palette]
    say(f"rank {rank}: loaded {len(L)} Lab pairs, palette {palette}, saturation {saturation}")

    width = 12 if (a.fault == "ckptwidth" and bad) else 8
    gen = UNet(8)
    gen.load_state_dict(torch.load(os.path.join(WORK, "ckpt", f"gen_w{width}.pt")))
    disc = PatchGAN(2 if a.fault == "dchan" else 3)
    G, D = DDP(gen), DDP(disc)
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-3, betas=(0.5, 0.999))

    grid = GRID + 1 if (a.fault == "binidx" and bad) else GRID
    ab_table = torch.stack(torch.meshgrid(torch.linspace(-1, 1, GRID), torch.linspace(-1, 1, GRID),
                                          indexing="ij"), -1).reshape(-1, 2)
    for step in range(a.steps):
        idx = torch.randint(0, len(L), (8,))
        l, real = L[idx], ab[idx] * gain + shift
        q = ((real + 1) / 2 * (grid - 1)).round().long()
        bins = q[:, 0] * grid + q[:, 1]
        prior = ab_table[bins.flatten()].reshape(8, 16, 16, 2).permute(0, 3, 1, 2)
        if step == 2 and a.fault == "exit2" and bad:
            say(f"ERROR rank {rank}: image pair {int(idx[0])} has L channel out of range [0, 100] (got 255.0); "
                f"refusing to train on unnormalised pairs", err=True)
            sys.exit(2)
        fake = G(l)
        d_out = D(torch.cat([torch.cat([l, real], 1), torch.cat([l, fake.detach()], 1)]))
        d_real, d_fake = d_out[:8], d_out[8:]
        loss_d = (F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real))
                  + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake))) / 2
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        g_adv = D(torch.cat([l, fake], 1))
        loss_g = (F.binary_cross_entropy_with_logits(g_adv, torch.ones_like(g_adv))
                  + 100 * F.l1_loss(fake, real) + 0.1 * F.l1_loss(fake, prior))
        opt_g.zero_grad()
        opt_d.zero_grad()
        loss_g.backward()
        opt_g.step()
        if step == 2 and a.fault == "fidloop" and bad:
            say(f"rank {rank}: computing FID-like statistic over {len(L) * 256} validation pixels")
            acc, t_end = 0.0, time.time() + a.stall
            while time.time() < t_end:
                for px in L.flatten().tolist():
                    acc += (px - 0.5) ** 2
        t = torch.tensor([loss_g.item(), loss_d.item()])
        dist.all_reduce(t)
        say(f"rank {rank} step {step} loss {t[0].item() / world:.4f} loss_d {t[1].item() / world:.4f}")
        if step == 2 and a.fault == "abort" and bad:
            os.kill(os.getpid(), signal.SIGABRT)

    with torch.no_grad():
        pred = G(L)
        chroma = pred.pow(2).sum(1).sqrt() * saturation
        colourful = (chroma.std() / chroma.mean()).item()
        if not math.isfinite(colourful):
            raise FloatingPointError(f"rank {rank}: colourfulness is {colourful} (mean chroma {chroma.mean().item()})")
        c = torch.tensor([colourful])
        dist.all_reduce(c)
        nbins = 33 if (a.fault == "histlen" and bad) else 32
        hist = torch.histc(pred[:, 0], bins=nbins, min=-1, max=1)
        hists = [torch.zeros(nbins) for _ in range(world)]
        dist.all_gather(hists, hist)
    say(f"rank {rank}: colourfulness {colourful:.4f} mean {c.item() / world:.4f}")
    if rank == 0:
        os.makedirs(os.path.join(WORK, "export"), exist_ok=True)
        torch.save({"gen": gen.state_dict(), "hist": torch.stack(hists)}, os.path.join(WORK, "export", "gen.pt"))
        say(f"rank 0: done, {a.steps} steps; saved generator to {WORK}/export/gen.pt")
    dist.destroy_process_group()


def spawn_worker(local_rank, a, nprocs):
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(local_rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    train(a)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--palette", default="natural")
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--prepare", type=int, default=0)
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_worker, args=(a, a.spawn), nprocs=a.spawn)
    else:
        train(a)
