"""A three-hundred-and-thirty-seventh hand-run batch: ECG ARRHYTHMIA CLASSIFICATION WITH A 1D RESNET.

Synthetic 12-lead ECG records (250 samples at 500 Hz, a short window) with a rhythm label per record
(NSR, AF, PVC, LBBB, RBBB, looked up in a 5-entry rhythm table).  Every rank reads its records from
/tmp/fault337_work/records/ecg_R.pt, normalises each lead by its standard deviation and trains a small 1D
ResNet (a strided stem, two residual blocks, global average pooling, a linear head) with cross-entropy,
wrapped in DDP over gloo (or, with --ddp 0, gradients all_reduced by hand).  The model is initialised from
ckpt/resnet1d_w16.pt.  The loss and accuracy are all_reduced every step, each rank's rhythm histogram is
all_gathered at the end, and rank 0 saves export/resnet1d.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  rhythm     - rank N's annotations contain "AFL" (atrial flutter), missing from the rhythm table (KeyError)
  lead       - rank N's lead selection asks for lead 12 ("V7") of a 12-lead record in its first batch (IndexError)
  norecords  - rank N reads its records from records/holter/ which does not exist (FileNotFoundError)
  ckptwidth  - rank N initialises from ckpt/resnet1d_w24.pt, saved with a 24-channel stem (size mismatch)
  ckptpickle - rank N initialises from ckpt/resnet1d_full.pt, which pickles a TrainConfig object (weights_only)
  histgather - rank N all_gathers its rhythm histogram with an extra "other" bin at the end (6 vs 5 entries)
  slowqrs    - rank N runs a pure-Python QRS detector over its records before the step-2 all_reduce
  nanamp     - rank N's step-3 batch holds a record with a flat lead: std 0, NaN inputs, the program's check
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit4      - rank N finds records sampled at 360 Hz, prints its own error line and calls sys.exit(4)
  poolshape  - every rank: the head gets flattened features instead of pooled ones (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  rhythm     - KeyError: 'AFL' encoding labels at start-up, before any collective; others SIGTERMed (np4 r2 tee, np6 r0 pymodule)
  lead       - IndexError 'index 12 is out of bounds for dimension 0 with size 12' in the first batch (np3 r1 loglevel, np8 r5 filter)
  norecords  - FileNotFoundError for records/holter/ecg_N.pt at start-up; others SIGTERMed (np4 r3 wrapper, np3 r0 prefix)
  ckptwidth  - load_state_dict size mismatch stem.weight [24,12,7] vs [16,12,7]; node 1 agent RendezvousConnectionError (np4 r1 pdsh2)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.TrainConfig' (np5 r3 tee_trainer)
  histgather - DETAIL: 'Detected mismatch between collectives ... shapes: 5vs 6' on every rank (np4 r2 detail, --ddp 0); plain gloo: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (6), got (5))' (np6 r4 plain)
  slowqrs    - 12 s PG timeout: peers 'Timed out waiting 12000ms' for recv/send (np3 r1 tee); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r2 plain)
  nanamp     - 'non-finite loss nan at step 3 (250 non-finite input samples)' and FloatingPointError; peers Connection closed (np3 r0 redirects, np6 r3 tee_trainer)
  sigsegv    - no traceback from rank N after step 3; Root Cause exitcode -11 (SIGSEGV); peers connection reset/closed (np4 r1 pymodule, np3 r2 prefix)
  exit4      - rank N's 360 Hz ERROR line and exit 4 (np5 r4 loglevel); with --max-restarts 1 attempt 1 fails in Gloo connectFullMesh Connect timeout (np3 r1 restart)
  poolshape  - every rank: 'mat1 and mat2 shapes cannot be multiplied (16x2000 and 16x5)' in the first forward; Root Cause rank 0 (np3 wrapper)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/resnet1d.pt, exit 0 (np3 plain)
"""
import argparse
import dataclasses
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault337_work"
RHYTHMS = {"NSR": 0, "AF": 1, "PVC": 2, "LBBB": 3, "RBBB": 4}
LEADS = ["I", "II", "III", "aVR", "aVL", "aVF", "V1", "V2", "V3", "V4", "V5", "V6"]
FS = 500
NSAMP = 250
BATCH = 16
log = None


@dataclasses.dataclass
class TrainConfig:
    lr: float = 1e-3
    width: int = 16
    fs: int = FS


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
    log = logging.getLogger("ecg")
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


class ResBlock1d(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.c1 = nn.Conv1d(ch, ch, 5, padding=2)
        self.b1 = nn.BatchNorm1d(ch)
        self.c2 = nn.Conv1d(ch, ch, 5, padding=2)
        self.b2 = nn.BatchNorm1d(ch)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(x + self.b2(self.c2(y)))


class ResNet1d(nn.Module):
    def __init__(self, width=16, nclass=5, flatten=False):
        super().__init__()
        self.stem = nn.Conv1d(12, width, 7, stride=2, padding=3)
        self.bn = nn.BatchNorm1d(width)
        self.blocks = nn.Sequential(ResBlock1d(width), ResBlock1d(width))
        self.head = nn.Linear(width, nclass)
        self.flatten = flatten

    def forward(self, x):
        h = self.blocks(F.relu(self.bn(self.stem(x))))
        h = h.flatten(1) if self.flatten else h.mean(-1)
        return self.head(h)


def make_records(n, seed, fs=FS):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(NSAMP) / FS
    names = list(RHYTHMS)
    labels = [names[int(i)] for i in torch.randint(0, 5, (n,), generator=g)]
    sig = torch.zeros(n, 12, NSAMP)
    for k, lab in enumerate(labels):
        hr = 1.2 + 0.3 * RHYTHMS[lab]
        base = torch.sin(2 * torch.pi * hr * t) ** 15
        gain = torch.randn(12, 1, generator=g) * 0.3 + 1.0
        sig[k] = gain * base + 0.05 * torch.randn(12, NSAMP, generator=g)
    return {"signals": sig, "rhythm": labels, "fs": fs, "leads": LEADS}


def prepare():
    os.makedirs(f"{WORK}/records", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_records(96, 700 + r), f"{WORK}/records/ecg_{r}.pt")
    torch.manual_seed(0)
    torch.save(ResNet1d(16).state_dict(), f"{WORK}/ckpt/resnet1d_w16.pt")
    torch.save(ResNet1d(24).state_dict(), f"{WORK}/ckpt/resnet1d_w24.pt")
    torch.save({"model": ResNet1d(16).state_dict(), "config": TrainConfig()}, f"{WORK}/ckpt/resnet1d_full.pt")
    print("prepared", WORK)


def qrs_detect(sig, fs):
    """Pan-Tompkins-like detector in plain Python (deliberately slow)."""
    x = sig.tolist()
    diff = [x[i + 1] - x[i] for i in range(len(x) - 1)]
    sq = [d * d for d in diff]
    win = max(1, int(0.15 * fs))
    integ = [sum(sq[max(0, i - win):i + 1]) / win for i in range(len(sq))]
    thr = 0.5 * max(integ)
    peaks, last = [], -fs
    for i in range(1, len(integ) - 1):
        if integ[i] > thr and integ[i] >= integ[i - 1] and integ[i] >= integ[i + 1] and i - last > 0.2 * fs:
            peaks.append(i)
            last = i
    return peaks


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading ECG records")
    sub = "holter/" if bad and a.fault == "norecords" else ""
    rec = torch.load(f"{WORK}/records/{sub}ecg_{rank}.pt")
    if bad and a.fault == "exit4":
        rec["fs"] = 360
    if rec["fs"] != FS:
        say(f"rank {rank}: ERROR records/ecg_{rank}.pt sampled at {rec['fs']} Hz, expected {FS} Hz; "
            f"resample the MIT-BIH export before training", err=True)
        sys.exit(4)
    if bad and a.fault == "rhythm":
        rec["rhythm"][37] = "AFL"
    y = torch.tensor([RHYTHMS[r] for r in rec["rhythm"]])
    sig = rec["signals"]
    if bad and a.fault == "nanamp":
        sig[3 * BATCH + 5, 7] = 0.0
    x = (sig - sig.mean(-1, keepdim=True)) / sig.std(-1, keepdim=True)
    leads = list(range(12))
    if bad and a.fault == "lead":
        leads[11] = 12
    model = ResNet1d(flatten=(a.fault == "poolshape"))
    ck = {"ckptwidth": "resnet1d_w24.pt", "ckptpickle": "resnet1d_full.pt"}.get(a.fault) if bad else None
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck or 'resnet1d_w16.pt'}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
    say(f"rank {rank}: {len(y)} records, {len(LEADS)} leads at {rec['fs']} Hz, ddp={a.ddp}")
    nb = len(y) // BATCH
    for step in range(a.steps):
        i0 = (step % nb) * BATCH
        xb = x[i0:i0 + BATCH][:, leads]
        yb = y[i0:i0 + BATCH]
        logits = net(xb)
        loss = F.cross_entropy(logits, yb)
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(xb)).sum())
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} ({nbad} non-finite input samples)",
                err=True)
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowqrs" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.qrs_budget:
                for k in range(len(y)):
                    n += len(qrs_detect(sig[k, 1], FS))
            say(f"rank {rank} QRS census: {n} beats")
        acc = (logits.argmax(1) == yb).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} acc {stats[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    hist = torch.bincount(y, minlength=5).float()
    if bad and a.fault == "histgather":
        hist = torch.cat([hist, torch.tensor([3.0])])
    allh = [torch.zeros(5) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} rhythm histogram {hist.int().tolist()} global {torch.stack(allh).sum(0).int().tolist()}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/resnet1d.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/resnet1d.pt")
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
    p.add_argument("--qrs-budget", type=int, default=40)
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
