"""A hundred-and-eighteenth hand-run batch: OBJECT DETECTION WITH VARIABLE-SIZE TARGETS. A tiny detector (a conv
backbone Conv(3,8)-Conv(8,16)-pool on random 3x32x32 images, a box head and a class head over --anchors query slots,
DETR-style) trained with hand-written collectives on gloo: rank 0's initial weights are broadcast, each step all-reduces
the number of boxes for the loss normalisation (as DETR does) and then the flattened gradients. The annotations
(COCO-like json: per image 0-3 boxes as x1,y1,x2,y2 in [0,1], 0-based category ids) are staged per rank as its
node-local copy under --work, read through a DistributedSampler and a custom collate_fn that keeps a list of per-image
targets; the loss greedily matches query slots to boxes (class CE, L1 and a log-size term). After --epochs x the shard
the eval decodes detections with a greedy NMS and all_gathers them with all_gather_object; rank 0 prints an mAP-like
precision@0.5. --rank N picks the faulty rank (-1: every rank). PG timeout --pg-timeout (12 s). No @record.

Faults:
  none        control: 2 epochs, eval, `eval AP50 ...` on rank 0, exit 0
  badclass    rank N's annotation copy keeps COCO's 1-based category ids: a class id 3 with 3 classes reaches
              cross_entropy: IndexError Target 3 is out of bounds on rank N
  xywh        rank N's annotation copy holds boxes as x,y,w,h: read as x1,y1,x2,y2 some widths are negative, the
              log-size term is nan and the loss check raises FloatingPointError on rank N
  emptyimg    rank N's shard has a batch of hard-negative images (no boxes); the zero-box guard skips the batch
              before the num_boxes all_reduce, so rank N runs one collective behind the others
  stack       every rank builds its DataLoader with the default collate (collate_fn left out of the config): RuntimeError
              stack expects each tensor to be equal size, from the per-image box tensors
  badjson     rank N's node-local annotation copy is truncated (an interrupted rsync): json.JSONDecodeError on rank N
  chans       rank N's (or every rank's) cached backbone checkpoint is the 1-channel (grayscale) variant: size mismatch
              for 0.weight in load_state_dict
  unpickle    every rank's eval groups its detections per class in a defaultdict(lambda: []), which
              all_gather_object cannot pickle (a local lambda)
  segv        rank N's DataLoader worker crashes in the native image decoder (SIGSEGV) on one image (--workers 1)
  anchors     rank N's model config has 3 anchors instead of 4 (an older config): its head tensors are shorter, the
              initial broadcast / gradient all_reduce sizes differ across ranks
  evalhang    rank N's eval annotations lack width/height: every box is clipped to zero area, IoU with itself is nan
              and the greedy NMS never drops the top box (infinite loop) while the others wait in all_gather_object
  imgmissing  rank N's node-local image copy is incomplete: its start-up check prints an error and sys.exit(3)

What happened (filled in after the runs):
  none: exit 0 (np3 plain, np4 pdsh2); AP50 0.000 (the tiny detector learns nothing in 8 steps), every rank done.
  badclass: IndexError: Target 3 is out of bounds at rank N's first step (np4 r2 tee, np6 r4 filter); peers closed/SIGTERM.
  xywh: FloatingPointError non-finite loss nan (size nan) at step 0 on rank N (np4 r3, np5 r1); peers Connection closed.
  emptyimg: `no boxes in this batch, skipping it` at step 2, rank N a step off; every rank 12 s gloo timeout (np4, np5).
  stack: RuntimeError: stack expects each tensor to be equal size on every rank at the first batch (np4, np6).
  badjson: JSONDecodeError Expecting ',' delimiter on rank N (np4 r2; np5 r3 --redirects: only in its stderr.log).
  chans: size mismatch for 0.weight [8, 1, 3, 3] vs [8, 3, 3, 3]; restart: attempt 1 Gloo connectFullMesh failed.
  unpickle: AttributeError: Can't pickle local object 'evaluate.<locals>.<lambda>' on every rank (np4 DETAIL, np3 tee).
  segv: Unexpected segmentation fault in worker; RuntimeError DataLoader worker killed by signal on rank N.
  anchors: DETAIL: Detected mismatch between collectives (BROADCAST [12, 16]); plain: EnforceNotMet 1024 vs 768, SIGABRT.
  evalhang: PG 12 s: the others time out in all_gather_object; PG 300 s + timeout 60: hung, exit 124, death signal.
  imgmissing: ERROR ... 3 of N images ... missing ..., aborting and exit code 3 on rank N (np5 r3 prefix, np4 r0).
"""
import argparse, datetime, json, os, signal, sys, time
from collections import defaultdict
import torch, torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

p = argparse.ArgumentParser()
p.add_argument("--fault", required=True)
p.add_argument("--rank", type=int, default=0)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--bs", type=int, default=4)
p.add_argument("--per-rank", type=int, default=16)
p.add_argument("--anchors", type=int, default=4)
p.add_argument("--classes", type=int, default=3)
p.add_argument("--workers", type=int, default=0)
p.add_argument("--pg-timeout", type=int, default=12)
p.add_argument("--work", default="/tmp/fault118_work/run")
a = p.parse_args()


def faulty(rank: int, name: str) -> bool:
    return a.fault == name and (a.rank < 0 or rank == a.rank)


class Detector(nn.Module):
    def __init__(self, anchors: int, classes: int, in_ch: int = 3):
        super().__init__()
        self.anchors, self.classes = anchors, classes
        self.backbone = nn.Sequential(nn.Conv2d(in_ch, 8, 3, stride=2, padding=1), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.box_head = nn.Linear(16, anchors * 4)
        self.cls_head = nn.Linear(16, anchors * classes)

    def forward(self, x):
        f = self.backbone(x).flatten(1)
        boxes = torch.sigmoid(self.box_head(f)).view(-1, self.anchors, 4)  # cx, cy, w, h in [0, 1]
        return boxes, self.cls_head(f).view(-1, self.anchors, self.classes)


def make_annotations(n_images: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    images, anns = [], []
    for i in range(n_images):
        images.append({"id": i, "file_name": f"{i:06d}.jpg", "width": 32, "height": 32})
        for _ in range(int(torch.randint(0, 4, (1,), generator=g))):
            x1, y1 = (torch.rand(2, generator=g) * 0.6).tolist()
            w, h = (0.1 + torch.rand(2, generator=g) * 0.3).tolist()
            anns.append({"image_id": i, "bbox": [round(x1, 4), round(y1, 4), round(x1 + w, 4), round(y1 + h, 4)],
                         "category_id": int(torch.randint(0, a.classes, (1,), generator=g))})
    return {"images": images, "annotations": anns, "categories": [{"id": c} for c in range(a.classes)]}


def stage_node_copy(rank: int, world: int, split: str, n_images: int, seed: int):
    """Stands in for the node-local copy of the dataset that the job's prolog rsyncs onto each node."""
    node = os.path.join(a.work, f"node{rank}")
    os.makedirs(node, exist_ok=True)
    coco = make_annotations(n_images, seed)
    if split == "train" and faulty(rank, "badclass"):
        for ann in coco["annotations"]:
            ann["category_id"] += 1  # this copy came from the original COCO export (1-based ids)
    if split == "train" and faulty(rank, "xywh"):
        for ann in coco["annotations"]:
            x1, y1, x2, y2 = ann["bbox"]
            ann["bbox"] = [x1, y1, round(x2 - x1, 4), round(y2 - y1, 4)]  # this copy is in COCO's x,y,w,h
    if split == "train" and faulty(rank, "emptyimg"):
        order = list(DistributedSampler(range(n_images), world, rank, shuffle=True, seed=0))
        negatives = set(order[2 * a.bs:3 * a.bs])  # hard-negative mining put background-only images here
        coco["annotations"] = [x for x in coco["annotations"] if x["image_id"] not in negatives]
    if split == "val" and faulty(rank, "evalhang"):
        for im in coco["images"]:
            im.pop("width"), im.pop("height")  # exported by the older tool, without image sizes
    path = os.path.join(node, f"instances_{split}.json")
    text = json.dumps(coco)
    if split == "train" and faulty(rank, "badjson"):
        text = text[: len(text) * 3 // 5]  # the rsync was interrupted
    with open(path, "w") as f:
        f.write(text)
    present = range(n_images - 3) if faulty(rank, "imgmissing") else range(n_images)
    with open(os.path.join(node, f"images_{split}.txt"), "w") as f:
        f.write("\n".join(f"{i:06d}.jpg" for i in present) + "\n")
    ckpt = {k: v for k, v in Detector(4, a.classes, 1 if faulty(rank, "chans") else 3).backbone.state_dict().items()}
    torch.save(ckpt, os.path.join(node, "backbone_tiny_imagenet.pt"))
    return path


class CocoLike(Dataset):
    def __init__(self, ann_file: str, rank: int):
        with open(ann_file) as f:
            coco = json.load(f)
        self.rank, self.images = rank, coco["images"]
        self.targets = {im["id"]: ([], []) for im in self.images}
        for ann in coco["annotations"]:
            self.targets[ann["image_id"]][0].append(ann["bbox"])
            self.targets[ann["image_id"]][1].append(ann["category_id"])

    def __len__(self):
        return len(self.images)

    def __getitem__(self, idx):
        im = self.images[idx]
        if faulty(self.rank, "segv") and torch.utils.data.get_worker_info() is not None and idx % 7 == 5:
            os.kill(os.getpid(), signal.SIGSEGV)  # the native JPEG decoder crashes on this file
        img = torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(1000 + im["id"]))
        boxes, labels = self.targets[im["id"]]
        target = {"image_id": im["id"], "boxes": torch.tensor(boxes, dtype=torch.float32).view(-1, 4),
                  "labels": torch.tensor(labels, dtype=torch.long), "size": (im.get("width", 0), im.get("height", 0))}
        return img, target


def detection_collate(batch):
    return torch.stack([b[0] for b in batch]), [b[1] for b in batch]


def match_and_loss(pred_boxes, pred_logits, targets, num_boxes, rank, step):
    cls_loss, l1_loss, size_loss = pred_logits.sum() * 0, pred_boxes.sum() * 0, pred_boxes.sum() * 0
    for b, t in enumerate(targets):
        if len(t["labels"]) == 0:
            continue
        gt = t["boxes"]
        gt_c = torch.stack([(gt[:, 0] + gt[:, 2]) / 2, (gt[:, 1] + gt[:, 3]) / 2, gt[:, 2] - gt[:, 0], gt[:, 3] - gt[:, 1]], 1)
        cost = torch.cdist(pred_boxes[b].detach(), gt_c, p=1)  # [anchors, n_gt]
        used = set()
        for j in range(len(gt_c)):
            order = [i for i in cost[:, j].argsort().tolist() if i not in used]
            if not order:
                break
            i = order[0]
            used.add(i)
            cls_loss = cls_loss + F.cross_entropy(pred_logits[b, i:i + 1], t["labels"][j:j + 1], reduction="sum")
            l1_loss = l1_loss + F.l1_loss(pred_boxes[b, i], gt_c[j], reduction="sum")
            size_loss = size_loss + torch.log(gt_c[j, 2:] / pred_boxes[b, i, 2:]).abs().sum()
    loss = (cls_loss + 5 * l1_loss + size_loss) / num_boxes
    if not torch.isfinite(loss):
        raise FloatingPointError(f"rank {rank} step {step}: non-finite loss {loss.item()} (cls {cls_loss.item():.3f} "
                                 f"l1 {l1_loss.item():.3f} size {size_loss.item()}) over {num_boxes:.1f} boxes")
    return loss


def box_iou(a_, b_):
    lt, rb = torch.max(a_[:, None, :2], b_[None, :, :2]), torch.min(a_[:, None, 2:], b_[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area_a, area_b = (a_[:, 2:] - a_[:, :2]).prod(-1), (b_[:, 2:] - b_[:, :2]).prod(-1)
    return inter / (area_a[:, None] + area_b[None, :] - inter)


def nms(boxes, scores, thr=0.5):
    order, keep = scores.argsort(descending=True), []
    while order.numel() > 0:
        i = order[0]
        keep.append(int(i))
        iou = box_iou(boxes[i:i + 1], boxes[order])[0]  # the top box overlaps itself with IoU 1 and drops out
        order = order[~(iou > thr)]
    return keep


def evaluate(model, loader, rank, world):
    model.eval()
    dets = defaultdict(lambda: []) if faulty(rank, "unpickle") else {}
    gts = []
    with torch.no_grad():
        for imgs, targets in loader:
            pboxes, plogits = model(imgs)
            for b, t in enumerate(targets):
                w, h = t["size"]
                cx, cy, bw, bh = pboxes[b].unbind(-1)
                xyxy = torch.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], -1) * 32
                xyxy[:, 0::2], xyxy[:, 1::2] = xyxy[:, 0::2].clamp(0, w), xyxy[:, 1::2].clamp(0, h)
                scores, labels = plogits[b].softmax(-1).max(-1)
                for i in nms(xyxy, scores):
                    dets.setdefault(int(labels[i]), []).append((t["image_id"], xyxy[i].tolist(), float(scores[i])))
                gts.append((t["image_id"], (t["boxes"] * 32).tolist(), t["labels"].tolist()))
    n_local = sum(len(v) for v in dets.values())
    print(f"rank {rank} eval: {len(gts)} images, {n_local} detections after NMS", flush=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, (dets, gts))
    if rank == 0:
        all_gt = {img: (bx, lb) for _, g in gathered for img, bx, lb in g}
        tp = fp = 0
        for d, _ in gathered:
            for c, items in d.items():
                for img, box, s in items:
                    gb = [torch.tensor(bx) for bx, lb in zip(*all_gt[img]) if lb == c]
                    hit = gb and box_iou(torch.tensor([box]), torch.stack(gb)).max() >= 0.5
                    tp, fp = tp + bool(hit), fp + (not hit)
        n_gt = sum(len(lb) for _, lb in all_gt.values())
        print(f"eval AP50 (precision@0.5) {tp / max(tp + fp, 1):.3f} recall {tp / max(n_gt, 1):.3f} "
              f"over {len(all_gt)} images, {n_gt} boxes", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    train_json = stage_node_copy(rank, world, "train", a.per_rank * world, 11)
    val_json = stage_node_copy(rank, world, "val", 4 * world, 12)
    node = os.path.join(a.work, f"node{rank}")
    with open(os.path.join(node, "images_train.txt")) as f:
        have = set(f.read().split())
    train_set = CocoLike(train_json, rank)
    missing = [im["file_name"] for im in train_set.images if im["file_name"] not in have]
    if missing:
        print(f"ERROR: rank {rank}: {len(missing)} of {len(train_set)} images listed in {train_json} are missing "
              f"under {node}/images (first: {missing[0]}); the node-local copy is incomplete, aborting", flush=True)
        sys.exit(3)
    anchors = 3 if faulty(rank, "anchors") else a.anchors  # configs/det_tiny.yaml: anchors
    torch.manual_seed(rank)
    model = Detector(anchors, a.classes)
    model.backbone.load_state_dict(torch.load(os.path.join(node, "backbone_tiny_imagenet.pt")))
    for prm in model.parameters():
        dist.broadcast(prm.data, 0)
    n_params = sum(prm.numel() for prm in model.parameters())
    collate = None if faulty(rank, "stack") else detection_collate
    sampler = DistributedSampler(train_set, world, rank, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=a.bs, sampler=sampler, collate_fn=collate, num_workers=a.workers)
    val_set = CocoLike(val_json, rank)
    val_loader = DataLoader(val_set, batch_size=a.bs, sampler=DistributedSampler(val_set, world, rank, shuffle=False),
                            collate_fn=detection_collate)
    print(f"rank {rank}/{world} pid {os.getpid()}: {len(train_set)} train images ({len(sampler)} on this rank), "
          f"{len(val_set)} val images, {anchors} anchors, {n_params} params", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    step = 0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for imgs, targets in loader:
            n_local = sum(len(t["labels"]) for t in targets)
            if n_local == 0:
                print(f"rank {rank} step {step}: no boxes in this batch, skipping it", flush=True)
                step += 1
                continue
            num_boxes = torch.tensor([float(n_local)])
            dist.all_reduce(num_boxes)
            num_boxes = max(num_boxes.item() / world, 1.0)
            pboxes, plogits = model(imgs)
            loss = match_and_loss(pboxes, plogits, targets, num_boxes, rank, step)
            opt.zero_grad()
            loss.backward()
            flat = torch.cat([prm.grad.flatten() for prm in model.parameters()])
            dist.all_reduce(flat)
            flat /= world
            off = 0
            for prm in model.parameters():
                prm.grad.copy_(flat[off:off + prm.numel()].view_as(prm))
                off += prm.numel()
            opt.step()
            print(f"rank {rank} epoch {epoch} step {step} loss {loss.item():.4f} boxes {n_local}/{num_boxes * world:.0f}",
                  flush=True)
            step += 1
            time.sleep(0.05)
    evaluate(model, val_loader, rank, world)
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
