"""Batch 374 of hand-run faults: OCEAN WAVE HEIGHT FORECASTING FROM BUOY SERIES.

Synthetic buoy records: every rank reads the hourly series of its buoys from
/tmp/fault374_work/buoys/buoy_R.pt (significant wave height Hs, peak period Tp, wind speed, pressure and a
QC flag per hour).  QC flags are mapped to sample weights through a small table, windows of 24 past hours
(4 channels) are cut, and a GRU encoder with a linear head forecasts Hs 6 hours ahead (weighted MSE).  The
model is initialised from ckpt/wavegru_h32.pt and wrapped in DDP (gloo) (or, with --ddp 0, gradients are
all_reduced by hand).  The loss and the RMSE are all_reduced every step, per-rank buoy statistics (mean Hs,
max Hs, mean Tp, hours) are all_gathered at the end, and rank 0 saves export/wavegru.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  badqc       - rank N's buoy reports QC flag 9 (sensor under maintenance), missing from the QC table (KeyError)
  nobuoy      - rank N reads its series from buoys/archive/, which does not exist (FileNotFoundError)
  ckptsize    - rank N initialises from ckpt/wavegru_h48.pt, saved with 48 hidden units (size mismatch)
  ckptpickle  - rank N loads ckpt/wavegru_meta.pt, which pickles a BuoyMeta object (weights_only refusal)
  gathershape - rank N all_gathers 5 buoy statistics (plus a swell count) instead of 4, at the end
  slowspectra - rank N computes a wave spectrum of every window in pure Python before the step-3 all_reduce
  sigkill     - rank N sends itself SIGKILL after step 2
  sigsegv     - rank N sends itself SIGSEGV at step 4
  nanspike    - rank N's series holds an inf Hs spike at a later window; the program's own check raises
                FloatingPointError at step 3
  exit4       - rank N prints its own error line about a drifting mooring and calls sys.exit(4) after step 1
  window      - every rank: windows carry 5 channels (a wave direction column added), the GRU expects 4
  none        - control, clean run

What happened (filled in after the runs):
  badqc       - rank N: 'KeyError: 9' in make_windows before the first step; others SIGTERM, Root Cause rank N (np4 r2 tee, np6 r0 pymodule)
  nobuoy      - rank N: FileNotFoundError for buoys/archive/buoy_N.pt at start-up; others SIGTERM (np3 r1 loglevel, np4 r3 wrapper)
  ckptsize    - rank N: load_state_dict size mismatch ([144, 4] vs [96, 4] ...) (np4 r1 pdsh2, the other agent then loses the
                c10d store; np3 r2 restart: attempt 2 failed in init on every rank with 'Gloo connectFullMesh failed ... Connection refused')
  ckptpickle  - rank N: '_pickle.UnpicklingError: Weights only load failed.' (np3 r0 tee_trainer)
  gathershape - after step 6 rank N: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' (np4 r2 filter);
                under DETAIL every rank 'Detected mismatch between collectives', rank N's fingerprint TensorShape=[5] (np3 r1 detail)
  slowspectra - 12 s: ranks 0 and 2 'Timed out waiting 12000ms' for recv/send, slow rank SIGTERMed (np3 r1 prefix); 300 s: silent after
                step 2, killed by timeout at 60 s, exit 124 (np4 r2 plain)
  sigkill     - rank N vanishes after step 2; peers 'Connection reset by peer'; Root Cause exitcode -9 SIGKILL (np6 r4 tee, np3 r1 redirects)
  sigsegv     - rank N dies at step 4; peers 'Connection reset by peer'; Root Cause exitcode -11 SIGSEGV (np4 r0 plain)
  nanspike    - rank N: '1 non-finite Hs target(s)' then FloatingPointError at step 3 (np3 r2 detail: rank 0 'Ranks 2 failed to pass
                monitoredBarrier'; np6 r3 tee_trainer: peers 'Connection closed by peer')
  exit4       - rank N's mooring-drift ERROR line after step 1, exitcode 4; peers 'Connection closed by peer' (np3 r2 pymodule, np4 r1 prefix)
  window      - every rank: 'input.size(-1) must be equal to input_size. Expected 4, got 5' in the first forward (np4 loglevel)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/wavegru.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault374_work"
QC_WEIGHT = {0: 1.0, 1: 0.8, 2: 0.5, 3: 0.2, 4: 0.0}
PAST = 24
AHEAD = 6
CHANNELS = 4
HIDDEN = 32
HOURS = 400
log = None


class BuoyMeta:
    def __init__(self, station, lat, lon):
        self.station, self.lat, self.lon = station, lat, lon


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
    log = logging.getLogger("wavh")
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


class WaveGRU(nn.Module):
    def __init__(self, channels=CHANNELS, hidden=HIDDEN):
        super().__init__()
        self.gru = nn.GRU(channels, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        out, _ = self.gru(x)
        return self.head(out[:, -1]).squeeze(1)


def make_series(seed, hours=HOURS):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(hours, dtype=torch.float32)
    wind = 8 + 4 * torch.sin(t / 30 + seed) + torch.randn(hours, generator=g)
    hs = 0.3 + 0.03 * wind ** 1.5 + 0.2 * torch.randn(hours, generator=g).abs()
    tp = 6 + 0.4 * wind + 0.5 * torch.randn(hours, generator=g)
    pres = 1013 - 2 * wind + torch.randn(hours, generator=g)
    qc = torch.randint(0, 4, (hours,), generator=g)
    return {"hs": hs, "tp": tp, "wind": wind, "pres": pres, "qc": qc.tolist(), "station": 46000 + seed}


def prepare(max_ranks=8):
    os.makedirs(f"{WORK}/buoys", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    os.makedirs(f"{WORK}/export", exist_ok=True)
    for r in range(max_ranks):
        torch.save(make_series(r), f"{WORK}/buoys/buoy_{r}.pt")
    torch.manual_seed(0)
    torch.save(WaveGRU().state_dict(), f"{WORK}/ckpt/wavegru_h32.pt")
    torch.save(WaveGRU(hidden=48).state_dict(), f"{WORK}/ckpt/wavegru_h48.pt")
    torch.save({"state_dict": WaveGRU().state_dict(), "meta": BuoyMeta(46001, 36.8, -122.4)},
               f"{WORK}/ckpt/wavegru_meta.pt")
    print(f"prepared {max_ranks} buoy series and 3 checkpoints under {WORK}")


def load_series(rank, fault, bad):
    folder = f"{WORK}/buoys/archive" if (fault == "nobuoy" and bad) else f"{WORK}/buoys"
    s = torch.load(f"{folder}/buoy_{rank}.pt")
    if fault == "badqc" and bad:
        s["qc"][137] = 9
    if fault == "nanspike" and bad:
        s["hs"][395] = float("inf")
    return s


def make_windows(s, fault):
    weights = torch.tensor([QC_WEIGHT[f] for f in s["qc"]])
    fin = s["hs"][torch.isfinite(s["hs"])]
    mean_hs, std_hs = fin.mean(), fin.std()
    cols = [(s["hs"] - mean_hs) / std_hs, (s["tp"] - 10) / 3, (s["wind"] - 8) / 4, (s["pres"] - 1000) / 10]
    if fault == "window":
        cols.append(torch.cos(torch.arange(len(s["hs"])) / 12.0))
    feats = torch.stack(cols, 1)
    n = len(s["hs"]) - PAST - AHEAD
    xs = torch.stack([feats[i:i + PAST] for i in range(n)])
    ys = torch.stack([(s["hs"][i + PAST + AHEAD - 1] - mean_hs) / std_hs for i in range(n)])
    ws = weights[PAST + AHEAD - 1:PAST + AHEAD - 1 + n]
    return xs, ys, ws


def python_spectrum(xs):
    # a naive DFT of every window's Hs column, one multiply at a time
    total = 0.0
    for w in xs.tolist() * 400:
        col = [row[0] for row in w]
        for k in range(len(col)):
            re = sum(c * math.cos(2 * math.pi * k * j / len(col)) for j, c in enumerate(col))
            im = sum(c * math.sin(2 * math.pi * k * j / len(col)) for j, c in enumerate(col))
            total += re * re + im * im
    return total


def run(rank, world, args):
    setup_log(rank, args.logfmt)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.pg_timeout))
    bad = args.rank == -1 or args.rank == rank
    fault = args.fault
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, fault={fault} faulty_rank={args.rank}")

    s = load_series(rank, fault, bad)
    xs, ys, ws = make_windows(s, fault if bad else "none")
    say(f"rank {rank} buoy {s['station']}: {len(xs)} windows of {PAST} h, horizon {AHEAD} h")

    model = WaveGRU()
    ckpt = f"{WORK}/ckpt/wavegru_h32.pt"
    if fault == "ckptsize" and bad:
        ckpt = f"{WORK}/ckpt/wavegru_h48.pt"
    if fault == "ckptpickle" and bad:
        state = torch.load(f"{WORK}/ckpt/wavegru_meta.pt")["state_dict"]
    else:
        state = torch.load(ckpt)
    model.load_state_dict(state)
    if args.ddp:
        net = DDP(model)
    else:
        net = model
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)

    batch = 32
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, len(xs) - 10, (batch,))
        if fault == "nanspike" and bad and step == 3:
            idx[0] = 395 - PAST - AHEAD + 1
        x, y, w = xs[idx], ys[idx], ws[idx]
        if fault == "nanspike" and bad:
            nbad = int((~torch.isfinite(y)).sum())
            if nbad:
                say(f"rank {rank} step {step}: {nbad} non-finite Hs target(s) in the batch", err=True)
                raise FloatingPointError(f"non-finite significant wave height in batch at step {step} on rank {rank}")
        if fault == "slowspectra" and bad and step == 3:
            say(f"rank {rank} computing wave spectra for {len(xs)} windows")
            python_spectrum(xs)
        if fault == "sigsegv" and bad and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
        pred = net(x)
        loss = (w * (pred - y) ** 2).sum() / w.sum().clamp_min(1e-6)
        opt.zero_grad()
        loss.backward()
        if not args.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        stats = torch.tensor([loss.item(), ((pred - y) ** 2).mean().sqrt().item()])
        dist.all_reduce(stats)
        stats /= world
        say(f"rank {rank} step {step} loss {stats[0]:.4f} rmse_hs {stats[1]:.4f}")
        if fault == "sigkill" and bad and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "exit4" and bad and step == 1:
            say(f"ERROR: rank {rank}: buoy {s['station']} mooring drift 2.7 km exceeds 1.0 km watch circle; "
                "series not usable, stopping", err=True)
            sys.exit(4)

    summary = [s["hs"].mean().item(), s["hs"].max().item(), s["tp"].mean().item(), float(len(s["hs"]))]
    if fault == "gathershape" and bad:
        summary.append(float(sum(1 for v in s["tp"].tolist() if v > 12)))
    mine = torch.tensor(summary)
    out = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(out, mine)
    if rank == 0:
        table = torch.stack(out)
        say(f"rank 0 buoy stats: mean Hs {table[:, 0].mean():.2f} m, max Hs {table[:, 1].max():.2f} m")
        torch.save(model.state_dict(), f"{WORK}/export/wavegru.pt")
        say(f"rank 0 saved {WORK}/export/wavegru.pt")
    dist.barrier()
    dist.destroy_process_group()
    say(f"rank {rank} done")


def spawn_main(rank, world, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    run(rank, world, args)


def main():
    ap = argparse.ArgumentParser(description="wave height forecasting from buoy series (fault batch 374)")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--pg-timeout", type=int, default=12)
    ap.add_argument("--ddp", type=int, default=1)
    ap.add_argument("--spawn", type=int, default=0)
    ap.add_argument("--port", type=int, default=29500)
    ap.add_argument("--logfmt", type=int, default=0)
    ap.add_argument("--prepare", action="store_true")
    args = ap.parse_args()
    if args.prepare:
        prepare()
        return
    torch.set_num_threads(1)
    if args.spawn:
        mp.spawn(spawn_main, args=(args.spawn, args), nprocs=args.spawn)
        return
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    run(rank, world, args)


if __name__ == "__main__":
    main()
