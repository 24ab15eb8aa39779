"""A two-hundred-and-ninety-eighth hand-run batch: SEISMIC PHASE PICKING ON THREE-COMPONENT WAVEFORMS.

Synthetic three-component (Z, N, E) seismograms, 400 samples at 100 Hz per window, each with a P and an S
arrival.  Every rank reads its windows from /tmp/fault298_work/wave/wave_R.pt, applies the gain of its station
(looked up in a 6-entry station table), normalises each trace by its peak amplitude, and trains a small
PhaseNet-like 1-D conv net that labels every sample as noise, P or S (soft Gaussian targets, cross-entropy).
The model is initialised from ckpt/picker_3c.pt and wrapped in DDP (gloo); --ddp 0 all_reduces gradients
by hand instead.  Per-rank amplitude statistics are all_gathered at the start, the loss and the P-pick
accuracy are all_reduced every step, and rank 0 saves export/picker.pt at the end.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  station    - rank N's windows come from station "XK.BAD9", missing from the station table (KeyError)
  pickidx    - rank N's batch at step 3 carries an S pick at sample 3120 of a 400-sample window (IndexError)
  nowave     - rank N reads wave/raw/wave_N.pt, a folder that does not exist (FileNotFoundError)
  ckptchan   - rank N initialises from ckpt/picker_6c.pt, saved for 6 input channels (size mismatch)
  ckptpickle - rank N loads ckpt/picker_full.pt, a pickled whole training state (weights_only refusal)
  ampgather  - rank N all_gathers 4 amplitude statistics (a peak-to-peak extra) instead of 3
  stalta     - rank N runs a pure-Python STA/LTA trigger over every trace before the step-2 all_reduce
  deadtrace  - rank N's batch at step 4 has a dead E channel (peak 0): normalised to NaN, the loss check
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit4      - rank N's pick QC at the end prints its own error line and calls sys.exit(4)
  maskchan   - every rank: a fourth (mask) channel is stacked onto the input, the first conv expects 3
  none       - control, clean run

What happened (filled in after the runs):
  station    - KeyError: 'XK.BAD9' at the station gain lookup before the first all_gather; peers Connection closed (np4 r1 tee, np3 r0 pymodule)
  pickidx    - IndexError 'index 3120 is out of bounds for dimension 2 with size 400' building step-3 targets; peers closed (np5 r2 loglevel, np3 r1 filter)
  nowave     - FileNotFoundError for wave/raw/wave_N.pt at start-up; peers closed (np4 r3 redirects: only in the files; np4 r2 pdsh2)
  ckptchan   - load_state_dict size mismatch for c1.weight [8, 6, 7] vs [8, 3, 7]; peers SIGTERM (np3 r2 wrapper, np5 r0 tee_trainer)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL argparse.Namespace' (np4 r1 prefix)
  ampgather  - DETAIL: 'Detected mismatch between collectives' TensorShape [4] vs [3] on every rank (np3 r1 detail); 'allgather: invalid tensor size' on rank 3 (np4 r3 plain)
  stalta     - 12 s: peers 'Timed out waiting 12000ms for recv' at step 2 (np3 r2 plain); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r1 tee, port 51820; budget 200)
  deadtrace  - 'loss is nan (400 non-finite input samples)', FloatingPointError at step 4 (np3 r2 detail: monitoredBarrier; np4 r0 restart: attempt 2 died in connectFullMesh)
  sigsegv    - no traceback after step 3; Root Cause exitcode -11 (SIGSEGV), peers Connection reset/closed (np5 r3 prefix, np3 r1 filter)
  exit4      - ERROR pick QC line, then 'terminate called without an active exception': exitcode -6 SIGABRT, not 4 (np4 r2 tee_trainer)
  maskchan   - every rank: 'expected input[16, 4, 400] to have 3 channels, but got 4 channels instead' in the first forward (np3 loglevel)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/picker.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault298_work"
STATIONS = {"CI.PAS": 1.00, "CI.USC": 0.85, "BK.BKS": 1.20, "IU.ANMO": 0.95, "UW.RATT": 1.10, "NC.KHBB": 0.90}
NSAMP = 400
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
    log = logging.getLogger("phpk")
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


class Picker(nn.Module):
    def __init__(self, cin=3, hid=8):
        super().__init__()
        self.c1 = nn.Conv1d(cin, hid, 7, padding=3)
        self.c2 = nn.Conv1d(hid, hid, 7, padding=3)
        self.out = nn.Conv1d(hid, 3, 1)

    def forward(self, x):
        return self.out(torch.relu(self.c2(torch.relu(self.c1(x)))))


def make_windows(n, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(NSAMP).float()
    waves, picks = [], []
    for _ in range(n):
        p = int(torch.randint(60, 200, (1,), generator=g))
        s = p + int(torch.randint(40, 150, (1,), generator=g))
        w = 0.05 * torch.randn(3, NSAMP, generator=g)
        w[0] += (t >= p).float() * torch.exp(-(t - p).clamp(min=0) / 30) * torch.sin(0.8 * t)
        w[1:] += 2.0 * (t >= s).float() * torch.exp(-(t - s).clamp(min=0) / 50) * torch.sin(0.4 * t)
        waves.append(w)
        picks.append((p, s))
    return torch.stack(waves), torch.tensor(picks)


def prepare():
    os.makedirs(f"{WORK}/wave", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    names = list(STATIONS)
    for r in range(8):
        w, p = make_windows(96, 300 + r)
        torch.save({"station": names[r % len(names)], "wave": w, "picks": p}, f"{WORK}/wave/wave_{r}.pt")
    torch.manual_seed(0)
    torch.save(Picker(3).state_dict(), f"{WORK}/ckpt/picker_3c.pt")
    torch.save(Picker(6).state_dict(), f"{WORK}/ckpt/picker_6c.pt")
    torch.save({"model": Picker(3).state_dict(), "args": argparse.Namespace(lr=1e-3, nsamp=NSAMP)},
               f"{WORK}/ckpt/picker_full.pt")
    print("prepared", WORK)


def targets(picks, nsamp, sigma=10.0):
    y = torch.zeros(picks.shape[0], 3, nsamp)
    t = torch.arange(nsamp).float()
    for i, (p, s) in enumerate(picks.tolist()):
        y[i, 1] = torch.exp(-((t - p) ** 2) / (2 * sigma ** 2))
        y[i, 2] = torch.exp(-((t - s) ** 2) / (2 * sigma ** 2))
        y[i, 1, p] = 1.0
        y[i, 2, s] = 1.0
    y[:, 0] = (1 - y[:, 1] - y[:, 2]).clamp(min=0)
    return y


def sta_lta(trace, ns=10, nl=80):
    trig = 0
    vals = [v * v for v in trace]
    for i in range(nl, len(vals)):
        sta = sum(vals[i - ns:i]) / ns
        lta = sum(vals[i - nl:i]) / nl
        if lta > 0 and sta / lta > 3.0:
            trig += 1
    return trig


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading waveforms")
    sub = "raw/" if bad and a.fault == "nowave" else ""
    d = torch.load(f"{WORK}/wave/{sub}wave_{rank}.pt")
    station = "XK.BAD9" if bad and a.fault == "station" else d["station"]
    gain = STATIONS[station]
    wave, picks = d["wave"] * gain, d["picks"].clone()
    stats = torch.tensor([wave.abs().max(), wave.std(), float(wave.shape[0])])
    if bad and a.fault == "ampgather":
        stats = torch.cat([stats, (wave.max() - wave.min()).reshape(1)])
    alls = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(alls, stats)
    say(f"rank {rank} station {station} windows {wave.shape[0]} peak {stats[0]:.2f} "
        f"global windows {int(sum(s[2] for s in alls))}")
    cin = 3
    model = Picker(cin)
    ck = "picker_3c.pt"
    if bad and a.fault == "ckptchan":
        ck = "picker_6c.pt"
    if bad and a.fault == "ckptpickle":
        ck = "picker_full.pt"
    sd = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for prm in model.parameters():
            dist.broadcast(prm.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    nwin = wave.shape[0]
    for step in range(a.steps):
        i0 = (step * BATCH) % nwin
        xb, pb = wave[i0:i0 + BATCH].clone(), picks[i0:i0 + BATCH].clone()
        if bad and a.fault == "pickidx" and step == 3:
            pb[5, 1] = 3120
        if bad and a.fault == "deadtrace" and step == 4:
            xb[7, 2] = 0.0
        peak = xb.abs().amax(dim=2, keepdim=True)
        xb = xb / peak
        if a.fault == "maskchan":
            xb = torch.cat([xb, torch.ones(xb.shape[0], 1, NSAMP)], dim=1)
        yb = targets(pb, NSAMP)
        logits = net(xb)
        loss = -(yb * F.log_softmax(logits, dim=1)).sum(1).mean()
        if not torch.isfinite(loss):
            say(f"rank {rank} step {step}: loss is {loss.item()} "
                f"({int((~torch.isfinite(xb)).sum())} non-finite input samples)", err=True)
            raise FloatingPointError(f"non-finite loss at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        if bad and a.fault == "stalta" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.stalta_budget:
                for tr in wave[:, 0]:
                    n += sta_lta(tr.tolist())
            say(f"rank {rank} STA/LTA triggers: {n}")
        ppick = logits.detach()[:, 1].argmax(1)
        acc = ((ppick - pb[:, 0]).abs() <= 10).float().mean()
        red = torch.stack([loss.detach(), acc])
        dist.all_reduce(red)
        say(f"rank {rank} step {step} loss {red[0].item() / world:.4f} p_acc {red[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR pick QC failed for station {station}: 37% of S picks precede their P pick, "
            f"refusing to write picks", err=True)
        sys.exit(4)
    dist.barrier()
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/picker.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/picker.pt")
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
    p.add_argument("--stalta-budget", type=int, default=45)
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
