"""A two-hundred-and-sixty-second hand-run batch: LANE DETECTION WITH ROW-WISE CLASSIFICATION.

Synthetic road images (1x32x64) with up to four painted lane polylines; a small CNN predicts, for each of
8 row anchors and each lane, the column cell (16 cells) of the lane or an extra "absent" class.  Every rank
reads its annotations from /tmp/fault262_work/data/annot_R.json (written on first use), draws its images,
augments them by road type, and trains with a cross-entropy per anchor (DDP over gloo, or a hand-written
gradient all_reduce with --ddp 0).  The CNN starts from ckpt/lane_cnn_init.pt (written by rank 0).  At the
end each rank measures lane accuracy on a validation set, all_reduces it, and all_gathers per-lane hit counts.

Faults:
  colcell  - rank N grids lane x with round() and no clamp: column cell 17 beyond the 17 classes (IndexError)
  anchors  - every rank: config num_anchors 10 while the head predicts 8 anchors (shape error in view)
  hitcount - rank N all_gathers per-lane hit counts for 5 lanes instead of 4 (gloo size mismatch)
  noannot  - rank N reads data/annotations_v2/annot_N.json which does not exist (FileNotFoundError)
  roadtype - rank N's annotations include road type "tunnel", missing from the augmentation table (KeyError)
  nanexp   - rank N's softmax column expectation over a lane with no visible anchors: NaN, the program's check
  ckpt     - rank N initialises from ckpt/lane_cnn_init_3lanes.pt, saved with 3 lanes (size mismatch)
  late     - rank N redraws its validation set at full resolution for --stall s before the accuracy all_reduce
  sigbus   - rank N sends itself SIGBUS after step 2
  exit5    - rank N prints its own error line about a broken polyline and calls os._exit(5)
  none     - control, clean run

What happened (filled in after the runs):
  colcell  - rank N: IndexError Target 21 (np3 r1) / 19 (np4 r2) is out of bounds in cross_entropy at step 0; peers closed
  anchors  - every rank: RuntimeError shape '[8, 17, 10, 4]' is invalid for input of size 4352
  hitcount - rank N: RuntimeError ProcessGroupGloo::allgather invalid tensor size (expected (5), got (4))
  noannot  - rank N: FileNotFoundError .../data/annotations_v2/annot_N.json before DDP; peers SIGTERMed
  roadtype - rank N: KeyError 'tunnel' in draw() before DDP; peers SIGTERMed
  nanexp   - rank N: FloatingPointError mean lane column is not finite ([nan, ...]) at step 1
  ckpt     - rank N: RuntimeError size mismatch for head.weight [408, 512] vs [544, 512]
  late     - rank N slept: peers gloo Timed out waiting 12000ms; with PG 300 s killed by timeout (exit 124)
  sigbus   - rank N: exitcode -7 (SIGBUS) after step 2; peers Connection reset by peer
  exit5    - rank N logs its ERROR polyline line, exitcode 5; peers Connection reset by peer
  none     - clean, exit 0, rank 0 prints lane accuracy and hits per lane
"""
import argparse
import json
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

WORK = "/tmp/fault262_work"
H, W = 32, 64
AUG = {"highway": (1.0, 0.05), "urban": (0.8, 0.10), "rural": (0.6, 0.15)}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lanes", type=int, default=4)
    p.add_argument("--anchors", type=int, default=8)
    p.add_argument("--cells", type=int, default=16)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=40.0)
    p.add_argument("--ddp", type=int, default=1)
    return p.parse_args()


class LaneNet(nn.Module):
    def __init__(self, lanes, anchors, cells):
        super().__init__()
        self.lanes, self.anchors, self.cells = lanes, anchors, cells
        self.body = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d((4, 8)))
        self.head = nn.Linear(16 * 4 * 8, (cells + 1) * anchors * lanes)

    def forward(self, x, anchors):
        z = self.head(self.body(x).flatten(1))
        return z.view(x.shape[0], self.cells + 1, anchors, self.lanes)


def make_annotations(path, n, lanes, roads, seed):
    rng = np.random.default_rng(seed)
    items = []
    for i in range(n):
        lane_pts = []
        for l in range(lanes):
            if rng.random() < 0.15:
                lane_pts.append(None)
                continue
            x0 = (l + 0.5) * W / lanes + rng.normal(0, 2)
            lane_pts.append([[float(x0 + rng.normal(0, 3)), 0.0], [float(x0), float(H - 1)]])
        items.append({"road": str(rng.choice(roads)), "lanes": lane_pts})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(items, f)


def draw(item, a, anchor_rows, grid_fn):
    img = np.zeros((H, W), dtype=np.float32)
    target = np.full((len(anchor_rows), a.lanes), a.cells, dtype=np.int64)
    gain, noise = AUG[item["road"]]
    for l, pts in enumerate(item["lanes"]):
        if pts is None:
            continue
        (xt, yt), (xb, yb) = pts
        for y in range(H):
            x = int(round(xt + (xb - xt) * (y - yt) / (yb - yt)))
            if 0 <= x < W:
                img[y, x] = gain
        for k, y in enumerate(anchor_rows):
            x = xt + (xb - xt) * (y - yt) / (yb - yt)
            if 0 <= x < W:
                target[k, l] = grid_fn(x)
    img += np.random.default_rng(len(item["lanes"])).normal(0, noise, img.shape).astype(np.float32)
    return torch.from_numpy(img)[None], torch.from_numpy(target)


def main():
    a = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    me = a.fault != "none" and (a.rank == -1 or a.rank == rank)
    torch.manual_seed(0)
    anchors = 10 if (a.fault == "anchors" and me) else a.anchors
    anchor_rows = [int(r) for r in np.linspace(8, H - 1, anchors)]
    if rank == 0:
        os.makedirs(f"{WORK}/ckpt", exist_ok=True)
        torch.save(LaneNet(a.lanes, a.anchors, a.cells).state_dict(), f"{WORK}/ckpt/lane_cnn_init.pt")
        torch.save(LaneNet(3, a.anchors, a.cells).state_dict(), f"{WORK}/ckpt/lane_cnn_init_3lanes.pt")
    dist.barrier()
    roads = list(AUG) + (["tunnel"] if (a.fault == "roadtype" and me) else [])
    annot = f"{WORK}/data/annot_{rank}.json"
    make_annotations(annot, 64, a.lanes, roads, seed=100 + rank)
    if a.fault == "noannot" and me:
        annot = f"{WORK}/data/annotations_v2/annot_{rank}.json"
    with open(annot) as f:
        items = json.load(f)
    if a.fault == "colcell" and me:
        grid = lambda x: int(x * a.cells / (W // 2))  # noqa: E731  (cell width of the half-width crop)
    else:
        grid = lambda x: min(int(x / W * a.cells), a.cells - 1)  # noqa: E731
    data = [draw(it, a, anchor_rows, grid) for it in items]
    print(f"rank {rank}: {len(data)} road images, {anchors} row anchors, {a.lanes} lanes x {a.cells} cells", flush=True)

    model = LaneNet(a.lanes, a.anchors, a.cells)
    ck = "lane_cnn_init_3lanes.pt" if (a.fault == "ckpt" and me) else "lane_cnn_init.pt"
    model.load_state_dict(torch.load(f"{WORK}/ckpt/{ck}"))
    net = DDP(model) if a.ddp else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cols = torch.arange(a.cells, dtype=torch.float32)
    for step in range(a.steps):
        idx = [(step * a.batch + i) % len(data) for i in range(a.batch)]
        x = torch.stack([data[i][0] for i in idx])
        y = torch.stack([data[i][1] for i in idx])
        out = net(x, anchors)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        with torch.no_grad():
            prob = out[:, :a.cells].softmax(1)
            vis = y < a.cells
            if a.fault == "nanexp" and me and step == 1:
                vis[:, :, 0] = False
            pos = (prob * cols[None, :, None, None]).sum(1)
            lane_pos = (pos * vis).sum((0, 1)) / vis.sum((0, 1))
            if a.fault == "nanexp" and me:
                pass
            else:
                lane_pos = torch.where(vis.sum((0, 1)) > 0, lane_pos, torch.zeros_like(lane_pos))
            if not torch.isfinite(lane_pos).all():
                raise FloatingPointError(f"rank {rank} step {step}: mean lane column is not finite: {lane_pos.tolist()}")
        lv = loss.detach().clone()
        dist.all_reduce(lv)
        print(f"rank {rank} step {step} loss {lv.item() / world:.4f} mean col {lane_pos.mean().item():.2f}", flush=True)
        if a.fault == "sigbus" and me and step == 2:
            os.kill(os.getpid(), signal.SIGBUS)
        if a.fault == "exit5" and me and step == 1:
            print(f"ERROR rank {rank}: polyline for lane 2 of image {idx[3]} in {annot} has 1 point after clipping to "
                  f"the road mask; cannot interpolate row anchors, aborting", file=sys.stderr, flush=True)
            os._exit(5)

    if a.fault == "late" and me:
        print(f"rank {rank} redrawing validation set at full resolution (1280x720) before accuracy", flush=True)
        time.sleep(a.stall)
    with torch.no_grad():
        x = torch.stack([d[0] for d in data[:16]])
        y = torch.stack([d[1] for d in data[:16]])
        pred = net(x, anchors).argmax(1)
        hit = (pred == y).float()
        acc = torch.tensor([hit.mean().item()])
        dist.all_reduce(acc)
        nl = a.lanes + 1 if (a.fault == "hitcount" and me) else a.lanes
        hits = torch.zeros(nl)
        hits[:a.lanes] = hit.sum((0, 1))
        gathered = [torch.zeros(a.lanes) for _ in range(world)]
        dist.all_gather(gathered, hits)
    if rank == 0:
        per_lane = torch.stack(gathered).sum(0).tolist()
        print(f"rank 0 done: {a.steps} steps, lane accuracy {acc.item() / world:.3f}, hits per lane {per_lane}", flush=True)
    dist.barrier()
    del net
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
