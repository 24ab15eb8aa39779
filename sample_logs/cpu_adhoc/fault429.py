"""Batch 429 hand-run faults: SEA ICE CONCENTRATION FROM PASSIVE MICROWAVE.

Synthetic passive-microwave swaths: every sample is a 16x16 polar-stereographic patch of brightness
temperatures in six channels (19V, 19H, 37V, 37H, 89V, 89H, in kelvin) with a sea ice concentration (SIC)
target in [0, 1].  Every rank reads its swaths from /tmp/fault429_work/tb/swath_R.pt, applies the
inter-sensor calibration offset of its sensor (a small table: SSMIS, AMSR2, SMMR), adds the bootstrap-style
polarisation and gradient ratios (PR19, GR3719) as features, and trains a small conv net (SICNet) with a
sigmoid head on an MSE loss, wrapped in DDP (gloo) or, with --ddp 0, with gradients all_reduced by hand.
The model starts from ckpt/sicnet_c6.pt.  The MAE is all_reduced every step; at the end every rank
all_gathers a 10-bin histogram of its predicted SIC and compares its skill with a climatology baseline
(ckpt/clim.pt), and rank 0 saves export/sicnet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  sensor     - rank N's swath header names sensor "AMSR3", missing from the calibration table (KeyError, start-up)
  noswath    - rank N reads its swaths from tb/nh_2025/ which does not exist (FileNotFoundError, start-up)
  ckptchan   - rank N initialises from ckpt/sicnet_c7.pt, saved for 7 TB channels (9 inputs vs 8: size mismatch)
  climpickle - rank N loads the climatology from ckpt/clim_meta.pt, pickled with a RunMeta object, at the
               end (torch.load weights_only refusal, UnpicklingError)
  sichist    - rank N all_gathers an 11-bin SIC histogram (an extra open-water bin) at the end (9/10 vs 11)
  tiepoint   - rank N re-derives bootstrap tie points in pure Python before the step-2 all_reduce
               (--tie-budget seconds; 12 s PG timeout -> peers time out; --pg-timeout 300 -> hang)
  coldtb     - rank N's swath has a dropped scan block with 0 K in 37V/37H: GR3719 = 0/0 = NaN at step 3,
               the program's finiteness check raises FloatingPointError
  segv       - rank N sends itself SIGSEGV after step 4
  exit2      - rank N prints its own error line (no scans north of 60N) and calls sys.exit(2) at start-up
  ratiochan  - every rank: PR/GR ratio channels appended twice, 10 channels into a 8-channel conv (shape error)
  scanidx    - rank N's sample at step 2 carries scan number 64 into a 64-row latitude table (IndexError)
  none       - control, clean run

What happened (filled in after the runs):
  sensor     - KeyError: 'AMSR3' at the calibration lookup before step 0; peers SIGTERMed (np4 r1 tee, np6 r0 pymodule)
  noswath    - FileNotFoundError for tb/nh_2025/swath_N.pt at start-up (np3 r2 redirects: only in stderr.log; np4 r3 wrapper)
  ckptchan   - size mismatch for c1.weight [16, 9, 3, 3] vs [16, 8, 3, 3] before step 0 (np4 r2 loglevel, np8 r5 filter)
  climpickle - after step 5: UnpicklingError 'Weights only load failed ... GLOBAL __main__.RunMeta' (np3 r0 tee_trainer)
  sichist    - DETAIL: every rank 'Detected mismatch between collectives', rank 1 TensorShape=[11] (np4 r1 detail);
               'ProcessGroupGloo::allgather: invalid tensor size ... (expected (11), got (10))', peers closed (np3 r2 prefix)
  tiepoint   - 12 s: no step-2 line, ranks 0/2 'Timed out waiting 12000ms' (np3 r1 plain); 300 s: silent after
               step 1, killed by timeout at 60 s, exit 124 (np4 r2 wrapper)
  coldtb     - step 3: '2048 non-finite values in the ratio features', FloatingPointError; peers closed
               (np4 r3 pdsh2, np6 r2 tee)
  segv       - after step 4 'exitcode: -11' / Signal 11 (SIGSEGV) (np6 r4 filter); np3 r1 restart: SIGSEGV in
               attempt 0, attempt 1 failed in init (connectFullMesh refused), final Root Cause rank 0
  exit2      - rank N's ERROR line and exitcode 2 at start-up (np4 r0 prefix, np3 r2 tee_trainer)
  ratiochan  - every rank: 'expected input[8, 10, 16, 16] to have 8 channels, but got 10' (np3 pymodule)
  scanidx    - after step 1: IndexError 'index 64 is out of bounds for dimension 0 with size 64' (np8 r6 loglevel, np4 r0 plain)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/sicnet.pt, exit 0 (np3 plain)
"""
import argparse
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault429_work"
CHANNELS = ["19V", "19H", "37V", "37H", "89V", "89H"]
CALIB = {"SSMIS": [0.0, 0.0, 0.0, 0.0, 0.0, 0.0], "AMSR2": [-1.2, -0.8, -0.6, -0.9, 1.1, 0.7],
         "SMMR": [2.1, 1.7, 1.4, 1.2, 0.0, 0.0]}
NIN = 8
BATCH = 8
NSCAN = 64
log = None


@dataclass
class RunMeta:
    product: str
    version: str
    hemisphere: str


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
    log = logging.getLogger("seaice")
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


class SICNet(nn.Module):
    def __init__(self, nin=NIN, width=16):
        super().__init__()
        self.c1 = nn.Conv2d(nin, width, 3, padding=1)
        self.c2 = nn.Conv2d(width, width, 3, padding=1)
        self.head = nn.Conv2d(width, 1, 1)

    def forward(self, x):
        h = F.relu(self.c1(x))
        h = F.relu(self.c2(h))
        return torch.sigmoid(self.head(h)).squeeze(1)


def make_swath(n, seed, sensor):
    g = torch.Generator().manual_seed(seed)
    sic = torch.rand(n, 1, 4, 4, generator=g)
    sic = F.interpolate(sic, size=(16, 16), mode="bilinear", align_corners=False).squeeze(1).clamp(0, 1)
    water = torch.tensor([185.0, 115.0, 205.0, 145.0, 240.0, 190.0]).view(1, 6, 1, 1)
    ice = torch.tensor([250.0, 235.0, 245.0, 230.0, 235.0, 225.0]).view(1, 6, 1, 1)
    tb = water + (ice - water) * sic.unsqueeze(1) + 2.0 * torch.randn(n, 6, 16, 16, generator=g)
    scans = torch.randint(0, NSCAN, (n,), generator=g)
    return {"sensor": sensor, "tb": tb, "sic": sic, "scan": scans, "lat0": 60.0 + 0.4 * torch.arange(NSCAN)}


def prepare():
    os.makedirs(f"{WORK}/tb", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_swath(48, 500 + r, "SSMIS" if r % 2 == 0 else "AMSR2"), f"{WORK}/tb/swath_{r}.pt")
    torch.manual_seed(0)
    torch.save(SICNet(NIN).state_dict(), f"{WORK}/ckpt/sicnet_c6.pt")
    torch.save(SICNet(NIN + 1).state_dict(), f"{WORK}/ckpt/sicnet_c7.pt")
    clim = {"mean_sic": torch.full((16, 16), 0.5), "months": torch.arange(12)}
    torch.save(clim, f"{WORK}/ckpt/clim.pt")
    torch.save({**clim, "meta": RunMeta("NSIDC-0051", "v2", "north")}, f"{WORK}/ckpt/clim_meta.pt")
    print("prepared", WORK)


def features(tb, a, bad):
    pr19 = (tb[:, 0] - tb[:, 1]) / (tb[:, 0] + tb[:, 1])
    gr3719 = (tb[:, 2] - tb[:, 0]) / (tb[:, 2] + tb[:, 0])
    if bad and a.fault == "coldtb":
        gr3719 = (tb[:, 2] - tb[:, 3]) / (tb[:, 2] + tb[:, 3])
    norm = (tb - 200.0) / 40.0
    parts = [norm, pr19.unsqueeze(1) * 10, gr3719.unsqueeze(1) * 10]
    if a.fault == "ratiochan":
        parts += [pr19.unsqueeze(1) * 10, gr3719.unsqueeze(1) * 10]
    return torch.cat(parts, 1)


def bootstrap_tiepoints(tb, budget):
    """Pure-Python re-derivation of the ice tie points: a slow per-pixel least squares."""
    t0 = time.time()
    v = tb[:, 2].flatten().tolist()
    h = tb[:, 3].flatten().tolist()
    best = (0.0, 0.0, float("inf"))
    rounds = 0
    while time.time() - t0 < budget:
        for slope in [0.9 + 0.01 * k for k in range(20)]:
            for off in [-20 + 2.0 * k for k in range(20)]:
                err = sum((hi - (slope * vi + off)) ** 2 for vi, hi in zip(v[:2000], h[:2000]))
                if err < best[2]:
                    best = (slope, off, err)
        rounds += 1
    return best, rounds


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4290 + rank)
    say(f"rank {rank}/{world} up, reading passive-microwave swaths")
    if bad and a.fault == "exit2":
        say(f"rank {rank}: ERROR swath_{rank}.pt has 0 scans north of 60N after the land/coast mask, "
            f"cannot train a northern-hemisphere SIC model", err=True)
        sys.exit(2)
    sub = "nh_2025/" if bad and a.fault == "noswath" else ""
    sw = torch.load(f"{WORK}/tb/{sub}swath_{rank}.pt")
    if bad and a.fault == "sensor":
        sw["sensor"] = "AMSR3"
    if bad and a.fault == "scanidx":
        sw["scan"][17] = NSCAN
    tb = sw["tb"] + torch.tensor(CALIB[sw["sensor"]]).view(1, 6, 1, 1)
    if bad and a.fault == "coldtb":
        tb[24:32, 2:4] = 0.0
    say(f"rank {rank} sensor {sw['sensor']} samples {tb.shape[0]} mean 37V {tb[:, 2].mean():.1f} K")
    model = SICNet(NIN)
    ck = "sicnet_c7.pt" if bad and a.fault == "ckptchan" else "sicnet_c6.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    sic = sw["sic"]
    for step in range(a.steps):
        lo = (step * BATCH) % tb.shape[0]
        xb = features(tb[lo:lo + BATCH], a, bad)
        yb = sic[lo:lo + BATCH]
        nonfinite = int((~torch.isfinite(xb)).sum())
        if nonfinite:
            say(f"rank {rank}: step {step}: {nonfinite} non-finite values in the ratio features "
                f"(samples {lo}-{lo + BATCH - 1})", err=True)
            raise FloatingPointError(f"non-finite GR3719/PR19 features on rank {rank} at step {step}")
        lat = sw["lat0"][sw["scan"][lo:lo + BATCH]]
        w = (1.0 + (lat - 60.0) / 30.0).view(-1, 1, 1)
        pred = net(xb)
        loss = (w * (pred - yb) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "tiepoint" and step == 2:
            best, rounds = bootstrap_tiepoints(tb, a.tie_budget)
            say(f"rank {rank} tie points slope {best[0]:.2f} offset {best[1]:.1f} ({rounds} rounds)")
        mae = (pred.detach() - yb).abs().mean().reshape(1)
        dist.all_reduce(mae)
        say(f"rank {rank} step {step} loss {loss.item():.4f} mae {mae.item() / world:.4f}")
        if bad and a.fault == "segv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        pall = model(features(tb, a, False if a.fault == "coldtb" else bad))
    nbins = 11 if bad and a.fault == "sichist" else 10
    hist = torch.histc(pall, bins=nbins, min=0.0, max=1.0)
    hists = [torch.zeros(10) for _ in range(world)]
    dist.all_gather(hists, hist)
    clim_file = "clim_meta.pt" if bad and a.fault == "climpickle" else "clim.pt"
    clim = torch.load(f"{WORK}/ckpt/{clim_file}")
    skill = 1 - (pall - sic).abs().mean() / (clim["mean_sic"] - sic).abs().mean()
    say(f"rank {rank} skill vs climatology {skill.item():.3f} ice pixels {int(sum(h[5:].sum() for h in hists))}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/sicnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/sicnet.pt")
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
    p.add_argument("--tie-budget", type=int, default=45)
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
