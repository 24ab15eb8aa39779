"""A four-hundred-and-sixty-fifth hand-run batch: OCEAN WAVE HEIGHT NOWCASTING FROM BUOY SERIES.

Synthetic hourly buoy records: each rank owns one moored buoy (a station id looked up in an 8-entry station
table giving latitude, longitude and water depth) and reads its series from
/tmp/fault465_work/buoys/buoy_R.pt: significant wave height Hs, peak period Tp, wind speed, wind-from
direction (degrees) and sea-level pressure.  Inputs are 24-hour windows of 5 standardised channels, the target
is Hs one hour ahead.  The model is a small GRU with a linear head, initialised from ckpt/gru_h32.pt and wrapped
in DDP (gloo), or with --ddp 0 the gradients are all_reduced by hand.  Per-rank station statistics (mean Hs,
max Hs, mean Tp, depth) are all_gathered at the start, the RMSE is all_reduced every step, a hold-out skill
is all_reduced at the end, and rank 0 saves export/swell_gru.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  stationid   - rank N's buoy file names station "46999", missing from the station table (KeyError, start-up)
  nofile      - rank N reads its series from buoys/qc/ which does not exist (FileNotFoundError)
  ckptsize    - rank N initialises from ckpt/gru_h48.pt, saved with 48 hidden units (size mismatch)
  weightsonly - rank N initialises from ckpt/gru_meta.pt, which pickles a StationMeta object (weights_only refusal)
  gathershape - rank N all_gathers its station statistics plus a swell-fraction entry (5 vs 4 values)
  slowspectra - rank N computes a wave spectrum with a pure-Python DFT before the step-2 all_reduce
  spike       - rank N's pressure channel reads +inf from step 3 (a stuck sensor); the program's finiteness check
  sigsegv     - rank N sends itself SIGSEGV after step 3
  exit2       - rank N prints its own error line (no valid Hs hours after QC) at step 1 and calls sys.exit(2)
  featwidth   - every rank adds sin/cos of the wave direction: 7 channels, the GRU expects 5 (shape error)
  lagindex    - rank N's hold-out evaluation at the end reads an hour past the end of its series (IndexError)
  none        - control, clean run

What happened (filled in after the runs):
  stationid   - rank N: KeyError: '46999' at the STATIONS lookup at start-up; peers 'Connection closed by peer' in the all_gather (np4 r2 tee, np6 r0 loglevel)
  nofile      - FileNotFoundError for buoys/qc/buoy_N.pt at start-up; peers closed (np3 r1 pymodule, np4 r3 wrapper)
  ckptsize    - load_state_dict size mismatch gru.weight_ih_l0 [144,5] vs [96,5] (np4 r1 pdsh2: worker-1 RendezvousConnectionError after; np3 r2 redirects: only in rank 2's stderr.log)
  weightsonly - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.StationMeta'; others SIGTERMed in step 0 (np5 r3 tee_trainer, np3 r0 prefix)
  gathershape - DETAIL: 'Detected mismatch between collectives on ranks', rank 1 TensorShape=[5] (np4 r1 detail); plain gloo: 'allgather: invalid tensor size at index 0 (expected (5), got (4))' on rank 4 (np6 r4 filter)
  slowspectra - 12 s: ranks 0/1 'Timed out waiting 12000ms for recv', Root Cause names rank 1 (np3 r2 prefix); 300 s: output stops after step 1, killed at 60 s, exit 124 (np4 r1 plain)
  spike       - NaN gradients from the +inf rank spread (DDP or hand all_reduce): every rank's check raises FloatingPointError at step 4, only rank N counts 384 non-finite inputs (np4 r0 restart: attempt 1 then died in Gloo connectFullMesh, the fault did not recur; np3 r1 detail: Root Cause rank 0)
  sigsegv     - no traceback from rank N after step 3; peers 'Connection reset by peer'; Root Cause exitcode -11 (SIGSEGV) (np4 r3 tee, np8 r5 plain)
  exit2       - rank N's QC ERROR line and exit 2 at step 1; Root Cause exitcode 2, torchrun exit 1 (np3 r0 filter, np6 r2 tee_trainer)
  featwidth   - every rank: 'input.size(-1) must be equal to input_size. Expected 5, got 7' in the first forward; Root Cause rank 0 (np3 loglevel)
  lagindex    - after 6 steps rank N: 'IndexError: index 999 is out of bounds for dimension 0 with size 999'; peers closed in the hold-out all_reduce (np5 r4 pymodule, np8 r2 wrapper)
  none        - clean: 6 steps on 3 ranks, hold-out rmse, rank 0 saved export/swell_gru.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault465_work"
STATIONS = {"46042": (36.8, -122.4, 1645.0), "46026": (37.8, -122.8, 53.0), "46013": (38.2, -123.3, 123.0),
            "46014": (39.2, -124.0, 264.0), "46022": (40.7, -124.5, 675.0), "46027": (41.8, -124.4, 48.0),
            "46050": (44.7, -124.5, 130.0), "46029": (46.2, -124.5, 135.0)}
CHANNELS = 5
WINDOW = 24
HIDDEN = 32
log = None


class StationMeta:
    def __init__(self, station, depth):
        self.station = station
        self.depth = depth


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
    log = logging.getLogger("swell")
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


class SwellGRU(nn.Module):
    def __init__(self, channels=CHANNELS, hidden=HIDDEN):
        super().__init__()
        self.gru = nn.GRU(channels, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        out, _ = self.gru(x)
        return self.head(out[:, -1]).squeeze(1)


def make_series(hours, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(hours, dtype=torch.float32)
    wind = 8 + 4 * torch.sin(2 * math.pi * t / 96) + torch.randn(hours, generator=g)
    hs = 1.5 + 0.12 * wind + 0.6 * torch.sin(2 * math.pi * t / 240) + 0.1 * torch.randn(hours, generator=g)
    tp = 9 + 3 * torch.sin(2 * math.pi * t / 300 + 1.0) + 0.3 * torch.randn(hours, generator=g)
    wdir = (270 + 40 * torch.sin(2 * math.pi * t / 150)) % 360
    pres = 1013 - 6 * torch.sin(2 * math.pi * t / 96) + torch.randn(hours, generator=g)
    return torch.stack([hs.clamp(min=0.2), tp, wind.clamp(min=0), wdir, pres], 1)


def prepare():
    os.makedirs(f"{WORK}/buoys", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r, st in enumerate(STATIONS):
        torch.save({"station": st, "series": make_series(1024, 300 + r)}, f"{WORK}/buoys/buoy_{r}.pt")
    torch.manual_seed(0)
    torch.save(SwellGRU().state_dict(), f"{WORK}/ckpt/gru_h32.pt")
    torch.save(SwellGRU(hidden=48).state_dict(), f"{WORK}/ckpt/gru_h48.pt")
    torch.save({"state": SwellGRU().state_dict(), "meta": StationMeta("46042", 1645.0)}, f"{WORK}/ckpt/gru_meta.pt")
    print("prepared", WORK)


def windows(series, a, bad):
    feats = series.clone()
    mu, sd = feats.mean(0), feats.std(0)
    z = (feats - mu) / sd
    if a.fault == "featwidth":
        rad = series[:, 3] * math.pi / 180
        z = torch.cat([z, torch.sin(rad)[:, None], torch.cos(rad)[:, None]], 1)
    n = series.shape[0] - WINDOW - 1
    idx = torch.arange(n)[:, None] + torch.arange(WINDOW)[None]
    x = z[idx]
    y = series[WINDOW:WINDOW + n, 0]
    return x, y


def spectrum(hs, budget):
    t0 = time.time()
    n = len(hs)
    power = []
    while time.time() - t0 < budget:
        power = []
        for k in range(n // 2):
            re = sum(hs[j] * math.cos(2 * math.pi * k * j / n) for j in range(n))
            im = sum(hs[j] * math.sin(2 * math.pi * k * j / n) for j in range(n))
            power.append(re * re + im * im)
    return power


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4650 + rank)
    say(f"rank {rank}/{world} up, loading buoy series")
    sub = "qc/" if bad and a.fault == "nofile" else ""
    rec = torch.load(f"{WORK}/buoys/{sub}buoy_{rank % 8}.pt")
    if bad and a.fault == "stationid":
        rec["station"] = "46999"
    lat, lon, depth = STATIONS[rec["station"]]
    series = rec["series"]
    hs = series[:, 0]
    stats = torch.tensor([hs.mean(), hs.max(), series[:, 1].mean(), depth])
    if bad and a.fault == "gathershape":
        stats = torch.cat([stats, (series[:, 1] > 12).float().mean().reshape(1)])
    allstats = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(allstats, stats)
    say(f"rank {rank} station {rec['station']} ({lat:.1f},{lon:.1f}) mean Hs {stats[0]:.2f} m, "
        f"fleet max Hs {max(float(s[1]) for s in allstats):.2f} m")
    x, y = windows(series, a, bad)
    train_n = x.shape[0] - 96
    model = SwellGRU()
    ck = "gru_h32.pt"
    if bad and a.fault == "ckptsize":
        ck = "gru_h48.pt"
    if bad and a.fault == "weightsonly":
        ck = "gru_meta.pt"
    sd = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(a.steps):
        sel = torch.randint(0, train_n, (64,), generator=g)
        xb, yb = x[sel].clone(), y[sel]
        if bad and a.fault == "spike" and step >= 3:
            xb[:, -6:, 4] = float("inf")
        pred = net(xb)
        loss = ((pred - yb) ** 2).mean()
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step}; "
                f"{int((~torch.isfinite(xb)).sum())} non-finite input values (pressure channel)", err=True)
            raise FloatingPointError(f"non-finite nowcast loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowspectra" and step == 2:
            power = spectrum(hs[:512].tolist(), a.spectra_budget)
            say(f"rank {rank} spectrum: peak bin {max(range(len(power)), key=power.__getitem__)}")
        if bad and a.fault == "exit2" and step == 1:
            say(f"rank {rank}: ERROR station {rec['station']} has 0 valid Hs hours after QC "
                f"(all flagged 4: mooring adrift?), refusing to train", err=True)
            sys.exit(2)
        rmse = ((pred.detach() - yb) ** 2).mean().reshape(1)
        dist.all_reduce(rmse)
        say(f"rank {rank} step {step} loss {loss.item():.4f} rmse {math.sqrt(rmse.item() / world):.3f} m")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    hold = torch.arange(train_n, x.shape[0])
    if bad and a.fault == "lagindex":
        hold = hold + 30
    with torch.no_grad():
        yh = torch.stack([y[i] for i in hold.tolist()])
        skill = ((model(x[hold.clamp(max=x.shape[0] - 1)]) - yh) ** 2).mean().sqrt().reshape(1)
    dist.all_reduce(skill)
    say(f"rank {rank} hold-out rmse {skill.item() / world:.3f} m")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/swell_gru.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/swell_gru.pt")
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
    p.add_argument("--spectra-budget", type=int, default=600)
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
