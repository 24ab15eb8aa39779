"""A two-hundred-and-first hand-run batch: MONOCULAR DEPTH ESTIMATION.

A small convolutional encoder-decoder predicts depth maps from synthetic RGB scenes.  Every rank reads its
scenes from /tmp/fault201_work/data/depth_R.pt (images and ground-truth depth in metres, 0 = invalid pixel),
initialises the model from ckpt/depth_init.pt and trains it wrapped in DDP (gloo).  The loss is a
scale-invariant log loss computed by hand over the valid-depth mask (min_depth < gt < max_depth, max_depth
from the DEPTH_MAX_M env var); the loss is checked for finiteness and all_reduced for the log.  At the end
abs-rel and delta<1.25 sums are all_reduced, per-rank metric sums are all_gathered, and rank 0 saves the
model to out/depth_final.pt.

Faults:
  logzero  - rank N reads min_depth -1: zero-depth (invalid) pixels enter the log, the loss check raises
  nomask   - rank N divides max_depth by 1000 (a mm/m mix-up): no pixel is valid (ZeroDivisionError)
  upsample - every rank: the decoder upsamples x4 instead of x2, prediction 32x32 vs target 16x16
  nofile   - rank N reads its scenes from data/nyu_v2/ which does not exist (FileNotFoundError)
  maxenv   - every rank: DEPTH_MAX_M defaults to "10m" (ValueError in float())
  gatherlen- rank N all_gathers its metric sums with an extra pixel-count element (gloo size mismatch)
  ckpt     - rank N initialises from ckpt/depth_init_w24.pt, saved with decoder width 24 (size mismatch)
  late     - rank N re-renders its scenes for --stall seconds before the step-2 loss all_reduce
  abrt     - rank N sends itself SIGABRT after step 2
  exit4    - rank N prints its own error line about a corrupt depth map and exits with code 4
  none     - control, clean run

What happened (filled in after the runs):
  logzero  - rank N: FloatingPointError silog loss is nan at step 0 (2048 valid pixels); peers closed
  nomask   - rank N: ZeroDivisionError float division by zero in silog, step 0; peers closed
  upsample - every rank: RuntimeError size of tensor a (32) must match tensor b (16), step 0
  nofile   - rank N: FileNotFoundError .../data/nyu_v2/depth_N.pt before DDP; peers closed/SIGTERMed
  maxenv   - every rank: ValueError could not convert string to float: '10m'
  gatherlen- a receiving rank aborted: gloo EnforceNotMet 8 vs 6 size mismatch (SIGABRT); others reset
  ckpt     - rank N: RuntimeError size mismatch for enc.0.weight [24, 3, 3, 3] vs [16, 3, 3, 3]
  late     - rank N slept: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout (124)
  abrt     - rank N: SIGABRT after step 2 (bash Aborted / spawn ProcessExitedException); peers closed
  exit4    - rank N logs its ERROR all-zeros depth map line and exits 4; peers closed in backward
  none     - clean, exit 0, rank 0 saved out/depth_final.pt
"""
import argparse
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault201_work"
SIZE = 16


class DepthNet(nn.Module):
    def __init__(self, width=16, up=2):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
                                 nn.Conv2d(width, width, 3, stride=2, padding=1), nn.ReLU())
        self.up = nn.Upsample(scale_factor=up, mode="bilinear", align_corners=False)
        self.dec = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.Conv2d(width, 1, 1))

    def forward(self, x):
        return nn.functional.softplus(self.dec(self.up(self.enc(x)))) + 1e-3


def get_logger(rank, use_logging):
    if not use_logging:
        return None
    class RankFilter(logging.Filter):
        def filter(self, record):
            record.rank = rank
            return True
    log = logging.getLogger("depth")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter())
    log.addHandler(h)
    log.setLevel(logging.INFO)
    return log


def silog(pred, gt, min_depth, max_depth):
    mask = (gt > min_depth) & (gt < max_depth)
    n_valid = int(mask.sum().item())
    inv_n = 1.0 / n_valid
    d = torch.log(pred) - torch.log(gt)
    d = d[mask]
    return (d ** 2).sum() * inv_n - 0.5 * (d.sum() * inv_n) ** 2, mask


def train(a):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = a.rank in (-1, rank)
    logger = get_logger(rank, a.logfmt)

    def say(msg, err=False):
        if logger is None:
            print(msg, file=sys.stderr if err else sys.stdout, flush=True)
        elif err:
            logger.error(msg)
        else:
            logger.info(msg)

    torch.manual_seed(1234 + rank)
    max_env = "10m" if a.fault == "maxenv" else "10.0"
    max_depth = float(os.environ.get("DEPTH_MAX_M", max_env))
    min_depth = -1.0 if (a.fault == "logzero" and bad) else 1e-3
    if a.fault == "nomask" and bad:
        max_depth = max_depth / 1000.0
    split = "nyu_v2" if (a.fault == "nofile" and bad) else ""
    data = torch.load(os.path.join(WORK, "data", split, f"depth_{rank}.pt"))
    images, depth = data["images"], data["depth"]
    say(f"rank {rank}: loaded {len(images)} scenes {SIZE}x{SIZE}, valid depth range ({min_depth}, {max_depth}) m")

    up = 4 if a.fault == "upsample" else 2
    width = 24 if (a.fault == "ckpt" and bad) else 16
    net = DepthNet(16, up)
    ck = "depth_init_w24.pt" if width == 24 else "depth_init.pt"
    net.load_state_dict(torch.load(os.path.join(WORK, "ckpt", ck)))
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    for step in range(a.steps):
        idx = torch.randint(0, len(images), (8,))
        x, gt = images[idx], depth[idx]
        if step == 2 and a.fault == "exit4" and bad:
            say(f"ERROR rank {rank}: depth map of scene {int(idx[0])} is all zeros (corrupt depth file); aborting", err=True)
            sys.exit(4)
        pred = model(x)
        loss, mask = silog(pred, gt, min_depth, max_depth)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {rank}: silog loss is {loss.item()} at step {step} ({int(mask.sum())} valid pixels)")
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 2 and a.fault == "late" and bad:
            say(f"rank {rank}: depth cache stale, re-rendering scenes into {WORK}/data")
            time.sleep(a.stall)
        t = loss.detach().clone()
        dist.all_reduce(t)
        say(f"rank {rank} step {step} loss {t.item() / world:.4f} valid {int(mask.sum())}")
        if step == 2 and a.fault == "abrt" and bad:
            os.kill(os.getpid(), signal.SIGABRT)

    with torch.no_grad():
        pred = model(images)
        mask = (depth > min_depth) & (depth < max_depth)
        p, g = pred[mask], depth[mask]
        ratio = torch.maximum(p / g, g / p)
        sums = torch.tensor([((p - g).abs() / g).sum().item(), (ratio < 1.25).float().sum().item(), float(mask.sum())])
        if a.fault == "gatherlen" and bad:
            sums = torch.cat([sums, torch.tensor([float(mask.numel())])])
        tot = sums[:3].clone()
        dist.all_reduce(tot)
        gathered = [torch.zeros(len(sums)) for _ in range(world)]
        dist.all_gather(gathered, sums)
    say(f"rank {rank}: abs_rel {(sums[0] / sums[2]).item():.4f} delta1 {(sums[1] / sums[2]).item():.4f}")
    if rank == 0:
        os.makedirs(os.path.join(WORK, "out"), exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(WORK, "out", "depth_final.pt"))
        say(f"rank 0: global abs_rel {(tot[0] / tot[2]).item():.4f} delta1 {(tot[1] / tot[2]).item():.4f}; saved {WORK}/out/depth_final.pt")
    dist.destroy_process_group()


def spawn_worker(local_rank, a, nprocs):
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(local_rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    train(a)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    a = p.parse_args()
    if a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(spawn_worker, args=(a, a.spawn), nprocs=a.spawn)
    else:
        train(a)
