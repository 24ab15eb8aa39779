"""A three-hundred-and-seventy-fifth hand-run batch: SOLAR FLARE PREDICTION FROM MAGNETOGRAM PATCHES.

Synthetic SDO/HMI-like line-of-sight magnetogram cut-outs (1x32x32 Bz patches around active regions), each
with a FITS-like header (INSTRUME, CDELT1) and a GOES label (flare >= M1.0 within 24 h).  Every rank reads
its patches from /tmp/fault375_work/patches/harp_R.pt, calibrates Bz by an instrument table, log-scales it,
and trains a small CNN (two conv blocks, a linear head) with a BCE loss, wrapped in DDP (gloo) or, with
--ddp 0, with gradients all_reduced by hand.  The model starts from ckpt/flarenet_c16.pt.  Per-rank flare
counts are all_gathered at start-up, the loss and accuracy are all_reduced every step, a per-rank |Bz|
histogram is all_gathered at the end, and rank 0 saves export/flarenet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  badflux    - rank N's header has CDELT1 = 'n/a' for one patch; float() fails at start-up (ValueError)
  instrument - rank N's batch 1 holds a patch from 'HMI_COMBINED', not in the calibration table (KeyError)
  nopatches  - rank N reads patches/test/harp_N.pt which does not exist (FileNotFoundError)
  ckptsize   - rank N initialises from ckpt/flarenet_c24.pt (24 conv channels): load_state_dict size mismatch
  ckptpickle - rank N initialises from ckpt/flarenet_full.pt (pickled with an argparse Namespace): weights_only refusal
  histgather - rank N all_gathers a 17-bin |Bz| histogram (others 16) at the end
  limbfit    - rank N fits limb darkening pixel by pixel in Python before the step-2 all_reduce (slow)
  nanflux    - rank N's patch 40 holds a saturated pixel (inf); the loss at step 2 is NaN, the program's check
  segv       - rank N sends itself SIGSEGV after step 3
  exit4      - rank N prints its own error line about a flare catalogue gap and sys.exit(4) after training
  kernwidth  - every rank: patches are 48x48 but the head expects 32x32 features (shape error, first forward)
  none       - control, clean run

What happened (filled in after the runs):
  badflux    - "ValueError: could not convert string to float: 'n/a'" at start-up; peers Connection closed by peer in the first all_gather (np4 r2 tee, np6 r0 pymodule)
  instrument - "KeyError: 'HMI_COMBINED'" in calibrate at step 1; peers closed in the step all_reduce (np3 r1 loglevel, np8 r5 prefix)
  nopatches  - FileNotFoundError for patches/test/harp_N.pt; console of the redirects run shows only Root Cause rank 3 (np4 r3 redirects, np3 r0 wrapper)
  ckptsize   - load_state_dict size mismatch c1.weight [24,1,3,3] vs [16,1,3,3] (np4 r1 pdsh2: node 1's agent loses the store;
               np5 r2 restart: attempt 1 fails in init with 'Gloo connectFullMesh failed ... Connection refused')
  ckptpickle - '_pickle.UnpicklingError: Weights only load failed.' (np3 r2 tee_trainer)
  histgather - DETAIL: every rank 'Detected mismatch between collectives', rank 1 TensorShape=[17] (np4 r1 detail);
               'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (17), got (16))' (np6 r3 filter)
  limbfit    - 12 s: ranks 0, 2 'Timed out waiting 12000ms for recv/send' at step 2 (np3 r1 plain); 300 s: output stops after step 1,
               killed at 60 s, exit 124 (np4 r2 tee_trainer)
  nanflux    - 'non-finite loss nan at step 2 (max |Bz| in batch inf)', FloatingPointError (np5 r3 detail: rank 0 names rank 3 in
               monitoredBarrier; np3 r0 wrapper)
  segv       - no traceback after step 3; Root Cause exitcode -11 SIGSEGV (np6 r4 loglevel); restart run: attempt 1 fails in
               connectFullMesh, final Root Cause rank 1, the -11 only in the agent's 'failed' line (np4 r0 restart)
  exit4      - rank 2's GOES-gap ERROR line and exit 4 after 6 steps; rank 0 closed in the end all_gather (np3 r2 filter)
  kernwidth  - every rank 'mat1 and mat2 shapes cannot be multiplied (16x2304 and 1024x1)' in the first forward (np4 pymodule)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/flarenet.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault375_work"
CALIB = {"HMI_SIDE1": 1.0, "HMI_FRONT2": 0.98, "MDI": 1.4}
PATCH = 32
NBINS = 16
BATCH = 16
log = None


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
    log = logging.getLogger("flarenet")
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


class FlareNet(nn.Module):
    def __init__(self, ch=16, patch=PATCH):
        super().__init__()
        self.c1 = nn.Conv2d(1, ch, 3, padding=1)
        self.c2 = nn.Conv2d(ch, ch, 3, padding=1)
        self.head = nn.Linear(ch * (patch // 4) ** 2, 1)

    def forward(self, x):
        h = F.max_pool2d(torch.relu(self.c1(x)), 2)
        h = F.max_pool2d(torch.relu(self.c2(h)), 2)
        return self.head(h.flatten(1)).squeeze(1)


def make_patches(n, seed, size=PATCH):
    g = torch.Generator().manual_seed(seed)
    bz = torch.randn(n, 1, size, size, generator=g) * 50.0
    label = (torch.rand(n, generator=g) < 0.3).float()
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    for i in range(n):
        if label[i] > 0:
            c = size // 2
            bz[i, 0] += 800.0 * torch.exp(-((xx - c + 3) ** 2 + (yy - c) ** 2) / 20.0)
            bz[i, 0] -= 800.0 * torch.exp(-((xx - c - 3) ** 2 + (yy - c) ** 2) / 20.0)
    inst = ["HMI_SIDE1" if i % 2 else "HMI_FRONT2" for i in range(n)]
    cdelt = [f"{0.504 + 0.001 * (i % 3):.4f}" for i in range(n)]
    goes = ["M1.2" if l > 0 else "B4.0" for l in label.tolist()]
    return {"bz": bz, "label": label, "instrume": inst, "cdelt1": cdelt, "goes": goes}


def prepare():
    os.makedirs(f"{WORK}/patches", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_patches(64, 500 + r), f"{WORK}/patches/harp_{r}.pt")
    torch.manual_seed(0)
    torch.save(FlareNet(16).state_dict(), f"{WORK}/ckpt/flarenet_c16.pt")
    torch.save(FlareNet(24).state_dict(), f"{WORK}/ckpt/flarenet_c24.pt")
    cfg = argparse.Namespace(ch=16, lr=1e-3, cadence="12m")
    torch.save({"model": FlareNet(16).state_dict(), "config": cfg}, f"{WORK}/ckpt/flarenet_full.pt")
    print("prepared", WORK)


def calibrate(bz, inst):
    scale = torch.tensor([CALIB[s] for s in inst]).view(-1, 1, 1, 1)
    b = bz * scale
    return torch.sign(b) * torch.log1p(b.abs()) / 7.0


def limb_darkening_fit(bz, budget):
    t0 = time.time()
    n = 0
    s = 0.0
    while time.time() - t0 < budget:
        for i in range(bz.shape[0]):
            for y in range(bz.shape[2]):
                for x in range(bz.shape[3]):
                    r = math.hypot(x - 16, y - 16) / 16.0
                    s += float(bz[i, 0, y, x]) * (1 - 0.6 * (1 - math.sqrt(max(0.0, 1 - r * r))))
            n += 1
    return n, s


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading HARP patches")
    split = "test/" if bad and a.fault == "nopatches" else ""
    d = torch.load(f"{WORK}/patches/{split}harp_{rank}.pt")
    if bad and a.fault == "badflux":
        d["cdelt1"][11] = "n/a"
    if bad and a.fault == "instrument":
        d["instrume"][20] = "HMI_COMBINED"
    if bad and a.fault == "nanflux":
        d["bz"][40, 0, 7, 9] = float("inf")
    if a.fault == "kernwidth":
        d["bz"] = F.pad(d["bz"], (8, 8, 8, 8))
    pix = torch.tensor([float(c) for c in d["cdelt1"]])
    say(f"rank {rank} {len(pix)} patches, mean pixel {pix.mean():.4f} arcsec")
    nflare = d["label"].sum().reshape(1)
    allf = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(allf, nflare)
    say(f"rank {rank} flaring patches {int(nflare)} global {int(sum(f.item() for f in allf))}")
    model = FlareNet()
    ck = {"ckptsize": "flarenet_c24.pt", "ckptpickle": "flarenet_full.pt"}.get(a.fault, "flarenet_c16.pt")
    if not bad:
        ck = "flarenet_c16.pt"
    sd = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    n = d["bz"].shape[0]
    for step in range(a.steps):
        lo = (step * BATCH) % n
        x = calibrate(d["bz"][lo:lo + BATCH], d["instrume"][lo:lo + BATCH])
        y = d["label"][lo:lo + BATCH]
        logit = net(x)
        loss = F.binary_cross_entropy_with_logits(logit, y)
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"(max |Bz| in batch {x.abs().max().item()})", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "limbfit" and step == 2:
            k, _ = limb_darkening_fit(d["bz"], a.fit_budget)
            say(f"rank {rank} limb darkening fitted over {k} patches")
        acc = ((logit.detach() > 0).float() == y).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} acc {stats[1].item() / world:.3f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR GOES catalogue gap 2014-10-24T21:00..23:40 overlaps 9 labelled patches, "
            f"refusing to export", err=True)
        sys.exit(4)
    nb = NBINS + 1 if bad and a.fault == "histgather" else NBINS
    hist = torch.histc(d["bz"].abs().clamp(max=1000.0), bins=nb, min=0.0, max=1000.0)
    allh = [torch.zeros(NBINS) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} strong-field pixels {int(sum(h[8:].sum() for h in allh))} across {world} ranks")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/flarenet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/flarenet.pt")
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
    p.add_argument("--fit-budget", type=int, default=200)
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
