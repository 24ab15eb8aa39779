"""A three-hundred-and-thirteenth hand-run batch: AUDIO WATERMARK DETECTION WITH A 1-D CNN.

Synthetic 8 kHz audio clips (2048 samples each): noise plus a few tones, and in most clips a faint keyed
watermark (a sum of three sinusoids whose frequencies come from a table of 8 watermark keys "k1".."k8").
The task is to say which key (or "none") marked each clip: 9 classes.  Every rank reads its clips from
/tmp/fault313_work/clips/clips_R.pt, maps each clip's key id to a class through the KEYS table, computes a
per-rank SNR summary (mean, min, max, count) that is all_gathered at the start, and trains a small 1-D CNN
(two strided Conv1d layers, global average pooling, a linear head) with cross-entropy, wrapped in DDP (gloo)
or, with --ddp 0, with gradients all_reduced by hand.  The model is initialised from ckpt/wmcnn.pt.  The
accuracy is all_reduced every step, the per-rank detection rate is all_gathered at the end, and rank 0 saves
export/wmcnn.pt.  Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (logging).

Faults:
  keyid      - rank N's clip table names watermark key "k11", not in the 9-entry KEYS table (KeyError, start-up)
  noclips    - rank N reads its clips from clips/eval/, which does not exist (FileNotFoundError, start-up)
  snrgather  - rank N all_gathers its SNR summary with a median added (5 vs 4 entries, start-up)
  ckptchan   - rank N initialises from ckpt/wmcnn_c24.pt, saved with 24 conv channels (size mismatch)
  ckptpickle - rank N initialises from ckpt/wmcnn_cfg.pt, which pickles a WmConfig object (weights_only refusal)
  kernel     - every rank: the head is fed the flattened feature map instead of the pooled one (shape error)
  clipnan    - rank N's clip 53 holds an inf sample (a clipping decoder); step 3's loss is NaN, the program's check
  segidx     - rank N crops step 4's batch with a segment-offset table of 32 entries indexed up to 39 (IndexError)
  stft       - rank N computes a pure-Python DFT of its clips for ~30 s before the step-2 all_reduce
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit4      - rank N prints its own false-positive-rate error at the end and calls sys.exit(4) before the gather
  none       - control, clean run

What happened (filled in after the runs):
  keyid      - KeyError: 'k11' in encode_keys before the SNR gather; peers Connection closed in all_gather (np4 r2 ranklabel); mp.spawn ProcessRaisedException for process 0 (np3 r0 spawn)
  noclips    - FileNotFoundError for clips/eval/clips_N.pt at start-up; peers closed in all_gather (np5 r3 mpitag, np3 r1 logfmt: Root Cause rank 1)
  snrgather  - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (4))' on rank N; peers closed (np3 r1 srunlabel, np5 r4 files)
  ckptchan   - load_state_dict size mismatch conv1/conv2/head (24/48 vs 16/32 channels); node 1's ranks closed (np4 r1 pdsh2); Root Cause rank 2 (np3 r2 legacy)
  ckptpickle - 'Weights only load failed ... Unsupported global: GLOBAL __main__.WmConfig'; torchrun SIGTERMs the rest, Root Cause rank 0 (np4 r0 tee)
  kernel     - every rank: 'mat1 and mat2 shapes cannot be multiplied (16x4096 and 32x9)'; Root Cause names rank 1, the first to exit (np3 legacy)
  clipnan    - 'non-finite loss nan at step 3 (batch max |x| inf)', FloatingPointError; peers closed in backward / the manual grad all_reduce (np4 r3 mpitag, np3 r1 logfmt --ddp 0)
  segidx     - 'IndexError: index 32 is out of bounds for dimension 0 with size 32' at step 4; a survivor aborts at exit ('terminate called without an active exception'), loop exit 134 (np4 r2 bashloop); Root Cause rank 0 (np5 r0 logfmt)
  stft       - 12 s PG timeout: peers 'Timed out waiting 12000ms for recv/send' in step 2's all_reduce (np3 r1 bashloop); 300 s: output stops after step 1, killed at 60 s, exit 124 (np4 r2 srunlabel)
  sigsegv    - silent after step 3, loop exit 139 (np4 r1 ranklabel); 'ProcessExitedException: process 2 terminated with signal SIGSEGV' (np3 r2 spawn)
  exit4      - rank N's false-positive-rate ERROR line, exit 4; Root Cause rank 2 exitcode 4 (np5 r2 tee); rank1.log, loop exit 4 (np4 r1 files)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/wmcnn.pt, exit 0 (np3 bashloop)
"""
import argparse
import logging
import math
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

WORK = "/tmp/fault313_work"
SR = 8000
CLIP = 2048
NCLIP = 64
BATCH = 16
KEYS = {"none": 0, "k1": 1, "k2": 2, "k3": 3, "k4": 4, "k5": 5, "k6": 6, "k7": 7, "k8": 8}
KEYFREQ = {k: (300.0 + 170.0 * i, 1100.0 + 90.0 * i, 2300.0 - 120.0 * i) for i, k in enumerate(KEYS) if k != "none"}
log = None


@dataclass
class WmConfig:
    channels: int = 16
    kernel: int = 9
    stride: int = 4
    sample_rate: int = SR


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
    log = logging.getLogger("wmcnn")
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


class WmCNN(nn.Module):
    def __init__(self, ch=16, nclass=len(KEYS)):
        super().__init__()
        self.conv1 = nn.Conv1d(1, ch, 9, stride=4, padding=4)
        self.conv2 = nn.Conv1d(ch, 2 * ch, 9, stride=4, padding=4)
        self.head = nn.Linear(2 * ch, nclass)
        self.flat = False

    def forward(self, x):
        h = F.relu(self.conv1(x.unsqueeze(1)))
        h = F.relu(self.conv2(h))
        feat = h.flatten(1) if self.flat else h.mean(-1)
        return self.head(feat)


def make_clips(n, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(CLIP) / SR
    audio = torch.randn(n, CLIP, generator=g) * 0.2
    keys = []
    for i in range(n):
        for _ in range(3):
            f = float(torch.randint(100, 3500, (1,), generator=g))
            audio[i] += 0.3 * torch.sin(2 * math.pi * f * t)
        k = list(KEYS)[int(torch.randint(0, len(KEYS), (1,), generator=g))]
        if k != "none":
            for f in KEYFREQ[k]:
                audio[i] += 0.08 * torch.sin(2 * math.pi * f * t)
        keys.append(k)
    seg = torch.randint(0, CLIP // 2, (32,), generator=g)
    return {"audio": audio, "keys": keys, "seg": seg}


def prepare():
    os.makedirs(f"{WORK}/clips", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_clips(NCLIP, 300 + r), f"{WORK}/clips/clips_{r}.pt")
    torch.manual_seed(0)
    torch.save(WmCNN(16).state_dict(), f"{WORK}/ckpt/wmcnn.pt")
    torch.save(WmCNN(24).state_dict(), f"{WORK}/ckpt/wmcnn_c24.pt")
    torch.save({"state": WmCNN(16).state_dict(), "cfg": WmConfig()}, f"{WORK}/ckpt/wmcnn_cfg.pt")
    print("prepared", WORK)


def encode_keys(keys):
    return torch.tensor([KEYS[k] for k in keys])


def snr_summary(audio):
    sig = audio.pow(2).mean(1)
    resid = (audio - F.avg_pool1d(audio.unsqueeze(1), 5, 1, 2).squeeze(1)).pow(2).mean(1)
    snr = 10 * torch.log10(sig / resid)
    return snr, torch.tensor([snr.mean().item(), snr.min().item(), snr.max().item(), float(len(snr))])


def python_dft(audio, nbins=64):
    # a slow "reference" spectrum, sample by sample in Python
    out = 0.0
    for clip in audio.tolist():
        for k in range(nbins):
            re = im = 0.0
            for n, v in enumerate(clip[:512]):
                re += v * math.cos(2 * math.pi * k * n / 512)
                im -= v * math.sin(2 * math.pi * k * n / 512)
            out += re * re + im * im
    return out


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading clips")
    split = "eval/" if bad and a.fault == "noclips" else ""
    data = torch.load(f"{WORK}/clips/{split}clips_{rank}.pt")
    audio, keys, seg = data["audio"], data["keys"], data["seg"]
    if bad and a.fault == "keyid":
        keys[9] = "k11"
    if bad and a.fault == "clipnan":
        audio[53, 700] = float("inf")
    y = encode_keys(keys)
    snr, summ = snr_summary(audio[torch.isfinite(audio).all(1)])
    if bad and a.fault == "snrgather":
        summ = torch.cat([summ, snr.median().reshape(1)])
    alls = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(alls, summ)
    say(f"rank {rank} clips {len(keys)} snr {summ[0]:.2f} dB global mean {sum(s[0] for s in alls) / world:.2f} dB")
    model = WmCNN()
    ck = {"ckptchan": "wmcnn_c24.pt", "ckptpickle": "wmcnn_cfg.pt"}.get(a.fault, "wmcnn.pt") if bad else "wmcnn.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    if bad and a.fault == "kernel":
        model.flat = True
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    correct = 0
    for step in range(a.steps):
        idx = torch.arange(step * BATCH, (step + 1) * BATCH) % NCLIP
        xb, yb = audio[idx], y[idx]
        if bad and a.fault == "segidx" and step == 4:
            starts = seg[idx + 24]
            xb = torch.stack([torch.roll(c, -int(s)) for c, s in zip(xb, starts)])
        logits = net(xb)
        loss = F.cross_entropy(logits, yb)
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"(batch max |x| {xb.abs().max().item()})", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "stft" and step == 2:
            t0 = time.time()
            e = 0.0
            while time.time() - t0 < a.dft_budget:
                e += python_dft(audio[:2])
            say(f"rank {rank} reference spectrum energy {e:.1f}")
        acc = (logits.argmax(1) == yb).float().mean().reshape(1)
        correct += int((logits.argmax(1) == yb).sum())
        dist.all_reduce(acc)
        say(f"rank {rank} step {step} loss {loss.item():.4f} acc {acc.item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    rate = torch.tensor([correct / (a.steps * BATCH)])
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR watermark false-positive rate 0.41 exceeds the 0.05 budget on clips_{rank}.pt, "
            f"refusing to export", err=True)
        sys.exit(4)
    rates = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(rates, rate)
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/wmcnn.pt")
        say(f"rank 0 done: {a.steps} steps, detection rates {[round(r.item(), 3) for r in rates]}, "
            f"saved export/wmcnn.pt")
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
    p.add_argument("--dft-budget", type=int, default=30)
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
