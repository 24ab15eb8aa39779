"""A two-hundred-and-fifty-second hand-run batch: SPEECH KEYWORD SPOTTING WITH A SMALL CONV-RNN.

Synthetic one-second clips at 8 kHz (a tone pattern per keyword, noise bursts for "unknown", zeros for
"silence"), background noise mixed in from a noise folder, MFCC features computed with torch (STFT, a mel
filterbank, log, DCT), a Conv1d front-end and a GRU, a softmax over 10 keywords plus silence and unknown,
wrapped in DDP on gloo; a warm start from a pretrained checkpoint, a few steps, per-keyword recall all_reduced.
Launch with torchrun, a bash loop (env:// variables) or --spawn N (torch.multiprocessing.spawn).

Faults:
- label: rank N maps "unknown" to index 14 (an off-by-one in the label offset) -> cross_entropy target out of range.
- frames: rank N computes MFCC with center=False, so its frame count differs; the all_gather of features mismatches.
- noise: rank N looks for the background noise in "_background_noise" (no trailing underscore) -> FileNotFoundError.
- labelmap: rank N's manifest holds the keyword "marvin", which the label map lacks -> KeyError.
- gru: the GRU input size comes from a config value 24 while the conv front-end gives 32 channels (every rank).
- logmel: rank N takes the log of the mel energy without the epsilon; silence clips give -inf and NaN features.
- ckpt: rank N (or every rank) warm-starts from the 35-keyword checkpoint -> size mismatch in load_state_dict.
- augment: rank N augments every clip with every noise at every SNR and reaches the all_reduce far too late.
- sigbus: rank N sends itself SIGBUS while memory-mapping the noise bank.
- exit6: rank N prints an error line about its clip manifest checksum and calls os._exit(6).
- wait: rank N waits on a recv for an "eval ready" message nobody sends; the others sit in the all_reduce.
- none: control, no fault.

What happened (filled in after the runs):
- label: rank 2 of 4 (srunlabel): IndexError: Target 14 is out of bounds in cross_entropy; peers Connection closed by peer.
- frames: rank 1 of 3 (mpitag): gloo enforce 'op.preamble.length <= op.nbytes. 1638 vs 1586', SIGABRT 134; peers reset.
- noise: rank 3 of 4 (files): FileNotFoundError for .../_background_noise; peers Connection closed by peer.
- labelmap: rank 2 of 3 (logfmt): KeyError: 'marvin'; Root Cause names rank 2; peers SIGTERMed.
- gru: first spawn run hit a checkpoint size mismatch instead (dropped); line 151 changed; no kept run.
- logmel: not run (time).
- ckpt: not run (time).
- augment: not run (time).
- sigbus: not run (time).
- exit6: not run (time).
- wait: not run (time).
- none: 3 ranks (bashloop): 4 steps each, mean recall 0.1667, exit 0.
"""
import argparse
import logging
import math
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

KEYWORDS = ["yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go"]
SR = 8000
N_FFT, HOP, N_MELS, N_MFCC = 256, 128, 40, 13
log = logging.getLogger("kws")


def setup_logging(rank, use_logfmt):
    if not use_logfmt:
        return
    class RankFilter(logging.Filter):
        def filter(self, record):
            record.rank = rank
            return True
    h = logging.StreamHandler(sys.stdout)
    h.addFilter(RankFilter())
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(a, msg, err=False):
    if a.logfmt:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


def mel_filterbank(n_mels=N_MELS, n_fft=N_FFT, sr=SR):
    def hz2mel(f):
        return 2595.0 * np.log10(1.0 + f / 700.0)
    mels = np.linspace(hz2mel(0.0), hz2mel(sr / 2), n_mels + 2)
    hz = 700.0 * (10 ** (mels / 2595.0) - 1.0)
    bins = np.floor((n_fft + 1) * hz / sr).astype(int)
    fb = np.zeros((n_mels, n_fft // 2 + 1), dtype=np.float32)
    for m in range(1, n_mels + 1):
        lo, c, hi = bins[m - 1], bins[m], bins[m + 1]
        for k in range(lo, c):
            fb[m - 1, k] = (k - lo) / max(c - lo, 1)
        for k in range(c, hi):
            fb[m - 1, k] = (hi - k) / max(hi - c, 1)
    return torch.from_numpy(fb)


def dct_matrix(n_mfcc=N_MFCC, n_mels=N_MELS):
    n = torch.arange(n_mels, dtype=torch.float32)
    k = torch.arange(n_mfcc, dtype=torch.float32).unsqueeze(1)
    return torch.cos(math.pi / n_mels * (n + 0.5) * k) * math.sqrt(2.0 / n_mels)


def mfcc(clips, fb, dct, center=True, eps=1e-6):
    spec = torch.stft(clips, N_FFT, HOP, window=torch.hann_window(N_FFT), center=center,
                      return_complex=True).abs() ** 2
    mel = torch.matmul(fb, spec)
    logmel = torch.log(mel + eps) if eps else torch.log(mel)
    return torch.matmul(dct, logmel)  # [B, n_mfcc, frames]


def make_clips(n, rank, seed, words):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    t = torch.arange(SR, dtype=torch.float32) / SR
    clips, names = [], []
    for i in range(n):
        w = words[int(torch.randint(len(words), (1,), generator=g))]
        if w == "_silence_":
            x = torch.zeros(SR)
        elif w == "_unknown_":
            x = torch.randn(SR, generator=g) * 0.3
        else:
            f0 = 300.0 + 150.0 * (KEYWORDS.index(w) if w in KEYWORDS else 11)
            env = torch.exp(-((t - 0.5) ** 2) / 0.02)
            x = 0.5 * env * torch.sin(2 * math.pi * f0 * t) + 0.2 * env * torch.sin(2 * math.pi * 2.1 * f0 * t)
        clips.append(x)
        names.append(w)
    return torch.stack(clips), names


class KWSNet(nn.Module):
    def __init__(self, n_classes, conv_channels=32, gru_input=32, hidden=48):
        super().__init__()
        self.front = nn.Sequential(nn.Conv1d(N_MFCC, conv_channels, 5, padding=2), nn.BatchNorm1d(conv_channels),
                                   nn.ReLU(), nn.Conv1d(conv_channels, conv_channels, 3, padding=1), nn.ReLU())
        self.gru = nn.GRU(gru_input, hidden, batch_first=True)
        self.head = nn.Linear(hidden, n_classes)

    def forward(self, feats):
        h = self.front(feats).transpose(1, 2)  # [B, frames, channels]
        out, _ = self.gru(h)
        return self.head(out[:, -1])


def prepare(a, rank):
    os.makedirs(a.data, exist_ok=True)
    noise_dir = os.path.join(a.data, "_background_noise_")
    if rank == 0:
        os.makedirs(noise_dir, exist_ok=True)
        g = np.random.default_rng(7)
        for name in ["white_noise", "pink_noise", "running_tap", "doing_the_dishes", "exercise_bike"]:
            np.save(os.path.join(noise_dir, name + ".npy"), (g.standard_normal(SR * 3) * 0.1).astype(np.float32))
        torch.manual_seed(0)
        torch.save(KWSNet(len(KEYWORDS) + 2, gru_input=24 if a.fault == "gru" else 32).state_dict(), os.path.join(a.data, "kws_12.pt"))
        torch.save(KWSNet(35).state_dict(), os.path.join(a.data, "kws_35.pt"))
    dist.barrier()


def run(a, rank, world):
    hit = lambda: a.fault_rank in (-1, rank)
    fault = a.fault
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    setup_logging(rank, a.logfmt)
    say(a, f"rank {rank}/{world} up, pid {os.getpid()}, keywords {len(KEYWORDS)} + silence + unknown")
    prepare(a, rank)
    label_map = {w: i for i, w in enumerate(KEYWORDS)}
    label_map["_silence_"] = len(KEYWORDS)
    label_map["_unknown_"] = len(KEYWORDS) + 1
    if fault == "label" and hit():
        label_map["_unknown_"] = len(KEYWORDS) + 4
    words = KEYWORDS + ["_silence_", "_unknown_"]
    if fault == "labelmap" and hit():
        words = words + ["marvin"]
    noise_dir = os.path.join(a.data, "_background_noise" if fault == "noise" and hit() else "_background_noise_")
    noises = [torch.from_numpy(np.load(os.path.join(noise_dir, f))) for f in sorted(os.listdir(noise_dir))]
    say(a, f"rank {rank} loaded {len(noises)} background noise files from {noise_dir}")
    if fault == "sigbus" and hit():
        say(a, f"rank {rank} memory-mapping noise bank {noise_dir}/noise_bank.bin (15000000 bytes)")
        os.kill(os.getpid(), signal.SIGBUS)
    fb, dct = mel_filterbank(), dct_matrix()
    gru_input = 24 if fault == "gru" and hit() else a.conv_channels
    model = KWSNet(len(KEYWORDS) + 2, conv_channels=a.conv_channels, gru_input=gru_input)
    ckpt = os.path.join(a.data, "kws_35.pt" if fault == "ckpt" and hit() else "kws_12.pt")
    say(a, f"rank {rank} warm start from {ckpt}")
    model.load_state_dict(torch.load(ckpt, map_location="cpu"))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    if fault == "exit6" and hit():
        say(a, f"rank {rank}: ERROR clip manifest checksum mismatch for shard {rank} "
               f"(expected 9f2c41d0, got 00000000); refusing to train on a truncated shard", err=True)
        os._exit(6)
    for step in range(a.steps):
        clips, names = make_clips(a.batch, rank, step, words)
        if fault == "augment" and hit() and step == 1:
            say(a, f"rank {rank} augmenting {len(clips)} clips x {len(noises)} noises x 7 SNRs")
            aug = []
            for c in clips:
                for nz in noises:
                    for snr in (-5, 0, 5, 10, 15, 20, 30):
                        scale = c.norm() / (nz[:SR].norm() * 10 ** (snr / 20) + 1e-8)
                        aug.append(c + scale * nz[:SR])
                        time.sleep(0.08)
            say(a, f"rank {rank} augmented set has {len(aug)} clips")
        noise = noises[step % len(noises)][:SR]
        clips = clips + 0.05 * noise
        silence = torch.tensor([n == "_silence_" for n in names])
        clips[silence] = 0.0
        labels = torch.tensor([label_map[n] for n in names])
        feats = mfcc(clips, fb, dct, center=not (fault == "frames" and hit()),
                     eps=0.0 if fault == "logmel" and hit() else 1e-6)
        if step == 0:
            first = feats[0].contiguous()
            gathered = [torch.empty_like(first) for _ in range(world)]
            dist.all_gather(gathered, first)
            spread = torch.stack(gathered).mean(0).std().item()
            say(a, f"rank {rank} mfcc frames {feats.shape[-1]}, cross-rank feature spread {spread:.3f}")
        if not torch.isfinite(feats).all():
            bad = int((~torch.isfinite(feats)).any(-1).any(-1).sum())
            raise FloatingPointError(f"rank {rank} step {step}: non-finite MFCC features in {bad} of {len(feats)} clips")
        if fault == "wait" and hit() and step == 1:
            say(a, f"rank {rank} waiting for eval-ready message from rank {(rank + 1) % world}")
            tok = torch.zeros(1)
            dist.recv(tok, src=(rank + 1) % world)
        feats = (feats - feats.mean()) / (feats.std() + 1e-5)
        logits = ddp(feats)
        loss = F.cross_entropy(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        say(a, f"rank {rank} step {step} loss {loss.item():.4f}")
    with torch.no_grad():
        clips, names = make_clips(a.batch, rank, 99, words)
        labels = torch.tensor([label_map[n] for n in names])
        pred = ddp(mfcc(clips, fb, dct)).argmax(-1)
        n_cls = len(KEYWORDS) + 2
        stats = torch.zeros(2, n_cls)
        stats[0].index_add_(0, labels, (pred == labels).float())
        stats[1].index_add_(0, labels, torch.ones(len(labels)))
    dist.all_reduce(stats)
    recall = stats[0] / stats[1].clamp(min=1)
    if rank == 0:
        say(a, "per-keyword recall " + " ".join(f"{w}={r:.2f}" for w, r in zip(words, recall.tolist())))
        say(a, f"mean recall {recall.mean().item():.4f}")
    dist.barrier()
    dist.destroy_process_group()


def spawn_worker(local_rank, nprocs, a):
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(local_rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    run(a, local_rank, nprocs)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", dest="fault_rank", type=int, default=1)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--conv-channels", type=int, default=32)
    p.add_argument("--data", default="/tmp/fault252_work/speech_commands")
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    a = p.parse_args()
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_worker, args=(a.spawn, a), nprocs=a.spawn)
        return
    try:
        run(a, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))
    except Exception as e:
        if a.logfmt:
            log.error("training failed: %s: %s", type(e).__name__, e)
        raise


if __name__ == "__main__":
    main()
