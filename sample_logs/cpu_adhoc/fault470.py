"""A four-hundred-and-seventieth hand-run batch: POLLEN COUNT FORECASTING FROM WEATHER SERIES.

Synthetic station data: every series is 14 days of weather (temperature, humidity, wind, rain, sunshine)
from one monitoring station (looked up in an 8-entry station table) and the next day's grass-pollen count
(grains per m^3).  Every rank reads its series from /tmp/fault470_work/wx/wx_R.pt, takes log1p of the counts
as the target and trains a small forecaster (a GRU over the days, a station embedding, a linear head) on an
MSE loss, wrapped in DDP over gloo (or, with --ddp 0, gradients all_reduced by hand).  The model starts from
ckpt/pollen_s8.pt.  The MAE is all_reduced every step; at the end each rank's mean count and coverage are
all_gathered and rank 0 saves export/pollen.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  station    - rank N's series carry station "BSL3", not in the station table (KeyError at start-up)
  nowx       - rank N reads its series from wx/2025/ which does not exist (FileNotFoundError at start-up)
  lagidx     - rank N adds a day-15 lag feature at step 3 from a 14-day window (IndexError)
  ckptvocab  - rank N starts from ckpt/pollen_s12.pt, saved with 12 stations (size mismatch in load_state_dict)
  ckptpickle - rank N loads ckpt/pollen_scaler.pt, a checkpoint holding a pickled Scaler object (weights_only refusal)
  statgather - rank N all_gathers its statistics with a 5th entry (peak count) at the end (5 vs 4 entries)
  slow       - rank N recomputes growing-degree-days in pure Python before the step-2 all_reduce (--slow-budget s)
  lognan     - rank N's step-2 batch holds the sensor's -9 "missing" code: log1p gives NaN, the program's check
  segv       - rank N sends itself SIGSEGV after step 4
  exit4      - rank N prints its own error line (station calibration expired) and calls sys.exit(4)
  featwidth  - every rank: 6 weather features (dew point added), the GRU expects 5 (shape error in step 0)
  none       - control, clean run

What happened (filled in after the runs):
  station    - KeyError: 'BSL3' building station indices at start-up; peers Connection closed by peer in DDP's check (np4 r2 bashloop); torchrun SIGTERMs the rest, Root Cause rank 0 (np6 r0 tee)
  nowx       - FileNotFoundError for wx/2025/wx_N.pt at start-up; peers closed in DDP's check (np3 r1 ranklabel, np4 r3 files)
  lagidx     - step 3: 'index 14 is out of bounds for dimension 1 with size 14'; peers closed in backward (np5 r1 srunlabel); ProcessRaisedException, process 2 (np3 r2 spawn, --ddp 0)
  ckptvocab  - load_state_dict size mismatch for station.weight [12, 4] vs [8, 4]; global rank 2 on the agent labelled worker-0 (np4 r2 pdsh2)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.Scaler' (np3 r1 legacy, np8 r5 mpitag)
  statgather - after step 5: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))'; peers closed (np6 r4 bashloop)
  slow       - 12 s: a peer's step-2 all_reduce 'Timed out waiting 12000ms for recv' (np3 r2 srunlabel); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r1 ranklabel)
  lognan     - the program's check 'loss is nan (3 non-finite targets in batch, min count -9)' and FloatingPointError at step 2 (np4 r0 logfmt, np3 r2 mpitag)
  segv       - no traceback after step 4; ProcessExitedException SIGSEGV (np4 r3 spawn); Root Cause rank 2 exitcode -11 (np6 r2 legacy)
  exit4      - rank N's calibration ERROR line and exit 4, no traceback; Root Cause exitcode 4, launchers exit 1 (np3 r1 tee, np4 r3 pdsh2)
  featwidth  - every rank: 'input.size(-1) must be equal to input_size. Expected 5, got 6' in step 0; Root Cause rank 2 (np3 logfmt)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/pollen.pt, exit 0 (np3 bashloop)
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

WORK = "/tmp/fault470_work"
DAYS = 14
NFEAT = 5
BATCH = 16
log = None


class Scaler:
    """Feature scaler pickled into an old checkpoint (not a tensor: weights_only refuses it)."""

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
    log = logging.getLogger("pollen")
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


class PollenNet(nn.Module):
    def __init__(self, nstation=8, nfeat=NFEAT, hid=16):
        super().__init__()
        self.gru = nn.GRU(nfeat, hid, batch_first=True)
        self.station = nn.Embedding(nstation, 4)
        self.head = nn.Linear(hid + 4, 1)

    def forward(self, wx, st):
        _, h = self.gru(wx)
        return self.head(torch.cat([h[-1], self.station(st)], 1)).squeeze(1)


def make_series(n, seed, stations):
    g = torch.Generator().manual_seed(seed)
    codes = list(stations)
    wx = torch.randn(n, DAYS, NFEAT, generator=g)
    st = [codes[int(i)] for i in torch.randint(0, len(codes), (n,), generator=g)]
    base = torch.tensor([stations[c] for c in st], dtype=torch.float32)
    warm = wx[:, -5:, 0].mean(1) - wx[:, -5:, 3].mean(1) + 0.3 * wx[:, -3:, 2].mean(1)
    pollen = torch.clamp(torch.exp(3.0 + 0.8 * warm + 0.1 * base + 0.2 * torch.randn(n, generator=g)), min=0.0)
    return {"station": st, "wx": wx, "pollen": pollen.round()}


def prepare():
    os.makedirs(f"{WORK}/wx", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    stations = {"ZRH1": 0, "BRN2": 1, "GVA1": 2, "LUG4": 3, "CHU1": 4, "SIO2": 5, "NEU1": 6, "LUZ3": 7}
    with open(f"{WORK}/stations.json", "w") as f:
        json.dump(stations, f)
    for r in range(8):
        torch.save(make_series(128, 700 + r, stations), f"{WORK}/wx/wx_{r}.pt")
    torch.manual_seed(0)
    torch.save(PollenNet(8).state_dict(), f"{WORK}/ckpt/pollen_s8.pt")
    torch.save(PollenNet(12).state_dict(), f"{WORK}/ckpt/pollen_s12.pt")
    torch.save({"model": PollenNet(8).state_dict(), "scaler": Scaler([0.0] * NFEAT, [1.0] * NFEAT)},
               f"{WORK}/ckpt/pollen_scaler.pt")
    print("prepared", WORK)


def growing_degree_days(wx, budget):
    t0 = time.time()
    total, n = 0.0, 0
    temps = wx[:, :, 0].tolist()
    while time.time() - t0 < budget:
        for series in temps:
            acc = 0.0
            for d in range(len(series)):
                for base in range(50):
                    acc += max(0.0, series[d] * 8 + 12 - base * 0.1)
            total += acc
        n += 1
    return total / max(n, 1)


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4700 + rank)
    say(f"rank {rank}/{world} up, loading weather series")
    with open(f"{WORK}/stations.json") as f:
        stations = json.load(f)
    sub = "2025/" if bad and a.fault == "nowx" else ""
    data = torch.load(f"{WORK}/wx/{sub}wx_{rank}.pt")
    if bad and a.fault == "station":
        data["station"][37] = "BSL3"
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR station {data['station'][0]} sensor calibration expired 2026-03-31; "
            f"refusing to train on uncalibrated counts", err=True)
        sys.exit(4)
    st = torch.tensor([stations[c] for c in data["station"]])
    wx = data["wx"]
    if a.fault == "featwidth":
        wx = torch.cat([wx, (wx[:, :, 0] - wx[:, :, 1] * 0.2).unsqueeze(2)], 2)
    pollen = data["pollen"].clone()
    if bad and a.fault == "lognan":
        pollen[2 * BATCH:2 * BATCH + 3] = -9.0
    target = torch.log1p(pollen)
    model = PollenNet()
    ck = "pollen_s8.pt"
    if bad and a.fault == "ckptvocab":
        ck = "pollen_s12.pt"
    if bad and a.fault == "ckptpickle":
        ck = "pollen_scaler.pt"
    state = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(state.get("model", state) if "model" in state else state)
    say(f"rank {rank} series {len(st)} stations {len(set(data['station']))} ckpt {ck}")
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    nb = len(st) // BATCH
    for step in range(a.steps):
        i = (step % nb) * BATCH
        xb, sb, yb = wx[i:i + BATCH], st[i:i + BATCH], target[i:i + BATCH]
        if bad and a.fault == "lagidx" and step == 3:
            lag = xb[:, DAYS, 0]
            xb = xb + lag[:, None, None] * 0.0
        pred = net(xb, sb)
        loss = ((pred - yb) ** 2).mean()
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(yb)).sum())
            say(f"rank {rank} step {step}: loss is {loss.item()} ({nbad} non-finite targets in batch, "
                f"min count {pollen[i:i + BATCH].min().item():.0f})", err=True)
            raise FloatingPointError(f"non-finite loss at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slow" and step == 2:
            gdd = growing_degree_days(xb, a.slow_budget)
            say(f"rank {rank} growing degree days {gdd:.1f}")
        mae = (torch.expm1(pred.detach()) - torch.expm1(yb)).abs().mean().reshape(1)
        dist.all_reduce(mae)
        say(f"rank {rank} step {step} loss {loss.item():.4f} mae {mae.item() / world:.1f} grains/m3")
        if bad and a.fault == "segv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    stats = torch.tensor([pollen.mean().item(), float(len(st)), float(len(set(data["station"]))), loss.item()])
    if bad and a.fault == "statgather":
        stats = torch.cat([stats, pollen.max().reshape(1)])
    allst = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(allst, stats)
    say(f"rank {rank} mean count {stats[0]:.1f}, all ranks {sum(s[0] for s in allst) / world:.1f}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/pollen.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/pollen.pt")
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
    p.add_argument("--slow-budget", type=int, default=40)
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
