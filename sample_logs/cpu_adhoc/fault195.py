"""A hundred-and-ninety-fifth hand-run batch: AUDIO CLASSIFICATION FROM SPECTROGRAMS.

Every rank loads its shard of synthetic 0.25 s clips (tones at four pitches plus noise, 16 kHz) from
/tmp/fault195_work/clips/shard_R.pt, turns them into log-mel spectrograms by hand (torch.stft with a Hann
window, a triangular mel filterbank matrix built from the config, log(x + 0)), applies SpecAugment (one
frequency and one time mask), and trains a small CNN (a 3x3 conv, mean over time, a linear classifier over
channels x mel bins).  Weights start from ckpt/wav_cnn_c4.pt.  Gradients are averaged by DDP on gloo (or
--ddp 0: a hand-written all_reduce); the loss and accuracy are all_reduced and per-class counts all_gathered.
Launch with torchrun / torch.distributed.launch / a bash loop (env://), or --spawn N (mp.spawn).

Faults:
  nfft      - rank N's config asks for n_fft=8192, longer than the 4000-sample clip (torch.stft raises)
  melbins   - every rank: the filterbank is built with 40 mel bins, the CNN expects 32 (linear shape error)
  noclip    - rank N reads its shard as shard_N_16k.pt, a file that does not exist (FileNotFoundError)
  logzero   - rank N's clips are scaled by a gain of 0: log of a zero spectrogram, the program's finite check
  label     - rank N shifts its labels by one: class 4 of 4 (cross_entropy's Target 4 is out of bounds)
  srstr     - every rank: the sample rate is read from the config as the string '16000' (TypeError)
  counts    - rank N counts classes with minlength=5: all_gather of 5 ints against 4 on the others
  slowcache - rank N recomputes its filterbank cache for --stall s before the first all_reduce
  ckpt      - rank N loads ckpt/wav_cnn_c5.pt, saved with 5 classes (size mismatch in load_state_dict)
  segv      - rank N sends itself SIGSEGV after step 2
  exit3     - rank N prints its own ERROR line about a clipped shard and exits with code 3
  none      - control, clean run

What happened (filled in after the runs):
  nfft      - rank N: RuntimeError stft ... expected 0 < n_fft < 4000, but got n_fft=8192; peers closed
  melbins   - every rank: RuntimeError mat1 and mat2 shapes cannot be multiplied (8x320 and 256x4)
  noclip    - rank N: FileNotFoundError .../clips/shard_N_16k.pt before DDP; peers Connection closed
  logzero   - rank N: FloatingPointError log-mel has 22528 non-finite values (program's check)
  label     - rank N: IndexError Target 4 is out of bounds. at step 0; peers Connection closed
  srstr     - every rank: TypeError unsupported operand type(s) for /: 'str' and 'int' (f_max = sr / 2)
  counts    - gloo EnforceNotMet 20 vs 16 size mismatch aborts another rank (SIGABRT); peers reset
  slowcache - stall 40 s: peers time out (12000ms) in DDP's check; stall 1000 s/PG 300 s: hung, exit 124
  ckpt      - rank N: RuntimeError size mismatch for fc.weight [5, 256] vs [4, 256]; peers closed
  segv      - rank N: SIGSEGV after step 2 (spawn: ProcessExitedException; bash loop: exit 139)
  exit3     - rank N: prints its ERROR clipped waveforms line, exits 3; peers Connection closed
  none      - clean, exit 0, rank 0 saved ckpt/wav_cnn_final.pt
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
import torch.nn as nn
import torch.nn.functional as F

WORK = "/tmp/fault195_work"
CFG = {"sample_rate": 16000, "n_fft": 512, "hop": 160, "n_mels": 32, "classes": 4, "clip": 4000}
LOG = None


class SpecCNN(nn.Module):
    def __init__(self, n_mels=32, classes=4):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.fc = nn.Linear(8 * n_mels, classes)

    def forward(self, x):
        h = F.relu(self.conv(x)).mean(dim=3)
        return self.fc(h.flatten(1))


def log(msg, level=logging.INFO):
    if LOG is not None:
        LOG.log(level, msg)
    else:
        print(msg, flush=True)


def mel_filterbank(sr, n_fft, n_mels):
    n_freqs = n_fft // 2 + 1
    f_max = sr / 2
    mel = lambda f: 2595.0 * math.log10(1.0 + f / 700.0)
    pts = torch.linspace(0.0, mel(f_max), n_mels + 2)
    hz = 700.0 * (10 ** (pts / 2595.0) - 1.0)
    freqs = torch.linspace(0.0, f_max, n_freqs)
    fb = torch.zeros(n_mels, n_freqs)
    for m in range(n_mels):
        lo, c, hi = hz[m], hz[m + 1], hz[m + 2]
        up = (freqs - lo) / (c - lo)
        down = (hi - freqs) / (hi - c)
        fb[m] = torch.clamp(torch.minimum(up, down), min=0.0)
    return fb


def log_mel(wave, fb, n_fft, hop):
    spec = torch.stft(wave, n_fft, hop_length=hop, window=torch.hann_window(n_fft), center=False,
                      return_complex=True).abs() ** 2
    mel = torch.matmul(fb, spec)
    return torch.log(mel)


def spec_augment(x, g):
    x = x.clone()
    f0 = int(torch.randint(0, x.shape[-2] - 4, (1,), generator=g))
    t0 = int(torch.randint(0, x.shape[-1] - 3, (1,), generator=g))
    x[..., f0:f0 + 4, :] = x.mean()
    x[..., :, t0:t0 + 3] = x.mean()
    return x


def prep():
    os.makedirs(f"{WORK}/clips", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    g = torch.Generator().manual_seed(0)
    t = torch.arange(CFG["clip"]) / CFG["sample_rate"]
    for r in range(8):
        y = torch.randint(0, 4, (32,), generator=g)
        f = torch.tensor([300.0, 700.0, 1500.0, 3100.0])[y]
        x = torch.sin(2 * math.pi * f[:, None] * t[None]) + 0.1 * torch.randn(32, CFG["clip"], generator=g)
        torch.save({"wave": x, "label": y}, f"{WORK}/clips/shard_{r}.pt")
    torch.manual_seed(1)
    torch.save(SpecCNN(32, 4).state_dict(), f"{WORK}/ckpt/wav_cnn_c4.pt")
    torch.save(SpecCNN(32, 5).state_dict(), f"{WORK}/ckpt/wav_cnn_c5.pt")
    print("prepared", WORK)


def train(rank, world, a):
    global LOG
    if a.logfmt:
        logging.basicConfig(format="%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s", level=logging.INFO)
        LOG = logging.LoggerAdapter(logging.getLogger("wav"), {"rank": rank})
    bad = a.rank in (-1, rank)
    f = a.fault if bad else "none"
    cfg = dict(CFG)
    if f == "srstr":
        cfg["sample_rate"] = "16000"
    if f == "melbins":
        cfg["n_mels"] = 40
    if f == "nfft":
        cfg["n_fft"] = 8192
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    log(f"rank {rank}/{world} up, sr {cfg['sample_rate']} n_fft {cfg['n_fft']} n_mels {cfg['n_mels']}")
    shard = f"{WORK}/clips/shard_{rank}_16k.pt" if f == "noclip" else f"{WORK}/clips/shard_{rank}.pt"
    data = torch.load(shard)
    wave, label = data["wave"], data["label"]
    if f == "logzero":
        wave = wave * 0.0
    if f == "label":
        label = label + 1
    fb = mel_filterbank(cfg["sample_rate"], cfg["n_fft"], cfg["n_mels"])
    if f == "slowcache":
        log(f"rank {rank}: filterbank cache stale, recomputing")
        time.sleep(a.stall)
    feats = log_mel(wave, fb, cfg["n_fft"], cfg["hop"]).unsqueeze(1)
    if not torch.isfinite(feats).all():
        n = int((~torch.isfinite(feats)).sum())
        raise FloatingPointError(f"rank {rank}: log-mel has {n} non-finite values (min power 0.0) in {shard}")
    model = SpecCNN(CFG["n_mels"], CFG["classes"])
    ck = f"{WORK}/ckpt/wav_cnn_c5.pt" if f == "ckpt" else f"{WORK}/ckpt/wav_cnn_c4.pt"
    model.load_state_dict(torch.load(ck))
    net = nn.parallel.DistributedDataParallel(model) if a.ddp else model
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for step in range(a.steps):
        idx = torch.randint(0, wave.shape[0], (8,), generator=g)
        x = spec_augment(feats[idx], g)
        logits = net(x)
        loss = F.cross_entropy(logits, label[idx])
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        acc = (logits.argmax(1) == label[idx]).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        stats /= world
        log(f"rank {rank} step {step} loss {stats[0]:.4f} acc {stats[1]:.3f}")
        if f == "segv" and step == 2:
            os.kill(os.getpid(), signal.SIGSEGV)
        if f == "exit3" and step == 1:
            log(f"ERROR rank {rank}: shard {shard} has clipped waveforms (peak > 1.0 in 7 of 32 clips); aborting",
                logging.ERROR)
            sys.exit(3)
    counts = torch.bincount(label, minlength=5 if f == "counts" else CFG["classes"])
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    if rank == 0:
        log(f"class counts per rank: {[c.tolist() for c in gathered]}")
        torch.save(model.state_dict(), f"{WORK}/ckpt/wav_cnn_final.pt")
        log(f"saved {WORK}/ckpt/wav_cnn_final.pt")
    dist.destroy_process_group()


def spawn_entry(rank, world, a):
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    os.environ["LOCAL_RANK"] = str(rank)
    train(rank, world, a)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--prep", action="store_true")
    a = p.parse_args()
    if a.prep:
        return prep()
    if a.spawn:
        import torch.multiprocessing as mp
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(a.port)
        mp.spawn(spawn_entry, args=(a.spawn, a), nprocs=a.spawn)
        return
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)


if __name__ == "__main__":
    main()
