"""Batch 350 hand-run fault script: GLACIER EXTENT SEGMENTATION FROM SATELLITE TILES.

Synthetic multispectral tiles (Sentinel-2 style bands B2, B3, B4, B11 picked through a band table) with a
DEM elevation channel and a per-pixel mask of 3 classes (background, clean ice, debris-covered ice).  Every
rank reads its region from /tmp/fault350_work/tiles/region_R.pt and dem/dem_R.pt, adds an NDSI channel
((green - swir) / (green + swir)), and trains a tiny U-Net (one down, one up, a skip concatenation) on a
class-weighted cross entropy, wrapped in DDP (gloo) or, with --ddp 0, with gradients all_reduced by hand.
The model starts from ckpt/unet_c6.pt.  The glacier IoU is all_reduced every step, the per-class glacier
area (pixels) is all_gathered at the end, and rank 0 saves export/glacier_unet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  bandkey    - rank N's tile metadata lists band "B12", missing from the band table (KeyError, start-up)
  nodem      - rank N reads its DEM from dem/srtm/ which does not exist (FileNotFoundError, start-up)
  ckptbands  - rank N initialises from ckpt/unet_c8.pt, saved for 8 input channels (size mismatch)
  ckptpickle - rank N loads ckpt/unet_full.pt, which pickles a BandStats object (weights_only refusal)
  areagather - rank N all_gathers 4 per-class areas (an extra "snow" class) instead of 3 (at the end)
  slowmorph  - rank N runs a pure-Python morphological opening of its masks before the step-2 all_reduce
  ndsi       - rank N's step-3 batch has green + swir == 0 pixels: NDSI 0/0 NaN, the program's loss check
  sigsegv    - rank N sends itself SIGSEGV after step 4
  exit4      - rank N prints its own error line about a CRS mismatch and calls sys.exit(4) before the gather
  labelidx   - rank N's masks keep the no-data code 255: class-weight lookup out of range (IndexError, step 0)
  tile17     - every rank crops 17x17 tiles: the skip concatenation fails (16 vs 17) in the first forward
  none       - control, clean run

What happened (filled in after the runs):
  bandkey    - KeyError: 'B12' in the band-table lookup at start-up, others SIGTERMed (np4 r2 tee, np6 r0 prefix)
  nodem      - FileNotFoundError for dem/srtm/dem_N.pt at start-up (np3 r1 tee_trainer; np4 r3 pdsh2, worker-0 ranks Connection closed)
  ckptbands  - load_state_dict size mismatch for enc1.weight [8,8,3,3] vs [8,6,3,3]; others SIGTERMed (np4 r1 loglevel)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.BandStats' (np3 r2 pymodule, np8 r5 filter)
  areagather - DETAIL: every rank 'Detected mismatch between collectives', TensorShape=[4] vs [3] (np5 r3 detail); gloo 'invalid tensor size at index 0 (expected (4), got (3))' on rank 0 (np3 r0 wrapper)
  slowmorph  - 12 s: ranks 0, 2 'Timed out waiting 12000ms for recv/send' in step 2 (np3 r1 plain); 300 s: output stops after step 1, killed at 60 s, exit 124 (np4 r2 tee)
  ndsi       - 'non-finite loss nan at step 3; 25 non-finite input values', FloatingPointError (np6 r4 redirects, in the files; np3 r0 restart, attempt 1 then failed in Gloo connectFullMesh)
  sigsegv    - no traceback after step 4, Root Cause exitcode -11 SIGSEGV, peers Connection reset (np4 r1 filter); np3 r2 restart: attempt 1 failed in connectFullMesh
  exit4      - rank N's EPSG mismatch ERROR line, exit 4; peers Connection closed in the area all_gather; Root Cause exitcode 4 (np5 r2 prefix)
  labelidx   - IndexError 'index 255 is out of bounds for dimension 0 with size 3' in step 0; peers Connection closed (np4 r3 wrapper, np6 r2 pymodule)
  tile17     - every rank 'Sizes of tensors must match except in dimension 1. Expected size 16 but got size 17'; Root Cause rank 3 (np8 loglevel)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/glacier_unet.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault350_work"
BANDS = {"B2": 0, "B3": 1, "B4": 2, "B8": 3, "B11": 4}
USE = ["B2", "B3", "B4", "B11"]
NCLS = 3
TILE = 16
NTILES = 32
BATCH = 8
log = None


class BandStats:
    def __init__(self, mean, std):
        self.mean = mean
        self.std = std


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
    log = logging.getLogger("glacier")
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


class TinyUNet(nn.Module):
    def __init__(self, cin=6, ncls=NCLS):
        super().__init__()
        self.enc1 = nn.Conv2d(cin, 8, 3, padding=1)
        self.enc2 = nn.Conv2d(8, 16, 3, padding=1)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.dec = nn.Conv2d(16, 8, 3, padding=1)
        self.head = nn.Conv2d(8, ncls, 1)

    def forward(self, x):
        e1 = F.relu(self.enc1(x))
        e2 = F.relu(self.enc2(F.max_pool2d(e1, 2)))
        u = self.up(e2)
        d = F.relu(self.dec(torch.cat([u, e1], dim=1)))
        return self.head(d)


def make_region(seed):
    g = torch.Generator().manual_seed(seed)
    elev = torch.rand(NTILES, 1, TILE, TILE, generator=g) * 3000 + 2500
    raw = torch.rand(NTILES, 5, TILE, TILE, generator=g) * 0.3 + 0.05
    ice = (elev[:, 0] > 4200).long()
    debris = ((elev[:, 0] > 3800) & (elev[:, 0] <= 4200)).long() * 2
    mask = ice + debris
    raw[:, 1] += ice * 0.5
    raw[:, 4] -= ice * 0.04
    meta = [{"tile": f"T45R{seed:03d}_{i:02d}", "bands": list(USE), "crs": "EPSG:32644"} for i in range(NTILES)]
    return {"raw": raw, "mask": mask, "meta": meta}, elev


def prepare():
    for d in ("tiles", "dem", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        region, elev = make_region(100 + r)
        torch.save(region, f"{WORK}/tiles/region_{r}.pt")
        torch.save(elev, f"{WORK}/dem/dem_{r}.pt")
    torch.manual_seed(0)
    sd = TinyUNet(6).state_dict()
    torch.save(sd, f"{WORK}/ckpt/unet_c6.pt")
    torch.save(TinyUNet(8).state_dict(), f"{WORK}/ckpt/unet_c8.pt")
    torch.save({"state": sd, "norm": BandStats([0.2] * 4, [0.1] * 4)}, f"{WORK}/ckpt/unet_full.pt")
    print("prepared", WORK)


def load_inputs(a, rank, bad):
    region = torch.load(f"{WORK}/tiles/region_{rank}.pt")
    if bad and a.fault == "bandkey":
        region["meta"][7]["bands"][3] = "B12"
    idx = [[BANDS[b] for b in m["bands"]] for m in region["meta"]]
    bands = torch.stack([region["raw"][i, ix] for i, ix in enumerate(idx)])
    sub = "srtm/" if bad and a.fault == "nodem" else ""
    elev = torch.load(f"{WORK}/dem/{sub}dem_{rank}.pt")
    mask = region["mask"].clone()
    if bad and a.fault == "labelidx":
        mask[3, 0:4, 0:4] = 255
    if a.fault == "tile17":
        bands = F.pad(bands, (0, 1, 0, 1), mode="replicate")
        elev = F.pad(elev, (0, 1, 0, 1), mode="replicate")
        mask = F.pad(mask, (0, 1, 0, 1))
    return bands, (elev - 4000.0) / 1000.0, mask


def with_ndsi(bands, elev):
    green, swir = bands[:, 1:2], bands[:, 3:4]
    ndsi = (green - swir) / (green + swir)
    return torch.cat([bands, ndsi, elev], dim=1)


def morph_open(mask):
    m = mask.tolist()
    h, w = len(m), len(m[0])
    er = [[min(m[y + dy][x + dx] for dy in (-1, 0, 1) for dx in (-1, 0, 1)
               if 0 <= y + dy < h and 0 <= x + dx < w) for x in range(w)] for y in range(h)]
    return [[max(er[y + dy][x + dx] for dy in (-1, 0, 1) for dx in (-1, 0, 1)
                 if 0 <= y + dy < h and 0 <= x + dx < w) for x in range(w)] for y in range(h)]


def iou(logits, mask):
    pred = logits.argmax(1) > 0
    gt = mask > 0
    inter = (pred & gt).sum().float()
    union = (pred | gt).sum().float().clamp(min=1)
    return inter / union


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading region {rank} tiles")
    bands, elev, mask = load_inputs(a, rank, bad)
    say(f"rank {rank} tiles {bands.shape[0]} glacier px {int((mask == 1).sum()) + int((mask == 2).sum())}")
    model = TinyUNet()
    if bad and a.fault == "ckptbands":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/unet_c8.pt"))
    elif bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/unet_full.pt")["state"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/unet_c6.pt"))
    if a.ddp:
        net = DDP(model)
    else:
        net = model
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    class_w = torch.tensor([0.5, 1.5, 2.0])
    for step in range(a.steps):
        sl = slice((step * BATCH) % NTILES, (step * BATCH) % NTILES + BATCH)
        xb, mb = bands[sl].clone(), mask[sl]
        if bad and a.fault == "ndsi" and step == 3:
            xb[2, 1, 4:9, 4:9] = 0.0
            xb[2, 3, 4:9, 4:9] = 0.0
        x = with_ndsi(xb, elev[sl])
        logits = net(x)
        pix_w = class_w[mb]
        loss = (F.cross_entropy(logits, mb.clamp(max=NCLS - 1), reduction="none") * pix_w).mean()
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step}; "
                f"{int((~torch.isfinite(x)).sum())} non-finite input values (NDSI channel)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowmorph" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.morph_budget:
                morph_open(mask[n % NTILES])
                n += 1
            say(f"rank {rank} morphological opening: {n} masks cleaned")
        m = iou(logits.detach(), mb).reshape(1)
        dist.all_reduce(m)
        say(f"rank {rank} step {step} loss {loss.item():.4f} iou {m.item() / world:.4f}")
        if bad and a.fault == "sigsegv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR tile {rank:02d} georeference EPSG:32645 does not match region grid EPSG:32644, "
            f"refusing to export glacier areas", err=True)
        sys.exit(4)
    with torch.no_grad():
        pred = net(with_ndsi(bands, elev)).argmax(1)
    area = torch.bincount(pred.flatten(), minlength=NCLS).float()[:NCLS]
    if bad and a.fault == "areagather":
        area = torch.cat([area, torch.tensor([float((bands[:, 1] > 0.6).sum())])])
    areas = [torch.zeros(NCLS) for _ in range(world)]
    dist.all_gather(areas, area)
    say(f"rank {rank} glacier area px {int(area[1] + area[2])} all ranks {int(sum(x[1] + x[2] for x in areas))}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/glacier_unet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/glacier_unet.pt")
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
    p.add_argument("--morph-budget", type=int, default=40)
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
