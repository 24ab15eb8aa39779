"""A three-hundred-and-eighth hand-run batch: WATER QUALITY FORECASTING FROM SENSOR STATIONS WITH A TEMPORAL CNN.

Synthetic river sensor stations: every station logs six channels each hour (pH, dissolved oxygen, turbidity,
temperature, conductivity, nitrate).  Every rank reads its stations from /tmp/fault308_work/stations/
stations_R.pt, checks the readings against plausible ranges, log-transforms turbidity, looks each station's
zone up in a small zone table (a learned zone embedding), cuts 48-hour windows and trains a temporal CNN
(dilated Conv1d blocks, a pooled head) to forecast dissolved oxygen 6 hours ahead, with an MSE loss, wrapped
in DDP (gloo) or, with --ddp 0, with gradients all_reduced by hand.  The model starts from ckpt/tcn_c6.pt.
Per-rank channel means are all_gathered at the start, the MAE is all_reduced every step, and rank 0 saves
export/tcn.pt at the end.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1.

Faults:
  badph       - rank N's station 3 reports pH 17.4 (a sensor stuck high); the range check raises ValueError
  zone        - rank N has a station in zone "ESTUARY-9", missing from the zone table (KeyError)
  lagindex    - rank N looks up a lag of 60 h in a 48-h window at step 3 (index_select out of range)
  nostation   - rank N reads stations/archive/stations_N.pt which does not exist (FileNotFoundError)
  ckptchan    - rank N initialises from ckpt/tcn_c8.pt, saved with 8 input channels (size mismatch)
  ckptpickle  - rank N loads ckpt/tcn_norm.pt, which pickles a ChannelScaler object (weights_only refusal)
  meangather  - rank N all_gathers its channel means plus a battery voltage (7 vs 6 entries)
  resample    - rank N resamples its series to 1-minute resolution in Python before the step-2 all_reduce
  logturb     - rank N's turbidity has negative readings at step 2: log gives NaN, the program's check
  sigsegv     - rank N sends itself SIGSEGV after step 3
  exit4       - rank N prints its own error line about a calibration date and calls sys.exit(4)
  kernelwidth - every rank: the head expects 32*44 features, the last conv leaves 32*40 (shape error)
  none        - control, clean run

What happened (filled in after the runs):
  badph       - ValueError 'station WQ-30N03: ph reading 17.4 outside plausible range [4.0, 10.5]' at start-up; peers Connection closed in all_gather (np4 r1 tee, np3 r0 pymodule)
  zone        - KeyError: 'ESTUARY-9' in windows() at start-up; peers Connection closed (np5 r3 loglevel, np3 r2 filter)
  lagindex    - RuntimeError 'INDICES element is out of DATA bounds, id=-13 axis_dim=48' at step 3, not IndexError (np4 r2 prefix, np3 r0 loglevel)
  nostation   - FileNotFoundError for stations/archive/stations_N.pt before the all_gather; peers Connection closed (np3 r1 wrapper, np4 r0 tee_trainer)
  ckptchan    - load_state_dict size mismatch for c1.weight [32,12,3] vs [32,10,3]; worker-1's Root Cause names rank 2 (np4 r1 pdsh2)
  ckptpickle  - weights_only UnpicklingError (Unsupported global __main__.ChannelScaler), only in rank 2's stderr.log; console: Root Cause rank 2 (np3 r2 redirects)
  meangather  - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (7), got (6))' (np3 r1 plain); DETAIL: every rank 'Detected mismatch between collectives', rank 3 TensorShape=[7] (np4 r3 detail)
  resample    - 12 s: ranks 0/2 'Timed out waiting 12000ms' for recv/send, Root Cause rank 0 (np3 r1 tee); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r2 plain)
  logturb     - '1 non-finite DO forecasts (turbidity log: 48 NaN inputs)', FloatingPointError at step 2 (np3 r2 detail: monitoredBarrier names rank 2; np5 r0 restart: attempt 2 died in Gloo connectFullMesh)
  sigsegv     - rank N dies silently after step 3, exitcode -11 (np3 r0 wrapper: Root Cause SIGSEGV; np4 r1 restart: attempt 2 died in connectFullMesh, final Root Cause rank 0 exit 1)
  exit4       - rank 4's calibration ERROR line, Root Cause rank 4 exitcode 4; peers Connection closed (np5 r4 pymodule)
  kernelwidth - every rank: 'mat1 and mat2 shapes cannot be multiplied (84x1280 and 1408x1)'; Root Cause rank 0 (np3 tee_trainer)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/tcn.pt, exit 0 (np3 plain)
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
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault308_work"
CHANNELS = ["ph", "do", "turbidity", "temp", "cond", "nitrate"]
RANGES = {"ph": (4.0, 10.5), "do": (0.0, 20.0), "temp": (-2.0, 40.0)}
ZONES = {"UPLAND": 0, "RIVER-1": 1, "RIVER-2": 2, "RESERVOIR": 3, "ESTUARY-1": 4}
WIN = 48
AHEAD = 6
log = None


class ChannelScaler:
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
    log = logging.getLogger("wqal")
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


class TCN(nn.Module):
    def __init__(self, cin=6, hid=32, nzones=len(ZONES), head_len=WIN - 8):
        super().__init__()
        self.zone = nn.Embedding(nzones, 4)
        self.c1 = nn.Conv1d(cin + 4, hid, 3, dilation=1)
        self.c2 = nn.Conv1d(hid, hid, 3, dilation=2)
        self.c3 = nn.Conv1d(hid, hid, 3, dilation=1)
        self.head = nn.Linear(hid * head_len, 1)

    def forward(self, x, z):
        e = self.zone(z).unsqueeze(2).expand(-1, -1, x.shape[2])
        h = torch.relu(self.c1(torch.cat([x, e], 1)))
        h = torch.relu(self.c2(h))
        h = torch.relu(self.c3(h))
        return self.head(h.flatten(1)).squeeze(1)


def make_stations(n, hours, seed):
    g = torch.Generator().manual_seed(seed)
    zones = list(ZONES)
    out = []
    for s in range(n):
        t = torch.arange(hours, dtype=torch.float32)
        temp = 14 + 6 * torch.sin(t / 24 * 6.283) + torch.randn(hours, generator=g)
        do = 11 - 0.25 * temp + 0.3 * torch.randn(hours, generator=g)
        ph = 7.4 + 0.2 * torch.randn(hours, generator=g)
        turb = torch.rand(hours, generator=g) * 30 + 1
        cond = 400 + 20 * torch.randn(hours, generator=g)
        nitrate = 2 + torch.rand(hours, generator=g)
        series = torch.stack([ph, do, turb, temp, cond, nitrate], 1)
        out.append({"code": f"WQ-{seed}{s:02d}", "zone": zones[int(torch.randint(0, 5, (1,), generator=g))],
                    "series": series})
    return out


def prepare():
    os.makedirs(f"{WORK}/stations", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_stations(6, 160, 300 + r), f"{WORK}/stations/stations_{r}.pt")
    torch.manual_seed(0)
    torch.save(TCN(6).state_dict(), f"{WORK}/ckpt/tcn_c6.pt")
    torch.save(TCN(8).state_dict(), f"{WORK}/ckpt/tcn_c8.pt")
    torch.save({"model": TCN(6).state_dict(), "scaler": ChannelScaler([0.0] * 6, [1.0] * 6)},
               f"{WORK}/ckpt/tcn_norm.pt")
    print("prepared", WORK)


def check_ranges(st, rank):
    for name, (lo, hi) in RANGES.items():
        col = st["series"][:, CHANNELS.index(name)]
        if col.min() < lo or col.max() > hi:
            raise ValueError(f"station {st['code']}: {name} reading {float(col.max() if col.max() > hi else col.min()):.1f}"
                             f" outside plausible range [{lo}, {hi}]")


def windows(stations, a, bad):
    xs, ys, zs = [], [], []
    for st in stations:
        s = st["series"].clone()
        s[:, 2] = torch.log(s[:, 2])
        s = (s - s.mean(0)) / (s.std(0) + 1e-6)
        z = ZONES[st["zone"]]
        for t0 in range(0, s.shape[0] - WIN - AHEAD, 8):
            xs.append(s[t0:t0 + WIN].T)
            ys.append(s[t0 + WIN + AHEAD - 1, 1])
            zs.append(z)
    return torch.stack(xs), torch.stack(ys), torch.tensor(zs)


def resample_minutes(stations):
    n = 0
    for st in stations:
        rows = st["series"].tolist()
        fine = []
        for i in range(len(rows) - 1):
            for m in range(60):
                fine.append([a + (b - a) * m / 60 for a, b in zip(rows[i], rows[i + 1])])
        n += len(fine)
    return n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading sensor stations")
    sub = "archive/" if bad and a.fault == "nostation" else ""
    stations = torch.load(f"{WORK}/stations/{sub}stations_{rank}.pt")
    if bad and a.fault == "badph":
        stations[3]["series"][70:75, 0] = 17.4
    if bad and a.fault == "zone":
        stations[4]["zone"] = "ESTUARY-9"
    for st in stations:
        check_ranges(st, rank)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR station {stations[2]['code']} conductivity probe calibration expired 2026-09-30, "
            f"refusing to train on uncalibrated data", err=True)
        sys.exit(4)
    x, y, z = windows(stations, a, bad)
    means = torch.stack([st["series"].mean(0) for st in stations]).mean(0)
    if bad and a.fault == "meangather":
        means = torch.cat([means, torch.tensor([12.6])])
    allm = [torch.zeros(6) for _ in range(world)]
    dist.all_gather(allm, means)
    say(f"rank {rank} windows {x.shape[0]} mean DO {means[1]:.2f} global {sum(m[1] for m in allm) / world:.2f}")
    model = TCN(head_len=WIN - 4 if a.fault == "kernelwidth" else WIN - 8)
    if bad and a.fault == "ckptpickle":
        sd = torch.load(f"{WORK}/ckpt/tcn_norm.pt")["model"]
    else:
        sd = torch.load(f"{WORK}/ckpt/{'tcn_c8.pt' if bad and a.fault == 'ckptchan' else 'tcn_c6.pt'}")
    if a.fault == "kernelwidth":
        sd = {k: v for k, v in sd.items() if not k.startswith("head")}
        model.load_state_dict(sd, strict=False)
    else:
        model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        xb = x
        if bad and a.fault == "logturb" and step == 2:
            raw = stations[0]["series"][:WIN, 2] - 35.0
            xb = x.clone()
            xb[0, 2] = torch.log(raw)
        pred = net(xb, z)
        if not torch.isfinite(pred).all():
            say(f"rank {rank} step {step}: {int((~torch.isfinite(pred)).sum())} non-finite DO forecasts "
                f"(turbidity log: {int(torch.isnan(xb[:, 2]).sum())} NaN inputs)", err=True)
            raise FloatingPointError(f"non-finite forecasts on rank {rank} at step {step}")
        loss = ((pred - y) ** 2).mean()
        if bad and a.fault == "lagindex" and step == 3:
            lags = torch.tensor([1, 6, 12, 24, 60])
            lagged = x[:, 1].index_select(1, WIN - 1 - lags)
            say(f"rank {rank} lagged DO features {tuple(lagged.shape)}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "resample" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.resample_budget:
                n += resample_minutes(stations)
            say(f"rank {rank} resampled {n} minute rows")
        mae = (pred.detach() - y).abs().mean().reshape(1)
        dist.all_reduce(mae)
        say(f"rank {rank} step {step} loss {loss.item():.4f} mae {mae.item() / world:.4f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/tcn.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/tcn.pt")
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
    p.add_argument("--resample-budget", type=int, default=45)
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
