"""A three-hundred-and-seventieth hand-run batch: SEISMIC PHASE PICKING ON WAVEFORM WINDOWS.

Synthetic three-component (Z, N, E) seismogram windows of 256 samples, each with a phase label (P, S or
noise, looked up in a 3-entry phase table), a pick sample (the phase onset inside the window) and a station
code.  Every rank reads its windows from /tmp/fault370_work/waves/waves_R.pt, normalises each window per
channel by its standard deviation, and trains a small 1-D CNN picker (two strided convolutions, a phase
head over the 3 classes and a pick head over the 256 sample positions) on the sum of two cross-entropies,
wrapped in DDP (gloo) or, with --ddp 0, with gradients all_reduced by hand.  The model is initialised from
ckpt/picker_3c.pt.  Per-station SNRs are all_gathered at the start, the loss and the phase accuracy are
all_reduced every step, the per-rank accuracy is all_gathered at the end, and rank 0 saves export/picker.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  regional  - rank N's catalogue labels some windows "Pg" (a regional phase) missing from the phase table (KeyError)
  badpick   - rank N's step-3 batch has a pick at sample 300 in a 256-sample window (IndexError, target out of bounds)
  nowave    - rank N reads its windows from waves/rotated/ which does not exist (FileNotFoundError)
  ckptchan  - rank N initialises from ckpt/picker_4c.pt, saved with a hydrophone channel (size mismatch)
  ckptmeta  - rank N initialises from ckpt/picker_meta.pt, which pickles a StationMeta object (weights_only refusal)
  snrgather - rank N all_gathers SNRs for 5 stations instead of 4 (collective size mismatch)
  stalta    - rank N runs a pure-Python STA/LTA trigger scan before the step-2 all_reduce (others time out)
  deadchan  - rank N's step-3 batch holds a dead (all-zero) E channel: 0/0 in normalisation, the program's check
  sigsegv   - rank N sends itself SIGSEGV after step 3
  exit4     - rank N prints its own error line about station clock drift after training and calls sys.exit(4)
  widewin   - every rank cuts 320-sample windows; the heads expect 256 (shape error in the first forward)
  none      - control, clean run

What happened (filled in after the runs):
  regional  - KeyError: 'Pg' at start-up before the first all_gather; peers Connection closed by peer (np4 r2 plain, np6 r0 tee)
  badpick   - 'IndexError: Target 300 is out of bounds.' at step 3 after the step-2 lines; peers closed (np3 r1 loglevel, np8 r5 prefix)
  nowave    - FileNotFoundError for waves/rotated/waves_R.pt at start-up (np4 r3 redirects: only in rank 3's stderr.log; np3 r1 filter)
  ckptchan  - load_state_dict size mismatch for c1.weight [8,4,7] vs [8,3,7] (np4 r1 pdsh2, node 1 then RendezvousConnectionError;
              np3 r2 pymodule)
  ckptmeta  - UnpicklingError: Weights only load failed ... Unsupported global __main__.StationMeta (np4 r0 tee_trainer)
  snrgather - DETAIL: every rank 'Detected mismatch between collectives', rank 1 TensorShape=[5] (np4 r1 detail, Root Cause rank 0);
              'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' (np6 r4 plain)
  stalta    - 12 s: a peer's recv 'Timed out waiting 12000ms', another Connection closed (np3 r2 wrapper, Root Cause rank 0);
              300 s: output stops after step 1, killed by timeout at 60 s, SignalException signal 15, exit 124 (np4 r1 loglevel)
  deadchan  - 'non-finite loss nan (256 non-finite input samples after normalisation)', FloatingPointError at step 3 (np4 r3
              restart); the restarted attempt failed first in Gloo connectFullMesh (Connection refused) on rank 1
  sigsegv   - no traceback after step 3; Root Cause exitcode -11 (SIGSEGV) (np5 r2 filter, np4 r0 pymodule)
  exit4     - rank N's clock-drift ERROR line after step 5 and exit 4; Root Cause rank N exitcode 4 (np3 r1 tee_trainer, np6 r5 prefix)
  widewin   - every rank: 'mat1 and mat2 shapes cannot be multiplied (16x1280 and 1024x3)' in the first forward (np3 wrapper)
  none      - clean: 6 steps on 3 ranks, rank 0 saved export/picker.pt, exit 0 (np3 plain)
"""
import argparse
import logging
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault370_work"
PHASES = {"P": 0, "S": 1, "noise": 2}
STATIONS = ["HHZ1", "KRV2", "OBS3", "PNT4"]
WIN = 256
BATCH = 16
log = None


@dataclass
class StationMeta:
    code: str
    lat: float
    lon: float
    sps: int


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
    log = logging.getLogger("picker")
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
    def __init__(self, chans=3, win=WIN):
        super().__init__()
        self.c1 = nn.Conv1d(chans, 8, 7, stride=2, padding=3)
        self.c2 = nn.Conv1d(8, 16, 7, stride=2, padding=3)
        self.phase = nn.Linear(16 * win // 4, len(PHASES))
        self.pick = nn.Linear(16 * win // 4, win)

    def forward(self, x):
        h = torch.relu(self.c2(torch.relu(self.c1(x)))).flatten(1)
        return self.phase(h), self.pick(h)


def make_windows(n, seed, length=WIN + 64):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(length).float()
    xs, phases, picks, stas = [], [], [], []
    for i in range(n):
        ph = ["P", "S", "noise"][int(torch.randint(0, 3, (1,), generator=g))]
        pick = int(torch.randint(40, WIN - 40, (1,), generator=g))
        x = torch.randn(3, length, generator=g) * 0.2
        if ph != "noise":
            f = 0.3 if ph == "P" else 0.12
            env = torch.exp(-(t - pick).clamp(min=0) / 60.0) * (t >= pick)
            amp = torch.tensor([1.5, 0.6, 0.6]) if ph == "P" else torch.tensor([0.5, 1.4, 1.4])
            x += amp[:, None] * env * torch.sin(f * t)
        xs.append(x)
        phases.append(ph)
        picks.append(pick)
        stas.append(STATIONS[i % 4])
    return {"x": torch.stack(xs), "phase": phases, "pick": picks, "station": stas}


def prepare():
    for d in ("waves", "ckpt"):
        os.makedirs(f"{WORK}/{d}", exist_ok=True)
    for r in range(8):
        torch.save(make_windows(128, 700 + r), f"{WORK}/waves/waves_{r}.pt")
    torch.manual_seed(0)
    sd = Picker(3).state_dict()
    torch.save(sd, f"{WORK}/ckpt/picker_3c.pt")
    torch.save(Picker(4).state_dict(), f"{WORK}/ckpt/picker_4c.pt")
    torch.save({"state_dict": sd, "station": StationMeta("KRV2", 46.21, 7.33, 100)}, f"{WORK}/ckpt/picker_meta.pt")
    print("prepared", WORK)


def stalta_scan(x, nsta=5, nlta=40):
    trig = 0
    for w in x.tolist():
        z = w[0]
        for i in range(nlta, len(z)):
            sta = sum(v * v for v in z[i - nsta:i]) / nsta
            lta = sum(v * v for v in z[i - nlta:i]) / nlta
            if lta > 0 and sta / lta > 3.0:
                trig += 1
    return trig


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, reading waveform windows")
    sub = "rotated/" if bad and a.fault == "nowave" else ""
    data = torch.load(f"{WORK}/waves/{sub}waves_{rank}.pt")
    if bad and a.fault == "regional":
        data["phase"][37] = "Pg"
    labels = torch.tensor([PHASES[p] for p in data["phase"]])
    picks = torch.tensor(data["pick"])
    win = 320 if a.fault == "widewin" else WIN
    x = data["x"][:, :, :win].clone()
    snr = torch.zeros(5 if bad and a.fault == "snrgather" else 4)
    for k, s in enumerate(STATIONS + ["OBS5"][: len(snr) - 4]):
        sel = [i for i, st in enumerate(data["station"]) if st == s] or [0]
        snr[k] = x[sel].abs().amax(-1).mean() / 0.2
    all_snr = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(all_snr, snr)
    say(f"rank {rank} windows {len(labels)} median station SNR {torch.stack(all_snr).median():.2f}")
    model = Picker()
    ck = {"ckptchan": "picker_4c.pt", "ckptmeta": "picker_meta.pt"}.get(a.fault, "picker_3c.pt") if bad else "picker_3c.pt"
    sd = torch.load(f"{WORK}/ckpt/{ck}", weights_only=True)
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    nb = len(labels) // BATCH
    correct = torch.zeros(1)
    for step in range(a.steps):
        b = step % nb
        xb = x[b * BATCH:(b + 1) * BATCH].clone()
        yb, pb = labels[b * BATCH:(b + 1) * BATCH], picks[b * BATCH:(b + 1) * BATCH].clone()
        if bad and a.fault == "deadchan" and step == 3:
            xb[5, 2] = 0.0
        if bad and a.fault == "badpick" and step == 3:
            pb[9] = 300
        xb = xb / xb.std(dim=-1, keepdim=True)
        lp, lk = net(xb)
        loss = F.cross_entropy(lp, yb) + 0.5 * F.cross_entropy(lk, pb)
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(xb)).sum())
            say(f"rank {rank} step {step}: non-finite loss {loss.item()} ({nbad} non-finite input samples "
                f"after normalisation)", err=True)
            raise FloatingPointError(f"non-finite picker loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "stalta" and step == 2:
            t0, n = time.time(), 0
            while time.time() - t0 < a.scan_budget:
                n += stalta_scan(x[:8])
            say(f"rank {rank} STA/LTA scan: {n} triggers")
        acc = (lp.argmax(1) == yb).float().mean()
        correct += acc
        stat = torch.tensor([loss.item(), acc.item()])
        dist.all_reduce(stat)
        say(f"rank {rank} step {step} loss {stat[0].item() / world:.4f} acc {stat[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR station {STATIONS[1]} clock drift 1.84 s exceeds 0.05 s tolerance, "
            f"picks are unusable; aborting", err=True)
        sys.exit(4)
    accs = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(accs, correct / a.steps)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/picker.pt")
        say(f"rank 0 done: {a.steps} steps, mean acc {torch.cat(accs).mean():.3f}, saved export/picker.pt")
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
    p.add_argument("--scan-budget", type=int, default=45)
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
