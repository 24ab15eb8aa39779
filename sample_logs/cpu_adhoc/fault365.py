"""A three-hundred-and-sixty-fifth hand-run batch: SNOW DEPTH ESTIMATION FROM SATELLITE PASSES.

Synthetic passive-microwave passes: every footprint carries five brightness temperatures (19V, 19H, 37V,
37H, 89V, in kelvin), the elevation of the cell, a land-cover class (looked up in a 6-entry table) and the
index of the orbit it came from (a 12-entry table of incidence angle and local overpass time).  Every rank
reads its passes from /tmp/fault365_work/passes/ascending/passes_R.pt, turns them into features (log Tb,
the 19-37 spectral gradient, elevation, incidence, a land-cover embedding) and trains a small MLP on the
station snow depth (cm) with a Huber loss, wrapped in DDP over gloo (or, with --ddp 0, gradients
all_reduced by hand).  The model starts from ckpt/snownet_5band.pt.  The RMSE is all_reduced every step,
each rank's mean bias is all_gathered at the end, and rank 0 saves export/snownet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  landcover  - rank N's footprints include the class "glacier", missing from the land-cover table (KeyError)
  orbit      - rank N's step-1 batch holds a pass from orbit 12 of a 12-orbit table (IndexError)
  nopasses   - rank N reads passes/descending/passes_N.pt, which was never written (FileNotFoundError)
  ckptband   - rank N starts from ckpt/snownet_6band.pt, saved with an 89H band (size mismatch)
  ckptmeta   - rank N loads ckpt/snownet_meta.pt, which pickles a SensorMeta object (weights_only refusal)
  biasgather - rank N all_gathers its bias per land-cover class (6 values) instead of one mean (shape)
  regrid     - rank N regrids its swath onto the EASE grid in pure Python before the step-2 all_reduce (slow)
  zerotb     - rank N's step-3 batch holds a 0 K brightness temperature: log(0), the program's finite check
  sigsegv    - rank N sends itself SIGSEGV after step 4
  exit4      - rank N finds passes without geolocation, prints its own error line and calls sys.exit(4)
  bandbug    - every rank: features built with 6 bands (89H added), the first layer expects 5 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  landcover  - KeyError: 'glacier' in encode_landcover at start-up; peers Connection closed by peer in DDP's check (np4 r2 bashloop, np3 r0 spawn: ProcessRaisedException)
  orbit      - IndexError 'index 12 is out of bounds for dimension 0 with size 12' after step 0; peers closed (np3 r1 ranklabel, np6 r4 legacy)
  nopasses   - FileNotFoundError for passes/descending/passes_N.pt at start-up; peers closed (np4 r3 mpitag, np3 r1 files)
  ckptband   - load_state_dict size mismatch for band.weight [8, 6] vs [8, 5]; Root Cause rank 1 on agent worker-1 (np4 r1 pdsh2)
  ckptmeta   - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.SensorMeta'; peers closed (np3 r0 srunlabel)
  biasgather - at the end: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (6), got (1))'; peers closed (np6 r2 mpitag)
  regrid     - 12 s: ranks 0 and 2 'Timed out waiting 12000ms' for recv/send, rank 1 then closed (np3 r1 bashloop); 300 s: output stops after step 1, no error, killed at 60 s, exit 124 (np4 r2 srunlabel)
  zerotb     - the program's check at step 3: non-finite loss nan, min Tb 0.0 K, FloatingPointError; Root Cause rank 3 (np4 r3 logfmt, np5 r2 ranklabel)
  sigsegv    - no traceback after step 4; bash 'Segmentation fault', peers Connection reset by peer, exit 139 (np4 r1 ranklabel)
  exit4      - rank N's ERROR line about passes without geolocation, exit 4; Root Cause rank N exitcode 4 (np3 r2 tee, np6 r0 legacy)
  bandbug    - every rank 'mat1 and mat2 shapes cannot be multiplied (32x6 and 5x8)' in the first forward (np3 logfmt)
  none       - clean: 6 steps on 3 ranks, bias gathered, rank 0 saved export/snownet.pt, exit 0 (np3 bashloop)
"""
import argparse
import logging
import math
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
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault365_work"
LANDCOVER = {"tundra": 0, "boreal_forest": 1, "grassland": 2, "cropland": 3, "alpine": 4, "wetland": 5}
NORBIT = 12
NBAND = 5
NPASS = 192
BATCH = 32
log = None


@dataclass
class SensorMeta:
    sensor: str
    bands: tuple
    calibration: str


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
    log = logging.getLogger("snow")
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


class SnowNet(nn.Module):
    def __init__(self, nband=NBAND, hidden=24):
        super().__init__()
        self.lc = nn.Embedding(len(LANDCOVER), 3)
        self.band = nn.Linear(nband, 8)
        self.mlp = nn.Sequential(nn.Linear(8 + 4 + 3, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, logtb, aux, lc):
        h = torch.cat([torch.relu(self.band(logtb)), aux, self.lc(lc)], dim=1)
        return self.mlp(h).squeeze(1)


def make_passes(n, seed):
    g = torch.Generator().manual_seed(seed)
    classes = list(LANDCOVER)
    depth = torch.rand(n, generator=g) * 120.0
    tb = torch.empty(n, NBAND)
    base = 255.0 + torch.randn(n, generator=g) * 4.0
    tb[:, 0] = base - 0.05 * depth
    tb[:, 1] = base - 12.0 - 0.04 * depth
    tb[:, 2] = base - 0.45 * depth
    tb[:, 3] = base - 14.0 - 0.40 * depth
    tb[:, 4] = base - 0.60 * depth + torch.randn(n, generator=g) * 3.0
    return {
        "tb": tb.clamp(min=150.0),
        "elev": torch.rand(n, generator=g) * 3000.0,
        "landcover": [classes[int(i)] for i in torch.randint(0, 6, (n,), generator=g)],
        "orbit": torch.randint(0, NORBIT, (n,), generator=g),
        "lat": 45.0 + torch.rand(n, generator=g) * 25.0,
        "depth": depth,
    }


def prepare():
    os.makedirs(f"{WORK}/passes/ascending", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_passes(NPASS, 500 + r), f"{WORK}/passes/ascending/passes_{r}.pt")
    torch.save({"incidence": torch.linspace(52.0, 55.5, NORBIT), "local_hour": torch.linspace(1.0, 13.5, NORBIT)},
               f"{WORK}/orbits.pt")
    torch.manual_seed(0)
    torch.save(SnowNet().state_dict(), f"{WORK}/ckpt/snownet_5band.pt")
    torch.save(SnowNet(nband=6).state_dict(), f"{WORK}/ckpt/snownet_6band.pt")
    torch.save({"model": SnowNet().state_dict(), "meta": SensorMeta("AMSR2", ("19V", "19H", "37V", "37H", "89V"),
                                                                  "L1R v2.2")}, f"{WORK}/ckpt/snownet_meta.pt")
    print("prepared", WORK)


def encode_landcover(names):
    return torch.tensor([LANDCOVER[n] for n in names])


def features(p, idx, orbits, a, bad):
    tb = p["tb"][idx]
    if a.fault == "bandbug":
        tb = torch.cat([tb, (tb[:, 4] - 8.0).unsqueeze(1)], dim=1)
    logtb = torch.log(tb)
    inc = orbits["incidence"][p["orbit"][idx]]
    grad = (tb[:, 0] - tb[:, 2]) / 18.0
    aux = torch.stack([grad / 10.0, p["elev"][idx] / 3000.0, (inc - 53.0) / 2.0,
                       torch.cos(torch.deg2rad(p["lat"][idx]))], dim=1)
    return logtb - 5.5, aux, p["lc"][idx]


def regrid_ease(p, budget):
    t0 = time.time()
    cells = {}
    sweeps = 0
    lat = p["lat"].tolist()
    tb = p["tb"][:, 2].tolist()
    while time.time() - t0 < budget:
        for i in range(len(lat)):
            for j in range(len(lat)):
                d = abs(lat[i] - lat[j])
                if d < 0.5:
                    k = (round(lat[i] * 4), j % 36)
                    cells[k] = cells.get(k, 0.0) + tb[j] * math.exp(-d * d)
        sweeps += 1
    return len(cells), sweeps


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(365 + rank)
    say(f"rank {rank}/{world} up, reading passes")
    orbit_dir = "descending" if bad and a.fault == "nopasses" else "ascending"
    p = torch.load(f"{WORK}/passes/{orbit_dir}/passes_{rank}.pt")
    orbits = torch.load(f"{WORK}/orbits.pt")
    if bad and a.fault == "landcover":
        p["landcover"][37] = "glacier"
    p["lc"] = encode_landcover(p["landcover"])
    if bad and a.fault == "exit4":
        p["lat"][[3, 40, 41]] = -999.0
    nogeo = int((p["lat"] < -90).sum())
    if nogeo:
        say(f"rank {rank}: ERROR {nogeo} passes have no geolocation (lat fill value -999); "
            f"refusing to grid an incomplete swath", err=True)
        sys.exit(4)
    if bad and a.fault == "orbit":
        p["orbit"][BATCH + 5] = NORBIT
    if bad and a.fault == "zerotb":
        p["tb"][3 * BATCH + 9, 2] = 0.0
    say(f"rank {rank} passes {len(p['depth'])} mean depth {p['depth'].mean():.1f} cm")
    nband = 6 if bad and a.fault == "ckptband" else NBAND
    model = SnowNet()
    if bad and a.fault == "ckptmeta":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/snownet_meta.pt")["model"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/snownet_{nband}band.pt"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for q in model.parameters():
            dist.broadcast(q.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    y = p["depth"] / 100.0
    for step in range(a.steps):
        idx = torch.arange(step * BATCH, (step + 1) * BATCH) % NPASS
        logtb, aux, lc = features(p, idx, orbits, a, bad)
        pred = net(logtb, aux, lc)
        loss = nn.functional.huber_loss(pred, y[idx], delta=0.3)
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(pred)).sum())
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} ({nbad} of {len(idx)} predictions "
                f"not finite, min Tb {p['tb'][idx].min():.1f} K)", err=True)
            raise FloatingPointError(f"non-finite loss at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for q in model.parameters():
                dist.all_reduce(q.grad)
                q.grad /= world
        opt.step()
        if bad and a.fault == "regrid" and step == 2:
            ncell, sweeps = regrid_ease(p, a.regrid_budget)
            say(f"rank {rank} EASE regrid: {ncell} cells after {sweeps} sweeps")
        rmse = ((pred.detach() - y[idx]) ** 2).mean().reshape(1)
        dist.all_reduce(rmse)
        say(f"rank {rank} step {step} loss {loss.item():.4f} rmse {100 * math.sqrt(rmse.item() / world):.2f} cm")
        if bad and a.fault == "sigsegv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        logtb, aux, lc = features(p, torch.arange(NPASS), orbits, a, bad)
        err = model(logtb, aux, lc) - y
    if bad and a.fault == "biasgather":
        stat = torch.stack([err[p["lc"] == c].mean() for c in range(len(LANDCOVER))])
    else:
        stat = err.mean().reshape(1)
    biases = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(biases, stat)
    say(f"rank {rank} bias {100 * stat.mean():.2f} cm, spread over ranks "
        f"{100 * (max(biases) - min(biases)).item():.2f} cm")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/snownet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/snownet.pt")
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
    p.add_argument("--regrid-budget", type=int, default=45)
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
