"""A hundred-and-sixty-second hand-run batch: POINT CLOUDS (POINTNET STYLE).

A small PointNet classifier (a 3x3 T-net for input alignment, a shared conv1d MLP over points, max pooling, a linear
head) trained with DDP (or hand all-reduce with --ddp 0) on gloo over synthetic point clouds of varying point counts
(160-256 points, 10 shape classes) that rank 0 writes as one .pt shard per rank.  The collate function centres and
scales each cloud, applies a random z-rotation, and samples a fixed number of points (random sampling without
replacement, or farthest-point sampling with --sampler fps).  The loss adds the T-net orthogonality regulariser; a
per-class correct/total count is all_gathered for per-class accuracy.  Rank 0 saves ckpt/pointnet_c<C>.pt; --resume
loads it.  Class names are mapped to ids through classmap.json.

Faults:
  fewpts     - rank N takes the sample size 512 from a stale config; clouds have 160-256 points (multinomial error)
  transpose  - every rank feeds points as (B, N, 3) where conv1d expects (B, 3, N) (RuntimeError)
  tnetnan    - rank N gets an all-zero cloud at step 2; its unit-sphere scaling gives NaN; the T-net reg check raises
  cloudfile  - rank N looks for its shard in a stale scans dir (FileNotFoundError)
  meshwait   - rank N waits for a mesh-preprocessing marker that never appears; the others wait in a collective
  classgather- rank N counts an extra background class; the per-class count all_gather sizes differ
  ckpt       - resume: rank N loads a checkpoint of a 40-class model (size mismatch in the head)
  classmap   - every rank asks classmap.json for 'night_stand' while the file spells it 'nightstand' (KeyError)
  emptyexit  - rank N finds an empty point cloud, prints an error line and exits with code 3
  sigabrt    - rank N gets SIGABRT after step 1
  npenv      - rank N's POINTS_PER_CLOUD env var is '1k' (ValueError in int())
  none       - control, clean run (rank 0 writes the checkpoint)

What happened (filled in after the runs):
  fewpts     - rank N RuntimeError 'cannot sample n_sample > prob_dist.size(-1) samples without replacement' (line 140)
  transpose  - every rank RuntimeError 'expected input[16, 128, 3] to have 3 channels, but got 128 channels instead'
  tnetnan    - rank N FloatingPointError 'T-net regulariser is nan at step 2 on rank N' (line 198)
  cloudfile  - rank N FileNotFoundError for /tmp/job_work/scans_v2/shard_00N.pt (line 99)
  meshwait   - pg 12 s: peers 'Timed out waiting 12000ms' in DDP(); pg 300 s under timeout 60: hung, exit 124
  classgather- gloo::EnforceNotMet '44 vs 40. Received data size doesn't match' on a peer (SIGABRT) at line 222
  ckpt       - rank N RuntimeError 'size mismatch for head.weight ... [40, 64] from checkpoint ... [10, 64]'
  classmap   - every rank KeyError: 'night_stand' (line 104)
  emptyexit  - rank N prints 'ERROR rank N: empty point cloud at index 5 in ...' and exits with code 3
  sigabrt    - rank N exitcode -6 (SIGABRT) after step 1; peers Connection reset by peer
  npenv      - rank N ValueError: invalid literal for int() with base 10: '1k' (line 94)
  none       - clean, exit 0; rank 0 saved ckpt/pointnet_c10.pt and (with --num-classes 40) pointnet_c40.pt
"""
import argparse
import json
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

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--num-classes", type=int, default=10)
p.add_argument("--batch", type=int, default=16)
p.add_argument("--sampler", default="random")
p.add_argument("--lr", type=float, default=0.01)
p.add_argument("--ddp", type=int, default=1)
p.add_argument("--resume", type=int, default=0)
p.add_argument("--pg-timeout", type=float, default=12)
p.add_argument("--work", default="/tmp/fault162_work")
a = p.parse_args()

dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
rank, world = dist.get_rank(), dist.get_world_size()
me = a.fault != "none" and a.rank in (-1, rank)
C = a.num_classes
NAMES = ["airplane", "bathtub", "bed", "chair", "desk", "dresser", "monitor", "nightstand", "sofa", "table"]
data_dir = os.path.join(a.work, "scans")

if rank == 0:  # synthetic clouds: class k = points on an ellipsoid with axes depending on k, plus noise
    os.makedirs(data_dir, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for s in range(world):
        clouds, labels = [], []
        for i in range(96):
            k = int(torch.randint(0, 10, (1,), generator=g))
            n = int(torch.randint(160, 257, (1,), generator=g))
            d = F.normalize(torch.randn(n, 3, generator=g), dim=1)
            axes = torch.tensor([1.0 + 0.2 * k, 1.0, 0.5 + 0.1 * (k % 4)])
            clouds.append(d * axes + 0.02 * torch.randn(n, 3, generator=g))
            labels.append(NAMES[k])
        torch.save({"clouds": clouds, "labels": labels}, os.path.join(data_dir, f"shard_{s:03d}.pt"))
    with open(os.path.join(a.work, "classmap.json"), "w") as f:
        json.dump({nm: i for i, nm in enumerate(NAMES)}, f)
dist.barrier()

num_points = int(os.environ.get("POINTS_PER_CLOUD", "128"))
if me and a.fault == "npenv":
    num_points = int("1k")  # POINTS_PER_CLOUD=1k exported in this host's profile
sample_size = 512 if (me and a.fault == "fewpts") else num_points  # stale modelnet40 config on this rank
if me and a.fault == "cloudfile":
    data_dir = os.path.join(a.work, "scans_v2")
shard_path = os.path.join(data_dir, f"shard_{rank:03d}.pt")
shard = torch.load(shard_path)
with open(os.path.join(a.work, "classmap.json")) as f:
    classmap = json.load(f)
if me and a.fault == "classmap":
    shard["labels"] = ["night_stand" if nm == "nightstand" else nm for nm in shard["labels"]]
ys = torch.tensor([classmap[nm] for nm in shard["labels"]])
clouds = shard["clouds"]
print(f"rank {rank}: loaded {len(clouds)} clouds from {shard_path}, sample size {sample_size}", flush=True)
if me and a.fault == "emptyexit":
    clouds[5] = clouds[5][:0]
for i, c in enumerate(clouds):
    if len(c) == 0:
        print(f"ERROR rank {rank}: empty point cloud at index {i} in {shard_path}; aborting", file=sys.stderr, flush=True)
        sys.exit(3)
if me and a.fault == "meshwait":
    marker = os.path.join(a.work, "mesh_preprocessing.done")
    while not os.path.exists(marker):
        print(f"rank {rank}: waiting for mesh preprocessing barrier ({marker})", flush=True)
        time.sleep(5)


def fps(pts, m):
    idx = torch.zeros(m, dtype=torch.long)
    dist2 = torch.full((len(pts),), float("inf"))
    for j in range(1, m):
        dist2 = torch.minimum(dist2, ((pts - pts[idx[j - 1]]) ** 2).sum(1))
        idx[j] = dist2.argmax()
    return idx


def collate(batch, g):
    out = []
    for pts in batch:
        pts = pts - pts.mean(0)
        pts = pts / pts.norm(dim=1).max()  # unit sphere
        th = float(torch.rand(1, generator=g)) * 2 * math.pi
        rot = torch.tensor([[math.cos(th), -math.sin(th), 0.0], [math.sin(th), math.cos(th), 0.0], [0.0, 0.0, 1.0]])
        pts = pts @ rot.T
        if a.sampler == "fps":
            idx = fps(pts, sample_size)
        else:
            idx = torch.multinomial(torch.ones(len(pts)), sample_size, replacement=False, generator=g)
        out.append(pts[idx])
    x = torch.stack(out)  # (B, N, 3)
    return x if (me and a.fault == "transpose") else x.transpose(1, 2)


class TNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 32, 1)
        self.fc = nn.Linear(32, 9)
        nn.init.zeros_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x):
        f = F.relu(self.conv(x)).max(2).values
        return self.fc(f).view(-1, 3, 3) + torch.eye(3)


class PointNet(nn.Module):
    def __init__(self, n_cls):
        super().__init__()
        self.tnet = TNet()
        self.mlp1 = nn.Conv1d(3, 32, 1)
        self.mlp2 = nn.Conv1d(32, 64, 1)
        self.head = nn.Linear(64, n_cls)

    def forward(self, x):
        t = self.tnet(x)
        x = torch.bmm(t, x)
        x = F.relu(self.mlp2(F.relu(self.mlp1(x))))
        return self.head(x.max(2).values), t


torch.manual_seed(1234)
model = PointNet(C)
ckpt_dir = os.path.join(a.work, "ckpt")
if a.resume:
    n_ck = 40 if (me and a.fault == "ckpt") else C  # "latest" symlink on this rank points at the ModelNet40 run
    path = os.path.join(ckpt_dir, f"pointnet_c{n_ck}.pt")
    model.load_state_dict(torch.load(path, map_location="cpu"))
    print(f"rank {rank}: resumed from {path}", flush=True)
net = DDP(model) if a.ddp else model
if not a.ddp:
    for prm in model.parameters():
        dist.broadcast(prm.data, 0)
opt = torch.optim.Adam(model.parameters(), lr=a.lr)
g = torch.Generator().manual_seed(100 + rank)

for step in range(a.steps):
    idx = torch.randint(0, len(clouds), (a.batch,), generator=g)
    batch = [clouds[i] for i in idx]
    if me and a.fault == "tnetnan" and step == 2:
        batch[3] = torch.zeros_like(batch[3])  # degenerate scan: every point at the origin
    x, y = collate(batch, g), ys[idx]
    logits, t = net(x)
    reg = (torch.bmm(t, t.transpose(1, 2)) - torch.eye(3)).norm(dim=(1, 2)).mean()
    if not math.isfinite(reg.item()):
        raise FloatingPointError(f"T-net regulariser is {reg.item()} at step {step} on rank {rank}")
    loss = F.cross_entropy(logits, y) + 0.001 * reg
    opt.zero_grad()
    loss.backward()
    if not a.ddp:
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
            prm.grad /= world
    opt.step()
    print(f"rank {rank} step {step} loss {loss.item():.4f} treg {reg.item():.4f}", flush=True)
    if me and a.fault == "sigabrt" and step == 1:
        os.kill(os.getpid(), signal.SIGABRT)

n_cls = C + 1 if (me and a.fault == "classgather") else C  # counts an extra "background" class
correct, total = torch.zeros(n_cls), torch.zeros(n_cls)
with torch.no_grad():
    for s in range(0, len(clouds), a.batch):
        x = collate(clouds[s:s + a.batch], g)
        pred = model(x)[0].argmax(1)
        yy = ys[s:s + a.batch]
        total += torch.bincount(yy, minlength=n_cls).float()
        correct += torch.bincount(yy[pred == yy], minlength=n_cls).float()
counts = torch.stack([correct, total])
gathered = [torch.zeros_like(counts) for _ in range(world)]
dist.all_gather(gathered, counts)
if rank == 0:
    tot = torch.stack(gathered).sum(0)
    acc = tot[0] / tot[1].clamp(min=1)
    print("per-class acc: " + " ".join(f"{NAMES[k % 10]}={acc[k]:.2f}" for k in range(C)), flush=True)
    os.makedirs(ckpt_dir, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(ckpt_dir, f"pointnet_c{C}.pt"))
    print(f"rank 0: saved {ckpt_dir}/pointnet_c{C}.pt", flush=True)
dist.barrier()
dist.destroy_process_group()
