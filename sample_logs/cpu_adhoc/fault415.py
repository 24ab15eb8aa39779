"""A four-hundred-and-fifteenth hand-run batch: LANDSLIDE SUSCEPTIBILITY MAPPING.

Every rank owns one 64x64 terrain tile (/tmp/fault415_work/tiles/tile_R.pt): a DEM, slope, aspect,
plan curvature and a rainfall raster (mm/yr), a lithology grid coded through the tile's legend (looked up
in an 8-entry LITHO table), and a landslide inventory of (row, col, label) points.  A small CNN reads 9x9
patches of six bands (elevation, slope, sin/cos aspect, curvature, log rainfall) around each inventory
point, adds a lithology embedding, and predicts susceptibility (BCE loss).  DDP over gloo (or --ddp 0:
gradients all_reduced by hand); the model is initialised from ckpt/susc_b6.pt.  Every step the loss is
checked for non-finite values and the accuracy is all_reduced; at the end each rank all_gathers its
10-bin slope histogram of landslide points and rank 0 saves export/susceptibility.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress through logging).

Faults (--fault NAME --rank R, R = -1 for every rank):
  lithology  - rank N's legend has "serpentinite", missing from the LITHO table (KeyError, start-up)
  nodem      - rank N reads its tile from tiles/v2/ which does not exist (FileNotFoundError, start-up)
  pointidx   - rank N's inventory has a point at row 70 on a 64-row tile, sampled at step 3 (IndexError)
  ckptbands  - rank N initialises from ckpt/susc_b7.pt, saved for 7 input bands (size mismatch)
  ckptmeta   - rank N loads ckpt/susc_meta.pt, which pickles a TileMeta object (weights_only refusal)
  histgather - rank N all_gathers a 12-bin slope histogram at the end (12 vs 10 entries)
  flowacc    - rank N runs a pure-Python D8 flow accumulation before the step-2 all_reduce (--flow-budget s)
  nodata     - rank N's rainfall has -9999 nodata under the step-2 batch: log1p gives NaN, the loss check
  sigsegv    - rank N sends itself SIGSEGV after step 3
  crs        - rank N prints its own error about a CRS mismatch after training and calls sys.exit(5)
  twiband    - every rank stacks a seventh band (TWI); the first conv expects 6 channels (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  lithology  - KeyError: 'serpentinite' building the lithology lookup at start-up; others SIGTERMed (np4 r2 plain, np6 r0 tee)
  nodem      - FileNotFoundError for tiles/v2/tile_N.pt at start-up (np5 r4 loglevel; np3 r1 redirects: only in rank 1's stderr.log)
  pointidx   - IndexError 'index 70 is out of bounds for dimension 0 with size 64' at step 3; peers Connection closed (np4 r3 tee_trainer, np8 r5 pymodule)
  ckptbands  - size mismatch for conv1.weight [16, 7, 3, 3] vs [16, 6, 3, 3] (np4 r1 pdsh2; np3 r0 restart, both attempts)
  ckptmeta   - _pickle.UnpicklingError: Weights only load failed (np5 r2 prefix)
  histgather - DETAIL: every rank 'Detected mismatch between collectives', rank 3 TensorShape=[12] (np6 r3 detail, --ddp 0);
               'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (12), got (10))' on rank 1 (np3 r1 filter)
  flowacc    - 12 s: ranks 0, 1 'Timed out waiting 12000ms for recv' in the step-2 all_reduce, rank 2 SIGTERMed (np3 r2 plain);
               300 s: steps 0-1 then silence, killed by timeout at 60 s, exit 124 (np4 r1 wrapper)
  nodata     - the nodata pixels also fall inside 9x9 patches of earlier batches, so the loss check fired at step 1 (np4 r0 tee)
               and step 0 (np6 r4 filter), not step 2: FloatingPointError after 'loss is nan'
  sigsegv    - exitcode -11 after step 3, peers Connection closed/reset (np3 r1 tee_trainer); with --max-restarts 1 (np4 r2)
               the second attempt never formed its group: every rank 'Gloo connectFullMesh failed ... Connect timeout'
  crs        - rank 6's own ERROR line about EPSG:32633 vs EPSG:4326, exit 5; Root Cause rank 6 exitcode 5 (np8 r6 pymodule)
  twiband    - every rank: 'expected input[16, 7, 9, 9] to have 6 channels, but got 7 channels instead' (np3 loglevel)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/susceptibility.pt, exit 0 (np3 prefix)
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

WORK = "/tmp/fault415_work"
LITHO = {"granite": 0, "gneiss": 1, "schist": 2, "sandstone": 3, "shale": 4, "limestone": 5,
         "colluvium": 6, "alluvium": 7}
TILE = 64
PATCH = 9
BATCH = 16
log = None


class TileMeta:
    def __init__(self, crs, res):
        self.crs = crs
        self.res = res


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
    log = logging.getLogger("lsdt")
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


class SusceptibilityCNN(nn.Module):
    def __init__(self, bands=6, nlitho=len(LITHO), dim=16):
        super().__init__()
        self.conv1 = nn.Conv2d(bands, dim, 3, padding=1)
        self.conv2 = nn.Conv2d(dim, dim, 3, padding=1)
        self.litho = nn.Embedding(nlitho, dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, patches, litho):
        h = F.relu(self.conv1(patches))
        h = F.relu(self.conv2(h)).mean(dim=(2, 3))
        return self.head(h + self.litho(litho)).squeeze(1)


def make_tile(seed):
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(TILE).float(), torch.arange(TILE).float(), indexing="ij")
    dem = 400 + 8 * yy + 30 * torch.sin(xx / 7) + 5 * torch.randn(TILE, TILE, generator=g)
    gy, gx = torch.gradient(dem)
    slope = torch.rad2deg(torch.atan(torch.sqrt(gx ** 2 + gy ** 2) / 10.0))
    aspect = torch.atan2(gy, gx)
    curv = torch.gradient(gx)[1] + torch.gradient(gy)[0]
    rain = 1200 + 300 * torch.rand(TILE, TILE, generator=g)
    legend = ["granite", "schist", "sandstone", "shale", "colluvium"]
    litho_idx = (yy // 13).long().clamp(max=len(legend) - 1)
    pts = []
    for _ in range(128):
        r, c = [int(v) for v in torch.randint(0, TILE, (2,), generator=g)]
        p = torch.sigmoid((slope[r, c] - 25) / 5 + 0.5 * curv[r, c])
        pts.append((r, c, int(torch.rand(1, generator=g) < p)))
    return {"dem": dem, "slope": slope, "aspect": aspect, "curv": curv, "rain": rain,
            "legend": legend, "litho_idx": litho_idx, "points": pts, "crs": "EPSG:32633"}


def prepare():
    for d in ("tiles", "ckpt", "export", "logs"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_tile(300 + r), f"{WORK}/tiles/tile_{r}.pt")
    torch.manual_seed(0)
    torch.save(SusceptibilityCNN(6).state_dict(), f"{WORK}/ckpt/susc_b6.pt")
    torch.save(SusceptibilityCNN(7).state_dict(), f"{WORK}/ckpt/susc_b7.pt")
    torch.save({"model": SusceptibilityCNN(6).state_dict(), "meta": TileMeta("EPSG:32633", 10.0)},
               f"{WORK}/ckpt/susc_meta.pt")
    print("prepared", WORK)


def stack_bands(t, twi):
    bands = [(t["dem"] - t["dem"].mean()) / t["dem"].std(), t["slope"] / 45.0, torch.sin(t["aspect"]),
             torch.cos(t["aspect"]), t["curv"], torch.log1p(t["rain"]) - 7.0]
    if twi:
        bands.append(torch.log1p(torch.ones(TILE, TILE) * 3.0))
    x = torch.stack(bands)
    return F.pad(x, (PATCH // 2,) * 4, mode="replicate")


def make_batch(t, x, lid, pts):
    patches, lits, ys = [], [], []
    for r, c, y in pts:
        _ = t["dem"][r, c]  # centre elevation, read for the tile statistics
        patches.append(x[:, r:r + PATCH, c:c + PATCH])
        lits.append(lid[min(r, TILE - 1), min(c, TILE - 1)])
        ys.append(float(y))
    return torch.stack(patches), torch.stack(lits), torch.tensor(ys)


def flow_accumulation(dem, budget):
    t0 = time.time()
    n, sweeps = dem.shape[0], 0
    z = dem.tolist()
    while time.time() - t0 < budget:
        acc = [[1.0] * n for _ in range(n)]
        order = sorted(((z[i][j], i, j) for i in range(n) for j in range(n)), reverse=True)
        for _, i, j in order:
            best, bi, bj = 0.0, -1, -1
            for di in (-1, 0, 1):
                for dj in (-1, 0, 1):
                    a, b = i + di, j + dj
                    if 0 <= a < n and 0 <= b < n and (di or dj):
                        drop = (z[i][j] - z[a][b]) / math.hypot(di, dj)
                        if drop > best:
                            best, bi, bj = drop, a, b
            if bi >= 0:
                acc[bi][bj] += acc[i][j]
        sweeps += 1
    return sweeps, max(max(row) for row in acc)


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4150 + rank)
    say(f"rank {rank}/{world} up, reading terrain tile {rank}")
    sub = "v2/" if bad and a.fault == "nodem" else ""
    t = torch.load(f"{WORK}/tiles/{sub}tile_{rank}.pt")
    if bad and a.fault == "lithology":
        t["legend"][3] = "serpentinite"
    if bad and a.fault == "pointidx":
        t["points"][3 * BATCH + 5] = (70, 12, 1)
    if bad and a.fault == "nodata":
        for r, c, _ in t["points"][2 * BATCH:2 * BATCH + 4]:
            t["rain"][r, c] = -9999.0
    lmap = torch.tensor([LITHO[name] for name in t["legend"]])
    lid = lmap[t["litho_idx"]]
    x = stack_bands(t, a.fault == "twiband" and bad)
    model = SusceptibilityCNN(6)
    if bad and a.fault == "ckptmeta":
        state = torch.load(f"{WORK}/ckpt/susc_meta.pt")["model"]
    else:
        state = torch.load(f"{WORK}/ckpt/{'susc_b7.pt' if bad and a.fault == 'ckptbands' else 'susc_b6.pt'}")
    model.load_state_dict(state)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    say(f"rank {rank} tile ready: {len(t['points'])} inventory points, {int(sum(p[2] for p in t['points']))} slides")
    for step in range(a.steps):
        pts = t["points"][step * BATCH:(step + 1) * BATCH]
        patches, lits, ys = make_batch(t, x, lid, pts)
        logits = net(patches, lits)
        loss = F.binary_cross_entropy_with_logits(logits, ys)
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(patches)).flatten(1).any(1).sum())
            say(f"rank {rank}: loss is {loss.item()} at step {step}; {nbad} patches hold non-finite rainfall", err=True)
            raise FloatingPointError(f"non-finite susceptibility loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "flowacc" and step == 2:
            sweeps, amax = flow_accumulation(t["dem"], a.flow_budget)
            say(f"rank {rank} D8 flow accumulation: {sweeps} sweeps, max contributing cells {amax:.0f}")
        acc = ((logits.detach() > 0).float() == ys).float().mean().reshape(1)
        dist.all_reduce(acc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc.item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "crs":
        say(f"rank {rank}: ERROR tile {rank} CRS {t['crs']} does not match the mosaic CRS EPSG:4326, "
            f"refusing to write susceptibility scores", err=True)
        sys.exit(5)
    sl = torch.tensor([float(t["slope"][r, c]) for r, c, y in t["points"] if y])
    nb = 12 if bad and a.fault == "histgather" else 10
    hist = torch.histc(sl, bins=nb, min=0, max=60)
    allh = [torch.zeros(10) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} slide slopes: {int(hist.sum())} local, {int(sum(h.sum() for h in allh))} global")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/susceptibility.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/susceptibility.pt")
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
    p.add_argument("--flow-budget", type=int, default=40)
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
