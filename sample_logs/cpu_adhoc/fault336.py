"""A three-hundred-and-thirty-sixth hand-run batch: LIDAR POINT CLOUD SEMANTIC SEGMENTATION (VOXELISED).

Synthetic LiDAR sweeps: every point has x, y, z (metres, sensor frame) and a return intensity, and carries a
raw SemanticKITTI-style label id that a learning map turns into one of 20 training classes.  Every rank reads
its sweeps from /tmp/fault336_work/scans/seq00/scans_R.pt, crops them to a 51.2 m x 51.2 m x 6.4 m box,
voxelises them on a 0.4 m grid (voxel features are point means gathered with index_add_), and trains a small
voxel network (a point MLP, a voxel MLP, a per-point head reading its voxel's feature) on a cross-entropy
loss, wrapped in DDP (gloo) or, with --ddp 0, with gradients all_reduced by hand.  The model starts from
ckpt/voxseg_c20.pt.  Per step the loss and the point accuracy are all_reduced; at the end every rank
all_gathers its 20-class point histogram and rank 0 saves export/voxseg.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults:
  labelmap   - rank N's sweeps contain raw label 257 (a moving-object id) missing from the learning map (KeyError)
  voxidx     - rank N stops cropping at step 3: a far point gets voxel row 128 of a 128-row occupancy grid (IndexError)
  noscan     - rank N reads its sweeps from scans/seq08/ which does not exist (FileNotFoundError, start-up)
  ckptcls    - rank N initialises from ckpt/voxseg_c19.pt, saved with a 19-class head (size mismatch)
  ckptpickle - rank N initialises from ckpt/voxseg_full.pt, pickled with its VoxelConfig (weights_only refusal)
  histgather - rank N all_gathers its class histogram with an extra "ignore" bin at the end (21 vs 20 entries)
  slowvox    - rank N re-voxelises its sweep point by point in Python before the step-2 all_reduce
  intnan     - rank N's sweep 2 has dropout returns of intensity 0; log-intensity -inf, the program's loss check
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit4      - rank N finds no extrinsics in its calibration, prints its own ERROR line and calls sys.exit(4)
  chanbug    - every rank: point features get a 5th channel (ring id), the point MLP expects 4 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  labelmap   - KeyError: 257 in map_labels at start-up; peers SIGTERMed (np4 r2 tee, np6 r0 prefix)
  voxidx     - step 3: IndexError 'index 130/137 is out of bounds for dimension 0 with size 128'; peers Connection closed (np3 r1 loglevel, np8 r5 filter)
  noscan     - FileNotFoundError for scans/seq08/scans_N.pt at start-up (np4 r3 redirects: only in the log dir; np3 r1 pymodule)
  ckptcls    - load_state_dict size mismatch for head.weight [19, 64] vs [20, 64] and head.bias (np4 r1 pdsh2, np3 r2 tee_trainer)
  ckptpickle - _pickle.UnpicklingError 'Weights only load failed' for voxseg_full.pt at start-up (np5 r0 wrapper)
  histgather - DETAIL: every rank 'Detected mismatch between collectives' (TensorShape [21] vs [20]) (np3 r1); 'allgather: invalid tensor size' (np6 r4 tee)
  slowvox    - 12 s: peers 'Timed out waiting 12000ms for recv', rank N SIGTERMed (np3 r2 plain); 300 s: silent, killed at 60 s, exit 124 (np4 r1 wrapper)
  intnan     - step 2: 'loss is nan (29 non-finite feature values ...)' then FloatingPointError (np4 r3 detail: monitoredBarrier; np3 r0 pymodule)
  sigsegv    - after step 3 exitcode -11 (SIGSEGV), no traceback (np6 r2 loglevel); restart: attempt 1 Gloo connectFullMesh refused (np3 r1)
  exit4      - rank N's ERROR line about missing Tr extrinsics, exit 4; Root Cause exitcode 4, torchrun exit 1 (np4 r2 tee_trainer)
  chanbug    - every rank 'mat1 and mat2 shapes cannot be multiplied (Nx5 and 4x32)'; Root Cause rank 3 by timing (np8 plain)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/voxseg.pt, exit 0 (np3 plain)
"""
import argparse
import dataclasses
import logging
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

WORK = "/tmp/fault336_work"
LEARNING_MAP = {0: 0, 1: 0, 10: 1, 11: 2, 15: 3, 18: 4, 20: 5, 30: 6, 31: 7, 32: 8, 40: 9, 44: 10,
                48: 11, 49: 12, 50: 13, 51: 14, 70: 15, 71: 16, 72: 17, 80: 18, 81: 19}
NCLS = 20
VOX = 0.4
GRID = 128
CROP = (25.6, 25.6, 3.2)
log = None


@dataclasses.dataclass
class VoxelConfig:
    voxel: float = VOX
    grid: int = GRID
    ncls: int = NCLS


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
    log = logging.getLogger("voxseg")
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


class VoxSeg(nn.Module):
    def __init__(self, cin=4, dim=32, ncls=NCLS):
        super().__init__()
        self.point_mlp = nn.Sequential(nn.Linear(cin, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.voxel_mlp = nn.Sequential(nn.Linear(dim, dim), nn.ReLU())
        self.head = nn.Linear(2 * dim, ncls)

    def forward(self, feats, vidx, nvox):
        p = torch.relu(self.point_mlp(feats))
        s = torch.zeros(nvox, p.shape[1]).index_add(0, vidx, p)
        c = torch.zeros(nvox).index_add(0, vidx, torch.ones(len(vidx))).clamp(min=1)
        v = self.voxel_mlp(s / c.unsqueeze(1))
        return self.head(torch.cat([p, v[vidx]], 1))


def make_sweeps(n, seed):
    g = torch.Generator().manual_seed(seed)
    raw = list(LEARNING_MAP)
    sweeps = []
    for _ in range(n):
        npts = 1500
        xy = (torch.rand(npts, 2, generator=g) - 0.5) * 60.0
        z = torch.randn(npts, 1, generator=g) * 1.0 - 0.5
        inten = torch.rand(npts, 1, generator=g) * 0.9 + 0.05
        lab = torch.tensor([raw[int(i)] for i in torch.randint(0, len(raw), (npts,), generator=g)])
        sweeps.append({"points": torch.cat([xy, z, inten], 1), "labels": lab})
    return sweeps


def prepare():
    os.makedirs(f"{WORK}/scans/seq00", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_sweeps(6, 300 + r), f"{WORK}/scans/seq00/scans_{r}.pt")
    torch.manual_seed(0)
    torch.save(VoxSeg().state_dict(), f"{WORK}/ckpt/voxseg_c20.pt")
    torch.save(VoxSeg(ncls=19).state_dict(), f"{WORK}/ckpt/voxseg_c19.pt")
    torch.save({"config": VoxelConfig(), "model": VoxSeg().state_dict()}, f"{WORK}/ckpt/voxseg_full.pt")
    print("prepared", WORK)


def map_labels(raw):
    return torch.tensor([LEARNING_MAP[int(v)] for v in raw.tolist()])


def voxelise(pts, crop=True):
    if crop:
        keep = (pts[:, 0].abs() < CROP[0]) & (pts[:, 1].abs() < CROP[1]) & (pts[:, 2].abs() < CROP[2])
    else:
        keep = torch.ones(len(pts), dtype=torch.bool)
    coords = torch.floor((pts[:, :3] + torch.tensor(CROP)) / VOX).long()
    return keep, coords


def occupancy(coords):
    grid = torch.zeros(GRID, GRID, dtype=torch.long)
    for i, j in coords[:, :2].tolist():
        grid[i, j] += 1
    return grid


def slow_voxelise(pts, budget):
    t0 = time.time()
    n = 0
    while time.time() - t0 < budget:
        cells = {}
        for p in pts.tolist():
            key = tuple(int((p[k] + CROP[k]) // VOX) for k in range(3))
            cells.setdefault(key, []).append(p[3])
        n += len(cells)
    return n


def features(pts, a, bad, step):
    inten = pts[:, 3:4]
    if bad and a.fault == "intnan" and step == 2:
        inten = inten.clone()
        inten[::37] = 0.0
    rng = pts[:, :3].norm(dim=1, keepdim=True) / 30.0
    f = torch.cat([pts[:, :2] / 25.6, pts[:, 2:3] / 3.2, torch.log(inten) + rng * 0.0], 1)
    if a.fault == "chanbug":
        ring = torch.floor((pts[:, 2:3] + 3.2) / 0.1) / 64.0
        f = torch.cat([f, ring], 1)
    return f


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(4321 + rank)
    say(f"rank {rank}/{world} up, loading sweeps")
    if bad and a.fault == "exit4":
        say(f"rank {rank}: ERROR calib/seq00/calib.txt has no Tr (velodyne->camera) extrinsics; "
            f"refusing to voxelise uncalibrated sweeps", err=True)
        sys.exit(4)
    seq = "seq08" if bad and a.fault == "noscan" else "seq00"
    sweeps = torch.load(f"{WORK}/scans/{seq}/scans_{rank}.pt")
    if bad and a.fault == "labelmap":
        sweeps[0]["labels"][411] = 257
    labels = [map_labels(s["labels"]) for s in sweeps]
    model = VoxSeg()
    ck = {"ckptcls": "voxseg_c19.pt", "ckptpickle": "voxseg_full.pt"}.get(a.fault if bad else "", "voxseg_c20.pt")
    state = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(state)
    net = DDP(model) if a.ddp else model
    if not a.ddp:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    hist = torch.zeros(NCLS)
    for step in range(a.steps):
        sw = sweeps[step % len(sweeps)]
        lab = labels[step % len(sweeps)]
        crop = not (bad and a.fault == "voxidx" and step == 3)
        keep, coords = voxelise(sw["points"], crop)
        pts, lab, coords = sw["points"][keep], lab[keep], coords[keep]
        occ = occupancy(coords)
        uniq, vidx = torch.unique(coords, dim=0, return_inverse=True)
        feats = features(pts, a, bad, step)
        logits = net(feats, vidx, len(uniq))
        loss = F.cross_entropy(logits, lab)
        if not torch.isfinite(loss):
            nf = int((~torch.isfinite(feats)).sum())
            say(f"rank {rank} step {step}: loss is {loss.item()} ({nf} non-finite feature values in "
                f"{len(feats)} points, {len(uniq)} voxels)", err=True)
            raise FloatingPointError(f"non-finite loss on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slowvox" and step == 2:
            n = slow_voxelise(sw["points"], a.slow_budget)
            say(f"rank {rank} exact re-voxelisation: {n} voxels")
        hist += torch.bincount(lab, minlength=NCLS).float()
        acc = (logits.argmax(1) == lab).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} acc {stats[1].item() / world:.4f} "
            f"voxels {len(uniq)} occ_max {int(occ.max())}")
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "histgather":
        hist = torch.cat([hist, torch.tensor([float((~keep).sum())])])
    allh = [torch.zeros(NCLS) for _ in range(world)]
    dist.all_gather(allh, hist)
    tot = torch.stack(allh).sum(0)
    say(f"rank {rank} points {int(hist.sum())} global {int(tot.sum())} rarest class {int(tot.argmin())}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/voxseg.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/voxseg.pt")
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
    p.add_argument("--slow-budget", type=int, default=45)
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
