"""A three-hundredth hand-run batch: LEARNED IMAGE COMPRESSION WITH A HYPERPRIOR AUTOENCODER.

Synthetic 32x32 RGB images (smooth gradients plus blobs) are written once by --prepare under
/tmp/fault300_work: images/shard_R.pt per rank (64 images and a quality tag), ckpt/hyper_m12.pt (12 latent
channels), ckpt/hyper_m16.pt (16 latent channels) and ckpt/codec_full.pt (a pickled CodecConfig object).  Every
rank looks up its rate-distortion lambda in a 6-entry quality table, and trains a small Balle-style hyperprior
codec: analysis transform g_a (two stride-2 convs), hyper analysis h_a, hyper synthesis h_s predicting the
Gaussian scales of the latents, synthesis g_s (two transposed convs); loss = lambda * 255^2 * MSE + bpp, with
uniform noise as the quantisation proxy.  DDP over gloo (--ddp 0 all_reduces the gradients by hand).  Loss and
PSNR are all_reduced every step (`rank R step S loss L psnr P`), per-image bpp of an eval batch is all_gathered
at the end, rank 0 saves export/codec.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port),
--logfmt 1 (progress and errors through logging).

Faults:
  lambdakey  - rank N's shard is tagged quality "q8", missing from the 6-entry lambda table (KeyError, start-up)
  noimages   - rank N reads images/shard_N_2x.pt (the upscaled shard), which was never written (FileNotFoundError)
  ckptchan   - rank N initialises from ckpt/hyper_m16.pt, saved with 16 latent channels (size mismatch)
  ckptpickle - rank N loads ckpt/codec_full.pt, a pickled CodecConfig object, with torch.load's weights_only default
  bppgather  - rank N all_gathers the bpp of its eval batch with the partial last batch (7 images instead of 8)
  entropy    - rank N estimates its real bitstream length with a pure-Python range coder before the step-2 all_reduce
  nanscale   - rank N's scale bound is lost at step 3: scales 0, likelihoods 0, rate inf; the program's own check
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit2      - rank N prints its own error line (decoder desync on an eval image) and calls sys.exit(2) at the end
  patchsize  - every rank: crops are 30x30, the synthesis transform returns 32x32 (shape error at the first step)
  quantidx   - rank N indexes the 64-entry CDF table with offset 64 instead of 32 at step 4 (IndexError)
  none       - control, clean run

What happened (filled in after the runs):
  lambdakey  - KeyError: 'q8' at LAMBDAS[quality] at start-up; peers Connection closed by peer in the first all_gather (np4 r2 ranklabel, np3 r0 logfmt)
  noimages   - FileNotFoundError for images/shard_N_2x.pt at start-up; peers closed (np5 r3 mpitag); spawn ProcessRaisedException (np3 r1 spawn)
  ckptchan   - load_state_dict size mismatch g_a.2.weight [16,8,5,5] vs [12,8,5,5] and 5 more (np4 r1 pdsh2, worker-1 agent RendezvousConnectionError; np3 r2 legacy)
  ckptpickle - _pickle.UnpicklingError 'Weights only load failed' (GLOBAL __main__.CodecConfig) (np4 r0 tee; np5 r4 srunlabel, peers closed in DDP init)
  bppgather  - after step 5 rank N: 'allgather: invalid tensor size at index 0 (expected (7), got (8))'; peers closed (np3 r1 bashloop, np4 r3 files)
  entropy    - 12 s: peers 'Timed out waiting 12000ms for recv' in the step-2 all_reduce (np3 r2 srunlabel); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r1 ranklabel)
  nanscale   - the program's check: 'non-finite rate at step 3: bpp inf ... (283 zero likelihoods)', FloatingPointError (np4 r2 logfmt, np3 r0 mpitag --ddp 0)
  sigsegv    - after step 3: bash 'Segmentation fault' line, exit 139 (np4 r3 bashloop); ProcessExitedException 'process 1 terminated with signal SIGSEGV' (np3 r1 spawn)
  exit2      - rank 2's ERROR line (range decoder desync) and exit 2 before the final all_gather; Root Cause rank 2 exitcode 2, torchrun exit 1 (np5 r2 tee)
  patchsize  - every rank at step 0: 'The size of tensor a (32) must match the size of tensor b (30) at non-singleton dimension 3'; Root Cause rank 1 (np3 legacy)
  quantidx   - step 4: 'IndexError: index 65 is out of bounds for dimension 0 with size 64'; peers closed in the step all_reduce (np4 r1 srunlabel)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/codec.pt, exit 0 (np3 bashloop)
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
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault300_work"
LAMBDAS = {"q1": 0.0018, "q2": 0.0035, "q3": 0.0067, "q4": 0.0130, "q5": 0.0250, "q6": 0.0483}
NSYM = 64
log = None


class CodecConfig:
    def __init__(self, m, n, lmbda):
        self.m, self.n, self.lmbda = m, n, lmbda


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    log = logging.getLogger("codec")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class Hyperprior(nn.Module):
    def __init__(self, n=8, m=12):
        super().__init__()
        self.g_a = nn.Sequential(nn.Conv2d(3, n, 5, 2, 2), nn.ReLU(), nn.Conv2d(n, m, 5, 2, 2))
        self.h_a = nn.Sequential(nn.Conv2d(m, n, 3, 1, 1), nn.ReLU(), nn.Conv2d(n, n, 3, 2, 1))
        self.h_s = nn.Sequential(nn.ConvTranspose2d(n, n, 4, 2, 1), nn.ReLU(), nn.Conv2d(n, m, 3, 1, 1))
        self.g_s = nn.Sequential(nn.ConvTranspose2d(m, n, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(n, 3, 4, 2, 1))
        self.z_scale = nn.Parameter(torch.ones(n, 1, 1))

    def forward(self, x, bound=0.11):
        y = self.g_a(x)
        z = self.h_a(y.abs())
        z_hat = z + torch.empty_like(z).uniform_(-0.5, 0.5)
        if bound is not None:
            scales = F.softplus(self.h_s(z_hat)).clamp(min=bound)
        else:
            scales = F.relu(self.h_s(z_hat))
        y_hat = y + torch.empty_like(y).uniform_(-0.5, 0.5)
        x_hat = self.g_s(y_hat)
        return x_hat, y_hat, gaussian_likelihood(y_hat, scales), laplace_likelihood(z_hat, self.z_scale)


def gaussian_likelihood(v, scale):
    n = torch.distributions.Normal(0.0, 1.0)
    return n.cdf((v + 0.5) / scale) - n.cdf((v - 0.5) / scale)


def laplace_likelihood(v, b):
    b = F.softplus(b) + 1e-3
    up = 0.5 - 0.5 * torch.sign(v + 0.5) * torch.expm1(-(v + 0.5).abs() / b)
    lo = 0.5 - 0.5 * torch.sign(v - 0.5) * torch.expm1(-(v - 0.5).abs() / b)
    return (up - lo).clamp(min=1e-9)


def make_images(n, seed, size=32):
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    imgs = []
    for _ in range(n):
        c = torch.rand(3, 3, generator=g)
        img = c[:, 0, None, None] + c[:, 1, None, None] * xx + c[:, 2, None, None] * yy
        for _ in range(3):
            cx, cy, r = torch.rand(3, generator=g)
            img = img + 0.4 * torch.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (0.02 + 0.05 * r))
        imgs.append((img / img.amax()).clamp(0, 1))
    return torch.stack(imgs)


def prepare():
    os.makedirs(f"{WORK}/images", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save({"images": make_images(64, 300 + r), "quality": f"q{3 + r % 3}"}, f"{WORK}/images/shard_{r}.pt")
    torch.manual_seed(0)
    torch.save(Hyperprior(8, 12).state_dict(), f"{WORK}/ckpt/hyper_m12.pt")
    torch.save(Hyperprior(8, 16).state_dict(), f"{WORK}/ckpt/hyper_m16.pt")
    torch.save({"config": CodecConfig(12, 8, 0.013), "state": Hyperprior(8, 12).state_dict()},
               f"{WORK}/ckpt/codec_full.pt")
    print("prepared", WORK)


def range_code_length(y_hat, scales):
    """Pure-Python range coder estimate of the real bitstream length (slow by design)."""
    low, rng, nbytes = 0, 0xFFFFFFFF, 0
    for v, s in zip(torch.round(y_hat).flatten().tolist(), scales.flatten().tolist()):
        p = max(1e-9, 0.5 * (math.erf((v + 0.5) / (s * 2 ** 0.5)) - math.erf((v - 0.5) / (s * 2 ** 0.5))))
        rng = max(1, int(rng * p))
        while rng < (1 << 24):
            low, rng, nbytes = (low << 8) & 0xFFFFFFFF, rng << 8, nbytes + 1
    return nbytes


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(300 + rank)
    say(f"rank {rank}/{world} up, loading image shard")
    suffix = "_2x" if bad and a.fault == "noimages" else ""
    shard = torch.load(f"{WORK}/images/shard_{rank}{suffix}.pt")
    imgs = shard["images"]
    quality = "q8" if bad and a.fault == "lambdakey" else shard["quality"]
    lmbda = LAMBDAS[quality]
    if a.fault == "patchsize":
        imgs = imgs[:, :, 1:31, 1:31]
    mean_px = imgs.mean(dim=(0, 2, 3))
    allm = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(allm, mean_px)
    say(f"rank {rank} images {imgs.shape[0]} quality {quality} lambda {lmbda} "
        f"global mean px {torch.stack(allm).mean():.3f}")
    model = Hyperprior()
    ck = "hyper_m16.pt" if bad and a.fault == "ckptchan" else "hyper_m12.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    if bad and a.fault == "ckptpickle":
        meta = torch.load(f"{WORK}/ckpt/codec_full.pt")
        model.load_state_dict(meta["state"])
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    cdf_table = torch.linspace(0, 1, NSYM)
    bs = 8
    for step in range(a.steps):
        x = imgs[(step * bs) % imgs.shape[0]:][:bs]
        bound = None if bad and a.fault == "nanscale" and step == 3 else 0.11
        x_hat, y_hat, y_lik, z_lik = net(x, bound)
        npx = x.shape[0] * x.shape[2] * x.shape[3]
        bpp = (-torch.log2(y_lik).sum() - torch.log2(z_lik).sum()) / npx
        mse = F.mse_loss(x_hat, x)
        loss = lmbda * 255 ** 2 * mse + bpp
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite rate at step {step}: bpp {bpp.item()} mse {mse.item():.5f} "
                f"({int((y_lik == 0).sum())} zero likelihoods)", err=True)
            raise FloatingPointError(f"rank {rank}: rate term is not finite at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        offset = NSYM if bad and a.fault == "quantidx" and step == 4 else NSYM // 2
        sym = torch.round(y_hat.detach()).long().clamp(-NSYM // 2, NSYM // 2 - 1) + offset
        cdf_mass = cdf_table[sym].mean()
        if bad and a.fault == "entropy" and step == 2:
            t0 = time.time()
            nbytes = 0
            while time.time() - t0 < a.code_budget:
                with torch.no_grad():
                    scales = F.softplus(model.h_s(model.h_a(model.g_a(x).abs()))).clamp(min=0.11)
                nbytes += range_code_length(y_hat.detach(), scales)
            say(f"rank {rank} range coder: {nbytes} bytes")
        psnr = (10 * torch.log10(1.0 / mse.detach())).reshape(1)
        stats = torch.cat([loss.detach().reshape(1), psnr])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} psnr {stats[1].item() / world:.2f} "
            f"cdf {cdf_mass.item():.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        ev = imgs[-7:] if bad and a.fault == "bppgather" else imgs[-8:]
        _, _, y_lik, z_lik = model(ev)
        img_bpp = (-torch.log2(y_lik).sum(dim=(1, 2, 3)) - torch.log2(z_lik).sum(dim=(1, 2, 3))) / (32 * 32)
    if bad and a.fault == "exit2":
        say(f"rank {rank}: ERROR decoded latents of eval image 5 differ from the encoder's (range decoder "
            f"desync at symbol 211), refusing to export the codec", err=True)
        sys.exit(2)
    allb = [torch.zeros(8) for _ in range(world)]
    dist.all_gather(allb, img_bpp)
    say(f"rank {rank} eval bpp {img_bpp.mean():.3f} global {torch.stack(allb).mean():.3f}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/codec.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/codec.pt")
    dist.destroy_process_group()


def main_guarded(a, rank, world):
    setup_log(rank, a.logfmt)
    try:
        run(a, rank, world)
    except Exception as e:
        if log is not None:
            say(f"training failed: {type(e).__name__}: {e}", err=True)
        raise


def worker(rank, a):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(a.spawn)
    os.environ["LOCAL_RANK"] = str(rank)
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--code-budget", type=int, default=40)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--prepare", action="store_true")
    a = p.parse_args()
    if a.prepare:
        return prepare()
    if a.spawn:
        mp.spawn(worker, args=(a,), nprocs=a.spawn)
        return
    main_guarded(a, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


if __name__ == "__main__":
    main()
