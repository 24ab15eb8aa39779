"""A two-hundred-and-thirty-eighth hand-run batch: SPEECH ENHANCEMENT ON SPECTROGRAMS.

A small convolutional U-Net predicts a ratio mask over the STFT magnitudes of synthetic noisy speech: every rank
builds clean "speech" from sine mixtures with a syllable envelope, mixes in noise from its noise bank
(/tmp/fault238_work/noise/bank_R.pt) with types and SNRs from the mixing config, computes torch.stft, masks the
magnitude, resynthesises with torch.istft and trains on a negative SI-SNR loss. The U-Net is initialised from
ckpt/unet_init.pt and wrapped in DDP (gloo), or with --ddp 0 its gradients are all_reduced by hand. At the end
the frame counts of every rank are all_gathered, the validation SNR is all_reduced, and rank 0 saves the U-Net.

Faults:
  silentref - rank N's batch at step 2 holds a silent clean reference: zero denominator, NaN SI-SNR, the check raises
  framelen  - rank N all_gathers its frame counts with an extra element (gloo size mismatch)
  nonoise   - rank N reads its noise bank from noise/bank_v2/, which does not exist (FileNotFoundError)
  nfft      - rank N takes n_fft 16384 from its config, longer than the 8000-sample clips (torch's stft error)
  window    - every rank: the Hann window is built with n_fft // 2 samples while stft gets n_fft (RuntimeError)
  noisekey  - rank N's mixing config asks for the "babble" noise type, absent from the mix table (KeyError)
  ckpt      - rank N initialises the U-Net from ckpt/unet_init_w12.pt, saved with base width 12 (size mismatch)
  fullres   - rank N enhances its whole validation set at full resolution for --stall s before the SNR all_reduce
  sigfpe    - rank N sends itself SIGFPE after step 2
  exit7     - rank N prints its own error line about a noise-bank sample rate and calls sys.exit(7)
  srenv     - every rank: the sample rate comes from SENH_SR, which defaults to "8k" (ValueError in int())
  none      - control, clean run

What happened (filled in after the runs):
  silentref - rank N: FloatingPointError SI-SNR [.., nan, ..] at step 2 (reference energy 0); peers closed
  framelen  - rank N: gloo allgather invalid tensor size (expected (3), got (2)); DETAIL: fingerprint mismatch 3vs 2
  nonoise   - rank N: FileNotFoundError .../noise/bank_v2/bank_N.pt at startup; peers SIGTERMed
  nfft      - rank N: RuntimeError Padding size should be less than ... padding (8192, 8192) ... [1, 4, 8000]
  window    - every rank: RuntimeError stft expected a 1D window tensor of size ... win_length=256, got [128]
  noisekey  - rank N: KeyError 'babble' in noisy_batch at step 0; peers Connection closed by peer
  ckpt      - rank N: RuntimeError size mismatch for enc1.weight [12, 1, 3, 3] vs [8, 1, 3, 3]; same after a restart
  fullres   - rank N slept: peers gloo Timed out waiting 12000ms in all_gather; with PG 300 s killed by timeout (124)
  sigfpe    - rank N: exitcode -8 (SIGFPE) after step 2, no traceback; peers closed or SIGTERMed
  exit7     - rank N prints its ERROR sample rate 16000 line after step 1, exitcode 7; peers closed
  srenv     - every rank: ValueError invalid literal for int() with base 10: '8k' before any step
  none      - clean, exit 0, rank 0 saved ckpt/unet_final.pt (one earlier try ended in a teardown abort)
"""
import argparse
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
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault238_work"
CLIP = 8000
MIX_TABLE = {"white": 1.0, "pink": 0.8, "hum": 0.5}


class UNet(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.enc1 = nn.Conv2d(1, width, 3, padding=1)
        self.enc2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.mid = nn.Conv2d(2 * width, 2 * width, 3, padding=1)
        self.dec1 = nn.Conv2d(3 * width, width, 3, padding=1)
        self.out = nn.Conv2d(width, 1, 1)

    def forward(self, mag):
        x = torch.log1p(mag).unsqueeze(1)
        e1 = F.relu(self.enc1(x))
        e2 = F.relu(self.mid(F.relu(self.enc2(e1))))
        up = F.interpolate(e2, size=e1.shape[-2:], mode="nearest")
        d1 = F.relu(self.dec1(torch.cat([up, e1], dim=1)))
        return torch.sigmoid(self.out(d1)).squeeze(1)


def prepare():
    os.makedirs(os.path.join(WORK, "noise"), exist_ok=True)
    os.makedirs(os.path.join(WORK, "ckpt"), exist_ok=True)
    g = torch.Generator().manual_seed(7)
    for r in range(8):
        white = torch.randn(16, CLIP, generator=g)
        pink = torch.cumsum(torch.randn(16, CLIP, generator=g), dim=1)
        pink = (pink - pink.mean(1, keepdim=True)) / pink.std(1, keepdim=True)
        t = torch.arange(CLIP) / 8000.0
        hum = torch.sin(2 * math.pi * 50 * t).repeat(16, 1)
        torch.save({"white": white, "pink": pink, "hum": hum, "sr": 8000}, os.path.join(WORK, "noise", f"bank_{r}.pt"))
    torch.manual_seed(0)
    torch.save(UNet(8).state_dict(), os.path.join(WORK, "ckpt", "unet_init.pt"))
    torch.save(UNet(12).state_dict(), os.path.join(WORK, "ckpt", "unet_init_w12.pt"))
    print("prepared noise banks and checkpoints in", WORK)


def make_speech(n, sr, gen):
    t = torch.arange(CLIP) / sr
    f0 = 100 + 150 * torch.rand(n, 1, generator=gen)
    s = sum(torch.sin(2 * math.pi * k * f0 * t) / k for k in range(1, 5))
    env = (torch.sin(2 * math.pi * 3 * t + 6 * torch.rand(n, 1, generator=gen)).clamp(min=0)) ** 2
    return 0.5 * s * env


def si_snr(est, ref, eps=0.0):
    est = est - est.mean(-1, keepdim=True)
    ref = ref - ref.mean(-1, keepdim=True)
    proj = (est * ref).sum(-1, keepdim=True) / ((ref * ref).sum(-1, keepdim=True) + eps) * ref
    noise = est - proj
    return 10 * torch.log10((proj.pow(2).sum(-1) + eps) / (noise.pow(2).sum(-1) + 1e-8))


def train(a):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad, sr_default = a.rank in (-1, rank), ("8k" if a.fault == "srenv" else "8000")
    sr = int(os.environ.get("SENH_SR", sr_default))
    n_fft = 16384 if (a.fault == "nfft" and bad) else 256
    hop = 64
    window = torch.hann_window(n_fft // 2 if a.fault == "window" else n_fft)
    sub = "bank_v2" if (a.fault == "nonoise" and bad) else ""
    bank = torch.load(os.path.join(WORK, "noise", sub, f"bank_{rank}.pt"))
    mix = {"types": ["white", "pink", "babble"] if (a.fault == "noisekey" and bad) else ["white", "pink", "hum"],
           "snr_db": (0.0, 10.0)}
    print(f"rank {rank}: sr {sr} n_fft {n_fft} hop {hop}; noise bank {len(bank['white'])} clips; types {mix['types']}",
          flush=True)
    torch.manual_seed(0)
    net = UNet(8)
    ck = "unet_init_w12.pt" if (a.fault == "ckpt" and bad) else "unet_init.pt"
    net.load_state_dict(torch.load(os.path.join(WORK, "ckpt", ck)))
    model = DDP(net) if a.ddp else net
    if not a.ddp:
        for p in net.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)

    def noisy_batch(n):
        clean = make_speech(n, sr, gen)
        noise = torch.zeros_like(clean)
        for i in range(n):
            kind = mix["types"][i % len(mix["types"])]
            nz = bank[kind][torch.randint(0, 16, (1,), generator=gen).item()] * MIX_TABLE[kind]
            snr = mix["snr_db"][0] + (mix["snr_db"][1] - mix["snr_db"][0]) * torch.rand(1, generator=gen).item()
            scale = clean[i].pow(2).mean().sqrt() / (nz.pow(2).mean().sqrt() * 10 ** (snr / 20) + 1e-8)
            noise[i] = nz * scale
        return clean, clean + noise

    def enhance(noisy):
        spec = torch.stft(noisy, n_fft, hop_length=hop, window=window, return_complex=True)
        mask = model(spec.abs())
        est = torch.istft(spec * mask, n_fft, hop_length=hop, window=window, length=CLIP)
        return est, spec.shape[-1]

    frames = 0
    for step in range(a.steps):
        clean, noisy = noisy_batch(4)
        if step == 2 and a.fault == "silentref" and bad:
            clean[1].zero_()
            noisy[1] = noisy[1] - noisy[1].mean()
        est, nfr = enhance(noisy)
        frames += nfr * noisy.shape[0]
        score = si_snr(est, clean)
        if not torch.isfinite(score).all():
            raise FloatingPointError(f"rank {rank}: SI-SNR is {score.tolist()} at step {step} "
                                     f"(reference energy {clean.pow(2).sum(-1).min().item():.3g})")
        loss = -score.mean()
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in net.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        print(f"rank {rank} step {step} loss {t.item() / world:.4f} si-snr {score.mean().item():.2f} dB", flush=True)
        if step == 1 and a.fault == "exit7" and bad:
            print(f"ERROR rank {rank}: noise bank {WORK}/noise/bank_{rank}.pt entry 11 has sample rate 16000, "
                  f"expected {sr}; refusing to mix", file=sys.stderr, flush=True)
            sys.exit(7)
        if step == 2 and a.fault == "sigfpe" and bad:
            os.kill(os.getpid(), signal.SIGFPE)

    with torch.no_grad():
        if a.fault == "fullres" and bad:
            print(f"rank {rank}: enhancing all 512 validation clips at full resolution before scoring", flush=True)
            time.sleep(a.stall)
        clean, noisy = noisy_batch(8)
        est, nfr = enhance(noisy)
        in_snr = si_snr(noisy, clean).mean()
        out_snr = si_snr(est, clean).mean()
        counts = torch.tensor([float(frames), float(a.steps)])
        if a.fault == "framelen" and bad:
            counts = torch.cat([counts, torch.tensor([float(nfr)])])
        gathered = [torch.zeros(2) for _ in range(world)]
        dist.all_gather(gathered, counts)
        val = torch.stack([in_snr, out_snr])
        dist.all_reduce(val)
        val /= world
    print(f"rank {rank}: {int(counts[0])} frames; val SI-SNR in {val[0].item():.2f} dB out {val[1].item():.2f} dB",
          flush=True)
    if rank == 0:
        out = os.path.join(WORK, "ckpt", "unet_final.pt")
        torch.save(net.state_dict(), out)
        print(f"rank 0: total frames {int(torch.stack(gathered)[:, 0].sum())}; saved {out}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--prepare", type=int, default=0)
    a = p.parse_args()
    if a.prepare:
        prepare()
    else:
        train(a)
