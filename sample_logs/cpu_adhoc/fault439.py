"""A four-hundred-and-thirty-ninth hand-run batch: KELP FOREST CANOPY MAPPING FROM SATELLITE TILES.

Synthetic 4-band (blue, green, red, NIR) 16x16 surface-reflectance tiles of a rocky coast; every tile carries
a sensor name (its gain looked up in a sensor table), a tide height, and a per-pixel canopy mask (kelp where
NDVI over water is high).  Every rank reads its tiles from /tmp/fault439_work/tiles/tiles_R.pt, scales
the bands by the sensor gain, appends an NDVI channel (5 inputs) and trains a small fully convolutional
segmenter (conv-conv-1x1 head) on a BCE loss, wrapped in DDP (gloo) or, with --ddp 0, with gradients
all_reduced by hand.  The model is initialised from ckpt/kelpseg_c5.pt.  Per-rank pixel counts per class
(water, kelp) are all_gathered at the start, the loss and the canopy IoU are all_reduced every step, and
rank 0 saves export/kelpseg.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  sensor      - rank N's tiles name sensor "PlanetScope-SD", missing from the gain table (KeyError, start-up)
  tilemissing - rank N reads its tiles from tiles/2026Q3/ which does not exist (FileNotFoundError, start-up)
  ckptbands   - rank N initialises from ckpt/kelpseg_c6.pt, saved with 6 input channels (size mismatch)
  ckptpickle  - rank N initialises from ckpt/kelpseg_meta.pt, a pickled run record with a custom class
                (torch.load weights_only refuses it: UnpicklingError)
  classgather - rank N all_gathers its pixel counts with a third "cloud" class (3 vs 2 entries)
  tidescan    - rank N re-derives tide heights for every pixel in pure Python before the step-2 all_reduce
                (--scan-budget seconds; with PG timeout 12 s the peers time out)
  nodata      - rank N's tile 61 keeps the nodata fill (0) in red and NIR over water; NDVI is 0/0 there and
                the step-3 hard-tile pass (tiles 60-63) makes the loss NaN: the program's check raises
                FloatingPointError
  patchidx    - rank N's hard-example list at step 4 names tile 64 of 64 tiles (IndexError)
  segv        - rank N sends itself SIGSEGV after step 3
  exit2       - after the last step rank N's coastline QA prints an ERROR line and calls sys.exit(2)
  bandwidth   - every rank: tiles stacked with the SWIR band (6 channels), the first conv expects 5 (shape error)
  none        - control, clean run

What happened (filled in after the runs):
  sensor      - KeyError: 'PlanetScope-SD' in stack_tiles at start-up; peers Connection closed in all_gather (np4 r2 plain, np6 r0 tee)
  tilemissing - FileNotFoundError tiles/2026Q3/tiles_N.pt at start-up; peers Connection closed (np3 r1 pymodule, np4 r3 wrapper)
  ckptbands   - size mismatch for c1.weight [12,6,3,3] vs [12,5,3,3] (np4 r1 tee_trainer; np3 r2 redirects, only in rank 2's stderr.log)
  ckptpickle  - UnpicklingError 'Weights only load failed', Unsupported global __main__.RunRecord (np3 r0 loglevel)
  classgather - 'allgather: invalid tensor size at index 0 (expected (3), got (2))' (np3 r1 filter); under DETAIL every
                rank 'Detected mismatch between collectives', rank 2 TensorShape=[3], Root Cause rank 0 (np4 r2 detail)
  tidescan    - 12 s: ranks 0,1 'Timed out waiting 12000ms for recv', Root Cause rank 0 (np3 r2 plain); 300 s: silent
                after step 1, killed at 60 s, torchrun SignalException, exit 124 (np4 r1 loglevel)
  nodata      - 'loss is nan (N non-finite input values after NDVI)', FloatingPointError at step 3 (np6 r4 prefix;
                np3 r0 detail, peers' monitoredBarrier errors name rank 0)
  patchidx    - IndexError 'index 64 is out of bounds for dimension 0 with size 64' at step 4 (np6 r3 filter)
  segv        - Root Cause exitcode -11 (SIGSEGV) after step 3 (np8 r5 tee); with --max-restarts 1 the second attempt
                failed in Gloo connectFullMesh (Connection refused), final Root Cause rank 2 exitcode 1 (np4 r3 restart)
  exit2       - rank N's coastline QA ERROR line and exit 2 (np3 r2 pymodule, Root Cause exitcode 2); np4 r1 pdsh2: the
                exit ended in 'terminate called without an active exception', Root Cause rank 1 exitcode -6
  bandwidth   - every rank: 'expected input[16, 6, 16, 16] to have 5 channels, but got 6'; Root Cause rank 2 (np3 wrapper)
  none        - clean: 6 steps on 4 ranks, rank 0 saved export/kelpseg.pt, exit 0 (np4 tee_trainer)
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

WORK = "/tmp/fault439_work"
SENSORS = {"Landsat-8": 2.75e-5, "Landsat-9": 2.75e-5, "Sentinel-2A": 1e-4, "Sentinel-2B": 1e-4}
NTILE = 64
SIDE = 16
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
    log = logging.getLogger("kelp")
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


class KelpSeg(nn.Module):
    def __init__(self, cin=5, width=12):
        super().__init__()
        self.c1 = nn.Conv2d(cin, width, 3, padding=1)
        self.c2 = nn.Conv2d(width, width, 3, padding=1)
        self.head = nn.Conv2d(width, 1, 1)

    def forward(self, x):
        return self.head(F.relu(self.c2(F.relu(self.c1(x))))).squeeze(1)


class RunRecord:
    """What the old pipeline pickled next to its weights."""
    def __init__(self, state, scene):
        self.state = state
        self.scene = scene


def make_tiles(seed):
    g = torch.Generator().manual_seed(seed)
    sensors = list(SENSORS)
    tiles = []
    for i in range(NTILE):
        sensor = sensors[int(torch.randint(0, 4, (1,), generator=g))]
        gain = SENSORS[sensor]
        water = torch.rand(SIDE, SIDE, generator=g) < 0.7
        kelp = water & (torch.rand(SIDE, SIDE, generator=g) < 0.35)
        refl = torch.rand(4, SIDE, SIDE, generator=g) * 0.08
        refl[3] += kelp.float() * 0.25 + (~water).float() * 0.3
        refl[2] += (~water).float() * 0.1
        dn = (refl / gain).round()
        tiles.append({"dn": dn, "sensor": sensor, "tide": float(torch.rand(1, generator=g)) * 2.0,
                      "mask": kelp.float(), "water": water.float(), "swir": torch.rand(SIDE, SIDE, generator=g)})
    return tiles


def prepare():
    os.makedirs(f"{WORK}/tiles", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_tiles(400 + r), f"{WORK}/tiles/tiles_{r}.pt")
    torch.manual_seed(0)
    torch.save(KelpSeg(5).state_dict(), f"{WORK}/ckpt/kelpseg_c5.pt")
    torch.save(KelpSeg(6).state_dict(), f"{WORK}/ckpt/kelpseg_c6.pt")
    torch.save(RunRecord(KelpSeg(5).state_dict(), "LC08_042036_20260711"), f"{WORK}/ckpt/kelpseg_meta.pt")
    print("prepared", WORK)


def stack_tiles(tiles, a, bad):
    xs, ys = [], []
    for i, t in enumerate(tiles):
        refl = t["dn"] * SENSORS[t["sensor"]]
        if bad and a.fault == "nodata" and i == 61:
            refl[2:4] = torch.where(t["water"] > 0, 0.0, refl[2:4])
        ndvi = (refl[3] - refl[2]) / (refl[3] + refl[2])
        chans = [refl, ndvi[None]]
        if a.fault == "bandwidth":
            chans.append(t["swir"][None])
        xs.append(torch.cat(chans))
        ys.append(t["mask"])
    return torch.stack(xs), torch.stack(ys)


def tide_scan(tiles, budget):
    t0 = time.time()
    n = 0
    while time.time() - t0 < budget:
        for t in tiles:
            w = t["water"].tolist()
            for r in range(SIDE):
                for c in range(SIDE):
                    if w[r][c]:
                        n += int((t["tide"] * 1000 + r * 7 + c * 13) % 97 > 40)
    return n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(2026 + rank)
    say(f"rank {rank}/{world} up, loading tiles")
    quarter = "2026Q3/" if bad and a.fault == "tilemissing" else ""
    tiles = torch.load(f"{WORK}/tiles/{quarter}tiles_{rank}.pt")
    if bad and a.fault == "sensor":
        tiles[13]["sensor"] = "PlanetScope-SD"
    x, y = stack_tiles(tiles, a, bad)
    counts = torch.tensor([float((y == 0).sum()), float((y == 1).sum())])
    if bad and a.fault == "classgather":
        counts = torch.cat([counts, torch.tensor([float(SIDE * SIDE * 3)])])
    allc = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(allc, counts)
    kelp_frac = sum(c[1] for c in allc) / sum(c.sum() for c in allc)
    say(f"rank {rank} tiles {len(tiles)} kelp pixels {int(counts[1])} global kelp fraction {kelp_frac:.3f}")
    model = KelpSeg()
    ck = "kelpseg_c5.pt"
    if bad and a.fault == "ckptbands":
        ck = "kelpseg_c6.pt"
    if bad and a.fault == "ckptpickle":
        ck = "kelpseg_meta.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    pos_w = torch.tensor(2.0)
    for step in range(a.steps):
        idx = torch.arange(step * 8, step * 8 + 16) % NTILE
        if bad and a.fault == "patchidx" and step == 4:
            hard = [int(i) for i in idx[:4]] + [NTILE]
            say(f"rank {rank} step {step} adding hard examples {hard}")
            idx = torch.cat([idx, torch.stack([torch.arange(NTILE)[h] for h in hard])])
        logits = net(x[idx])
        loss = F.binary_cross_entropy_with_logits(logits, y[idx], pos_weight=pos_w)
        if bad and a.fault == "nodata" and step == 3:
            logits = net(x[60:64])
            loss = F.binary_cross_entropy_with_logits(logits, y[60:64], pos_weight=pos_w)
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(x[idx] if step != 3 or a.fault != "nodata" else x[60:64])).sum())
            say(f"rank {rank} step {step}: loss is {loss.item()} ({nbad} non-finite input values after NDVI)",
                err=True)
            raise FloatingPointError(f"non-finite canopy BCE loss at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "tidescan" and step == 2:
            n = tide_scan(tiles, a.scan_budget)
            say(f"rank {rank} tide scan: {n} submerged canopy pixels")
        pred = (logits.detach() > 0).float()
        yy = y[idx][: pred.shape[0]]
        inter = (pred * yy).sum()
        union = ((pred + yy) > 0).float().sum()
        stats = torch.stack([loss.detach(), inter / union.clamp(min=1)])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} iou {stats[1].item() / world:.4f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit2":
        say(f"rank {rank}: ERROR coastline QA failed: 11 of 64 tiles have canopy on land pixels "
            f"(misregistered by > 2 px); refusing to export the canopy map", err=True)
        sys.exit(2)
    fin = torch.ones(1)
    dist.all_reduce(fin)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/kelpseg.pt")
        say(f"rank 0 done: {a.steps} steps on {int(fin.item())} ranks, saved export/kelpseg.pt")
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
    p.add_argument("--scan-budget", type=int, default=90)
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
