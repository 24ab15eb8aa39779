"""A four-hundred-and-thirty-seventh hand-run batch: WILDFIRE SPREAD PREDICTION ON RASTER TILES.

Synthetic landscape tiles (32x32 cells): every cell has a fuel model code (looked up in a 6-entry fuel
table giving a fuel load and a spread factor), a fuel moisture fraction, an elevation from a DEM (slope is
its gradient), and every tile has a wind direction in degrees, bucketed into 8 compass sectors.  The input
is the burning mask at t, the target the burning mask at t+1 (a simple neighbour rule pushed by the wind).
Each rank reads tiles/tiles_R.pt and terrain/dem_R.pt under /tmp/fault437_work and trains FireNet (a wind
sector embedding broadcast as channels, three 3x3 convolutions, a per-cell logit, plus a linear head over
the flattened 32x32 logits that regresses the burned fraction) with BCE + MSE, in DDP over gloo (or with
gradients all_reduced by hand, --ddp 0).  The model is initialised from ckpt/firenet_c5.pt.  The loss and
IoU are all_reduced every step; the per-fuel-class burned cell counts are all_gathered at the end, and
rank 0 saves export/firenet.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1.

Faults:
  fueltype   - rank N's tile legend contains fuel model "TU5", missing from the fuel table (KeyError, start-up)
  windidx    - rank N at step 3 buckets wind 350 deg as sector round(350/45)=8 without wrapping (IndexError)
  nodem      - rank N reads its DEM from terrain_lidar/, which does not exist (FileNotFoundError, start-up)
  ckptsize   - rank N initialises from ckpt/firenet_c6.pt, saved with 6 input channels (size mismatch)
  ckptpickle - rank N initialises from ckpt/firenet_meta.pt, which pickles a RunMeta object (weights_only)
  burngather - rank N all_gathers 6 burned counts per fuel class (adds "unburnable") vs 5 (at the end)
  spotfire   - rank N runs a pure-Python ember spotting Monte Carlo before the step-2 all_reduce
  moistnan   - rank N's step-4 batch has moisture 0.0 (sensor dropout): log-moisture -inf, program's check
  segv       - rank N sends itself SIGSEGV after step 3
  exit4      - rank N prints an error about a stale weather feed at the end and calls sys.exit(4)
  gridshape  - every rank: tiles resampled to 40x40, the area head expects 32*32 inputs (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  fueltype   - KeyError: 'TU5' in build_batch at start-up, the others SIGTERMed before any step (np4 r2 tee, np6 r0 prefix)
  windidx    - 'IndexError: index out of range in self' in the wind embedding at step 3; peers Connection closed (np3 r1 loglevel, np5 r3 tee_trainer)
  nodem      - FileNotFoundError terrain_lidar/dem_N.pt at start-up (np4 r3 redirects: only in the log dir; np3 r0 wrapper)
  ckptsize   - size mismatch for c1.weight [16, 9, 3, 3] vs [16, 8, 3, 3]; pdsh2 node 1's ranks Connection closed in DDP init (np4 r1 pdsh2, np3 r2 pymodule)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.RunMeta' (np5 r4 filter)
  burngather - DETAIL: 'Detected mismatch between collectives ... Tensor shapes: 6vs 5' on every rank (np3 r1 detail);
               plain: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (6), got (5))' on rank 2 (np6 r2 plain)
  spotfire   - 12 s: peers 'Timed out waiting 12000ms for recv', Root Cause rank 1 (np3 r2 tee); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r1 plain)
  moistnan   - own check: '1024 non-finite input values', FloatingPointError at step 4 (np8 r5 loglevel; np4 r0 restart, whose
               attempt 1 died in gloo connectFullMesh 'Connection refused' at init, a stale peer address from attempt 0)
  segv       - no output from rank N after step 3; Root Cause exitcode -11 SIGSEGV (np4 r2 tee_trainer); np3 r1 restart: only the
               agent's '(exitcode: -11) local_rank: 1', then attempt 1 failed in connectFullMesh, final Root Cause rank 0
  exit4      - rank N's stale-feed ERROR line after step 5 and exit 4; Root Cause exitcode 4 (np5 r3 wrapper, np3 r0 pymodule logfmt)
  gridshape  - failed earlier than planned: every rank 'The size of tensor a (39) must match the size of tensor b (40)' in the
               slope line at start-up (the DEM is 40x40 too), not in the area head (np8 all detail)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/firenet.pt, exit 0 (np3 plain)
"""
import argparse
import logging
import math
import os
import random
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

WORK = "/tmp/fault437_work"
GRID = 32
FUELS = {"GR1": (0.1, 1.4), "GR2": (0.4, 1.2), "GS1": (0.6, 1.0), "SH2": (1.2, 0.8), "TL3": (0.9, 0.6),
         "TU1": (1.0, 0.7)}
CLASSES = ["grass", "grass-shrub", "shrub", "litter", "understory"]
log = None


@dataclass
class RunMeta:
    region: str
    season: int


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
    log = logging.getLogger("wfire")
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


class FireNet(nn.Module):
    def __init__(self, cin=5, grid=GRID):
        super().__init__()
        self.wind = nn.Embedding(8, 3)
        self.c1 = nn.Conv2d(cin + 3, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1)
        self.c3 = nn.Conv2d(16, 1, 3, padding=1)
        self.area = nn.Linear(grid * grid, 1)

    def forward(self, x, sector):
        w = self.wind(sector)[:, :, None, None].expand(-1, -1, x.shape[2], x.shape[3])
        h = torch.relu(self.c1(torch.cat([x, w], 1)))
        h = torch.relu(self.c2(h))
        logit = self.c3(h).squeeze(1)
        frac = torch.sigmoid(self.area(logit.flatten(1))).squeeze(1)
        return logit, frac


def spread(burn, fuel_rate, wind_deg):
    dy = round(-math.cos(math.radians(wind_deg)))
    dx = round(math.sin(math.radians(wind_deg)))
    nb = F.max_pool2d(burn[None, None], 3, 1, 1)[0, 0]
    pushed = torch.roll(burn, shifts=(dy, dx), dims=(0, 1))
    return ((nb * fuel_rate > 0.75) | (pushed > 0) | (burn > 0)).float()


def make_tiles(n, seed, grid=GRID):
    g = torch.Generator().manual_seed(seed)
    codes = list(FUELS)
    tiles = []
    for _ in range(n):
        fuel = torch.randint(0, len(codes), (grid, grid), generator=g)
        moist = 0.05 + 0.25 * torch.rand(grid, grid, generator=g)
        burn = torch.zeros(grid, grid)
        cy, cx = torch.randint(4, grid - 4, (2,), generator=g).tolist()
        burn[cy - 1:cy + 2, cx - 1:cx + 2] = 1.0
        wind = float(torch.randint(0, 360, (1,), generator=g))
        tiles.append({"fuel": fuel, "moist": moist, "burn": burn, "wind": wind})
    return {"legend": codes, "tiles": tiles}


def prepare():
    for d in ("tiles", "terrain", "ckpt", "tiles40"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_tiles(16, 700 + r), f"{WORK}/tiles/tiles_{r}.pt")
        torch.save(make_tiles(16, 700 + r, 40), f"{WORK}/tiles40/tiles_{r}.pt")
        g = torch.Generator().manual_seed(900 + r)
        torch.save(torch.cumsum(torch.rand(40, 40, generator=g), 0) * 12.0, f"{WORK}/terrain/dem_{r}.pt")
    torch.manual_seed(0)
    torch.save(FireNet(5).state_dict(), f"{WORK}/ckpt/firenet_c5.pt")
    torch.save(FireNet(6).state_dict(), f"{WORK}/ckpt/firenet_c6.pt")
    torch.save({"meta": RunMeta("sierra-foothills", 2025), "model": FireNet(5).state_dict()},
               f"{WORK}/ckpt/firenet_meta.pt")
    print("prepared", WORK)


def build_batch(data, dem, bad, a, step):
    grid = data["tiles"][0]["fuel"].shape[0]
    legend = list(data["legend"])
    if bad and a.fault == "fueltype":
        legend[4] = "TU5"
    load = torch.tensor([FUELS[c][0] for c in legend])
    rate = torch.tensor([FUELS[c][1] for c in legend])
    slope = (dem[1:grid + 1, :grid] - dem[:grid, :grid]) / 30.0
    xs, ys, sectors = [], [], []
    for i, t in enumerate(data["tiles"]):
        moist = t["moist"].clone()
        wind = t["wind"]
        if bad and a.fault == "moistnan" and step == 4 and i == 3:
            moist[:, :] = 0.0
        if bad and a.fault == "windidx" and step == 3 and i == 0:
            wind = 350.0
            sectors.append(int(round(wind / 45.0)))
        else:
            sectors.append(int(round(wind / 45.0)) % 8)
        r = rate[t["fuel"]]
        target = spread(t["burn"], r * (1 + slope.clamp(0, 1)), wind)
        xs.append(torch.stack([t["burn"], load[t["fuel"]], r, torch.log(moist), slope]))
        ys.append(target)
    return torch.stack(xs), torch.stack(ys), torch.tensor(sectors)


def ember_spotting(data, budget):
    random.seed(7)
    t0 = time.time()
    landed = 0
    while time.time() - t0 < budget:
        for t in data["tiles"]:
            b = t["burn"].tolist()
            for y in range(len(b)):
                for x in range(len(b[y])):
                    if b[y][x] > 0 and random.random() < 0.3:
                        dx, dy = random.gauss(0, 4), random.gauss(0, 4)
                        landed += 0 <= int(x + dx) < len(b) and 0 <= int(y + dy) < len(b)
    return landed


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4370 + rank)
    say(f"rank {rank}/{world} up, loading tiles and terrain")
    tdir = "tiles40" if a.fault == "gridshape" else "tiles"
    data = torch.load(f"{WORK}/{tdir}/tiles_{rank}.pt")
    ddir = "terrain_lidar" if bad and a.fault == "nodem" else "terrain"
    dem = torch.load(f"{WORK}/{ddir}/dem_{rank}.pt")
    x0, _, _ = build_batch(data, dem, bad, a, -1)
    say(f"rank {rank} tiles {x0.shape[0]} grid {x0.shape[2]}x{x0.shape[3]} burning cells {int(x0[:, 0].sum())}")
    model = FireNet()
    if bad and a.fault == "ckptsize":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/firenet_c6.pt"))
    elif bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/firenet_meta.pt")["model"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/firenet_c5.pt"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        x, y, sector = build_batch(data, dem, bad, a, step)
        if not torch.isfinite(x).all():
            say(f"rank {rank} step {step}: {int((~torch.isfinite(x)).sum())} non-finite input values "
                f"(log fuel moisture, min moisture {float(x[:, 3].exp().min()):.3f})", err=True)
            raise FloatingPointError(f"non-finite inputs on rank {rank} at step {step}")
        logit, frac = net(x, sector)
        loss = F.binary_cross_entropy_with_logits(logit, y) + F.mse_loss(frac, y.mean((1, 2)))
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "spotfire" and step == 2:
            say(f"rank {rank} ember spotting census (python Monte Carlo)")
            n = ember_spotting(data, a.spot_budget)
            say(f"rank {rank} embers landed {n}")
        pred = (logit.detach() > 0).float()
        iou = (pred * y).sum() / ((pred + y).clamp(max=1).sum() + 1e-6)
        stats = torch.stack([loss.detach(), iou])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} iou {stats[1].item() / world:.4f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"ERROR rank {rank}: weather station feed RAWS-{310 + rank} is 19 h stale (limit 6 h); "
            f"refusing to publish spread predictions", err=True)
        sys.exit(4)
    burned = torch.stack([y[torch.stack([t["fuel"] for t in data["tiles"]]) == c].sum()
                          for c in range(len(CLASSES))])
    if bad and a.fault == "burngather":
        burned = torch.cat([burned, torch.tensor([float((torch.stack([t["moist"] for t in data["tiles"]]) > 0.28).sum())])])
    allb = [torch.zeros(len(CLASSES)) for _ in range(world)]
    dist.all_gather(allb, burned)
    say(f"rank {rank} burned cells {int(burned.sum())} global {int(sum(b.sum() for b in allb))}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/firenet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/firenet.pt")
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
    p.add_argument("--spot-budget", type=int, default=45)
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
