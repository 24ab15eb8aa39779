"""A two-hundred-and-fourth hand-run batch: OBJECT DETECTION WITH ANCHORS. A tiny single-stage detector.

Each rank reads its shard's annotations (/tmp/fault204_work/data/ann_shard<R>.json, written by --prepare),
renders 32x32 synthetic images with bright boxes of 3 classes, runs a 3-conv backbone (stride 8, a 4x4
feature map) with a 3-anchor head, matches hand-made anchors to the boxes by IoU, and trains with a focal
loss plus a smooth-L1 box loss under DDP. Rank 0 saves the initial weights and every rank reloads them.
After training, each rank decodes its predictions, runs NMS by hand, counts matched boxes per class; the
counts are all_gathered and the recall all_reduced. Launch under torchrun, a bash loop (env://) or --spawn N.

Faults:
  badbox      rank N's shard has a box with x2 < x1: the program's check raises ValueError
  anchorsize  every rank builds anchors for an 8x8 feature map while the backbone gives 4x4 (shape error)
  annmissing  rank N reads its annotations from the val/ folder, which is not there (FileNotFoundError)
  focalnan    rank N's IoU threshold schedule ends at 0.99 from step 2: no anchor matches, the loss is NaN
  badcls      rank N's shard has class id 3 with 3 classes: one_hot raises RuntimeError
  iouthr      every rank reads the positive IoU threshold as the string "0.5" (TypeError)
  recalllen   rank N all_gathers per-class counts with the background class included (4 instead of 3)
  ckptanchors rank N builds its head with 2 anchors per cell and loads rank 0's 3-anchor checkpoint
  slownms     rank N runs NMS over every anchor (sleeps --stall s) before the recall all_reduce
  segv        rank N sends itself SIGSEGV after step 3
  exit6       rank N prints its own error line about a zero recall and exits 6
  none        control, exit 0

What happened (filled in after the runs):
  badbox      ValueError degenerate box on rank N, peers Connection closed by peer (np4 r2 ranklabel, np3 r1 legacy)
  anchorsize  ValueError Target size [192, 3] vs input [48, 3] on every rank (np3 srunlabel, np4 tee)
  annmissing  FileNotFoundError data/val/ann_shardN.json on rank N (np4 r3 mpitag, np3 r1 files)
  focalnan    FloatingPointError loss nan at step 2, 0 positive anchors, rank N (np3 r1 spawn, np4 r2 logfmt)
  badcls      RuntimeError Class values must be smaller than num_classes on rank N (np4 r1 tee, np3 r2 bashloop)
  iouthr      TypeError '>=' Tensor and str on every rank (np4 pdsh2; Root Causes rank 0 and rank 3)
  recalllen   gloo allgather invalid tensor size (expected (4), got (3)) on rank N (np3 r1 ranklabel, np4 r2 spawn)
  ckptanchors size mismatch for cls_head.weight [9,...] vs [6,...] on rank N (np4 r2 logfmt, np3 r1 mpitag)
  slownms     rank 2 stalled 35 s, ranks 0/1 gloo 12000ms timeouts (np3 bashloop); rank 1 hung, exit 124 (np4 srunlabel)
  segv        rank N SIGSEGV after step 3 (np4 r3 legacy, Root Cause -11; np3 r1 spawn, ProcessExitedException)
  exit6       rank N ERROR line and exit 6, peers closed in final barrier (np4 r1 files; np4 r3 pdsh2)
  none        exit 0, rank 0 saved det_final.pt (np3 bashloop)
"""
import argparse
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

WORK = "/tmp/fault204_work"
NUM_CLASSES = 3


class RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


def prepare(n_shards=8, per_shard=32):
    os.makedirs(os.path.join(WORK, "data"), exist_ok=True)
    g = torch.Generator().manual_seed(204)
    for s in range(n_shards):
        imgs = []
        for i in range(per_shard):
            boxes = []
            for _ in range(int(torch.randint(1, 3, (1,), generator=g))):
                w, h = [int(v) for v in torch.randint(7, 16, (2,), generator=g)]
                x1, y1 = [int(v) for v in torch.randint(0, 32 - 16, (2,), generator=g)]
                boxes.append([x1, y1, x1 + w, y1 + h, int(torch.randint(0, NUM_CLASSES, (1,), generator=g))])
            imgs.append({"id": s * 1000 + i, "boxes": boxes})
        with open(os.path.join(WORK, "data", f"ann_shard{s}.json"), "w") as f:
            json.dump(imgs, f)


def render(ann, gen):
    img = torch.rand(1, 32, 32, generator=gen) * 0.3
    for x1, y1, x2, y2, c in ann["boxes"]:
        img[0, y1:y2, x1:x2] += 0.4 + 0.3 * c
    return img


def make_anchors(fmap, stride, sizes=(8.0, 12.0, 16.0)):
    out = []
    for y in range(fmap):
        for x in range(fmap):
            cx, cy = (x + 0.5) * stride, (y + 0.5) * stride
            for s in sizes:
                out.append([cx - s / 2, cy - s / 2, cx + s / 2, cy + s / 2])
    return torch.tensor(out)


def box_iou(a, b):
    lt = torch.max(a[:, None, :2], b[None, :, :2])
    rb = torch.min(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(2)
    area_a = (a[:, 2:] - a[:, :2]).prod(1)
    area_b = (b[:, 2:] - b[:, :2]).prod(1)
    return inter / (area_a[:, None] + area_b[None, :] - inter)


def nms(boxes, scores, thr=0.5):
    order = scores.argsort(descending=True)
    keep = []
    while order.numel() > 0:
        i = order[0]
        keep.append(int(i))
        if order.numel() == 1:
            break
        ious = box_iou(boxes[i:i + 1], boxes[order[1:]])[0]
        order = order[1:][ious < thr]
    return torch.tensor(keep, dtype=torch.long)


class Detector(nn.Module):
    def __init__(self, n_anchors=3, c=32):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(1, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, c, 3, 2, 1), nn.ReLU(),
            nn.Conv2d(c, c, 3, 2, 1), nn.ReLU())
        self.cls_head = nn.Conv2d(c, n_anchors * NUM_CLASSES, 3, padding=1)
        self.box_head = nn.Conv2d(c, n_anchors * 4, 3, padding=1)

    def forward(self, x):
        f = self.backbone(x)
        b = x.shape[0]
        cls = self.cls_head(f).permute(0, 2, 3, 1).reshape(b, -1, NUM_CLASSES)
        box = self.box_head(f).permute(0, 2, 3, 1).reshape(b, -1, 4)
        return cls, box


def match(anchors, gt, thr):
    ious = box_iou(anchors, gt[:, :4])
    best, idx = ious.max(1)
    labels = torch.full((anchors.shape[0],), -1, dtype=torch.long)
    pos = best >= thr
    labels[pos] = gt[idx[pos], 4].long()
    deltas = (gt[idx, :4] - anchors) / 8.0
    return labels, deltas, pos


def focal_loss(logits, labels, alpha=0.25, gamma=2.0):
    t = F.one_hot(labels.clamp(min=0), NUM_CLASSES).float() * (labels >= 0).unsqueeze(-1)
    p = torch.sigmoid(logits)
    ce = F.binary_cross_entropy_with_logits(logits, t, reduction="none")
    pt = p * t + (1 - p) * (1 - t)
    return (alpha * t + (1 - alpha) * (1 - t)) * (1 - pt) ** gamma * ce


def worker(rank, a, world):
    if a.spawn:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    r = int(os.environ["RANK"])
    bad = a.fault != "none" and (a.rank == -1 or a.rank == r)
    if a.logfmt:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("%(asctime)s [rank=%(rank)s] %(levelname)s %(message)s"))
        h.addFilter(RankFilter(r))
        logging.basicConfig(level=logging.INFO, handlers=[h])
        say, err = logging.getLogger("det").info, logging.getLogger("det").error
    else:
        say = err = lambda m: print(m, flush=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    ws = dist.get_world_size()
    torch.manual_seed(0)
    cfg = {"fmap": 4, "stride": 8, "iou_pos": 0.4, "iou_end": 0.5, "n_anchors": 3, "lr": 0.05}
    if bad and a.fault == "anchorsize":
        cfg["fmap"], cfg["stride"] = 8, 4
    if bad and a.fault == "iouthr":
        cfg["iou_pos"] = "0.5"
    if bad and a.fault == "focalnan":
        cfg["iou_end"] = 0.99
    if bad and a.fault == "ckptanchors":
        cfg["n_anchors"] = 2
    ann_dir = os.path.join(WORK, "data", "val") if bad and a.fault == "annmissing" else os.path.join(WORK, "data")
    ann_path = os.path.join(ann_dir, f"ann_shard{r}.json")
    say(f"rank {r}/{ws}: loading annotations from {ann_path}")
    with open(ann_path) as f:
        anns = json.load(f)
    if bad and a.fault == "badbox":
        b = anns[5]["boxes"][0]
        b[0], b[2] = b[2], b[0]
    if bad and a.fault == "badcls":
        anns[7]["boxes"][0][4] = NUM_CLASSES
    for ann in anns:
        for b in ann["boxes"]:
            if b[2] <= b[0] or b[3] <= b[1]:
                raise ValueError(f"image {ann['id']}: degenerate box {b[:4]} (x2 <= x1 or y2 <= y1)")
    gen = torch.Generator().manual_seed(100 + r)
    imgs = torch.stack([render(ann, gen) for ann in anns])
    gts = [torch.tensor(ann["boxes"], dtype=torch.float32) for ann in anns]
    anchors = make_anchors(cfg["fmap"], cfg["stride"], (8.0, 12.0, 16.0)[:cfg["n_anchors"]])
    hist = F.one_hot(torch.cat([g[:, 4] for g in gts]).long(), NUM_CLASSES).sum(0).tolist()
    say(f"rank {r}/{ws}: {len(anns)} images, boxes per class {hist}, {anchors.shape[0]} anchors")

    model = Detector(cfg["n_anchors"])
    ckpt = os.path.join(WORK, "ckpt", "det_init.pt")
    if r == 0:
        os.makedirs(os.path.dirname(ckpt), exist_ok=True)
        torch.save(model.state_dict(), ckpt)
    dist.barrier()
    model.load_state_dict(torch.load(ckpt))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"], momentum=0.9)
    bs = 8
    for step in range(a.steps):
        thr = cfg["iou_pos"] if step < 2 else cfg["iou_end"]
        i0 = (step * bs) % len(anns)
        x = imgs[i0:i0 + bs]
        cls, box = ddp(x)
        cls_l, box_l, npos = 0.0, 0.0, 0
        for j in range(x.shape[0]):
            labels, deltas, pos = match(anchors, gts[i0 + j], thr)
            npos += int(pos.sum())
            cls_l = cls_l + focal_loss(cls[j], labels).sum()
            box_l = box_l + F.smooth_l1_loss(box[j][pos], deltas[pos], reduction="sum")
        loss = cls_l / npos + box_l / npos
        if not torch.isfinite(loss):
            raise FloatingPointError(f"rank {r}: detection loss is {loss.item()} at step {step} "
                                     f"({npos} positive anchors at IoU >= {thr})")
        opt.zero_grad()
        loss.backward()
        opt.step()
        say(f"rank {r} step {step} loss {loss.item():.4f} pos {npos}")
        if bad and a.fault == "segv" and step == 3:
            os.kill(os.getpid(), signal.SIGSEGV)

    model.eval()
    counts = torch.zeros(NUM_CLASSES + (1 if bad and a.fault == "recalllen" else 0))
    total = torch.zeros(1)
    with torch.no_grad():
        cls, box = model(imgs)
        for j in range(imgs.shape[0]):
            scores, pred_c = torch.sigmoid(cls[j]).max(1)
            boxes = anchors + box[j] * 8.0
            cand = scores > 0.3
            if bad and a.fault == "slownms" and j == 0:
                say(f"rank {r}: running NMS over all {anchors.shape[0]} anchors x {imgs.shape[0]} images "
                    f"(score threshold disabled)")
                time.sleep(a.stall)
            keep = nms(boxes[cand], scores[cand])
            kept_b, kept_c = boxes[cand][keep], pred_c[cand][keep]
            for g in gts[j]:
                total += 1
                if kept_b.numel() and (box_iou(g[None, :4], kept_b)[0] >= 0.5).logical_and(
                        kept_c == int(g[4])).any():
                    counts[int(g[4])] += 1
    gathered = [torch.zeros(NUM_CLASSES) for _ in range(ws)]
    dist.all_gather(gathered, counts)
    rec = torch.stack([counts.sum(), total.sum()])
    dist.all_reduce(rec)
    say(f"rank {r}: matched {int(counts.sum())}/{int(total)} boxes; global recall {rec[0] / rec[1]:.3f}")
    if bad and a.fault == "exit6":
        err(f"ERROR rank {r}: recall 0.000 on the held-out anchors of this shard (0 of {int(total)} boxes "
            f"after NMS); refusing to export detector")
        sys.exit(6)
    dist.barrier()
    if r == 0:
        os.makedirs(os.path.join(WORK, "out"), exist_ok=True)
        torch.save(model.state_dict(), os.path.join(WORK, "out", "det_final.pt"))
        say(f"rank 0: saved detector to {WORK}/out/det_final.pt")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=int, default=12)
    p.add_argument("--stall", type=float, default=35.0)
    p.add_argument("--logfmt", type=int, default=0)
    p.add_argument("--spawn", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--prepare", type=int, default=0)
    a = p.parse_args()
    if a.prepare:
        prepare()
    elif a.spawn:
        import torch.multiprocessing as mp
        mp.spawn(worker, args=(a, a.spawn), nprocs=a.spawn)
    else:
        worker(None, a, None)


if __name__ == "__main__":
    main()
