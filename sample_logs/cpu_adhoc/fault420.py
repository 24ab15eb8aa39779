"""A four-hundred-and-twentieth hand-run batch: TIDAL LEVEL PREDICTION FROM HARMONIC CONSTITUENTS AND GAUGE LAGS.

Synthetic tide-gauge records: every rank owns one station (/tmp/fault420_work/gauges/station_R.pt, 720 hourly
water levels in metres above chart datum) and a station header (stations/station_R.json: name, datum offset,
the list of harmonic constituents to model).  The level is a sum of the 8 main constituents (M2, S2, N2, K2,
K1, O1, P1, Q1) plus noise.  Features for an hour are cos/sin of every constituent's phase (16 values) plus the
12 previous levels; a small MLP predicts the next hour's level (MSE loss), wrapped in DDP (gloo) or, with
--ddp 0, with gradients all_reduced by hand.  The model starts from ckpt/tide_c8.pt.  Per-rank tidal range and
mean level are all_gathered at start-up, the RMSE is all_reduced every step, and rank 0 saves export/tide.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress through logging).

Faults:
  constituent - rank N's station header lists the fortnightly "MSf", missing from the constituent table (KeyError)
  datum       - rank N's header gives its datum offset as "0.42 m CD", float() refuses it (ValueError)
  nogauge     - rank N reads its gauge record from gauges/qc/ which does not exist (FileNotFoundError)
  ckptharm    - rank N initialises from ckpt/tide_c9.pt, saved with 9 constituents (size mismatch, 30 vs 28 inputs)
  ckptmeta    - rank N initialises from ckpt/tide_meta.pt, which pickles a StationMeta object (weights_only refusal)
  rangegather - rank N all_gathers range, mean and a surge maximum (3 entries where the others send 2)
  lagindex    - rank N's window sampler at step 3 asks for hour 720 of a 720-hour record (IndexError)
  nanlevel    - rank N's gauge has a NaN gap reaching its step-2 batch; the program's check raises FloatingPointError
  surge       - rank N runs a pure-Python storm-surge relaxation before the step-2 all_reduce (--surge-budget s)
  sigsegv     - rank N sends itself SIGSEGV after step 3
  exit4       - rank N, after training, finds a prediction above its high-water mark, prints an error, sys.exit(4)
  harmwidth   - every rank: the M4 overtide added to the features (18 harmonic values, the model expects 16)
  none        - control, clean run

What happened (filled in after the runs):
  constituent - KeyError: 'MSf' at start-up; peers Connection closed by peer in the first all_gather (np4 r2 plain, np6 r0 tee_trainer)
  datum       - ValueError: could not convert string to float: '0.42 m CD' at start-up; peers closed (np3 r1 tee)
  nogauge     - FileNotFoundError gauges/qc/station_1.pt, seen only in rank 1's stderr.log; console Root Cause rank 1 (np4 r1 redirects)
  ckptharm    - load_state_dict size mismatch for inp.weight [32, 30] vs [32, 28] on rank 2 (worker-0); worker-1's ranks closed (np4 pdsh2)
  ckptmeta    - UnpicklingError 'Weights only load failed ... GLOBAL __main__.StationMeta'; peers SIGTERMed (np3 r0 pymodule)
  rangegather - DETAIL: 'Detected mismatch between collectives', rank 4 TensorShape=[3] (np6 r4 detail, --ddp 0); without DETAIL
                'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (3), got (2))' (np3 r1 tee)
  lagindex    - IndexError 'index 720 is out of bounds for dimension 0 with size 720' at step 3 (np4 r3 loglevel, np8 r5 filter)
  nanlevel    - the NaN gap (hours 300-339) reached a random batch already at step 0, not step 2: 'loss is nan at step 0',
                FloatingPointError (np4 r0 restart, second attempt connectFullMesh refused; np3 r2 prefix)
  surge       - 12 s: ranks 0, 1 'Timed out waiting 12000ms for recv', Root Cause rank 1 (np3 r2 wrapper); 300 s: silent after
                step 1, killed by timeout at 60 s, exit 124 (np4 r1 plain)
  sigsegv     - rank N exitcode -11 (SIGSEGV) after step 3, peers Connection reset/closed (np4 r2 tee_trainer, np3 r1 restart)
  exit4       - rank N's high-water ERROR line and exit 4 after step 5; Root Cause exitcode 4 (np6 r3 filter, np3 r0 pymodule)
  harmwidth   - every rank 'mat1 and mat2 shapes cannot be multiplied (64x30 and 28x32)'; Root Cause rank 0 (np3 loglevel)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/tide.pt, exit 0 (np3 prefix)
"""
import argparse
import json
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

WORK = "/tmp/fault420_work"
# angular speed in degrees per hour
CONSTITUENTS = {"M2": 28.984, "S2": 30.000, "N2": 28.440, "K2": 30.082,
                "K1": 15.041, "O1": 13.943, "P1": 14.959, "Q1": 13.399}
OVERTIDES = {"M4": 57.968}
LAGS = 12
HOURS = 720
log = None


class StationMeta:
    def __init__(self, name, lat, lon):
        self.name, self.lat, self.lon = name, lat, lon


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
    log = logging.getLogger("tide")
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


class TideNet(nn.Module):
    def __init__(self, ncons=8, lags=LAGS, hidden=32):
        super().__init__()
        self.inp = nn.Linear(2 * ncons + lags, hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(h))
        return self.out(h).squeeze(1)


def make_station(r):
    g = torch.Generator().manual_seed(500 + r)
    t = torch.arange(HOURS, dtype=torch.float64)
    level = torch.full((HOURS,), 2.5, dtype=torch.float64)
    for name, speed in CONSTITUENTS.items():
        amp = float(torch.rand(1, generator=g)) * (1.2 if name == "M2" else 0.3)
        ph = float(torch.rand(1, generator=g)) * 360.0
        level += amp * torch.cos(torch.deg2rad(speed * t - ph))
    level += 0.05 * torch.randn(HOURS, generator=g, dtype=torch.float64)
    header = {"name": f"gauge-{r:02d}", "datum_offset": f"{0.1 * r:.2f}", "constituents": list(CONSTITUENTS),
              "high_water_mark": float(level.max()) + 0.5}
    return level.float(), header


def prepare():
    for d in ("gauges", "stations", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        level, header = make_station(r)
        torch.save(level, f"{WORK}/gauges/station_{r}.pt")
        with open(f"{WORK}/stations/station_{r}.json", "w") as f:
            json.dump(header, f)
    torch.manual_seed(0)
    torch.save(TideNet(8).state_dict(), f"{WORK}/ckpt/tide_c8.pt")
    torch.save(TideNet(9).state_dict(), f"{WORK}/ckpt/tide_c9.pt")
    torch.save({"model": TideNet(8).state_dict(), "station": StationMeta("gauge-00", 50.37, -4.14)},
               f"{WORK}/ckpt/tide_meta.pt")
    print("prepared", WORK)


def harmonic_features(cons, hours):
    cols = []
    for name in cons:
        speed = CONSTITUENTS[name] if name in CONSTITUENTS or name not in OVERTIDES else OVERTIDES[name]
        ang = torch.deg2rad(speed * hours)
        cols += [torch.cos(ang), torch.sin(ang)]
    return torch.stack(cols, 1)


def windows(level, harm, idx):
    lags = torch.stack([level[i - LAGS:i] for i in idx.tolist()])
    x = torch.cat([harm[idx], lags - 2.5], 1)
    return x, level[idx] - 2.5


def surge_relaxation(budget):
    # pure-Python 1-D shallow-water relaxation over a 400-cell shelf
    eta = [0.0] * 400
    t0, sweeps = time.time(), 0
    while time.time() - t0 < budget:
        for i in range(1, 399):
            eta[i] = 0.25 * (eta[i - 1] + 2 * eta[i] + eta[i + 1]) + 1e-4 * math.sin(i * 0.01 + sweeps)
        sweeps += 1
    return sweeps, max(eta)


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, reading station header and gauge record")
    with open(f"{WORK}/stations/station_{rank}.json") as f:
        header = json.load(f)
    if bad and a.fault == "constituent":
        header["constituents"].append("MSf")
    if bad and a.fault == "datum":
        header["datum_offset"] = "0.42 m CD"
    if bad and a.fault == "harmwidth":
        header["constituents"].append("M4")
    datum = float(header["datum_offset"])
    sub = "qc/" if bad and a.fault == "nogauge" else ""
    level = torch.load(f"{WORK}/gauges/{sub}station_{rank}.pt") + datum
    if bad and a.fault == "nanlevel":
        level[300:340] = float("nan")
    hours = torch.arange(HOURS, dtype=torch.float32)
    speeds = [CONSTITUENTS[c] if c not in OVERTIDES else OVERTIDES[c] for c in header["constituents"]]
    say(f"rank {rank} station {header['name']}: {len(speeds)} constituents, datum {datum:+.2f} m")
    harm = harmonic_features(header["constituents"], hours)
    finite = level[torch.isfinite(level)]
    stats = torch.tensor([float(finite.max() - finite.min()), float(finite.mean())])
    if bad and a.fault == "rangegather":
        stats = torch.cat([stats, torch.tensor([0.37])])
    allstats = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(allstats, stats)
    say(f"rank {rank} tidal range {stats[0]:.3f} m, largest range of all stations "
        f"{max(float(s[0]) for s in allstats):.3f} m")
    model = TideNet()
    ck = {"ckptharm": "tide_c9.pt", "ckptmeta": "tide_meta.pt"}.get(a.fault, "tide_c8.pt") if bad else "tide_c8.pt"
    state = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(state.get("model", state) if isinstance(state, dict) and "model" in state else state)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(77 + rank)
    for step in range(a.steps):
        idx = torch.randint(LAGS, HOURS, (64,), generator=g)
        if bad and a.fault == "nanlevel" and step == 2:
            idx[:8] = torch.arange(320, 328)
        if bad and a.fault == "lagindex" and step == 3:
            idx[-1] = HOURS
        x, y = windows(level, harm, idx)
        pred = net(x)
        loss = ((pred - y) ** 2).mean()
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(x)).any(1).sum())
            say(f"rank {rank}: loss is {loss.item()} at step {step}; {nbad} of 64 windows hold non-finite gauge "
                f"levels (gap in the record?)", err=True)
            raise FloatingPointError(f"non-finite loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "surge" and step == 2:
            sweeps, peak = surge_relaxation(a.surge_budget)
            say(f"rank {rank} surge relaxation: {sweeps} sweeps, peak {peak:.4f} m")
        rmse = ((pred.detach() - y) ** 2).mean().reshape(1)
        dist.all_reduce(rmse)
        say(f"rank {rank} step {step} loss {loss.item():.4f} rmse {math.sqrt(rmse.item() / world):.4f} m")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        full_idx = torch.arange(LAGS, HOURS)
        x, y = windows(level, harm, full_idx)
        peak = float(model(x).max()) + 2.5 + datum
    if bad and a.fault == "exit4":
        peak = header["high_water_mark"] + datum + 0.83
    hwm = header["high_water_mark"] + datum
    if peak > hwm:
        say(f"rank {rank}: ERROR predicted level {peak:.2f} m exceeds the station's high-water mark "
            f"{hwm:.2f} m; refusing to publish the prediction", err=True)
        sys.exit(4)
    peaks = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(peaks, torch.tensor([peak]))
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/tide.pt")
        say(f"rank 0 done: {a.steps} steps, highest predicted level {max(float(p) for p in peaks):.2f} m, "
            f"saved export/tide.pt")
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
    p.add_argument("--surge-budget", type=int, default=45)
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
