"""A four-hundred-and-sixth hand-run batch: EARTHQUAKE MAGNITUDE ESTIMATION FROM WAVEFORMS.

Synthetic three-component seismograms (Z, N, E; 12 s at 100 Hz = 1200 samples) of local events, each recorded
at one station of a small network.  Every rank reads its catalogue from /tmp/fault406_work/waves/waves_R.pt
(a list of events: station code, raw counts, epicentral distance, catalogue magnitude), converts counts to
velocity with the station's gain from an 8-station response table, normalises each trace by its peak and
keeps the log peak amplitude as a side feature.  A small 1-D CNN (three strided conv blocks, a flatten, a head
that also takes log peak amplitude and log distance) regresses the local magnitude on an L1 loss, wrapped in
DDP over gloo (or with gradients all_reduced by hand, --ddp 0).  The model is initialised from
ckpt/magnet_3c.pt.  Per-rank magnitude histograms (M0-M8, 9 bins) and per-rank phase pick counts (P, S, coda)
are all_gathered at the start, the MAE is all_reduced every step, and rank 0 saves export/magnet.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  nowaves     - rank N reads its catalogue from waves/2025/ which does not exist (FileNotFoundError, start-up)
  bucket      - rank N's catalogue holds an M9.4 event: the 9-bin histogram list overflows (IndexError, start-up)
  phasegather - rank N all_gathers pick counts with an extra Pn phase (4 vs 3 entries, start-up collective)
  ckptch      - rank N initialises from ckpt/magnet_4c.pt, saved for 4 input channels (size mismatch)
  pickled     - rank N initialises from ckpt/magnet_full.pt, a whole pickled model (weights_only refusal)
  window      - every rank: windows of 1280 samples, the head expects the 1200-sample flatten (shape error)
  station     - rank N's step-1 batch holds a trace from station "XKC", missing from the response table (KeyError)
  clipnan     - rank N's step-3 batch holds a dead channel (all zeros): peak 0, the program's check finds NaN
  slowpick    - rank N runs an STA/LTA picker over its whole catalogue in Python before the step-2 all_reduce
  segv        - rank N sends itself SIGSEGV after step 2
  exit4       - rank N prints its own error line about a station's sample rate at the end and calls sys.exit(4)
  none        - control, clean run

What happened (filled in after the runs):
  nowaves     - FileNotFoundError for waves/2025/waves_N.pt at start-up; peers Connection closed in the first all_gather (np3 r1 ranklabel, np4 r3 tee)
  bucket      - 'IndexError: list index out of range' in the 9-bin histogram at start-up; peers Connection closed (np5 r2 bashloop, --ddp 0)
  phasegather - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (13), got (12))' on rank N (np4 r1 spawn, np8 r5 srunlabel)
  ckptch      - load_state_dict size mismatch for c1.weight [8,4,7] vs [8,3,7] (np4 r1 pdsh2, worker-0 then lost the c10d store; np3 r2 legacy)
  pickled     - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.MagNet' (np3 r0 srunlabel, np5 r4 logfmt)
  window      - every rank: 'mat1 and mat2 shapes cannot be multiplied (16x432 and 400x32)' in the first forward (np6 files, --ddp 0)
  station     - KeyError: 'XKC' after step 0; peers Connection closed in DDP's forward (np4 r2 bashloop, np6 r0 mpitag)
  clipnan     - 'step 3 loss is nan (1 of 16 traces non-finite ...)' and FloatingPointError; np4 r3 files: rank 1 recv timeout then
                'terminate called without an active exception' (loop exit 134); np6 r2 legacy: peers closed, Root Cause rank 2
  slowpick    - 12 s: rank 1 'Timed out waiting 12000ms for recv', ranks 0 and 2 Connection closed (np3 r2 ranklabel);
                300 s: silent after step 1, killed by timeout at 60 s, exit 124 (np4 r1 tee)
  segv        - no traceback; ProcessExitedException 'process 1 terminated with signal SIGSEGV' (np3 r1 spawn); worker-0 Root Cause
                exitcode -11, worker-1 rank 2 SIGABRT cascade (np4 r0 pdsh2)
  exit4       - rank N's ERROR line about station MLAC's 40 Hz response at the end, exit 4; peers Connection closed in the final barrier
                (np5 r3 mpitag, loop exit 4; np3 r1 logfmt, Root Cause rank 1 exitcode 4)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/magnet.pt, exit 0 (np3 bashloop)
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault406_work"
GAINS = {"PAS": 6.3e8, "GSC": 5.1e8, "PFO": 6.0e8, "BAR": 4.2e8,
         "SVD": 4.9e8, "ISA": 5.5e8, "MLAC": 3.8e8, "DGR": 4.4e8}
NSAMP = 1200
NBINS = 9
BATCH = 16
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
    log = logging.getLogger("magnet")
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


class MagNet(nn.Module):
    def __init__(self, chans=3, nsamp=NSAMP):
        super().__init__()
        self.c1 = nn.Conv1d(chans, 8, 7, stride=4, padding=3)
        self.c2 = nn.Conv1d(8, 16, 5, stride=4, padding=2)
        self.c3 = nn.Conv1d(16, 16, 5, stride=3, padding=2)
        self.flat = 16 * math.ceil(math.ceil(math.ceil(nsamp / 4) / 4) / 3)
        self.fc = nn.Linear(self.flat, 32)
        self.head = nn.Linear(32 + 2, 1)

    def forward(self, x, amp, dist_km):
        h = F.relu(self.c1(x))
        h = F.relu(self.c2(h))
        h = F.relu(self.c3(h)).flatten(1)
        h = F.relu(self.fc(h))
        return self.head(torch.cat([h, amp[:, None], torch.log10(dist_km)[:, None]], 1)).squeeze(1)


def make_events(n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = list(GAINS)
    t = torch.arange(NSAMP) / 100.0
    evs = []
    for _ in range(n):
        mag = 0.5 + 5.5 * float(torch.rand(1, generator=g))
        d = 5.0 + 150.0 * float(torch.rand(1, generator=g))
        sta = codes[int(torch.randint(0, 8, (1,), generator=g))]
        tp = 1.0 + d / 6.0 / 10.0
        ts = tp * 1.73
        env = torch.exp(-(t - ts).clamp(min=0) / (1.0 + mag)) * (t > tp)
        amp = 10 ** (mag - 1.1 * math.log10(d) - 3.0)
        noise = torch.randn(3, NSAMP, generator=g) * 0.02 * amp
        sig = torch.sin(2 * math.pi * (2.0 + torch.rand(3, 1, generator=g) * 6) * t) * env * amp
        counts = ((sig + noise) * GAINS[sta]).to(torch.float32)
        evs.append({"sta": sta, "counts": counts, "dist": d, "mag": mag, "tp": tp, "ts": ts})
    return evs


def prepare():
    os.makedirs(f"{WORK}/waves", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_events(64, 4060 + r), f"{WORK}/waves/waves_{r}.pt")
    torch.manual_seed(0)
    torch.save(MagNet(3).state_dict(), f"{WORK}/ckpt/magnet_3c.pt")
    torch.save(MagNet(4).state_dict(), f"{WORK}/ckpt/magnet_4c.pt")
    torch.save(MagNet(3), f"{WORK}/ckpt/magnet_full.pt")
    print("prepared", WORK)


def to_batch(evs, a, bad):
    xs, amps, ds, ys = [], [], [], []
    n = 1280 if a.fault == "window" else NSAMP
    for e in evs:
        v = e["counts"] / GAINS[e["sta"]]
        if n > NSAMP:
            v = F.pad(v, (0, n - NSAMP))
        peak = v.abs().amax(1, keepdim=True)
        xs.append(v / peak)
        amps.append(torch.log10(peak.max()))
        ds.append(e["dist"])
        ys.append(e["mag"])
    return torch.stack(xs), torch.stack(amps), torch.tensor(ds), torch.tensor(ys)


def sta_lta(trace, ns=50, nl=500):
    best = 0.0
    for i in range(nl, len(trace)):
        sta = sum(x * x for x in trace[i - ns:i]) / ns
        lta = sum(x * x for x in trace[i - nl:i]) / nl
        best = max(best, sta / (lta + 1e-30))
    return best


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4060 + rank)
    say(f"rank {rank}/{world} up, reading catalogue")
    sub = "2025/" if bad and a.fault == "nowaves" else ""
    evs = torch.load(f"{WORK}/waves/{sub}waves_{rank}.pt")
    if bad and a.fault == "bucket":
        evs[11]["mag"] = 9.4
    if bad and a.fault == "station":
        evs[BATCH + 3]["sta"] = "XKC"
    if bad and a.fault == "clipnan":
        evs[(3 * BATCH) % len(evs) + 5]["counts"][1].zero_()
    hist = [0] * NBINS
    for e in evs:
        hist[int(e["mag"])] += 1
    picks = [len(evs), len(evs), sum(1 for e in evs if e["mag"] > 2.0)]
    if bad and a.fault == "phasegather":
        picks.append(sum(1 for e in evs if e["dist"] > 120.0))
    stat = torch.tensor(hist + picks, dtype=torch.float32)
    allst = [torch.zeros(NBINS + 3) for _ in range(world)]
    dist.all_gather(allst, stat)
    tot = torch.stack(allst).sum(0)
    say(f"rank {rank} events {len(evs)} network M>=3 {int(tot[3:NBINS].sum())} picks {int(tot[NBINS:].sum())}")
    model = MagNet()
    ck = {"ckptch": "magnet_4c.pt", "pickled": "magnet_full.pt"}.get(a.fault if bad else "", "magnet_3c.pt")
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        i0 = (step * BATCH) % len(evs)
        x, amp, dk, y = to_batch(evs[i0:i0 + BATCH], a, bad)
        pred = net(x, amp, dk)
        loss = F.l1_loss(pred, y)
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(x)).any(2).any(1).sum())
            say(f"rank {rank}: step {step} loss is {loss.item()} ({nbad} of {len(x)} traces non-finite "
                f"after peak normalisation)", err=True)
            raise FloatingPointError(f"non-finite loss at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowpick" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.pick_budget:
                n += sum(sta_lta(e["counts"][0].tolist()) > 3.0 for e in evs[:4])
            say(f"rank {rank} STA/LTA triggers: {n}")
        mae = (pred.detach() - y).abs().mean().reshape(1)
        dist.all_reduce(mae)
        say(f"rank {rank} step {step} loss {loss.item():.4f} mae {mae.item() / world:.4f}")
        if bad and a.fault == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR station MLAC response file reports 40 Hz, catalogue waveforms are 100 Hz; "
            f"refusing to export a magnitude model", err=True)
        sys.exit(4)
    dist.barrier()
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/magnet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/magnet.pt")
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
    p.add_argument("--pick-budget", type=int, default=45)
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
