"""A three-hundred-and-eighty-first hand-run batch: POWER GRID LOAD FORECASTING.

Synthetic hourly load for 8 grid zones: every rank reads two weeks of metered load from
/tmp/fault381_work/meters/meters_R.pt (per-feeder series, mapped to zones through the feeder table
grid/feeders.pt), a temperature series and a list of holiday days.  Windows of 24 hours of
[load, temperature, hour sin, hour cos, holiday flag] plus a zone embedding go into a small GRU forecaster
that predicts the next 6 hours (MSE on normalised load).  The model is initialised from ckpt/gru_z8.pt and
wrapped in DDP over gloo (or, with --ddp 0, gradients are all_reduced by hand).  Per-rank zone peaks are
all_gathered at start-up, the MAPE is all_reduced every step, the per-rank validation MAPE is all_gathered at
the end, and rank 0 saves export/loadgru.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  feeder     - rank N's meter file names feeder "F-0917" which the feeder table lacks (KeyError, start-up)
  holiday    - rank N's holiday list has day 366 (leap year) for a 365-day calendar (IndexError, first step)
  nometer    - rank N reads meters/2025/meters_N.pt, a folder that does not exist (FileNotFoundError)
  ckptzones  - rank N initialises from ckpt/gru_z12.pt, saved with 12 zones (size mismatch in load_state_dict)
  ckptpickle - rank N loads ckpt/gru_scaler.pt, which pickles a LoadScaler object (weights_only refusal)
  zonegather - rank N all_gathers its zone peaks plus a district-heating zone (9 vs 8 entries)
  slowpeak   - rank N recomputes every feeder's daily peak in pure Python before the step-2 all_reduce
  negload    - at step 3 rank N's batch carries a 1e39 meter sentinel (inf in float32); the loss check raises
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit5      - after the last step rank N prints its own error line about a frequency excursion, sys.exit(5)
  horizon    - every rank: targets 12 hours ahead, the head predicts 6 (shape error in the loss)
  none       - control, clean run

What happened (filled in after the runs):
  feeder     - KeyError: 'F-0917' in zone_loads at start-up; peers Connection closed in the zone-peak all_gather (np4 r2 bashloop, np6 r0 tee)
  holiday    - IndexError 'index 366 is out of bounds for dimension 0 with size 365' before step 0 (np3 r1 spawn, np4 r3 mpitag)
  nometer    - FileNotFoundError for meters/2025/meters_3.pt; peers closed in the first all_gather (np4 r3 srunlabel)
  ckptzones  - load_state_dict size mismatch for zone.weight [12, 4] vs [8, 4]; worker-0 agent RendezvousConnectionError (np4 r1 pdsh2); not run on legacy (time)
  ckptpickle - UnpicklingError 'Weights only load failed ... GLOBAL __main__.LoadScaler' (np3 r0 logfmt; np6 r4 ranklabel, exit 124 on a loaded machine)
  zonegather - rank N: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (9), got (8))'; peers closed (np4 r1 files)
  slowpeak   - 12 s: peers 'Timed out waiting 12000ms' in the step-2 all_reduce (np3 r1 bashloop); 300 s: no step printed before the 60 s kill, exit 124 (np4 r2 srunlabel)
  negload    - rank N's loss stayed finite but DDP spread NaN grads: every rank 'FloatingPointError: loss is nan ... at step 4' (np3 r2 logfmt; np4 r0 spawn --ddp 0)
  sigsegv    - rank N silent after step 3, peers closed/reset in the step-4 backward, loop exit 139 (np4 r3 ranklabel, np6 r5 mpitag)
  exit5      - rank N's 'frequency excursion' ERROR line and exit 5; peers closed in the final all_gather (np3 r2 tee exit 1; np6 r1 files exit 5)
  horizon    - every rank: 'The size of tensor a (6) must match the size of tensor b (12) at non-singleton dimension 1'; Root Cause rank 1 (np3 legacy)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/loadgru.pt, exit 0 (np3 bashloop)
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

WORK = "/tmp/fault381_work"
ZONES = 8
WIN = 24
HOR = 6
HOURS = 24 * 14
log = None


class LoadScaler:
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
    log = logging.getLogger("gridload")
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


class LoadGRU(nn.Module):
    def __init__(self, zones=ZONES, feat=5, hid=16, hor=HOR):
        super().__init__()
        self.zone = nn.Embedding(zones, 4)
        self.gru = nn.GRU(feat, hid, batch_first=True)
        self.head = nn.Linear(hid + 4, hor)

    def forward(self, x, z):
        _, h = self.gru(x)
        return self.head(torch.cat([h[-1], self.zone(z)], 1))


def prepare():
    for d in ("meters", "grid", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    feeders = {f"F-{z:02d}{k:02d}": z for z in range(ZONES) for k in range(3)}
    torch.save(feeders, f"{WORK}/grid/feeders.pt")
    for r in range(8):
        g = torch.Generator().manual_seed(500 + r)
        t = torch.arange(HOURS, dtype=torch.float32)
        temp = 8 + 6 * torch.sin(2 * math.pi * (t - 14) / 24) + torch.randn(HOURS, generator=g)
        series = {}
        for fid, z in feeders.items():
            base = 20 + 3 * z
            daily = 1 + 0.35 * torch.sin(2 * math.pi * (t - 18) / 24)
            series[fid] = base * daily + 0.4 * (12 - temp).clamp(min=0) + torch.randn(HOURS, generator=g)
        torch.save({"series": series, "temp": temp, "holidays": [3, 10], "day0": 300},
                   f"{WORK}/meters/meters_{r}.pt")
    torch.manual_seed(0)
    torch.save(LoadGRU(8).state_dict(), f"{WORK}/ckpt/gru_z8.pt")
    torch.save(LoadGRU(12).state_dict(), f"{WORK}/ckpt/gru_z12.pt")
    torch.save({"model": LoadGRU(8).state_dict(), "scaler": LoadScaler(25.0, 9.0)}, f"{WORK}/ckpt/gru_scaler.pt")
    print("prepared", WORK)


def zone_loads(meters, feeders):
    load = torch.zeros(HOURS, ZONES)
    for fid, s in meters["series"].items():
        load[:, feeders[fid]] += s
    return load


def make_batch(load, temp, meters, g, n=64, hor=HOR):
    cal = torch.zeros(365)
    for d in meters["holidays"]:
        cal[d] = 1.0
    t = torch.arange(HOURS)
    day = (meters["day0"] + t // 24) % 365
    hol = cal[day]
    hs, hc = torch.sin(2 * math.pi * (t % 24) / 24), torch.cos(2 * math.pi * (t % 24) / 24)
    start = torch.randint(0, HOURS - WIN - hor, (n,), generator=g)
    zone = torch.randint(0, ZONES, (n,), generator=g)
    idx = start[:, None] + torch.arange(WIN)[None]
    x = torch.stack([load[idx, zone[:, None]], temp[idx], hs[idx], hc[idx], hol[idx]], -1)
    y = load[start[:, None] + WIN + torch.arange(hor)[None], zone[:, None]]
    return x, zone, y


def daily_peaks(meters, budget):
    t0, n = time.time(), 0
    while time.time() - t0 < budget:
        for fid, s in meters["series"].items():
            vals = s.tolist()
            for d in range(len(vals) // 24):
                day = vals[d * 24:(d + 1) * 24]
                n += sorted(day)[-1] > sum(day) / 24
    return n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    g = torch.Generator().manual_seed(4000 + rank)
    torch.manual_seed(1234)
    say(f"rank {rank}/{world} up, reading meter data")
    sub = "2025/" if bad and a.fault == "nometer" else ""
    meters = torch.load(f"{WORK}/meters/{sub}meters_{rank}.pt")
    feeders = torch.load(f"{WORK}/grid/feeders.pt")
    if bad and a.fault == "feeder":
        meters["series"]["F-0917"] = meters["series"].pop("F-0702")
    if bad and a.fault == "holiday":
        meters["holidays"].append(366)
    load = zone_loads(meters, feeders)
    mu, sd = load.mean(), load.std()
    loadn = (load - mu) / sd
    peaks = load.max(0).values
    if bad and a.fault == "zonegather":
        peaks = torch.cat([peaks, torch.tensor([41.5])])
    allp = [torch.zeros(ZONES) for _ in range(world)]
    dist.all_gather(allp, peaks)
    say(f"rank {rank} zone peaks max {peaks.max():.1f} MW, system peak {torch.stack(allp).max():.1f} MW")
    model = LoadGRU()
    ck = {"ckptzones": "gru_z12.pt", "ckptpickle": "gru_scaler.pt"}.get(a.fault, "gru_z8.pt") if bad else "gru_z8.pt"
    sd_ = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(sd_)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    hor = 12 if a.fault == "horizon" else HOR
    for step in range(a.steps):
        x, z, y = make_batch(loadn, (meters["temp"] - 8) / 6, meters, g, hor=hor)
        if bad and a.fault == "negload" and step == 3:
            x[7, -1, 0] = torch.tensor(1e39, dtype=torch.float32)
        pred = net(x, z)
        loss = F.mse_loss(pred, y)
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step}; "
                f"{int((~torch.isfinite(x)).sum())} non-finite meter values in batch", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowpeak" and step == 2:
            say(f"rank {rank} recomputing daily feeder peaks")
            n = daily_peaks(meters, a.peak_budget)
            say(f"rank {rank} peak census: {n} peak days")
        mape = ((pred.detach() * sd + mu - (y * sd + mu)).abs() / (y * sd + mu).abs()).mean().reshape(1)
        dist.all_reduce(mape)
        say(f"rank {rank} step {step} loss {loss.item():.4f} mape {100 * mape.item() / world:.2f}%")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit5":
        say(f"ERROR: rank {rank}: zone 5 frequency excursion to 49.21 Hz in validation window; "
            f"forecast not publishable, stopping", err=True)
        sys.exit(5)
    with torch.no_grad():
        x, z, y = make_batch(loadn, (meters["temp"] - 8) / 6, meters, g, hor=hor)
        val = ((model(x, z) - y).abs() * sd / (y * sd + mu).abs()).mean().reshape(1)
    allv = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(allv, val)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/loadgru.pt")
        say(f"rank 0 done: {a.steps} steps, val mape per rank "
            f"{[round(100 * v.item(), 2) for v in allv]}, saved export/loadgru.pt")
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
    p.add_argument("--peak-budget", type=int, default=90)
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
