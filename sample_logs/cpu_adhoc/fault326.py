"""Batch 326 of hand-run faults: CROP YIELD PREDICTION FROM SATELLITE TIME SERIES.

Synthetic fields: every field has a 12-date Sentinel-2-like time series of 10 reflectance bands (cloudy dates
masked), a crop type (looked up in a 6-entry crop table), a Sentinel tile id (20 tiles, embedded) and a yield
in t/ha.  Every rank reads its fields from /tmp/fault326_work/season2024/fields_R.pt, all_gathers a 16-bin NDVI
histogram at the start, and trains a Conv1d + GRU encoder with crop and tile embeddings on an MSE loss, wrapped
in DDP (gloo) or, with --ddp 0, with gradients all_reduced by hand.  The model is initialised from
ckpt/yieldnet_b10.pt.  The loss is all_reduced every step; the per-rank RMSE is all_gathered at the end and rank
0 saves export/yieldnet.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (logging).

Faults:
  cropkey    - rank N's fields include crop "quinoa", missing from the crop table (KeyError at start-up)
  cloudnan   - rank N's cloud mask fills cloudy dates with NaN instead of 0 from step 3: the program's check
  tileidx    - rank N's fields carry tile id 20 (a new tile) beyond the 20-row tile embedding (IndexError, step 0)
  notile     - rank N reads its fields from season2025/ which does not exist (FileNotFoundError)
  ckptband   - rank N initialises from ckpt/yieldnet_b12.pt, saved with 12 bands (size mismatch)
  ckptpickle - rank N initialises from ckpt/yieldnet_meta.pt, which pickles a SeasonMeta object (weights_only)
  histgather - rank N all_gathers a 17-bin NDVI histogram (an extra bin for water) where peers expect 16
  phenology  - rank N fits a phenology curve per field in pure Python before the step-2 all_reduce (slow rank)
  segv       - rank N sends itself SIGSEGV after step 3
  exit2      - rank N prints its own error about the export CRS after training and calls sys.exit(2)
  bandshape  - every rank: 13 bands stacked (B1, B9, B10 kept) where the Conv1d expects 10 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  cropkey    - KeyError: 'quinoa' in stack_fields at start-up; peers Connection closed in the histogram all_gather (np4 r2 tee, np6 r0 wrapper)
  cloudnan   - steps 0-2 fine, 'loss is nan at step 3; N NaN reflectances', FloatingPointError (np3 r1 loglevel; np4 r3 detail --ddp 0: rank 0 monitoredBarrier names rank 3)
  tileidx    - IndexError 'index out of range in self' in the tile embedding at step 0; peers Connection closed (np4 r1 prefix, np8 r5 filter)
  notile     - FileNotFoundError season2025/fields_N.pt (np3 r2 pymodule); np4 r0 restart: the restarted attempt fails in Gloo connectFullMesh instead
  ckptband   - load_state_dict size mismatch conv.weight [16,12,3] vs [16,10,3] (np4 r1 pdsh2: node 1 RendezvousConnectionError; np3 r2 tee_trainer)
  ckptpickle - UnpicklingError: Weights only load failed, Unsupported global __main__.SeasonMeta; others SIGTERMed (np6 r3 plain)
  histgather - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (17), got (16))' (np4 r2 redirects, in the files; np3 r0 loglevel)
  phenology  - 12 s: peers 'Timed out waiting 12000ms' send/recv after step 1, Root Cause rank 0 (np3 r1 tee); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r2 plain)
  segv       - exitcode -11 after step 3, Root Cause rank N (np6 r4 pymodule); np3 r1 restart: attempt 1 fails in Gloo connectFullMesh, final exit 1
  exit2      - rank N's CRS ERROR line after step 5, exit 2, peers Connection closed in the final all_gather (np4 r3 tee_trainer, np3 r0 prefix)
  bandshape  - every rank: Conv1d 'expected input[48, 13, 12] to have 10 channels, but got 13'; Root Cause rank 2 (np3 wrapper)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/yieldnet.pt, exit 0 (np3 plain)
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
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault326_work"
CROPS = {"wheat": 0, "maize": 1, "soy": 2, "rice": 3, "barley": 4, "sorghum": 5}
NTILE = 20
BANDS = 10
DATES = 12
NBIN = 16
log = None


class SeasonMeta:
    def __init__(self, season, tiles):
        self.season = season
        self.tiles = tiles


def setup_log(rank, logfmt):
    global log
    if not logfmt:
        return
    log = logging.getLogger("yield")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter(f"%(asctime)s [rank={rank}] %(levelname)s %(message)s"))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class YieldNet(nn.Module):
    def __init__(self, bands=BANDS, hid=24):
        super().__init__()
        self.conv = nn.Conv1d(bands, 16, 3, padding=1)
        self.gru = nn.GRU(16, hid, batch_first=True)
        self.crop = nn.Embedding(len(CROPS), 4)
        self.tile = nn.Embedding(NTILE, 4)
        self.head = nn.Sequential(nn.Linear(hid + 8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x, crop, tile):
        h = torch.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        _, hn = self.gru(h)
        z = torch.cat([hn[-1], self.crop(crop), self.tile(tile)], 1)
        return self.head(z).squeeze(1)


def make_fields(n, seed):
    g = torch.Generator().manual_seed(seed)
    crops = list(CROPS)
    fields = []
    for _ in range(n):
        c = crops[int(torch.randint(0, len(crops), (1,), generator=g))]
        t = torch.linspace(0, 1, DATES)
        peak = 0.4 + 0.2 * float(torch.rand(1, generator=g))
        ndvi = 0.2 + 0.6 * torch.exp(-((t - peak) ** 2) / 0.03)
        refl = torch.rand(DATES, 13, generator=g) * 0.1
        refl[:, 7] += ndvi * 0.5
        cloud = torch.rand(DATES, generator=g) < 0.15
        y = 2.0 + 6.0 * float(ndvi.max()) * (1 + 0.1 * CROPS[c]) + 0.3 * float(torch.randn(1, generator=g))
        fields.append({"crop": c, "tile": int(torch.randint(0, NTILE, (1,), generator=g)),
                       "refl": refl, "cloud": cloud, "ndvi": ndvi, "yield": y})
    return fields


def prepare():
    for d in ("season2024", "ckpt", "export"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_fields(48, 300 + r), f"{WORK}/season2024/fields_{r}.pt")
    torch.manual_seed(0)
    torch.save(YieldNet().state_dict(), f"{WORK}/ckpt/yieldnet_b10.pt")
    torch.save(YieldNet(bands=12).state_dict(), f"{WORK}/ckpt/yieldnet_b12.pt")
    torch.save({"state_dict": YieldNet().state_dict(), "meta": SeasonMeta(2024, list(range(NTILE)))},
               f"{WORK}/ckpt/yieldnet_meta.pt")
    print("prepared", WORK)


def stack_fields(fields, a, bad, step):
    keep = list(range(13)) if a.fault == "bandshape" else [1, 2, 3, 4, 5, 6, 7, 8, 11, 12]
    xs, crops, tiles = [], [], []
    for f in fields:
        r = f["refl"][:, keep].clone()
        fill = float("nan") if bad and a.fault == "cloudnan" and step >= 3 else 0.0
        r[f["cloud"]] = fill
        xs.append(r)
        crops.append(CROPS[f["crop"]])
        tiles.append(f["tile"])
    return torch.stack(xs), torch.tensor(crops), torch.tensor(tiles)


def fit_phenology(fields, budget):
    t0 = time.time()
    fits = 0
    while time.time() - t0 < budget:
        for f in fields:
            v = f["ndvi"].tolist()
            best = (1e9, 0.0, 0.0)
            for pi in range(60):
                p = pi / 60
                for wi in range(1, 40):
                    w = wi / 200
                    err = sum((v[k] - 0.2 - 0.6 * math.exp(-((k / 11 - p) ** 2) / w)) ** 2 for k in range(DATES))
                    if err < best[0]:
                        best = (err, p, w)
            fits += 1
    return fits


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(2024 + rank)
    say(f"rank {rank}/{world} up, reading season 2024 fields")
    season = "season2025" if bad and a.fault == "notile" else "season2024"
    fields = torch.load(f"{WORK}/{season}/fields_{rank}.pt")
    if bad and a.fault == "cropkey":
        fields[11]["crop"] = "quinoa"
    if bad and a.fault == "tileidx":
        fields[7]["tile"] = NTILE
    x, crop, tile = stack_fields(fields, a, bad, 0)
    y = torch.tensor([f["yield"] for f in fields])
    peak = torch.stack([f["ndvi"].max() for f in fields])
    nb = NBIN + 1 if bad and a.fault == "histgather" else NBIN
    hist = torch.histc(peak, bins=nb, min=0.0, max=1.0)
    allh = [torch.zeros(NBIN) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} fields {len(fields)} peak-NDVI fields in histogram {int(sum(h.sum() for h in allh))}")
    model = YieldNet()
    ck = {"ckptband": "yieldnet_b12.pt", "ckptpickle": "yieldnet_meta.pt"}.get(a.fault) if bad else None
    sd = torch.load(f"{WORK}/ckpt/{ck or 'yieldnet_b10.pt'}")
    model.load_state_dict(sd["state_dict"] if "state_dict" in sd else sd)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=5e-3)
    for step in range(a.steps):
        if step:
            x, crop, tile = stack_fields(fields, a, bad, step)
        pred = net(x, crop, tile)
        loss = ((pred - y) ** 2).mean()
        if not torch.isfinite(loss):
            say(f"rank {rank}: loss is {loss.item()} at step {step}; "
                f"{int(torch.isnan(x).sum())} NaN reflectances in the batch", err=True)
            raise FloatingPointError(f"non-finite loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "phenology" and step == 2:
            n = fit_phenology(fields, a.pheno_budget)
            say(f"rank {rank} phenology fits: {n}")
        l = loss.detach().reshape(1)
        dist.all_reduce(l)
        rmse = (l.item() / world) ** 0.5
        say(f"rank {rank} step {step} loss {l.item() / world:.4f} rmse {rmse:.3f} t/ha")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit2":
        say(f"rank {rank}: ERROR export grid EPSG:32633 does not match field boundaries EPSG:4326 for tile "
            f"33UVP, refusing to write yield map", err=True)
        sys.exit(2)
    mine = torch.tensor([((pred.detach() - y) ** 2).mean().sqrt().item()])
    allr = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(allr, mine)
    if rank == 0:
        torch.save(model.state_dict(), f"{WORK}/export/yieldnet.pt")
        say(f"rank 0 done: {a.steps} steps, per-rank rmse {[round(float(v), 3) for v in allr]}, "
            f"saved export/yieldnet.pt")
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
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(rank),
                      WORLD_SIZE=str(a.spawn), LOCAL_RANK=str(rank))
    main_guarded(a, rank, a.spawn)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--pheno-budget", type=int, default=40)
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
