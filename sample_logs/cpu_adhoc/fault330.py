"""A three-hundred-and-thirtieth hand-run batch: OCEAN COLOUR CHLOROPHYLL REGRESSION FROM MULTISPECTRAL PATCHES.

Synthetic ocean-colour match-ups: each sample is an 11x11 patch of remote-sensing reflectance in six bands
(412, 443, 490, 510, 560, 665 nm) from one sensor (MODIS-A, VIIRS-SNPP or OLCI-A, each with its own
vicarious-calibration gains looked up in a table), the latitude of the in-situ station, and the in-situ
chlorophyll-a (mg m^-3) that is regressed as log10(chl).  Every rank reads /tmp/fault330_work/patches/
patches_R.pt, crops the central 7x7 window, and trains ChlNet (two 3x3 convolutions over the bands, a
latitude-bin embedding of 180 one-degree bins, an MLP head) on an MSE loss in log10 space, wrapped in DDP
(gloo) or, with --ddp 0, with gradients all_reduced by hand.  The model starts from ckpt/chlnet_b6.pt.
Per-rank band means are all_gathered at start-up, the RMSE is all_reduced every step, per-rank validation
RMSEs are all_gathered at the end, and rank 0 saves export/chlnet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  sensor     - rank N's match-ups include sensor "OLCI-B", missing from the calibration table (KeyError)
  nopatch    - rank N reads its patches from patches/2025/ which does not exist (FileNotFoundError)
  ckptbands  - rank N initialises from ckpt/chlnet_b8.pt, saved for 8 bands (size mismatch in load_state_dict)
  ckptpickle - rank N resumes from ckpt/chlnet_meta.pt, which pickles a SensorMeta object (weights_only refusal)
  bandgather - rank N all_gathers its band means with the 709 nm band added (7 vs 6 entries)
  cloudmask  - rank N builds a per-pixel cloud mask in pure Python before the step-3 all_reduce (slow rank)
  logchl     - rank N's step-2 batch has in-situ chl 0.0 (below detection): log10 -> -inf, the program's loss check
  latidx     - rank N's step-3 batch holds a station at 90.0 N: latitude bin 180 of 180 (embedding IndexError)
  sigsegv    - rank N sends itself SIGSEGV after step 4
  exit5      - rank N prints its own error about too few valid match-ups after training and calls sys.exit(5)
  patchsize  - every rank crops 9x9 windows; the head expects the 7x7 feature size (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  sensor     - KeyError: 'OLCI-B' in calibrate at start-up; peers Connection closed in the band-means all_gather (np4 r1 ranklabel, np6 r4 tee)
  nopatch    - FileNotFoundError patches/2025/patches_2.pt, peers closed (np3 r2 srunlabel); np4 r0 spawn hides it: only process 3's Connection closed
  ckptbands  - load_state_dict size mismatch conv1.weight [16,8,3,3] vs [16,6,3,3] (np4 r3 legacy; np4 r2 pdsh2, worker-0 then RendezvousConnectionError)
  ckptpickle - UnpicklingError 'Weights only load failed ... GLOBAL __main__.SensorMeta'; peers closed in DDP() (np3 r1 mpitag, np5 r0 logfmt)
  bandgather - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (7), got (6))'; peers closed (np3 r0 srunlabel, np8 r5 files)
  cloudmask  - 12 s: peers 'Timed out waiting 12000ms' in the step-3 all_reduce (np3 r1 bashloop); 300 s: silent after step 2, exit 124 (np4 r2 ranklabel)
  logchl     - 'non-finite loss inf at step 2', FloatingPointError; 5 peers closed in the hand grad all_reduce, --ddp 0 (np6 r4 bashloop)
  latidx     - 'IndexError: index out of range in self' at step 3 (lat bin 180); peers closed in grad all_reduce, --ddp 0 (np4 r1 logfmt)
  sigsegv    - silent after step 4; bash 'Segmentation fault' exit 139 (np4 r3 mpitag); ProcessExitedException SIGSEGV (np3 r1 spawn)
  exit5      - rank N's ERROR line, exit 5; peers closed in the final all_gather; Root Cause rank 2 exitcode 5 (np3 r2 tee); loop exit 5 (np6 r0 files)
  patchsize  - every rank: 'mat1 and mat2 shapes cannot be multiplied (32x400 and 144x32)' in the first forward; Root Cause rank 0 (np3 legacy)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/chlnet.pt, exit 0 (np3 bashloop)
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
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault330_work"
BANDS = [412, 443, 490, 510, 560, 665]
CALIB = {"MODIS-A": [1.0, 0.98, 1.01, 1.0, 0.99, 1.02],
         "VIIRS-SNPP": [0.97, 1.0, 1.0, 1.03, 1.0, 0.98],
         "OLCI-A": [1.01, 1.0, 0.99, 1.0, 1.02, 1.0]}
PATCH = 7
NLAT = 180
BATCH = 32
log = None


class SensorMeta:
    def __init__(self, sensor, bands):
        self.sensor = sensor
        self.bands = bands


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
    log = logging.getLogger("chl")
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


class ChlNet(nn.Module):
    def __init__(self, nbands=len(BANDS), patch=PATCH):
        super().__init__()
        self.conv1 = nn.Conv2d(nbands, 16, 3)
        self.conv2 = nn.Conv2d(16, 16, 3)
        self.lat_emb = nn.Embedding(NLAT, 4)
        feat = 16 * (patch - 4) * (patch - 4)
        self.fc = nn.Linear(feat, 32)
        self.head = nn.Linear(32 + 4, 1)

    def forward(self, x, latbin):
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        h = torch.relu(self.fc(h.flatten(1)))
        return self.head(torch.cat([h, self.lat_emb(latbin)], 1)).squeeze(1)


def make_patches(n, seed):
    g = torch.Generator().manual_seed(seed)
    chl = 10 ** (torch.rand(n, generator=g) * 3 - 1.5)
    ratio = (torch.log10(chl) * -0.3 + 0.5).clamp(0.05, 2.0)
    base = torch.tensor([0.012, 0.011, 0.009, 0.006, 0.003, 0.0005])
    rrs = base.view(1, 6, 1, 1) * (1 + ratio.view(n, 1, 1, 1) * torch.linspace(1, -0.5, 6).view(1, 6, 1, 1))
    rrs = rrs + 0.0004 * torch.randn(n, 6, 11, 11, generator=g)
    sensors = [list(CALIB)[int(i)] for i in torch.randint(0, 3, (n,), generator=g)]
    lat = torch.rand(n, generator=g) * 140 - 70
    return {"rrs": rrs, "sensor": sensors, "lat": lat, "chl": chl}


def prepare():
    os.makedirs(f"{WORK}/patches", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_patches(192, 500 + r), f"{WORK}/patches/patches_{r}.pt")
    torch.manual_seed(0)
    torch.save(ChlNet().state_dict(), f"{WORK}/ckpt/chlnet_b6.pt")
    torch.save(ChlNet(nbands=8).state_dict(), f"{WORK}/ckpt/chlnet_b8.pt")
    torch.save({"model": ChlNet().state_dict(), "meta": SensorMeta("OLCI-A", BANDS)}, f"{WORK}/ckpt/chlnet_meta.pt")
    print("prepared", WORK)


def calibrate(d):
    gains = torch.tensor([CALIB[s] for s in d["sensor"]])
    return d["rrs"] * gains.view(-1, 6, 1, 1)


def cloud_mask(rrs, budget):
    # per-pixel flag test in pure Python: bright at 665 nm and flat spectrum -> cloud
    t0 = time.time()
    flagged = 0
    data = rrs.tolist()
    while time.time() - t0 < budget:
        for patch in data:
            for i in range(11):
                for j in range(11):
                    spec = [patch[b][i][j] for b in range(6)]
                    if spec[5] > 0.002 and max(spec) - min(spec) < 0.004:
                        flagged += 1
    return flagged


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading match-up patches")
    sub = "2025/" if bad and a.fault == "nopatch" else ""
    d = torch.load(f"{WORK}/patches/{sub}patches_{rank}.pt")
    if bad and a.fault == "sensor":
        for k in (40, 41, 97):
            d["sensor"][k] = "OLCI-B"
    if bad and a.fault == "logchl":
        d["chl"][2 * BATCH + 7] = 0.0
    if bad and a.fault == "latidx":
        d["lat"][3 * BATCH + 11] = 90.0
    rrs = calibrate(d)
    crop = 9 if a.fault == "patchsize" else PATCH
    o = (11 - crop) // 2
    x = rrs[:, :, o:o + crop, o:o + crop] * 100.0
    y = torch.log10(d["chl"])
    latbin = (d["lat"] + 90.0).floor().long()
    means = x.mean((0, 2, 3))
    if bad and a.fault == "bandgather":
        means = torch.cat([means, torch.tensor([0.031])])
    allm = [torch.zeros(6) for _ in range(world)]
    dist.all_gather(allm, means)
    say(f"rank {rank} patches {x.shape[0]} band means 443nm local {means[1]:.3f} "
        f"global {sum(m[1] for m in allm) / world:.3f}")
    model = ChlNet()
    if bad and a.fault == "ckptpickle":
        state = torch.load(f"{WORK}/ckpt/chlnet_meta.pt")["model"]
    else:
        state = torch.load(f"{WORK}/ckpt/chlnet_b8.pt" if bad and a.fault == "ckptbands"
                           else f"{WORK}/ckpt/chlnet_b6.pt")
    model.load_state_dict(state)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    n = x.shape[0]
    for step in range(a.steps):
        idx = torch.arange(step * BATCH, (step + 1) * BATCH) % n
        pred = net(x[idx], latbin[idx])
        loss = ((pred - y[idx]) ** 2).mean()
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"(log10 chl range {y[idx].min().item()}..{y[idx].max().item()})", err=True)
            raise FloatingPointError(f"non-finite loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "cloudmask" and step == 3:
            say(f"rank {rank} cloud mask: {cloud_mask(d['rrs'], a.mask_budget)} flagged pixels")
        rmse = loss.detach().sqrt().reshape(1)
        dist.all_reduce(rmse)
        say(f"rank {rank} step {step} loss {loss.item():.4f} rmse_log10 {rmse.item() / world:.4f}")
        if bad and a.fault == "sigsegv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        vrmse = ((model(x[-BATCH:], latbin[-BATCH:]) - y[-BATCH:]) ** 2).mean().sqrt().reshape(1)
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR only 3 of {n} match-ups pass the +/-3 h and CV<0.15 screening, "
            f"validation RMSE is meaningless; aborting", err=True)
        sys.exit(5)
    allv = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(allv, vrmse)
    say(f"rank {rank} validation rmse {vrmse.item():.4f} worst rank {int(torch.cat(allv).argmax())}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/chlnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/chlnet.pt")
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
    p.add_argument("--mask-budget", type=int, default=30)
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
