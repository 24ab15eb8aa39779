"""A three-hundred-and-tenth hand-run batch: DENOISING DIFFUSION ON TINY SPRITES.

Synthetic 8x8 sprites stored as palette indices (an 8-colour RGB palette): every rank reads its sprite
sheet from /tmp/fault310_work/sheets/sheet_R.pt (indices plus a small meta dict naming the noise schedule
and its beta range), decodes each batch through the palette, noises it at random timesteps of a DDPM
schedule (T = 50) and trains a tiny conv denoiser (sinusoidal time embedding, two conv blocks, an
epsilon head) on the noise-prediction MSE, wrapped in DDP (gloo) or with gradients all_reduced by hand
(--ddp 0).  The denoiser starts from ckpt/denoiser_c3.pt.  Per-rank sprite counts are all_gathered at the
start, the loss and an x0-reconstruction MAE are all_reduced every step, per-timestep-bucket losses are
all_gathered at the end, and rank 0 saves export/denoiser.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  palette    - rank N's sheet holds colour index 9 in the sprites of step 3's batch: palette has 8 rows (IndexError)
  schedule   - rank N's sheet meta names the schedule "sigmoid", not in the SCHEDULES table (KeyError)
  nosheet    - rank N reads its sheet from sheets/holdout/ which does not exist (FileNotFoundError)
  ckptchan   - rank N initialises from ckpt/denoiser_c4.pt, saved for RGBA sprites (size mismatch)
  ckptema    - rank N loads ckpt/ema_state.pt, pickled with an EmaState object (weights_only refusal)
  bucketgath - rank N all_gathers 11 timestep-bucket losses at the end instead of 10
  slowfid    - rank N computes pixel statistics of its sheet in pure Python before the step-2 all_reduce
  betanan    - rank N's meta has beta_end 1.6: alpha_bar goes negative, sqrt gives NaN, the program's loss check
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit5      - rank N prints its own error line about a sheet checksum and calls sys.exit(5)
  tembwidth  - every rank: the time embedding is built 32 wide, the denoiser's time MLP expects 16 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  palette    - IndexError 'index 9 is out of bounds for dimension 0 with size 8' decoding step 3's batch; peers closed (np4 r2 ranklabel, np3 r0 spawn)
  schedule   - KeyError: 'sigmoid' at start-up; peers closed in the first all_gather (np5 r3 srunlabel, np3 r1 logfmt: Root Cause rank 1)
  nosheet    - FileNotFoundError for sheets/holdout/sheet_1.pt at start-up, stderr-tagged; peers closed (np4 r1 mpitag)
  ckptchan   - size mismatch for c1.weight [24,4,3,3] vs [24,3,3,3] (and out.*); Root Cause rank N (np4 r1 pdsh2, np3 r2 legacy)
  ckptema    - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.EmaState'; Root Cause rank 0 (np3 r0 tee)
  bucketgath - after 6 steps 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (11), got (10))' (np4 r3 bashloop, np5 r1 mpitag --ddp 0)
  slowfid    - 12 s: peers 'Timed out waiting 12000ms for recv', exit 1 (np3 r2 ranklabel); 300 s: rank files stop after step 1, killed at 60 s, exit 124 (np4 r1 files)
  betanan    - 'non-finite loss nan (... min alpha_bar -0.0000)' then FloatingPointError at step 0 (np4 r0 tee, np3 r2 files)
  sigsegv    - no traceback after step 3; bash 'Segmentation fault', exit 139 (np4 r3 srunlabel); ProcessExitedException SIGSEGV (np3 r1 spawn)
  exit5      - rank N's checksum ERROR line and exit 5; Root Cause rank N exitcode 5 (np5 r4 legacy, np3 r1 logfmt)
  tembwidth  - every rank: 'mat1 and mat2 shapes cannot be multiplied (16x32 and 16x24)' in the first forward (np3 bashloop)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/denoiser.pt, exit 0 (np3 bashloop)
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

WORK = "/tmp/fault310_work"
PALETTE = torch.tensor([[0, 0, 0], [1, 1, 1], [1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0], [1, 0, 1], [0.5, 0.5, 0.5]])
T = 50
TEMB = 16
BATCH = 16
NBUCKET = 10
log = None


class EmaState:
    def __init__(self, decay, shadow):
        self.decay = decay
        self.shadow = shadow


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
    log = logging.getLogger("sprites")
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


def linear_betas(lo, hi):
    return torch.linspace(lo, hi, T)


def cosine_betas(lo, hi):
    s = torch.arange(T + 1) / T
    f = torch.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2
    return (1 - f[1:] / f[:-1]).clamp(lo, hi)


SCHEDULES = {"linear": linear_betas, "cosine": cosine_betas}


def time_embedding(t, width):
    half = width // 2
    freqs = torch.exp(-math.log(1000.0) * torch.arange(half) / half)
    ang = t.float()[:, None] * freqs[None]
    return torch.cat([ang.sin(), ang.cos()], dim=1)


class Denoiser(nn.Module):
    def __init__(self, ch=3, hid=24):
        super().__init__()
        self.tmlp = nn.Sequential(nn.Linear(TEMB, hid), nn.SiLU(), nn.Linear(hid, hid))
        self.c1 = nn.Conv2d(ch, hid, 3, padding=1)
        self.c2 = nn.Conv2d(hid, hid, 3, padding=1)
        self.out = nn.Conv2d(hid, ch, 3, padding=1)

    def forward(self, x, temb):
        h = F.silu(self.c1(x)) + self.tmlp(temb)[:, :, None, None]
        h = F.silu(self.c2(h))
        return self.out(h)


def make_sheet(n, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.zeros(n, 8, 8, dtype=torch.long)
    for i in range(n):
        body = torch.randint(1, 8, (1,), generator=g).item()
        w = torch.randint(2, 5, (1,), generator=g).item()
        idx[i, 4 - w // 2 - 1:4 + w // 2 + 1, 2:6] = body
        idx[i, 2, 3] = idx[i, 2, 5] = 1
    return idx


def prepare():
    for d in ("sheets", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        meta = {"schedule": "linear", "beta_start": 1e-4, "beta_end": 0.2, "n": 96}
        torch.save({"idx": make_sheet(96, 300 + r), "meta": meta}, f"{WORK}/sheets/sheet_{r}.pt")
    torch.manual_seed(0)
    torch.save(Denoiser(3).state_dict(), f"{WORK}/ckpt/denoiser_c3.pt")
    torch.save(Denoiser(4).state_dict(), f"{WORK}/ckpt/denoiser_c4.pt")
    torch.save({"ema": EmaState(0.999, Denoiser(3).state_dict())}, f"{WORK}/ckpt/ema_state.pt")
    print("prepared", WORK)


def pixel_stats(idx, budget):
    t0 = time.time()
    hist = [0] * 64
    while time.time() - t0 < budget:
        for s in idx.tolist():
            for row in s:
                for j, v in enumerate(row):
                    hist[(v * 8 + j) % 64] += 1
    return sum(hist)


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4242 + rank)
    say(f"rank {rank}/{world} up, loading sprite sheet")
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR sheet_{rank}.pt checksum 9f3e01c2 != manifest 4b7a10d8, sheet is corrupt; "
            f"refusing to train", err=True)
        sys.exit(5)
    sub = "holdout/" if bad and a.fault == "nosheet" else ""
    sheet = torch.load(f"{WORK}/sheets/{sub}sheet_{rank}.pt")
    idx, meta = sheet["idx"], dict(sheet["meta"])
    if bad and a.fault == "palette":
        idx[3 * BATCH + 5, 2, 4] = 9
    if bad and a.fault == "schedule":
        meta["schedule"] = "sigmoid"
    if bad and a.fault == "betanan":
        meta["beta_end"] = 1.6
    betas = SCHEDULES[meta["schedule"]](meta["beta_start"], meta["beta_end"])
    abar = torch.cumprod(1 - betas, 0)
    cnt = torch.tensor([float(idx.shape[0])])
    allc = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(allc, cnt)
    say(f"rank {rank} sprites {int(cnt.item())} global {int(sum(c.item() for c in allc))} "
        f"schedule {meta['schedule']}")
    model = Denoiser(3)
    if bad and a.fault == "ckptema":
        state = torch.load(f"{WORK}/ckpt/ema_state.pt")["ema"].shadow
    else:
        ck = "denoiser_c4.pt" if bad and a.fault == "ckptchan" else "denoiser_c3.pt"
        state = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(state)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    temb_w = 32 if a.fault == "tembwidth" else TEMB
    bucket_loss = torch.zeros(NBUCKET)
    for step in range(a.steps):
        b = idx[(step * BATCH) % idx.shape[0]:][:BATCH]
        x0 = PALETTE[b].permute(0, 3, 1, 2) * 2 - 1
        t = torch.randint(0, T, (x0.shape[0],))
        eps = torch.randn_like(x0)
        ab = abar[t][:, None, None, None]
        xt = ab.sqrt() * x0 + (1 - ab).sqrt() * eps
        pred = net(xt, time_embedding(t, temb_w))
        per = ((pred - eps) ** 2).mean(dim=(1, 2, 3))
        loss = per.mean()
        if not torch.isfinite(loss):
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} ({int((~torch.isfinite(xt)).sum())} "
                f"non-finite noised pixels, min alpha_bar {abar.min().item():.4f})", err=True)
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        bucket_loss.index_add_(0, t * NBUCKET // T, per.detach())
        if bad and a.fault == "slowfid" and step == 2:
            n = pixel_stats(idx, a.fid_budget)
            say(f"rank {rank} pixel statistics: {n} pixels")
        x0hat = (xt - (1 - ab).sqrt() * pred.detach()) / ab.sqrt()
        stats = torch.stack([loss.detach(), (x0hat - x0).abs().mean()])
        dist.all_reduce(stats)
        stats /= world
        say(f"rank {rank} step {step} loss {stats[0].item():.4f} x0_mae {stats[1].item():.4f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "bucketgath":
        bucket_loss = torch.cat([bucket_loss, bucket_loss[-1:]])
    allb = [torch.zeros(NBUCKET) for _ in range(world)]
    dist.all_gather(allb, bucket_loss)
    say(f"rank {rank} bucket losses gathered, worst bucket {int(torch.stack(allb).sum(0).argmax())}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/denoiser.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/denoiser.pt")
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
    p.add_argument("--fid-budget", type=int, default=30)
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
