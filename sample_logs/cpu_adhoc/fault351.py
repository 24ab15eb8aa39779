"""A three-hundred-and-fifty-first hand-run batch: PEDESTRIAN DETECTION WITH ANCHOR BOXES.

Synthetic 32x32 street crops with one to three pedestrians each (tall boxes, class "person" or "rider").  Every
rank reads its images from /tmp/fault351_work/shards/img_R.pt and its annotations from ann_R.pt, matches the
ground-truth boxes to 3 anchors (aspect ratios 0.33, 0.5, 1.0) on an 8x8 grid by IoU, encodes the box deltas
(dx, dy, log dw, log dh) and trains a tiny conv backbone with an objectness head and a box-regression head
(BCE + smooth L1), wrapped in DDP (gloo) or, with --ddp 0, with gradients all_reduced by hand.  The model is
initialised from ckpt/pdet_a3.pt.  The mean loss is all_reduced every step; at the end each rank all_gathers
its count of positive anchors and rank 0 saves export/pdet.pt.  Options: --spawn N, --logfmt 1, --ddp 0.

Faults:
  classmap   - rank N's annotations carry the label "cyclist", missing from the class table (KeyError, start-up)
  noshard    - rank N reads its annotations from shards/val/ which does not exist (FileNotFoundError, start-up)
  anchoridx  - rank N's matcher adds a second pyramid level's offset (192) the model lacks (IndexError, first step)
  flatbox    - rank N's step-2 batch holds a box of height 0: log(0) in the targets, the program's check
  ckptanchors- rank N initialises from ckpt/pdet_a5.pt, saved with 5 anchors (size mismatch)
  ckptpickle - rank N initialises from ckpt/pdet_cfg.pt, which pickles an AnchorConfig object (weights_only)
  gatherpos  - rank N all_gathers its positive-anchor counts per class plus an "ignored" count (3 vs 2, the end)
  nms        - rank N runs a pure-Python NMS over every anchor of every image before the step-2 all_reduce
  sigsegv    - rank N sends itself SIGSEGV after step 3
  exit4      - rank N prints its own error line about an empty crop and calls sys.exit(4) after step 1
  inchan     - every rank: images carry a fourth (depth) channel, the stem conv expects 3 (shape error)
  none       - control, clean run

What happened (filled in after the runs):
  classmap   - KeyError 'cyclist' in encode() at step 1; peers Connection closed / SIGTERM (np4 r2 plain, np3 r0 tee_trainer)
  noshard    - FileNotFoundError shards/val/ann_N.pt at start-up; peers SIGTERMed (np6 r3 tee; np3 r1 redirects, only in stderr.log)
  anchoridx  - IndexError 'index 301/277 is out of bounds for dimension 1 with size 192' at step 0 (np3 r2 filter, np8 r0 pymodule)
  flatbox    - '1 non-finite box targets (min gt height 0.0 px)', FloatingPointError at step 2 (np3 r0 detail; np4 r3 restart)
  ckptanchors- load_state_dict size mismatch obj/box [5..]/[20..] vs [3..]/[12..] on rank 3; worker-1 RendezvousConnectionError (np4 pdsh2)
  ckptpickle - UnpicklingError Weights only load failed, Unsupported global __main__.AnchorConfig (np3 r1 plain, np5 r0 prefix)
  gatherpos  - 'ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (3), got (2))' after step 5 (np6 r4 tee)
  nms        - 12 s: peers 'Timed out waiting 12000ms' (np3 r1 pymodule; np4 r0 filter hides them); 300 s: silent, exit 124 (np3 r2 loglevel)
  sigsegv    - no traceback after step 3; Root Cause exitcode -11 SIGSEGV (np6 r0 wrapper, np4 r2 tee_trainer)
  exit4      - rank 1's ERROR empty-crop line, exitcode 4; restart attempt died in gloo connectFullMesh (np3 r1 restart)
  inchan     - every rank 'expected input[8, 4, 32, 32] to have 3 channels, but got 4 channels' (np3 prefix, np6 loglevel)
  none       - clean: 6 steps on 3 ranks, rank 0 saved export/pdet.pt, exit 0 (np3 plain)
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

WORK = "/tmp/fault351_work"
CLASSES = {"person": 0, "rider": 1}
RATIOS = [0.33, 0.5, 1.0]
GRID = 8
IMG = 32
NIMG = 48
BATCH = 8
log = None


@dataclasses.dataclass
class AnchorConfig:
    ratios: tuple = (0.33, 0.5, 1.0)
    scale: float = 12.0


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
    log = logging.getLogger("pdet")
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


def make_anchors(ratios=RATIOS, scale=12.0):
    stride = IMG / GRID
    out = []
    for gy in range(GRID):
        for gx in range(GRID):
            cx, cy = (gx + 0.5) * stride, (gy + 0.5) * stride
            for r in ratios:
                w = scale * r ** 0.5
                h = scale / r ** 0.5
                out.append([cx, cy, w, h])
    return torch.tensor(out)


class Detector(nn.Module):
    def __init__(self, nanch=3, cin=3):
        super().__init__()
        self.stem = nn.Conv2d(cin, 8, 3, padding=1)
        self.body = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.down = nn.Conv2d(16, 16, 3, stride=2, padding=1)
        self.obj = nn.Conv2d(16, nanch, 1)
        self.box = nn.Conv2d(16, nanch * 4, 1)

    def forward(self, x):
        h = F.relu(self.down(F.relu(self.body(F.relu(self.stem(x))))))
        n = x.shape[0]
        obj = self.obj(h).permute(0, 2, 3, 1).reshape(n, -1)
        box = self.box(h).permute(0, 2, 3, 1).reshape(n, -1, 4)
        return obj, box


def make_shard(seed):
    g = torch.Generator().manual_seed(seed)
    imgs = torch.rand(NIMG, 3, IMG, IMG, generator=g) * 0.2
    anns = []
    for i in range(NIMG):
        boxes = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            w = float(torch.randint(4, 9, (1,), generator=g))
            h = w * float(torch.empty(1).uniform_(1.8, 2.8, generator=g))
            cx = float(torch.empty(1).uniform_(w / 2, IMG - w / 2, generator=g))
            cy = float(torch.empty(1).uniform_(h / 2, IMG - h / 2, generator=g))
            label = "person" if float(torch.rand(1, generator=g)) < 0.8 else "rider"
            x0, y0 = int(cx - w / 2), int(cy - h / 2)
            imgs[i, :, y0:int(y0 + h), x0:int(x0 + w)] += 0.7
            boxes.append({"box": [cx, cy, w, h], "label": label})
        anns.append(boxes)
    return imgs, anns


def prepare():
    os.makedirs(f"{WORK}/shards", exist_ok=True)
    os.makedirs(f"{WORK}/ckpt", exist_ok=True)
    for r in range(8):
        imgs, anns = make_shard(500 + r)
        torch.save(imgs, f"{WORK}/shards/img_{r}.pt")
        torch.save(anns, f"{WORK}/shards/ann_{r}.pt")
    torch.manual_seed(0)
    torch.save(Detector(3).state_dict(), f"{WORK}/ckpt/pdet_a3.pt")
    torch.save(Detector(5).state_dict(), f"{WORK}/ckpt/pdet_a5.pt")
    torch.save({"model": Detector(3).state_dict(), "anchors": AnchorConfig()}, f"{WORK}/ckpt/pdet_cfg.pt")
    print("prepared", WORK)


def iou_cxcywh(a, b):
    a0, a1 = a[:, None, :2] - a[:, None, 2:] / 2, a[:, None, :2] + a[:, None, 2:] / 2
    b0, b1 = b[None, :, :2] - b[None, :, 2:] / 2, b[None, :, :2] + b[None, :, 2:] / 2
    wh = (torch.min(a1, b1) - torch.max(a0, b0)).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    return inter / (a[:, None, 2] * a[:, None, 3] + b[None, :, 2] * b[None, :, 3] - inter)


def encode(anns, anchors, a, bad):
    na = anchors.shape[0]
    obj_t = torch.zeros(len(anns), na)
    box_t = torch.zeros(len(anns), na, 4)
    cls_pos = torch.zeros(len(CLASSES))
    for i, boxes in enumerate(anns):
        gt = torch.tensor([b["box"] for b in boxes])
        best = iou_cxcywh(gt, anchors).argmax(1)
        for k, b in enumerate(boxes):
            j = int(best[k])
            if bad and a.fault == "anchoridx":
                j = j + len(RATIOS) * GRID * GRID
            obj_t[i, j] = 1.0
            cls_pos[CLASSES[b["label"]]] += 1
            g, an = gt[k], anchors[j]
            box_t[i, j] = torch.stack([(g[0] - an[0]) / an[2], (g[1] - an[1]) / an[3],
                                       torch.log(g[2] / an[2]), torch.log(g[3] / an[3])])
    return obj_t, box_t, cls_pos


def python_nms(boxes, scores, thr=0.5):
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    keep = []
    for i in order:
        bi, ok = boxes[i], True
        for bj in (boxes[j] for j in keep):
            ix = max(0.0, min(bi[0] + bi[2] / 2, bj[0] + bj[2] / 2) - max(bi[0] - bi[2] / 2, bj[0] - bj[2] / 2))
            iy = max(0.0, min(bi[1] + bi[3] / 2, bj[1] + bj[3] / 2) - max(bi[1] - bi[3] / 2, bj[1] - bj[3] / 2))
            if ix * iy / (bi[2] * bi[3] + bj[2] * bj[3] - ix * iy) > thr:
                ok = False
                break
        if ok:
            keep.append(i)
    return keep


def run(a, rank, world):
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    bad = a.rank in (-1, rank)
    torch.manual_seed(1234 + rank)
    say(f"rank {rank}/{world} up, loading shard {rank}")
    split = "val/" if bad and a.fault == "noshard" else ""
    imgs = torch.load(f"{WORK}/shards/img_{rank}.pt")
    anns = torch.load(f"{WORK}/shards/{split}ann_{rank}.pt")
    if bad and a.fault == "classmap":
        anns[11][0]["label"] = "cyclist"
    if bad and a.fault == "flatbox":
        anns[2 * BATCH + 3][0]["box"][3] = 0.0
    if a.fault == "inchan":
        imgs = torch.cat([imgs, torch.rand(NIMG, 1, IMG, IMG)], 1)
    anchors = make_anchors()
    model = Detector()
    ck = {"ckptanchors": "pdet_a5.pt", "ckptpickle": "pdet_cfg.pt"}.get(a.fault, "pdet_a3.pt") if bad else "pdet_a3.pt"
    sd = torch.load(f"{WORK}/ckpt/{ck}")
    model.load_state_dict(sd)
    net = DDP(model) if a.ddp else model
    for p in model.parameters() if not a.ddp else []:
        dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    pos_total = torch.zeros(len(CLASSES))
    for step in range(a.steps):
        s = (step * BATCH) % NIMG
        x = imgs[s:s + BATCH]
        obj_t, box_t, cls_pos = encode(anns[s:s + BATCH], anchors, a, bad)
        if not torch.isfinite(box_t).all():
            say(f"rank {rank} step {step}: {int((~torch.isfinite(box_t)).sum())} non-finite box targets "
                f"(min gt height {min(b['box'][3] for bs in anns[s:s + BATCH] for b in bs):.1f} px)", err=True)
            raise FloatingPointError(f"non-finite regression targets on rank {rank} at step {step}")
        pos_total += cls_pos
        obj, box = net(x)
        pos = obj_t > 0
        loss = F.binary_cross_entropy_with_logits(obj, obj_t) + F.smooth_l1_loss(box[pos], box_t[pos])
        opt.zero_grad()
        loss.backward()
        if not a.ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if bad and a.fault == "nms" and step == 2:
            t0 = time.time()
            kept = 0
            while time.time() - t0 < a.nms_budget:
                for i in range(x.shape[0]):
                    kept += len(python_nms(anchors.tolist() * 4, torch.rand(anchors.shape[0] * 4).tolist()))
            say(f"rank {rank} nms kept {kept} boxes")
        recall = ((obj.detach().sigmoid() > 0.5) & pos).sum() / pos.sum().clamp(min=1)
        stats = torch.stack([loss.detach(), recall.float()])
        dist.all_reduce(stats)
        say(f"rank {rank} step {step} loss {stats[0].item() / world:.4f} recall {stats[1].item() / world:.3f}")
        if bad and a.fault == "exit4" and step == 1:
            say(f"rank {rank}: ERROR crop {s + 5} of shard {rank} has 0 visible pedestrians after clipping, "
                f"refusing to train on empty crops", err=True)
            sys.exit(4)
        if bad and a.fault == "sigsegv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)
    if bad and a.fault == "gatherpos":
        pos_total = torch.cat([pos_total, torch.tensor([float(a.steps * 3)])])
    allp = [torch.zeros(len(CLASSES)) for _ in range(world)]
    dist.all_gather(allp, pos_total)
    say(f"rank {rank} positives {pos_total.tolist()} global {sum(p.sum() for p in allp).item():.0f}")
    if rank == 0:
        os.makedirs(f"{WORK}/export", exist_ok=True)
        torch.save(model.state_dict(), f"{WORK}/export/pdet.pt")
        say(f"rank 0 done: {a.steps} steps, saved export/pdet.pt")
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
    p.add_argument("--nms-budget", type=int, default=45)
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
