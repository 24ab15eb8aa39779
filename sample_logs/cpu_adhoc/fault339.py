"""A three-hundred-and-thirty-ninth hand-run batch: MULTIVARIATE TIME-SERIES FORECASTING WITH A TEMPORAL CONVOLUTION NETWORK.

Synthetic sensor series: every rank reads /tmp/fault339_work/data/series_R.pt, a dict with a [T, 6] float
tensor of readings and the sensor id of every column (looked up in a 6-entry SENSORS table to order the
columns).  Each column is standardised by its own mean and std, cut into windows of 32 steps, and a TCN
(three causal dilated Conv1d blocks, dilation 1/2/4, kernel 3, residual adds, a linear head) forecasts the
next 4 steps of all 6 channels on an MSE loss, wrapped in DDP (gloo) or, with --ddp 0, gradients all_reduced
by hand.  The model starts from ckpt/tcn_k3.pt.  The loss is all_reduced every step; after training every
rank all_gathers its validation MAE per horizon step (4 values) and rank 0 saves export/tcn.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  sensorid    - rank N's series has a column from sensor "H07", missing from the SENSORS table (KeyError)
  nodata      - rank N reads its series from data/2026-11/ which does not exist (FileNotFoundError)
  ckptdil     - rank N initialises from ckpt/tcn_k5.pt, saved with kernel size 5 (size mismatch)
  ckptpickle  - rank N initialises from ckpt/tcn_meta.pt, which pickles a ScalerMeta object (weights_only refusal)
  horizongather - rank N all_gathers its validation MAE for 5 horizon steps instead of 4 (invalid tensor size)
  slowacf     - rank N computes autocorrelations in pure Python before the step-2 all_reduce (--acf-budget s)
  nanscale    - at step 3 rank N's window has a sensor whose scale is 0: inf inputs, the program's loss check
  sigsegv     - rank N sends itself SIGSEGV after step 3
  exit4       - after training rank N prints its own error line about sensor clock drift and calls sys.exit(4)
  causalpad   - every rank: Conv1d padded on both sides, the residual add sees 34 vs 32 steps (shape error)
  none        - control, clean run

What happened (filled in after the runs):
  sensorid    - KeyError: 'H07' in order_columns at start-up; peers SIGTERMed (np4 r0 tee, np6 r4 filter)
  nodata      - FileNotFoundError data/2026-11/series_R.pt at start-up; peers SIGTERMed (np3 r1 pymodule, np8 r5 loglevel)
  ckptdil     - load_state_dict size mismatch [16,6,5] vs [16,6,3] (np4 r1 pdsh2, worker-1 RendezvousConnectionError; np3 r2 redirects)
  ckptpickle  - UnpicklingError 'Weights only load failed' (GLOBAL __main__.ScalerMeta) at start-up (np5 r3 tee_trainer)
  horizongather - DETAIL: 'Detected mismatch between collectives' on every rank, [5] vs [4] (np4 r3); 'allgather: invalid tensor size at index 0 (expected (5), got (4))' (np6 r1 prefix)
  slowacf     - 12 s: ranks 0,1 'Timed out waiting 12000ms for recv' (np3 r2 wrapper); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r1 plain)
  nanscale    - 'non-finite loss nan at step 3' + FloatingPointError; peers monitoredBarrier errors (np3 r0 detail) / Connection closed (np6 r4 tee)
  sigsegv     - exitcode -11 after step 3, peers Connection reset (np3 r0 pymodule); restart: attempt 1 connectFullMesh refused (np4 r2 restart)
  exit4       - rank's ERROR clock-drift line, exitcode 4 after training, peers Connection closed (np5 r1 loglevel, np3 r2 restart)
  causalpad   - every rank 'The size of tensor a (34) must match the size of tensor b (32)' in the first forward (np8 tee_trainer, np3 wrapper)
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

WORK = "/tmp/fault339_work"
SENSORS = {"T01": 0, "T02": 1, "P01": 2, "P02": 3, "F01": 4, "V01": 5}
NCH = 6
WIN = 32
HOR = 4
HID = 16
log = None


class ScalerMeta:
    def __init__(self, means, stds):
        self.means = means
        self.stds = stds


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
    log = logging.getLogger("tsfc")
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


class CausalBlock(nn.Module):
    def __init__(self, cin, cout, k, dil, bug=False):
        super().__init__()
        self.pad = (k - 1) * dil
        self.bug = bug
        self.conv = nn.Conv1d(cin, cout, k, dilation=dil, padding=self.pad if bug else 0)
        self.res = nn.Conv1d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        h = x if self.bug else nn.functional.pad(x, (self.pad, 0))
        return torch.relu(self.conv(h) + self.res(x))


class TCN(nn.Module):
    def __init__(self, k=3, bug=False):
        super().__init__()
        self.blocks = nn.Sequential(CausalBlock(NCH, HID, k, 1, bug), CausalBlock(HID, HID, k, 2, bug),
                                    CausalBlock(HID, HID, k, 4, bug))
        self.head = nn.Linear(HID, NCH * HOR)

    def forward(self, x):
        h = self.blocks(x.transpose(1, 2))
        return self.head(h[:, :, -1]).view(-1, HOR, NCH)


def make_series(T, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(T, dtype=torch.float32)
    cols = []
    for c in range(NCH):
        period = 12.0 + 6 * c
        base = torch.sin(2 * torch.pi * t / period + float(torch.rand(1, generator=g)) * 6.28)
        trend = 0.002 * (c - 2) * t
        cols.append((base + trend + 0.1 * torch.randn(T, generator=g)) * (1 + c) + 10 * c)
    ids = list(SENSORS)
    perm = torch.randperm(NCH, generator=g).tolist()
    return {"values": torch.stack([cols[p] for p in perm], 1), "sensors": [ids[p] for p in perm]}


def prepare():
    os.makedirs(f"{WORK}/data", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_series(400, 700 + r), f"{WORK}/data/series_{r}.pt")
    torch.manual_seed(0)
    torch.save(TCN(3).state_dict(), f"{WORK}/ckpt/tcn_k3.pt")
    torch.save(TCN(5).state_dict(), f"{WORK}/ckpt/tcn_k5.pt")
    torch.save({"model": TCN(3).state_dict(), "scaler": ScalerMeta([0.0] * NCH, [1.0] * NCH)},
               f"{WORK}/ckpt/tcn_meta.pt")
    print("prepared", WORK)


def order_columns(d):
    idx = [SENSORS[s] for s in d["sensors"]]
    out = torch.empty_like(d["values"])
    out[:, idx] = d["values"]
    return out


def windows(v):
    n = v.shape[0] - WIN - HOR + 1
    x = torch.stack([v[i:i + WIN] for i in range(n)])
    y = torch.stack([v[i + WIN:i + WIN + HOR] for i in range(n)])
    return x, y


def acf_python(series, maxlag):
    vals = [float(u) for u in series]
    n = len(vals)
    mu = sum(vals) / n
    var = sum((u - mu) ** 2 for u in vals)
    out = []
    for lag in range(1, maxlag):
        out.append(sum((vals[i] - mu) * (vals[i + lag] - mu) for i in range(n - lag)) / var)
    return out


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading sensor series")
    part = "2026-11/" if bad and a.fault == "nodata" else ""
    d = torch.load(f"{WORK}/data/{part}series_{rank}.pt")
    if bad and a.fault == "sensorid":
        d["sensors"][3] = "H07"
    v = order_columns(d)
    split = int(v.shape[0] * 0.8)
    mean, std = v[:split].mean(0), v[:split].std(0)
    v = (v - mean) / std
    x, y = windows(v[:split])
    xv, yv = windows(v[split - WIN:])
    say(f"rank {rank} windows train {x.shape[0]} val {xv.shape[0]} channels {NCH}")
    model = TCN(3, bug=a.fault == "causalpad")
    ck = {"ckptdil": "tcn_k5.pt", "ckptpickle": "tcn_meta.pt"}.get(a.fault if bad else "", "tcn_k3.pt")
    sd = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    bs = 48
    for step in range(a.steps):
        i0 = (step * bs) % (x.shape[0] - bs)
        xb, yb = x[i0:i0 + bs].clone(), y[i0:i0 + bs]
        if bad and a.fault == "nanscale" and step == 3:
            xb[:, :, 4] = xb[:, :, 4] * std[4] / 0.0
        pred = net(xb)
        loss = ((pred - yb) ** 2).mean()
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"({int((~torch.isfinite(xb)).sum())} non-finite inputs in channel F01)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowacf" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.acf_budget:
                acf_python(v[:, n % NCH].tolist() * 4, 96)
                n += 1
            say(f"rank {rank} autocorrelation table: {n} channels")
        mae = (pred.detach() - yb).abs().mean().reshape(1)
        lt = loss.detach().reshape(1)
        dist.all_reduce(lt)
        dist.all_reduce(mae)
        say(f"rank {rank} step {step} loss {lt.item() / world:.4f} mae {mae.item() / world:.4f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR sensor clock drift on P02: 17 timestamps out of order after resampling, "
            f"validation aborted", err=True)
        sys.exit(4)
    with torch.no_grad():
        vm = (model(xv) - yv).abs().mean(dim=(0, 2))
    if bad and a.fault == "horizongather":
        vm = torch.cat([vm, vm[-1:]])
    allv = [torch.zeros(HOR) for _ in range(world)]
    dist.all_gather(allv, vm)
    say(f"rank {rank} val mae by horizon {[round(float(u), 3) for u in vm]}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/tcn.pt")
        say(f"rank 0 done: {a.steps} steps, global val mae {float(torch.stack(allv).mean()):.4f}, "
            f"saved export/tcn.pt")
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
    p.add_argument("--acf-budget", type=int, default=90)
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
