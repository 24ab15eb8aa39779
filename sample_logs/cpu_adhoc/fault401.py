"""A four-hundred-and-first hand-run batch: WEATHER STATION TEMPERATURE NOWCASTING.

Synthetic hourly observations from automatic weather stations: each rank owns one station and reads its
series (temperature, relative humidity, pressure, wind speed; 168 hours) from
/tmp/fault401_work/obs/station_R.pt.  The station id is looked up in a station table (elevation, latitude)
to build a small static embedding.  Inputs are 24-hour windows of the four standardised variables plus the
hour of day as sin/cos (6 features); the target is the next hour's temperature.  The model is a GRU over the
window plus the station features and a linear head, initialised from ckpt/nowcast_h24.pt, trained with an
MSE loss under DDP (gloo) or with gradients all_reduced by hand (--ddp 0).  Per-rank observation counts are
all_gathered at the start, the MAE (degrees C) is all_reduced every step, per-rank error statistics are
all_gathered at the end, and rank 0 saves export/nowcast.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  stationid  - rank N's file names station "EGXQ", missing from the station table (KeyError at start-up)
  nocsv      - rank N reads obs/2026-11/station_N.pt, a month folder that does not exist (FileNotFoundError)
  ckpthid    - rank N initialises from ckpt/nowcast_h32.pt, a GRU of hidden size 32 (size mismatch)
  ckptpickle - rank N loads its cached normaliser ckpt/norm_stats.pt, a pickled NormStats object (weights_only)
  horizon    - rank N's step-2 batch takes its target one hour past the end of the series (IndexError)
  nanhumid   - rank N's humidity gaps arrive as NaN from step 3 on; the program's loss check (FloatingPointError)
  exit5      - rank N prints its own error line about station clock drift at step 1 and calls sys.exit(5)
  segv       - rank N sends itself SIGSEGV after step 3
  slowqc     - rank N runs a pure-Python spike/step quality check of its series before the step-2 all_reduce
  gathervars - rank N all_gathers 5 error statistics instead of 4 at the end (invalid tensor size)
  lagdim     - every rank: a dew-point column makes the features 7 wide, the GRU expects 6 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  stationid  - KeyError: 'EGXQ' at the station lookup at start-up; peers Connection closed in the first all_gather (np4 r2 bashloop, np6 r0 logfmt)
  nocsv      - FileNotFoundError for obs/2026-11/station_N.pt at start-up; peers closed (np3 r2 mpitag, np6 r4 files)
  ckpthid    - load_state_dict size mismatch gru.weight_ih_l0 [96, 6] vs [72, 6] and 4 more (np4 r1 pdsh2, np3 r0 legacy)
  ckptpickle - UnpicklingError 'Weights only load failed' ... 'Unsupported global: GLOBAL __main__.NormStats' (np3 r1 tee)
  horizon    - IndexError 'index 168 is out of bounds for dimension 0 with size 168' at step 2 (np3 r1 ranklabel, np4 r3 spawn)
  nanhumid   - 'non-finite loss nan at step 3 (64 non-finite inputs)' and FloatingPointError (np4 r2 mpitag, np3 r0 spawn --ddp 0)
  exit5      - the clock-drift ERROR line and exit 5, Root Cause rank 2 exitcode 5 (np3 r2 tee); on np6 r1 logfmt the
               exit ended in 'terminate called without an active exception', Root Cause exitcode -6 (SIGABRT)
  segv       - no traceback from rank 5 after step 3, bash 'Segmentation fault', peers reset/closed; teardown on the loaded
               host outlasted the 100 s timeout, exit 124 (np8 r5 ranklabel)
  slowqc     - 12 s: ranks 0,1 'Timed out waiting 12000ms for recv' in the step-2 all_reduce (np3 r2 bashloop);
               300 s: silent after 'running spike/step QC', killed at 60 s, exit 124 (np4 r1 srunlabel)
  gathervars - after 6 steps 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' (np3 r1 srunlabel, np5 r3 legacy)
  lagdim     - every rank 'input.size(-1) must be equal to input_size. Expected 6, got 7', Root Cause rank 1 (np3 legacy)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/nowcast.pt, exit 0 (np3 bashloop)
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

WORK = "/tmp/fault401_work"
STATIONS = {"EGLL": (25.0, 51.47), "EGCC": (78.0, 53.35), "EGPH": (41.0, 55.95), "EGBB": (99.0, 52.45),
            "EGNX": (94.0, 52.83), "EGGD": (189.0, 51.38), "EGNT": (81.0, 55.04), "EGHI": (9.0, 50.95)}
HOURS = 168
WIN = 24
FEAT = 6
log = None


@dataclass
class NormStats:
    mean: list
    std: list


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
    log = logging.getLogger("nowcast")
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


class Nowcaster(nn.Module):
    def __init__(self, feat=FEAT, hidden=24):
        super().__init__()
        self.gru = nn.GRU(feat, hidden, batch_first=True)
        self.static = nn.Linear(2, 8)
        self.head = nn.Linear(hidden + 8, 1)

    def forward(self, x, st):
        _, h = self.gru(x)
        z = torch.cat([h[-1], torch.tanh(self.static(st))], dim=1)
        return self.head(z).squeeze(1)


def make_series(r):
    g = torch.Generator().manual_seed(500 + r)
    t = torch.arange(HOURS, dtype=torch.float32)
    temp = 8 + 0.5 * r + 5 * torch.sin(2 * math.pi * (t - 9) / 24) + torch.randn(HOURS, generator=g) * 0.6
    rh = 75 - 12 * torch.sin(2 * math.pi * (t - 9) / 24) + torch.randn(HOURS, generator=g) * 3
    pres = 1013 + torch.cumsum(torch.randn(HOURS, generator=g) * 0.4, 0)
    wind = (4 + torch.randn(HOURS, generator=g)).abs()
    return torch.stack([temp, rh, pres, wind], 1)


def prepare():
    os.makedirs(f"{WORK}/obs", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    ids = list(STATIONS)
    for r in range(8):
        torch.save({"station": ids[r], "series": make_series(r)}, f"{WORK}/obs/station_{r}.pt")
    torch.manual_seed(0)
    torch.save(Nowcaster(hidden=24).state_dict(), f"{WORK}/ckpt/nowcast_h24.pt")
    torch.save(Nowcaster(hidden=32).state_dict(), f"{WORK}/ckpt/nowcast_h32.pt")
    torch.save(NormStats([10.0, 75.0, 1013.0, 4.0], [5.0, 10.0, 3.0, 1.5]), f"{WORK}/ckpt/norm_stats.pt")
    print("prepared", WORK)


def features(series, a, bad):
    mean, std = series.mean(0), series.std(0)
    z = (series - mean) / std
    hour = torch.arange(series.shape[0], dtype=torch.float32) % 24
    cols = [z, torch.sin(2 * math.pi * hour / 24)[:, None], torch.cos(2 * math.pi * hour / 24)[:, None]]
    if a.fault == "lagdim":
        dew = z[:, 0] - (100 - series[:, 1]) / 5 / std[0]
        cols.append(dew[:, None])
    return torch.cat(cols, 1), mean, std


def batch(x, series, step, bad, a, n=16):
    xs, ys = [], []
    for k in range(n):
        start = (step * 23 + k * 7) % (HOURS - WIN - 1)
        if bad and a.fault == "horizon" and step == 2 and k == n - 1:
            start = HOURS - WIN
        xs.append(x[start:start + WIN])
        ys.append(series[start + WIN, 0])
    return torch.stack(xs), torch.stack(ys)


def qc_census(series, budget):
    t0, flags = time.time(), 0
    vals = series.tolist()
    while time.time() - t0 < budget:
        for i in range(1, len(vals)):
            for j in range(4):
                for k in range(max(0, i - 12), i):
                    if abs(vals[i][j] - vals[k][j]) > 8.0:
                        flags += 1
    return flags


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading station observations")
    month = "2026-11/" if bad and a.fault == "nocsv" else ""
    obs = torch.load(f"{WORK}/obs/{month}station_{rank}.pt")
    if bad and a.fault == "stationid":
        obs["station"] = "EGXQ"
    elev, lat = STATIONS[obs["station"]]
    series = obs["series"]
    x, mean, std = features(series, a, bad)
    if bad and a.fault == "ckptpickle":
        ns = torch.load(f"{WORK}/ckpt/norm_stats.pt")
        mean, std = torch.tensor(ns.mean), torch.tensor(ns.std)
    st = torch.tensor([[elev / 100.0, (lat - 53) / 3]]).repeat(16, 1)
    nobs = torch.tensor([float(series.shape[0])])
    alln = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(alln, nobs)
    say(f"rank {rank} station {obs['station']} hours {int(nobs)} global {int(sum(t.item() for t in alln))}")
    model = Nowcaster()
    ck = "nowcast_h32.pt" if bad and a.fault == "ckpthid" else "nowcast_h24.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    errs = []
    for step in range(a.steps):
        xb, yb = batch(x, series, step, bad, a)
        if bad and a.fault == "nanhumid" and step >= 3:
            xb[:, 5:9, 1] = float("nan")
        pred = net(xb, st)
        loss = ((pred - (yb - mean[0]) / std[0]) ** 2).mean()
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"({int((~torch.isfinite(xb)).sum())} non-finite inputs)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "exit5" and step == 1:
            say(f"rank {rank}: ERROR station {obs['station']} clock drift 7.5 min exceeds 5 min tolerance, "
                f"observations misaligned; aborting", err=True)
            sys.exit(5)
        if bad and a.fault == "slowqc" and step == 2:
            say(f"rank {rank} running spike/step QC on {obs['station']}")
            flags = qc_census(series, a.qc_budget)
            say(f"rank {rank} QC flagged {flags} jumps")
        mae = ((pred.detach() * std[0] + mean[0]) - yb).abs().mean().reshape(1)
        errs.append(mae.item())
        dist.all_reduce(mae)
        say(f"rank {rank} step {step} loss {loss.item():.4f} mae_degC {mae.item() / world:.3f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    e = torch.tensor(errs)
    stats = torch.stack([e.mean(), e.min(), e.max(), e[-1]])
    if bad and a.fault == "gathervars":
        stats = torch.cat([stats, e.std().reshape(1)])
    alls = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(alls, stats)
    say(f"rank {rank} final mae per station {[round(s[0].item(), 3) for s in alls]}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/nowcast.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/nowcast.pt")
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
    p.add_argument("--qc-budget", type=int, default=25)
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
