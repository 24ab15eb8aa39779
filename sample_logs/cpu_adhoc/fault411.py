"""Batch 411 hand-run fault script: SOUND EVENT DETECTION IN URBAN AUDIO.

Synthetic urban recordings (UrbanSound-style classes: air conditioner, car horn, dog bark, siren, ...):
every rank reads 48 clips of 32-bin mel power spectrograms (64 frames) from
/tmp/fault411_work/mels/clips_R.pt, with an event list per clip (class name, onset s, offset s).  The
events are turned into frame-level multi-label targets, the power into dB, and a small CRNN (two conv
blocks pooling over frequency, a bidirectional GRU over frames, a per-frame linear head over 10 classes)
is trained with BCE, wrapped in DDP over gloo (or, with --ddp 0, gradients all_reduced by hand).  The model
starts from ckpt/crnn_mel32.pt.  Per-class event counts are all_gathered at the start, the frame F1 is
all_reduced every step, the final F1 is all_reduced once more at the end, and rank 0 saves export/crnn.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults (--fault NAME --rank R; -1 = every rank):
  classname  - rank R's event list names "ice_cream_truck", missing from the class table (KeyError, start-up)
  nomels     - rank R reads its clips from mels/fold9/, which does not exist (FileNotFoundError, start-up)
  onsetidx   - rank R's clip in the step-3 batch has an offset past the clip end: the frame loop writes
               frame 64 of a 64-frame target (IndexError, step 3)
  ckptmels   - rank R initialises from ckpt/crnn_mel40.pt, trained on 40 mel bins (size mismatch, start-up)
  ckptpickle - rank R initialises from ckpt/crnn_full.pt, which pickles a SEDConfig object; torch.load's
               weights_only unpickler refuses it (UnpicklingError, start-up)
  histgather - rank R all_gathers its class histogram with an extra "background" bin (11 vs 10 entries)
  slowvad    - rank R runs a pure-Python energy VAD over every frame before the step-2 all_reduce for
               --vad-budget s (30); with --pg-timeout 300 and a long budget, a hang
  dbnan      - rank R's step-4 batch holds a clip of digital silence: dB of 0 power is -inf, the loss is NaN,
               the program's own finiteness check raises FloatingPointError (step 4)
  sigsegv    - rank R sends itself SIGSEGV after step 3
  exit4      - rank R prints its own ERROR line about the evaluation sample rate and calls sys.exit(4) after
               the last step (the end)
  chanall    - every rank stacks its spectrograms as stereo (2 channels); the first conv expects 1 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  classname  - KeyError: 'ice_cream_truck' before the first all_gather; peers Connection closed by peer (np4 r2 ranklabel);
               spawn: Process 0 terminated with the KeyError, the other 5 SIGTERMed (np6 r0 spawn)
  nomels     - FileNotFoundError for mels/fold9/clips_R.pt at start-up; peers closed in all_gather (np3 r1 mpitag, np4 r3 files)
  onsetidx   - IndexError 'index 64 is out of bounds for dimension 1 with size 64' at step 3; peers closed
               (np4 r1 srunlabel; np3 r2 logfmt, Root Cause rank 2)
  ckptmels   - load_state_dict size mismatch gru.weight_ih_l0 [96,160] vs [96,128] (np3 r0 legacy; np4 r2 pdsh2, where
               worker-0's agent then lost the c10d store: RendezvousConnectionError)
  ckptpickle - UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.SEDConfig'; Root Cause
               rank 4 (np6 r4 tee)
  histgather - rank N: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (11), got (10))' (np3 r1
               bashloop); the np8 r5 mpitag run was dropped for time (never run)
  slowvad    - 12 s: ranks 0,1 'Timed out waiting 12000ms for recv', then rank 2's vad line and Connection closed (np3 r2
               ranklabel); 300 s: silent after step 1, killed at 60 s, exit 124 (np3 r0 ranklabel); np4 r1 srunlabel
               (300 s) went silent after step 0 on a heavily loaded machine, killed at 60 s, exit 124
  dbnan      - the program's check: 'non-finite loss nan at step 4; 2048 non-finite input bins', FloatingPointError
               (np4 r0 tee; np3 r2 spawn with --ddp 0)
  sigsegv    - no traceback after step 3; bash 'Segmentation fault' exit 139 (np4 r3 bashloop); Root Cause exitcode -11
               (SIGSEGV) (np3 r1 legacy)
  exit4      - rank 2's ERROR line about 22050 Hz annotations and exit 4 after step 5; Root Cause exitcode 4 (np6 r2 logfmt)
  chanall    - every rank: 'expected input[8, 2, 32, 64] to have 1 channels, but got 2 channels instead' (np3 srunlabel)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/crnn.pt, exit 0 (np3 bashloop)
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
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault411_work"
CLASSES = ["air_conditioner", "car_horn", "children_playing", "dog_bark", "drilling",
           "engine_idling", "gun_shot", "jackhammer", "siren", "street_music"]
CLASS_IDX = {c: i for i, c in enumerate(CLASSES)}
NMEL, NFRAMES, NCLIP, BATCH = 32, 64, 48, 8
HOP_S = 4.0 / NFRAMES  # 4 s clips
log = None


@dataclass
class SEDConfig:
    n_mels: int = 32
    hop_s: float = HOP_S
    classes: int = 10


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
    def __init__(self, n_mels=NMEL, ncls=len(CLASSES)):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d((2, 1)),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d((2, 1)))
        self.gru = nn.GRU(16 * (n_mels // 4), 32, batch_first=True, bidirectional=True)
        self.head = nn.Linear(64, ncls)

    def forward(self, x):  # x: [B, 1, mels, frames]
        h = self.conv(x)
        b, c, f, t = h.shape
        h, _ = self.gru(h.permute(0, 3, 1, 2).reshape(b, t, c * f))
        return self.head(h)  # [B, frames, classes]


def make_clips(n, seed):
    g = torch.Generator().manual_seed(seed)
    power = torch.rand(n, NMEL, NFRAMES, generator=g) * 1e-3 + 1e-6
    events = []
    for i in range(n):
        ev = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            c = int(torch.randint(0, len(CLASSES), (1,), generator=g))
            on = float(torch.rand(1, generator=g)) * 3.0
            off = min(4.0 - HOP_S, on + 0.3 + float(torch.rand(1, generator=g)))
            lo, hi = int(on / HOP_S), int(off / HOP_S)
            power[i, 4 + 2 * c:8 + 2 * c, lo:hi] += 0.05
            ev.append((CLASSES[c], round(on, 3), round(off, 3)))
        events.append(ev)
    return {"power": power, "events": events, "sr": 44100}


def prepare():
    os.makedirs(f"{WORK}/mels", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_clips(NCLIP, 500 + r), f"{WORK}/mels/clips_{r}.pt")
    torch.manual_seed(0)
    torch.save(CRNN(32).state_dict(), f"{WORK}/ckpt/crnn_mel32.pt")
    torch.save(CRNN(40).state_dict(), f"{WORK}/ckpt/crnn_mel40.pt")
    torch.save({"state_dict": CRNN(32).state_dict(), "config": SEDConfig()}, f"{WORK}/ckpt/crnn_full.pt")
    print("prepared", WORK)


def frame_targets(events, bad_offset=False):
    tgt = torch.zeros(len(events), NFRAMES, len(CLASSES))
    for i, ev in enumerate(events):
        for name, on, off in ev:
            if bad_offset and i == 0:
                off = 4.0 + HOP_S * 1.2  # annotation runs past the 4 s clip
            lo, hi = int(on / HOP_S), int(round(off / HOP_S))
            for f in range(lo, hi):
                tgt[i, f, CLASS_IDX[name]] = 1.0
    return tgt


def energy_vad(power, budget):
    t0, passes, voiced = time.time(), 0, 0
    rows = power.sum(1).tolist()
    while time.time() - t0 < budget:
        for clip in rows:
            floor = sorted(clip)[len(clip) // 10]
            for e in clip:
                voiced += e > 3.0 * floor
        passes += 1
    return passes, voiced


def run(a, rank, world):
    torch.set_num_threads(1)  # 2 shared cores
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(411 + rank)
    say(f"rank {rank}/{world} up, loading clips")
    fold = "fold9/" if bad and a.fault == "nomels" else ""
    data = torch.load(f"{WORK}/mels/{fold}clips_{rank}.pt")
    power, events = data["power"], data["events"]
    if bad and a.fault == "classname":
        events[11].append(("ice_cream_truck", 1.25, 2.5))
    if bad and a.fault == "dbnan":
        power[4 * BATCH % NCLIP + 3] = 0.0  # a clip of digital silence in the step-4 batch
    hist = torch.zeros(len(CLASSES))
    for ev in events:
        for name, _, _ in ev:
            hist[CLASS_IDX[name]] += 1
    if bad and a.fault == "histgather":
        hist = torch.cat([hist, torch.tensor([float(NCLIP)])])  # background bin
    allh = [torch.zeros(len(CLASSES)) for _ in range(world)]
    dist.all_gather(allh, hist)
    say(f"rank {rank} events {int(hist.sum())} global {int(sum(h.sum() for h in allh))}")
    feats = 10.0 * torch.log10(power)
    feats = (feats - feats[torch.isfinite(feats)].mean()) / 10.0
    model = CRNN()
    if bad and a.fault == "ckptmels":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/crnn_mel40.pt"))
    elif bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/crnn_full.pt")["state_dict"])
    else:
        model.load_state_dict(torch.load(f"{WORK}/ckpt/crnn_mel32.pt"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    lossf = nn.BCEWithLogitsLoss()
    f1 = torch.zeros(1)
    for step in range(a.steps):
        lo = step * BATCH % NCLIP
        x = feats[lo:lo + BATCH].unsqueeze(1)
        if a.fault == "chanall" and bad:
            x = torch.cat([x, x], 1)  # stereo stack
        y = frame_targets(events[lo:lo + BATCH], bad and a.fault == "onsetidx" and step == 3)
        logits = net(x)
        loss = lossf(logits, y)
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step}; "
                f"{int((~torch.isfinite(x)).sum())} non-finite input bins in the batch", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowvad" and step == 2:
            passes, voiced = energy_vad(power, a.vad_budget)
            say(f"rank {rank} vad: {passes} passes, {voiced} voiced frames")
        pred = (logits.detach() > 0).float()
        tp = (pred * y).sum()
        f1 = (2 * tp / (pred.sum() + y.sum()).clamp(min=1)).reshape(1)
        dist.all_reduce(f1)
        say(f"rank {rank} step {step} loss {loss.item():.4f} f1 {f1.item() / world:.4f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR reference annotations for fold 10 are at 22050 Hz, model hop assumes 44100 Hz; "
            f"refusing to score event-based F1", err=True)
        sys.exit(4)
    final = f1.clone()
    dist.all_reduce(final)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/crnn.pt")
        say(f"rank 0 done: {a.steps} steps, final f1 {final.item() / world:.4f}, saved export/crnn.pt")
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
    p.add_argument("--vad-budget", type=int, default=30)
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
