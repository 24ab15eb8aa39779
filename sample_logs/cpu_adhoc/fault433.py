"""Hand-run batch 433: POWER GRID LOAD FORECASTING (day-ahead, per feeder).

Synthetic hourly meter readings for 16 distribution feeders: every rank reads its own CSV,
/tmp/fault433_work/feeders/load_R.csv (feeder id, hour, load in MW, temperature in C), maps each feeder id
through the FEEDERS table, and cuts windows of 48 past hours of load plus 24 hours of temperature forecast
to predict the next 24 hours of load.  The model is a small MLP with a feeder embedding, trained on the log
of the load (MSE), wrapped in DDP over gloo (or, with --ddp 0, gradients all_reduced by hand).  The model
starts from ckpt/forecaster.pt.  Per-rank load statistics are all_gathered at the start, the loss and the
MAPE are all_reduced every step, the per-rank evening peak is all_gathered at the end and rank 0 saves
export/forecaster.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (logging).

Faults (--fault NAME --rank R, R = -1 for every rank):
  feederid     - rank R's CSV names feeder "F-999", missing from the FEEDERS table (KeyError, start-up)
  nometer      - rank R reads feeders/2026-11/load_R.csv, a month folder that does not exist (FileNotFoundError)
  ckptwidth    - rank R starts from ckpt/forecaster_h48.pt, saved with a 48-hour horizon (size mismatch)
  weightsonly  - rank R starts from ckpt/forecaster_v1.pt, which pickles a LoadScaler object (weights_only refusal)
  statgather   - rank R all_gathers its load statistics plus a holiday count (5 values vs 4)
  negload      - from step 3 rank R's batch holds a sign-flipped meter (negative MW): log load NaN, program check
  slowweather  - rank R re-interpolates the weather grid in pure Python before the step-2 all_reduce
  segv         - rank R sends itself SIGSEGV after step 3
  exit2        - rank R prints its own error about duplicated DST timestamps and calls sys.exit(2)
  lagwidth     - every rank cuts 49 lag hours, the first layer expects 48 (shape error, first step)
  horizon      - at the end rank R reads the evening peak at hour index 24 of a 24-hour forecast (IndexError)
  none         - control, clean run

What happened (filled in after the runs):
  feederid     - KeyError: 'F-999' at start-up; peers Connection closed in the all_gather or SIGTERM (np4 r2 tee, np6 r0 pymodule)
  nometer      - FileNotFoundError feeders/2026-11/load_R.csv (np3 r1 redirects: console shows only Root Cause rank 1; np4 r3 loglevel)
  ckptwidth    - size mismatch for head.weight [48, 32] vs [24, 32] on rank 1; worker-1's ranks closed in DDP's param check (np4 pdsh2)
  weightsonly  - UnpicklingError 'Weights only load failed ... GLOBAL __main__.LoadScaler'; Root Cause rank 2 (np3 tee_trainer)
  statgather   - DETAIL: every rank 'Detected mismatch between collectives', rank 3 TensorShape=[5] (np6 detail); plain:
                 rank 0 'allgather: invalid tensor size at index 0 (expected (5), got (4))' (np3 r0 plain)
  negload      - 'loss is nan ... min load -1200.0 MW' then FloatingPointError at step 3 (np4 r1 prefix; np3 r2 restart, both attempts)
  slowweather  - 12 s: rank 0 recv / rank 2 send 'Timed out waiting 12000ms' (np3 r1 wrapper); 300 s: silent after step 1,
                 killed at 60 s, exit 124 (np4 r2 plain)
  segv         - exitcode -11 (SIGSEGV) with no traceback after step 3 (np8 r5 filter); np3 r0 restart: first attempt SIGSEGV,
                 the second fails in connectFullMesh (Connection refused)
  exit2        - the rank's own DST ERROR line; np6 r2 loglevel: exitcode 2; np4 r3 tee_trainer: 'terminate called without an
                 active exception', exitcode -6 (SIGABRT) instead of 2
  lagwidth     - every rank: 'mat1 and mat2 shapes cannot be multiplied (64x77 and 76x32)' in the first forward (np3 pymodule)
  horizon      - after 6 steps 'IndexError: index 24 is out of bounds for dimension 1 with size 24' (np4 r1 wrapper, np8 r6 prefix)
  none         - clean: 6 steps on 3 ranks, rank 0 saved export/forecaster.pt, exit 0 (np3 plain)
"""
import argparse
import csv
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

WORK = "/tmp/fault433_work"
FEEDERS = {f"F-{101 + i}": i for i in range(16)}
LAGS = 48
HORIZON = 24
HOURS = 24 * 12
log = None


class LoadScaler:
    """Old (v1) export kept the scaler as an object; torch.load's weights_only unpickler refuses it."""

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
    log = logging.getLogger("pgrid")
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


class Forecaster(nn.Module):
    def __init__(self, horizon=HORIZON, nfeed=16, hidden=32):
        super().__init__()
        self.emb = nn.Embedding(nfeed, 4)
        self.fc1 = nn.Linear(LAGS + HORIZON + 4, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, horizon)

    def forward(self, lags, temps, feeder):
        z = torch.cat([lags, temps, self.emb(feeder)], dim=1)
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(z)))))


def prepare():
    os.makedirs(f"{WORK}/feeders", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    g = torch.Generator().manual_seed(433)
    names = list(FEEDERS)
    for r in range(8):
        with open(f"{WORK}/feeders/load_{r}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["feeder", "hour", "load_mw", "temp_c"])
            for k in range(2):
                name = names[(2 * r + k) % 16]
                base = 20 + 10 * float(torch.rand(1, generator=g))
                for h in range(HOURS):
                    temp = 8 + 6 * math.sin(2 * math.pi * (h % 24 - 9) / 24) + float(torch.randn(1, generator=g))
                    daily = 1 + 0.35 * math.sin(2 * math.pi * (h % 24 - 13) / 24)
                    load = base * daily + 0.4 * max(0.0, 12 - temp) + float(torch.randn(1, generator=g)) * 0.5
                    w.writerow([name, h, f"{load:.3f}", f"{temp:.2f}"])
    torch.manual_seed(0)
    torch.save({"model": Forecaster().state_dict(), "scaler": {"mean": 3.2, "std": 0.3}},
               f"{WORK}/ckpt/forecaster.pt")
    torch.save({"model": Forecaster(48).state_dict(), "scaler": {"mean": 3.2, "std": 0.3}},
               f"{WORK}/ckpt/forecaster_h48.pt")
    torch.save({"model": Forecaster().state_dict(), "scaler": LoadScaler(3.2, 0.3)},
               f"{WORK}/ckpt/forecaster_v1.pt")
    print("prepared", WORK)


def read_feeders(a, rank, bad):
    month = "2026-11/" if bad and a.fault == "nometer" else ""
    rows = []
    with open(f"{WORK}/feeders/{month}load_{rank}.csv") as f:
        for row in csv.DictReader(f):
            rows.append(row)
    if bad and a.fault == "feederid":
        rows[137]["feeder"] = "F-999"
    series = {}
    for row in rows:
        fid = FEEDERS[row["feeder"]]
        series.setdefault(fid, ([], []))
        series[fid][0].append(float(row["load_mw"]))
        series[fid][1].append(float(row["temp_c"]))
    return series


def make_windows(series, nlags):
    L, T, F, Y = [], [], [], []
    for fid, (load, temp) in series.items():
        load = torch.tensor(load)
        temp = torch.tensor(temp)
        for s in range(0, len(load) - nlags - HORIZON, 3):
            L.append(load[s:s + nlags])
            T.append(temp[s + nlags:s + nlags + HORIZON])
            Y.append(load[s + nlags:s + nlags + HORIZON])
            F.append(fid)
    return torch.stack(L), torch.stack(T), torch.tensor(F), torch.stack(Y)


def weather_regrid(temps, budget):
    """Pure-Python inverse-distance re-interpolation of the weather grid onto the feeders (slow)."""
    t0 = time.time()
    grid = temps.flatten().tolist()
    acc = 0.0
    while time.time() - t0 < budget:
        for i in range(len(grid)):
            for j in range(0, len(grid), 7):
                acc += grid[j] / (1.0 + abs(i - j))
    return acc


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(433 + rank)
    say(f"rank {rank}/{world} up, reading feeder meters")
    series = read_feeders(a, rank, bad)
    nlags = LAGS + 1 if a.fault == "lagwidth" and bad else LAGS
    lags, temps, feeder, target = make_windows(series, nlags)
    stats = torch.tensor([target.mean(), target.std(), target.max(), target.min()])
    if bad and a.fault == "statgather":
        stats = torch.cat([stats, torch.tensor([2.0])])
    allstats = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(allstats, stats)
    say(f"rank {rank} windows {len(target)} feeders {sorted(series)} "
        f"peak {stats[2]:.1f} MW global peak {max(float(s[2]) for s in allstats):.1f} MW")
    if bad and a.fault == "exit2":
        say(f"rank {rank}: ERROR feeder F-{101 + min(series)} has 37 duplicated timestamps "
            f"(DST fall-back not deduplicated); refusing to train on ambiguous hours", err=True)
        sys.exit(2)
    ck = "forecaster.pt"
    if bad and a.fault == "ckptwidth":
        ck = "forecaster_h48.pt"
    if bad and a.fault == "weightsonly":
        ck = "forecaster_v1.pt"
    state = torch.load(f"{WORK}/ckpt/{ck}")
    model = Forecaster()
    model.load_state_dict(state["model"])
    mu, sd = state["scaler"]["mean"], state["scaler"]["std"]
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    n = len(target)
    for step in range(a.steps):
        idx = torch.randint(0, n, (64,))
        y = target[idx].clone()
        if bad and a.fault == "negload" and step >= 3:
            y[5, 7:12] = -1200.0
        ylog = (torch.log(y) - mu) / sd
        pred = net(torch.log(lags[idx]) - mu, temps[idx] / 10.0, feeder[idx])
        loss = ((pred - ylog) ** 2).mean()
        if not torch.isfinite(loss):
            bad_rows = int((~torch.isfinite(ylog)).any(1).sum())
            say(f"rank {rank} step {step}: loss is {loss.item()} ({bad_rows} windows with non-finite log load, "
                f"min load {y.min():.1f} MW)", err=True)
            raise FloatingPointError(f"non-finite forecast loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowweather" and step == 2:
            acc = weather_regrid(temps[:8], a.slow_s)
            say(f"rank {rank} weather regrid done ({acc:.1f})")
        with torch.no_grad():
            mw = torch.exp(pred.detach() * sd + mu)
            mape = ((mw - y).abs() / y.abs()).mean()
        red = torch.tensor([loss.item(), mape.item()])
        dist.all_reduce(red)
        red /= world
        say(f"rank {rank} step {step} loss {red[0]:.4f} mape {100 * red[1]:.2f}%")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        fc = torch.exp(net(torch.log(lags[:16]) - mu, temps[:16] / 10.0, feeder[:16]) * sd + mu)
    hour = HORIZON if bad and a.fault == "horizon" else 19
    peak = fc[:, hour].max().reshape(1)
    peaks = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(peaks, peak)
    say(f"rank {rank} evening peak {peak.item():.1f} MW (max over ranks {max(p.item() for p in peaks):.1f})")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/forecaster.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/forecaster.pt")
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
    p.add_argument("--slow-s", type=int, default=90)
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
