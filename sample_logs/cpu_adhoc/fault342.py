"""A three-hundred-and-forty-second hand-run batch: SOUND EVENT DETECTION WITH A CRNN ON LOG-MEL FRAMES.

Synthetic 64-frame clips of 40-bin mel power and a strong-label annotation table (class name, onset and
offset frame) per rank, written by --prepare under /tmp/fault342_work (feats/mels_R.pt, feats/events_R.json).
Each rank takes log(mel + eps), builds frame-level multi-hot targets for a batch of 4 clips each step from the
annotations (10 classes in the CLASSES table), and trains a CRNN (two conv blocks pooling frequency 40 -> 2,
a bidirectional GRU, a frame-wise linear head) with BCE, wrapped in DDP over gloo (or --ddp 0: gradients
all_reduced by hand).  The model is initialised from ckpt/crnn_m40.pt.  The frame F1 is all_reduced every
step, per-class event counts are all_gathered at the end, and rank 0 saves export/crnn_sed.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  badlabel    - rank N's annotations name "siren", not in the CLASSES table (KeyError at the first step)
  onsetidx    - rank N has an event with offset frame 71 in a 64-frame clip, used at step 3 (IndexError)
  nofeats     - rank N reads feats/eval/mels_R.pt, which does not exist (FileNotFoundError at start-up)
  ckptmels    - rank N initialises from ckpt/crnn_m64.pt, a model built for 64 mel bins (size mismatch)
  ckptpickle  - rank N loads ckpt/crnn_full.pt, pickled with its MelConfig object (weights_only refusal)
  classgather - rank N all_gathers 11 per-class counts (an extra "unknown" bucket) against 10 (end of run)
  slowaug     - rank N runs a pure-Python spec-augment over every frame before the step-2 all_reduce
  logzero     - rank N takes log(mel) without eps; silent frames give -inf, the program's NaN check at step 0
  sigsegv     - rank N sends itself SIGSEGV after step 3
  exit5       - rank N prints its own error line about a sample-rate mismatch and calls sys.exit(5)
  poolshape   - every rank pools frequency by 2 instead of 5 in the second block: the GRU gets 80 features, not 32
  none        - control, clean run

What happened (filled in after the runs):
  badlabel    - KeyError: 'siren' in frame_targets at step 0; peers Connection closed by peer (np4 r2 ranklabel, np6 r0 spawn)
  onsetidx    - after step 2, IndexError 'index 64 is out of bounds for dimension 0 with size 64'; peers closed (np3 r1 srunlabel, np5 r3 logfmt)
  nofeats     - FileNotFoundError feats/eval/mels_N.pt at start-up; peers closed in DDP init / broadcast (np8 r6 mpitag, np4 r0 bashloop)
  ckptmels    - load_state_dict size mismatch gru.weight_ih_l0 [72,48] vs [72,32] (np4 r1 pdsh2, np3 r2 legacy; Root Cause = rank N)
  ckptpickle  - UnpicklingError 'Weights only load failed' (GLOBAL __main__.MelConfig); Root Cause rank 0 (np5 r0 tee)
  classgather - after 6 steps 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (11), got (10))' (np6 r4 mpitag)
  slowaug     - 12 s: peers 'Timed out waiting 12000ms' in the step-2 all_reduce (np3 r1); 300 s: silent after step 1, exit 124 (np4 r2)
  logzero     - rank N 'loss is nan (960 non-finite log-mel bins)', FloatingPointError at step 0 (np8 r5 files; np3 r0 logfmt, Root Cause rank 1)
  sigsegv     - after step 3 no traceback; bash 'Segmentation fault' exit 139 (np4 r3 ranklabel); ProcessExitedException SIGSEGV (np3 r1 spawn)
  exit5       - rank N's 22050 Hz ERROR line, exit 5 at start-up; Root Cause rank 2 exitcode 5 (np6 r2 tee); loop exit 5 (np4 r0 files)
  poolshape   - every rank 'input.size(-1) must be equal to input_size. Expected 32, got 80'; Root Cause rank 1 (np3 legacy)
  none        - clean: 6 steps on 3 ranks, rank 0 saved export/crnn_sed.pt, exit 0 (np3 bashloop)
"""
import argparse
import dataclasses
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

WORK = "/tmp/fault342_work"
CLASSES = {"speech": 0, "dog": 1, "cat": 2, "alarm_bell": 3, "dishes": 4, "frying": 5, "blender": 6,
           "running_water": 7, "vacuum_cleaner": 8, "electric_shaver": 9}
NCLS = len(CLASSES)
FRAMES = 64
MELS = 40
NCLIPS = 24
BATCH = 4
log = None


@dataclasses.dataclass
class MelConfig:
    sr: int = 16000
    n_mels: int = MELS
    hop: int = 320


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
    log = logging.getLogger("sed")
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


class CRNN(nn.Module):
    def __init__(self, mels=MELS, pool2=5):
        super().__init__()
        self.block1 = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d((1, 4)))
        self.block2 = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                    nn.MaxPool2d((1, pool2)))
        self.gru = nn.GRU(16 * (mels // 20), 24, batch_first=True, bidirectional=True)
        self.head = nn.Linear(48, NCLS)

    def forward(self, x):
        h = self.block2(self.block1(x.unsqueeze(1)))
        b, c, t, f = h.shape
        h = h.permute(0, 2, 1, 3).reshape(b, t, c * f)
        out, _ = self.gru(h)
        return self.head(out)


def make_rank_data(r):
    g = torch.Generator().manual_seed(500 + r)
    mel = torch.rand(NCLIPS, FRAMES, MELS, generator=g) * 0.01
    names = list(CLASSES)
    events = []
    for c in range(NCLIPS):
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            k = int(torch.randint(0, NCLS, (1,), generator=g))
            on = int(torch.randint(0, 48, (1,), generator=g))
            off = min(FRAMES, on + int(torch.randint(4, 20, (1,), generator=g)))
            mel[c, on:off, 3 * k:3 * k + 6] += 1.0
            events.append({"clip": c, "label": names[k], "onset": on, "offset": off})
        mel[c, 58:, :] = 0.0  # digital silence at the clip tail
    return mel, events


def prepare():
    os.makedirs(f"{WORK}/feats", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        mel, events = make_rank_data(r)
        torch.save(mel, f"{WORK}/feats/mels_{r}.pt")
        with open(f"{WORK}/feats/events_{r}.json", "w") as f:
            json.dump(events, f)
    torch.manual_seed(0)
    torch.save(CRNN().state_dict(), f"{WORK}/ckpt/crnn_m40.pt")
    torch.save(CRNN(mels=64).state_dict(), f"{WORK}/ckpt/crnn_m64.pt")
    torch.save({"config": MelConfig(), "model": CRNN().state_dict()}, f"{WORK}/ckpt/crnn_full.pt")
    print("prepared", WORK)


def frame_targets(events, clips):
    y = torch.zeros(len(clips), FRAMES, NCLS)
    pos = {c: i for i, c in enumerate(clips)}
    for ev in events:
        if ev["clip"] not in pos:
            continue
        row = y[pos[ev["clip"]]]
        k = CLASSES[ev["label"]]
        for t in range(ev["onset"], ev["offset"]):
            row[t, k] = 1.0
    return y


def spec_augment(x, budget):
    t0 = time.time()
    n = 0
    while time.time() - t0 < budget:
        for c in range(x.shape[0]):
            for t in range(x.shape[1]):
                row = x[c, t].tolist()
                x[c, t] = torch.tensor([v if (i + t + n) % 11 else 0.0 for i, v in enumerate(row)])
        n += 1
    return n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading log-mel features")
    split = "eval/" if bad and a.fault == "nofeats" else ""
    mel = torch.load(f"{WORK}/feats/{split}mels_{rank}.pt")
    with open(f"{WORK}/feats/events_{rank}.json") as f:
        events = json.load(f)
    if bad and a.fault == "badlabel":
        events[1]["label"] = "siren"
    if bad and a.fault == "onsetidx":
        events.append({"clip": 13, "label": "alarm_bell", "onset": 52, "offset": 71})
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR clip header says 22050 Hz but the mel front-end was built for 16000 Hz "
            f"(feats/mels_{rank}.pt), refusing to train on mismatched features", err=True)
        sys.exit(5)
    eps = 0.0 if bad and a.fault == "logzero" else 1e-6
    x_all = torch.log(mel + eps)
    model = CRNN(pool2=2 if a.fault == "poolshape" else 5)
    if bad and a.fault == "ckptpickle":
        state = torch.load(f"{WORK}/ckpt/crnn_full.pt")["model"]
    else:
        ck = "crnn_m64.pt" if bad and a.fault == "ckptmels" else "crnn_m40.pt"
        state = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(state)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    bce = nn.BCEWithLogitsLoss()
    say(f"rank {rank} {NCLIPS} clips, {len(events)} events, training {a.steps} steps")
    for step in range(a.steps):
        clips = [(step * BATCH + i) % NCLIPS for i in range(BATCH)]
        x = x_all[clips].clone()
        y = frame_targets(events, clips)
        logits = net(x)
        loss = bce(logits, y)
        if not torch.isfinite(loss):
            nbad = int((~torch.isfinite(x)).sum())
            say(f"rank {rank} step {step}: loss is {loss.item()} ({nbad} non-finite log-mel bins in batch "
                f"{clips})", err=True)
            raise FloatingPointError(f"non-finite BCE loss at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowaug" and step == 2:
            n = spec_augment(x_all[:8], a.aug_budget)
            say(f"rank {rank} spec-augment: {n} passes")
        pred = (logits.detach() > 0).float()
        tp = (pred * y).sum()
        f1 = (2 * tp / (pred.sum() + y.sum() + 1e-8)).reshape(1)
        dist.all_reduce(f1)
        say(f"rank {rank} step {step} loss {loss.item():.4f} frame_f1 {f1.item() / world:.4f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    counts = torch.zeros(NCLS)
    for ev in events:
        counts[CLASSES[ev["label"]]] += 1
    if bad and a.fault == "classgather":
        counts = torch.cat([counts, torch.tensor([2.0])])
    allc = [torch.zeros(NCLS) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} events {int(counts.sum())} global {int(sum(c.sum() for c in allc))}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/crnn_sed.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/crnn_sed.pt")
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
    p.add_argument("--aug-budget", type=int, default=40)
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
