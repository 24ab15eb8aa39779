"""A three-hundred-and-seventy-first hand-run batch: CROP YIELD REGRESSION FROM SATELLITE INDICES.

Synthetic fields observed by a satellite over a growing season: each field has a time series of 12 dates of
three vegetation indices (NDVI, EVI, NDWI) computed from 6 reflectance bands, a crop type (looked up in a
5-entry crop table) and a yield in t/ha.  Every rank reads its fields from /tmp/fault371_work/tiles/tile_R.pt,
computes the indices, and trains a small temporal CNN (Conv1d over the dates, a crop embedding, a linear head)
on an MSE loss, wrapped in DDP (gloo) or with gradients all_reduced by hand (--ddp 0).  The model starts from
ckpt/yieldnet_3idx.pt.  Per-rank index means are all_gathered at the start, the RMSE is all_reduced every
step, and rank 0 saves export/yieldnet.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  croptype    - rank N's tile has a field of crop "quinoa", missing from the crop table (KeyError, start-up)
  bandidx     - rank N computes NDWI from band index 6 of a 6-band tensor (IndexError, first step)
  notile      - rank N reads tiles/tile_R.pt from tiles/2027/ which does not exist (FileNotFoundError)
  ckptwidth   - rank N initialises from ckpt/yieldnet_4idx.pt, saved with 4 input indices (size mismatch)
  ckptpickle  - rank N loads ckpt/yieldnet_meta.pt, which pickles a SeasonConfig object (weights_only refusal)
  gatherbands - rank N all_gathers its index means plus a cloud fraction (4 vs 3 entries)
  reproject   - rank N reprojects every pixel in Python before the step-3 all_reduce (others time out)
  nanyield    - rank N's batch at step 4 has cloud-gap NaN indices; the program's loss check raises
  sigsegv     - rank N sends itself SIGSEGV after step 3
  exit4       - rank N prints its own error line about harvest dates after the season and calls sys.exit(4)
                after the last step
  seqlen      - every rank: 14 dates per series, the head expects the pooled 12-date width (shape error)
  none        - control, clean run

What happened (filled in after the runs):
  croptype    - KeyError: 'quinoa' on rank N before the start-up all_gather; peers Connection closed by peer (np4 r2 bashloop);
                torchrun Root Cause rank 0, others SIGTERM (np6 r0 tee)
  bandidx     - IndexError 'index 6 is out of bounds for dimension 0 with size 6' in step 0; peers closed (np3 r1 ranklabel);
                ProcessRaisedException for process 3 (np4 r3 spawn, --ddp 0)
  notile      - FileNotFoundError for tiles/2027/tile_N.pt at start-up; peers closed (np3 r0 mpitag, np5 r4 srunlabel)
  ckptwidth   - load_state_dict size mismatch for conv.weight [16,4,3] vs [16,3,3]; Root Cause rank N (np4 r1 pdsh2, np3 r2 legacy)
  ckptpickle  - UnpicklingError 'Weights only load failed' (GLOBAL __main__.SeasonConfig), logged then raised (np4 r0 logfmt)
  gatherbands - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (4), got (3))' on rank N
                (np6 r3 mpitag, np3 r1 spawn)
  reproject   - 12 s: a peer 'Timed out waiting 12000ms for recv', the slow rank then finds peers closed (np3 r2 bashloop);
                300 s: no error, killed by timeout at 60 s, exit 124 (np4 r1 srunlabel; a first try with a 45 s budget
                finished training and was dropped)
  nanyield    - own check: 'non-finite loss nan at step 4 (9 NaN index values in batch)', FloatingPointError; peers closed
                (np8 r5 ranklabel, which ended at the 100 s outer timeout, exit 124; np3 r1 logfmt)
  sigsegv     - rank N silent after step 3; bash 'Segmentation fault', exit 139 (np4 r2 files); ProcessExitedException
                SIGSEGV (np3 r1 spawn)
  exit4       - rank 0's ERROR line about harvest date after season end, exitcode 4, Root Cause rank 0 (np3 r0 tee)
  seqlen      - every rank 'mat1 and mat2 shapes cannot be multiplied (16x224 and 192x16)' (np3 legacy)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/yieldnet.pt, exit 0 (np3 bashloop)
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

WORK = "/tmp/fault371_work"
CROPS = {"maize": 0, "wheat": 1, "soy": 2, "barley": 3, "rice": 4}
NDATES = 12
NBANDS = 6
NIDX = 3
HID = 16
log = None


class SeasonConfig:
    def __init__(self, start="2026-04-01", end="2026-10-15", ndates=NDATES):
        self.start, self.end, self.ndates = start, end, ndates


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
    log = logging.getLogger("yield")
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


class YieldNet(nn.Module):
    def __init__(self, nidx=NIDX, ndates=NDATES, hid=HID):
        super().__init__()
        self.conv = nn.Conv1d(nidx, hid, kernel_size=3, padding=1)
        self.crop = nn.Embedding(len(CROPS), hid)
        self.mix = nn.Linear(hid * ndates, hid)
        self.head = nn.Linear(hid, 1)

    def forward(self, x, crop):
        h = torch.relu(self.conv(x))          # [B, hid, T]
        h = torch.relu(self.mix(h.flatten(1)) + self.crop(crop))
        return self.head(h).squeeze(1)


def make_tile(n, seed):
    g = torch.Generator().manual_seed(seed)
    crops = list(CROPS)
    fields = []
    for _ in range(n):
        c = crops[int(torch.randint(0, len(crops), (1,), generator=g))]
        t = torch.linspace(0, 1, NDATES)
        peak = 0.5 + 0.2 * float(torch.rand(1, generator=g))
        green = torch.exp(-((t - peak) ** 2) / 0.05)
        bands = 0.05 + 0.3 * torch.rand(NBANDS, NDATES, generator=g) * 0.2
        bands[3] += 0.4 * green          # NIR
        bands[2] -= 0.03 * green         # red
        y = 3.0 + 6.0 * float(green.mean()) + CROPS[c] * 0.4 + 0.3 * float(torch.randn(1, generator=g))
        fields.append({"crop": c, "bands": bands.clamp(0.01, 1.0), "yield": y, "harvest": "2026-09-20"})
    return fields


def prepare():
    os.makedirs(f"{WORK}/tiles", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_tile(48, 300 + r), f"{WORK}/tiles/tile_{r}.pt")
    torch.manual_seed(0)
    torch.save(YieldNet().state_dict(), f"{WORK}/ckpt/yieldnet_3idx.pt")
    torch.save(YieldNet(nidx=4).state_dict(), f"{WORK}/ckpt/yieldnet_4idx.pt")
    torch.save({"model": YieldNet().state_dict(), "season": SeasonConfig()}, f"{WORK}/ckpt/yieldnet_meta.pt")
    print("prepared", WORK)


def indices(bands, a, bad):
    # bands: [6, T] = blue, green, red, nir, swir1, swir2
    blue, red, nir = bands[0], bands[2], bands[3]
    ndvi = (nir - red) / (nir + red)
    evi = 2.5 * (nir - red) / (nir + 6 * red - 7.5 * blue + 1)
    swir = 6 if bad and a.fault == "bandidx" else 4
    ndwi = (nir - bands[swir]) / (nir + bands[swir])
    return torch.stack([ndvi, evi, ndwi])


def reproject(fields, budget):
    # naive per-pixel UTM -> lat/lon reprojection in pure Python
    t0 = time.time()
    n = 0
    while time.time() - t0 < budget:
        for f in fields:
            for px in range(64):
                for py in range(64):
                    e, nn_ = 500000.0 + px * 10.0, 5300000.0 + py * 10.0
                    lat = nn_ / 111320.0
                    lon = (e - 500000.0) / (111320.0 * max(0.1, abs(lat) % 1.0)) + 9.0
                    n += int(lat > lon)
    return n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, reading tile {rank}")
    sub = "2027/" if bad and a.fault == "notile" else ""
    fields = torch.load(f"{WORK}/tiles/{sub}tile_{rank}.pt")
    if bad and a.fault == "croptype":
        fields[11]["crop"] = "quinoa"
    crop = torch.tensor([CROPS[f["crop"]] for f in fields])
    x = torch.stack([indices(f["bands"], a, bad) for f in fields]) if not (bad and a.fault == "bandidx") else None
    if x is None:
        say(f"rank {rank} computing indices lazily per batch")
    else:
        if bad and a.fault == "seqlen":
            x = torch.cat([x, x[:, :, -2:]], dim=2)
    y = torch.tensor([f["yield"] for f in fields])
    ymu, ysd = y.mean(), y.std()
    yt = (y - ymu) / ysd
    stats = x.mean(dim=(0, 2)) if x is not None else torch.tensor([0.5, 0.3, 0.1])
    if bad and a.fault == "gatherbands":
        stats = torch.cat([stats, torch.tensor([0.18])])
    allst = [torch.zeros(NIDX) for _ in range(world)]
    dist.all_gather(allst, stats)
    say(f"rank {rank} fields {len(fields)} mean NDVI {stats[0]:.3f} global NDVI "
        f"{sum(s[0] for s in allst) / world:.3f}")
    model = YieldNet()
    if bad and a.fault == "ckptwidth":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/yieldnet_4idx.pt"))
    elif bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/yieldnet_meta.pt")["model"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/yieldnet_3idx.pt"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    bs = 16
    for step in range(a.steps):
        lo = (step * bs) % len(fields)
        idx = torch.arange(lo, lo + bs) % len(fields)
        if x is None:
            xb = torch.stack([indices(fields[int(i)]["bands"], a, bad) for i in idx])
        else:
            xb = x[idx].clone()
        if bad and a.fault == "nanyield" and step == 4:
            xb[3:6, 0, 5:8] = float("nan")   # cloud gap left unmasked
        pred = net(xb, crop[idx])
        loss = ((pred - yt[idx]) ** 2).mean()
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"({int(torch.isnan(xb).sum())} NaN index values in batch)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "reproject" and step == 3:
            n = reproject(fields, a.reproject_budget)
            say(f"rank {rank} reprojected tile: {n} pixels north-east")
        mse = ((pred.detach() - yt[idx]) ** 2).mean().reshape(1)
        dist.all_reduce(mse)
        rmse = float((mse / world).sqrt() * ysd)
        say(f"rank {rank} step {step} loss {loss.item():.4f} rmse {rmse:.3f} t/ha")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR field 7 harvest date 2026-11-02 is after season end 2026-10-15, "
            f"yield labels invalid for this tile", err=True)
        sys.exit(4)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/yieldnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/yieldnet.pt")
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
    p.add_argument("--reproject-budget", type=int, default=45)
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
