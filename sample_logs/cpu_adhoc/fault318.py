"""A three-hundred-and-eighteenth hand-run batch: CHROMATIN ACCESSIBILITY PREDICTION FROM DNA SEQUENCES.

Synthetic DNase/ATAC-style data: every rank reads 128 DNA sequences of 200 bp (strings over A, C, G, T)
and an 8-track binary accessibility matrix (one column per cell type) from
/tmp/fault318_work/peaks/peaks_R.pt.  Sequences are one-hot encoded through a 4-entry base table and a
small 1-D CNN (two convolutions with kernel 9, a global max pool, a linear head over 8 cell types) is
trained with BCE, wrapped in DDP over gloo (or, with --ddp 0, gradients all_reduced by hand).  The model is
initialised from ckpt/cnn_k9.pt.  Per-rank positive peak counts per track are all_gathered at the start,
the accuracy is all_reduced every step, per-rank mean accessibility is all_gathered at the end, and rank 0
saves export/accnet.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (logging).

Faults:
  badbase     - rank N's sequences contain an ambiguous base 'N', missing from the base table (KeyError)
  celltype    - rank N at step 3 looks up cell type 'HepG2' as track 8 of 8 (IndexError)
  nopeaks     - rank N reads its peaks from peaks/holdout/ which does not exist (FileNotFoundError)
  ckptwidth   - rank N initialises from ckpt/cnn_k11.pt, saved with kernel 11 (size mismatch)
  ckptpickle  - rank N initialises from ckpt/cnn_meta.pt, which pickles a PeakMeta object (weights_only refusal)
  trackgather - rank N all_gathers its positive counts for 9 tracks (an extra 'input control' track) vs 8
  motifscan   - rank N scans every sequence for 40 motifs in pure Python before the step-2 all_reduce
  gcweight    - rank N at step 3 weights the loss by log-odds of GC content, a GC-only sequence gives inf;
                the program's own finiteness check raises FloatingPointError
  sigsegv     - rank N sends itself SIGSEGV after step 4
  exit4       - rank N at the end prints its own error line about overlapping peak calls and sys.exit(4)
  revcomp     - every rank: reverse complement concatenated on the channel axis, 8 channels vs conv's 4
  none        - control, clean run

What happened (filled in after the runs):
  badbase     - KeyError: 'N' in one_hot at start-up; peers Connection closed by peer in all_gather (np4 r2 tee, np3 r0 pymodule)
  celltype    - IndexError 'index 8 is out of bounds for dimension 1 with size 8' at step 3; peers closed (np5 r3 loglevel); DETAIL: rank 0 monitoredBarrier names rank 1 (np3 r1 detail)
  nopeaks     - FileNotFoundError peaks/holdout/peaks_N.pt at start-up (np4 r1 wrapper); restart: attempt 2 Gloo connectFullMesh Connect timeout (np3 r2)
  ckptwidth   - load_state_dict size mismatch conv1/conv2 [16,4,11] vs [16,4,9] (np4 r3 pdsh2: worker-0 RendezvousConnectionError after; np3 r0 tee_trainer)
  ckptpickle  - _pickle.UnpicklingError 'Weights only load failed' ... Unsupported global __main__.PeakMeta; others SIGTERMed (np4 r2 prefix)
  trackgather - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (9), got (8))' (np3 r1 filter); DETAIL: every rank 'Detected mismatch between collectives' 9 vs 8 (np4 r0)
  motifscan   - 12 s: ranks 0, 1 'Timed out waiting 12000ms for recv', Root Cause rank 1 (np3 r2 plain); 300 s: silent after step 1, SIGTERM at 60 s, exit 124 (np4 r1 tee)
  gcweight    - 'non-finite loss inf at step 3' then FloatingPointError (np4 r0 redirects, in rank 0's stderr.log; np3 r2 filter)
  sigsegv     - no traceback after step 4; Root Cause exitcode -11 SIGSEGV, peers Connection reset (np5 r1 prefix); restart: attempt 2 connectFullMesh timeout (np3 r2)
  exit4       - ERROR line and exit 4, Root Cause rank 3 exitcode 4 (np4 r3 tee_trainer); rank 0 aborted at shutdown, Root Cause -6 SIGABRT (np5 r0 pymodule)
  revcomp     - every rank 'expected input[32, 8, 200] to have 4 channels, but got 8 channels instead' (np3 loglevel, np4 wrapper)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/accnet.pt, exit 0 (np3 plain)
"""
import argparse
import logging
import os
import random
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

WORK = "/tmp/fault318_work"
BASES = {"A": 0, "C": 1, "G": 2, "T": 3}
COMP = {"A": "T", "C": "G", "G": "C", "T": "A"}
CELLS = ["K562", "GM12878", "HeLa", "IMR90", "H1", "A549", "MCF7", "SKNSH"]
SEQLEN = 200
NSEQ = 128
BATCH = 32
log = None


@dataclass
class PeakMeta:
    assembly: str
    caller: str
    fdr: float


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
    log = logging.getLogger("chrm")
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


class AccNet(nn.Module):
    def __init__(self, k=9, ch=16, ntrack=len(CELLS)):
        super().__init__()
        self.conv1 = nn.Conv1d(4, ch, k, padding=k // 2)
        self.conv2 = nn.Conv1d(ch, ch, k, padding=k // 2)
        self.head = nn.Linear(ch, ntrack)

    def forward(self, x):
        h = F.max_pool1d(torch.relu(self.conv1(x)), 4)
        h = torch.relu(self.conv2(h)).amax(dim=2)
        return self.head(h)


def make_peaks(n, seed):
    rng = random.Random(seed)
    motifs = ["TGACTCA", "CCGCCC", "GATAAG", "CACGTG"]
    seqs, labels = [], torch.zeros(n, len(CELLS))
    for i in range(n):
        s = [rng.choice("ACGT") for _ in range(SEQLEN)]
        for t, m in enumerate(motifs):
            if rng.random() < 0.4:
                p = rng.randrange(0, SEQLEN - len(m))
                s[p:p + len(m)] = list(m)
                labels[i, 2 * t] = 1.0
                labels[i, 2 * t + 1] = float(rng.random() < 0.7)
        seqs.append("".join(s))
    return {"seqs": seqs, "labels": labels, "cells": list(CELLS)}


def prepare():
    os.makedirs(f"{WORK}/peaks", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_peaks(NSEQ, 300 + r), f"{WORK}/peaks/peaks_{r}.pt")
    torch.manual_seed(0)
    torch.save(AccNet(9).state_dict(), f"{WORK}/ckpt/cnn_k9.pt")
    torch.save(AccNet(11).state_dict(), f"{WORK}/ckpt/cnn_k11.pt")
    torch.save({"model": AccNet(9).state_dict(), "meta": PeakMeta("hg38", "MACS2", 0.01)},
               f"{WORK}/ckpt/cnn_meta.pt")
    print("prepared", WORK)


def one_hot(seqs, revcomp):
    idx = torch.tensor([[BASES[b] for b in s] for s in seqs])
    x = F.one_hot(idx, 4).float().transpose(1, 2)
    if revcomp:
        rc = torch.tensor([[BASES[COMP[b]] for b in reversed(s)] for s in seqs])
        x = torch.cat([x, F.one_hot(rc, 4).float().transpose(1, 2)], dim=1)
    return x


def motif_scan(seqs, budget):
    rng = random.Random(7)
    motifs = ["".join(rng.choice("ACGT") for _ in range(8)) for _ in range(40)]
    t0, hits = time.time(), 0
    while time.time() - t0 < budget:
        for s in seqs:
            for m in motifs:
                for p in range(len(s) - len(m) + 1):
                    mism = sum(1 for a, b in zip(s[p:p + len(m)], m) if a != b)
                    hits += mism <= 1
    return hits


def load_init(a, bad):
    if bad and a.fault == "ckptwidth":
        return torch.load(f"{WORK}/ckpt/cnn_k11.pt")
    if bad and a.fault == "ckptpickle":
        return torch.load(f"{WORK}/ckpt/cnn_meta.pt")["model"]
    return torch.load(f"{WORK}/ckpt/cnn_k9.pt")


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading peaks (ddp={a.ddp})")
    split = "holdout/" if bad and a.fault == "nopeaks" else ""
    data = torch.load(f"{WORK}/peaks/{split}peaks_{rank}.pt")
    seqs, labels = data["seqs"], data["labels"]
    if bad and a.fault == "badbase":
        s = seqs[41]
        seqs[41] = s[:87] + "NNNNN" + s[92:]
    if bad and a.fault == "gcweight":
        seqs[3 * BATCH + 5] = "GC" * (SEQLEN // 2)
    x = one_hot(seqs, a.fault == "revcomp")
    pos = labels.sum(0)
    if bad and a.fault == "trackgather":
        pos = torch.cat([pos, torch.tensor([float(NSEQ // 2)])])
    allpos = [torch.zeros(len(CELLS)) for _ in range(world)]
    dist.all_gather(allpos, pos)
    say(f"rank {rank} peaks {int(pos.sum())} global {int(sum(p.sum() for p in allpos))}")
    model = AccNet()
    model.load_state_dict(load_init(a, bad))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    for step in range(a.steps):
        lo = (step * BATCH) % NSEQ
        xb, yb = x[lo:lo + BATCH], labels[lo:lo + BATCH]
        if bad and a.fault == "celltype" and step == 3:
            track = {c: i for i, c in enumerate(CELLS)}.get("HepG2", len(CELLS))
            yb = yb[:, track].unsqueeze(1).expand_as(yb)
        logits = net(xb)
        w = torch.ones(len(xb))
        if a.fault == "gcweight" and bad and step == 3:
            gc = torch.tensor([(s.count("G") + s.count("C")) / SEQLEN for s in seqs[lo:lo + BATCH]])
            w = torch.log(gc / (1 - gc)).abs()
        loss = (F.binary_cross_entropy_with_logits(logits, yb, reduction="none").mean(1) * w).mean()
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"(max weight {w.max().item()})", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "motifscan" and step == 2:
            say(f"rank {rank} motif scan: {motif_scan(seqs, a.scan_budget)} hits")
        acc = ((logits.detach() > 0).float() == yb).float().mean().reshape(1)
        dist.all_reduce(acc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc.item() / world:.4f}")
        if bad and a.fault == "sigsegv" and step == 4:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR 17 peak calls on chr7 overlap after merging (summit 55012344), "
            f"refusing to export predictions", err=True)
        sys.exit(4)
    with torch.no_grad():
        mean_acc = torch.sigmoid(model(x[:BATCH])).mean().reshape(1)
    means = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(means, mean_acc)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/accnet.pt")
        say(f"rank 0 done: {a.steps} steps, mean accessibility per rank "
            f"{[round(m.item(), 3) for m in means]}, saved export/accnet.pt")
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
    p.add_argument("--scan-budget", type=int, default=40)
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
