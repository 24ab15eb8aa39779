"""Batch 396 of hand-run faults: LAND COVER CLASSIFICATION FROM MULTISPECTRAL TILES.

Synthetic Sentinel-2-like tiles: 6 bands (B02 blue, B03 green, B04 red, B08 nir, B11 swir1, B12 swir2) of
16x16 pixels stored as integer digital numbers with a reflectance scale of 1e-4, one land cover code per
tile (WorldCover-style codes 10..90, mapped to 8 classes through CODES).  Every rank reads its tiles from
/tmp/fault396_work/tiles/tiles_R.pt, converts them to reflectance, appends an NDVI channel (7 inputs) and
trains a small CNN (stem conv stride 2, conv, avg-pool, flatten, linear head) with cross entropy, wrapped in
DDP over gloo (or, with --ddp 0, gradients all_reduced by hand).  The model starts from ckpt/lcnet_7ch.pt.
Per-rank class histograms are all_gathered at start-up, the loss and accuracy are all_reduced every step,
per-rank accuracies are all_gathered at the end and rank 0 saves export/lcnet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  classcode  - rank N's labels contain code 95 (mangroves), missing from the class table (KeyError, start-up)
  bandidx    - rank N looks up the nir band as "B8A" -> index 6 of a 6-band tile (IndexError, first step)
  notiles    - rank N reads its tiles from tiles/val/ which does not exist (FileNotFoundError, start-up)
  ckptbands  - rank N initialises from ckpt/lcnet_11ch.pt, saved for 11 input channels (size mismatch)
  ckptpickle - rank N initialises from ckpt/lcnet_meta.pt, which pickles a BandStats object (weights_only)
  histgather - rank N all_gathers its class histogram plus a no-data count (9 vs 8 entries)
  cloudmask  - rank N runs a per-pixel cloud mask in Python before the step-2 all_reduce (--mask-budget s)
  nodata     - rank N's step-3 batch has zero-filled no-data tiles: NDVI 0/0, the program's finiteness check
  sigsegv    - rank N sends itself SIGSEGV after step 4
  exit2      - rank N finds its tile grid in another CRS at the end, prints an error line and sys.exit(2)
  patchdim   - every rank: the pooling is skipped, the head gets 32x8x8 features instead of 32x4x4 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  classcode  - KeyError: 95 in the class-code lookup at start-up; peers Connection closed by peer in all_gather (np4 r2 bashloop, np6 r0 logfmt)
  bandidx    - IndexError 'index 6 is out of bounds for dimension 1 with size 6' in features at step 0; peers closed (np3 r1 ranklabel, np5 r3 spawn)
  notiles    - FileNotFoundError for tiles/val/tiles_N.pt at start-up; peers closed (np4 r3 mpitag, np3 r1 files)
  ckptbands  - load_state_dict size mismatch stem.weight [16,11,3,3] vs [16,7,3,3] (np3 r2 legacy; np4 r1 pdsh2, then SIGABRT)
  ckptpickle - UnpicklingError 'Weights only load failed' (__main__.BandStats not allowed) on rank 0 (np3 r0 tee)
  histgather - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (9), got (8))' on rank N (np6 r4 srunlabel, np3 r1 spawn)
  cloudmask  - 12 s: ranks 0, 1 'Timed out waiting 12000ms for recv' (np3 r2 bashloop); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r1 srunlabel)
  nodata     - 1024 non-finite inputs, FloatingPointError at step 3 (np6 r5 ranklabel, np4 r2 tee --ddp 0); an np8 run was dropped (loop.sh bug, exit 127)
  sigsegv    - no traceback after step 4; bash 'Segmentation fault', exit 139 (np4 r1 mpitag); Root Cause rank 0 exitcode -11 (np3 r0 legacy)
  exit2      - rank 3's EPSG:32633 ERROR line and exit 2 at the end; Root Cause exitcode 2 (np5 r3 logfmt)
  patchdim   - every rank 'mat1 and mat2 shapes cannot be multiplied (16x2048 and 512x8)'; Root Cause rank 0 (np3 tee)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/lcnet.pt, exit 0 (np3 bashloop)
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

WORK = "/tmp/fault396_work"
BANDS = {"B02": 0, "B03": 1, "B04": 2, "B08": 3, "B11": 4, "B12": 5}
CODES = {10: 0, 20: 1, 30: 2, 40: 3, 50: 4, 60: 5, 80: 6, 90: 7}
NCLS = 8
TILE = 16
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
    log = logging.getLogger("landcover")
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


class BandStats:
    """Per-band mean/std of the training archive, kept next to the weights in lcnet_meta.pt."""

    def __init__(self, mean, std):
        self.mean = mean
        self.std = std


class LCNet(nn.Module):
    def __init__(self, in_ch=7, ncls=NCLS):
        super().__init__()
        self.stem = nn.Conv2d(in_ch, 16, 3, stride=2, padding=1)
        self.conv = nn.Conv2d(16, 32, 3, padding=1)
        self.head = nn.Linear(32 * 4 * 4, ncls)

    def forward(self, x, skip_pool=False):
        h = F.relu(self.stem(x))
        h = F.relu(self.conv(h))
        if not skip_pool:
            h = F.avg_pool2d(h, 2)
        return self.head(h.flatten(1))


def make_tiles(n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = list(CODES)
    lab = [codes[int(i)] for i in torch.randint(0, NCLS, (n,), generator=g)]
    base = torch.rand(NCLS, 6, generator=g) * 3000 + 200
    dn = torch.stack([base[CODES[c]] for c in lab])[:, :, None, None]
    dn = dn + torch.randn(n, 6, TILE, TILE, generator=g) * 150
    return {"dn": dn.clamp(1, 10000).to(torch.int16), "codes": lab, "scale": 1e-4, "crs": "EPSG:32632"}


def prepare():
    for d in ("tiles", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_tiles(128, 500 + r), f"{WORK}/tiles/tiles_{r}.pt")
    torch.manual_seed(0)
    torch.save(LCNet(7).state_dict(), f"{WORK}/ckpt/lcnet_7ch.pt")
    torch.save(LCNet(11).state_dict(), f"{WORK}/ckpt/lcnet_11ch.pt")
    meta = {"model": LCNet(7).state_dict(), "stats": BandStats([0.1] * 6, [0.05] * 6)}
    torch.save(meta, f"{WORK}/ckpt/lcnet_meta.pt")
    print("prepared", WORK)


def features(dn, scale, nir_key="B08"):
    refl = dn.float() * scale
    red = refl[:, BANDS["B04"]]
    nir = refl[:, BANDS[nir_key]] if nir_key in BANDS else refl[:, 6]
    ndvi = (nir - red) / (nir + red)
    return torch.cat([refl, ndvi.unsqueeze(1)], 1)


def cloud_mask(dn, budget):
    t0 = time.time()
    cloudy = 0
    while time.time() - t0 < budget:
        for t in range(dn.shape[0]):
            for i in range(TILE):
                for j in range(TILE):
                    b = int(dn[t, 0, i, j])
                    s = int(dn[t, 4, i, j])
                    if b > 2500 and s > 2000:
                        cloudy += 1
    return cloudy


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4242 + rank)
    say(f"rank {rank}/{world} up, reading tiles")
    split = "val/" if bad and a.fault == "notiles" else ""
    data = torch.load(f"{WORK}/tiles/{split}tiles_{rank}.pt")
    if bad and a.fault == "classcode":
        data["codes"][37] = 95
    y = torch.tensor([CODES[c] for c in data["codes"]])
    hist = torch.bincount(y, minlength=NCLS).float()
    if bad and a.fault == "histgather":
        hist = torch.cat([hist, torch.tensor([3.0])])
    allh = [torch.zeros(NCLS) for _ in range(world)]
    dist.all_gather(allh, hist)
    glob = torch.stack(allh).sum(0)
    say(f"rank {rank} tiles {len(y)} global class histogram {glob.int().tolist()}")
    model = LCNet()
    ck = {"ckptbands": "lcnet_11ch.pt", "ckptpickle": "lcnet_meta.pt"}.get(a.fault, "lcnet_7ch.pt") if bad \
        else "lcnet_7ch.pt"
    sd = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    nir_key = "B8A" if bad and a.fault == "bandidx" else "B08"
    if bad and a.fault == "bandidx":
        BANDS["B8A"] = 6
    n = len(y)
    for step in range(a.steps):
        lo = (step * BATCH) % n
        dn = data["dn"][lo:lo + BATCH].clone()
        yb = y[lo:lo + BATCH]
        if bad and a.fault == "nodata" and step == 3:
            dn[5:9] = 0
        x = features(dn, data["scale"], nir_key)
        nonfin = int((~torch.isfinite(x)).sum())
        if nonfin:
            say(f"rank {rank} step {step}: {nonfin} non-finite input values in batch (NDVI of no-data pixels)",
                err=True)
            raise FloatingPointError(f"non-finite NDVI in batch {step} on rank {rank}")
        out = net(x, skip_pool=(a.fault == "patchdim"))
        loss = F.cross_entropy(out, yb)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "cloudmask" and step == 2:
            c = cloud_mask(data["dn"], a.mask_budget)
            say(f"rank {rank} cloud mask: {c} cloudy pixels")
        acc = (out.argmax(1) == yb).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        stats /= world
        say(f"rank {rank} step {step} loss {stats[0].item():.4f} acc {stats[1].item():.3f}")
        if bad and a.fault == "sigsegv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit2":
        say(f"rank {rank}: ERROR tile grid of tiles_{rank}.pt is EPSG:32633 but the job grid is "
            f"{data['crs']}; refusing to merge predictions from another UTM zone", err=True)
        sys.exit(2)
    accs = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(accs, acc.reshape(1))
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/lcnet.pt")
        say(f"rank 0 done: {a.steps} steps, per-rank acc {[round(t.item(), 3) for t in accs]}, "
            f"saved export/lcnet.pt")
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
    p.add_argument("--mask-budget", type=int, default=25)
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
