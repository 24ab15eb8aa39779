"""A three-hundred-and-twenty-ninth hand-run batch: IMAGE SUPER-RESOLUTION GAN (ESRGAN-STYLE).

Synthetic image patches: every rank reads its high-resolution 16x16 RGB patches from
/tmp/fault329_work/hr/hr_R.pt together with a degradation name per patch ("bicubic", "blur3", "blur5",
"noise"), looked up in a degradation table to make the 8x8 low-resolution inputs.  The generator is a tiny
ESRGAN (conv_first, two residual-in-residual dense blocks with residual scaling 0.2, conv_body, a x2
PixelShuffle upsampler, conv_last); the discriminator is a small strided VGG-style net.  Losses: L1 pixel loss
plus a relativistic average GAN loss (weight 5e-3).  Both nets are wrapped in DDP (gloo), or with --ddp 0 their
gradients are all_reduced by hand.  The generator starts from the PSNR-oriented ckpt/gen_psnr.pt.  Per-rank
patch counts are all_gathered at the start, the PSNR is all_reduced every step, per-rank [psnr, l1, n]
statistics are all_gathered at the end, and rank 0 saves export/esrgan_g.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  kernel     - rank N's patch list names degradation "jpeg75", missing from the degradation table (KeyError)
  nohr       - rank N reads its patches from hr/val/ which does not exist (FileNotFoundError)
  ckptmeta   - rank N loads ckpt/gen_meta.pt, saved with its argparse options inside (weights_only refusal)
  patchidx   - rank N's step-2 crop list indexes patch 64 of 64 (IndexError)
  exit2      - rank N prints its own error about a scale mismatch (x4 data, x2 model) and calls sys.exit(2)
  nanpatch   - rank N's step-3 batch holds an overflowed patch (inf): the program's non-finite loss check
  sigsegv    - rank N sends itself SIGSEGV after step 3
  slowval    - rank N computes a pure-Python PSNR table before the step-3 all_reduce (40 s; PG timeout 12 s)
  lockwait   - rank N waits at step 2 for an EMA-ready flag file that nobody writes (a hang)
  pixshuf    - every rank: the upsampler conv gives nf*scale channels instead of nf*scale**2 (conv_last shape error)
  statgather - rank N all_gathers [psnr, l1, n, lpips] at the end, the others [psnr, l1, n] (4 vs 3)
  none       - control, clean run

What happened (filled in after the runs):
  kernel     - KeyError: 'jpeg75' in degrade() at start-up; peers Connection closed in the all_gather (np4 r2 tee, np6 r0 pymodule)
  nohr       - FileNotFoundError hr/val/hr_R.pt at start-up; peers Connection closed (np4 r3 redirects: only in the files; np3 r1 loglevel)
  ckptmeta   - weights_only UnpicklingError (argparse.Namespace) (np4 r1 tee_trainer); np3 r2 restart: attempt 1 dies in Gloo connectFullMesh
  patchidx   - IndexError 'index 64 is out of bounds for dimension 0 with size 64' at step 2; peers Connection closed (np4 r3 pymodule)
  exit2      - rank N's 'ERROR patch pairs are x4 ...' line, exit 2 at start-up (np8 r5 loglevel, np3 r0 prefix)
  nanpatch   - rank 0 l1 inf at step 3; NaN D grads spread by the --ddp 0 all_reduce: every rank FloatingPointError (np4 r0 detail)
  sigsegv    - silent SIGSEGV after step 3, Root Cause exitcode -11 (np4 r2 pdsh2: other agent RendezvousConnectionError; np3 r1 restart)
  slowval    - ranks 0, 1 'Timed out waiting 12000ms for recv' in the step-3 all_reduce; rank 2 SIGTERMed (np3 r2 wrapper)
  lockwait   - rank 1 'waiting for .../sync/ema_ready_1' at step 2, silence, killed by timeout 60, exit 124 (np4 r1 plain)
  pixshuf    - never reached forward: every rank load_state_dict size mismatch up.weight [64,16,3,3] vs [32,16,3,3] (np8 tee_trainer)
  statgather - 'allgather: invalid tensor size at index 0 (expected (4), got (3))' after step 5 (np3 r1 prefix, np6 r4 filter)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/esrgan_g.pt, exit 0 (np3 plain)
"""
import argparse
import logging
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

WORK = "/tmp/fault329_work"
DEGRADE = {"bicubic": (0, 0.0), "blur3": (3, 0.0), "blur5": (5, 0.0), "noise": (0, 0.03)}
NF = 16
GC = 8
NPATCH = 64
BATCH = 8
log = None


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    logging.basicConfig(stream=sys.stdout, level=logging.INFO,
                        format=f"%(asctime)s [rank={rank}] %(levelname)s %(message)s")
    log = logging.getLogger("esrgan")


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class DenseBlock(nn.Module):
    def __init__(self, nf=NF, gc=GC):
        super().__init__()
        self.c1 = nn.Conv2d(nf, gc, 3, 1, 1)
        self.c2 = nn.Conv2d(nf + gc, gc, 3, 1, 1)
        self.c3 = nn.Conv2d(nf + 2 * gc, nf, 3, 1, 1)

    def forward(self, x):
        x1 = F.leaky_relu(self.c1(x), 0.2)
        x2 = F.leaky_relu(self.c2(torch.cat([x, x1], 1)), 0.2)
        return x + 0.2 * self.c3(torch.cat([x, x1, x2], 1))


class RRDB(nn.Module):
    def __init__(self, nf=NF):
        super().__init__()
        self.d1 = DenseBlock(nf)
        self.d2 = DenseBlock(nf)

    def forward(self, x):
        return x + 0.2 * self.d2(self.d1(x))


class Generator(nn.Module):
    def __init__(self, nf=NF, up_ch=None):
        super().__init__()
        self.conv_first = nn.Conv2d(3, nf, 3, 1, 1)
        self.body = nn.Sequential(RRDB(nf), RRDB(nf))
        self.conv_body = nn.Conv2d(nf, nf, 3, 1, 1)
        self.up = nn.Conv2d(nf, up_ch or nf * 4, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, 3, 3, 1, 1)

    def forward(self, x):
        f = self.conv_first(x)
        f = f + self.conv_body(self.body(f))
        f = F.leaky_relu(F.pixel_shuffle(self.up(f), 2), 0.2)
        return self.conv_last(f)


class Discriminator(nn.Module):
    def __init__(self, nf=NF):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, nf, 3, 1, 1), nn.LeakyReLU(0.2), nn.Conv2d(nf, nf, 4, 2, 1),
                                 nn.LeakyReLU(0.2), nn.Conv2d(nf, 2 * nf, 4, 2, 1), nn.LeakyReLU(0.2))
        self.head = nn.Linear(2 * nf * 16, 1)

    def forward(self, x):
        return self.head(self.net(x).flatten(1)).squeeze(1)


def prepare():
    os.makedirs(f"{WORK}/hr", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    names = list(DEGRADE)
    for r in range(8):
        g = torch.Generator().manual_seed(300 + r)
        base = torch.rand(NPATCH, 3, 4, 4, generator=g)
        hr = F.interpolate(base, size=16, mode="bilinear", align_corners=False).clamp(0, 1)
        deg = [names[int(i)] for i in torch.randint(0, 4, (NPATCH,), generator=g)]
        torch.save({"hr": hr, "degradation": deg}, f"{WORK}/hr/hr_{r}.pt")
    torch.manual_seed(0)
    torch.save(Generator().state_dict(), f"{WORK}/ckpt/gen_psnr.pt")
    torch.manual_seed(0)
    opts = argparse.Namespace(scale=2, nf=NF, gc=GC, pretrain="psnr", lr=2e-4)
    torch.save({"state_dict": Generator().state_dict(), "opts": opts}, f"{WORK}/ckpt/gen_meta.pt")
    print("prepared", WORK)


def degrade(hr, names):
    lrs = []
    for k, name in enumerate(names):
        ksize, noise = DEGRADE[name]
        x = hr[k:k + 1]
        if ksize:
            x = F.avg_pool2d(x, ksize, 1, ksize // 2)
        x = F.interpolate(x, scale_factor=0.5, mode="bicubic", align_corners=False)
        if noise:
            x = x + noise * torch.randn_like(x)
        lrs.append(x)
    return torch.cat(lrs).clamp(0, 1)


def psnr_table(sr, hr, budget):
    t0 = time.time()
    rows = 0
    a, b = sr.tolist(), hr.tolist()
    while time.time() - t0 < budget:
        for i in range(len(a)):
            se = sum((a[i][c][y][x] - b[i][c][y][x]) ** 2 for c in range(3) for y in range(16) for x in range(16))
            rows += 1
    return rows


def grads_all_reduce(model, world):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading HR patches")
    split = "val/" if bad and a.fault == "nohr" else ""
    data = torch.load(f"{WORK}/hr/{split}hr_{rank}.pt")
    hr, names = data["hr"], data["degradation"]
    if bad and a.fault == "kernel":
        names[11] = "jpeg75"
    lr = degrade(hr, names)
    if bad and a.fault == "exit2":
        say(f"rank {rank}: ERROR patch pairs are x4 (LR {lr.shape[-1] // 2}x{lr.shape[-1] // 2} for HR 16x16) "
            f"but the generator upsamples x2; refusing to train", err=True)
        sys.exit(2)
    counts = torch.tensor([float(len(names))])
    allc = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} patches {int(counts.item())} global {int(sum(c.item() for c in allc))}")
    G = Generator(up_ch=NF * 2 if a.fault == "pixshuf" else None)
    D = Discriminator()
    if bad and a.fault == "ckptmeta":
        G.load_state_dict(torch.load(f"{WORK}/ckpt/gen_meta.pt")["state_dict"])
    else:
        G.load_state_dict(torch.load(f"{WORK}/ckpt/gen_psnr.pt"))
    if a.ddp:
        g_run, d_run = DDP(G), DDP(D)
    else:
        for p in list(G.parameters()) + list(D.parameters()):
            dist.broadcast(p.data, 0)
        g_run, d_run = G, D
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.9, 0.99))
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.9, 0.99))
    l1_sum = 0.0
    for step in range(a.steps):
        idx = [(step * BATCH + k) % NPATCH for k in range(BATCH)]
        if bad and a.fault == "patchidx" and step == 2:
            idx[-1] = NPATCH
        lr_b, hr_b = lr[idx], hr[idx]
        if bad and a.fault == "nanpatch" and step == 3:
            hr_b = hr_b.clone()
            hr_b[5] = hr_b[5] * 3.4e38 * 10
        if bad and a.fault == "lockwait" and step == 2:
            flag = f"{WORK}/sync/ema_ready_{rank}"
            say(f"rank {rank} waiting for {flag}")
            while not os.path.exists(flag):
                time.sleep(0.5)
        sr = g_run(lr_b)
        D.requires_grad_(True)
        d_out = d_run(torch.cat([hr_b, sr.detach()]))
        d_real, d_fake = d_out[:BATCH], d_out[BATCH:]
        loss_d = (F.binary_cross_entropy_with_logits(d_real - d_fake.mean(), torch.ones_like(d_real))
                  + F.binary_cross_entropy_with_logits(d_fake - d_real.mean(), torch.zeros_like(d_fake))) / 2
        opt_d.zero_grad()
        loss_d.backward()
        if not a.ddp:
            grads_all_reduce(D, world)
        opt_d.step()
        D.requires_grad_(False)
        g_out = D(torch.cat([hr_b, sr]))
        g_real, g_fake = g_out[:BATCH], g_out[BATCH:]
        l1 = F.l1_loss(sr, hr_b)
        adv = (F.binary_cross_entropy_with_logits(g_real - g_fake.mean(), torch.zeros_like(g_real))
               + F.binary_cross_entropy_with_logits(g_fake - g_real.mean(), torch.ones_like(g_fake))) / 2
        loss = l1 + 5e-3 * adv
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite generator loss at step {step} (l1 {l1.item()}, adv {adv.item()}, "
                f"hr max {hr_b.max().item():.3g})", err=True)
            raise FloatingPointError(f"generator loss is {loss.item()} on rank {rank} at step {step}")
        opt_g.zero_grad()
        loss.backward()
        if not a.ddp:
            grads_all_reduce(G, world)
        opt_g.step()
        if bad and a.fault == "slowval" and step == 3:
            rows = psnr_table(sr.detach(), hr_b, a.slow_budget)
            say(f"rank {rank} PSNR table: {rows} rows")
        mse = F.mse_loss(sr.detach().clamp(0, 1), hr_b).clamp_min(1e-10)
        psnr = (10 * torch.log10(1.0 / mse)).reshape(1)
        dist.all_reduce(psnr)
        l1_sum += l1.item()
        say(f"rank {rank} step {step} loss {loss.item():.4f} d_loss {loss_d.item():.4f} "
            f"psnr {psnr.item() / world:.2f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    stats = torch.tensor([psnr.item() / world, l1_sum / a.steps, float(len(names))])
    if bad and a.fault == "statgather":
        stats = torch.cat([stats, torch.tensor([0.21])])
    alls = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(alls, stats)
    say(f"rank {rank} final l1 {stats[1].item():.4f} mean-l1 {sum(s[1].item() for s in alls) / world:.4f}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(G.state_dict(), f"{WORK}/export/esrgan_g.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/esrgan_g.pt")
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
    p.add_argument("--slow-budget", type=int, default=40)
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
