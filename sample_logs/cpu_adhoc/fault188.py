"""A hundred-and-eighty-eighth hand-run batch: TEMPORAL CONVOLUTIONAL NETWORKS.

Every rank writes its synthetic multichannel time series (data/series_rR.npz: 3 channels, a class-dependent
sine frequency per segment plus noise) and reads it back, normalises each channel by its mean and std, and cuts
it into sliding windows (length --window, stride --stride; the label is the segment class at the window end).
Window counts are all_gathered before training.  The model is a TCN: dilated causal Conv1d blocks (weight norm,
causal padding then a chomp, ReLU, a residual add with a 1x1 downsample), a receptive-field check at start-up,
and a linear head on the last time step.  Training is cross-entropy under DDP on gloo (or --ddp 0: gradients
all_reduced by hand), with the program's own finite-logits check; the loss is all_reduced for the progress
lines, accuracy is all_reduced at the end and rank 0 saves the model.

Faults:
  padwrong   - every rank's block chomps (k-1) instead of (k-1)*dilation (residual add size mismatch)
  short      - rank N's series is trimmed to 24 samples, shorter than the receptive field (ValueError)
  chanlast   - rank N builds its batches channels-last (B, W, C) instead of (B, C, W) (conv1d RuntimeError)
  seriesmiss - rank N reads its series from a node-local cache dir that was never synced (FileNotFoundError)
  flatline   - rank N's channel 1 is a dead sensor (constant); normalisation without eps gives NaN logits
  dilstr     - every rank's config holds the dilations as the string "1,2,4,8" (TypeError)
  wincount   - rank N all_gathers its window stats with 3 entries against 2 (gloo size mismatch)
  slowwin    - rank N recomputes its windows for --busy seconds before the window all_gather
  ckptk5     - rank N resumes from a pretrained checkpoint with kernel size 5 against 3 (size mismatch)
  sigbus     - rank N gets SIGBUS (sent to itself) at step 2
  exit6      - rank N prints its own 'validation windows overlap' error line and exits with code 6
  none       - control, clean run

What happened (filled in after the runs):
  padwrong   - every rank: RuntimeError The size of tensor a (36) must match the size of tensor b (32) (residual add)
  short      - rank N: ValueError series has 24 samples, shorter than the receptive field 29; peers Connection closed
  chanlast   - rank N: RuntimeError conv1d expected input[8, 32, 3] to have 3 channels, but got 32 channels instead
  seriesmiss - rank N: FileNotFoundError data/node_cache/series_rN.npz; restart run dies in connectFullMesh timeout
  flatline   - rank N: FloatingPointError non-finite logits at step 0 (32 of 32); DETAIL: monitoredBarrier on rank 0
  dilstr     - every rank: TypeError unsupported operand type(s) for +: 'int' and 'str' (receptive-field sum)
  wincount   - rank N: RuntimeError ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (3), got (2))
  slowwin    - busy 40 s: peers gloo timeout 12000ms (Root Cause a victim); busy 1000 s / PG 300 s: timeout 60, exit 124
  ckptk5     - rank N: RuntimeError loading state_dict: size mismatch [16, 3, 5] vs [16, 3, 3]; pdsh2 node 0 store lost
  sigbus     - rank N: exitcode -7 (SIGBUS) at step 2; peers Connection reset by peer
  exit6      - rank N: prints its ERROR validation windows overlap line, exitcode 6; peers Connection closed by peer
  none       - clean, exit 0, rank 0 saved ckpt/tcn.pt
"""
import argparse
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
from torch.nn.utils.parametrizations import weight_norm


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--stride", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--busy", type=float, default=40.0)
    p.add_argument("--pg-timeout", type=float, default=12.0)
    p.add_argument("--save", default="/tmp/fault188_work/ckpt/tcn.pt")
    return p.parse_args()


class Chomp(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        return x[:, :, : -self.n] if self.n > 0 else x


class TemporalBlock(nn.Module):
    def __init__(self, cin, cout, k, d, chomp_dilated=True):
        super().__init__()
        pad = (k - 1) * d
        cut = pad if chomp_dilated else (k - 1)
        self.conv1 = weight_norm(nn.Conv1d(cin, cout, k, padding=pad, dilation=d))
        self.conv2 = weight_norm(nn.Conv1d(cout, cout, k, padding=pad, dilation=d))
        self.chomp1, self.chomp2 = Chomp(cut), Chomp(cut)
        self.down = nn.Conv1d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        h = F.relu(self.chomp1(self.conv1(x)))
        h = F.relu(self.chomp2(self.conv2(h)))
        return F.relu(h + self.down(x))


class TCN(nn.Module):
    def __init__(self, cin, hidden, classes, k, dilations, chomp_dilated=True):
        super().__init__()
        chans = [cin] + [hidden] * len(dilations)
        self.blocks = nn.Sequential(*[TemporalBlock(chans[i], chans[i + 1], k, d, chomp_dilated)
                                      for i, d in enumerate(dilations)])
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.blocks(x)[:, :, -1])


def receptive_field(k, dilations):
    return 1 + sum(2 * (k - 1) * d for d in dilations)


def write_series(rank, length, classes):
    g = np.random.default_rng(300 + rank)
    seg = 32
    labels = g.integers(0, classes, size=length // seg)
    t = np.arange(length)
    cls = np.repeat(labels, seg)[:length]
    freq = 0.05 + 0.04 * cls
    x = np.stack([np.sin(2 * np.pi * freq * t + c) + 0.1 * g.standard_normal(length) for c in range(3)])
    os.makedirs("data", exist_ok=True)
    np.savez(f"data/series_r{rank}.npz", x=x.astype(np.float32), y=cls.astype(np.int64))


def make_windows(x, y, window, stride):
    starts = range(0, x.shape[1] - window + 1, stride)
    xs = torch.stack([x[:, s: s + window] for s in starts])
    ys = torch.stack([y[s + window - 1] for s in starts])
    return xs, ys


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    hit = a.rank in (-1, rank)
    f = a.fault
    torch.manual_seed(0)
    write_series(rank, a.length, a.classes)
    cfg = {"kernel": 3, "dilations": [1, 2, 4], "hidden": 16, "trim": a.length, "chomp_dilated": True}
    if f == "dilstr" and hit:
        cfg["dilations"] = "1,2,4"
    if f == "padwrong" and hit:
        cfg["chomp_dilated"] = False
    if f == "short" and hit:
        cfg["trim"] = 24
    rf = receptive_field(cfg["kernel"], cfg["dilations"])
    src = "data/node_cache" if f == "seriesmiss" and hit else "data"
    z = np.load(os.path.join(src, f"series_r{rank}.npz"))
    x, y = torch.from_numpy(z["x"])[:, : cfg["trim"]], torch.from_numpy(z["y"])[: cfg["trim"]]
    if f == "flatline" and hit:
        x[1] = 0.0  # channel 1 reads a constant
    if x.shape[1] < rf:
        raise ValueError(f"rank {rank}: series has {x.shape[1]} samples, shorter than the receptive field {rf} "
                         f"(kernel {cfg['kernel']}, dilations {cfg['dilations']})")
    x = (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)
    print(f"rank {rank}: series {tuple(x.shape)} receptive field {rf} window {a.window}", flush=True)
    if f == "slowwin" and hit:
        print(f"rank {rank}: window cache stale, recomputing windows", flush=True)
        t0 = time.time()
        while time.time() - t0 < a.busy:
            time.sleep(0.5)
    xs, ys = make_windows(x, y, a.window, a.stride)
    stats = torch.tensor([xs.shape[0], x.shape[1]], dtype=torch.int64)
    if f == "wincount" and hit:
        stats = torch.tensor([xs.shape[0], x.shape[1], a.stride], dtype=torch.int64)
    allstats = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(allstats, stats)
    if rank == 0:
        print(f"rank 0: windows per rank {[int(s[0]) for s in allstats]}", flush=True)
    model = TCN(3, cfg["hidden"], a.classes, cfg["kernel"], cfg["dilations"], cfg["chomp_dilated"])
    if f == "ckptk5" and hit:
        path = "/tmp/fault188_work/ckpt/tcn_pretrain_k5.pt"
        model.load_state_dict(torch.load(path, map_location="cpu"))
        print(f"rank {rank}: resumed from {path}", flush=True)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for step in range(a.steps):
        if f == "sigbus" and hit and step == 2:
            os.kill(os.getpid(), signal.SIGBUS)
        idx = torch.randint(0, xs.shape[0], (a.batch,), generator=g)
        xb, yb = xs[idx], ys[idx]
        if f == "chanlast" and hit:
            xb = xb.permute(0, 2, 1).contiguous()
        opt.zero_grad()
        logits = net(xb)
        if not torch.isfinite(logits).all():
            raise FloatingPointError(f"rank {rank}: non-finite logits at step {step} "
                                     f"({int((~torch.isfinite(logits)).sum())} of {logits.numel()})")
        loss = F.cross_entropy(logits, yb)
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        tot = loss.detach().clone()
        dist.all_reduce(tot)
        print(f"rank {rank} step {step} loss {tot.item() / world:.4f}", flush=True)
    with torch.no_grad():
        correct = (model(xs).argmax(1) == ys).sum()
    if f == "exit6" and hit:
        print(f"ERROR rank {rank}: validation windows overlap training windows (12 of {xs.shape[0]} shared); "
              f"refusing to report accuracy", flush=True)
        sys.exit(6)
    acc = torch.tensor([float(correct), float(xs.shape[0])])
    dist.all_reduce(acc)
    if rank == 0:
        print(f"rank 0: accuracy {acc[0] / acc[1]:.3f} over {int(acc[1])} windows", flush=True)
        os.makedirs(os.path.dirname(a.save), exist_ok=True)
        torch.save(model.state_dict(), a.save)
        print(f"rank 0: saved {a.save}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
