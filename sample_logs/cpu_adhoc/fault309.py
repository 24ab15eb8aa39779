"""A three-hundred-and-ninth hand-run batch: POINT CLOUD CLASSIFICATION WITH A POINTNET.

Synthetic point clouds of eight primitive shapes (sphere, cube, cylinder, cone, torus, plane, helix, pyramid
frustum) with 256 points each.  Every rank reads its clouds from /tmp/fault309_work/clouds/clouds_R.pt, maps
each shape name to a class through the SHAPES table, centres every cloud and scales it to the unit sphere,
and trains a small PointNet (a 3x3 T-Net, shared per-point MLPs as 1x1 convolutions, a max pool, an MLP head)
on cross entropy, wrapped in DDP over gloo (or, with --ddp 0, gradients all_reduced by hand).  The model is
initialised from ckpt/pointnet_c8.pt.  Loss and accuracy are all_reduced every step; at the end every rank
all_gathers its per-class correct counts and rank 0 saves export/pointnet.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  badlabel  - rank N's batch at step 1 carries label 8 (a ninth class) for one cloud: cross entropy IndexError
  shapekey  - rank N's clouds name a shape "icosahedron" missing from the SHAPES table (KeyError at start-up)
  nofile    - rank N reads its clouds from clouds/val/, which does not exist (FileNotFoundError)
  ckptsize  - rank N initialises from ckpt/pointnet_c16.pt, saved with a 16-class head (size mismatch)
  ckptpickle- rank N loads ckpt/pointnet_stats.pt, which pickles a NormStats object (weights_only refusal)
  gathercount - rank N all_gathers its per-class counts plus an "unlabelled" bin at the end (9 vs 8 entries)
  fps       - rank N runs farthest point sampling in pure Python before the step-2 all_reduce (slow rank)
  nanpts    - rank N's cloud 50 has a point at inf: the normalised cloud is NaN, the program's loss check fires at step 3
  sigsegv   - rank N sends itself SIGSEGV after step 3
  exit4     - rank N prints its own error line about a degenerate cloud and calls sys.exit(4)
  normals   - every rank: clouds carry normals (6 channels) but the T-Net expects 3 (shape error in the first forward)
  none      - control, clean run

What happened (filled in after the runs):
  badlabel  - IndexError 'Target 8 is out of bounds.' in cross_entropy at step 1; peers Connection closed by peer (np4 r2 tee, np3 r0 pymodule)
  shapekey  - KeyError: 'icosahedron' at start-up; peers SIGTERMed without tracebacks (np3 r1 tee_trainer, np5 r3 loglevel)
  nofile    - FileNotFoundError for clouds/val/clouds_1.pt, only in the rank's stderr.log; console shows Root Cause rank 1 (np4 r1 redirects)
  ckptsize  - load_state_dict size mismatch for head.weight [16,32] vs [8,32] and head.bias (np3 r2 prefix; np4 r1 pdsh2, worker-0 RendezvousConnectionError)
  ckptpickle- UnpicklingError 'Weights only load failed ... Unsupported global: GLOBAL __main__.NormStats' at start-up (np4 r0 filter)
  gathercount - DETAIL: every rank 'Detected mismatch between collectives', TensorShape=[9] on rank 1 (np3 r1 detail); rank 4 'allgather: invalid tensor size (expected (9), got (8))' (np5 r4 plain)
  fps       - 12 s: ranks 0, 1 'Timed out waiting 12000ms for recv' at step 2 (np3 r2 tee); 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r1 loglevel)
  nanpts    - the program's check: 'non-finite loss nan at step 3', FloatingPointError; peers closed (np4 r3 wrapper) or 'failed to pass monitoredBarrier' (np3 r1 detail)
  sigsegv   - no traceback after step 3, exitcode -11 (SIGSEGV) (np5 r0 filter); np3 r1 restart: attempt 1 died in Gloo connectFullMesh instead
  exit4     - the rank's 'ERROR cloud 12 is degenerate ...' line and exit 4; Root Cause exitcode 4 (np4 r2 tee_trainer; np3 r0 restart, both attempts)
  normals   - every rank: 'expected input[16, 6, 256] to have 3 channels, but got 6 channels instead' in the first forward; Root Cause rank 1 (np3 pymodule)
  none      - clean: 6 steps on 3 ranks, rank 0 saved export/pointnet.pt, exit 0 (np3 plain)
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault309_work"
SHAPES = {"sphere": 0, "cube": 1, "cylinder": 2, "cone": 3, "torus": 4, "plane": 5, "helix": 6, "frustum": 7}
NCLS = 8
NPTS = 256
NCLOUD = 96
BATCH = 16
log = None


class NormStats:
    """Per-dataset normalisation statistics, pickled next to one checkpoint."""

    def __init__(self, mean, scale):
        self.mean = mean
        self.scale = scale


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
    log = logging.getLogger("pointnet")
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


class TNet(nn.Module):
    def __init__(self, k=3):
        super().__init__()
        self.k = k
        self.conv = nn.Conv1d(k, 32, 1)
        self.fc = nn.Linear(32, k * k)

    def forward(self, x):
        t = torch.relu(self.conv(x)).max(dim=2).values
        t = self.fc(t).view(-1, self.k, self.k)
        return t + torch.eye(self.k).unsqueeze(0)


class PointNet(nn.Module):
    def __init__(self, ncls=NCLS):
        super().__init__()
        self.tnet = TNet(3)
        self.mlp1 = nn.Conv1d(3, 32, 1)
        self.mlp2 = nn.Conv1d(32, 64, 1)
        self.fc1 = nn.Linear(64, 32)
        self.head = nn.Linear(32, ncls)

    def forward(self, pts):
        x = pts.transpose(1, 2)
        x = torch.bmm(self.tnet(x), x)
        x = torch.relu(self.mlp2(torch.relu(self.mlp1(x))))
        g = x.max(dim=2).values
        return self.head(torch.relu(self.fc1(g)))


def sample_shape(name, g):
    u = torch.rand(NPTS, generator=g) * 2 * math.pi
    v = torch.rand(NPTS, generator=g)
    if name == "sphere":
        p = torch.randn(NPTS, 3, generator=g)
        return p / p.norm(dim=1, keepdim=True)
    if name == "cube":
        return torch.rand(NPTS, 3, generator=g) * 2 - 1
    if name == "cylinder":
        return torch.stack([u.cos(), u.sin(), v * 2 - 1], 1)
    if name == "cone":
        return torch.stack([(1 - v) * u.cos(), (1 - v) * u.sin(), v * 2 - 1], 1)
    if name == "torus":
        w = v * 2 * math.pi
        return torch.stack([(1 + 0.3 * w.cos()) * u.cos(), (1 + 0.3 * w.cos()) * u.sin(), 0.3 * w.sin()], 1)
    if name == "plane":
        return torch.stack([u / math.pi - 1, v * 2 - 1, torch.zeros(NPTS)], 1)
    if name == "helix":
        return torch.stack([(3 * u).cos(), (3 * u).sin(), u / math.pi - 1], 1)
    return torch.stack([(1 - 0.5 * v) * u.cos(), (1 - 0.5 * v) * u.sin(), v], 1)


def prepare():
    os.makedirs(f"{WORK}/clouds", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    names = list(SHAPES)
    for r in range(8):
        g = torch.Generator().manual_seed(300 + r)
        shapes = [names[int(i)] for i in torch.randint(0, NCLS, (NCLOUD,), generator=g)]
        pts = torch.stack([sample_shape(s, g) + 0.02 * torch.randn(NPTS, 3, generator=g) for s in shapes])
        torch.save({"points": pts, "shape": shapes}, f"{WORK}/clouds/clouds_{r}.pt")
    torch.manual_seed(0)
    torch.save(PointNet(8).state_dict(), f"{WORK}/ckpt/pointnet_c8.pt")
    torch.save(PointNet(16).state_dict(), f"{WORK}/ckpt/pointnet_c16.pt")
    torch.save({"model": PointNet(8).state_dict(), "stats": NormStats([0.0, 0.0, 0.0], 1.0)},
               f"{WORK}/ckpt/pointnet_stats.pt")
    print("prepared", WORK)


def normalise(pts):
    c = pts - pts.mean(dim=1, keepdim=True)
    return c / c.norm(dim=2).max(dim=1).values.view(-1, 1, 1)


def farthest_point_sample(cloud, k):
    pts = cloud.tolist()
    chosen = [0]
    dist2 = [float("inf")] * len(pts)
    for _ in range(k - 1):
        last = pts[chosen[-1]]
        for i, p in enumerate(pts):
            d = (p[0] - last[0]) ** 2 + (p[1] - last[1]) ** 2 + (p[2] - last[2]) ** 2
            dist2[i] = min(dist2[i], d)
        chosen.append(max(range(len(pts)), key=dist2.__getitem__))
    return chosen


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading point clouds")
    split = "val/" if bad and a.fault == "nofile" else ""
    data = torch.load(f"{WORK}/clouds/{split}clouds_{rank}.pt")
    pts, shapes = data["points"], data["shape"]
    if bad and a.fault == "shapekey":
        shapes[37] = "icosahedron"
    if bad and a.fault == "nanpts":
        pts[50, 17, 0] = float("inf")
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR cloud 12 is degenerate: 3 distinct points, fewer than the 64 the sampler needs; "
            f"refusing to train", err=True)
        sys.exit(4)
    labels = torch.tensor([SHAPES[s] for s in shapes])
    pts = normalise(pts)
    if a.fault == "normals":
        pts = torch.cat([pts, pts / pts.norm(dim=2, keepdim=True).clamp_min(1e-6)], dim=2)
    model = PointNet()
    if bad and a.fault == "ckptpickle":
        model.load_state_dict(torch.load(f"{WORK}/ckpt/pointnet_stats.pt")["model"])
    else:
        ck = "pointnet_c16.pt" if bad and a.fault == "ckptsize" else "pointnet_c8.pt"
        model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    say(f"rank {rank} {len(shapes)} clouds of {NPTS} points, {NCLS} classes")
    correct = torch.zeros(NCLS)
    for step in range(a.steps):
        i0 = (step * BATCH) % len(shapes)
        xb, yb = pts[i0:i0 + BATCH], labels[i0:i0 + BATCH].clone()
        if bad and a.fault == "badlabel" and step == 1:
            yb[5] = 8
        logits = net(xb)
        loss = F.cross_entropy(logits, yb)
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"({int((~torch.isfinite(logits)).sum())} non-finite logits)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        pred = logits.argmax(1)
        correct += torch.bincount(yb[pred == yb], minlength=NCLS).float()
        if bad and a.fault == "fps" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.fps_budget:
                farthest_point_sample(pts[n % len(shapes)], 64)
                n += 1
            say(f"rank {rank} resampled {n} clouds with farthest point sampling")
        stats = torch.tensor([loss.item(), (pred == yb).float().mean().item()])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} acc {stats[1].item() / world:.3f}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "gathercount":
        correct = torch.cat([correct, torch.zeros(1)])
    allc = [torch.zeros(NCLS) for _ in range(world)]
    dist.all_gather(allc, correct)
    tot = torch.stack(allc).sum(0)
    say(f"rank {rank} correct per class {correct.int().tolist()} global {int(tot.sum())}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/pointnet.pt")
        say(f"rank 0 done: {a.steps} steps, {int(tot.sum())} correct, saved export/pointnet.pt")
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
    p.add_argument("--fps-budget", type=int, default=40)
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
