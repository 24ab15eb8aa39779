"""A four-hundred-and-sixty-second hand-run batch: POWER GRID LOAD FORECASTING (day-ahead, per feeder).

Synthetic feeder telemetry: every rank owns one grid region and reads its meters from
/tmp/fault462_work/meters/region_R.pt (hourly load in MW for 8 feeders over 14 days, an hourly temperature
series, the first day of year).  Feeders are mapped to their region through data/feeders.json, holidays come
from a 365-entry flag table (data/holidays.pt), and the load scaler from ckpt/scaler_stats.pt.  The model,
LoadNet, takes 48 h of log-load lags, the 24 h temperature forecast, a holiday flag, a weekday and a region
embedding, and predicts the next 24 h of log-load (an MLP with a 24-wide head); it is initialised from
ckpt/loadnet_h24.pt and wrapped in DDP over gloo (or, with --ddp 0, gradients are all_reduced by hand).
Every rank all_gathers its feeder count at start-up, all_reduces its MAPE each step, and all_gathers its
24-hour peak-load profile at the end; rank 0 saves export/loadnet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  feeder      - rank N's meter file lists feeder "FDR-0917B", missing from the feeder table (KeyError)
  holiday     - rank N looks holidays up by 1-based day of year without wrapping at New Year: index 365 at
                step 3 (IndexError)
  nometer     - rank N reads meters/2025/region_N.pt, a folder that does not exist (FileNotFoundError)
  ckptsize    - rank N initialises from ckpt/loadnet_h48.pt, saved with a 48-hour head (size mismatch)
  weightsonly - rank N loads the legacy scaler ckpt/scaler_v1.pt, a pickled LoadScaler object, which the
                default weights_only torch.load refuses (UnpicklingError)
  peakgather  - rank N's peak profile covers a 25-hour DST day: all_gather of 25 values vs 24, at the end
  reconcile   - rank N reconciles meter readings in pure Python before the step-2 all_reduce (slow rank)
  negload     - rank N's feeder 3 has a telemetry dropout coded -9999 MW at hour 130: log1p gives NaN, the
                program's own loss check at step 2 raises FloatingPointError
  sigsegv     - rank N sends itself SIGSEGV after step 4
  exit4       - rank N prints its own error line about a frozen SCADA feed and calls sys.exit(4)
  lagwidth    - every rank: lag windows of 72 h, the model expects 48 h (shape error in the first forward)
  none        - control, clean run

What happened (filled in after the runs):
  feeder      - KeyError: 'FDR-0917B' at start-up; peers Connection closed by peer in all_gather (np4 r2 ranklabel); spawn
                SIGTERMs the rest, ProcessRaisedException for process 0 (np6 r0 spawn)
  holiday     - 'IndexError: index 365 is out of bounds for dimension 0 with size 365' at step 3; peers Connection closed
                (np3 r1 mpitag; np4 r3 logfmt, Root Cause rank 3)
  nometer     - FileNotFoundError for meters/2025/region_N.pt at start-up; peers closed (np4 r1 srunlabel, np3 r2 files)
  ckptsize    - load_state_dict size mismatch for head.weight [48, 64] vs [24, 64] (np4 r1 pdsh2: worker-1's agent
                Root Cause, worker-0's agent RendezvousConnectionError; np3 r0 legacy)
  weightsonly - UnpicklingError 'Weights only load failed ... GLOBAL __main__.LoadScaler' (np5 r3 tee)
  peakgather  - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (25), got (24))' after step 5;
                peers closed; no 'rank 0 done' (np6 r4 bashloop, np3 r1 srunlabel)
  reconcile   - 12 s: ranks 0-1 'Timed out waiting 12000ms for recv' in the step-2 all_reduce, rank 2 later closed by peer
                (np3 r2 bashloop); 300 s: output stops after step 1, killed at 60 s, exit 124 (np4 r1 ranklabel)
  negload     - 'rank N step 2: loss is nan ...' then FloatingPointError; peers closed (np8 r5 tee --ddp 0, np4 r0 mpitag)
  sigsegv     - no traceback from rank N after step 4; bash 'Segmentation fault', exit 139 (np4 r3 ranklabel);
                ProcessExitedException 'process 1 terminated with signal SIGSEGV' (np3 r1 spawn)
  exit4       - rank N's frozen-SCADA ERROR line and exit 4; Root Cause rank 2 exitcode 4 (np5 r2 legacy); rank1.log,
                loop exit 4 (np4 r1 files)
  lagwidth    - every rank 'mat1 and mat2 shapes cannot be multiplied (32x102 and 78x64)'; Root Cause rank 0 (np3 logfmt)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/loadnet.pt, exit 0 (np3 bashloop)
"""
import argparse
import json
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
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault462_work"
NFEED = 8
DAYS = 14
LAG = 48
HOR = 24
NREG = 8
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


class LoadScaler:
    """Legacy scaler object (pickled whole by the v1 pipeline)."""

    def __init__(self, mean, std):
        self.mean = mean
        self.std = std


class LoadNet(nn.Module):
    def __init__(self, lag=LAG, hor=HOR, hidden=64):
        super().__init__()
        self.region = nn.Embedding(NREG, 4)
        self.body = nn.Sequential(nn.Linear(lag + 24 + 2 + 4, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, hor)

    def forward(self, x, reg):
        return self.head(self.body(torch.cat([x, self.region(reg)], 1)))


def prepare():
    for d in ("meters", "data", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    feeders = {}
    for r in range(NREG):
        g = torch.Generator().manual_seed(500 + r)
        hours = DAYS * 24
        h = torch.arange(hours, dtype=torch.float32)
        temp = 4.0 + 6.0 * torch.sin(2 * torch.pi * (h - 9) / 24) + torch.randn(hours, generator=g)
        base = 80 + 40 * torch.rand(NFEED, 1, generator=g)
        daily = 1 + 0.35 * torch.sin(2 * torch.pi * (h - 7) / 24)
        load = base * daily * (1 + 0.01 * (12 - temp)) + 3 * torch.randn(NFEED, hours, generator=g)
        ids = [f"FDR-{r}{k:02d}{chr(65 + k)}" for k in range(NFEED)]
        for fid in ids:
            feeders[fid] = r
        torch.save({"feeders": ids, "load": load, "temp": temp, "start_doy": 359},
                   f"{WORK}/meters/region_{r}.pt")
    with open(f"{WORK}/data/feeders.json", "w") as f:
        json.dump(feeders, f)
    hol = torch.zeros(365)
    hol[[0, 358, 359, 364]] = 1.0
    torch.save(hol, f"{WORK}/data/holidays.pt")
    torch.save({"mean": torch.tensor(4.5), "std": torch.tensor(0.4)}, f"{WORK}/ckpt/scaler_stats.pt")
    torch.save(LoadScaler(4.5, 0.4), f"{WORK}/ckpt/scaler_v1.pt")
    torch.manual_seed(0)
    torch.save(LoadNet().state_dict(), f"{WORK}/ckpt/loadnet_h24.pt")
    torch.save(LoadNet(hor=48).state_dict(), f"{WORK}/ckpt/loadnet_h48.pt")
    print("prepared", WORK)


def make_batch(m, step, hol, reg, sc, a, bad):
    lag = 72 if a.fault == "lagwidth" else LAG
    xs, ys, regs = [], [], []
    for t0 in range(step * 24, step * 24 + 24, 6):
        t = t0 + lag
        day = t // 24
        if bad and a.fault == "holiday":
            doy = m["start_doy"] + day + 1
        else:
            doy = (m["start_doy"] + day) % 365
        flag = hol[doy]
        wd = float((doy + 3) % 7) / 6.0
        for f in range(NFEED):
            lags = (torch.log1p(m["load"][f, t0:t]) - sc["mean"]) / sc["std"]
            tf = m["temp"][t:t + 24] / 10.0
            xs.append(torch.cat([lags, tf, torch.stack([flag, torch.tensor(wd)])]))
            ys.append((torch.log1p(m["load"][f, t:t + HOR]) - sc["mean"]) / sc["std"])
            regs.append(reg[f])
    return torch.stack(xs), torch.stack(ys), torch.tensor(regs)


def reconcile(m, budget):
    t0 = time.time()
    passes = 0
    rows = m["load"].tolist()
    while time.time() - t0 < budget:
        for row in rows:
            acc = 0.0
            for i, v in enumerate(row):
                for j in range(i, min(i + 48, len(row))):
                    acc += abs(row[j] - v) * 1e-6
        passes += 1
    return passes


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading region {rank} meters")
    sub = "2025/" if bad and a.fault == "nometer" else ""
    m = torch.load(f"{WORK}/meters/{sub}region_{rank}.pt")
    if bad and a.fault == "feeder":
        m["feeders"][5] = "FDR-0917B"
    if bad and a.fault == "negload":
        m["load"][3, 130] = -9999.0
    with open(f"{WORK}/data/feeders.json") as f:
        table = json.load(f)
    reg = [table[fid] for fid in m["feeders"]]
    hol = torch.load(f"{WORK}/data/holidays.pt")
    if bad and a.fault == "weightsonly":
        sc = torch.load(f"{WORK}/ckpt/scaler_v1.pt")
    else:
        sc = torch.load(f"{WORK}/ckpt/scaler_stats.pt")
    nf = torch.tensor([float(len(reg))])
    allnf = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(allnf, nf)
    say(f"rank {rank} feeders {int(nf.item())} global {int(sum(t.item() for t in allnf))}")
    model = LoadNet()
    ck = "loadnet_h48.pt" if bad and a.fault == "ckptsize" else "loadnet_h24.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR SCADA feed for substation SS-{rank}14 frozen since 2025-12-20T03:00Z "
            f"(36 h at 412.0 MW); refusing to train on stale telemetry", err=True)
        sys.exit(4)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        x, y, r = make_batch(m, step, hol, reg, sc, a, bad)
        pred = net(x, r)
        loss = ((pred - y) ** 2).mean()
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(x)).sum() + (~torch.isfinite(y)).sum())
            say(f"rank {rank} step {step}: loss is {loss.item()} ({nbad} non-finite values in the lag and target windows)",
                err=True)
            raise FloatingPointError(f"non-finite loss at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "reconcile" and step == 2:
            n = reconcile(m, a.reconcile_budget)
            say(f"rank {rank} meter reconciliation: {n} passes")
        mape = ((torch.expm1(pred.detach() * sc["std"] + sc["mean"]) - torch.expm1(y * sc["std"] + sc["mean"])).abs()
                / torch.expm1(y * sc["std"] + sc["mean"])).mean().reshape(1)
        dist.all_reduce(mape)
        say(f"rank {rank} step {step} loss {loss.item():.4f} mape {100 * mape.item() / world:.2f}%")
        if bad and a.fault == "sigsegv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    peak = m["load"].reshape(NFEED, DAYS, 24).amax(dim=(0, 1))
    if bad and a.fault == "peakgather":
        peak = torch.cat([peak, peak[1:2]])
    allpk = [torch.zeros(24) for _ in range(world)]
    dist.all_gather(allpk, peak)
    say(f"rank {rank} peak {peak.max():.1f} MW, system peak hour {int(torch.stack(allpk).sum(0).argmax())}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/loadnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/loadnet.pt")
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
    p.add_argument("--reconcile-budget", type=int, default=30)
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
