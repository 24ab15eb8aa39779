"""Batch 416 of hand-run faults: WIND POWER FORECASTING FROM TURBINE SCADA.

Every rank owns the 10-minute SCADA records of one turbine of a synthetic wind park, read from
/tmp/fault416_work/scada/turbine_R.pt: wind speed, wind direction (degrees), ambient temperature, rotor rpm,
blade pitch, a status code and the active power of the next interval.  Records are turned into 12-step windows
of 6 features (speed corrected by a per-yaw-sector gain, sin/cos of the direction, temperature, rpm, pitch);
status codes are looked up in the park's status table to mask non-producing intervals.  A GRU forecaster
(initialised from ckpt/gru_h32.pt) predicts the normalised power, trained with an MSE loss under DDP (gloo) or,
with --ddp 0, with gradients all_reduced by hand.  The MAE is all_reduced every step; at the end every rank's
power-curve bin counts (25 bins of 1 m/s) are all_gathered and rank 0 saves export/forecaster.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  statuscode - rank N's step-2 batch carries status code 77 (a vendor code missing from the status table): KeyError
  sectoridx  - rank N's vane reports north as 360.0 deg: yaw sector 12 of a 12-entry gain table (IndexError)
  noscada    - rank N reads its SCADA file from scada/park_b/ which does not exist (FileNotFoundError)
  ckptwidth  - rank N initialises from ckpt/gru_h48.pt (hidden size 48 vs 32): load_state_dict size mismatch
  ckptpickle - rank N loads ckpt/forecaster_full.pt, a pickled whole module: torch.load weights_only refusal
  gatherbins - rank N all_gathers 26 power-curve bins (an extra cut-out bin) where the others send 25
  icing     - rank N runs an icing-detection sweep in Python before the step-3 all_reduce (PG timeout / hang)
  sensornan - rank N's anemometer drops out at step 4 (NaN wind speed): the program's loss check raises
  sigsegv   - rank N sends itself SIGSEGV after step 3
  curtail   - rank N finds its curtailment log inconsistent after training, prints an ERROR and sys.exit(5)
  lagwidth  - every rank: a lagged-power feature makes windows 7 wide, the GRU expects 6 (RuntimeError)
  none      - control, clean run

What happened (filled in after the runs):
  statuscode - 'KeyError: 77' in availability() at step 2; peers Connection closed by peer in backward (np4 r2 ranklabel,
               np6 r0 tee, Root Cause rank 0)
  sectoridx  - 'IndexError: list index out of range' at SECTOR_GAIN[int(d // 30)] at start-up; 7 peers closed in DDP()
               (np8 r6 srunlabel)
  noscada    - FileNotFoundError for scada/park_b/turbine_N.pt at start-up; peers closed in DDP() (np3 r1 mpitag, np4 r3 files)
  ckptwidth  - load_state_dict size mismatch gru.weight_ih_l0 [144, 6] vs [96, 6] (np4 r1 pdsh2, worker-1's agent then
               RendezvousConnectionError; np3 r2 legacy, Root Cause rank 2)
  ckptpickle - 'Weights only load failed ... Unsupported global: GLOBAL __main__.Forecaster' (np3 r0 srunlabel)
  gatherbins - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (26), got (25))' on rank N after
               6 clean steps; peers closed (np6 r4 bashloop, np3 r1 spawn)
  icing      - 12 s: ranks 0 and 1 'Timed out waiting 12000ms for recv', Root Cause rank 0 (np3 r2 logfmt); 300 s: silent
               after rank 1's sweep line, killed at 60 s, exit 124 (np4 r1 ranklabel; ranks killed by PID afterwards)
  sensornan  - 'non-finite loss nan (17 windows ...)' then FloatingPointError at step 4 (np4 r3 srunlabel: rank 0 also
               'terminate called without an active exception', exit 134; np8 r5 legacy, Root Cause rank 5)
  sigsegv    - spawn: 'process 1 terminated with signal SIGSEGV' (np3 r1); mpitag --ddp 0: silent, peers closed, exit 139 (np4 r2)
  curtail    - rank N's curtailment ERROR line and exit 5; Root Cause rank N exitcode 5 (np5 r3 tee, np3 r0 logfmt)
  lagwidth   - every rank 'input.size(-1) must be equal to input_size. Expected 6, got 7' in the first forward (np3 bashloop)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/forecaster.pt, exit 0 (np3 bashloop)
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
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault416_work"
STATUS = {0: ("producing", 1.0), 2: ("low wind", 1.0), 5: ("grid curtailment", 0.0), 11: ("maintenance", 0.0),
          23: ("yaw error", 0.0), 40: ("icing stop", 0.0)}
SECTOR_GAIN = [1.00, 0.98, 0.97, 1.02, 1.04, 1.01, 0.99, 0.95, 0.96, 1.00, 1.03, 1.02]
WIN = 12
NFEAT = 6
HIDDEN = 32
NBINS = 25
RATED_KW = 2050.0
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
    log = logging.getLogger("windpower")
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
    def __init__(self, nfeat=NFEAT, hidden=HIDDEN):
        super().__init__()
        self.gru = nn.GRU(nfeat, hidden, batch_first=True)
        self.head = nn.Sequential(nn.Linear(hidden, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x):
        out, _ = self.gru(x)
        return self.head(out[:, -1]).squeeze(1)


def power_curve(v):
    return torch.clamp((v - 3.0) / (12.0 - 3.0), 0, 1) ** 3 * (v < 25.0)


def make_turbine(n, seed):
    g = torch.Generator().manual_seed(seed)
    speed = torch.clamp(7 + 3 * torch.randn(n, generator=g).cumsum(0) * 0.05 + torch.randn(n, generator=g), 0, 30)
    direc = (220 + 40 * torch.randn(n, generator=g)) % 360
    temp = 8 + 4 * torch.randn(n, generator=g)
    rpm = 14 * torch.clamp(speed / 12, 0, 1)
    pitch = torch.clamp(speed - 12, 0, 20)
    status = torch.zeros(n, dtype=torch.long)
    status[torch.randint(0, n, (12,), generator=g)] = 5
    status[torch.randint(0, n, (6,), generator=g)] = 2
    power = power_curve(speed) * RATED_KW + 20 * torch.randn(n, generator=g)
    return {"speed": speed, "dir": direc, "temp": temp, "rpm": rpm, "pitch": pitch, "status": status,
            "power_kw": power.clamp(min=0)}


def prepare():
    os.makedirs(f"{WORK}/scada", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_turbine(400, 4160 + r), f"{WORK}/scada/turbine_{r}.pt")
    torch.manual_seed(0)
    torch.save(Forecaster().state_dict(), f"{WORK}/ckpt/gru_h32.pt")
    torch.save(Forecaster(hidden=48).state_dict(), f"{WORK}/ckpt/gru_h48.pt")
    torch.save(Forecaster(), f"{WORK}/ckpt/forecaster_full.pt")
    print("prepared", WORK)


def windows(rec, fault, bad):
    n = rec["speed"].shape[0]
    gains = []
    for d in rec["dir"].tolist():
        gains.append(SECTOR_GAIN[int(d // 30)])
    v = rec["speed"] * torch.tensor(gains)
    rad = rec["dir"] * math.pi / 180
    cols = [v / 25, torch.sin(rad), torch.cos(rad), rec["temp"] / 20, rec["rpm"] / 14, rec["pitch"] / 20]
    if fault == "lagwidth":
        lag = torch.cat([torch.zeros(1), rec["power_kw"][:-1]]) / RATED_KW
        cols.append(lag)
    feats = torch.stack(cols, 1)
    idx = torch.arange(WIN)[None, :] + torch.arange(n - WIN)[:, None]
    x = feats[idx]
    y = rec["power_kw"][WIN:] / RATED_KW
    return x, y, rec["status"][WIN:]


def availability(codes):
    return torch.tensor([STATUS[c][1] for c in codes.tolist()])


def icing_sweep(rec, budget):
    t0 = time.time()
    flagged = 0
    temps = rec["temp"].tolist()
    speeds = rec["speed"].tolist()
    while time.time() - t0 < budget:
        for i in range(len(temps)):
            for j in range(i, min(i + 36, len(temps))):
                if temps[j] < 1.0 and speeds[j] > 4.0:
                    flagged += 1
    return flagged


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(416 + rank)
    say(f"rank {rank}/{world} up, loading SCADA for turbine WTG{rank + 1:02d}")
    park = "park_b/" if bad and a.fault == "noscada" else ""
    rec = torch.load(f"{WORK}/scada/{park}turbine_{rank}.pt")
    if bad and a.fault == "sectoridx":
        rec["dir"][57] = 360.0
    if bad and a.fault == "statuscode":
        rec["status"][WIN + 2 * a.batch + 7] = 77
    if bad and a.fault == "sensornan":
        rec["speed"][WIN + 4 * a.batch + 3:WIN + 4 * a.batch + 9] = float("nan")
    x, y, codes = windows(rec, a.fault, bad)
    say(f"rank {rank} windows {tuple(x.shape)} mean power {y.mean().item() * RATED_KW:.0f} kW")
    model = Forecaster()
    ck = "gru_h32.pt"
    if bad and a.fault == "ckptwidth":
        ck = "gru_h48.pt"
    if bad and a.fault == "ckptpickle":
        model = torch.load(f"{WORK}/ckpt/forecaster_full.pt")
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        lo = step * a.batch
        xb, yb = x[lo:lo + a.batch], y[lo:lo + a.batch]
        mask = availability(codes[lo:lo + a.batch])
        pred = net(xb)
        loss = (((pred - yb) ** 2) * mask).sum() / mask.sum().clamp(min=1)
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(xb)).any(2).any(1).sum())
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} ({nbad} windows with non-finite "
                f"features, anemometer readings missing)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "icing" and step == 3:
            say(f"rank {rank} running icing-detection sweep over {len(rec['temp'])} records")
            n = icing_sweep(rec, a.icing_budget)
            say(f"rank {rank} icing sweep flagged {n} intervals")
        mae = ((pred.detach() - yb).abs() * mask).sum().reshape(1) / mask.sum().clamp(min=1)
        dist.all_reduce(mae)
        say(f"rank {rank} step {step} loss {loss.item():.4f} mae_kw {mae.item() / world * RATED_KW:.1f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "curtail":
        say(f"rank {rank}: ERROR curtailment log for WTG{rank + 1:02d} has 12 setpoint intervals with status 0 "
            f"(producing); refusing to publish a power curve from inconsistent SCADA", err=True)
        sys.exit(5)
    nb = NBINS + 1 if bad and a.fault == "gatherbins" else NBINS
    bins = torch.histc(rec["speed"], bins=nb, min=0, max=float(nb))
    allb = [torch.zeros(NBINS) for _ in range(world)]
    dist.all_gather(allb, bins)
    say(f"rank {rank} power-curve bins {int(bins.sum())} records, park total {int(sum(b.sum() for b in allb))}")
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
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--icing-budget", type=int, default=40)
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
