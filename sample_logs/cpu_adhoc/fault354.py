"""A three-hundred-and-fifty-fourth hand-run batch: WIND POWER FORECASTING FROM TURBINE SCADA DATA.

Synthetic 10-minute SCADA records per turbine: wind speed, wind direction (sin, cos), nacelle temperature,
blade pitch and rotor speed, plus the active power in kW.  Every rank is one turbine: it reads
/tmp/fault354_work/scada/site_A/turbine_R.pt, looks its turbine id up in a table of rated powers, cuts
24-sample windows and trains a small GRU forecaster to predict the next 6 samples of power (normalised by the
rated power), wrapped in DDP over gloo (or, with --ddp 0, gradients all_reduced by hand).  The model starts
from ckpt/forecaster_h32.pt and the feature scaler from ckpt/scaler.pt.  Loss and MAE are all_reduced every
step, per-rank capacity factors per horizon are all_gathered at the end, and rank 0 saves export/forecaster.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  turbineid  - rank N's SCADA file names turbine "WTG-9B", missing from the turbine table (KeyError, start-up)
  nosite     - rank N reads its SCADA file from scada/site_B/, which does not exist (FileNotFoundError)
  curveckpt  - rank N initialises from ckpt/forecaster_h48.pt, a 48-unit GRU (load_state_dict size mismatch)
  pickleckpt - rank N loads ckpt/scaler_state.pt, a pickled ScalerState object (torch.load weights_only refusal)
  gatherstat - rank N all_gathers 7 capacity factors (nowcast + 6 horizons) instead of 6, at the end
  wakecalc   - rank N computes a Jensen wake-deficit table in pure Python before step 2's all_reduce (slow rank)
  icing      - rank N's turbine is flagged iced from step 3: availability 0, targets power/0 = inf (own check)
  windowidx  - rank N's window sampler at step 4 starts a window at the end of the series (IndexError)
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit4      - rank N prints its own ERROR line about a stuck anemometer after step 1 and calls sys.exit(4)
  lagwidth   - every rank appends an air-density column: 7 features into a GRU built for 6 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  turbineid  - KeyError: 'WTG-9B' at the rated-power lookup at start-up; peers SIGTERMed (np4 r1 tee, np6 r0 pymodule)
  nosite     - FileNotFoundError for scada/site_B/turbine_N.pt at start-up (np3 r2 loglevel); np4 r3 restart: attempt 2 died in Gloo connectFullMesh
  curveckpt  - load_state_dict size mismatch gru.weight_ih_l0 [144, 6] vs [96, 6]; only in rank 2's stderr.log (np4 r2 redirects)
  pickleckpt - UnpicklingError 'Weights only load failed' (Unsupported global __main__.ScalerState) (np3 r1 tee_trainer, np8 r5 prefix)
  gatherstat - DETAIL: 'Detected mismatch between collectives' ALLGATHER [7] vs [6] (np3 r1); 'allgather: invalid tensor size' (np6 r4 filter)
  wakecalc   - 12 s: peers 'Timed out waiting 12000ms', slow rank silent (np4 r2 wrapper); 300 s: silent, killed at 60 s, exit 124 (np3 r0)
  icing      - own check: 'non-finite loss nan/inf ... availability 0.0' then FloatingPointError at step 3 (np4 r3 pdsh2, np6 r2 tee logfmt)
  windowidx  - IndexError 'index 2000 is out of bounds for dimension 0 with size 2000' at step 4; rank 0 monitoredBarrier (np5 r4 detail)
  sigsegv    - no traceback after step 3; peers 'Connection reset by peer'; Root Cause exitcode -11 SIGSEGV (np3 r1 filter, np4 r0 loglevel)
  exit4      - rank N's 'ERROR turbine ... anemometer stuck' line, exit 4; Root Cause exitcode 4 (np5 r3 prefix, np3 r2 wrapper)
  lagwidth   - every rank: 'input.size(-1) must be equal to input_size. Expected 6, got 7'; Root Cause rank 1 (np8 pymodule)
  none       - clean: 6 steps on 4 ranks, exit 0 (np4 plain); np3 plain ran before the final barrier: SIGABRT at shutdown
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

WORK = "/tmp/fault354_work"
TURBINES = {"WTG-01": 2050.0, "WTG-02": 2050.0, "WTG-03": 2300.0, "WTG-04": 2300.0,
            "WTG-05": 3000.0, "WTG-06": 3000.0, "WTG-07": 3450.0, "WTG-08": 3450.0}
NFEAT = 6
LAGS = 24
HORIZON = 6
T = 2000
log = None


@dataclass
class ScalerState:
    mean: torch.Tensor
    std: torch.Tensor
    fitted_on: str


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
    log = logging.getLogger("windfc")
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
    def __init__(self, nfeat=NFEAT, hidden=32, horizon=HORIZON):
        super().__init__()
        self.gru = nn.GRU(nfeat, hidden, batch_first=True)
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, horizon))

    def forward(self, x):
        out, _ = self.gru(x)
        return self.head(out[:, -1])


def power_curve(ws, rated):
    frac = ((ws - 3.0) / (12.0 - 3.0)).clamp(0, 1) ** 3
    return torch.where(ws > 25.0, torch.zeros_like(ws), frac * rated)


def make_turbine(r):
    g = torch.Generator().manual_seed(500 + r)
    t = torch.arange(T, dtype=torch.float32)
    ws = (8 + 3 * torch.sin(t / 144 * 2 * math.pi) + torch.randn(T, generator=g).cumsum(0) * 0.05).clamp(0, 30)
    wd = t / 500 + torch.randn(T, generator=g) * 0.2
    temp = 12 + 5 * torch.sin(t / 144 * 2 * math.pi + 1.0)
    pitch = ((ws - 12).clamp(min=0) * 1.5)
    rpm = (ws * 1.4).clamp(max=16)
    tid = f"WTG-{r + 1:02d}"
    power = power_curve(ws, TURBINES[tid]) + torch.randn(T, generator=g) * 20
    feats = torch.stack([ws, torch.sin(wd), torch.cos(wd), temp, pitch, rpm], 1)
    return {"turbine": tid, "features": feats, "power_kw": power.clamp(min=0)}


def prepare():
    for d in ("scada/site_A", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    allf = []
    for r in range(8):
        rec = make_turbine(r)
        torch.save(rec, f"{WORK}/scada/site_A/turbine_{r}.pt")
        allf.append(rec["features"])
    allf = torch.cat(allf)
    torch.save({"mean": allf.mean(0), "std": allf.std(0)}, f"{WORK}/ckpt/scaler.pt")
    torch.save(ScalerState(allf.mean(0), allf.std(0), "site_A 2026-10"), f"{WORK}/ckpt/scaler_state.pt")
    torch.manual_seed(0)
    torch.save(Forecaster(hidden=32).state_dict(), f"{WORK}/ckpt/forecaster_h32.pt")
    torch.save(Forecaster(hidden=48).state_dict(), f"{WORK}/ckpt/forecaster_h48.pt")
    print("prepared", WORK)


def jensen_wake_table(n_turbines=8, sectors=360):
    table = []
    for sector in range(sectors):
        row = []
        for up in range(n_turbines):
            for down in range(n_turbines):
                d = abs(up - down) * 450.0 + 1e-3
                deficit = 0.0
                for k in range(200):
                    deficit += (1 - math.sqrt(1 - 0.8)) / (1 + 0.075 * d / (40 + k)) ** 2
                row.append(deficit * math.cos(math.radians(sector)))
        table.append(row)
    return table


def windows(feats, power, starts):
    idx = starts[:, None] + torch.arange(LAGS)
    tidx = starts[:, None] + LAGS + torch.arange(HORIZON)
    return feats[idx], power[tidx]


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    site = "site_B" if bad and a.fault == "nosite" else "site_A"
    say(f"rank {rank}/{world} up, reading SCADA from scada/{site}/turbine_{rank}.pt")
    rec = torch.load(f"{WORK}/scada/{site}/turbine_{rank}.pt")
    if bad and a.fault == "turbineid":
        rec["turbine"] = "WTG-9B"
    rated = TURBINES[rec["turbine"]]
    feats, power = rec["features"], rec["power_kw"]
    if a.fault == "lagwidth":
        rho = 1.225 * 288.15 / (273.15 + feats[:, 3:4])
        feats = torch.cat([feats, rho], 1)
    sc_file = "scaler_state.pt" if bad and a.fault == "pickleckpt" else "scaler.pt"
    sc = torch.load(f"{WORK}/ckpt/{sc_file}")
    mean = torch.cat([sc["mean"], torch.ones(feats.shape[1] - NFEAT)])
    std = torch.cat([sc["std"], torch.ones(feats.shape[1] - NFEAT)])
    feats = (feats - mean) / std
    say(f"rank {rank} turbine {rec['turbine']} rated {rated:.0f} kW, {feats.shape[0]} records")
    model = Forecaster()
    ck = "forecaster_h48.pt" if bad and a.fault == "curveckpt" else "forecaster_h32.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    nwin = feats.shape[0] - LAGS - HORIZON
    for step in range(a.steps):
        starts = torch.randint(0, nwin, (32,))
        if bad and a.fault == "windowidx" and step == 4:
            starts[-1] = feats.shape[0]
        x, y = windows(feats, power, starts)
        avail = 0.0 if bad and a.fault == "icing" and step >= 3 else 1.0
        target = y / (rated * avail)
        pred = net(x)
        loss = ((pred - target) ** 2).mean()
        if not torch.isfinite(loss):
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} (turbine {rec['turbine']} availability "
                f"{avail}, {int((~torch.isfinite(target)).sum())} non-finite targets)", err=True)
            raise FloatingPointError(f"non-finite loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "wakecalc" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.wake_budget:
                n += len(jensen_wake_table())
            say(f"rank {rank} wake table: {n} sectors")
        stats = torch.stack([loss.detach(), (pred.detach() - target).abs().mean()])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} mae {stats[1].item() / world:.4f}")
        if bad and a.fault == "exit4" and step == 1:
            say(f"rank {rank}: ERROR turbine {rec['turbine']} anemometer stuck at 3.2 m/s for 144 samples, "
                f"refusing to train on frozen wind speed", err=True)
            sys.exit(4)
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    with torch.no_grad():
        cf = (power[-HORIZON:] / rated).reshape(HORIZON)
        if bad and a.fault == "gatherstat":
            cf = torch.cat([(power[-HORIZON - 1] / rated).reshape(1), cf])
    allcf = [torch.zeros(HORIZON) for _ in range(world)]
    dist.all_gather(allcf, cf)
    say(f"rank {rank} capacity factor {cf.mean():.3f} fleet {torch.stack(allcf).mean():.3f}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/forecaster.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/forecaster.pt")
    dist.barrier()
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
    p.add_argument("--wake-budget", type=int, default=40)
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
