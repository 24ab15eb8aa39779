"""A two-hundred-and-sixtieth hand-run batch: WAVEFORM GENERATION WITH A SMALL WAVENET.

Synthetic audio clips of mixed sines (one shard manifest per rank, a speaker id per clip),
mu-law companded and quantised to 64 levels; a small WaveNet (causal input conv, dilated
causal convolutions with gated tanh/sigmoid units conditioned on a speaker embedding,
residual and skip connections, a softmax over the 64 levels), initialised from a
checkpoint. DDP over gloo by default (--ddp 0 all-reduces gradients by hand); bits per
sample all_reduced every step; per-clip lengths all_gathered at the end; rank 0 then draws
a short autoregressive sample.

Faults:
  level     one rank quantises with 65 mu-law levels, so a peak sample maps to level 64 (softmax has 64)
  receptive every rank builds 3 stacks of dilations 1..512; the receptive field exceeds the clip (ValueError)
  cliplen   one rank drops its short clip and all_gathers 3 lengths into buffers sized for 4
  manifest  one rank computes its shard manifest name with world-1 and opens a file that does not exist
  speaker   one rank's shard lists a clip of speaker spk_07, missing from the conditioning table (KeyError)
  nan       one rank masks the levels unseen in its first batch; log(0) = -inf gives NaN bits/sample (check)
  ckpt      one rank loads the residual-32 WaveNet checkpoint into the residual-16 model
  slowgen   one rank renders a full-second autoregressive preview before step 2's all_reduce
  abrt      one rank aborts (SIGABRT) after its step-2 line
  exit3     one rank prints its own error about clips shorter than the receptive field and calls os._exit(3)
  none      control

What happened (filled in after the runs):
  level     rank N IndexError: Target 64 is out of bounds. in cross_entropy at step 0; peers closed by peer; Root Cause rank N
  receptive every rank ValueError: receptive field 3071 samples exceeds the shortest clip (216 samples); Root Cause rank 0
  cliplen   after 5 steps rank N allgather: invalid tensor size at index 0 (expected (3), got (4)); peers closed
  manifest  rank N FileNotFoundError: .../clips/shard-00N-of-00(W-1).json before DDP (first np4 r1 try found a stale file)
  speaker   rank N KeyError: 'spk_07' before DDP; DETAIL: rank 0 Ranks 2 failed to pass monitoredBarrier in 12000 ms
  nan       rank N FloatingPointError: rank N: bits per sample is nan at step 0 (program's check); peers closed
  ckpt      rank N RuntimeError: Error(s) in loading state_dict for WaveNet: size mismatch ... [32, 1, 2] vs [16, 1, 2]
  slowgen   PG 12 s: peers Timed out waiting 12000ms for recv/send; PG 300 s under timeout 60: no output, exit 124
  abrt      rank N exitcode -6 (SIGABRT) after its step-2 line, no traceback; peers reset by peer; Root Cause rank N
  exit3     rank N prints its ERROR line about short clips at step 1 and exits 3; Root Cause rank N exitcode 3
  none      exit 0, rank 0 done: 5 steps, 2952 samples in 12 clips, sample mean level -0.736
"""
import argparse
import json
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
from torch.nn.parallel import DistributedDataParallel as DDP

SR = 8000
SPEAKERS = ["spk_%02d" % i for i in range(6)]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--work", default="/tmp/fault260_work")
    p.add_argument("--clip", type=int, default=256)
    p.add_argument("--levels", type=int, default=64)
    return p.parse_args()


def mu_law(x, levels):
    mu = levels - 1
    y = torch.sign(x) * torch.log1p(mu * x.abs()) / math.log1p(mu)
    return y, ((y + 1) / 2 * mu + 0.5).long()


def make_clip(rng, n):
    t = np.arange(n) / SR
    x = sum(rng.uniform(0.2, 1.0) * np.sin(2 * np.pi * rng.uniform(80, 900) * t + rng.uniform(0, 6.28))
            for _ in range(3))
    x = x / np.abs(x).max()
    if x.max() < -x.min():
        x = -x
    return x.astype(np.float32)


def prepare(work, world, clip):
    os.makedirs(os.path.join(work, "clips"), exist_ok=True)
    os.makedirs(os.path.join(work, "ckpt"), exist_ok=True)
    rng = np.random.default_rng(260)
    with open(os.path.join(work, "speakers.json"), "w") as f:
        json.dump({s: i for i, s in enumerate(SPEAKERS)}, f)
    for r in range(world):
        clips = []
        for c in range(4):
            n = clip if c < 3 else clip - 40
            clips.append({"id": "r%dc%d" % (r, c), "speaker": SPEAKERS[(r + c) % 6], "len": n,
                          "seed": int(rng.integers(1 << 30))})
        with open(os.path.join(work, "clips", "shard-%03d-of-%03d.json" % (r, world)), "w") as f:
            json.dump(clips, f)
    for res in (16, 32):
        torch.manual_seed(res)
        torch.save(WaveNet(res, [1, 2, 4, 8] * 2).state_dict(), os.path.join(work, "ckpt", "wavenet_res%d.pt" % res))


class Layer(nn.Module):
    def __init__(self, res, dil):
        super().__init__()
        self.dil = dil
        self.conv = nn.Conv1d(res, 2 * res, 2, dilation=dil)
        self.cond = nn.Linear(8, 2 * res)
        self.out = nn.Conv1d(res, res, 1)
        self.skip = nn.Conv1d(res, res, 1)

    def forward(self, x, s):
        h = self.conv(F.pad(x, (self.dil, 0))) + self.cond(s).unsqueeze(-1)
        a, b = h.chunk(2, 1)
        z = torch.tanh(a) * torch.sigmoid(b)
        return x + self.out(z), self.skip(z)


class WaveNet(nn.Module):
    def __init__(self, res, dilations, levels=64):
        super().__init__()
        self.inp = nn.Conv1d(1, res, 2)
        self.spk = nn.Embedding(len(SPEAKERS), 8)
        self.layers = nn.ModuleList(Layer(res, d) for d in dilations)
        self.head = nn.Sequential(nn.ReLU(), nn.Conv1d(res, res, 1), nn.ReLU(), nn.Conv1d(res, levels, 1))
        self.receptive = 2 + sum(dilations)

    def forward(self, x, spk):
        s = self.spk(spk)
        h = self.inp(F.pad(x, (1, 0)))
        skip = 0
        for layer in self.layers:
            h, k = layer(h, s)
            skip = skip + k
        return self.head(skip + h)


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.rank in (-1, rank)
    f = a.fault if bad else "none"
    torch.manual_seed(rank)
    if rank == 0:
        prepare(a.work, world, a.clip)
    dist.barrier()

    shard_world = world - 1 if f == "manifest" else world
    with open(os.path.join(a.work, "clips", "shard-%03d-of-%03d.json" % (rank, shard_world))) as fh:
        clips = json.load(fh)
    if f == "speaker":
        clips[2]["speaker"] = "spk_07"
    with open(os.path.join(a.work, "speakers.json")) as fh:
        table = json.load(fh)
    spk_ids = torch.tensor([table[c["speaker"]] for c in clips])
    levels = a.levels + 1 if f == "level" else a.levels
    audio = [torch.from_numpy(make_clip(np.random.default_rng(c["seed"]), c["len"])) for c in clips]
    print(f"rank {rank}: {len(clips)} clips, speakers {sorted(set(c['speaker'] for c in clips))}, "
          f"{levels} mu-law levels", flush=True)

    dilations = [1, 2, 4, 8] * 2
    if f == "receptive":
        dilations = [2 ** i for i in range(10)] * 3
    model = WaveNet(16, dilations)
    if model.receptive > min(c["len"] for c in clips):
        raise ValueError(f"receptive field {model.receptive} samples exceeds the shortest clip "
                         f"({min(c['len'] for c in clips)} samples); reduce the dilation stacks")
    ck = "wavenet_res32.pt" if f == "ckpt" else "wavenet_res16.pt"
    model.load_state_dict(torch.load(os.path.join(a.work, "ckpt", ck)))
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    n = min(c["len"] for c in clips)
    x = torch.stack([w[:n] for w in audio])
    y, q = mu_law(x, levels)
    inp, tgt = y[:, :-1].unsqueeze(1), q[:, 1:]
    mask = None
    for step in range(a.steps):
        logits = net(inp, spk_ids)
        if f == "nan":
            if mask is None:
                mask = torch.zeros(a.levels)
                mask[tgt[:2].unique()] = 1.0
            probs = F.softmax(logits, 1) * mask.view(1, -1, 1)
            logp = torch.log(probs / probs.sum(1, keepdim=True))
            loss = -(F.one_hot(tgt, a.levels).permute(0, 2, 1) * logp).sum(1).mean()
        else:
            loss = F.cross_entropy(logits, tgt)
        bps = loss.detach() / math.log(2)
        if not torch.isfinite(bps):
            raise FloatingPointError(f"rank {rank}: bits per sample is {bps.item()} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if f == "exit3" and step == 1:
            print(f"ERROR rank {rank}: clip shard shard-{rank:03d}-of-{world:03d}.json has 2 clips shorter than "
                  f"2x the receptive field ({model.receptive}); refusing to train on truncated audio",
                  file=sys.stderr, flush=True)
            os._exit(3)
        if f == "slowgen" and step == 2:
            print(f"rank {rank} rendering a 1 s preview ({SR} samples) before step {step}", flush=True)
            t0, buf = time.time(), torch.zeros(1, 1, model.receptive)
            with torch.no_grad():
                for i in range(SR):
                    lg = model(buf[:, :, -model.receptive:], spk_ids[:1])[0, :, -1]
                    buf = torch.cat([buf, (lg.argmax() * 2.0 / 63 - 1).view(1, 1, 1)], -1)
                    time.sleep(max(0.0, a.stall * (i + 1) / SR - (time.time() - t0)))
        dist.all_reduce(bps)
        print(f"rank {rank} step {step} loss {loss.item():.4f} bits/sample {bps.item() / world:.3f}", flush=True)
        if f == "abrt" and step == 2:
            os.kill(os.getpid(), signal.SIGABRT)

    lens = torch.tensor([c["len"] for c in clips])
    if f == "cliplen":
        lens = lens[lens >= a.clip]
    out = [torch.zeros(len(clips), dtype=lens.dtype) for _ in range(world)]
    dist.all_gather(out, lens)
    if rank == 0:
        buf = y[:1, :model.receptive].unsqueeze(1).clone()
        with torch.no_grad():
            for i in range(64):
                lg = model(buf[:, :, -model.receptive:], spk_ids[:1])[0, :, -1]
                buf = torch.cat([buf, (lg.argmax() * 2.0 / 63 - 1).view(1, 1, 1)], -1)
        print(f"rank 0 done: {a.steps} steps, {int(torch.cat(out).sum())} samples in {world * len(clips)} clips, "
              f"sample mean level {buf[0, 0, -64:].mean().item():+.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
