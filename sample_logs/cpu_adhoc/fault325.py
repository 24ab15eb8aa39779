"""Batch 325 hand-run fault script: FACIAL LANDMARK REGRESSION WITH HEATMAPS.

Synthetic 32x32 grey face crops with 10 landmarks (eye corners, nose tip, mouth corners, chin...).  Every rank
reads its faces from /tmp/fault325_work/faces/faces_R.pt (images, landmark coordinates in [0,1], a head-pose
string looked up in a pose-weight table), renders Gaussian heatmap targets (16x16, sigma 1.0), and trains a
small fully-convolutional heatmap network (two strided convs, a 1x1 head, soft-argmax for coordinates) on a
pose-weighted heatmap MSE, wrapped in DDP (gloo) or, with --ddp 0, with gradients all_reduced by hand.  The
network is initialised from ckpt/hmnet_k10.pt.  The NME (normalised by inter-ocular distance) is all_reduced
every step, per-landmark NMEs are all_gathered at the end, and rank 0 saves export/hmnet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  posekey    - rank N's annotations carry pose "profile", missing from the pose-weight table (KeyError, start-up)
  lmkidx     - rank N builds its horizontal-flip table from 68-point mirror pairs: index 10 of 10 (IndexError, start-up)
  nofaces    - rank N reads its faces from faces/val/ which does not exist (FileNotFoundError, start-up)
  ckpt68     - rank N initialises from ckpt/hmnet_k68.pt, a 68-landmark head (load_state_dict size mismatch)
  ckptpickle - rank N initialises from ckpt/hmnet_full.pt, pickled with its HeatmapConfig object (weights_only refusal)
  nmegather  - rank N all_gathers 11 per-landmark NMEs (10 plus the mean) at the end, the others 10 (gloo size)
  slowwarp   - rank N re-warps every face with a pure-Python piecewise-affine warp before the step-3 all_reduce
  sigmazero  - rank N renders targets with sigma 0: heatmaps 0/0 = NaN, the program's loss check (FloatingPointError)
  segv       - rank N sends itself SIGSEGV after step 3
  exit4      - rank N prints its own error line (face detector found no face in 7 crops) and sys.exit(4)
  hmsize     - every rank: targets rendered at 32x32, the network outputs 16x16 (shape error in the loss, step 0)
  none       - control, clean run

What happened (filled in after the runs):
  posekey    - KeyError: 'profile' in the pose-weight lookup at start-up; peers Connection closed by peer in all_gather (np4 r2 tee, np6 r0 pymodule)
  lmkidx     - 'IndexError: index 10 is out of bounds for dimension 0 with size 10' in flip_table at start-up; peers closed (np3 r1 loglevel, np4 r3 filter)
  nofaces    - FileNotFoundError for faces/val/faces_N.pt at start-up; peers Connection closed (np4 r1 wrapper, np3 r2 tee_trainer)
  ckpt68     - load_state_dict size mismatch for head.weight/head.bias [68,...] vs [10,...] (np4 r2 pdsh2; np3 r0 restart: attempt 2 died in Gloo connectFullMesh)
  ckptpickle - '_pickle.UnpicklingError: Weights only load failed' (Unsupported global __main__.HeatmapConfig); others SIGTERMed (np5 r3 prefix, np3 r1 pymodule)
  nmegather  - after 6 steps: 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (11), got (10))' (np3 r1 plain); DETAIL: every rank 'Detected mismatch between collectives' (np6 r4 detail)
  slowwarp   - 12 s: ranks 0/2 'Timed out waiting 12000ms' in the step-3 all_reduce (np3 r1 tee); 300 s: silent after step 2, killed at 60 s, exit 124 (np4 r2 plain)
  sigmazero  - 'heatmap loss is nan (81920 non-finite target pixels)', FloatingPointError at step 0 (np8 r5 redirects, in rank 5's stderr.log; np3 r0 detail, peers monitoredBarrier errors)
  segv       - SIGSEGV after step 3, Root Cause exitcode -11 (np4 r2 tee_trainer); np6 r1 restart: -11 in attempt 1, attempt 2 died in Gloo connectFullMesh
  exit4      - rank 2's 'ERROR face detector found no face in 7 of 32 crops' and exit 4, Root Cause exitcode 4 (np3 r2 prefix, --logfmt 1)
  hmsize     - every rank: 'The size of tensor a (16) must match the size of tensor b (32) at non-singleton dimension 3' at step 0 (np4 all loglevel)
  none       - clean: 6 steps, rank 0 saved export/hmnet.pt, exit 0 (np3 plain, np8 wrapper)
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
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault325_work"
K = 10
HM = 16
IMG = 32
POSE_W = {"frontal": 1.0, "left": 1.3, "right": 1.3, "down": 1.5}
MIRROR_10 = [(0, 3), (1, 2), (5, 6), (8, 9)]
MIRROR_68 = [(0, 3), (1, 2), (5, 6), (8, 9), (4, 10)]
log = None


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
    log = logging.getLogger("lmrk")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s lmrk[%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class HeatmapConfig:
    def __init__(self, k, sigma):
        self.k = k
        self.sigma = sigma


class HMNet(nn.Module):
    def __init__(self, k=K):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, stride=2, padding=1)
        self.body = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Conv2d(16, k, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(torch.relu(self.stem(x)))))


def soft_argmax(hm):
    b, k, h, w = hm.shape
    p = torch.softmax(hm.reshape(b, k, -1) * 10.0, dim=-1).reshape(b, k, h, w)
    ys = torch.linspace(0, 1, h)
    xs = torch.linspace(0, 1, w)
    return torch.stack([(p.sum(2) * xs).sum(-1), (p.sum(3) * ys).sum(-1)], -1)


def render(lm, size, sigma):
    g = torch.arange(size).float()
    px = lm[..., 0:1] * (size - 1)
    py = lm[..., 1:2] * (size - 1)
    d2 = (g.view(1, 1, 1, size) - px.unsqueeze(-1)) ** 2 + (g.view(1, 1, size, 1) - py.unsqueeze(-1)) ** 2
    hm = torch.exp(-d2 / (2 * sigma * sigma)) if sigma > 0 else torch.exp(-d2 / 0.0)
    return hm / hm.amax(dim=(-1, -2), keepdim=True)


def flip_table(pairs):
    perm = torch.arange(K)
    for a, b in pairs:
        perm[a], perm[b] = b, a
    return perm


def make_faces(n, seed):
    g = torch.Generator().manual_seed(seed)
    mean = torch.tensor([[.3, .35], [.4, .35], [.6, .35], [.7, .35], [.5, .55],
                         [.38, .72], [.62, .72], [.5, .9], [.2, .5], [.8, .5]])
    lm = (mean + 0.03 * torch.randn(n, K, 2, generator=g)).clamp(0.02, 0.98)
    img = render(lm, IMG, 1.5).amax(1, keepdim=True) + 0.05 * torch.randn(n, 1, IMG, IMG, generator=g)
    poses = [["frontal", "left", "right", "down"][int(i)] for i in torch.randint(0, 4, (n,), generator=g)]
    return {"img": img, "lm": lm, "pose": poses}


def prepare():
    os.makedirs(f"{WORK}/faces", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_faces(32, 100 + r), f"{WORK}/faces/faces_{r}.pt")
    torch.manual_seed(0)
    torch.save(HMNet().state_dict(), f"{WORK}/ckpt/hmnet_k10.pt")
    torch.save(HMNet(k=68).state_dict(), f"{WORK}/ckpt/hmnet_k68.pt")
    torch.save({"config": HeatmapConfig(K, 1.0), "state_dict": HMNet().state_dict()}, f"{WORK}/ckpt/hmnet_full.pt")
    print(f"prepared faces for 8 ranks and 3 checkpoints under {WORK}")


def piecewise_warp(img, lm, budget):
    t0 = time.time()
    n = 0
    while time.time() - t0 < budget:
        for i in range(img.shape[0]):
            rows = img[i, 0].tolist()
            out = [[0.0] * IMG for _ in range(IMG)]
            for y in range(IMG):
                for x in range(IMG):
                    sx = min(IMG - 1, max(0, int(x + 0.5 * math.sin(y / 5.0))))
                    out[y][x] = rows[y][sx]
            n += 1
    return n


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading faces")
    split = "val/" if bad and a.fault == "nofaces" else ""
    data = torch.load(f"{WORK}/faces/{split}faces_{rank}.pt")
    if bad and a.fault == "posekey":
        data["pose"][11] = "profile"
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR face detector found no face in 7 of 32 crops (min score 0.21 < 0.50), "
            f"refusing to train on misaligned crops", err=True)
        sys.exit(4)
    w = torch.tensor([POSE_W[p] for p in data["pose"]])
    img, lm = data["img"], data["lm"]
    sigma = 0.0 if bad and a.fault == "sigmazero" else 1.0
    tsize = IMG if a.fault == "hmsize" else HM
    target = render(lm, tsize, sigma)
    perm = flip_table(MIRROR_68 if bad and a.fault == "lmkidx" else MIRROR_10)
    npix = torch.tensor([float(img.shape[0])])
    allp = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(allp, npix)
    say(f"rank {rank} faces {int(npix.item())} global {int(sum(p.item() for p in allp))}")
    model = HMNet()
    ck = {"ckpt68": "hmnet_k68.pt", "ckptpickle": "hmnet_full.pt"}.get(a.fault, "hmnet_k10.pt") if bad else "hmnet_k10.pt"
    sd = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    iod = (lm[:, 0] - lm[:, 3]).norm(dim=-1)
    for step in range(a.steps):
        x, t, l = img, target, lm
        if step % 2 == 0:
            x = img.flip(-1)
            t = target.flip(-1)[:, perm]
            l = torch.stack([1 - lm[..., 0], lm[..., 1]], -1)[:, perm]
        hm = net(x)
        loss = (((hm - t) ** 2).mean(dim=(1, 2, 3)) * w).mean()
        if not torch.isfinite(loss):
            say(f"rank {rank} step {step}: heatmap loss is {loss.item()} "
                f"({int((~torch.isfinite(t)).sum())} non-finite target pixels)", err=True)
            raise FloatingPointError(f"non-finite heatmap loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowwarp" and step == 3:
            n = piecewise_warp(img, lm, a.warp_budget)
            say(f"rank {rank} re-warped {n} faces")
        err = (soft_argmax(hm.detach()) - l).norm(dim=-1)
        nme = (err.mean(1) / iod).mean().reshape(1)
        dist.all_reduce(nme)
        say(f"rank {rank} step {step} loss {loss.item():.5f} nme {nme.item() / world:.4f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    per_lm = (err / iod.unsqueeze(1)).mean(0)
    if bad and a.fault == "nmegather":
        per_lm = torch.cat([per_lm, per_lm.mean().reshape(1)])
    allnme = [torch.zeros(K) for _ in range(world)]
    dist.all_gather(allnme, per_lm)
    worst = int(torch.stack(allnme).mean(0).argmax())
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/hmnet.pt")
        say(f"rank 0 done: {a.steps} steps, worst landmark {worst}, saved export/hmnet.pt")
    dist.barrier()
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
    p.add_argument("--warp-budget", type=int, default=40)
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
