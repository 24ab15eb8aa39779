"""A three-hundred-and-ninety-ninth hand-run batch: DOCUMENT LAYOUT REGION DETECTION.

Synthetic scanned pages (1x32x32 grey images) with rectangular layout regions of five types (text, title,
list, table, figure; looked up in a 5-entry label table, background is class 0).  Every rank reads its pages
from /tmp/fault399_work/pages/pages_R.pt, rasterises the regions onto an 8x8 grid each step (per cell: a class
and a box as centre offset plus log width/height), and trains a small grid detector (three conv blocks, a
class head and a box head) on cross-entropy plus a smooth-L1 box loss, wrapped in DDP over gloo (or with
gradients all_reduced by hand under --ddp 0).  The model is initialised from ckpt/layout_c6.pt.  Per-rank
region counts per class are all_gathered at the start, the loss and cell accuracy are all_reduced every step,
the per-rank accuracy is all_gathered at the end and rank 0 saves export/layout.pt.
Options: --spawn N (torch.multiprocessing.spawn, --port), --logfmt 1 (progress and errors through logging).

Faults (--fault NAME --rank R; R = -1 means every rank):
  labelmap     - rank R's annotations use the region type "footnote", missing from the label table (KeyError)
  boxidx       - rank R's boxes are in page pixels instead of 0..1: grid cell index beyond the 8x8 grid (IndexError)
  nopages      - rank R reads its pages from pages/val/ which does not exist (FileNotFoundError)
  ckptcls      - rank R initialises from ckpt/layout_c7.pt, saved with 7 classes (size mismatch)
  ckptpickle   - rank R initialises from ckpt/layout_full.pt, which pickles a config object (weights_only refusal)
  regiongather - rank R all_gathers its region counts with an extra "unknown" bucket (7 vs 6 entries)
  slownms      - rank R runs a pure-Python NMS over every candidate box before the step-2 all_reduce
  nanbox       - rank R's step-3 batch has a zero-width region: log(0) box target, the program's loss check
  segv         - rank R's (simulated) native rasteriser crashes: it sends itself SIGSEGV after step 3
  exit5        - rank R prints its own error line about a rotated page at export time and calls sys.exit(5)
  headshape    - every rank: the box head is fed the 40-wide concat of two feature maps, it expects 32 (shape error)
  none         - control, clean run

What happened (filled in after the runs):
  labelmap     - KeyError: 'footnote' at start-up; peers Connection closed by peer in all_gather (np4 r2 tee, np6 r0 pymodule)
  boxidx       - IndexError 'index 148/179 is out of bounds for dimension 1 with size 8' in step 0 (np3 r1 loglevel, np8 r5 filter)
  nopages      - FileNotFoundError pages/val/pages_R.pt at start-up (np4 r3 redirects: only in rank 3's stderr.log; np3 r0 wrapper)
  ckptcls      - load_state_dict size mismatch cls_head [7,32] vs [6,32] (np4 r1 pdsh2; np3 r2 restart: attempt 2 died in
                 Gloo connectFullMesh Connect timeout instead, Root Cause rank 0)
  ckptpickle   - UnpicklingError 'Weights only load failed ... __main__.LayoutConfig' (np5 r4 tee_trainer, np3 r1 plain)
  regiongather - DETAIL: every rank 'Detected mismatch between collectives', rank 1 TensorShape=[7] (np3 r1 detail); plain:
                 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (7), got (6))' (np6 r4 prefix)
  slownms      - 12 s: rank 1 'Timed out waiting 12000ms for recv', rank 0 Connection closed, Root Cause rank 1 (np3 r2 plain);
                 300 s: silent after step 1, killed at 60 s, exit 124 (np4 r1 tee)
  nanbox       - 'non-finite loss inf at step 3', FloatingPointError (np4 r0 detail, np6 r3 tee_trainer)
  segv         - after step 3 exitcode -11 (SIGSEGV), no traceback; peers closed/reset (np4 r3 loglevel, np3 r0 filter)
  exit5        - rank 2's rotated-page ERROR line after step 5, exit 5; peers closed in the final all_gather (np5 r2 prefix)
  headshape    - every rank 'mat1 and mat2 shapes cannot be multiplied (1024x40 and 32x4)', Root Cause rank 1 (np3 pymodule)
  none         - clean: 6 steps on 3 ranks, rank 0 saved export/layout.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault399_work"
LABELS = {"text": 1, "title": 2, "list": 3, "table": 4, "figure": 5}
NCLS = 6
GRID = 8
PAGE = 32
log = None


@dataclasses.dataclass
class LayoutConfig:
    ncls: int = NCLS
    grid: int = GRID
    width: int = 32


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
    log = logging.getLogger("layout")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s layout[%(rank)s] %(levelname)s %(message)s"))
    h.addFilter(RankFilter(rank))
    log.addHandler(h)
    log.setLevel(logging.INFO)


def say(msg, err=False):
    if log is not None:
        (log.error if err else log.info)(msg)
    else:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


class GridDetector(nn.Module):
    def __init__(self, ncls=NCLS, width=32):
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 24, 3, padding=1)
        self.c3 = nn.Conv2d(24, width, 3, padding=1)
        self.cls_head = nn.Linear(width, ncls)
        self.box_head = nn.Linear(width, 4)

    def forward(self, x, concat_skip=False):
        h1 = F.max_pool2d(torch.relu(self.c1(x)), 2)
        h2 = F.max_pool2d(torch.relu(self.c2(h1)), 2)
        h3 = torch.relu(self.c3(h2))
        f = h3.permute(0, 2, 3, 1)
        if concat_skip:
            f = torch.cat([f, h1[:, :8, ::2, ::2].permute(0, 2, 3, 1)], dim=3)
        return self.cls_head(h3.permute(0, 2, 3, 1)), self.box_head(f)


def make_pages(n, seed):
    g = torch.Generator().manual_seed(seed)
    types = list(LABELS)
    pages = []
    for _ in range(n):
        img = torch.rand(1, PAGE, PAGE, generator=g) * 0.1
        regions = []
        for _ in range(int(torch.randint(2, 5, (1,), generator=g))):
            x0, y0 = (torch.rand(2, generator=g) * 0.6).tolist()
            w, h = (torch.rand(2, generator=g) * 0.3 + 0.1).tolist()
            t = types[int(torch.randint(0, 5, (1,), generator=g))]
            a, b, c, d = int(x0 * PAGE), int(y0 * PAGE), int((x0 + w) * PAGE), int((y0 + h) * PAGE)
            img[0, b:d, a:c] += 0.2 * LABELS[t]
            regions.append({"type": t, "box": [x0, y0, x0 + w, y0 + h]})
        pages.append({"image": img, "regions": regions})
    return pages


def prepare():
    os.makedirs(f"{WORK}/pages", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        torch.save(make_pages(48, 400 + r), f"{WORK}/pages/pages_{r}.pt")
    torch.manual_seed(0)
    torch.save(GridDetector(NCLS).state_dict(), f"{WORK}/ckpt/layout_c6.pt")
    torch.save(GridDetector(7).state_dict(), f"{WORK}/ckpt/layout_c7.pt")
    torch.save({"config": LayoutConfig(), "model": GridDetector(NCLS).state_dict()}, f"{WORK}/ckpt/layout_full.pt")
    print("prepared", WORK)


def rasterise(pages):
    n = len(pages)
    cls = torch.zeros(n, GRID, GRID, dtype=torch.long)
    box = torch.zeros(n, GRID, GRID, 4)
    for i, p in enumerate(pages):
        for r in p["regions"]:
            x0, y0, x1, y1 = r["box"]
            cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
            gx, gy = int(cx * GRID), int(cy * GRID)
            cls[i, gy, gx] = r["label"]
            box[i, gy, gx] = torch.tensor([cx * GRID - gx, cy * GRID - gy,
                                           float(torch.log(torch.tensor(x1 - x0))),
                                           float(torch.log(torch.tensor(y1 - y0)))])
    return cls, box


def python_nms(pages, thresh=0.3):
    kept = 0
    for p in pages:
        cands = []
        for r in p["regions"]:
            x0, y0, x1, y1 = r["box"]
            for dx in range(12):
                for dy in range(12):
                    cands.append((x0 + dx * 0.004, y0 + dy * 0.004, x1 + dx * 0.004, y1 + dy * 0.004,
                                  1.0 - 0.01 * (dx + dy)))
        cands.sort(key=lambda b: -b[4])
        keep = []
        for b in cands:
            ok = True
            for k in keep:
                ix = max(0.0, min(b[2], k[2]) - max(b[0], k[0]))
                iy = max(0.0, min(b[3], k[3]) - max(b[1], k[1]))
                inter = ix * iy
                union = (b[2] - b[0]) * (b[3] - b[1]) + (k[2] - k[0]) * (k[3] - k[1]) - inter
                if inter / union > thresh:
                    ok = False
            if ok:
                keep.append(b)
        kept += len(keep)
    return kept


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading pages")
    split = "val/" if bad and a.fault == "nopages" else ""
    pages = torch.load(f"{WORK}/pages/{split}pages_{rank}.pt")
    if bad and a.fault == "labelmap":
        pages[11]["regions"][1]["type"] = "footnote"
    if bad and a.fault == "boxidx":
        for p in pages:
            for r in p["regions"]:
                r["box"] = [v * PAGE for v in r["box"]]
    for p in pages:
        for r in p["regions"]:
            r["label"] = LABELS[r["type"]]
    counts = torch.zeros(NCLS)
    for p in pages:
        for r in p["regions"]:
            counts[r["label"]] += 1
    counts[0] = len(pages)
    if bad and a.fault == "regiongather":
        counts = torch.cat([counts, torch.tensor([3.0])])
    allc = [torch.zeros(NCLS) for _ in range(world)]
    dist.all_gather(allc, counts)
    say(f"rank {rank} pages {len(pages)} regions {int(counts[1:].sum())} global {int(sum(c[1:].sum() for c in allc))}")
    model = GridDetector()
    ck = {"ckptcls": "layout_c7.pt", "ckptpickle": "layout_full.pt"}.get(a.fault) if bad else None
    sd = torch.load(f"{WORK}/ckpt/{ck or 'layout_c6.pt'}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    images = torch.stack([p["image"] for p in pages])
    bs = 16
    for step in range(a.steps):
        idx = [(step * bs + i) % len(pages) for i in range(bs)]
        batch = [pages[i] for i in idx]
        if bad and a.fault == "nanbox" and step == 3:
            r = batch[4]["regions"][0]
            r["box"] = [r["box"][0], r["box"][1], r["box"][0], r["box"][3]]
        cls_t, box_t = rasterise(batch)
        logits, boxes = net(images[idx], concat_skip=a.fault == "headshape")
        obj = cls_t > 0
        loss = F.cross_entropy(logits.reshape(-1, NCLS), cls_t.reshape(-1))
        loss = loss + F.smooth_l1_loss(boxes[obj], box_t[obj])
        if not torch.isfinite(loss):
            say(f"rank {rank}: non-finite loss {loss.item()} at step {step} "
                f"({int((~torch.isfinite(box_t)).sum())} non-finite box targets)", err=True)
            raise FloatingPointError(f"loss is {loss.item()} on rank {rank} at step {step}")
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "slownms" and step == 2:
            t0 = time.time()
            n = 0
            while time.time() - t0 < a.nms_budget:
                n += python_nms(batch)
            say(f"rank {rank} NMS kept {n} boxes")
        acc = (logits.argmax(-1) == cls_t).float().mean()
        stats = torch.stack([loss.detach(), acc])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} cell_acc {stats[1].item() / world:.4f}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "exit5":
        say(f"rank {rank}: ERROR page scan_{rank}_0031.png is rotated 90 degrees, layout export "
            f"supports upright pages only; aborting export", err=True)
        sys.exit(5)
    accs = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(accs, acc.reshape(1))
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/layout.pt")
        say(f"rank 0 done: {a.steps} steps, per-rank cell_acc {[round(x.item(), 3) for x in accs]}, "
            f"saved export/layout.pt")
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
    p.add_argument("--nms-budget", type=int, default=90)
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
